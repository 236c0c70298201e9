//! The deliveries' table: leasing due deliveries (one at a time per subscription, oldest first),
//! checkpoints and outcomes under the lease's generation, and the API's view.

use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

/// A delivery leased for one attempt.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub id: Uuid,
    pub tenant: String,
    pub principal: String,
    pub subscription: String,
    pub destination: String,
    pub export_id: Uuid,
    pub dataset: String,
    /// Fences every write of this attempt.
    pub generation: i64,
    pub attempts: i32,
    pub files_done: i32,
    pub bytes_done: i64,
    pub egress_counted: bool,
}

/// The attempt's lease is gone: another process took the delivery over (or a retry by hand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost;

/// Leases the oldest due delivery whose subscription has nothing older undelivered (so a
/// partner's bucket receives its exports in order, and a failed one holds the rest until it is
/// retried). Sets its give-up time on the first attempt.
pub async fn claim(pool: &PgPool, owner: &str, lease: Duration, retry_for: Duration) -> sqlx::Result<Option<Claimed>> {
    sqlx::query_as!(
        Claimed,
        r#"WITH due AS (
               SELECT d.id FROM bucket_deliveries d
                WHERE d.state = 'pending' AND d.next_attempt_at <= now()
                  AND (d.lease_expires_at IS NULL OR d.lease_expires_at < now())
                  AND NOT EXISTS (SELECT 1 FROM bucket_deliveries o
                                   WHERE o.subscription_id = d.subscription_id AND o.state <> 'delivered'
                                     AND o.seq < d.seq)
                ORDER BY d.next_attempt_at, d.seq LIMIT 1 FOR UPDATE OF d SKIP LOCKED)
           UPDATE bucket_deliveries d
              SET attempts = d.attempts + 1, lease_generation = d.lease_generation + 1, lease_owner = $1,
                  lease_expires_at = now() + make_interval(secs => $2), last_attempt_at = now(),
                  give_up_at = coalesce(d.give_up_at, now() + make_interval(secs => $3))
             FROM due
            WHERE d.id = due.id
        RETURNING d.id, d.tenant, d.principal, d.subscription, d.destination, d.export_id, d.dataset,
                  d.lease_generation AS generation, d.attempts, d.files_done, d.bytes_done, d.egress_counted"#,
        owner,
        lease.as_secs_f64(),
        retry_for.as_secs_f64(),
    )
    .fetch_optional(pool)
    .await
}

/// Extends the lease; `Err(LeaseLost)` when this attempt no longer holds it.
pub async fn heartbeat(pool: &PgPool, claimed: &Claimed, lease: Duration) -> sqlx::Result<Result<(), LeaseLost>> {
    let renewed = sqlx::query!(
        "UPDATE bucket_deliveries SET lease_expires_at = now() + make_interval(secs => $3)
          WHERE id = $1 AND lease_generation = $2 AND state = 'pending'",
        claimed.id,
        claimed.generation,
        lease.as_secs_f64(),
    )
    .execute(pool)
    .await?;
    Ok(if renewed.rows_affected() == 1 { Ok(()) } else { Err(LeaseLost) })
}

/// Records that the first `files` files (of `bytes` bytes) are in the bucket, verified.
pub async fn checkpoint(
    pool: &PgPool,
    claimed: &Claimed,
    files: i32,
    bytes: i64,
) -> sqlx::Result<Result<(), LeaseLost>> {
    let recorded = sqlx::query!(
        "UPDATE bucket_deliveries SET files_done = $3, bytes_done = $4
          WHERE id = $1 AND lease_generation = $2 AND state = 'pending'",
        claimed.id,
        claimed.generation,
        files,
        bytes,
    )
    .execute(pool)
    .await?;
    Ok(if recorded.rows_affected() == 1 { Ok(()) } else { Err(LeaseLost) })
}

