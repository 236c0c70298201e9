//! Delivery into a partner's bucket under faults, by real `exportd worker` processes: the
//! partner's store frozen (SIGSTOP) for 20 s while a multipart upload is open, and the worker
//! holding that upload SIGKILLed. The partner's store here is a SeaweedFS of its own
//! (`EXPORTD_TEST_FREEZABLE_S3_*`, started by scripts/test), so freezing it stalls no other test.
//! What the partner finds afterwards is checked with curl (SigV4), a client nobody here wrote.

use std::collections::BTreeMap;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use exportd::delivery::subscriptions;
use exportd::storage::{ObjectKey, Remote};
use exportd::tenants::Registry;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::common::processes::{Fleet, database_url, terminate, wait_exit, worker_command};
use crate::common::{TestApp, edited_tenants_dir};
use crate::deliveries::{Partner, bucket_reader, courier_allowing, read, var};

/// The freezable store's settings.
struct PartnerStore {
    endpoint: String,
    bucket: String,
    access_key_id: String,
    secret: String,
    pid: String,
}

impl PartnerStore {
    fn from_env() -> PartnerStore {
        PartnerStore {
            endpoint: var("EXPORTD_TEST_FREEZABLE_S3_ENDPOINT"),
            bucket: var("EXPORTD_TEST_FREEZABLE_S3_BUCKET"),
            access_key_id: var("EXPORTD_TEST_FREEZABLE_S3_ACCESS_KEY_ID"),
            secret: var("EXPORTD_TEST_FREEZABLE_S3_SECRET_ACCESS_KEY"),
            pid: var("EXPORTD_TEST_FREEZABLE_S3_PID"),
        }
    }

    /// The bucket under `prefix`, as the partner's loader reads it.
    fn reader(&self, pool: &PgPool, prefix: &str) -> Remote {
        bucket_reader(pool, "FREEZABLE", prefix)
    }

    /// A SigV4-signed request to the bucket by curl; the response body.
    fn curl(&self, method: &str, path_and_query: &str) -> String {
        let output = Command::new("curl")
            .args(["-sS", "--fail-with-body", "-X", method, "--aws-sigv4", "aws:amz:us-east-1:s3", "-u"])
            .arg(format!("{}:{}", self.access_key_id, self.secret))
            .arg(format!("{}/{}/{path_and_query}", self.endpoint, self.bucket))
            .output()
            .expect("curl runs");
        let body = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "curl {method} {path_and_query}: {body}");
        body
    }

    /// The multipart uploads open under `prefix/` (S3 ListMultipartUploads): their object keys.
    fn open_uploads(&self, prefix: &str) -> Vec<String> {
        let xml = self.curl("GET", &format!("?prefix={prefix}%2F&uploads="));
        assert!(xml.contains("ListMultipartUploadsResult"), "a ListMultipartUploads answer: {xml}");
        xml.split("<Upload>")
            .skip(1)
            .map(|upload| upload.split("<Key>").nth(1).and_then(|k| k.split("</Key>").next()).unwrap_or("?").to_owned())
            .collect()
    }

    /// Sends `signal` (STOP or CONT) to the store's process group.
    fn signal(&self, signal: &str) {
        let status =
            Command::new("kill").args([&format!("-{signal}"), "--", &format!("-{}", self.pid)]).status().unwrap();
        assert!(status.success(), "kill -{signal} the partner's store");
    }
}

/// The partner's store stopped (SIGSTOP) until dropped (SIGCONT), so a failing assertion never
/// leaves it frozen.
struct Frozen<'a>(&'a PartnerStore);

