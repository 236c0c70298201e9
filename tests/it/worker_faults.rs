//! Workers under faults: crashes with and without progress, a connection terminated mid-job,
//! claims and checkpoints of several tenants racing, ingest batches that deadlock, and
//! `exportd worker` as a long-running process.

use std::time::{Duration, Instant};

use crate::common::processes::{self, deadlocks, spawn_worker, terminate, wait_exit, wait_terminal};
use crate::common::{TestApp, expire_lease, expire_lease_by, full_csv};
use exportd::jobs::{ClaimedExport, Step, WorkerConfig};
use serde_json::{Value, json};
use sqlx::{Connection, PgPool};

/// State, attempts, stalled attempts and failure code of a job.
async fn job(pool: &PgPool, id: &str) -> (String, i32, i32, Option<String>) {
    sqlx::query_as("SELECT state, attempts, stalled_attempts, error_code FROM export_jobs WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_job_that_progresses_between_crashes_never_exhausts_its_attempts(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 100).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(10)).await;
    let deps = app.deps();
    // Eight crashes, more than max_attempts (5), each after one new checkpoint.
    for crash in 0..8 {
        let mut doomed = ClaimedExport::claim(&deps, "doomed").await.unwrap().unwrap();
        loop {
            match doomed.step().await.unwrap() {
                Step::ShardVerified { .. } => continue,
                Step::ShardWritten { index, .. } => {
                    assert_eq!(index, crash);
                    break;
                }
                other => panic!("unexpected step {other:?}"),
            }
        }
        drop(doomed); // the process died with the lease held
        expire_lease(&app.pool, &id).await;
    }
    assert_eq!(app.drain().await, vec![Step::Published]);
    let (state, attempts, stalled, _) = job(&app.pool, &id).await;
    assert_eq!((state.as_str(), attempts, stalled), ("SUCCEEDED", 9, 1));
}

/// Workers killed again and again before a checkpoint (a kill storm) do not fail an export:
/// many stalls in a short time are not a poison export.
#[sqlx::test(migrations = "./migrations")]
async fn many_quick_stalls_do_not_fail_an_export(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 30).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(10)).await;
    let deps = app.deps();
    for _ in 0..8 {
        drop(ClaimedExport::claim(&deps, "doomed").await.unwrap().unwrap()); // killed at once
        expire_lease(&app.pool, &id).await;
    }
    assert_eq!(app.drain().await, vec![Step::Published]);
    let (state, attempts, _, _) = job(&app.pool, &id).await;
    assert_eq!((state.as_str(), attempts), ("SUCCEEDED", 9));
}

/// An export that kills every worker taking it: after the second stall in a row the next claim
/// waits (a sixth of the lease, doubling), and once more than `max_attempts` stalls went on for
/// `give_up_after` it fails `attempts-exhausted`. A crash with progress starts the count again.
#[sqlx::test(migrations = "./migrations")]
async fn an_export_that_keeps_killing_its_workers_fails_after_the_give_up_time(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 30).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(10)).await;
    let deps = app.deps(); // 30 s leases: the first wait is 5 s
    let mut first = ClaimedExport::claim(&deps, "doomed").await.unwrap().unwrap();
    assert!(matches!(first.step().await.unwrap(), Step::ShardWritten { index: 0, .. }));
    drop(first);
    for stalled in 1..=5 {
        expire_lease(&app.pool, &id).await;
        drop(ClaimedExport::claim(&deps, "doomed").await.unwrap().unwrap());
        if stalled == 2 {
            // Its lease ran out a second ago: too soon after two stalls in a row.
            expire_lease_by(&app.pool, &id, "1 second").await;
            assert!(ClaimedExport::claim(&deps, "eager").await.unwrap().is_none(), "the claim waits");
        }
    }
    expire_lease(&app.pool, &id).await;
    // A sixth stall in a row, given back after an error (which counts too).
    let sixth = ClaimedExport::claim(&deps, "doomed").await.unwrap().unwrap();
    let (_, _, stalled, _) = job(&app.pool, &id).await;
    assert_eq!(stalled, 6);
    sixth.give_back(false).await.unwrap();
    // They went on for more than `give_up_after` (10 minutes by default).
    sqlx::query("UPDATE export_jobs SET stalled_since = now() - interval '601 seconds' WHERE id = $1::uuid")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();
    expire_lease(&app.pool, &id).await;
    assert_eq!(app.drain().await, vec![Step::Failed { code: "attempts-exhausted".into() }]);
    let (state, _, stalled, code) = job(&app.pool, &id).await;
    assert_eq!((state.as_str(), stalled, code.as_deref()), ("FAILED", 7, Some("attempts-exhausted")));
    let detail: String = sqlx::query_scalar("SELECT error_detail FROM export_jobs WHERE id = $1::uuid")
        .bind(&id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(detail.contains("6 attempts in a row without a new checkpoint, over 10m"), "{detail}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_connection_terminated_mid_job_is_retried_in_place_without_using_an_attempt(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 50).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(10)).await;
    let deps = app.deps();
    let mut run = ClaimedExport::claim(&deps, "survivor").await.unwrap().unwrap();
    assert!(matches!(run.step().await.unwrap(), Step::ShardWritten { index: 0, .. }));

    // Hold the job's row, so the worker's next statement (its heartbeat) waits on us; then cut
    // the worker's connection while it waits, as a failover or network blip would.
    let mut holder = app.pool.begin().await.unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *holder).await.unwrap();
    sqlx::query("SELECT 1 FROM export_jobs WHERE id = $1::uuid FOR UPDATE")
        .bind(&id)
        .execute(&mut *holder)
        .await
        .unwrap();
    let stepping = tokio::spawn(async move { (run.step_with_retries().await, run) });
    let waiting = wait_for_backend_blocked_by(&app.pool, holder_pid).await;
    let terminated: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(waiting).fetch_one(&app.pool).await.unwrap();
    assert!(terminated);
    holder.rollback().await.unwrap();

    let (step, mut run) = stepping.await.unwrap();
    assert_eq!(step.unwrap(), Step::ShardWritten { index: 1, rows: 10, last: false });
    while !run.step_with_retries().await.unwrap().is_final() {}
    let (state, attempts, _, _) = job(&app.pool, &id).await;
    assert_eq!((state.as_str(), attempts), ("SUCCEEDED", 1), "the blip cost no attempt and no takeover");
}

