//! What the rest of exportd reads about exports — usage, usage history, metrics, partners,
//! estimates and feed GC — each as one question answered here.

use std::collections::{BTreeMap, HashMap};

use sqlx::{PgConnection, PgExecutor, PgPool};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::auth::Caller;
use crate::exports::{ExportState, Mode};
use crate::sharing::changes::Predecessor;

/// The tenant's exports per state.
pub async fn states(pool: &PgPool, tenant: &str) -> sqlx::Result<BTreeMap<String, i64>> {
    let rows = sqlx::query!(
        r#"SELECT state AS "state: ExportState", count(*) AS "count!" FROM export_jobs WHERE tenant = $1 GROUP BY state"#,
        tenant,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.state.as_str().to_owned(), r.count)).collect())
}

/// When the tenant's oldest QUEUED export was created and its oldest RUNNING one started.
pub async fn oldest_waiting(
    pool: &PgPool,
    tenant: &str,
) -> sqlx::Result<(Option<OffsetDateTime>, Option<OffsetDateTime>)> {
    let row = sqlx::query!(
        "SELECT min(created_at) FILTER (WHERE state = 'QUEUED') AS queued,
                min(started_at) FILTER (WHERE state = 'RUNNING') AS running
         FROM export_jobs WHERE tenant = $1",
        tenant,
    )
    .fetch_one(pool)
    .await?;
    Ok((row.queued, row.running))
}

/// Bytes of the tenant's export files that exist (one row per job, kept equal to the sum of its
/// checkpoints by [`super::lease::record_shard`]), and of its table versions' change files.
pub async fn stored_bytes(db: impl PgExecutor<'_>, tenant: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT (coalesce(sum(j.bytes_done), 0) + coalesce(sum(s.changes_bytes), 0))::bigint AS "bytes!"
           FROM export_jobs j LEFT JOIN share_versions s ON s.export_id = j.id
           WHERE j.tenant = $1 AND j.files_deleted_at IS NULL"#,
        tenant,
    )
    .fetch_one(db)
    .await
}

/// Published exports, of every tenant, whose files should be in the store.
pub async fn published_with_files(pool: &PgPool) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "count!" FROM export_jobs WHERE state = 'SUCCEEDED' AND files_deleted_at IS NULL"#
    )
    .fetch_one(pool)
    .await
}

/// Rows of the tenant's exports published (and finished) since `since`.
pub async fn rows_published_since(pool: &PgPool, tenant: &str, since: OffsetDateTime) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT coalesce(sum(rows_done), 0)::bigint AS "rows!" FROM export_jobs
           WHERE tenant = $1 AND exportd_export_published(state) AND finished_at >= $2"#,
        tenant,
        since,
    )
    .fetch_one(pool)
    .await
}

/// Exports of one tenant in one state, and the oldest start (or creation) among them.
pub struct StateCount {
    pub tenant: String,
    pub state: ExportState,
    pub count: i64,
    pub oldest: Option<OffsetDateTime>,
}

/// Exports per tenant and state.
pub async fn by_tenant_and_state(pool: &PgPool) -> sqlx::Result<Vec<StateCount>> {
    sqlx::query_as!(
        StateCount,
        r#"SELECT tenant, state AS "state: ExportState", count(*) AS "count!",
                  min(coalesce(started_at, created_at)) AS oldest
           FROM export_jobs GROUP BY tenant, state"#,
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
    let rows = sqlx::query!(
        r#"SELECT principal, count(*) AS "count!" FROM export_jobs
           WHERE tenant = $1 AND created_at >= $2 GROUP BY principal"#,
        tenant,
        since,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.principal, r.count)).collect())
}

/// The snapshots unfinished exports still read at: full exports' watermarks and incremental
/// exports' starts. History they can see must be kept.
pub async fn live_snapshots(pool: &PgPool, tenant: &str) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar!(
        r#"SELECT watermark::text AS "snapshot!" FROM export_jobs WHERE tenant = $1 AND exportd_export_unfinished(state)
           UNION ALL
           SELECT start_from FROM export_jobs
           WHERE tenant = $1 AND start_from IS NOT NULL AND exportd_export_unfinished(state)"#,
        tenant,
    )
    .fetch_all(pool)
    .await
}

/// Whether an unfinished incremental export of the tenant may still read feed windows.
pub async fn incremental_unfinished(pool: &PgPool, tenant: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM export_jobs
                          WHERE tenant = $1 AND start_from IS NOT NULL AND exportd_export_unfinished(state)) AS "exists!""#,
        tenant,
    )
    .fetch_one(pool)
    .await
}

/// Rows and seconds (claim to publish) of recent published exports.
pub struct Throughput {
    /// Of the asked dataset (else of any of the tenant's).
    pub same_dataset: bool,
    pub rows: f64,
    pub seconds: f64,
}

