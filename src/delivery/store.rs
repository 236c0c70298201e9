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
}

/// The attempt's lease is gone: another process took the delivery over (or a retry by hand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost;

/// What a process already runs, so one claim keeps to the shares: tenants and principals
/// (`(tenant, principal)`) holding all the slots they may have here are skipped.
#[derive(Debug, Default)]
pub struct Shares<'a> {
    pub full_tenants: Vec<&'a str>,
    pub full_principals: Vec<(&'a str, &'a str)>,
}

/// Leases a due delivery whose subscription has nothing older undelivered (so a partner's bucket
/// receives its exports in order, and a failed one holds the rest until it is retried), skipping
/// the tenants and principals at their share. Among the rest, the tenant with the fewest
/// deliveries running anywhere comes first, then its principal with the fewest, then the oldest
/// due. Sets the give-up time on the first attempt.
pub async fn claim(
    pool: &PgPool,
    owner: &str,
    lease: Duration,
    retry_for: Duration,
    shares: &Shares<'_>,
) -> sqlx::Result<Option<Claimed>> {
    let (principal_tenants, principals): (Vec<&str>, Vec<&str>) = shares.full_principals.iter().copied().unzip();
    sqlx::query_as!(
        Claimed,
        r#"WITH running AS (
               SELECT tenant, principal, count(*) AS n FROM bucket_deliveries
                WHERE state = 'pending' AND lease_expires_at > now() GROUP BY tenant, principal),
           due AS (
               SELECT d.id FROM bucket_deliveries d
                WHERE d.state = 'pending' AND d.next_attempt_at <= now()
                  AND (d.lease_expires_at IS NULL OR d.lease_expires_at < now())
                  AND NOT EXISTS (SELECT 1 FROM bucket_deliveries o
                                   WHERE o.subscription_id = d.subscription_id AND o.state <> 'delivered'
                                     AND o.seq < d.seq)
                  AND d.tenant <> ALL($4::text[])
                  AND NOT EXISTS (SELECT 1 FROM unnest($5::text[], $6::text[]) AS full_(tenant, principal)
                                   WHERE full_.tenant = d.tenant AND full_.principal = d.principal)
                ORDER BY (SELECT coalesce(sum(r.n), 0) FROM running r WHERE r.tenant = d.tenant),
                         (SELECT coalesce(sum(r.n), 0) FROM running r
                           WHERE r.tenant = d.tenant AND r.principal = d.principal),
                         d.next_attempt_at, d.seq
                LIMIT 1 FOR UPDATE OF d SKIP LOCKED)
           UPDATE bucket_deliveries d
              SET attempts = d.attempts + 1, lease_generation = d.lease_generation + 1, lease_owner = $1,
                  lease_expires_at = now() + make_interval(secs => $2), last_attempt_at = now(),
                  give_up_at = coalesce(d.give_up_at, now() + make_interval(secs => $3))
             FROM due
            WHERE d.id = due.id
        RETURNING d.id, d.tenant, d.principal, d.subscription, d.destination, d.export_id, d.dataset,
                  d.lease_generation AS generation, d.attempts, d.files_done, d.bytes_done"#,
        owner,
        lease.as_secs_f64(),
        retry_for.as_secs_f64(),
        &shares.full_tenants as &[&str],
        &principal_tenants as &[&str],
        &principals as &[&str],
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

/// A file completed in the bucket: its size and ETag as the bucket reported them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub bytes: i64,
    pub e_tag: Option<String>,
}

