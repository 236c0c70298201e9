//! What the rest of exportd reads about exports — usage, usage history, metrics, partners,
//! estimates and feed GC — each as one question answered here.

use std::collections::{BTreeMap, HashMap};

use sqlx::{PgConnection, PgExecutor, PgPool};
use time::OffsetDateTime;

use crate::auth::Caller;
use crate::exports::states::{PUBLISHED, UNFINISHED};

/// The tenant's exports per state.
pub async fn states(pool: &PgPool, tenant: &str) -> sqlx::Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM export_jobs WHERE tenant = $1 GROUP BY state")
            .bind(tenant)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().collect())
}

/// When the tenant's oldest QUEUED export was created and its oldest RUNNING one started.
pub async fn oldest_waiting(
    pool: &PgPool,
    tenant: &str,
) -> sqlx::Result<(Option<OffsetDateTime>, Option<OffsetDateTime>)> {
    sqlx::query_as(
        "SELECT min(created_at) FILTER (WHERE state = 'QUEUED'), min(started_at) FILTER (WHERE state = 'RUNNING')
         FROM export_jobs WHERE tenant = $1",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await
}

/// Bytes of the tenant's export files that exist (one row per job, kept equal to the sum of its
/// checkpoints by [`super::lease::record_shard`]).
pub async fn stored_bytes(db: impl PgExecutor<'_>, tenant: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT coalesce(sum(bytes_done), 0)::bigint FROM export_jobs WHERE tenant = $1 AND files_deleted_at IS NULL",
    )
    .bind(tenant)
    .fetch_one(db)
    .await
}

/// Rows of the tenant's exports published (and finished) since `since`.
pub async fn rows_published_since(pool: &PgPool, tenant: &str, since: OffsetDateTime) -> sqlx::Result<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT coalesce(sum(rows_done), 0)::bigint FROM export_jobs WHERE tenant = $1 AND state IN {PUBLISHED}
           AND finished_at >= $2"
    )))
    .bind(tenant)
    .bind(since)
    .fetch_one(pool)
    .await
}

/// Exports per tenant and state, with the oldest start (or creation) of each group.
pub async fn by_tenant_and_state(pool: &PgPool) -> sqlx::Result<Vec<(String, String, i64, Option<OffsetDateTime>)>> {
    sqlx::query_as(
        "SELECT tenant, state, count(*), min(coalesce(started_at, created_at)) FROM export_jobs GROUP BY tenant, state",
    )
    .fetch_all(pool)
    .await
}

/// Exports created since `since`, per principal of the tenant.
pub async fn created_per_principal(
    pool: &PgPool,
    tenant: &str,
    since: OffsetDateTime,
) -> sqlx::Result<HashMap<String, i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT principal, count(*) FROM export_jobs WHERE tenant = $1 AND created_at >= $2 GROUP BY principal",
    )
    .bind(tenant)
    .bind(since)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// The snapshots unfinished exports still read at: full exports' watermarks and incremental
/// exports' starts. History they can see must be kept.
pub async fn live_snapshots(pool: &PgPool, tenant: &str) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT watermark::text FROM export_jobs WHERE tenant = $1 AND state IN {UNFINISHED}
         UNION ALL
         SELECT start_from FROM export_jobs WHERE tenant = $1 AND start_from IS NOT NULL AND state IN {UNFINISHED}"
    )))
    .bind(tenant)
    .fetch_all(pool)
    .await
}

/// Whether an unfinished incremental export of the tenant may still read feed windows.
pub async fn incremental_unfinished(pool: &PgPool, tenant: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT EXISTS (SELECT 1 FROM export_jobs WHERE tenant = $1 AND start_from IS NOT NULL AND state IN {UNFINISHED})"
    )))
    .bind(tenant)
    .fetch_one(pool)
    .await
}

