//! One export written by several workers at once: the job's lease holder plans its next shard
//! open-ended and publishes, idle workers (any process) count the shards ahead of it and write
//! them under per-shard leases, and the result is byte for byte a one-worker run.

use crate::common::{TestApp, expire_lease, full_csv};
use exportd::jobs::{ClaimedExport, Outcome, Step, WorkerDeps, run_next_job};
use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::watch;

async fn manifest(app: &TestApp, token: &str, id: &str) -> Value {
    let response = app.get(Some(token), &format!("/v1/exports/{id}/manifest")).await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// Who wrote each checkpointed shard, in shard order.
async fn writers(app: &TestApp, id: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT written_by FROM export_shards WHERE export_id = $1::uuid ORDER BY shard_index")
        .bind(id)
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

/// Runs `coordinator` until its run ends; returns every step.
async fn run_to_end(coordinator: &mut ClaimedExport) -> Vec<Step> {
    let mut steps = Vec::new();
    loop {
        let step = coordinator.step().await.unwrap();
        steps.push(step.clone());
        if step.is_final() || step == Step::Waiting {
            return steps;
        }
    }
}

/// A reference export of 120 rows in 6 shards, written by one worker alone; returns its manifest.
async fn one_worker_reference(app: &TestApp, token: &str) -> Value {
    let id = app.export(token, &full_csv(20)).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    assert_eq!(writers(app, &id).await, vec!["test-worker"; 6]);
    manifest(app, token, &id).await
}

/// Shards planned so far, and whether the plan is complete.
async fn planned(app: &TestApp, id: &str) -> (i32, bool) {
    sqlx::query_as("SELECT planned_shards, plan_complete FROM export_jobs WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// A new export in shards of 20 rows, claimed by "w1", which wrote shard 0 — planned no further.
async fn started(app: &TestApp, token: &str) -> (String, WorkerDeps, ClaimedExport) {
    let id = app.export(token, &full_csv(20)).await;
    let deps = app.deps();
    let mut coordinator = ClaimedExport::claim(&deps, "w1").await.unwrap().unwrap();
    assert_eq!(coordinator.step().await.unwrap(), Step::ShardWritten { index: 0, rows: 20, last: false });
    assert_eq!(planned(app, &id).await, (1, false), "a worker alone counts nothing ahead");
    (id, deps, coordinator)
}

/// [`started`], then every shard counted and planned (as helpers would, one at a time).
async fn fully_planned(app: &TestApp, token: &str) -> (String, WorkerDeps, ClaimedExport) {
    let (id, deps, coordinator) = started(app, token).await;
    coordinator.plan_ahead().await.unwrap();
    assert_eq!(planned(app, &id).await, (6, true));
    (id, deps, coordinator)
}

/// A helper took the export's shards matching `which` and then stalled: their writer leases
/// are live for an hour, nothing is written.
async fn stall_writers(app: &TestApp, id: &str, which: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE export_shard_plan SET writer = 'ghost', writer_attempt = writer_attempt + 1,
                writer_expires_at = now() + interval '1 hour'
         WHERE export_id = $1::uuid AND {which}"
    )))
    .bind(id)
    .execute(&app.pool)
    .await
    .unwrap();
}

#[sqlx::test(migrations = "./migrations")]
async fn an_idle_worker_writes_shards_of_a_running_export_with_identical_bytes(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 120).await;
    let admin = app.token("acme", "alice");
    let reference = one_worker_reference(&app, &admin).await;

    let (id, deps, mut coordinator) = started(&app, &admin).await;

    // "w2" finds no job of its own to claim, so it helps: each run counts the next shard and
    // writes it.
    let (_keep, shutdown) = watch::channel(false);
    for shards in [2, 3] {
        assert_eq!(run_next_job(&deps, "w2", &shutdown).await.unwrap(), Outcome::Ran(Step::Yielded));
        assert_eq!(planned(&app, &id).await, (shards, false), "one shard counted per helper run");
    }
    // The coordinator goes on after the helped shards; the last is full, so an empty read ends it.
    let steps = run_to_end(&mut coordinator).await;
    assert_eq!(
        steps,
        vec![
            Step::ShardWritten { index: 3, rows: 20, last: false },
            Step::ShardWritten { index: 4, rows: 20, last: false },
            Step::ShardWritten { index: 5, rows: 20, last: false },
            Step::Published,
        ]
    );
    assert_eq!(writers(&app, &id).await, ["w1", "w2", "w2", "w1", "w1", "w1"]);
    let parallel = manifest(&app, &admin, &id).await;
    assert_eq!(parallel["shards"], reference["shards"], "the same shards, rows, keys and checksums");
    assert_eq!(parallel["file"]["sha256"], reference["file"]["sha256"]);
    let file = app.get(Some(&admin), &format!("/v1/exports/{id}/file")).await;
    assert_eq!(file.status(), 200);
    let bytes = file.bytes().await.unwrap();
    assert_eq!(Value::from(crate::common::sha256_hex(&bytes)), reference["file"]["sha256"]);
    let plan_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM export_shard_plan").fetch_one(&app.pool).await.unwrap();
    assert_eq!(plan_rows, 0, "publishing removes the plan");
}

