//! Reads from hot standbys (`EXPORTD_READ_REPLICAS`): a full export's shards are read on a
//! standby once it has replayed past the export's watermark, with the bytes the primary would
//! give; a standby that lags is waited for a bounded time, then the primary reads.

use std::sync::Arc;
use std::time::Duration;

use exportd::jobs::WorkerDeps;
use exportd::replicas::Replicas;
use serde_json::json;
use sqlx::Executor;
use sqlx::postgres::PgPoolOptions;

use crate::common::replication::{Node, Replication};
use crate::common::{TestApp, sha256_hex};

/// How many shard reads went where, from the process's metrics: (standby, primary because the
/// standbys lagged).
async fn reads(app: &TestApp) -> (u64, u64) {
    let page = app.get(None, "/metrics").await.text().await.unwrap();
    let count = |served: &str| {
        let line = format!("exportd_standby_reads_total{{served=\"{served}\"}} ");
        page.lines().find_map(|l| l.strip_prefix(&line)).map_or(0, |n| n.trim().parse().unwrap())
    };
    (count("standby"), count("primary_standbys_lagging"))
}

/// Runs every queued export with `deps`; returns the sha256 of each shard file of `id`.
async fn run_and_read(app: &TestApp, deps: &WorkerDeps, id: &str) -> Vec<String> {
    exportd::jobs::drain(deps, "standby-test").await.unwrap();
    let files = app.shard_files(id, &app.store).await;
    assert!(files.len() > 1, "several shards");
    files.iter().map(|f| sha256_hex(f)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_read_on_a_standby_hold_the_bytes_the_primary_would_give_even_while_it_lags() {
    let primary = Node::primary(Replication::Asynchronous);
    let standby = Node::standby_of(&primary);
    primary.connect("postgres").await.execute("CREATE DATABASE exportd").await.unwrap();
    let pool = PgPoolOptions::new().max_connections(8).connect(&primary.url("exportd")).await.unwrap();
    exportd::db::migrate(&pool).await.unwrap();
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 300).await;
    let token = app.token("acme", "alice");
    let body = json!({"dataset": "tickets", "format": "csv", "shard_rows": 100});
    let with_standby = |wait| WorkerDeps {
        replicas: Arc::new(Replicas::connect(&standby.url("exportd"), 2, wait).unwrap()),
        ..app.deps()
    };

    // The same rows read on the primary, then on the standby (waited for: it replays on its own).
    let on_primary = app.export(&token, &body).await;
    let expected = run_and_read(&app, &app.deps(), &on_primary).await;
    let before = reads(&app).await;
    let on_standby = app.export(&token, &body).await;
    assert_eq!(run_and_read(&app, &with_standby(Duration::from_secs(30)), &on_standby).await, expected);
    let after = reads(&app).await;
    // Each shard (and a look past the last one, when the plan does not know it is the last).
    assert!(after.0 - before.0 >= expected.len() as u64, "every shard read on the standby");
    assert_eq!(after.1, before.1, "none on the primary");

    // A standby that stopped replaying is waited for, then passed over: the primary reads.
    standby.stop_receiving().await;
    app.seed("acme", "tickets", 350).await;
    let fresh = app.export(&token, &body).await;
    let expected = run_and_read(&app, &app.deps(), &fresh).await;
    let before = reads(&app).await;
    let passed_over = app.export(&token, &body).await;
    let files = run_and_read(&app, &with_standby(Duration::from_millis(200)), &passed_over).await;
    assert_eq!(files, expected, "the rows the standby does not have yet");
    let after = reads(&app).await;
    assert!(after.1 - before.1 >= files.len() as u64, "every shard read on the primary");
    assert_eq!(after.0, before.0, "none on the standby");
}
