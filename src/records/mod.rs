//! The versioned record store: writes stamped with the writer's xid8, reads "as of" a snapshot.
//! The write path itself lives in SQL (migrations) so host applications and the HTTP ingest share it.

pub mod census;
mod seed;
mod snapshot;

pub use seed::{SeedReport, seed};
pub use snapshot::Snapshot;

use serde_json::{Map, Value};
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::{PgPool, Postgres};

use crate::tenants::{DatasetName, TenantId};

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
        let result = sqlx::query("SELECT exportd_write_batch($1, $2, $3, $4)")
            .bind(tenant.as_str())
            .bind(dataset.as_str())
            .bind(&keys)
            .bind(&data)
            .execute(pool)
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
        Ok(self.page_within(pool, after, limit, usize::MAX).await?.0)
    }

    /// [`page`](Self::page), stopping early once the rows read hold `max_bytes` (records are
    /// streamed, so memory follows bytes, not rows). Also says whether the dataset ended.
    pub async fn page_within(
        &self,
        pool: &PgPool,
        after: Option<&str>,
        limit: i64,
        max_bytes: usize,
    ) -> sqlx::Result<(Vec<Record>, bool)> {
        use futures_util::TryStreamExt;
        let query = sqlx::query_as::<_, Record>(sqlx::AssertSqlSafe(page_sql()));
        let mut tx = in_key_order(pool).await?;
        let (mut rows, mut bytes, mut stopped_early) = (Vec::new(), 0usize, false);
        let mut stream = self.bind_as_of(query, after, limit).fetch(&mut *tx);
        while let Some(record) = stream.try_next().await? {
            bytes += record.key.len() + record.data.len();
            rows.push(record);
            if bytes >= max_bytes && (rows.len() as i64) < limit {
                stopped_early = true;
                break;
            }
        }
        drop(stream);
        tx.commit().await?;
        let ended = !stopped_early && (rows.len() as i64) < limit;
        Ok((rows, ended))
    }

    /// How many records follow key `after` (at most `limit`), and the last of their keys: where
    /// a shard of `limit` rows starting after `after` ends. Reads no record data beyond the
    /// filters, so planning an export's shards costs a fraction of writing them.
    pub async fn span(&self, pool: &PgPool, after: Option<&str>, limit: i64) -> sqlx::Result<(i64, Option<String>)> {
        let query = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), max(s.key) FROM (
                 SELECT v.key FROM record_versions v WHERE {AS_OF_AFTER} ORDER BY v.key LIMIT $5) s"
        )));
        let mut tx = in_key_order(pool).await?;
        let span = self.bind_as_of(query, after, limit).fetch_one(&mut *tx).await?;
        tx.commit().await?;
        Ok(span)
    }

    /// The plan PostgreSQL uses for [`page`](Self::page), one line per node (`EXPLAIN`, not run).
    /// Diagnostics: shows that pages walk the key index whatever the table's statistics say.
    pub async fn page_plan(&self, pool: &PgPool, after: Option<&str>, limit: i64) -> sqlx::Result<Vec<String>> {
        let query = sqlx::query_as::<_, (String,)>(sqlx::AssertSqlSafe(format!("EXPLAIN {}", page_sql())));
        let mut tx = in_key_order(pool).await?;
        let plan = self.bind_as_of(query, after, limit).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(plan.into_iter().map(|(line,)| line).collect())
    }

    /// Binds the parameters of [`AS_OF_AFTER`] (`$5` is the caller's `LIMIT`).
    fn bind_as_of<'q, O>(
        &'q self,
        query: QueryAs<'q, Postgres, O, PgArguments>,
        after: Option<&'q str>,
        limit: i64,
    ) -> QueryAs<'q, Postgres, O, PgArguments> {
        query
            .bind(self.tenant.as_str())
            .bind(self.dataset.as_str())
            .bind(self.snapshot.as_str())
            .bind(after.unwrap_or(""))
            .bind(limit)
            .bind(non_null(self.filters[0]))
            .bind(non_null(self.filters[1]))
    }
}

/// A keyset page: the records after key `$4`, in key order, at most `$5`.
fn page_sql() -> String {
    format!("SELECT v.key, v.data::text AS data FROM record_versions v WHERE {AS_OF_AFTER} ORDER BY v.key LIMIT $5")
}

/// Reads that must walk `record_versions_by_key` in key order run in a short transaction of their
/// own with these settings. Whatever the statistics say: on a table PostgreSQL has never
/// analyzed, or right after a bulk write, its estimates say a handful of rows match, and it
/// prefers a bitmap scan of every matching row plus a top-N sort — 1.4 s a page at 1M rows
/// instead of 2 ms. With both off, the ordered index scan is the only cheap plan left. JIT is off
/// too: the same estimates make it compile every page, which costs more than the page.
const WALK_THE_KEY_INDEX: &str = "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL jit = off";

pub(crate) async fn in_key_order(pool: &PgPool) -> sqlx::Result<sqlx::Transaction<'static, Postgres>> {
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(WALK_THE_KEY_INDEX).execute(&mut *tx).await?;
    Ok(tx)
}

/// The records of tenant `$1`, dataset `$2` as of snapshot `$3`, after key `$4`, containing
/// the filters `$6` and `$7` (each may be NULL).
const AS_OF_AFTER: &str = "v.tenant = $1 AND v.dataset = $2 AND v.key > $4
    AND exportd_live_at(v.created_xid, v.closed_xid, $3::pg_snapshot)
    AND v.data IS NOT NULL
    AND ($6::jsonb IS NULL OR v.data @> $6)
    AND ($7::jsonb IS NULL OR v.data @> $7)";

fn non_null(filter: &Value) -> Option<&Value> {
    match filter {
        Value::Null => None,
        Value::Object(map) if map.is_empty() => None,
        other => Some(other),
    }
}
