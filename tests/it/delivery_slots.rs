//! Deliveries flow like downloads: a bucket that never answers holds one slot of its own tenant
//! for at most the attempt's time, never another tenant's delivery; a retried delivery resumes
//! from what the partner's bucket still holds and counts every byte it sends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use exportd::config::DeliverySettings;
use exportd::delivery::{self, subscriptions};
use exportd::tenants::Registry;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::common::{TestApp, edited_tenants_dir};
use crate::deliveries::{PARTNER_SECRET, Partner, bucket_reader, courier_with, s3_destination, subscription, var};

/// A "bucket" that accepts connections and never answers.
pub(crate) async fn silent_bucket() -> String {
    let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", socket.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = socket.accept().await {
            held.push(stream);
        }
    });
    endpoint
}

/// A destination `name` for `principal` at `endpoint` (the partner SeaweedFS's credentials)
/// and a subscription `name` delivering its full exports of tickets there.
pub(crate) fn subscribed(name: &str, principal: &str, endpoint: &str, prefix: &str) -> String {
    let destination = s3_destination(name, principal, endpoint, prefix, PARTNER_SECRET);
    format!("{destination}\n{}", subscription(name, name))
}

async fn states(pool: &PgPool, tenant: &str) -> Vec<(String, String, bool, Option<String>)> {
    sqlx::query_as(
        "SELECT subscription, state, lease_expires_at > now() IS TRUE, last_error FROM bucket_deliveries
          WHERE tenant = $1 ORDER BY subscription",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_bucket_that_never_answers_holds_one_slot_of_its_tenant_and_never_another_tenants_delivery(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // acme's partner has two subscriptions into buckets that never answer; globex's partner one
    // into a real bucket.
    let prefix = format!("s-{}", uuid::Uuid::new_v4().simple());
    let (first, second) = (silent_bucket().await, silent_bucket().await);
    let acme = format!(
        "{}{}",
        subscribed("silent-one", "zenpartner", &first, &prefix),
        subscribed("silent-two", "zenpartner", &second, &prefix)
    );
    let tenants = edited_tenants_dir("acme", |t| format!("{t}\n{acme}"));
    let globex_file = tenants.path().join("globex.toml");
    let globex = std::fs::read_to_string(&globex_file).unwrap();
    let partner_endpoint = var("EXPORTD_TEST_PARTNER_S3_ENDPOINT");
    let lake = "\n[[principals]]\nid = \"lake\"\nrole = \"partner\"\ngrants = [\"tickets\"]\n";
    let globex = format!("{globex}\n{lake}\n{}", subscribed("lake", "lake", &partner_endpoint, &prefix));
    std::fs::write(&globex_file, globex).unwrap();
    let registry = Arc::new(Registry::load(tenants.path()).unwrap());
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    app.seed("acme", "tickets", 20).await;
    app.seed("globex", "tickets", 20).await;

    // Two slots, attempts of at most 3 s; the delivery loop runs as in `serve`.
    let settings = DeliverySettings {
        delivery_allow_nets: vec!["127.0.0.0/8".parse().unwrap()],
        delivery_first_retry: Duration::from_secs(60),
        delivery_parallel: 2,
        delivery_attempt_timeout: Duration::from_secs(3),
        ..DeliverySettings::default()
    };
    let courier = courier_with(&app, registry.clone(), settings);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(delivery::run(courier, stopped));

    // acme's export is published first: its deliveries are due before globex's.
    app.export(&app.token("acme", "zenpartner"), &json!({"dataset": "tickets", "format": "jsonl"})).await;
    app.drain().await;
    let start = Instant::now();
    while !states(&app.pool, "acme").await.iter().any(|(_, _, leased, _)| *leased) {
        assert!(start.elapsed() < Duration::from_secs(10), "acme's delivery was not leased");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let api = app.sibling(registry.clone()).await;
    let lake = crate::common::token_in(&registry, "globex", "lake");
    app.export_at(&api, &lake, &json!({"dataset": "tickets", "format": "jsonl"})).await;
    exportd::jobs::drain(&app.deps_with(registry.clone(), app.store.clone()), "test-worker").await.unwrap();

    // globex's delivery gets the free slot at once, while acme's silent bucket holds the other.
    let start = Instant::now();
    loop {
        let globex = states(&app.pool, "globex").await;
        if globex.iter().all(|(_, state, _, _)| state == "delivered") && globex.len() == 1 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "globex waited behind acme's bucket: {globex:?}");
        let leased = states(&app.pool, "acme").await.iter().filter(|(_, _, leased, _)| *leased).count();
        assert!(leased <= 1, "acme holds more than its share of the slots");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let delivered = bucket_reader(&app.pool, "PARTNER", &prefix).list(None).await.unwrap();
    assert!(delivered.iter().any(|o| o.key.as_str().ends_with("/_SUCCESS")), "globex's export is in its bucket");

    // Each silent attempt ends at its time limit, retried later, its reason a timeout.
    let start = Instant::now();
    loop {
        let acme = states(&app.pool, "acme").await;
        if acme.iter().all(|(_, state, _, error)| {
            state == "pending" && error.as_deref().is_some_and(|e| e.starts_with("timeout"))
        }) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "acme's attempts did not time out: {acme:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), running).await.expect("the delivery loop stops").unwrap();
}

/// The delivery's counters and the tenant's egress today.
async fn sent(pool: &PgPool) -> (i32, i64, i64) {
    sqlx::query_as(
        "SELECT d.attempts, d.bytes_sent, (SELECT coalesce(sum(egress_bytes), 0)::bigint FROM tenant_usage WHERE tenant = 'acme')
           FROM bucket_deliveries d",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_delivery_retried_by_hand_sends_only_what_the_bucket_lacks_and_counts_every_byte_sent(pool: PgPool) {
    resumes_from_the_bucket(pool, Partner::S3).await;
}

#[sqlx::test(migrations = "./migrations")]
async fn a_delivery_into_an_azure_container_retried_by_hand_sends_only_what_it_lacks(pool: PgPool) {
    resumes_from_the_bucket(pool, Partner::Azure).await;
}

async fn resumes_from_the_bucket(pool: PgPool, partner_at: Partner) {
    let app = TestApp::spawn(pool).await;
    let prefix = format!("r-{}", uuid::Uuid::new_v4().simple());
    let destination = partner_at.destination("zen", "zenpartner", &prefix, partner_at.secret());
    let subscription = subscription("zen", "zen");
    let tenants = edited_tenants_dir("acme", |t| format!("{t}\n{destination}\n{subscription}"));
    let registry = Arc::new(Registry::load(tenants.path()).unwrap());
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    app.seed("acme", "tickets", 3000).await;
    let partner = app.token("acme", "zenpartner");
    let export = app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl", "shard_rows": 300})).await;
    app.drain().await;
    let settings =
        DeliverySettings { delivery_allow_nets: vec!["127.0.0.0/8".parse().unwrap()], ..DeliverySettings::default() };
    let courier = courier_with(&app, registry.clone(), settings);
    assert_eq!(courier.pass().await.unwrap(), 1);
    let (_, first_sent, first_egress) = sent(&app.pool).await;
    let manifest: Vec<u8> = sqlx::query_scalar("SELECT manifest FROM export_jobs WHERE id = $1::uuid")
        .bind(&export)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let shards: Vec<(String, i64)> = serde_json::from_slice::<Value>(&manifest).unwrap()["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_owned(), s["bytes"].as_i64().unwrap()))
        .collect();
    let total: i64 = shards.iter().map(|(_, b)| b).sum::<i64>() + manifest.len() as i64;
    assert!(shards.len() >= 3, "{shards:?}");
    assert_eq!((first_sent, first_egress), (total, total), "every file sent once and counted once");

    // The bucket then lost `_SUCCESS` and the second shard, and the delivery is marked failed (as
    // when a bucket refuses the marker); an admin retries it by hand.
    let bucket = partner_at.bucket(&app.pool, &prefix);
    let folder = format!("tickets/{export}");
    let before: Vec<_> = bucket.list(None).await.unwrap();
    let second_key = format!("{folder}/{}", shards[1].0);
    let second =
        before.iter().find(|o| o.key.as_str() == second_key).expect("the second shard is in the bucket").clone();
    let success = exportd::storage::ObjectKey::parse(&format!("{folder}/_SUCCESS")).unwrap();
    bucket.delete(&second.key).await.unwrap();
    bucket.delete(&success).await.unwrap();
    sqlx::query("UPDATE bucket_deliveries SET state = 'failed', last_error = 'access-denied'")
        .execute(&app.pool)
        .await
        .unwrap();
    let api = app.sibling(registry.clone()).await;
    let id: String = sqlx::query_scalar("SELECT id::text FROM bucket_deliveries").fetch_one(&app.pool).await.unwrap();
    let admin = app.token("acme", "alice");
    let retried = app.client.post(format!("{api}/v1/deliveries/{id}/retry")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(retried.status(), 202);
    assert_eq!(courier.pass().await.unwrap(), 1);

    // Only the missing shard went again, and it counted; every object is back, whole.
    let (attempts, bytes_sent, egress) = sent(&app.pool).await;
    assert_eq!(attempts, 2);
    assert_eq!((bytes_sent, egress), (total + second.bytes as i64, total + second.bytes as i64));
    let after = bucket.list(None).await.unwrap();
    for object in &before {
        let now = after.iter().find(|o| o.key == object.key).unwrap_or_else(|| panic!("{:?} is back", object.key));
        assert_eq!(now.bytes, object.bytes);
    }
    assert!(after.iter().any(|o| o.key == success), "the marker written last");
    let page: Value = app
        .client
        .get(format!("{api}/v1/deliveries/{id}"))
        .bearer_auth(&partner)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["state"], "delivered", "{page}");
    let audited: Vec<i64> = sqlx::query_scalar("SELECT bytes FROM audit_log WHERE action = 'delivered' ORDER BY id")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(audited.last(), Some(&(total + second.bytes as i64)), "the entry counts every byte sent: {audited:?}");
}