/// Records that file `ordinal` (0-based, in delivery order) is in the bucket, verified, as
/// `completed`: every file up to it is done, `bytes_done` bytes of them.
pub async fn checkpoint(
    pool: &PgPool,
    claimed: &Claimed,
    ordinal: i32,
    completed: &Completed,
    bytes_done: i64,
) -> sqlx::Result<Result<(), LeaseLost>> {
    let mut tx = pool.begin().await?;
    let recorded = sqlx::query!(
        "UPDATE bucket_deliveries SET files_done = greatest(files_done, $3 + 1), bytes_done = $4
          WHERE id = $1 AND lease_generation = $2 AND state = 'pending'",
        claimed.id,
        claimed.generation,
        ordinal,
        bytes_done,
    )
    .execute(&mut *tx)
    .await?;
    if recorded.rows_affected() == 0 {
        return Ok(Err(LeaseLost));
    }
    sqlx::query!(
        "INSERT INTO bucket_delivery_files (delivery_id, ordinal, bytes, e_tag) VALUES ($1, $2, $3, $4)
         ON CONFLICT (delivery_id, ordinal) DO UPDATE SET bytes = excluded.bytes, e_tag = excluded.e_tag",
        claimed.id,
        ordinal,
        completed.bytes,
        completed.e_tag,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// The files earlier attempts completed, in order (the first `files_done`).
pub async fn completed_files(pool: &PgPool, claimed: &Claimed) -> sqlx::Result<Vec<Completed>> {
    sqlx::query_as!(
        Completed,
        "SELECT bytes, e_tag FROM bucket_delivery_files WHERE delivery_id = $1 AND ordinal < $2 ORDER BY ordinal",
        claimed.id,
        claimed.files_done,
    )
    .fetch_all(pool)
    .await
}

/// Whether a file's bytes may be sent.
#[derive(Debug)]
pub enum Charge {
    /// Counted against today's egress quota and in the delivery's `bytes_sent`.
    Counted,
    OverQuota(crate::quota::Rejection),
    LeaseLost,
}

/// Counts `bytes` about to be sent against the tenant's egress quota and the delivery's
/// `bytes_sent`, in one transaction under the lease. Every push counts: a file sent again (its
/// upload failed, or the partner removed it) is counted again.
pub async fn charge(
    pool: &PgPool,
    tenant: &crate::tenants::Tenant,
    claimed: &Claimed,
    bytes: u64,
    now: OffsetDateTime,
) -> anyhow::Result<Charge> {
    let mut tx = pool.begin().await?;
    if let Err(rejection) = crate::quota::egress::admit(&mut tx, tenant, bytes, now).await? {
        return Ok(Charge::OverQuota(rejection));
    }
    let counted = sqlx::query!(
        "UPDATE bucket_deliveries SET bytes_sent = bytes_sent + $3
          WHERE id = $1 AND lease_generation = $2 AND state = 'pending'",
        claimed.id,
        claimed.generation,
        bytes as i64,
    )
    .execute(&mut *tx)
    .await?;
    if counted.rows_affected() == 0 {
        return Ok(Charge::LeaseLost);
    }
    tx.commit().await?;
    Ok(Charge::Counted)
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every file and `_SUCCESS` are in the bucket, the folder at `path` (for the audit entry).
    Delivered { path: String },
    /// Try again after `after` (failed once the give-up time has passed).
    Retry { error: String, after: Duration },
    /// No point trying again until someone changes something.
    Fail { error: String },
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Delivered { .. } => "delivered",
            Outcome::Retry { .. } => "retry",
            Outcome::Fail { .. } => "failed",
        }
    }
}

/// Records the outcome under the attempt's lease; returns the state it left, or `None` when the
/// lease was lost meanwhile (the newer attempt decides). A delivery gets its `delivered` audit
/// entry (the bytes sent over all its attempts) in the same transaction.
pub async fn record(pool: &PgPool, claimed: &Claimed, outcome: &Outcome) -> sqlx::Result<Option<String>> {
    let (state, error, after): (&str, Option<&str>, f64) = match outcome {
        Outcome::Delivered { .. } => ("delivered", None, 0.0),
        Outcome::Retry { error, after } => ("pending", Some(error), after.as_secs_f64()),
        Outcome::Fail { error } => ("failed", Some(error), 0.0),
    };
    let mut tx = pool.begin().await?;
    let recorded = sqlx::query!(
        "UPDATE bucket_deliveries
            SET state = CASE WHEN $3 = 'pending' AND now() + make_interval(secs => $5) > give_up_at
                             THEN 'failed' ELSE $3 END,
                last_error = $4, next_attempt_at = now() + make_interval(secs => $5),
                delivered_at = CASE WHEN $3 = 'delivered' THEN now() END,
                lease_owner = NULL, lease_expires_at = NULL
          WHERE id = $1 AND lease_generation = $2 AND state = 'pending'
         RETURNING state, bytes_sent",
        claimed.id,
        claimed.generation,
        state,
        error,
        after,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(recorded) = recorded else { return Ok(None) };
    if let Outcome::Delivered { path } = outcome {
        let event = crate::audit::AuditEvent {
            tenant: &claimed.tenant,
            principal: &claimed.principal,
            action: "delivered",
            export_id: Some(claimed.export_id),
            object: Some(path.clone()),
            bytes: Some(recorded.bytes_sent as u64),
            ..Default::default()
        };
        crate::audit::insert(&mut *tx, &event).await?;
    }
    tx.commit().await?;
    Ok(Some(recorded.state))
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
    /// Every byte pushed into the bucket over all attempts (what egress counted).
    pub bytes_sent: i64,
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
                  bytes_done, bytes_sent, last_error, last_attempt_at,
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

/// A failed delivery is pending again now, with a fresh retry period. Its next attempt skips
/// the files still in the bucket as it completed them (size and ETag) and sends the rest.
pub async fn retry(pool: &PgPool, id: Uuid, retry_for: Duration) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE bucket_deliveries
            SET state = 'pending', next_attempt_at = now(), give_up_at = now() + make_interval(secs => $2),
                last_error = NULL
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
