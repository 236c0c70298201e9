//! Delivery into a partner's own bucket: a second SeaweedFS with credentials of its own plays
//! the partner's store (scripts/test starts it). Subscriptions deliver full exports and a
//! schedule of incremental ones; the bucket, read as a loader would (wait for `_SUCCESS`, follow
//! the manifests' cursors), equals a fresh full export.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use exportd::config::DeliverySettings;
use exportd::delivery::{Courier, subscriptions};
use exportd::links::LinkKeys;
use exportd::storage::{BucketConfig, BucketUrl, Credentials, ObjectKey, Provider, Remote};
use exportd::tenants::Registry;
use futures_util::TryStreamExt;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::common::{LINK_KEYS, TestApp, edited_registry, gunzip};

pub(crate) fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run the tests with scripts/test"))
}

/// The partner's bucket, as the partner (or its loader) reads it.
fn partner_bucket(pool: &PgPool, prefix: &str) -> Remote {
    bucket_reader(pool, "PARTNER", prefix)
}

/// A destination `name` for `principal` in the partner SeaweedFS's bucket under `prefix`, reached
/// at `endpoint` (the store's, or a stand-in's), its secret from `secret` (a reference).
pub(crate) fn s3_destination(name: &str, principal: &str, endpoint: &str, prefix: &str, secret: &str) -> String {
    format!(
        r#"
[[destinations]]
name = "{name}"
principal = "{principal}"
url = "s3://{bucket}/{prefix}"
endpoint = "{endpoint}"
credentials.access_key_id = {{ env = "EXPORTD_TEST_PARTNER_S3_ACCESS_KEY_ID" }}
credentials.secret_access_key = {secret}
"#,
        bucket = var("EXPORTD_TEST_PARTNER_S3_BUCKET"),
    )
}

/// A subscription `name` delivering every JSONL full export of tickets into `destination`.
pub(crate) fn subscription(name: &str, destination: &str) -> String {
    format!(
        "[[subscriptions]]\nname = \"{name}\"\ndestination = \"{destination}\"\ndataset = \"tickets\"\nformat = \"jsonl\"\n"
    )
}

/// Where a partner's bucket is in these tests: an S3 SeaweedFS or an Azure Blob azurite.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Partner {
    S3,
    Azure,
}

impl Partner {
    /// The bucket under `prefix`, as the partner (or its loader) reads it.
    pub(crate) fn bucket(self, pool: &PgPool, prefix: &str) -> Remote {
        match self {
            Partner::S3 => partner_bucket(pool, prefix),
            Partner::Azure => {
                let config = BucketConfig {
                    url: BucketUrl {
                        provider: Provider::Azure,
                        bucket: var("EXPORTD_TEST_AZURE_CONTAINER"),
                        prefix: prefix.into(),
                    },
                    endpoint: Some(var("EXPORTD_TEST_AZURE_ENDPOINT")),
                    region: None,
                    credentials: Credentials::Azure {
                        account: var("EXPORTD_TEST_AZURE_ACCOUNT"),
                        access_key: var("EXPORTD_TEST_AZURE_ACCESS_KEY").into(),
                    },
                };
                Remote::connect(&config, &exportd::storage::bucket::Reach::Own, "test-reader", pool.clone()).unwrap()
            }
        }
    }

    /// A destination `name` for `principal` under `prefix`, its secret from `secret` (a
    /// reference).
    pub(crate) fn destination(self, name: &str, principal: &str, prefix: &str, secret: &str) -> String {
        match self {
            Partner::S3 => s3_destination(name, principal, &var("EXPORTD_TEST_PARTNER_S3_ENDPOINT"), prefix, secret),
            Partner::Azure => format!(
                r#"
[[destinations]]
name = "{name}"
principal = "{principal}"
url = "az://{container}/{prefix}"
endpoint = "{endpoint}"
credentials.account = "{account}"
credentials.access_key = {secret}
"#,
                container = var("EXPORTD_TEST_AZURE_CONTAINER"),
                endpoint = var("EXPORTD_TEST_AZURE_ENDPOINT"),
                account = var("EXPORTD_TEST_AZURE_ACCOUNT"),
            ),
        }
    }