/// Rows and seconds (claim to publish) of the tenant's recent published exports of `mode` with
/// at least `min_rows` rows — of `dataset` if there are any (`true`), else of any dataset.
pub async fn recent_throughput(
    pool: &PgPool,
    tenant: &str,
    mode: &str,
    dataset: &str,
    min_rows: i64,
) -> sqlx::Result<Option<(bool, f64, f64)>> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT same_dataset, sum(rows_done)::float8, sum(extract(epoch FROM finished_at - started_at))::float8
         FROM (SELECT dataset = $3 AS same_dataset, rows_done, started_at, finished_at FROM export_jobs
               WHERE tenant = $1 AND mode = $2 AND state IN {PUBLISHED}
                 AND rows_done >= $4 AND started_at IS NOT NULL AND finished_at > now() - interval '30 days'
               ORDER BY finished_at DESC LIMIT 200) recent
         GROUP BY same_dataset ORDER BY same_dataset DESC LIMIT 1"
    )))
    .bind(tenant)
    .bind(mode)
    .bind(dataset)
    .bind(min_rows)
    .fetch_optional(pool)
    .await
}

/// QUEUED and RUNNING exports the caller may see, and the rows they have left by their own
/// estimates.
pub async fn work_ahead(pool: &PgPool, caller: &Caller) -> sqlx::Result<(i64, i64)> {
    sqlx::query_as(
        "SELECT count(*), coalesce(sum(GREATEST(coalesce(rows_estimate, planned_rows), planned_rows) - rows_done), 0)::bigint
         FROM export_jobs
         WHERE tenant = $1 AND ($2 OR principal = $3) AND state IN ('QUEUED', 'RUNNING')",
    )
    .bind(caller.tenant.id.as_str())
    .bind(caller.principal.is_admin())
    .bind(caller.principal.id.as_str())
    .fetch_one(pool)
    .await
}

/// Exports of a tenant that ended in one hour.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct FinishedInHour {
    pub tenant: String,
    /// Rows of the published ones.
    pub rows: i64,
    pub succeeded: i32,
    pub failed: i32,
    pub cancelled: i32,
    /// Seconds from create to publish, median and 95th percentile.
    pub p50: Option<f64>,
    pub p95: Option<f64>,
}

/// Per tenant of `tenants`, the exports that finished in the UTC hour starting at `hour`.
pub async fn finished_in_hour(
    conn: &mut PgConnection,
    hour: OffsetDateTime,
    tenants: &[String],
) -> sqlx::Result<Vec<FinishedInHour>> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT j.tenant,
                coalesce(sum(j.rows_done) FILTER (WHERE j.state IN {PUBLISHED}), 0)::bigint AS rows,
                count(*) FILTER (WHERE j.state IN {PUBLISHED})::int AS succeeded,
                count(*) FILTER (WHERE j.state = 'FAILED')::int AS failed,
                count(*) FILTER (WHERE j.state = 'CANCELLED')::int AS cancelled,
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.finished_at - j.created_at))
                    FILTER (WHERE j.state IN {PUBLISHED}) AS p50,
                percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM j.finished_at - j.created_at))
                    FILTER (WHERE j.state IN {PUBLISHED}) AS p95
         FROM export_jobs j
         WHERE j.finished_at >= $1 AND j.finished_at < $1 + interval '1 hour' AND j.tenant = ANY($2)
         GROUP BY j.tenant"
    )))
    .bind(hour)
    .bind(tenants)
    .fetch_all(conn)
    .await
}

/// A tenant's export gauges right now.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Gauges {
    pub tenant: String,
    pub stored_bytes: i64,
    pub queued: i32,
    pub running: i32,
    /// Age of the oldest QUEUED export, whole seconds (0 when none waits).
    pub oldest_queued_seconds: i64,
}

/// The gauges of each tenant of `tenants` that has exports.
pub async fn gauges(conn: &mut PgConnection, tenants: &[String]) -> sqlx::Result<Vec<Gauges>> {
    sqlx::query_as(
        "SELECT j.tenant,
                coalesce(sum(j.bytes_done) FILTER (WHERE j.files_deleted_at IS NULL), 0)::bigint AS stored_bytes,
                count(*) FILTER (WHERE j.state = 'QUEUED')::int AS queued,
                count(*) FILTER (WHERE j.state = 'RUNNING')::int AS running,
                coalesce(floor(extract(epoch FROM now() - min(j.created_at) FILTER (WHERE j.state = 'QUEUED'))), 0)::bigint
                    AS oldest_queued_seconds
         FROM export_jobs j
         WHERE j.tenant = ANY($1)
         GROUP BY j.tenant",
    )
    .bind(tenants)
    .fetch_all(conn)
    .await
}
