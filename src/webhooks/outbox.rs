//! The outbox's tables: routing events to the endpoints subscribed to them, leasing due
//! deliveries, recording each attempt's outcome under its lease, and the tenant admin's view.

use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use crate::tenants::{Registry, WebhookEvent};

/// Events routed per transaction.
const ROUTE_BATCH: i64 = 100;
/// Pending deliveries one endpoint may have. Past it (an endpoint that has failed for days) new
/// deliveries are recorded as failed at once, with an error saying so: the admin sees them and
/// retries them by hand once the endpoint is back, and the outbox stays small for everyone.
pub const MAX_PENDING_PER_ENDPOINT: i64 = 10_000;

/// Creates the deliveries of events not routed yet, one per endpoint that wants the event,
/// each with its body fixed. Several processes route at once without overlap (`SKIP LOCKED`).
/// Returns how many deliveries were created.
pub async fn route(
    pool: &PgPool,
    registry: &Registry,
    public_url: Option<&reqwest::Url>,
    retry_for: Duration,
) -> sqlx::Result<u64> {
    let mut tx = pool.begin().await?;
    let events = sqlx::query_as!(
        EventRow,
        r#"SELECT id, tenant, type AS kind, principal, dataset, export_id, data, occurred_at FROM webhook_events
           WHERE routed_at IS NULL ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED"#,
        ROUTE_BATCH,
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut created = 0;
    let mut pending = std::collections::HashMap::new();
    for event in &events {
        let Some(kind) = WebhookEvent::parse(&event.kind) else { continue };
        let Some(tenant) = registry.get(&event.tenant) else { continue };
        let wanting =
            tenant.webhooks.iter().filter(|w| w.wants(kind, event.principal.as_deref(), event.dataset.as_deref()));
        for endpoint in wanting {
            let key = (event.tenant.clone(), endpoint.name.clone());
            let backlog = match pending.get(&key) {
                Some(n) => *n,
                None => pending_of(&mut tx, &event.tenant, &endpoint.name).await?,
            };
            let full = backlog >= MAX_PENDING_PER_ENDPOINT;
            let inserted = sqlx::query!(
                "INSERT INTO webhook_deliveries (event_id, tenant, endpoint, body, give_up_at, state, last_error)
                 VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5),
                         CASE WHEN $6 THEN 'failed' ELSE 'pending' END,
                         CASE WHEN $6 THEN $7 END)
                 ON CONFLICT ON CONSTRAINT webhook_deliveries_once DO NOTHING",
                event.id,
                &event.tenant,
                &endpoint.name,
                event.body(public_url),
                retry_for.as_secs_f64(),
                full,
                format!("not attempted: the endpoint already had {MAX_PENDING_PER_ENDPOINT} deliveries pending"),
            )
            .execute(&mut *tx)
            .await?
            .rows_affected();
            created += inserted;
            pending.insert(key, backlog + if full { 0 } else { inserted as i64 });
        }
    }
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    sqlx::query!("UPDATE webhook_events SET routed_at = now() WHERE id = ANY($1)", &ids).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(created)
}

/// The endpoint's pending deliveries, counted up to [`MAX_PENDING_PER_ENDPOINT`] (an index range).
async fn pending_of(tx: &mut sqlx::PgConnection, tenant: &str, endpoint: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "count!" FROM (
               SELECT 1 FROM webhook_deliveries WHERE state = 'pending' AND tenant = $1 AND endpoint = $2 LIMIT $3) p"#,
        tenant,
        endpoint,
        MAX_PENDING_PER_ENDPOINT,
    )
    .fetch_one(tx)
    .await
}

struct EventRow {
    id: Uuid,
    tenant: String,
    kind: String,
    principal: Option<String>,
    dataset: Option<String>,
    export_id: Option<Uuid>,
    data: Value,
    occurred_at: OffsetDateTime,
}

impl EventRow {
    /// `{type, timestamp, data}` as the Standard Webhooks specification suggests. Export events
    /// name the export's API paths (and URLs, given EXPORTD_PUBLIC_URL) — never a signed link.
    fn body(&self, public_url: Option<&reqwest::Url>) -> String {
        let mut data = self.data.clone();
        if let (Some(id), Some(fields)) = (self.export_id, data.as_object_mut()) {
            let mut paths = vec![("export", format!("/v1/exports/{id}"))];
            if self.kind == WebhookEvent::ExportSucceeded.as_str() {
                paths.push(("manifest", format!("/v1/exports/{id}/manifest")));
            }
            for (name, path) in paths {
                if let Some(url) = public_url.and_then(|base| base.join(&path).ok()) {
                    fields.insert(format!("{name}_url"), Value::String(url.to_string()));
                }
                fields.insert(format!("{name}_path"), Value::String(path));
            }
        }
        let timestamp = self.occurred_at.format(&Rfc3339).unwrap_or_default();
        json!({ "type": self.kind, "timestamp": timestamp, "data": data }).to_string()
    }
}