impl<'a> Frozen<'a> {
    fn new(store: &'a PartnerStore) -> Frozen<'a> {
        store.signal("STOP");
        Frozen(store)
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        self.0.signal("CONT");
    }
}

/// An upload into a partner's bucket open now (`upload`, or any), and the lease owner of its
/// delivery.
async fn open_upload(pool: &PgPool, upload: Option<&str>) -> Option<(String, String)> {
    sqlx::query_as(
        "SELECT p.upload_id, d.lease_owner FROM pending_uploads p
           JOIN bucket_deliveries d ON p.object_path LIKE '%/' || d.export_id || '/%'
          WHERE p.store LIKE 'destination:%' AND d.state = 'pending' AND d.lease_owner IS NOT NULL
            AND ($1::text IS NULL OR p.upload_id = $1)
          LIMIT 1",
    )
    .bind(upload)
    .fetch_optional(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn deliveries_survive_a_frozen_bucket_and_a_worker_killed_mid_upload(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let store = PartnerStore::from_env();
    let prefix = format!("f-{}", uuid::Uuid::new_v4().simple());
    let destination = format!(
        r#"
[[destinations]]
name = "crm-landing"
principal = "bulk"
url = "s3://{}/{prefix}"
endpoint = "{}"
credentials.access_key_id = {{ env = "EXPORTD_TEST_FREEZABLE_S3_ACCESS_KEY_ID" }}
credentials.secret_access_key = {{ env = "EXPORTD_TEST_FREEZABLE_S3_SECRET_ACCESS_KEY" }}

[[subscriptions]]
name = "crm-tickets"
destination = "crm-landing"
dataset = "tickets"
format = "jsonl"
"#,
        store.bucket, store.endpoint
    );
    // A partner without a row filter: every row, so the shards are large.
    let bulk = "\n[[principals]]\nid = \"bulk\"\nrole = \"partner\"\ngrants = [\"tickets\"]\n";
    let tenants = edited_tenants_dir("acme", |t| format!("{t}\n{bulk}\n{destination}"));
    let registry = Arc::new(Registry::load(tenants.path()).unwrap());
    subscriptions::sync(&app.pool, &registry).await.unwrap();

    // The listing of open uploads sees one when there is one (so its empty answer at the end
    // means something).
    let started = store.curl("POST", &format!("{prefix}/listing-check?uploads="));
    let upload_id = started.split("<UploadId>").nth(1).and_then(|s| s.split("</UploadId>").next()).unwrap();
    assert_eq!(store.open_uploads(&prefix), vec![format!("{prefix}/listing-check")]);
    store.curl("DELETE", &format!("{prefix}/listing-check?uploadId={upload_id}"));
    assert_eq!(store.open_uploads(&prefix), Vec::<String>::new());

    // Three full exports whose shards are more than one 8 MiB part each, written by the workers.
    app.seed("acme", "tickets", 250_000).await;
    let api = app.sibling(registry.clone()).await;
    let partner = crate::common::token_in(&registry, "acme", "bulk");
    let mut exports = Vec::new();
    for _ in 0..3 {
        let request = json!({"dataset": "tickets", "format": "jsonl", "shard_rows": 1_000_000});
        exports.push(app.export_at(&api, &partner, &request).await);
    }

    let url = database_url(&app.pool).await;
    let log = app.data_dir.path().join("workers.log");
    let spawn = || -> Child {
        worker_command(&url, app.data_dir.path(), &log, 1, "3s")
            .env("EXPORTD_TENANTS_DIR", tenants.path())
            .env("EXPORTD_DELIVERY_ALLOW_NETS", "127.0.0.0/8")
            .env("EXPORTD_DELIVERY_FIRST_RETRY", "200ms")
            .env("EXPORTD_LOG", "info")
            .spawn()
            .expect("exportd worker starts")
    };
    let mut workers = Fleet(vec![spawn(), spawn()]);

    // The store freezes while a multipart upload is open; the worker holding it is killed.
    let waiting = Instant::now();
    let (frozen, owner) = loop {
        // A deadline against a hang, not a speed bound: three exports of 250 000 rows run first,
        // in a debug build on a runner as busy as the whole suite makes it.
        assert!(waiting.elapsed() < Duration::from_secs(300), "no multipart upload into the partner's bucket");
        let Some((upload, _)) = open_upload(&app.pool, None).await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let frozen = Frozen::new(&store);
        match open_upload(&app.pool, Some(&upload)).await {
            Some((_, owner)) => break (frozen, owner),
            None => drop(frozen), // it completed in between: catch the next one
        }
    };
    let freeze_started = Instant::now();
    let pid: u32 = owner.split('-').next().unwrap().parse().unwrap();
    let victim = workers.0.iter().position(|w| w.id() == pid).expect("the lease owner is one of the workers");
    workers.0[victim].kill().unwrap(); // SIGKILL, in the middle of the multipart upload
    workers.0[victim].wait().unwrap();
    workers.0[victim] = spawn();
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(freeze_started.elapsed())).await;
    drop(frozen);

    // Every delivery ends delivered.
    let start = Instant::now();
    loop {
        let (delivered, total): (i64, i64) =
            sqlx::query_as("SELECT count(*) FILTER (WHERE state = 'delivered'), count(*) FROM bucket_deliveries")
                .fetch_one(&app.pool)
                .await
                .unwrap();
        if delivered == 3 && total == 3 {
            break;
        }
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(start.elapsed() < Duration::from_secs(180), "{delivered}/{total} delivered\n{log}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let shard_bytes: Vec<i64> = sqlx::query_scalar("SELECT bytes FROM export_shards ORDER BY export_id, shard_index")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert!(shard_bytes.iter().all(|b| *b > 8 << 20), "shards of more than one 8 MiB part: {shard_bytes:?}");
    let takeovers: i64 = sqlx::query_scalar("SELECT coalesce(sum(attempts - 1), 0)::bigint FROM bucket_deliveries")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(takeovers >= 1, "the killed worker's delivery was taken over");

    // The bucket holds exactly the manifests' objects, each with the manifest's sha256.
    let bucket = store.reader(&app.pool, &prefix);
    let found: BTreeMap<String, u64> =
        bucket.list(None).await.unwrap().into_iter().map(|o| (o.key.as_str().to_owned(), o.bytes)).collect();
    let mut expected = BTreeMap::new();
    let mut delivered_bytes = 0u64;
    for export in &exports {
        let folder = format!("tickets/{export}");
        let manifest = read(&bucket, &format!("{folder}/manifest.json")).await;
        let stored: Vec<u8> = sqlx::query_scalar("SELECT manifest FROM export_jobs WHERE id = $1::uuid")
            .bind(export)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(manifest, stored, "the delivered manifest is the export's");
        let manifest: Value = serde_json::from_slice(&manifest).unwrap();
        for shard in manifest["shards"].as_array().unwrap() {
            let key = format!("{folder}/{}", shard["name"].as_str().unwrap());
            let (bytes, sha256) = bucket.digest(&ObjectKey::parse(&key).unwrap()).await.unwrap().unwrap();
            assert_eq!(sha256, shard["sha256"].as_str().unwrap(), "{key}: the manifest's sha256");
            delivered_bytes += bytes;
            expected.insert(key, bytes);
        }
        delivered_bytes += stored.len() as u64;
        expected.insert(format!("{folder}/manifest.json"), stored.len() as u64);
        expected.insert(format!("{folder}/_SUCCESS"), 0);
    }
    assert_eq!(found, expected, "exactly the manifests' objects, nothing partial or stray");
    assert_eq!(store.open_uploads(&prefix), Vec::<String>::new(), "no multipart upload left open");
    let registered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pending_uploads").fetch_one(&app.pool).await.unwrap();
    assert_eq!(registered, 0, "no upload left registered for the cleaner");

    // Every byte sent counted against the egress quota: each export at least once (a file sent
    // again after the kill or the freeze counts again), in one audit entry per export.
    let (egress, sent, audited, audited_bytes): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(egress_bytes), 0)::bigint FROM tenant_usage WHERE tenant = 'acme'),
                (SELECT sum(bytes_sent)::bigint FROM bucket_deliveries),
                (SELECT count(*) FROM audit_log WHERE action = 'delivered'),
                (SELECT sum(bytes)::bigint FROM audit_log WHERE action = 'delivered')",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((egress, audited, audited_bytes), (sent, 3, sent));
    assert!(sent as u64 >= delivered_bytes, "{sent} bytes counted, {delivered_bytes} delivered");

    for worker in &workers.0 {
        terminate(worker);
    }
    for worker in &mut workers.0 {
        let status = wait_exit(worker, Duration::from_secs(25)).await;
        assert!(status.is_some_and(|s| s.success()), "a worker exits 0 on SIGTERM");
    }
    // The workers logged their work (delivery spans at info), never a credential.
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("delivery"), "the workers' log holds their deliveries:\n{log}");
    for secret in [&store.secret, &store.access_key_id] {
        assert!(!log.contains(secret.as_str()), "a credential in the workers' log:\n{log}");
    }
}

/// An attempt dropped in the middle of a multipart upload (its process gone), then another
/// taking the delivery over: the bucket ends with exactly the manifest's objects, whole, and
/// every byte sent was counted. Run against azurite (Azure Blob); S3 goes through the harder
/// test above, with real worker processes.
async fn an_upload_cut_off_midway_leaves_nothing_partial(pool: PgPool, partner_at: Partner) {
    let app = TestApp::spawn(pool).await;
    let prefix = format!("c-{}", uuid::Uuid::new_v4().simple());
    let bulk = "\n[[principals]]\nid = \"bulk\"\nrole = \"partner\"\ngrants = [\"tickets\"]\n";
    let destination = partner_at.destination("landing", "bulk", &prefix, partner_at.secret());
    let subscription = crate::deliveries::subscription("bulk", "landing");
    let tenants = edited_tenants_dir("acme", |t| format!("{t}\n{bulk}\n{destination}\n{subscription}"));
    let registry = Arc::new(Registry::load(tenants.path()).unwrap());
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    // One shard of more than one 8 MiB part.
    app.seed("acme", "tickets", 250_000).await;
    let api = app.sibling(registry.clone()).await;
    let partner = crate::common::token_in(&registry, "acme", "bulk");
    let request = json!({"dataset": "tickets", "format": "jsonl", "shard_rows": 1_000_000});
    let export = app.export_at(&api, &partner, &request).await;
    exportd::jobs::drain(&app.deps_with(registry.clone(), app.store.clone()), "test-worker").await.unwrap();

    // The first attempt is cut off while its upload is open.
    let courier = courier_allowing(&app, registry.clone(), &["127.0.0.0/8"]);
    let first = tokio::spawn({
        let courier = courier.clone();
        async move { courier.pass().await }
    });
    let waiting = Instant::now();
    while open_upload(&app.pool, None).await.is_none() {
        assert!(waiting.elapsed() < Duration::from_secs(300), "no upload into the partner's bucket opened");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.abort();
    let _ = first.await;
    let bucket = partner_at.bucket(&app.pool, &prefix);
    let folder = format!("tickets/{export}");
    let visible: Vec<String> =
        bucket.list(None).await.unwrap().into_iter().map(|o| o.key.as_str().to_owned()).collect();
    assert!(!visible.iter().any(|k| k.ends_with("_SUCCESS")), "no marker before the files: {visible:?}");

    // Its lease runs out; the next attempt takes over and completes.
    sqlx::query("UPDATE bucket_deliveries SET lease_expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(courier.pass().await.unwrap(), 1);
    let (state, attempts, sent): (String, i32, i64) =
        sqlx::query_as("SELECT state, attempts, bytes_sent FROM bucket_deliveries").fetch_one(&app.pool).await.unwrap();
    assert_eq!((state.as_str(), attempts), ("delivered", 2));

    let manifest: Vec<u8> = sqlx::query_scalar("SELECT manifest FROM export_jobs WHERE id = $1::uuid")
        .bind(&export)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(read(&bucket, &format!("{folder}/manifest.json")).await, manifest);
    let manifest: Value = serde_json::from_slice(&manifest).unwrap();
    let mut expected = BTreeMap::from([(format!("{folder}/manifest.json"), 0u64), (format!("{folder}/_SUCCESS"), 0)]);
    let mut total = 0u64;
    for shard in manifest["shards"].as_array().unwrap() {
        let key = format!("{folder}/{}", shard["name"].as_str().unwrap());
        let (bytes, sha256) = bucket.digest(&ObjectKey::parse(&key).unwrap()).await.unwrap().unwrap();
        assert_eq!(sha256, shard["sha256"].as_str().unwrap(), "{key}: the manifest's sha256");
        assert!(bytes > 8 << 20, "{key}: more than one part ({bytes} bytes)");
        total += bytes;
        expected.insert(key, 0);
    }
    let found: BTreeMap<String, u64> =
        bucket.list(None).await.unwrap().into_iter().map(|o| (o.key.as_str().to_owned(), 0)).collect();
    assert_eq!(found, expected, "exactly the manifest's objects, nothing partial or stray");
    let egress: i64 = sqlx::query_scalar("SELECT coalesce(sum(egress_bytes), 0)::bigint FROM tenant_usage")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(egress, sent, "egress counts every byte sent");
    // The usage history's hour holds them too (from the delivery's audit entry).
    while !exportd::usage::history::record(&app.pool, &["acme"]).await.unwrap() {}
    let hourly: i64 = sqlx::query_scalar("SELECT coalesce(sum(egress_bytes), 0)::bigint FROM tenant_usage_hours")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(hourly, sent, "the hour's egress includes the delivery");
    assert!(sent as u64 > total, "the file cut off was counted, and counted again when sent again");
    let registered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pending_uploads").fetch_one(&app.pool).await.unwrap();
    assert_eq!(registered, 0, "no upload left registered");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_azure_upload_cut_off_midway_leaves_nothing_partial(pool: PgPool) {
    an_upload_cut_off_midway_leaves_nothing_partial(pool, Partner::Azure).await;
}