/// Counts the export's bytes against the tenant's egress quota, once: in one transaction with
/// the delivery's flag and an audit entry. `Ok(Err(rejection))` when today's quota is used up.
pub async fn count_egress(
    pool: &PgPool,
    tenant: &crate::tenants::Tenant,
    claimed: &Claimed,
    bytes: u64,
    bucket_path: &str,
    now: OffsetDateTime,
) -> anyhow::Result<Result<(), crate::quota::Rejection>> {
    let mut tx = pool.begin().await?;
    if let Err(rejection) = crate::quota::egress::admit(&mut tx, tenant, bytes, now).await? {
        return Ok(Err(rejection));
    }
    let event = crate::audit::AuditEvent {
        tenant: tenant.id.as_str(),
        principal: &claimed.principal,
        action: "delivered",
        export_id: Some(claimed.export_id),
        object: Some(bucket_path.to_owned()),
        bytes: Some(bytes),
        ..Default::default()
    };
    crate::audit::insert(&mut *tx, &event).await?;
    let marked = sqlx::query!(
        "UPDATE bucket_deliveries SET egress_counted = true
          WHERE id = $1 AND lease_generation = $2 AND state = 'pending' AND NOT egress_counted",
        claimed.id,
        claimed.generation,
    )
    .execute(&mut *tx)
    .await?;
    if marked.rows_affected() == 0 {
        anyhow::bail!("the delivery's lease was lost before its egress was counted");
    }
    tx.commit().await?;
    Ok(Ok(()))
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Delivered,
    /// Try again after `after` (failed once the give-up time has passed).
    Retry {
        error: String,
        after: Duration,
    },
    /// No point trying again until someone changes something.
    Fail {
        error: String,
    },
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Delivered => "delivered",
            Outcome::Retry { .. } => "retry",
            Outcome::Fail { .. } => "failed",
        }
    }
}

/// Records the outcome under the attempt's lease; returns the state it left, or `None` when the
/// lease was lost meanwhile (the newer attempt decides).
pub async fn record(pool: &PgPool, claimed: &Claimed, outcome: &Outcome) -> sqlx::Result<Option<String>> {
    let (state, error, after): (&str, Option<&str>, f64) = match outcome {
        Outcome::Delivered => ("delivered", None, 0.0),
        Outcome::Retry { error, after } => ("pending", Some(error), after.as_secs_f64()),
        Outcome::Fail { error } => ("failed", Some(error), 0.0),
    };
    sqlx::query_scalar!(
        "UPDATE bucket_deliveries
            SET state = CASE WHEN $3 = 'pending' AND now() + make_interval(secs => $5) > give_up_at
                             THEN 'failed' ELSE $3 END,
                last_error = $4, next_attempt_at = now() + make_interval(secs => $5),
                delivered_at = CASE WHEN $3 = 'delivered' THEN now() END,
                lease_owner = NULL, lease_expires_at = NULL
          WHERE id = $1 AND lease_generation = $2 AND state = 'pending'
         RETURNING state",
        claimed.id,
        claimed.generation,
        state,
        error,
        after,
    )
    .fetch_optional(pool)
    .await
}

/// A delivery as the API shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DeliveryView {
    pub id: Uuid,
    pub subscription: String,
    pub destination: String,
    pub principal: String,
    pub export_id: Uuid,
    pub dataset: String,
    pub mode: String,
    /// `pending`, `delivered` or `failed`.
    pub state: String,
    pub attempts: i32,
    pub files_done: i32,
    pub bytes_done: i64,
    pub last_error: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_attempt_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub next_attempt_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub delivered_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// Where the export's folder is in the bucket (filled in from the destination).
    pub path: Option<String>,
    #[serde(skip)]
    pub seq: i64,
}