    /// The reference to the partner's real secret.
    pub(crate) fn secret(self) -> &'static str {
        match self {
            Partner::S3 => PARTNER_SECRET,
            Partner::Azure => r#"{ env = "EXPORTD_TEST_AZURE_ACCESS_KEY" }"#,
        }
    }
}

/// A test store's bucket under `prefix` with its own credentials (`EXPORTD_TEST_<store>_S3_*`).
pub(crate) fn bucket_reader(pool: &PgPool, store: &str, prefix: &str) -> Remote {
    let setting = |name: &str| var(&format!("EXPORTD_TEST_{store}_S3_{name}"));
    let config = BucketConfig {
        url: BucketUrl { provider: Provider::S3, bucket: setting("BUCKET"), prefix: prefix.into() },
        endpoint: Some(setting("ENDPOINT")),
        region: None,
        credentials: Credentials::S3 {
            access_key_id: setting("ACCESS_KEY_ID"),
            secret_access_key: setting("SECRET_ACCESS_KEY").into(),
        },
    };
    Remote::connect(&config, &exportd::storage::bucket::Reach::Own, "test-reader", pool.clone()).unwrap()
}

/// acme with a destination for zenpartner (row filter region = emea) under `prefix` of the
/// partner's S3 bucket, whose secret comes from `secret` (a reference), and `subscription`.
fn registry_with(prefix: &str, secret: &str, subscription: &str) -> Arc<Registry> {
    registry_at(Partner::S3, prefix, secret, subscription)
}

/// [`registry_with`] for the partner's bucket at `partner`.
fn registry_at(partner: Partner, prefix: &str, secret: &str, subscription: &str) -> Arc<Registry> {
    let destination = partner.destination("zen-landing", "zenpartner", prefix, secret);
    let text = format!(
        r#"
{destination}
[[subscriptions]]
name = "zen-tickets"
destination = "zen-landing"
dataset = "tickets"
format = "jsonl"
{subscription}
"#
    );
    edited_registry("acme", |t| format!("{t}\n{text}"))
}

fn courier(app: &TestApp, registry: Arc<Registry>, allow_loopback: bool) -> Courier {
    courier_allowing(app, registry, if allow_loopback { &["127.0.0.0/8"] } else { &[] })
}

/// A courier whose deliveries may reach the networks `allowed` (besides public addresses).
pub(crate) fn courier_allowing(app: &TestApp, registry: Arc<Registry>, allowed: &[&str]) -> Courier {
    let settings = DeliverySettings {
        delivery_allow_nets: allowed.iter().map(|net| net.parse().unwrap()).collect(),
        delivery_first_retry: Duration::from_millis(200),
        ..DeliverySettings::default()
    };
    courier_with(app, registry, settings)
}

/// A courier with `settings`.
pub(crate) fn courier_with(app: &TestApp, registry: Arc<Registry>, settings: DeliverySettings) -> Courier {
    let keys = Arc::new(LinkKeys::parse(LINK_KEYS).unwrap());
    Courier::new(
        app.pool.clone(),
        registry,
        app.store.clone(),
        keys,
        settings,
        Duration::from_secs(30),
        app.clock.clone(),
    )
}

pub(crate) const PARTNER_SECRET: &str = r#"{ env = "EXPORTD_TEST_PARTNER_S3_SECRET_ACCESS_KEY" }"#;

/// Every byte of an object of the partner's bucket.
pub(crate) async fn read(bucket: &Remote, key: &str) -> Vec<u8> {
    let key = ObjectKey::parse(key).unwrap();
    let (len, _) = bucket.digest(&key).await.unwrap().unwrap_or_else(|| panic!("{key:?} is in the bucket"));
    let chunks: Vec<_> = bucket.read(&key, 0, len).await.unwrap().try_collect().await.unwrap();
    chunks.concat()
}

