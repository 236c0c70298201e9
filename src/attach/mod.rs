//! Attached host tables: a host application's own table feeds a dataset without a line of the
//! host's code changing. `exportd attach` checks the binding against the host's catalog and the
//! dataset ([`resolve`]), then captures the table's changes in one of two ways:
//!
//! - **log** (`--source URL`, [`log`]): the host table, in any PostgreSQL with
//!   `wal_level = logical`, is followed through a publication and a logical replication slot; a
//!   copy of the rows already there joins the log with no gap and no overlap. Nothing of
//!   exportd's runs in the host's writes.
//! - **trigger** (exportd's own database, [`sql`]): a row trigger writes every change as a
//!   record in the writer's own transaction, then the rows already there are backfilled
//!   ([`backfill`]).
//!
//! Either way, exports and feeds of the dataset wait for the first copy: until it ends they are
//! refused (409 `backfill-running`), and a log attachment whose slot the host dropped is
//! refused (409 `capture-lost`) until it is resynced — never silently incomplete.

mod backfill;
pub mod log;
mod resolve;
mod sql;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

pub use backfill::{BackfillOptions, Progress};
pub use resolve::Refusal;

use crate::tenants::Registry;

/// What an operator binds: a host table to a dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    /// The host table, e.g. `tickets` or `app.tickets`.
    pub table: String,
    pub dataset: String,
    /// Key columns (empty: the primary key). Several make a key like `["org-1",42]`.
    #[serde(default)]
    pub key: Vec<String>,
    pub tenant: TenantRule,
    /// Dataset column → SQL expression over the host's columns (default: the same-named column).
    #[serde(default)]
    pub columns: BTreeMap<String, String>,
    /// The host database's URL: the table is followed from its write-ahead log (log capture).
    /// None: the table is in exportd's own database, captured by a trigger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// How a row finds its tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TenantRule {
    /// Every row belongs to this tenant.
    Fixed(String),
    /// The column's value (as text) maps to a tenant; rows with an unmapped value are no records.
    Column { column: String, map: BTreeMap<String, String> },
}

/// An attachment as recorded.
#[derive(Debug, Clone)]
pub struct Attachment {
    pub id: i64,
    pub host_table: String,
    pub dataset: String,
    pub spec: sqlx::types::Json<Spec>,
    pub tenants: Vec<String>,
    pub state: String,
    pub rows_done: i64,
    pub rows_written: i64,
    pub rows_estimate: i64,
    pub created_at: time::OffsetDateTime,
    pub updated_at: time::OffsetDateTime,
    /// `trigger` or `log`.
    pub capture: String,
    /// Log capture: the host's slot (and publication).
    pub slot: Option<String>,
    /// Log capture: WAL the host keeps for the slot, and how far the applied position trails
    /// the host's WAL, in bytes, when last looked.
    pub retained_bytes: Option<i64>,
    pub lag_bytes: Option<i64>,
    pub followed_at: Option<time::OffsetDateTime>,
    pub lost_reason: Option<String>,
    /// Log capture: the follower's last failure, until it applies again.
    pub last_error: Option<String>,
    /// Host rows the dataset refused, kept out of exports and feeds.
    pub quarantined: i64,
}

impl Attachment {
    /// Time left at the backfill's average rate since it began (`None` before any progress).
    pub fn eta(&self) -> Option<std::time::Duration> {
        let elapsed = (self.updated_at - self.created_at).as_seconds_f64();
        if self.rows_done <= 0 || elapsed <= 0.0 {
            return None;
        }
        let left = (self.rows_estimate - self.rows_done).max(0) as f64;
        Some(std::time::Duration::from_secs_f64(left * elapsed / self.rows_done as f64))
    }
}

/// Runs (or resumes) the attachment's first copy to its end — the backfill of a trigger
/// attachment, the copy of a log attachment (or its resync) — calling `report` after each batch.
pub async fn backfill(
    pool: &PgPool,
    registry: &Registry,
    attachment: &Attachment,
    options: BackfillOptions,
    report: impl FnMut(&Progress),
) -> anyhow::Result<Progress> {
    if attachment.capture == "log" {
        log::copy(pool, registry, attachment, options, report).await
    } else {
        backfill::backfill(pool, registry, attachment, options, report).await
    }
}

