//! The order a reader receives records in. A partner whose keys are hashed receives them in the
//! order of the hashed key it sees, never the real key's: sequential keys in key order give the
//! hash away from row positions alone. Positions (`after`, a shard's last key) follow the order:
//! keys, or hashed keys as 32 hex digits. Full exports sort through a spool
//! (`jobs::spool`); feed windows and change files in PostgreSQL (`exportd_keyed_hash`).

use sqlx::{PgPool, Postgres, Transaction};

use crate::dataset::ColumnHasher;

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
const WALK_THE_KEY_INDEX: &str = "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL jit = off";

/// A feed page in hashed order sorts its window's keys by hash (a top-N sort of the page).
const SORT_BY_HASH: &str = "SET LOCAL jit = off";