/// The records of a delivered export's folder: its manifest, then every JSONL row of its shards.
async fn delivered(bucket: &Remote, folder: &str) -> (Value, Vec<Value>) {
    let manifest: Value = serde_json::from_slice(&read(bucket, &format!("{folder}/manifest.json")).await).unwrap();
    let mut rows = Vec::new();
    for shard in manifest["shards"].as_array().unwrap() {
        let bytes = read(bucket, &format!("{folder}/{}", shard["name"].as_str().unwrap())).await;
        assert_eq!(crate::common::sha256_hex(&bytes), shard["sha256"].as_str().unwrap(), "the manifest's sha256");
        for line in String::from_utf8(gunzip(&bytes)).unwrap().lines() {
            rows.push(serde_json::from_str(line).unwrap());
        }
    }
    (manifest, rows)
}

/// The folders holding `_SUCCESS`, each checked complete: its manifest and every shard the
/// manifest names are there, with the manifest's sizes. Panics on a folder marked too early.
async fn complete_folders(bucket: &Remote) -> Vec<String> {
    let objects = bucket.list(None).await.unwrap();
    let sizes: BTreeMap<String, u64> = objects.iter().map(|o| (o.key.as_str().to_owned(), o.bytes)).collect();
    let mut folders = Vec::new();
    for key in sizes.keys().filter(|k| k.ends_with("/_SUCCESS")) {
        let folder = key.trim_end_matches("/_SUCCESS").to_owned();
        let manifest_key = format!("{folder}/manifest.json");
        assert!(sizes.contains_key(&manifest_key), "{folder}: _SUCCESS before its manifest");
        let manifest: Value = serde_json::from_slice(&read(bucket, &manifest_key).await).unwrap();
        for shard in manifest["shards"].as_array().unwrap() {
            let name = format!("{folder}/{}", shard["name"].as_str().unwrap());
            assert_eq!(sizes.get(&name).copied(), shard["bytes"].as_u64(), "{name}: _SUCCESS before the whole shard");
        }
        folders.push(folder);
    }
    folders
}

async fn ingest(app: &TestApp, token: &str, records: Value) {
    let response = app.ingest(token, "tickets", &records).await;
    assert!(response.status().is_success(), "{}", response.text().await.unwrap());
}

/// The subscription's next scheduled run is due now (its schedule is hourly in these tests).
async fn run_due(app: &TestApp) {
    sqlx::query("UPDATE subscriptions SET next_run_at = now()").execute(&app.pool).await.unwrap();
}