/// Lock waits of attach and detach on the host table: they take a lock that waits for running
/// writers and blocks new ones while it waits, so they give up rather than stall the host.
const DDL_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '3s'";

/// Puts the attachment's triggers on the host table and records it, in one transaction, or
/// finds it already there (attaching twice is one attachment). An attachment of the table with
/// another spec is refused: detach it first. Returns the attachment; its backfill is next.
pub async fn attach(pool: &PgPool, registry: &Registry, spec: &Spec) -> anyhow::Result<Attachment> {
    if let Some(existing) = find_by_name(pool, &spec.table, spec.source.as_deref()).await? {
        if existing.spec.0 != *spec {
            return Err(Refusal(format!(
                "table `{}` is already attached to dataset `{}` with another binding: `exportd detach --table {}` first",
                existing.host_table, existing.dataset, existing.host_table
            ))
            .into());
        }
        return Ok(existing);
    }
    if let Some(source) = &spec.source {
        return log::attach(pool, registry, spec, source).await;
    }
    let resolved = resolve::resolve(pool, pool, registry, spec, resolve::Evaluated::OnTheTable).await?;
    let estimate = rows_estimate(pool, &resolved.table).await?;
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(DDL_LOCK_TIMEOUT).execute(&mut *tx).await?;
    let id = sqlx::query_scalar!(
        "INSERT INTO attachments (host_table, dataset, spec, tenants, rows_estimate) VALUES ($1, $2, $3, $4, $5)
         RETURNING id",
        resolved.table,
        spec.dataset,
        sqlx::types::Json(spec) as _,
        &resolved.tenants,
        estimate,
    )
    .fetch_one(&mut *tx)
    .await?;
    for statement in sql::functions(id, &resolved).into_iter().chain(sql::triggers(id, &resolved)) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await
            .map_err(|e| locked(e, &resolved.table))?;
    }
    tx.commit().await.map_err(|e| locked(e, &resolved.table))?;
    find(pool, &resolved.table, None).await?.ok_or_else(|| anyhow::anyhow!("the attachment vanished"))
}

/// The planner's row count of the table, or a count when it was never analyzed.
pub(crate) async fn rows_estimate(pool: &PgPool, table: &str) -> sqlx::Result<i64> {
    let planned = sqlx::query_scalar!("SELECT reltuples FROM pg_class WHERE oid = $1::text::regclass", table)
        .fetch_one(pool)
        .await?;
    if planned >= 0.0 {
        return Ok(planned as i64);
    }
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}"))).fetch_one(pool).await
}

/// A lock timeout on the host table, said plainly.
pub(crate) fn locked(e: sqlx::Error, table: &str) -> anyhow::Error {
    match e.as_database_error().and_then(|d| d.code()) {
        Some(code) if code == "55P03" => Refusal(format!(
            "table `{table}`: a long-running transaction holds it; nothing was changed — try again when it ends"
        ))
        .into(),
        _ => e.into(),
    }
}

/// Removes the triggers and functions attach created, and the attachment. The records already
/// written stay (exports of them keep working); the host table is as before attach. Detaching a
/// table that is not attached changes nothing (`Ok(false)`).
pub async fn detach(pool: &PgPool, table: &str, source: Option<&str>) -> anyhow::Result<bool> {
    let Some(attachment) = find_by_name(pool, table, source).await? else { return Ok(false) };
    if attachment.capture == "log" {
        return log::detach(pool, &attachment).await.map(|()| true);
    }
    let (row, truncate) = sql::function_names(attachment.id);
    let host = &attachment.host_table;
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(DDL_LOCK_TIMEOUT).execute(&mut *tx).await?;
    let statements = [
        format!("DROP TRIGGER IF EXISTS {} ON {host}", sql::ROW_TRIGGER),
        format!("DROP TRIGGER IF EXISTS {} ON {host}", sql::TRUNCATE_TRIGGER),
        format!("DROP FUNCTION IF EXISTS {row}()"),
        format!("DROP FUNCTION IF EXISTS {truncate}()"),
    ];
    for statement in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(&mut *tx).await.map_err(|e| locked(e, host))?;
    }
    sqlx::query!("DELETE FROM attachments WHERE id = $1", attachment.id).execute(&mut *tx).await?;
    tx.commit().await.map_err(|e| locked(e, host))?;
    Ok(true)
}

