//! Jobs as the API sees them: insert, find, list, cancel, revoke, the manifest, and the cleaner's
//! expiry and file bookkeeping. Reads are scoped to what the caller may see: admins their
//! tenant's jobs, partners their own; anything else reads as missing.

use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;
use uuid::Uuid;

use super::job_query;
use crate::auth::Caller;
use crate::exports::{ExportJob, ExportState};

/// A job to insert, everything but its watermark (the inserting transaction's snapshot).
pub struct NewJob<'a> {
    pub tenant: &'a str,
    pub principal: &'a str,
    pub dataset: &'a str,
    pub mode: &'a str,
    pub format: &'a str,
    pub codec: &'a str,
    pub schema_sha256: &'a str,
    pub schema_version: &'a str,
    pub exportd_version: &'a str,
    pub request: &'a Value,
    pub request_sha256: &'a str,
    pub idempotency_key: &'a str,
    pub columns: Value,
    pub filter: Value,
    pub row_filter: Value,
    pub column_policy: Option<&'a str>,
    pub hashed_key_order: bool,
    pub shard_rows: i32,
    pub from_cursor: Option<&'a str>,
    pub start_from: Option<&'a str>,
    pub start_after: Option<&'a str>,
    pub until_tick: Option<i64>,
    /// The subscription whose schedule creates it (see [`crate::delivery`]).
    pub subscription_id: Option<Uuid>,
}

/// The tenant's QUEUED jobs, and how many of them are the principal's.
pub async fn count_queued(tx: &mut PgConnection, tenant: &str, principal: &str) -> sqlx::Result<(i64, i64)> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "queued!", count(*) FILTER (WHERE principal = $2) AS "mine!"
           FROM export_jobs WHERE tenant = $1 AND state = 'QUEUED'"#,
        tenant,
        principal,
    )
    .fetch_one(tx)
    .await?;
    Ok((row.queued, row.mine))
}

/// What an insert did.
pub enum Inserted {
    Job(Box<ExportJob>),
    /// The idempotency key is taken already (a concurrent create won).
    KeyTaken,
    /// The principal has an unfinished incremental export of the dataset (one at a time).
    IncrementalInProgress,
}

/// Inserts the job QUEUED, sealed at `pg_current_snapshot()`. After `IncrementalInProgress` the
/// transaction is aborted.
pub async fn insert(tx: &mut PgConnection, job: &NewJob<'_>) -> sqlx::Result<Inserted> {
    let inserted = job_query!(
        "INSERT INTO export_jobs (id, tenant, principal, dataset, mode, format, codec, request, request_sha256,
             idempotency_key, columns, filter, row_filter, shard_rows, watermark,
             from_cursor, start_from, start_after, until_tick, schema_sha256, exportd_version, column_policy,
             schema_version, subscription_id, hashed_key_order)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, pg_current_snapshot(), $15, $16, $17, $18,
             $19, $20, $21, $22, $23, $24)
         ON CONFLICT ON CONSTRAINT export_jobs_idempotency_key DO NOTHING
         RETURNING",
        "",
        Uuid::new_v4(),
        job.tenant,
        job.principal,
        job.dataset,
        job.mode,
        job.format,
        job.codec,
        job.request,
        job.request_sha256,
        job.idempotency_key,
        &job.columns,
        &job.filter,
        &job.row_filter,
        job.shard_rows,
        job.from_cursor,
        job.start_from,
        job.start_after,
        job.until_tick,
        job.schema_sha256,
        job.exportd_version,
        job.column_policy,
        job.schema_version,
        job.subscription_id,
        job.hashed_key_order,
    )
    .fetch_optional(tx)
    .await;
    match inserted {
        Ok(Some(job)) => Ok(Inserted::Job(Box::new(job))),
        Ok(None) => Ok(Inserted::KeyTaken),
        Err(e) if e.as_database_error().and_then(|d| d.constraint()) == Some("export_jobs_one_incremental") => {
            Ok(Inserted::IncrementalInProgress)
        }
        Err(e) => Err(e),
    }
}

pub async fn find_by_key(pool: &PgPool, caller: &Caller, key: &str) -> sqlx::Result<Option<ExportJob>> {
    job_query!(
        "SELECT",
        "FROM export_jobs WHERE tenant = $1 AND principal = $2 AND idempotency_key = $3",
        caller.tenant.id.as_str(),
        caller.principal.id.as_str(),
        key,
    )
    .fetch_optional(pool)
    .await
}

/// The job if the caller may see it.
pub async fn get(pool: &PgPool, caller: &Caller, id: Uuid) -> sqlx::Result<Option<ExportJob>> {
    job_query!(
        "SELECT",
        "FROM export_jobs WHERE id = $1 AND tenant = $2 AND ($3 OR principal = $4)",
        id,
        caller.tenant.id.as_str(),
        caller.principal.is_admin(),
        caller.principal.id.as_str(),
    )
    .fetch_optional(pool)
    .await
}