/// A delivery leased for one attempt.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub id: Uuid,
    pub event_id: Uuid,
    pub tenant: String,
    pub endpoint: String,
    pub body: String,
    /// This attempt's number (1 for the first); fences its result.
    pub attempts: i32,
}

/// Leases up to `limit` due deliveries for one attempt each: per endpoint only its oldest
/// pending delivery, and only when no attempt of that endpoint is in flight — so an endpoint
/// gets one request at a time, oldest event first — and at most `per_tenant` of one tenant, so
/// a tenant with many slow endpoints cannot hold every attempt slot. The endpoints with pending
/// deliveries are found by skipping through the pending index (one probe per endpoint), and
/// each one's head by one more: the cost follows the endpoints, not the backlog.
pub async fn claim(
    pool: &PgPool,
    owner: &str,
    lease: Duration,
    limit: i64,
    per_tenant: i64,
) -> sqlx::Result<Vec<Attempt>> {
    sqlx::query_as!(
        Attempt,
        "WITH RECURSIVE endpoints AS (
             (SELECT tenant, endpoint FROM webhook_deliveries WHERE state = 'pending'
               ORDER BY tenant, endpoint, seq LIMIT 1)
             UNION ALL
             SELECT n.tenant, n.endpoint FROM endpoints e CROSS JOIN LATERAL (
                 SELECT tenant, endpoint FROM webhook_deliveries
                  WHERE state = 'pending' AND (tenant, endpoint) > (e.tenant, e.endpoint)
                  ORDER BY tenant, endpoint, seq LIMIT 1) n),
         heads AS (
             SELECT h.id, h.tenant, h.next_attempt_at, h.lease_expires_at FROM endpoints e CROSS JOIN LATERAL (
                 SELECT id, tenant, next_attempt_at, lease_expires_at FROM webhook_deliveries
                  WHERE state = 'pending' AND tenant = e.tenant AND endpoint = e.endpoint
                  ORDER BY seq LIMIT 1) h),
         ready AS (
             SELECT id, next_attempt_at, row_number() OVER (PARTITION BY tenant ORDER BY next_attempt_at) AS nth
               FROM heads
              WHERE next_attempt_at <= now() AND (lease_expires_at IS NULL OR lease_expires_at < now())),
         due AS (
             SELECT d.id FROM webhook_deliveries d JOIN ready r ON r.id = d.id
              WHERE r.nth <= $4
              ORDER BY r.next_attempt_at LIMIT $3 FOR UPDATE OF d SKIP LOCKED)
         UPDATE webhook_deliveries d
            SET attempts = d.attempts + 1, lease_owner = $1,
                lease_expires_at = now() + make_interval(secs => $2), last_attempt_at = now()
           FROM due
          WHERE d.id = due.id AND d.state = 'pending'
            AND (d.lease_expires_at IS NULL OR d.lease_expires_at < now())
         RETURNING d.id, d.event_id, d.tenant, d.endpoint, d.body, d.attempts",
        owner,
        lease.as_secs_f64(),
        limit,
        per_tenant,
    )
    .fetch_all(pool)
    .await
}

/// What one attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer.
    Delivered { status: u16 },
    /// Try again after the backoff (until the delivery's give-up time).
    Retry { status: Option<u16>, error: String },
    /// No point trying again (the endpoint is no longer configured).
    GiveUp { error: String },
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Delivered { .. } => "delivered",
            Outcome::Retry { .. } => "retrying",
            Outcome::GiveUp { .. } => "failed",
        }
    }
}

/// Records an attempt's outcome, only while `attempt` still holds the lease (a stale attempt
/// whose lease expired and was taken over records nothing). Returns the delivery's new state,
/// or `None` when the lease was lost.
pub async fn record(
    pool: &PgPool,
    owner: &str,
    attempt: &Attempt,
    outcome: &Outcome,
    retry_after: Duration,
) -> sqlx::Result<Option<String>> {
    let (status, error, give_up) = match outcome {
        Outcome::Delivered { status } => (Some(i32::from(*status)), None, false),
        Outcome::Retry { status, error } => (status.map(i32::from), Some(error.as_str()), false),
        Outcome::GiveUp { error } => (None, Some(error.as_str()), true),
    };
    let delivered = matches!(outcome, Outcome::Delivered { .. });
    sqlx::query_scalar!(
        "UPDATE webhook_deliveries SET
             state = CASE WHEN $4 THEN 'delivered'
                          WHEN $6 OR now() + make_interval(secs => $7) > give_up_at THEN 'failed'
                          ELSE 'pending' END,
             delivered_at = CASE WHEN $4 THEN now() END,
             next_attempt_at = CASE WHEN $4 THEN next_attempt_at ELSE now() + make_interval(secs => $7) END,
             last_status = $5, last_error = $8, lease_owner = NULL, lease_expires_at = NULL
         WHERE id = $1 AND attempts = $2 AND lease_owner = $3 AND state = 'pending'
         RETURNING state",
        attempt.id,
        attempt.attempts,
        owner,
        delivered,
        status,
        give_up,
        retry_after.as_secs_f64(),
        error
    )
    .fetch_optional(pool)
    .await
}