/// Every attachment, by table.
pub async fn list(pool: &PgPool) -> sqlx::Result<Vec<Attachment>> {
    select(pool, None).await
}

/// The attachments feeding one of `tenant`'s datasets, by table.
pub async fn of_tenant(pool: &PgPool, tenant: &str) -> sqlx::Result<Vec<Attachment>> {
    Ok(list(pool).await?.into_iter().filter(|a| a.tenants.iter().any(|t| t == tenant)).collect())
}

/// Why a dataset's records are not complete yet: exports and feeds of it wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incomplete {
    /// An attachment's first copy (or resync) has not finished.
    Backfilling,
    /// A log attachment lost its slot: changes since are missing until it is resynced.
    Lost,
}

/// Whether `tenant`'s `dataset` is fed by an attachment that has not copied the host table
/// yet, or has lost track of it.
pub async fn incomplete(pool: &PgPool, tenant: &str, dataset: &str) -> sqlx::Result<Option<Incomplete>> {
    let states = sqlx::query_scalar!(
        "SELECT state FROM attachments WHERE $1 = ANY (tenants) AND dataset = $2 AND state <> 'live'",
        tenant,
        dataset,
    )
    .fetch_all(pool)
    .await?;
    Ok(if states.iter().any(|s| s == "lost") {
        Some(Incomplete::Lost)
    } else if states.is_empty() {
        None
    } else {
        Some(Incomplete::Backfilling)
    })
}

async fn find(pool: &PgPool, table: &str, source: Option<&str>) -> sqlx::Result<Option<Attachment>> {
    Ok(select(pool, Some(table)).await?.into_iter().find(|a| a.spec.source.as_deref() == source))
}

/// The attachment of `table` as the operator names it (any spelling `regclass` resolves in the
/// database it is in: exportd's own, or the `source` host's).
async fn find_by_name(pool: &PgPool, table: &str, source: Option<&str>) -> anyhow::Result<Option<Attachment>> {
    let host = match source {
        Some(url) => Some(log::connect(url, 1).await?),
        None => None,
    };
    let regclass = sqlx::query_scalar!("SELECT to_regclass($1)::text", table)
        .fetch_one(host.as_ref().unwrap_or(pool))
        .await
        .map_err(|e| resolve::unparsable(e, table))?;
    if let Some(host) = host {
        host.close().await;
    }
    Ok(match regclass {
        Some(name) => find(pool, &name, source).await?,
        // A dropped table: its attachment is known by the name it was recorded under.
        None => find(pool, table, source).await?,
    })
}

pub(crate) async fn by_id(pool: &PgPool, id: i64) -> sqlx::Result<Option<Attachment>> {
    Ok(select(pool, None).await?.into_iter().find(|a| a.id == id))
}

async fn select(pool: &PgPool, table: Option<&str>) -> sqlx::Result<Vec<Attachment>> {
    sqlx::query_as!(
        Attachment,
        r#"SELECT id, host_table, dataset, spec AS "spec: sqlx::types::Json<Spec>", tenants, state, rows_done,
                  rows_written, rows_estimate, created_at, updated_at, capture, slot, retained_bytes, lag_bytes,
                  followed_at, lost_reason, last_error,
                  (SELECT count(*) FROM attachment_quarantine q WHERE q.attachment = a.id) AS "quarantined!"
           FROM attachments a WHERE $1::text IS NULL OR host_table = $1 ORDER BY host_table, id"#,
        table,
    )
    .fetch_all(pool)
    .await
}