/// Up to `limit` of the caller's jobs, newest first, after `(created_at, id)`.
pub async fn list(
    pool: &PgPool,
    caller: &Caller,
    state: Option<ExportState>,
    after: Option<(OffsetDateTime, Uuid)>,
    limit: i64,
) -> sqlx::Result<Vec<ExportJob>> {
    job_query!(
        "SELECT",
        "FROM export_jobs
         WHERE tenant = $1 AND ($2 OR principal = $3) AND ($4::text IS NULL OR state = $4)
           AND ($5::timestamptz IS NULL OR (created_at, id) < ($5, $6))
         ORDER BY created_at DESC, id DESC
         LIMIT $7",
        caller.tenant.id.as_str(),
        caller.principal.is_admin(),
        caller.principal.id.as_str(),
        state.map(ExportState::as_str),
        after.map(|(at, _)| at),
        after.map(|(_, id)| id),
        limit,
    )
    .fetch_all(pool)
    .await
}

/// The job if the caller may see it, row-locked until `tx` ends: orders a cancel against a
/// worker's conditional publish (whichever commits first wins; the other sees the new state).
pub async fn lock(tx: &mut PgConnection, caller: &Caller, id: Uuid) -> sqlx::Result<Option<ExportJob>> {
    job_query!(
        "SELECT",
        "FROM export_jobs WHERE id = $1 AND tenant = $2 AND ($3 OR principal = $4) FOR UPDATE",
        id,
        caller.tenant.id.as_str(),
        caller.principal.is_admin(),
        caller.principal.id.as_str(),
    )
    .fetch_optional(tx)
    .await
}

/// QUEUED or RUNNING → CANCEL_REQUESTED, for a job locked by [`lock`]; the worker ends it.
pub async fn request_cancel(tx: &mut PgConnection, id: Uuid) -> sqlx::Result<Option<ExportJob>> {
    job_query!(
        "UPDATE export_jobs SET state = 'CANCEL_REQUESTED' WHERE id = $1 AND state IN ('QUEUED', 'RUNNING')
         RETURNING",
        "",
        id,
    )
    .fetch_optional(tx)
    .await
}

/// SUCCEEDED → REVOKED, for the tenant's job; `None` if it is not (or not any more) SUCCEEDED.
pub async fn revoke(pool: &PgPool, tenant: &str, id: Uuid) -> sqlx::Result<Option<ExportJob>> {
    job_query!(
        "UPDATE export_jobs SET state = 'REVOKED' WHERE id = $1 AND tenant = $2 AND state = 'SUCCEEDED' RETURNING",
        "",
        id,
        tenant,
    )
    .fetch_optional(pool)
    .await
}

/// The published manifest bytes and their sha256, while the job is SUCCEEDED.
pub async fn manifest(pool: &PgPool, id: Uuid) -> sqlx::Result<Option<(Vec<u8>, String)>> {
    let row = sqlx::query!(
        r#"SELECT manifest AS "manifest!", manifest_sha256 AS "manifest_sha256!"
           FROM export_jobs WHERE id = $1 AND state = 'SUCCEEDED'"#,
        id,
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| (r.manifest, r.manifest_sha256)))
}

/// Stores the census's expected rows unless the job has one; returns what the job holds.
pub async fn store_rows_estimate(pool: &PgPool, id: Uuid, rows: i64) -> sqlx::Result<Option<i64>> {
    let stored = sqlx::query_scalar!(
        "UPDATE export_jobs SET rows_estimate = coalesce(rows_estimate, $2) WHERE id = $1 RETURNING rows_estimate",
        id,
        rows,
    )
    .fetch_optional(pool)
    .await?;
    Ok(stored.flatten())
}

/// SUCCEEDED → EXPIRED for every job past its retention at `now`; returns (id, tenant) of each.
pub async fn expire_due(pool: &PgPool, now: OffsetDateTime) -> sqlx::Result<Vec<(Uuid, String)>> {
    let rows = sqlx::query!(
        "UPDATE export_jobs SET state = 'EXPIRED' WHERE state = 'SUCCEEDED' AND expires_at <= $1 RETURNING id, tenant",
        now,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.tenant)).collect())
}

/// Jobs that ended without files to keep but whose files were not deleted yet: (id, tenant, state).
pub async fn ended_with_files(pool: &PgPool) -> sqlx::Result<Vec<(Uuid, String, ExportState)>> {
    let rows = sqlx::query!(
        r#"SELECT id, tenant, state AS "state: ExportState" FROM export_jobs
           WHERE exportd_export_ended_without_files(state) AND files_deleted_at IS NULL"#,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.tenant, r.state)).collect())
}

/// The job's files are gone: it no longer counts towards the tenant's stored bytes.
pub async fn mark_files_deleted(pool: &PgPool, id: Uuid) -> sqlx::Result<()> {
    sqlx::query!("UPDATE export_jobs SET files_deleted_at = now() WHERE id = $1 AND files_deleted_at IS NULL", id)
        .execute(pool)
        .await?;
    Ok(())
}

/// The state of the tenant's job `id`, if it exists (whoever may see it).
pub async fn state(pool: &PgPool, tenant: &str, id: Uuid) -> sqlx::Result<Option<ExportState>> {
    sqlx::query_scalar!(
        r#"SELECT state AS "state: ExportState" FROM export_jobs WHERE id = $1 AND tenant = $2"#,
        id,
        tenant
    )
    .fetch_optional(pool)
    .await
}