#[sqlx::test(migrations = "./migrations")]
async fn the_export_waits_for_a_writer_that_holds_its_last_shard_and_takes_it_over_when_it_vanishes(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 120).await;
    let admin = app.token("acme", "alice");
    let reference = one_worker_reference(&app, &admin).await;

    let (id, deps, mut coordinator) = fully_planned(&app, &admin).await;
    stall_writers(&app, &id, "shard_index = 5").await;
    let steps = run_to_end(&mut coordinator).await;
    assert_eq!(steps.len(), 5);
    assert_eq!(steps[3], Step::ShardWritten { index: 4, rows: 20, last: false });
    assert_eq!(steps[4], Step::Waiting, "nothing is left for the coordinator to write or publish");
    coordinator.release().await.unwrap();

    // Nobody claims the job while the ghost's shard lease is live, and no helper takes the shard.
    assert!(ClaimedExport::claim(&deps, "w3").await.unwrap().is_none());
    let (_keep, shutdown) = watch::channel(false);
    assert_eq!(run_next_job(&deps, "w3", &shutdown).await.unwrap(), Outcome::Idle);
    assert_eq!(app.state(&id).await, "RUNNING");

    expire_lease(&app.pool, &id).await; // the ghost vanished
    let mut next = ClaimedExport::claim(&deps, "w3").await.unwrap().expect("claimable once the writer vanished");
    assert_eq!(
        run_to_end(&mut next).await,
        vec![Step::ShardWritten { index: 5, rows: 20, last: true }, Step::Published]
    );
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM export_jobs WHERE id = $1::uuid")
        .bind(&id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 1, "a clean hand-back between runs is not a new attempt");
    assert_eq!(manifest(&app, &admin, &id).await["shards"], reference["shards"]);
}

#[sqlx::test(migrations = "./migrations")]
async fn workers_racing_on_one_export_publish_it_once_with_every_shard_written_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 400).await;
    let admin = app.token("acme", "alice");
    let reference = app.export(&admin, &full_csv(20)).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let reference = manifest(&app, &admin, &reference).await;

    // A first run writes shard 0 and gives the job back; then four workers race: one claims
    // the job, the others count shards ahead of it and write them.
    let (id, deps, starter) = started(&app, &admin).await;
    starter.release().await.unwrap();
    let workers: Vec<_> = (0..4)
        .map(|n| {
            let deps = deps.clone();
            tokio::spawn(async move { exportd::jobs::drain(&deps, &format!("racer-{n}")).await.unwrap() })
        })
        .collect();
    let mut ends = Vec::new();
    for worker in workers {
        ends.extend(worker.await.unwrap());
    }
    assert_eq!(ends, vec![Step::Published], "one run publishes; the others only helped");
    let written: Vec<(i32, i32)> = sqlx::query_as(
        "SELECT shard_index, count(*)::int FROM export_shards WHERE export_id = $1::uuid GROUP BY 1 ORDER BY 1",
    )
    .bind(&id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(written, (0..20).map(|i| (i, 1)).collect::<Vec<_>>());
    let mut racers = writers(&app, &id).await;
    racers.sort();
    racers.dedup();
    assert!(racers.len() > 1, "shards were written by several workers: {racers:?}");
    let parallel = manifest(&app, &admin, &id).await;
    assert_eq!(parallel["shards"], reference["shards"]);
    assert_eq!(parallel["file"], reference["file"]);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_helper_writing_a_shard_counts_toward_the_tenants_running_exports(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 120).await;
    let admin = app.token("acme", "alice");
    // acme may run 2 exports at once (tenants/acme.toml): the first is held by a helper alone.
    let (held, deps, mut coordinator) = fully_planned(&app, &admin).await;
    stall_writers(&app, &held, "NOT done").await;
    assert_eq!(run_to_end(&mut coordinator).await, vec![Step::Waiting]);
    coordinator.release().await.unwrap();

    let second = app.export(&admin, &full_csv(20)).await;
    let third = app.export(&admin, &full_csv(20)).await;
    let run = ClaimedExport::claim(&deps, "w2").await.unwrap().expect("the second export starts");
    assert_eq!(run.lease().job_id.to_string(), second);
    // Two run: one by its helper alone, one by its coordinator. The third waits, and a worker
    // with nothing to claim finds nothing to help with either (the second is not planned yet).
    let (_keep, shutdown) = watch::channel(false);
    assert_eq!(run_next_job(&deps, "w3", &shutdown).await.unwrap(), Outcome::Idle);
    assert_eq!(app.state(&third).await, "QUEUED");

    // The helper vanished: its export needs a coordinator again and, the oldest, comes first.
    expire_lease(&app.pool, &held).await;
    let resumed = ClaimedExport::claim(&deps, "w3").await.unwrap().expect("the vanished helper's export is claimable");
    assert_eq!(resumed.lease().job_id.to_string(), held);
    assert!(ClaimedExport::claim(&deps, "w4").await.unwrap().is_none(), "and the third still waits");
    resumed.release().await.unwrap();
    run.release().await.unwrap();
}

#[sqlx::test(migrations = "./migrations")]
async fn a_helper_passes_over_an_export_at_its_row_limit_to_help_another(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("globex", "tickets", 1001).await;
    app.seed("acme", "tickets", 120).await;
    // globex may export 1000 rows (tenants/globex.toml): its second shard would cross the limit.
    let capped = app.export(&app.token("globex", "hank"), &full_csv(1000)).await;
    let deps = app.deps();
    let mut first = ClaimedExport::claim(&deps, "g").await.unwrap().unwrap();
    assert_eq!(first.lease().job_id.to_string(), capped);
    assert_eq!(first.step().await.unwrap(), Step::ShardWritten { index: 0, rows: 1000, last: false });
    let (open, _, _) = started(&app, &app.token("acme", "alice")).await;

    // globex was served first, so it comes first for helpers too; it has nothing to count.
    let (_keep, shutdown) = watch::channel(false);
    assert_eq!(run_next_job(&deps, "h", &shutdown).await.unwrap(), Outcome::Ran(Step::Yielded));
    assert_eq!(writers(&app, &open).await, ["w1", "h"]);
    assert_eq!(planned(&app, &capped).await, (1, false), "nothing was planned past the limit");
    assert_eq!(first.step().await.unwrap(), Step::Failed { code: "too-many-rows".into() });
}
