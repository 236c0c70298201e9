//! The versioned record store: writes stamped with the writer's xid8, reads "as of" a snapshot.
//! The write path itself lives in SQL (migrations) so host applications and the HTTP ingest share it.

pub mod census;
mod order;
mod seed;
mod snapshot;

pub use order::KeyOrder;
pub use seed::{SeedReport, seed};
pub use snapshot::Snapshot;

use serde_json::{Map, Value};
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::{PgPool, Postgres};

use crate::dataset::{DatasetName, TenantId};

/// SQLSTATE raised by the SQL write functions for a record that does not fit its dataset.
pub const INVALID_RECORD_SQLSTATE: &str = "EXD01";

/// One write of an ingest batch.
#[derive(Debug, Clone, PartialEq)]
pub enum RecordWrite {
    Upsert { key: String, data: Map<String, Value> },
    Delete { key: String },
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BatchOutcome {
    pub upserted: u64,
    pub deleted: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("record {index}: {field}: {message}")]
    Invalid { index: usize, field: String, message: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Runs of a batch that lost a deadlock or serialization race (against a host transaction
/// writing the same keys in another order) before the error reaches the client.
const BATCH_TRIES: u32 = 4;

fn lost_race(error: &sqlx::Error) -> bool {
    error.as_database_error().and_then(|d| d.code()).is_some_and(|code| code == "40P01" || code == "40001")
}

/// Validates and writes a batch in one transaction: all records or none. Keys are locked in key
/// order, so two batches never deadlock each other; a batch that deadlocks with a host
/// transaction is run again, a few times.
pub async fn write_batch(
    pool: &PgPool,
    tenant: &TenantId,
    dataset: &DatasetName,
    writes: &[RecordWrite],
) -> Result<BatchOutcome, WriteError> {
    let mut outcome = BatchOutcome::default();
    let mut keys = Vec::with_capacity(writes.len());
    let mut data = Vec::with_capacity(writes.len());
    for write in writes {
        match write {
            RecordWrite::Upsert { key, data: d } => {
                outcome.upserted += 1;
                keys.push(key.as_str());
                data.push(Some(Value::Object(d.clone())));
            }
            RecordWrite::Delete { key } => {
                outcome.deleted += 1;
                keys.push(key.as_str());
                data.push(None);
            }
        }
    }
    let mut delays = crate::db::retry_delays();
    let mut tries = 1;
    let result = loop {
        let result = sqlx::query!(
            "SELECT exportd_write_batch($1, $2, $3, $4)",
            tenant.as_str(),
            dataset.as_str(),
            // Borrowed keys and NULL (delete) elements: the types the statement takes, unchecked.
            &keys as _,
            &data as _,
        )
        .fetch_one(pool)
        .await;
        match result {
            // The batch is one statement: a deadlock or serialization victim was rolled back
            // whole, so running it again cannot write anything twice. (A lost connection is
            // ambiguous — the commit may have happened — and is left to the client.)
            Err(e) if lost_race(&e) && tries < BATCH_TRIES => {
                tries += 1;
                tokio::time::sleep(delays.next().unwrap_or_default()).await;
            }
            other => break other,
        }
    };
    match result {
        Ok(_) => Ok(outcome),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(INVALID_RECORD_SQLSTATE) => {
            let pg = db.downcast_ref::<sqlx::postgres::PgDatabaseError>();
            Err(WriteError::Invalid {
                index: pg.detail().and_then(|d| d.parse().ok()).unwrap_or(0),
                field: pg.column().unwrap_or("data").to_owned(),
                message: pg.message().to_owned(),
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// One record as of a snapshot. `data` is its JSON object as text, exactly as PostgreSQL renders
/// the stored jsonb (numbers keep their stored digits); exports read fields from it without
/// building a JSON tree per row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Record {
    pub key: String,
    pub data: String,
}

impl Record {
    /// The data parsed as JSON (convenient outside the hot path).
    pub fn value(&self) -> Value {
        serde_json::from_str(&self.data).expect("PostgreSQL renders valid JSON")
    }
}

/// "The dataset as of a snapshot", optionally narrowed by column = value filters.
#[derive(Debug, Clone)]
pub struct AsOf<'a> {
    pub tenant: &'a TenantId,
    pub dataset: &'a DatasetName,
    pub snapshot: &'a Snapshot,
    /// JSON objects every record's data must contain (`data @> filter`), e.g. a request filter
    /// and a partner's row filter. Empty objects match everything.
    pub filters: [&'a Value; 2],
}

impl<'a> AsOf<'a> {
    pub fn new(tenant: &'a TenantId, dataset: &'a DatasetName, snapshot: &'a Snapshot) -> Self {
        static EMPTY: Value = Value::Null;
        AsOf { tenant, dataset, snapshot, filters: [&EMPTY, &EMPTY] }
    }

    /// Up to `limit` records in key (byte) order after key `after`. Exact from any transaction
    /// that began after the snapshot was taken; no transaction needs to stay open between pages.
    pub async fn page(&self, pool: &PgPool, after: Option<&str>, limit: i64) -> sqlx::Result<Vec<Record>> {
        use futures_util::TryStreamExt;
        let mut tx = in_key_order(pool).await?;
        let rows = self.stream(&mut tx, after, limit).try_collect().await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Up to `limit` records in key order after key `after`, as one statement streamed on
    /// `conn`, a transaction begun by [`in_key_order`]. The reader takes rows at its own pace
    /// (PostgreSQL waits on the socket), so a long read costs neither memory nor the round
    /// trips and index descents of page after page — but holds the transaction (and its
    /// connection) until the stream is dropped.
    pub fn stream<'c>(
        &'c self,
        conn: &'c mut sqlx::PgConnection,
        after: Option<&'c str>,
        limit: i64,
    ) -> futures_util::stream::BoxStream<'c, sqlx::Result<Record>> {
        page_statement!(checked_page(self, after, limit)).fetch(conn)
    }

    /// How many records follow key `after` (at most `limit`), and the last of their keys: where
    /// a shard of `limit` rows starting after `after` ends. Reads no record data beyond the
    /// filters, so planning an export's shards costs a fraction of writing them.
    pub async fn span(&self, pool: &PgPool, after: Option<&str>, limit: i64) -> sqlx::Result<(i64, Option<String>)> {
        let mut tx = in_key_order(pool).await?;
        let span = as_of_after!(
            checked_span(
                r#"SELECT count(*) AS "rows!", max(s.key) AS last_key FROM (SELECT v.key FROM record_versions v WHERE "#,
                " ORDER BY v.key LIMIT $5) s",
            ),
            self,
            after,
            limit
        )
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok((span.rows, span.last_key))
    }

    /// The plan PostgreSQL uses for [`page`](Self::page), one line per node (`EXPLAIN`, not run).
    /// Diagnostics: shows that pages walk the key index whatever the table's statistics say.
    pub async fn page_plan(&self, pool: &PgPool, after: Option<&str>, limit: i64) -> sqlx::Result<Vec<String>> {
        let query = sqlx::query_as::<_, (String,)>(page_statement!(explain()));
        let mut tx = in_key_order(pool).await?;
        let plan = bind_as_of(query, self, after, limit).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(plan.into_iter().map(|(line,)| line).collect())
    }
}

/// Binds the parameters of [`as_of_after!`] at runtime (`$5` is the caller's `LIMIT`).
fn bind_as_of<'q, O>(
    query: QueryAs<'q, Postgres, O, PgArguments>,
    as_of: &'q AsOf<'_>,
    after: Option<&'q str>,
    limit: i64,
) -> QueryAs<'q, Postgres, O, PgArguments> {
    query
        .bind(as_of.tenant.as_str())
        .bind(as_of.dataset.as_str())
        .bind(as_of.snapshot.as_str())
        .bind(after.unwrap_or(""))
        .bind(limit)
        .bind(non_null(as_of.filters[0]))
        .bind(non_null(as_of.filters[1]))
}

/// Calls `$then!` with the statement `$before`, the conditions of "the records of tenant `$1`,
/// dataset `$2` as of snapshot `$3`, after key `$4`, containing the filters `$6` and `$7` (each
/// may be NULL)", then `$after` — three literals joined by `+`, as `query!` takes them — followed
/// by the bound values of `$as_of`. One spelling of the conditions for every reader.
macro_rules! as_of_after {
    ($then:ident($before:literal, $after:literal $(,)?) $(, $as_of:expr, $after_key:expr, $limit:expr)? $(,)?) => {
        $then!(
            $before
                + "v.tenant = $1 AND v.dataset = $2 AND v.key > $4
                   AND exportd_live_at(v.created_xid, v.closed_xid, $3::text::pg_snapshot)
                   AND v.data IS NOT NULL
                   AND ($6::jsonb IS NULL OR v.data @> $6)
                   AND ($7::jsonb IS NULL OR v.data @> $7)"
                + $after
            $(, $as_of, $after_key, $limit)?
        )
    };
}
use as_of_after;

/// Calls `$then!` (see [`as_of_after!`]) with the keyset page: the records after key `$4`, in
/// key order, at most `$5`. The page is read checked at compile time; its plan is explained
/// from the same text.
macro_rules! page_statement {
    ($then:ident($($as_of:expr, $after_key:expr, $limit:expr)?)) => {
        as_of_after!(
            $then(r#"SELECT v.key, v.data::text AS "data!" FROM record_versions v WHERE "#, " ORDER BY v.key LIMIT $5"),
            $($as_of, $after_key, $limit)?
        )
    };
}
use page_statement;

/// `query_as!` of `$row`s over [`as_of_after!`]'s statement, binding `$as_of`'s values.
macro_rules! checked_as_of {
    ($row:ident, $sql:expr, $as_of:expr, $after_key:expr, $limit:expr) => {
        sqlx::query_as!(
            $row,
            $sql,
            $as_of.tenant.as_str(),
            $as_of.dataset.as_str(),
            $as_of.snapshot.as_str(),
            $after_key.unwrap_or(""),
            $limit,
            non_null($as_of.filters[0]),
            non_null($as_of.filters[1]),
        )
    };
}
use checked_as_of;

macro_rules! checked_page {
    ($sql:expr, $($rest:tt)*) => {
        checked_as_of!(Record, $sql, $($rest)*)
    };
}
use checked_page;

macro_rules! checked_span {
    ($sql:expr, $($rest:tt)*) => {
        checked_as_of!(Span, $sql, $($rest)*)
    };
}
use checked_span;

/// Where a shard of at most `$5` rows after key `$4` ends: how many rows, and the last key.
struct Span {
    rows: i64,
    last_key: Option<String>,
}

/// `EXPLAIN` of a statement given as three literals (see [`as_of_after!`]), run unchecked.
macro_rules! explain {
    ($a:literal + $b:literal + $c:literal) => {
        sqlx::AssertSqlSafe(concat!("EXPLAIN ", $a, $b, $c))
    };
}
use explain;

/// A short transaction for reads in key order (see [`KeyOrder::begin`]).
pub(crate) async fn in_key_order(pool: &PgPool) -> sqlx::Result<sqlx::Transaction<'static, Postgres>> {
    KeyOrder::Key.begin(pool).await
}

fn non_null(filter: &Value) -> Option<&Value> {
    match filter {
        Value::Null => None,
        Value::Object(map) if map.is_empty() => None,
        other => Some(other),
    }
}
/// The record's JSON object with a string field `name` = `value` first (both plain names,
/// nothing to escape).
pub fn with_leading_field(name: &str, value: &str, data: &str) -> String {
    let rest = data.trim_start().strip_prefix('{').unwrap_or("}").trim_start();
    if rest.starts_with('}') {
        format!("{{\"{name}\":\"{value}\"}}")
    } else {
        format!("{{\"{name}\":\"{value}\",{rest}")
    }
}
