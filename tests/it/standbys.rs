//! Reads from hot standbys (`EXPORTD_READ_REPLICAS`): a full export's shards are read on a
//! standby once it has replayed past the export's watermark, feed pages once it has replayed
//! what the primary had when the window was there, with the bytes the primary would give; a
//! standby that lags is waited for a bounded time, then the primary reads.

use std::sync::Arc;
use std::time::Duration;

use exportd::jobs::WorkerDeps;
use exportd::replicas::Replicas;
use serde_json::{Value, json};
use sqlx::Executor;
use sqlx::postgres::PgPoolOptions;

use crate::common::replication::{Node, Replication};
use crate::common::{TestApp, sha256_hex};
use crate::feeds::seal;

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

/// A primary with a streaming standby, and the app on the primary.
async fn primary_and_standby() -> (Node, Node, TestApp) {
    let primary = Node::primary(Replication::Asynchronous);
    let standby = Node::standby_of(&primary);
    primary.connect("postgres").await.execute("CREATE DATABASE exportd").await.unwrap();
    let pool = PgPoolOptions::new().max_connections(8).connect(&primary.url("exportd")).await.unwrap();
    exportd::db::migrate(&pool).await.unwrap();
    let app = TestApp::spawn(pool).await;
    (primary, standby, app)
}

/// One test: the read counters are the process's, so the two scenarios must not overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_a_standby_give_the_primarys_bytes_even_while_it_lags() {
    exports_read_on_a_standby_hold_the_bytes_the_primary_would_give().await;
    feed_pages_read_on_a_standby_are_the_primarys_pages().await;
}

async fn exports_read_on_a_standby_hold_the_bytes_the_primary_would_give() {
    let (_primary, standby, app) = primary_and_standby().await;
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

/// Every page of the feed from `cursor` on the API at `base`: each page's changes.
async fn pages(app: &TestApp, base: &str, token: &str, cursor: &str) -> Vec<Vec<Value>> {
    let (mut cursor, mut pages) = (cursor.to_owned(), Vec::new());
    loop {
        let url = format!("{base}/v1/datasets/tickets/changes?limit=30&cursor={cursor}");
        let page = app.client.get(url).bearer_auth(token).send().await.unwrap();
        assert_eq!(page.status(), 200);
        let page: Value = page.json().await.unwrap();
        pages.push(page["changes"].as_array().unwrap().clone());
        cursor = page["next_cursor"].as_str().unwrap().to_owned();
        if page["end_of_stream"] == true {
            return pages;
        }
    }
}

async fn feed_pages_read_on_a_standby_are_the_primarys_pages() {
    let (_primary, standby, app) = primary_and_standby().await;
    let token = app.token("acme", "zenpartner"); // row-filtered: pages skip what it may not see
    let from = app.cursor_now(&token, "tickets").await;
    app.seed("acme", "tickets", 300).await;
    seal(&app).await;
    let on_standby = |wait| {
        let replicas = Arc::new(Replicas::connect(&standby.url("exportd"), 2, wait).unwrap());
        app.sibling_with(app.registry.clone(), move |state| state.replicas = replicas)
    };

    // The primary cuts the windows; a server with the standby reads them there.
    let expected = pages(&app, &app.url(""), &token, &from).await;
    let counts: Vec<usize> = expected.iter().map(Vec::len).collect();
    assert!(counts.len() > 2 && counts.iter().sum::<usize>() > 100, "several pages: {counts:?}");
    let base = on_standby(Duration::from_secs(30)).await;
    let before = reads(&app).await;
    assert_eq!(pages(&app, &base, &token, &from).await, expected);
    let after = reads(&app).await;
    assert!(after.0 - before.0 >= 1, "read on the standby");
    assert_eq!(after.1, before.1, "none on the primary");
    // So does an estimate's census.
    let admin = app.token("acme", "alice");
    let estimate = |base: String| {
        let request = app.client.post(format!("{base}/v1/exports/estimate")).bearer_auth(&admin);
        async move {
            let response = request.json(&json!({"dataset": "tickets", "format": "csv"})).send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()["rows"].clone()
        }
    };
    let before = reads(&app).await;
    assert_eq!(estimate(base.clone()).await, estimate(app.url("")).await);
    assert_eq!(estimate(app.url("")).await["value"], 300);
    assert_eq!(reads(&app).await.0, before.0 + 1, "the estimate read on the standby");

    // Windows cut while the standby stopped replaying: waited for, then read on the primary.
    standby.stop_receiving().await;
    app.seed("acme", "tickets", 400).await;
    seal(&app).await;
    let base = on_standby(Duration::from_millis(200)).await;
    let before = reads(&app).await;
    let lagging = pages(&app, &base, &token, &from).await;
    assert_eq!(lagging, pages(&app, &app.url(""), &token, &from).await, "the rows the standby does not have yet");
    assert!(lagging.iter().flatten().count() > expected.iter().flatten().count());
    let after = reads(&app).await;
    assert!(after.1 - before.1 >= 1, "read on the primary");
}
