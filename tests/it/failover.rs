//! Database failover: exportd follows a primary that moves (a TCP forwarder of the test's own
//! stands in for the virtual address) and never serves a position from history the new
//! primary does not have. Each test runs a private primary and a streaming standby.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::Executor;
use sqlx::postgres::PgPoolOptions;

use exportd::jobs::{Outcome, Step, WorkerConfig, WorkerDeps};

use crate::common::processes::Server;
use crate::common::proxy::OutageProxy;
use crate::common::replication::{Node, Replication};
use crate::common::{TestApp, problem};
use crate::feeds::{apply, committed_state, delete, seal, upsert};

/// A primary (replicating as `replication`) with a standby, the exportd database on it, and the
/// in-process app over the forwarder in front of the primary.
struct Deployment {
    primary: Node,
    standby: Node,
    address: OutageProxy,
    app: TestApp,
}

impl Deployment {
    async fn start(replication: Replication) -> Deployment {
        let primary = Node::primary(replication);
        // A synchronous primary's commits wait for the standby: it comes first.
        let standby = Node::standby_of(&primary);
        primary.connect("postgres").await.execute("CREATE DATABASE exportd").await.unwrap();
        let address = OutageProxy::start(primary.addr()).await;
        // A short acquire timeout: requests during the switch fail fast instead of queueing.
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(3))
            .connect(&format!("postgres://postgres@{}/exportd", address.addr))
            .await
            .unwrap();
        exportd::db::migrate(&pool).await.unwrap();
        let app = TestApp::spawn(pool).await;
        Deployment { primary, standby, address, app }
    }

    fn url(&self) -> String {
        format!("postgres://postgres@{}/exportd", self.address.addr)
    }

    /// The primary dies; the standby is promoted; the address moves to it.
    async fn fail_over(&self) {
        self.primary.kill();
        self.standby.promote().await;
        self.standby.stop_waiting_for_standbys().await;
        self.address.move_to(self.standby.addr());
    }

    async fn write(&self, keys: std::ops::Range<u32>, subject: &str) {
        let mut conn = self.app.pool.acquire().await.unwrap();
        for i in keys {
            upsert(&mut conn, &format!("k{i:03}"), subject, "emea").await;
        }
    }

    async fn delete(&self, keys: std::ops::Range<u32>) {
        let mut conn = self.app.pool.acquire().await.unwrap();
        for i in keys {
            delete(&mut conn, &format!("k{i:03}")).await;
        }
    }
}

async fn changes_at(app: &TestApp, token: &str, cursor: &str) -> reqwest::Response {
    app.get(Some(token), &format!("/v1/datasets/tickets/changes?limit=100&cursor={cursor}")).await
}

/// Creates a full export, runs it, and returns its id and manifest.
async fn exported(app: &TestApp, token: &str) -> (String, Value) {
    let id = app.export(token, &json!({"dataset": "tickets", "format": "csv"})).await;
    app.drain().await;
    let manifest = manifest_of(app, token, &id).await;
    (id, manifest)
}