/// One scheduled run, then everything until nothing is left to do: exports written, delivered.
async fn settle(app: &TestApp, courier: &Courier) {
    run_due(app).await;
    for _ in 0..20 {
        let ran = courier.pass().await.unwrap();
        let steps = app.drain().await;
        let ran_after = courier.pass().await.unwrap();
        if ran == 0 && steps.is_empty() && ran_after == 0 {
            return;
        }
    }
    panic!("the subscription did not settle");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_subscription_fills_the_bucket_with_exports_that_add_up_to_a_fresh_full_export(pool: PgPool) {
    fills_the_bucket(pool, Partner::S3).await;
}

#[sqlx::test(migrations = "./migrations")]
async fn a_subscription_fills_an_azure_container_with_exports_that_add_up_to_a_fresh_full_export(pool: PgPool) {
    fills_the_bucket(pool, Partner::Azure).await;
}

async fn fills_the_bucket(pool: PgPool, partner_at: Partner) {
    let app = TestApp::spawn(pool).await;
    let prefix = format!("t-{}", uuid::Uuid::new_v4().simple());
    let registry = registry_at(partner_at, &prefix, partner_at.secret(), r#"incremental_every = "1h""#);
    let courier = courier(&app, registry.clone(), true);
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    let admin = app.token("acme", "alice");
    let partner = app.token("acme", "zenpartner");
    let records = |from: usize, to: usize, subject: &str| -> Value {
        (from..to)
            .map(|i| {
                let region = if i % 3 == 0 { "apac" } else { "emea" };
                json!({"key": format!("t-{i:04}"), "data": {"subject": format!("{subject} {i}"), "status": "open", "region": region}})
            })
            .collect()
    };
    ingest(&app, &admin, records(0, 120, "first")).await;

    // A loader polls the bucket the whole time: a folder with `_SUCCESS` is always complete.
    let bucket = partner_at.bucket(&app.pool, &prefix);
    let stop = Arc::new(AtomicBool::new(false));
    let checks = Arc::new(AtomicUsize::new(0));
    let poller = tokio::spawn({
        let (bucket, stop, checks) = (bucket.clone(), stop.clone(), checks.clone());
        async move {
            while !stop.load(Ordering::Relaxed) {
                complete_folders(&bucket).await;
                checks.fetch_add(1, Ordering::Relaxed);
            }
        }
    });

    // Rounds of writes (updates, deletes, rows entering and leaving the partner's filter), each
    // followed by a scheduled run; writers keep going while exports are written.
    for round in 0..4usize {
        app.tick().await;
        app.pass_safety_delay();
        let writers: Vec<_> = (0..3usize)
            .map(|w| {
                let (app_url, client, admin) = (app.url("/v1/datasets/tickets/records"), app.client.clone(), admin.clone());
                tokio::spawn(async move {
                    let start = w * 40;
                    let mut changes: Vec<Value> = (start..start + 40)
                        .step_by(2)
                        .map(|i| {
                            let region = if (i + round) % 4 == 0 { "apac" } else { "emea" };
                            json!({"key": format!("t-{i:04}"), "data": {"subject": format!("round {round} {i}"), "status": "open", "region": region}})
                        })
                        .collect();
                    changes.push(json!({"key": format!("t-{:04}", start + 1 + round * 2), "deleted": true}));
                    let response = client.post(app_url).bearer_auth(admin).json(&changes).send().await.unwrap();
                    assert!(response.status().is_success());
                })
            })
            .collect();
        run_due(&app).await;
        courier.pass().await.unwrap();
        for writer in writers {
            writer.await.unwrap();
        }
        app.drain().await;
        courier.pass().await.unwrap();
    }
    app.tick().await;
    app.pass_safety_delay();
    settle(&app, &courier).await;

    // A fresh full export as the partner (also delivered: the subscription takes its full exports).
    let fresh = app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl"})).await;
    app.drain().await;
    settle(&app, &courier).await;
    stop.store(true, Ordering::Relaxed);
    poller.await.unwrap();
    assert!(checks.load(Ordering::Relaxed) > 0);

    let folders = complete_folders(&bucket).await;
    let fresh_folder = format!("tickets/{fresh}");
    assert!(folders.contains(&fresh_folder), "the partner's own full export was delivered: {folders:?}");
    let (_, expected) = delivered(&bucket, &fresh_folder).await;

    // Apply the chain as a loader would: the full export first, then each incremental export
    // whose from_cursor is the previous one's next_cursor.
    let mut manifests = BTreeMap::new();
    for folder in folders.iter().filter(|f| **f != fresh_folder) {
        let (manifest, rows) = delivered(&bucket, folder).await;
        manifests.insert(folder.clone(), (manifest, rows));
    }
    let seed = manifests.values().find(|(m, _)| m["mode"] == "full").expect("the chain starts with a full export");
    let seed = seed.clone();
    let mut state: BTreeMap<String, Value> =
        seed.1.iter().map(|r| (r["id"].as_str().unwrap().to_owned(), r.clone())).collect();
    let mut cursor = seed.0["next_cursor"].clone();
    let total = manifests.len();
    manifests.retain(|_, (m, _)| m["mode"] != "full");
    let mut applied = 1;
    // An incremental export with no change ends where it starts: several may share a cursor.
    while let Some(folder) =
        manifests.iter().find(|(_, (m, _))| m["from_cursor"] == cursor).map(|(folder, _)| folder.clone())
    {
        let (manifest, rows) = manifests.remove(&folder).unwrap();
        for row in rows {
            let mut row = row.clone();
            let key = row["id"].as_str().unwrap().to_owned();
            match row.as_object_mut().unwrap().remove("_op").unwrap().as_str().unwrap() {
                "upsert" => state.insert(key, row),
                "delete" => state.remove(&key),
                op => panic!("unknown op {op}"),
            };
        }
        cursor = manifest["next_cursor"].clone();
        applied += 1;
    }
    assert_eq!(applied, total, "every delivered export of the chain links to the one before");
    assert!(applied >= 3, "a full export and scheduled incremental ones: {applied}");
    let expected: BTreeMap<String, Value> =
        expected.into_iter().map(|r| (r["id"].as_str().unwrap().to_owned(), r)).collect();
    assert_eq!(state, expected, "the chain adds up to a fresh full export");
    assert!(expected.values().all(|r| r["region"] == "emea"), "only what the partner may see");

    // Every delivery delivered, each export once; the API shows them to the partner.
    let (delivered_count, pending): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'delivered'), count(*) FILTER (WHERE state <> 'delivered') FROM bucket_deliveries",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((delivered_count as usize, pending), (folders.len(), 0));
    let api = app.sibling(registry.clone()).await;
    let page: Value = app
        .client
        .get(format!("{api}/v1/deliveries"))
        .bearer_auth(&partner)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed = page["deliveries"].as_array().unwrap();
    assert_eq!(listed.len(), folders.len());
    let path = listed[0]["path"].as_str().unwrap();
    let root = match partner_at {
        Partner::S3 => format!("s3://{}/{prefix}/tickets/", var("EXPORTD_TEST_PARTNER_S3_BUCKET")),
        Partner::Azure => format!("az://{}/{prefix}/tickets/", var("EXPORTD_TEST_AZURE_CONTAINER")),
    };
    assert!(path.starts_with(&root), "{path}");
    // The audit log names each delivery's folder as the API does (no endpoint spliced in).
    let mut audited: Vec<String> =
        sqlx::query_scalar("SELECT object FROM audit_log WHERE action = 'delivered' ORDER BY object")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    let mut paths: Vec<String> = listed.iter().map(|d| d["path"].as_str().unwrap().to_owned()).collect();
    audited.sort();
    paths.sort();
    assert_eq!(audited, paths);
    for cursor in ["x", "1.5", "-1", "0", "01"] {
        let response =
            app.client.get(format!("{api}/v1/deliveries?cursor={cursor}")).bearer_auth(&partner).send().await.unwrap();
        assert_eq!(response.status(), 400, "cursor={cursor}");
    }
    let admin_page = app.client.get(format!("{api}/dashboard")).bearer_auth(&admin).send().await.unwrap();
    let admin_page = admin_page.text().await.unwrap();
    assert!(admin_page.contains(r#"data-behind="zen-tickets">up to date"#), "the dashboard shows it caught up");
    assert!(!admin_page.contains(r#"data-last-delivery="zen-tickets">never"#));
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events WHERE type = 'delivery.succeeded'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(events as usize, folders.len());
    // The partner's own stored cursor was never moved by the subscription's chain.
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM feed_cursors WHERE principal = 'zenpartner'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, 0);
    let uploads: i64 = sqlx::query_scalar("SELECT count(*) FROM pending_uploads").fetch_one(&app.pool).await.unwrap();
    assert_eq!(uploads, 0, "no upload left open");
}

#[sqlx::test(migrations = "./migrations")]
async fn wrong_credentials_fail_the_delivery_saying_so_and_write_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let prefix = format!("t-{}", uuid::Uuid::new_v4().simple());
    let secret_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret_file.path(), "not-the-partners-secret\n").unwrap();
    let reference = format!(r#"{{ file = "{}" }}"#, secret_file.path().display());
    let registry = registry_with(&prefix, &reference, "");
    let courier = courier(&app, registry.clone(), true);
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    app.seed("acme", "tickets", 20).await;
    let partner = app.token("acme", "zenpartner");
    let export = app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl"})).await;
    app.drain().await;
    assert_eq!(courier.pass().await.unwrap(), 1);

    let api = app.sibling(registry.clone()).await;
    let page: Value = app
        .client
        .get(format!("{api}/v1/deliveries"))
        .bearer_auth(&partner)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let delivery = &page["deliveries"][0];
    assert_eq!(delivery["state"], "failed", "a refusal fails at once: {delivery}");
    assert_eq!(delivery["export_id"], export.as_str());
    let error = delivery["last_error"].as_str().unwrap();
    assert!(error.contains("access denied") || error.contains("refused"), "{error}");
    let body = page.to_string();
    assert!(
        !body.contains("not-the-partners-secret") && !body.contains(&var("EXPORTD_TEST_PARTNER_S3_SECRET_ACCESS_KEY"))
    );
    let event: Value = sqlx::query_scalar("SELECT data FROM webhook_events WHERE type = 'delivery.failed'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(event["destination"], "zen-landing");
    assert!(!event.to_string().contains("not-the-partners-secret"));
    assert!(partner_bucket(&app.pool, &prefix).list(None).await.unwrap().is_empty(), "nothing written");
    let egress: Option<i64> = sqlx::query_scalar("SELECT egress_bytes FROM tenant_usage WHERE tenant = 'acme'")
        .fetch_optional(&app.pool)
        .await
        .unwrap();
    assert_eq!(egress.unwrap_or(0), 0, "a refused delivery counts no egress");

    // The dashboard shows the subscription behind, with the reason, and no secret.
    let admin = app.token("acme", "alice");
    let page =
        app.client.get(format!("{api}/dashboard")).bearer_auth(&admin).send().await.unwrap().text().await.unwrap();
    let row = page
        .split(r#"<tr data-subscription="zen-tickets">"#)
        .nth(1)
        .expect("the subscription's row")
        .split("</tr>")
        .next()
        .unwrap();
    assert!(row.contains(&format!("s3://{}/{prefix}", var("EXPORTD_TEST_PARTNER_S3_BUCKET"))), "{row}");
    assert!(row.contains(r#"data-last-delivery="zen-tickets">never"#), "{row}");
    assert!(row.contains("1</data> export not delivered") && row.contains(r#"data-failed="1""#), "{row}");
    assert!(row.contains(error), "the reason is shown: {row}");
    assert!(!page.contains("not-the-partners-secret"));

    // Another partner cannot see or retry it; an admin can retry it.
    let id = delivery["id"].as_str().unwrap();
    let other = app.token("acme", "lens");
    for request in [
        app.client.get(format!("{api}/v1/deliveries/{id}")),
        app.client.post(format!("{api}/v1/deliveries/{id}/retry")),
    ] {
        assert_eq!(request.bearer_auth(&other).send().await.unwrap().status(), 404);
    }
    let mine: Value =
        app.client.get(format!("{api}/v1/deliveries")).bearer_auth(&other).send().await.unwrap().json().await.unwrap();
    assert_eq!(mine["deliveries"], json!([]));
    let retried = app.client.post(format!("{api}/v1/deliveries/{id}/retry")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(retried.status(), 202);
    assert_eq!(retried.json::<Value>().await.unwrap()["state"], "pending");

    // A secret that names nothing fails with what to fix.
    let registry = registry_with(&prefix, r#"{ env = "EXPORTD_TEST_NO_SUCH_SECRET" }"#, "");
    let courier = self::courier(&app, registry, true);
    assert_eq!(courier.pass().await.unwrap(), 1);
    let error: String =
        sqlx::query_scalar("SELECT last_error FROM bucket_deliveries").fetch_one(&app.pool).await.unwrap();
    assert!(error.contains("EXPORTD_TEST_NO_SUCH_SECRET") && error.contains("not set"), "{error}");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_endpoint_on_an_internal_address_is_refused_unless_the_operator_allows_it(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let prefix = format!("t-{}", uuid::Uuid::new_v4().simple());
    let registry = registry_with(&prefix, PARTNER_SECRET, "");
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    app.seed("acme", "tickets", 5).await;
    let partner = app.token("acme", "zenpartner");
    app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl"})).await;
    app.drain().await;
    assert_eq!(courier(&app, registry, false).pass().await.unwrap(), 1);
    let (state, error): (String, String) =
        sqlx::query_as("SELECT state, last_error FROM bucket_deliveries").fetch_one(&app.pool).await.unwrap();
    assert_eq!(state, "failed");
    assert!(error.contains("loopback") && error.contains("EXPORTD_DELIVERY_ALLOW_NETS"), "{error}");
    assert!(partner_bucket(&app.pool, &prefix).list(None).await.unwrap().is_empty());
}