/// A page of deliveries, newest first: the tenant's, or one principal's; optionally of one state
/// or subscription; before `before` (a `seq`).
pub async fn list(
    pool: &PgPool,
    tenant: &str,
    principal: Option<&str>,
    state: Option<&str>,
    subscription: Option<&str>,
    before: Option<i64>,
    limit: i64,
) -> sqlx::Result<Vec<DeliveryView>> {
    select(pool, tenant, principal, None, state, subscription, before, limit).await
}

/// One delivery, if `principal` (or any, for `None`: an admin) of the tenant may see it.
pub async fn get(pool: &PgPool, tenant: &str, principal: Option<&str>, id: Uuid) -> sqlx::Result<Option<DeliveryView>> {
    Ok(select(pool, tenant, principal, Some(id), None, None, None, 1).await?.pop())
}

#[allow(clippy::too_many_arguments)] // one statement behind both readers
async fn select(
    pool: &PgPool,
    tenant: &str,
    principal: Option<&str>,
    id: Option<Uuid>,
    state: Option<&str>,
    subscription: Option<&str>,
    before: Option<i64>,
    limit: i64,
) -> sqlx::Result<Vec<DeliveryView>> {
    sqlx::query_as!(
        DeliveryView,
        r#"SELECT id, subscription, destination, principal, export_id, dataset, mode, state, attempts, files_done,
                  bytes_done, last_error, last_attempt_at,
                  CASE WHEN state = 'pending' THEN next_attempt_at END AS next_attempt_at,
                  delivered_at, created_at, NULL::text AS path, seq AS "seq!"
             FROM bucket_deliveries
            WHERE tenant = $1 AND ($2::text IS NULL OR principal = $2) AND ($3::uuid IS NULL OR id = $3)
              AND ($4::text IS NULL OR state = $4) AND ($5::text IS NULL OR subscription = $5)
              AND ($6::bigint IS NULL OR seq < $6)
            ORDER BY seq DESC LIMIT $7"#,
        tenant,
        principal,
        id,
        state,
        subscription,
        before,
        limit,
    )
    .fetch_all(pool)
    .await
}

/// A failed delivery is pending again now, with a fresh retry period; the files already in the
/// bucket are written again (same names, same bytes). Returns the state found before.
pub async fn retry(pool: &PgPool, id: Uuid, retry_for: Duration) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE bucket_deliveries
            SET state = 'pending', next_attempt_at = now(), give_up_at = now() + make_interval(secs => $2),
                files_done = 0, bytes_done = 0, last_error = NULL
          WHERE id = $1 AND state = 'failed'",
        id,
        retry_for.as_secs_f64(),
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// How far one subscription's deliveries are behind (the dashboard).
#[derive(Debug, Clone)]
pub struct Lag {
    pub subscription: String,
    /// Deliveries not delivered yet (pending or failed).
    pub undelivered: i64,
    pub failed: i64,
    /// When the oldest undelivered export was published (how long the bucket has lacked it).
    pub oldest_undelivered_at: Option<OffsetDateTime>,
    pub last_delivered_at: Option<OffsetDateTime>,
    /// The newest failed delivery's reason.
    pub last_failure: Option<String>,
}

/// Each subscription of the tenant that has deliveries: how far behind it is.
pub async fn lag(pool: &PgPool, tenant: &str) -> sqlx::Result<Vec<Lag>> {
    sqlx::query_as!(
        Lag,
        r#"SELECT subscription AS "subscription!",
                  count(*) FILTER (WHERE state <> 'delivered') AS "undelivered!",
                  count(*) FILTER (WHERE state = 'failed') AS "failed!",
                  min(created_at) FILTER (WHERE state <> 'delivered') AS oldest_undelivered_at,
                  max(delivered_at) AS last_delivered_at,
                  (array_agg(last_error ORDER BY seq DESC) FILTER (WHERE state = 'failed'))[1] AS last_failure
             FROM bucket_deliveries WHERE tenant = $1 GROUP BY subscription ORDER BY subscription"#,
        tenant,
    )
    .fetch_all(pool)
    .await
}