/// The throughput of the recent published exports of `mode` with at least `min_rows` rows that
/// the caller may see (a partner: its own) — of `dataset` if there are any, else of any dataset.
pub async fn recent_throughput(
    pool: &PgPool,
    caller: &Caller,
    mode: Mode,
    dataset: &str,
    min_rows: i64,
) -> sqlx::Result<Option<Throughput>> {
    sqlx::query_as!(
        Throughput,
        r#"SELECT same_dataset AS "same_dataset!", sum(rows_done)::float8 AS "rows!",
                  sum(extract(epoch FROM finished_at - started_at))::float8 AS "seconds!"
           FROM (SELECT dataset = $3 AS same_dataset, rows_done, started_at, finished_at FROM export_jobs
                 WHERE tenant = $1 AND ($5 OR principal = $6) AND mode = $2 AND exportd_export_published(state)
                   AND rows_done >= $4 AND started_at IS NOT NULL AND finished_at > now() - interval '30 days'
                 ORDER BY finished_at DESC LIMIT 200) recent
           GROUP BY same_dataset ORDER BY same_dataset DESC LIMIT 1"#,
        caller.tenant.id.as_str(),
        mode.as_str(),
        dataset,
        min_rows,
        caller.principal.is_admin(),
        caller.principal.id.as_str(),
    )
    .fetch_optional(pool)
    .await
}

/// QUEUED and RUNNING exports the caller may see, and the rows they have left by their own
/// estimates.
pub async fn work_ahead(pool: &PgPool, caller: &Caller) -> sqlx::Result<(i64, i64)> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "exports!",
                  coalesce(sum(GREATEST(coalesce(rows_estimate, planned_rows), planned_rows) - rows_done), 0)::bigint
                      AS "rows!"
           FROM export_jobs
           WHERE tenant = $1 AND ($2 OR principal = $3) AND state IN ('QUEUED', 'RUNNING')"#,
        caller.tenant.id.as_str(),
        caller.principal.is_admin(),
        caller.principal.id.as_str(),
    )
    .fetch_one(pool)
    .await?;
    Ok((row.exports, row.rows))
}

/// Exports of a tenant that ended in one hour.
#[derive(Debug, Clone)]
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
    sqlx::query_as!(
        FinishedInHour,
        r#"SELECT j.tenant,
                  coalesce(sum(j.rows_done) FILTER (WHERE exportd_export_published(j.state)), 0)::bigint AS "rows!",
                  count(*) FILTER (WHERE exportd_export_published(j.state))::int AS "succeeded!",
                  count(*) FILTER (WHERE j.state = 'FAILED')::int AS "failed!",
                  count(*) FILTER (WHERE j.state = 'CANCELLED')::int AS "cancelled!",
                  percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.finished_at - j.created_at))
                      FILTER (WHERE exportd_export_published(j.state)) AS p50,
                  percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM j.finished_at - j.created_at))
                      FILTER (WHERE exportd_export_published(j.state)) AS p95
           FROM export_jobs j
           WHERE j.finished_at >= $1 AND j.finished_at < $1 + interval '1 hour' AND j.tenant = ANY($2)
           GROUP BY j.tenant"#,
        hour,
        tenants,
    )
    .fetch_all(conn)
    .await
}

/// A tenant's export gauges right now.
#[derive(Debug, Clone)]
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
    sqlx::query_as!(
        Gauges,
        r#"SELECT j.tenant,
                  coalesce(sum(j.bytes_done) FILTER (WHERE j.files_deleted_at IS NULL), 0)::bigint AS "stored_bytes!",
                  count(*) FILTER (WHERE j.state = 'QUEUED')::int AS "queued!",
                  count(*) FILTER (WHERE j.state = 'RUNNING')::int AS "running!",
                  coalesce(floor(extract(epoch FROM now() - min(j.created_at) FILTER (WHERE j.state = 'QUEUED'))), 0)::bigint
                      AS "oldest_queued_seconds!"
           FROM export_jobs j
           WHERE j.tenant = ANY($1)
           GROUP BY j.tenant"#,
        tenants,
    )
    .fetch_all(conn)
    .await
}

/// The table version the export `export_id` (not yet published) would follow, if a change file
/// can be written from it: the export is a table version (see `exportd_is_table_version`), the
/// latest version's snapshot is older than the export's, it was cut with the same columns, row
/// filter and column policy, and its snapshot is newer than `history_from` (older history may
/// be collected: its changes answer as whole files instead).
pub async fn table_version_predecessor(
    pool: &PgPool,
    export_id: Uuid,
    history_from: OffsetDateTime,
) -> sqlx::Result<Option<Predecessor>> {
    sqlx::query_as!(
        Predecessor,
        r#"SELECT s.version, p.watermark::text AS "watermark!"
           FROM export_jobs j
           JOIN LATERAL (SELECT version, export_id, snapshot_at FROM share_versions
                         WHERE tenant = j.tenant AND principal = j.principal AND dataset = j.dataset
                         ORDER BY version DESC LIMIT 1) s ON true
           JOIN export_jobs p ON p.id = s.export_id
           WHERE j.id = $1 AND exportd_is_table_version(j.mode, j.format, j.request)
             AND s.snapshot_at < j.created_at AND s.snapshot_at > $2
             AND p.columns = j.columns AND p.row_filter = j.row_filter
             AND p.column_policy IS NOT DISTINCT FROM j.column_policy
             AND p.schema_sha256 = j.schema_sha256"#,
        export_id,
        history_from,
    )
    .fetch_optional(pool)
    .await
}