/// One delivery as a tenant admin sees it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DeliveryView {
    pub id: Uuid,
    /// The `webhook-id` header: the same on every attempt.
    pub event_id: Uuid,
    pub event: String,
    pub export_id: Option<Uuid>,
    pub endpoint: String,
    /// `pending`, `delivered` or `failed`.
    pub state: String,
    pub attempts: i32,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_attempt_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub next_attempt_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub delivered_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(skip)]
    pub seq: i64,
}

/// `query_as!` of [`DeliveryView`]s of deliveries `d` joined with their events `e`, then `$rest`.
macro_rules! select_deliveries {
    ($rest:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            DeliveryView,
            "SELECT d.id, d.event_id, e.type AS event, e.export_id, d.endpoint, d.state, d.attempts,
                    d.last_status, d.last_error, d.last_attempt_at,
                    CASE WHEN d.state = 'pending' THEN d.next_attempt_at END AS next_attempt_at, d.delivered_at,
                    d.created_at, d.seq
             FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id "
                + $rest
            $(, $arg)*
        )
    };
}

/// Which deliveries to list.
#[derive(Debug, Default)]
pub struct DeliveryFilter<'a> {
    pub endpoint: Option<&'a str>,
    pub event: Option<WebhookEvent>,
    pub state: Option<&'a str>,
    pub export_id: Option<Uuid>,
    /// Only deliveries older than this listing position.
    pub before: Option<i64>,
}

/// The tenant's deliveries, newest first, and the position to continue from.
pub async fn list(
    pool: &PgPool,
    tenant: &str,
    filter: &DeliveryFilter<'_>,
    limit: u32,
) -> sqlx::Result<(Vec<DeliveryView>, Option<i64>)> {
    let mut rows = select_deliveries!(
        "WHERE d.tenant = $1 AND ($2::text IS NULL OR d.endpoint = $2) AND ($3::text IS NULL OR e.type = $3)
           AND ($4::text IS NULL OR d.state = $4) AND ($5::uuid IS NULL OR e.export_id = $5)
           AND ($6::bigint IS NULL OR d.seq < $6)
         ORDER BY d.seq DESC LIMIT $7",
        tenant,
        filter.endpoint,
        filter.event.map(WebhookEvent::as_str),
        filter.state,
        filter.export_id,
        filter.before,
        i64::from(limit) + 1,
    )
    .fetch_all(pool)
    .await?;
    let more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let next = if more { rows.last().map(|r| r.seq) } else { None };
    Ok((rows, next))
}

/// Schedules a delivered or failed delivery again, now, with a fresh retry period (a pending
/// one is left as it is). `None`: no such delivery of this tenant.
pub async fn retry(pool: &PgPool, tenant: &str, id: Uuid, retry_for: Duration) -> sqlx::Result<Option<DeliveryView>> {
    sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'pending', next_attempt_at = now(),
             give_up_at = now() + make_interval(secs => $3), delivered_at = NULL
         WHERE id = $1 AND tenant = $2 AND state <> 'pending'",
        id,
        tenant,
        retry_for.as_secs_f64()
    )
    .execute(pool)
    .await?;
    select_deliveries!("WHERE d.id = $1 AND d.tenant = $2", id, tenant).fetch_optional(pool).await
}

/// The pending deliveries and the age of the oldest (for `/metrics`).
pub async fn pending(pool: &PgPool) -> sqlx::Result<(i64, Option<OffsetDateTime>)> {
    let pending = sqlx::query!(
        r#"SELECT count(*) AS "count!", min(created_at) AS oldest FROM webhook_deliveries WHERE state = 'pending'"#
    )
    .fetch_one(pool)
    .await?;
    Ok((pending.count, pending.oldest))
}

/// Forgets events (and their deliveries) older than `keep` once none is pending.
pub async fn collect(pool: &PgPool, now: OffsetDateTime, keep: Duration) -> sqlx::Result<u64> {
    let deleted = sqlx::query!(
        "DELETE FROM webhook_events e WHERE occurred_at < $1::timestamptz - make_interval(secs => $2) AND routed_at IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = e.id AND d.state = 'pending')",
        now,
        keep.as_secs_f64()
    )
    .execute(pool)
    .await?;
    Ok(deleted.rows_affected())
}
