//! The fault campaign: `exportd worker` processes SIGKILLed at random and every database
//! connection terminated in bursts while exports run. Every export must succeed with the bytes
//! of an undisturbed run, no job may exhaust its attempts, PostgreSQL must detect no deadlock,
//! and no worker may exit unless signalled.
//!
//! The short form runs with the tests; `scripts/chaos` runs the long one (100 kills — a storm of
//! one every 2.5 s on average — and 5 bursts) in a release build and prints its figures. Both
//! stop by themselves.

use std::process::Child;
use std::time::{Duration, Instant};

use crate::common::TestApp;
use crate::common::processes::{
    self, deadlocks, spawn_worker, terminate, terminate_backends, wait_exit, wait_terminal,
};
use serde_json::json;
use sqlx::PgPool;

struct Campaign {
    processes: usize,
    kills: usize,
    bursts: usize,
    rows: u64,
    shard_rows: u32,
    /// Longest pause between two faults; each pause is random up to this.
    max_pause: Duration,
    lease_ttl: &'static str,
    /// Seeds the kill schedule (pauses, victims): printed, and replayed with `CHAOS_SEED`.
    seed: u64,
}

impl Campaign {
    /// Settings from `CHAOS_*` variables, falling back to `defaults`.
    fn from_env(defaults: Campaign) -> Campaign {
        let var = |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        Campaign {
            processes: var("CHAOS_PROCESSES", defaults.processes as u64) as usize,
            kills: var("CHAOS_KILLS", defaults.kills as u64) as usize,
            bursts: var("CHAOS_BURSTS", defaults.bursts as u64) as usize,
            rows: var("CHAOS_ROWS", defaults.rows),
            shard_rows: var("CHAOS_SHARD_ROWS", u64::from(defaults.shard_rows)) as u32,
            max_pause: Duration::from_millis(var("CHAOS_MAX_PAUSE_MS", defaults.max_pause.as_millis() as u64)),
            lease_ttl: defaults.lease_ttl,
            seed: var("CHAOS_SEED", defaults.seed),
        }
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn a_short_fault_campaign_loses_nothing(pool: PgPool) {
    let campaign = Campaign {
        processes: 3,
        kills: 10,
        bursts: 2,
        rows: 20_000,
        shard_rows: 400,
        max_pause: Duration::from_millis(1500),
        lease_ttl: "3s",
        seed: any_seed(),
    };
    run(pool, campaign).await;
}

#[sqlx::test(migrations = "./migrations")]
#[ignore = "minutes long: scripts/chaos runs it"]
async fn the_full_fault_campaign_loses_nothing(pool: PgPool) {
    let defaults = Campaign {
        processes: 3,
        kills: 100,
        bursts: 5,
        rows: 100_000,
        shard_rows: 2_000,
        max_pause: Duration::from_millis(5000),
        lease_ttl: "5s",
        seed: any_seed(),
    };
    run(pool, Campaign::from_env(defaults)).await;
}

/// A fresh seed for a campaign that is not replaying one.
fn any_seed() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

async fn run(pool: PgPool, campaign: Campaign) {
    use rand::{Rng, SeedableRng};
    println!("fault campaign: seed {} (CHAOS_SEED={0} replays its kill schedule)", campaign.seed);
    let mut schedule = rand::rngs::StdRng::seed_from_u64(campaign.seed);
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", campaign.rows).await;
    let admin = app.token("acme", "alice");
    let request = json!({"dataset": "tickets", "format": "csv", "shard_rows": campaign.shard_rows});

    // The undisturbed run: one worker in this process, no faults.
    let reference_id = app.export(&admin, &request).await;
    let undisturbed = Instant::now();
    app.drain().await;
    let undisturbed = undisturbed.elapsed();
    let reference = file_sha256(&app.pool, &reference_id).await;

    let url = processes::database_url(&app.pool).await;
    let log = app.data_dir.path().join("workers.log");
    let spawn = || spawn_worker(&url, app.data_dir.path(), &log, 2, campaign.lease_ttl);
    let mut workers: Vec<Child> = (0..campaign.processes).map(|_| spawn()).collect();
    // A worker that exited without being signalled is counted and started again.
    let exited_by_themselves = |workers: &mut Vec<Child>| {
        let mut exited = 0;
        for worker in workers.iter_mut() {
            if worker.try_wait().unwrap().is_some() {
                exited += 1;
                *worker = spawn();
            }
        }
        exited
    };

    let started = Instant::now();
    let mut exports = Vec::new();
    let (mut kills, mut bursts, mut terminated, mut unprompted_exits) = (0, 0, 0, 0);
    let burst_every = campaign.kills / campaign.bursts.max(1);
    while kills < campaign.kills {
        // Keep work in flight, so every fault lands on a busy cluster.
        while in_flight(&app.pool).await < 2 * campaign.processes as i64 {
            exports.push(create_export(&app, &admin, &request).await);
        }
        tokio::time::sleep(Duration::from_millis(
            schedule.random_range(0..campaign.max_pause.as_millis() as u64 + 1) + 1,
        ))
        .await;
        unprompted_exits += exited_by_themselves(&mut workers);
        let victim = schedule.random_range(0..workers.len());
        workers[victim].kill().unwrap(); // SIGKILL
        workers[victim].wait().unwrap();
        workers[victim] = spawn();
        kills += 1;
        if bursts < campaign.bursts && kills % burst_every.max(1) == 0 {
            for _ in 0..3 {
                terminated += terminate_backends(&app.pool).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            bursts += 1;
        }
    }
    let last_fault = Instant::now();
    let mut states = Vec::new();
    for id in &exports {
        states.push(wait_terminal(&app.pool, id, Duration::from_secs(300)).await);
    }
    let settled = last_fault.elapsed();
    unprompted_exits += exited_by_themselves(&mut workers);

    let (succeeded, exhausted, takeovers, attempts): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'SUCCEEDED'), count(*) FILTER (WHERE error_code = 'attempts-exhausted'),
                coalesce(sum(attempts - 1), 0)::bigint, coalesce(sum(attempts), 0)::bigint
         FROM export_jobs WHERE id <> $1::uuid",
    )
    .bind(&reference_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let mut identical = 0;
    for id in &exports {
        if file_sha256(&app.pool, id).await == reference {
            identical += 1;
        }
    }
    for worker in &workers {
        terminate(worker);
    }
    let mut clean_exits = 0;
    for worker in &mut workers {
        if wait_exit(worker, Duration::from_secs(25)).await.is_some_and(|s| s.success()) {
            clean_exits += 1;
        }
    }
    let deadlocks = deadlocks(&app.pool).await;
    println!(
        "fault campaign: {} worker processes x 2, {kills} SIGKILLs, {bursts} termination bursts ({terminated} backends) \
         over {:.1} s; exports {} finished / {} failed ({} attempts-exhausted), {takeovers} takeovers, {attempts} attempts, \
         {identical}/{} byte-identical to the undisturbed run ({:.1} s); settled {:.1} s after the last fault; \
         {deadlocks} deadlocks; {unprompted_exits} unprompted worker exits; {clean_exits}/{} clean exits on SIGTERM",
        campaign.processes,
        last_fault.duration_since(started).as_secs_f64(),
        succeeded,
        states.iter().filter(|s| *s != "SUCCEEDED").count(),
        exhausted,
        exports.len(),
        undisturbed.as_secs_f64(),
        settled.as_secs_f64(),
        workers.len(),
    );
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(succeeded as usize, exports.len(), "every export succeeded; states {states:?}\n{log}");
    assert_eq!(identical, exports.len(), "every file is byte-identical to the undisturbed run");
    assert_eq!(exhausted, 0);
    assert_eq!(deadlocks, 0, "PostgreSQL detected no deadlock");
    assert_eq!(unprompted_exits, 0, "no worker exited unless signalled\n{log}");
    assert_eq!(clean_exits, workers.len(), "every worker exited 0 on SIGTERM\n{log}");
}

async fn in_flight(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM export_jobs WHERE state IN ('QUEUED', 'RUNNING', 'CANCEL_REQUESTED')")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Creates an export as a client would during faults: a 503 is retried with the same key.
async fn create_export(app: &TestApp, token: &str, request: &serde_json::Value) -> String {
    let key = uuid::Uuid::new_v4().to_string();
    for _ in 0..50 {
        let response = app.create_export(token, Some(&key), request).await;
        match response.status().as_u16() {
            200 | 202 => return response.json::<serde_json::Value>().await.unwrap()["id"].as_str().unwrap().to_owned(),
            503 => tokio::time::sleep(Duration::from_millis(200)).await,
            other => panic!("creating an export: {other} {}", response.text().await.unwrap()),
        }
    }
    panic!("the API kept answering 503");
}

async fn file_sha256(pool: &PgPool, id: &str) -> Option<String> {
    sqlx::query_scalar("SELECT file_sha256 FROM export_jobs WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}