/// The backend waiting on a lock that `holder` holds.
async fn wait_for_backend_blocked_by(pool: &PgPool, holder: i32) -> i32 {
    for _ in 0..1000 {
        let blocked: Option<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1")
                .bind(holder)
                .fetch_optional(pool)
                .await
                .unwrap();
        if let Some(pid) = blocked {
            return pid;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("no backend blocked on {holder} within 5 s");
}

#[sqlx::test(migrations = "./migrations")]
async fn claims_and_checkpoints_of_several_tenants_never_deadlock(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 300).await;
    app.seed("globex", "tickets", 300).await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(app.export(&app.token("acme", "alice"), &full_csv(10)).await);
        ids.push(app.export(&app.token("globex", "hank"), &full_csv(10)).await);
    }
    // Six workers, short leases (some expire under load and are taken over), a yield after every
    // shard: about 300 checkpoints racing about 300 claims across two tenants.
    let deps = exportd::jobs::WorkerDeps {
        config: WorkerConfig { lease_ttl: Duration::from_millis(1500), page_rows: 5, ..WorkerConfig::default() },
        ..app.deps()
    };
    let workers: Vec<_> = (0..6)
        .map(|n| {
            let deps = deps.clone();
            tokio::spawn(async move { exportd::jobs::drain(&deps, &format!("racer-{n}")).await })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap().expect("no worker run failed");
    }
    for id in &ids {
        let (state, _, _, code) = job(&app.pool, id).await;
        assert_eq!((state.as_str(), code), ("SUCCEEDED", None));
    }
    let rows: Vec<i64> =
        sqlx::query_scalar("SELECT rows_done FROM export_jobs ORDER BY id").fetch_all(&app.pool).await.unwrap();
    assert_eq!(rows, vec![300; 10]);
    assert_eq!(deadlocks(&app.pool).await, 0, "PostgreSQL detected no deadlock");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_ingest_batch_that_deadlocks_with_a_host_transaction_still_succeeds(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let mut host = sqlx::PgConnection::connect_with(&app.pool.connect_options()).await.unwrap();
    let host_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut host).await.unwrap();
    sqlx::query("BEGIN").execute(&mut host).await.unwrap();
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', 'k2', '{\"subject\": \"host\", \"status\": \"open\"}')")
        .execute(&mut host)
        .await
        .unwrap();

    let batch = json!([
        {"key": "k1", "data": {"subject": "batch", "status": "open"}},
        {"key": "k2", "data": {"subject": "batch", "status": "open"}},
    ]);
    let client = app.client.clone();
    let url = app.url("/v1/datasets/tickets/records");
    let admin_for_batch = admin.clone();
    let posting =
        tokio::spawn(async move { client.post(url).bearer_auth(admin_for_batch).json(&batch).send().await.unwrap() });
    // The batch holds k1 and waits for k2; the host now asks for k1: a deadlock.
    wait_for_backend_blocked_by(&app.pool, host_pid).await;
    let host_k1 =
        sqlx::query("SELECT exportd_upsert('acme', 'tickets', 'k1', '{\"subject\": \"host\", \"status\": \"open\"}')")
            .execute(&mut host)
            .await;
    // PostgreSQL aborts one side: usually the batch (it waited first), which runs again and waits
    // for the host to commit; if the host is the victim it rolls back and the batch goes on.
    let host_end = if host_k1.is_ok() { "COMMIT" } else { "ROLLBACK" };
    sqlx::query(host_end).execute(&mut host).await.unwrap();

    let response = posting.await.unwrap();
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let subjects: Vec<String> = sqlx::query_scalar(
        "SELECT data->>'subject' FROM record_versions WHERE tenant = 'acme' AND closed_xid IS NULL ORDER BY key",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(subjects, vec!["batch", "batch"], "the batch committed last, whole");
}

#[sqlx::test(migrations = "./migrations")]
async fn concurrent_batches_over_the_same_keys_in_opposite_orders_all_succeed(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let keys: Vec<String> = (0..300).map(|i| format!("k{i:03}")).collect();
    let batches: Vec<_> = (0..8)
        .map(|n| {
            let mut order = keys.clone();
            if n % 2 == 1 {
                order.reverse();
            }
            order.rotate_left(n * 37);
            let body: Vec<Value> = order
                .iter()
                .map(|k| json!({"key": k, "data": {"subject": format!("b{n}"), "status": "open"}}))
                .collect();
            let (client, url, admin) = (app.client.clone(), app.url("/v1/datasets/tickets/records"), admin.clone());
            tokio::spawn(async move { client.post(url).bearer_auth(admin).json(&body).send().await.unwrap().status() })
        })
        .collect();
    for batch in batches {
        assert_eq!(batch.await.unwrap(), 200);
    }
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM record_versions WHERE closed_xid IS NULL")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(live, 300);
    assert_eq!(deadlocks(&app.pool).await, 0);
}

/// How long the long-running worker test keeps the process (default 45 s: more than twice the
/// 20 s after which `exportd worker` used to exit by itself). `scripts/chaos` runs for minutes.
fn worker_test_duration() -> Duration {
    let seconds = std::env::var("EXPORTD_TEST_WORKER_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(45);
    Duration::from_secs(seconds)
}

#[sqlx::test(migrations = "./migrations")]
async fn exportd_worker_keeps_serving_until_sigterm_then_exits_cleanly(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 40).await;
    let admin = app.token("acme", "alice");
    let url = processes::database_url(&app.pool).await;
    let log = app.data_dir.path().join("worker.log");
    let mut worker = spawn_worker(&url, app.data_dir.path(), &log, 2, "30s");
    let started = Instant::now();
    let mut served = 0;
    while started.elapsed() < worker_test_duration() {
        let id = app.export(&admin, &full_csv(10)).await;
        assert_eq!(wait_terminal(&app.pool, &id, Duration::from_secs(60)).await, "SUCCEEDED");
        served += 1;
        assert!(
            worker.try_wait().unwrap().is_none(),
            "the worker exited by itself: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    let id = app.export(&admin, &full_csv(10)).await;
    assert_eq!(wait_terminal(&app.pool, &id, Duration::from_secs(60)).await, "SUCCEEDED");
    assert!(worker.try_wait().unwrap().is_none(), "still up after {:?}", started.elapsed());
    assert!(served >= 4);

    terminate(&worker);
    let status = wait_exit(&mut worker, Duration::from_secs(25)).await.expect("exits after SIGTERM");
    assert!(status.success(), "exit status {status}: {}", std::fs::read_to_string(&log).unwrap());
}

#[sqlx::test(migrations = "./migrations")]
async fn a_record_the_encoder_refuses_fails_the_export_at_once_with_a_clear_code(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 5).await;
    // Written around the write functions (an older release had no depth limit): 200 levels deep.
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    sqlx::query(
        "INSERT INTO record_versions (tenant, dataset, key, data)
         VALUES ('acme', 'tickets', 'poison', jsonb_build_object('subject', 's', 'status', 'open', 'tags', $1::text::jsonb))",
    )
    .bind(&deep)
    .execute(&app.pool)
    .await
    .unwrap();
    let id = app.export(&app.token("acme", "alice"), &full_csv(100)).await;
    assert_eq!(app.drain().await, vec![Step::Failed { code: "unencodable-record".into() }]);
    let (state, attempts, _, _) = job(&app.pool, &id).await;
    assert_eq!((state.as_str(), attempts), ("FAILED", 1), "no retries, no attempts burnt");
}
