//! Attached host tables: a host application's own table feeds a dataset without a line of the
//! host's code changing. `exportd attach` checks the binding against the host's catalog and the
//! dataset ([`resolve`]), puts a row trigger on the table that writes every change as a record
//! in the writer's own transaction ([`sql`]), then backfills the rows already there, online and
//! resumable ([`backfill`]). Exports and feeds of the dataset wait for the backfill: until it
//! ends they are refused (409 `backfill-running`), never silently incomplete.

mod backfill;
mod resolve;
mod sql;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

pub use backfill::{BackfillOptions, Progress, backfill};
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

/// Lock waits of attach and detach on the host table: they take a lock that waits for running
/// writers and blocks new ones while it waits, so they give up rather than stall the host.
const DDL_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '3s'";

/// Puts the attachment's triggers on the host table and records it, in one transaction, or
/// finds it already there (attaching twice is one attachment). An attachment of the table with
/// another spec is refused: detach it first. Returns the attachment; its backfill is next.
pub async fn attach(pool: &PgPool, registry: &Registry, spec: &Spec) -> anyhow::Result<Attachment> {
    if let Some(existing) = find_by_name(pool, &spec.table).await? {
        if existing.spec.0 != *spec {
            return Err(Refusal(format!(
                "table `{}` is already attached to dataset `{}` with another binding: `exportd detach --table {}` first",
                existing.host_table, existing.dataset, existing.host_table
            ))
            .into());
        }
        return Ok(existing);
    }
    let resolved = resolve::resolve(pool, registry, spec).await?;
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
    find(pool, &resolved.table).await?.ok_or_else(|| anyhow::anyhow!("the attachment vanished"))
}

/// The planner's row count of the table, or a count when it was never analyzed.
async fn rows_estimate(pool: &PgPool, table: &str) -> sqlx::Result<i64> {
    let planned = sqlx::query_scalar!("SELECT reltuples FROM pg_class WHERE oid = $1::text::regclass", table)
        .fetch_one(pool)
        .await?;
    if planned >= 0.0 {
        return Ok(planned as i64);
    }
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}"))).fetch_one(pool).await
}

/// A lock timeout on the host table, said plainly.
fn locked(e: sqlx::Error, table: &str) -> anyhow::Error {
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
pub async fn detach(pool: &PgPool, table: &str) -> anyhow::Result<bool> {
    let Some(attachment) = find_by_name(pool, table).await? else { return Ok(false) };
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

/// Whether `tenant`'s `dataset` is fed by an attachment whose backfill has not finished.
pub async fn backfill_running(pool: &PgPool, tenant: &str, dataset: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM attachments WHERE $1 = ANY (tenants) AND dataset = $2 AND state = 'backfilling')
           AS "running!""#,
        tenant,
        dataset,
    )
    .fetch_one(pool)
    .await
}

async fn find(pool: &PgPool, regclass: &str) -> sqlx::Result<Option<Attachment>> {
    Ok(select(pool, Some(regclass)).await?.pop())
}

/// The attachment of `table` as the operator names it (any spelling `regclass` resolves).
async fn find_by_name(pool: &PgPool, table: &str) -> anyhow::Result<Option<Attachment>> {
    let regclass = sqlx::query_scalar!("SELECT to_regclass($1)::text", table)
        .fetch_one(pool)
        .await
        .map_err(|e| resolve::unparsable(e, table))?;
    Ok(match regclass {
        Some(name) => find(pool, &name).await?,
        // A dropped table: its attachment is known by the name it was recorded under.
        None => find(pool, table).await?,
    })
}

async fn select(pool: &PgPool, table: Option<&str>) -> sqlx::Result<Vec<Attachment>> {
    sqlx::query_as!(
        Attachment,
        r#"SELECT id, host_table, dataset, spec AS "spec: sqlx::types::Json<Spec>", tenants, state, rows_done,
                  rows_written, rows_estimate, created_at, updated_at
           FROM attachments WHERE $1::text IS NULL OR host_table = $1 ORDER BY host_table"#,
        table,
    )
    .fetch_all(pool)
    .await
}
