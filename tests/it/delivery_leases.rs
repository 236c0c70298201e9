//! The deliveries' bookkeeping against PostgreSQL, one attempt at a time: an attempt whose lease
//! another process took over writes nothing (heartbeat, egress, checkpoint, outcome); the
//! checkpoints of the attempt that took over only move forward and survive being repeated; a
//! retry past the give-up time fails the delivery; a retry by hand makes it due at once with its
//! completed files kept; a tenant or principal at its share is skipped.

use std::sync::Arc;
use std::time::Duration;

use exportd::delivery::store::{self, Charge, Claimed, Completed, LeaseLost, Outcome, Shares};
use exportd::delivery::subscriptions;
use exportd::tenants::Registry;
use serde_json::json;
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::common::{TestApp, edited_tenants_dir};
use crate::delivery_slots::subscribed;

const LEASE: Duration = Duration::from_secs(30);
const RETRY_FOR: Duration = Duration::from_secs(3600);

async fn claim(pool: &PgPool, owner: &str, shares: &Shares<'_>) -> Option<Claimed> {
    store::claim(pool, owner, LEASE, RETRY_FOR, shares).await.unwrap()
}

/// (state, attempts, files_done, bytes_done, bytes_sent) of the only delivery.
async fn row(pool: &PgPool) -> (String, i32, i32, i64, i64) {
    sqlx::query_as("SELECT state, attempts, files_done, bytes_done, bytes_sent FROM bucket_deliveries")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn file_rows(pool: &PgPool) -> Vec<(i32, i64, Option<String>)> {
    sqlx::query_as("SELECT ordinal, bytes, e_tag FROM bucket_delivery_files ORDER BY ordinal")
        .fetch_all(pool)
        .await
        .unwrap()
}

fn done(bytes: i64, e_tag: &str) -> Completed {
    Completed { bytes, e_tag: Some(e_tag.to_owned()) }
}

#[sqlx::test(migrations = "./migrations")]
async fn a_taken_over_attempt_writes_nothing_and_the_newer_ones_bookkeeping_only_moves_forward(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // The bucket is never contacted: this test drives the deliveries' table directly.
    let prefix = format!("l-{}", uuid::Uuid::new_v4().simple());
    let tenants = edited_tenants_dir("acme", |t| {
        format!("{t}\n{}", subscribed("lake", "zenpartner", "http://127.0.0.1:9", &prefix))
    });
    let registry = Arc::new(Registry::load(tenants.path()).unwrap());
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    let acme = registry.get("acme").unwrap().clone();
    app.seed("acme", "tickets", 5).await;
    app.export(&app.token("acme", "zenpartner"), &json!({"dataset": "tickets", "format": "jsonl"})).await;
    app.drain().await;
    let none = Shares::default();

    // Process a leases the delivery; while it holds the lease nobody else can.
    let first = claim(&app.pool, "process-a", &none).await.expect("the published export's delivery is due");
    assert_eq!((first.attempts, first.files_done, first.bytes_done), (1, 0, 0));
    assert!(claim(&app.pool, "process-b", &none).await.is_none(), "a leased delivery was leased twice");
    let now = OffsetDateTime::now_utc();
    assert!(matches!(store::charge(&app.pool, &acme, &first, 100, now).await.unwrap(), Charge::Counted));
    store::checkpoint(&app.pool, &first, 0, &done(100, "a0"), 100).await.unwrap().unwrap();

    // Process a vanishes: its lease runs out and process b takes the delivery over from the checkpoint.
    sqlx::query("UPDATE bucket_deliveries SET lease_expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    let second = claim(&app.pool, "process-b", &none).await.expect("an expired lease is taken over");
    assert_eq!((second.attempts, second.files_done, second.bytes_done), (2, 1, 100));
    assert!(second.generation > first.generation);
    assert_eq!(store::completed_files(&app.pool, &second).await.unwrap(), vec![done(100, "a0")]);

    // Process a wakes up: every write it tries is refused and changes nothing.
    let egress_before = exportd::quota::egress_today(&app.pool, "acme", now).await.unwrap();
    assert_eq!(store::heartbeat(&app.pool, &first, LEASE).await.unwrap(), Err(LeaseLost));
    assert!(matches!(store::charge(&app.pool, &acme, &first, 999, now).await.unwrap(), Charge::LeaseLost));
    assert_eq!(store::checkpoint(&app.pool, &first, 1, &done(7, "stale"), 107).await.unwrap(), Err(LeaseLost));
    let delivered = Outcome::Delivered { path: "stale/".into() };
    assert_eq!(store::record(&app.pool, &first, &delivered).await.unwrap(), None);
    assert_eq!(exportd::quota::egress_today(&app.pool, "acme", now).await.unwrap(), egress_before);
    assert_eq!(row(&app.pool).await, ("pending".into(), 2, 1, 100, 100));
    assert_eq!(file_rows(&app.pool).await, vec![(0, 100, Some("a0".into()))]);

    // Process b's checkpoints: a repeated one is recorded again without moving back; files_done
    // only grows.
    store::heartbeat(&app.pool, &second, LEASE).await.unwrap().unwrap();
    store::checkpoint(&app.pool, &second, 0, &done(100, "b0"), 100).await.unwrap().unwrap();
    store::checkpoint(&app.pool, &second, 1, &done(50, "b1"), 150).await.unwrap().unwrap();
    store::checkpoint(&app.pool, &second, 0, &done(100, "b0"), 150).await.unwrap().unwrap();
    assert_eq!(row(&app.pool).await, ("pending".into(), 2, 2, 150, 100));
    assert_eq!(file_rows(&app.pool).await, vec![(0, 100, Some("b0".into())), (1, 50, Some("b1".into()))]);

    // A retry later, within the give-up time: pending, not due yet, the lease given back.
    let later = Outcome::Retry { error: "timeout: the bucket did not answer".into(), after: Duration::from_secs(600) };
    assert_eq!(store::record(&app.pool, &second, &later).await.unwrap().as_deref(), Some("pending"));
    assert!(claim(&app.pool, "process-c", &none).await.is_none(), "a delivery retried later was due at once");

    // Due again: the third attempt's retry would come after the give-up time, so it fails.
    sqlx::query("UPDATE bucket_deliveries SET next_attempt_at = now()").execute(&app.pool).await.unwrap();
    let third = claim(&app.pool, "process-c", &none).await.expect("due again");
    assert_eq!((third.attempts, third.files_done), (3, 2));
    let too_late = Outcome::Retry { error: "timeout: the bucket did not answer".into(), after: RETRY_FOR * 2 };
    assert_eq!(store::record(&app.pool, &third, &too_late).await.unwrap().as_deref(), Some("failed"));
    sqlx::query("UPDATE bucket_deliveries SET next_attempt_at = now()").execute(&app.pool).await.unwrap();
    assert!(claim(&app.pool, "process-c", &none).await.is_none(), "a failed delivery was attempted again");

    // A retry by hand: due at once, its completed files kept — but not for a tenant or a
    // principal that holds all the slots it may have.
    let id = third.id;
    store::retry(&app.pool, id, RETRY_FOR).await.unwrap();
    let tenant_full = Shares { full_tenants: vec!["acme"], ..Shares::default() };
    assert!(claim(&app.pool, "process-d", &tenant_full).await.is_none(), "a tenant at its share got a slot");
    let principal_full = Shares { full_principals: vec![("acme", "zenpartner")], ..Shares::default() };
    assert!(claim(&app.pool, "process-d", &principal_full).await.is_none(), "a principal at its share got a slot");
    let other_full = Shares { full_tenants: vec!["globex"], full_principals: vec![("acme", "warehouse")] };
    let fourth = claim(&app.pool, "process-d", &other_full).await.expect("retried by hand, due at once");
    assert_eq!((fourth.attempts, fourth.files_done, fourth.bytes_done), (4, 2, 150));

    // Delivered: one audit entry with every byte sent over all attempts.
    assert!(matches!(store::charge(&app.pool, &acme, &fourth, 25, now).await.unwrap(), Charge::Counted));
    let delivered = Outcome::Delivered { path: "lake/tickets/".into() };
    assert_eq!(store::record(&app.pool, &fourth, &delivered).await.unwrap().as_deref(), Some("delivered"));
    assert_eq!(store::record(&app.pool, &fourth, &delivered).await.unwrap(), None, "recorded twice");
    type Entry = (String, String, Option<uuid::Uuid>, Option<String>, Option<i64>);
    let audited: Vec<Entry> =
        sqlx::query_as("SELECT tenant, principal, export_id, object, bytes FROM audit_log WHERE action = 'delivered'")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    let entry = ("acme".into(), "zenpartner".into(), Some(fourth.export_id), Some("lake/tickets/".into()), Some(125));
    assert_eq!(audited, vec![entry]);
}
