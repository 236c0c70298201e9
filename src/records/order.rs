//! The order a reader receives records in. A partner whose keys are hashed receives them in the
//! order of the hashed key it sees, never the real key's: sequential keys in key order give the
//! hash away from row positions alone. Positions (`after`, a shard's last key) follow the order:
//! keys, or hashed keys as 32 hex digits.

use futures_util::stream::BoxStream;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use super::{AsOf, Record, Span, as_of_after, non_null};
use crate::masking::ColumnHasher;

#[derive(Debug, Clone, Copy)]
pub enum KeyOrder<'a> {
    /// The key's byte order; positions are keys.
    Key,
    /// The partner's hashed key's order; positions are its hashed keys.
    Hashed(&'a ColumnHasher),
}

impl KeyOrder<'_> {
    pub fn is_hashed(&self) -> bool {
        matches!(self, KeyOrder::Hashed(_))
    }

    /// A record's position: its key, or its hashed key.
    pub fn position(&self, key: &str) -> String {
        match self {
            KeyOrder::Key => key.to_owned(),
            KeyOrder::Hashed(hasher) => hasher.hash(key.as_bytes()),
        }
    }

    /// A short read-only transaction set up for reads in this order.
    pub async fn begin(&self, pool: &PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
        let mut tx = pool.begin().await?;
        let settings = match self {
            KeyOrder::Key => WALK_THE_KEY_INDEX,
            KeyOrder::Hashed(_) => SORT_BY_HASH,
        };
        sqlx::raw_sql(settings).execute(&mut *tx).await?;
        Ok(tx)
    }
}

/// Reads that must walk `record_versions_by_key` in key order run in a short transaction of their
/// own with these settings. Whatever the statistics say: on a table PostgreSQL has never
/// analyzed, or right after a bulk write, its estimates say a handful of rows match, and it
/// prefers a bitmap scan of every matching row plus a top-N sort — 1.4 s a page at 1M rows
/// instead of 2 ms. With both off, the ordered index scan is the only cheap plan left. JIT is off
/// too: the same estimates make it compile every page, which costs more than the page.
pub(crate) const WALK_THE_KEY_INDEX: &str =
    "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL jit = off";

/// Reads in hashed order sort: the next shard's (hash, id) pairs — about 60 bytes each — fit a
/// bounded top-N sort in memory up to a few hundred thousand rows instead of spilling to disk.
const SORT_BY_HASH: &str = "SET LOCAL work_mem = '64MB'; SET LOCAL jit = off";

/// The records after hashed key `$4` (hex; empty for the start), in hashed-key order, at most
/// `$5`: PostgreSQL hashes every record's key (`$8`, `$9`: the partner's padded key), keeps the
/// next `$5` (hash, id) pairs in a top-N sort, then reads their data by id in that order.
pub(super) fn hashed_stream<'c>(
    as_of: &'c AsOf<'_>,
    hasher: &'c ColumnHasher,
    conn: &'c mut PgConnection,
    after: Option<&'c str>,
    limit: i64,
) -> BoxStream<'c, sqlx::Result<Record>> {
    as_of_after!(
        checked_hashed(
            r#"SELECT v.key, v.data::text AS "data!" FROM (
                   SELECT v.id, exportd_keyed_hash(v.key, $8, $9) AS hash FROM record_versions v WHERE "#,
            "exportd_keyed_hash(v.key, $8, $9) > decode($4, 'hex')",
            " ORDER BY 2 LIMIT $5) picked JOIN record_versions v ON v.id = picked.id ORDER BY picked.hash",
        ),
        Record,
        as_of,
        hasher,
        after,
        limit
    )
    .fetch(conn)
}

/// How many records follow hashed key `$4` (at most `$5`) and the last of their hashed keys.
pub(super) async fn hashed_span(
    as_of: &AsOf<'_>,
    hasher: &ColumnHasher,
    conn: &mut PgConnection,
    after: Option<&str>,
    limit: i64,
) -> sqlx::Result<Span> {
    as_of_after!(
        checked_hashed(
            r#"SELECT count(*) AS "rows!", max(encode(s.hash, 'hex') COLLATE "C") AS last_key FROM (
                   SELECT exportd_keyed_hash(v.key, $8, $9) AS hash FROM record_versions v WHERE "#,
            "exportd_keyed_hash(v.key, $8, $9) > decode($4, 'hex')",
            " ORDER BY 1 LIMIT $5) s",
        ),
        Span,
        as_of,
        hasher,
        after,
        limit
    )
    .fetch_one(conn)
    .await
}

/// `query_as!` of `$row`s over [`as_of_after!`]'s statement in hashed order: `$as_of`'s values,
/// then the partner's padded key as `$8` and `$9`.
macro_rules! checked_hashed {
    ($sql:expr, $row:ident, $as_of:expr, $hasher:expr, $after_key:expr, $limit:expr) => {
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
            &$hasher.pads().inner,
            &$hasher.pads().outer,
        )
    };
}
use checked_hashed;