async fn manifest_of(app: &TestApp, token: &str, id: &str) -> Value {
    let manifest = app.get(Some(token), &format!("/v1/exports/{id}/manifest")).await;
    assert_eq!(manifest.status(), 200);
    manifest.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_failover_refuses_every_position_that_saw_lost_commits_and_serves_the_rest_exactly() {
    let ha = Deployment::start(Replication::Asynchronous).await;
    let app = &ha.app;
    // A partner with a row filter (every record written here matches it).
    let token = app.token("acme", "zenpartner");
    let data_dir = tempfile::tempdir().unwrap();
    let server = Server::start_on(&ha.url(), data_dir.path(), "0", None, |_| {}).await;

    // History the standby receives: 40 records, a partner's copy of them, a published export.
    let start = app.cursor_now(&token, "tickets").await;
    ha.write(0..40, "kept").await;
    seal(app).await;
    let (first, kept_cursor) = app.pull_all(&token, "tickets", &start, 100).await;
    assert_eq!(first.len(), 40);
    let (kept_export, kept_manifest) = exported(app, &token).await;
    // An export the standby knows as queued, and never learns ran.
    let running = app.export(&token, &json!({"dataset": "tickets", "format": "csv"})).await;
    ha.standby.catch_up_with(&ha.primary).await;

    // History it never receives: changes (answered as committed), a partner that pulls them,
    // an export that publishes them.
    ha.standby.stop_receiving().await;
    ha.write(30..60, "lost").await;
    ha.delete(0..5).await;
    seal(app).await;
    let (lost, lost_cursor) = app.pull_all(&token, "tickets", &kept_cursor, 100).await;
    assert_eq!(lost.len(), 35, "the partner saw the commits that will be lost");
    let (lost_export, lost_manifest) = exported(app, &token).await;
    let first_run = manifest_of(app, &token, &running).await;

    ha.primary.kill();
    // Requests while no primary answers fail, and say why.
    let health = reqwest::get(format!("{}/healthz", server.base)).await.unwrap();
    assert_eq!(health.status(), 503, "no primary answers");
    assert_eq!(problem(health).await["database"], "failing over");
    ha.standby.promote().await;
    ha.address.move_to(ha.standby.addr());

    // The new primary hands the lost transaction ids out again.
    ha.write(40..70, "new").await;
    ha.delete(10..12).await;
    seal(app).await;

    // Everything that saw the lost commits is refused, naming the failover.
    let lost_handoff = lost_manifest["next_cursor"].as_str().unwrap();
    for (what, cursor) in [("feed cursor", lost_cursor.as_str()), ("lost export's next_cursor", lost_handoff)] {
        let refused = changes_at(app, &token, cursor).await;
        assert_eq!(refused.status(), 410, "{what}");
        let refused = problem(refused).await;
        assert_eq!(refused["code"], "cursor-lost-in-failover", "{what}: {refused}");
        assert!(refused["detail"].as_str().unwrap().contains("Run a full export"), "{refused}");
    }
    let since = json!({"dataset": "tickets", "format": "csv", "mode": "incremental", "since": lost_cursor});
    let refused = app.create_export(&token, Some("after-failover"), &since).await;
    assert_eq!(problem(refused).await["code"], "cursor-lost-in-failover", "an incremental export from it");
    let gone = app.get(Some(&token), &format!("/v1/exports/{lost_export}")).await;
    assert_eq!(gone.status(), 404, "the lost export does not exist on the new primary");

    // The admin is told: one event per partner and dataset, refusals counted, the feed marked
    // until the partner reads again.
    let pool = &app.pool;
    let (refusals, timeline): (i64, i32) =
        sqlx::query_as("SELECT refusals, timeline FROM failover_refusals WHERE principal = 'zenpartner'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!((refusals, timeline), (3, 2));
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events WHERE type = 'feed.history_lost'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(events, 1);
    let admin = app.token("acme", "alice");
    let dashboard = app.client.get(app.url("/dashboard")).bearer_auth(&admin).send().await.unwrap();
    let page = dashboard.text().await.unwrap();
    assert!(page.contains(r#"data-history-lost="2""#), "the partner's feed is shown as refused");

    // What did not see them goes on exactly: the copy a partner kept converges on what exists.
    let mut copy = BTreeMap::new();
    apply(&mut copy, &first);
    let (after, _) = app.pull_all(&token, "tickets", &kept_cursor, 100).await;
    apply(&mut copy, &after);
    let existing = committed_state(&app.pool).await;
    assert_eq!(copy, existing, "no change missed or invented");
    assert_eq!(existing.len(), 70 - 2);
    assert!(existing.values().all(|data| data["subject"] != "lost"));
    let (_, kept_again) = exported(app, &token).await;
    assert_ne!(kept_again["next_cursor"], kept_manifest["next_cursor"]);
    let from_kept_export = changes_at(app, &token, kept_manifest["next_cursor"].as_str().unwrap()).await;
    assert_eq!(from_kept_export.status(), 200, "the export published before the loss hands off");
    let kept_status = app.get(Some(&token), &format!("/v1/exports/{kept_export}")).await;
    assert_eq!(kept_status.status(), 200);
    // The export whose run was lost runs again from its watermark: the same files.
    app.drain().await;
    let second_run = manifest_of(app, &token, &running).await;
    for field in ["total_rows", "next_cursor"] {
        assert_eq!(second_run[field], first_run[field], "{field}");
    }
    let digests = |m: &Value| m["shards"].as_array().unwrap().iter().map(|s| s["sha256"].clone()).collect::<Vec<_>>();
    assert_eq!(digests(&second_run), digests(&first_run));

    let health: Value = reqwest::get(format!("{}/healthz", server.base)).await.unwrap().json().await.unwrap();
    assert_eq!((&health["database"], &health["timeline"]), (&json!("ok"), &json!(2)), "{health}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_failover_loses_nothing_and_refuses_nothing() {
    let ha = Deployment::start(Replication::Synchronous).await;
    let app = &ha.app;
    let token = app.token("acme", "alice");

    let start = app.cursor_now(&token, "tickets").await;
    ha.write(0..40, "first").await;
    seal(app).await;
    let (first, cursor) = app.pull_all(&token, "tickets", &start, 100).await;
    ha.write(20..50, "second").await;
    ha.delete(0..3).await;
    seal(app).await;
    let (second, latest) = app.pull_all(&token, "tickets", &cursor, 100).await;
    let (_, manifest) = exported(app, &token).await;

    // An export two shards into its run when the primary dies (a worker that yields after
    // every shard), and a writer that keeps writing through the switch (other rows: `apac`).
    let body = json!({"dataset": "tickets", "format": "csv", "shard_rows": 10, "filter": {"region": "emea"}});
    let interrupted = app.export(&token, &body).await;
    let one_shard_at_a_time =
        WorkerDeps { config: WorkerConfig { yield_between_shards: true, ..WorkerConfig::default() }, ..app.deps() };
    let (_, never) = tokio::sync::watch::channel(false);
    for _ in 0..2 {
        let ran = exportd::jobs::run_next_job(&one_shard_at_a_time, "before-the-switch", &never).await.unwrap();
        assert_eq!(ran, Outcome::Ran(Step::Yielded));
    }
    let writer = tokio::spawn(keep_writing(app.pool.clone(), 150));
    ha.fail_over().await;
    let acknowledged = writer.await.unwrap();
    assert!(!acknowledged.is_empty());

    // The export finishes with the bytes of one run undisturbed at the same snapshot.
    app.drain().await;
    let undisturbed = app.export(&token, &body).await;
    app.drain().await;
    let (finished, reference) = (shard_digests(app, &interrupted).await, shard_digests(app, &undisturbed).await);
    assert!(finished.len() > 2);
    assert_eq!(finished, reference, "byte-identical across the switch");

    ha.write(45..60, "third").await;
    seal(app).await;
    let existing = committed_state(&app.pool).await;
    for key in &acknowledged {
        assert!(existing.contains_key(key), "{key} was acknowledged: synchronous replication kept it");
    }
    let mut copy = BTreeMap::new();
    apply(&mut copy, &first);
    apply(&mut copy, &second);
    let (third, _) = app.pull_all(&token, "tickets", &latest, 100).await;
    apply(&mut copy, &third);
    assert_eq!(copy, existing, "exact across the switch");
    for cursor in [&cursor, manifest["next_cursor"].as_str().unwrap()] {
        assert_eq!(changes_at(app, &token, cursor).await.status(), 200, "nothing was lost: nothing is refused");
    }
    let refusals: i64 =
        sqlx::query_scalar("SELECT count(*) FROM failover_refusals").fetch_one(&app.pool).await.unwrap();
    assert_eq!(refusals, 0);
}

/// A full Parquet export of the whole dataset (the next table version of `token`'s share);
/// returns the table's latest version after it.
async fn publish_table_version(app: &TestApp, token: &str) -> i64 {
    app.export(token, &json!({"dataset": "tickets", "format": "parquet"})).await;
    app.drain().await;
    let version = app.get(Some(token), &format!("{TABLE}/version")).await;
    assert_eq!(version.status(), 200);
    version.headers()["delta-table-version"].to_str().unwrap().parse().unwrap()
}

const TABLE: &str = "/delta-sharing/shares/zenpartner/schemas/acme/tables/tickets";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_version_published_by_lost_history_is_refused_and_its_number_never_given_again() {
    let ha = Deployment::start(Replication::Asynchronous).await;
    let app = &ha.app;
    let token = app.token("acme", "zenpartner");
    ha.write(0..20, "kept").await;
    assert_eq!(publish_table_version(app, &token).await, 0);
    ha.standby.catch_up_with(&ha.primary).await;

    // Version 1, published by history the standby never receives; a partner reads its changes.
    ha.standby.stop_receiving().await;
    ha.write(20..30, "lost").await;
    assert_eq!(publish_table_version(app, &token).await, 1);
    let read = app.get(Some(&token), &format!("{TABLE}/changes?startingVersion=1")).await;
    assert_eq!(read.status(), 200);

    ha.fail_over().await;
    ha.write(30..40, "new").await;
    let went_on = publish_table_version(app, &token).await;
    assert_eq!(went_on, 1 + exportd::sharing::FAILOVER_SKIP, "the lost history's numbers are skipped");

    // The partner that read version 1 asks for what follows it, or reads it again: refused,
    // naming the failover, in the protocol's error body.
    for asked in
        [format!("{TABLE}/changes?startingVersion=2"), format!("{TABLE}/changes?startingVersion=2&endingVersion=5")]
    {
        let refused = app.get(Some(&token), &asked).await;
        assert_eq!(refused.status(), 410, "{asked}");
        let body: Value = refused.json().await.unwrap();
        assert!(body["message"].as_str().unwrap().contains("failover"), "{body}");
    }
    let query = app.client.post(app.url(&format!("{TABLE}/query"))).bearer_auth(&token).json(&json!({"version": 1}));
    assert_eq!(query.send().await.unwrap().status(), 410, "version 1 itself");

    // A partner that holds version 0 gets exactly what the new primary has beyond it: the
    // records written after the switch, none of the lost ones.
    let changes = app.get(Some(&token), &format!("{TABLE}/changes?startingVersion=1")).await;
    assert_eq!(changes.status(), 200);
    assert_eq!(changes.headers()["delta-table-version"], went_on.to_string().as_str());
    let lines: Vec<Value> = changes.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "protocol, metaData and the new version's change file: {lines:?}");
    assert_eq!(lines[2]["cdf"]["version"], went_on);
    let rows = crate::sharing::change_rows(&lines[2]["cdf"]).await;
    let expected: Vec<(String, String)> = (30..40).map(|i| (format!("k{i:03}"), "insert".to_owned())).collect();
    assert_eq!(rows, expected);
    // So does one that asks for the new version's own changes, and the version after it counts on.
    let own = app.get(Some(&token), &format!("{TABLE}/changes?startingVersion={went_on}")).await;
    assert_eq!(own.status(), 200);
    ha.write(40..41, "later").await;
    assert_eq!(publish_table_version(app, &token).await, went_on + 1);

    let refusals: i64 = sqlx::query_scalar("SELECT refusals FROM failover_refusals WHERE principal = 'zenpartner'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(refusals, 3);
}

async fn shard_digests(app: &TestApp, id: &str) -> Vec<String> {
    let files = app.shard_files(id, &app.store).await;
    files.iter().map(|f| crate::common::sha256_hex(f)).collect()
}

/// Upserts `w000`, `w001`, … one every few milliseconds, `count` attempts, through whatever the
/// pool reaches; returns the keys whose commit was acknowledged.
async fn keep_writing(pool: sqlx::PgPool, count: u32) -> Vec<String> {
    let mut acknowledged = Vec::new();
    for i in 0..count {
        let key = format!("w{i:03}");
        let data = json!({"subject": "during the switch", "status": "open", "region": "apac"});
        let written =
            sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, $2)").bind(&key).bind(data).execute(&pool).await;
        if written.is_ok() {
            acknowledged.push(key);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    acknowledged
}
