//! A hashed-key export's rows in the order of the partner's hashed keys (see
//! [`KeyOrder`](crate::records::KeyOrder)), read from PostgreSQL once per export and worker.
//!
//! Sorting by a keyed hash in PostgreSQL costs a scan and a hash of every record per shard (11×
//! an unmasked export at 1M rows). Instead the worker reads the dataset once, in key order (the
//! fast index walk), hashes each key (it would anyway, to write it) and appends the record to one
//! of 256 bucket files by its hash's first byte. A shard then reads the buckets from its start
//! position on, each sorted in memory — 1/256 of the dataset at a time. Bytes are the same
//! whoever builds the spool: the rows are fixed by the snapshot, the order by the hashes.
//!
//! The files hold record data: they live in a directory of the worker's temporary directory
//! (`TMPDIR`) that only its user may read, and are removed when the export ends or the spool is
//! evicted (at most [`KEPT`] per worker) and no shard reads it any more. A killed worker leaves
//! its directory to the temporary directory's cleaning.

use std::collections::VecDeque;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use futures_util::TryStreamExt;
use tokio::sync::OnceCell;
use uuid::Uuid;

use crate::masking::ColumnHasher;
use crate::records::{AsOf, KeyOrder, Record};

/// Buckets per spool: the first byte of the hash.
const BUCKETS: usize = 256;
/// Spools a worker keeps between shards (its slots' exports).
const KEPT: usize = 4;
/// Rows between two `keep_going` checks while a spool is written.
const CHECK_EVERY: u64 = 50_000;

/// A worker's spools, shared by its slots: one build per export, whichever slot needs it first.
#[derive(Default)]
pub struct Spools {
    kept: Mutex<VecDeque<(Uuid, Arc<Building>)>>,
}

/// An export's spool once built; its first reader builds it while the others wait.
type Building = OnceCell<Arc<Spool>>;

impl Spools {
    /// Export `id`'s spool, built from `as_of` (in hashed order) unless this worker has it.
    /// `None` when `keep_going` said stop while it was being built.
    pub async fn get<F, Fut>(
        &self,
        id: Uuid,
        pool: &sqlx::PgPool,
        as_of: &AsOf<'_>,
        hasher: &ColumnHasher,
        keep_going: F,
    ) -> anyhow::Result<Option<Arc<Spool>>>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<bool>>,
    {
        let cell = {
            let mut kept = self.kept.lock().expect("not poisoned");
            match kept.iter().find(|(kept_id, _)| *kept_id == id) {
                Some((_, cell)) => cell.clone(),
                None => {
                    if kept.len() == KEPT {
                        kept.pop_front();
                    }
                    let cell = Arc::new(OnceCell::new());
                    kept.push_back((id, cell.clone()));
                    cell
                }
            }
        };
        let built: anyhow::Result<&Arc<Spool>> = cell
            .get_or_try_init(|| async {
                match Spool::build(pool, as_of, hasher, keep_going).await? {
                    Some(spool) => Ok(Arc::new(spool)),
                    None => Err(Interrupted.into()),
                }
            })
            .await;
        match built {
            Ok(spool) => Ok(Some(spool.clone())),
            Err(e) if e.is::<Interrupted>() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Drops export `id`'s spool (its files go once no shard reads them).
    pub fn forget(&self, id: Uuid) {
        self.kept.lock().expect("not poisoned").retain(|(kept_id, _)| *kept_id != id);
    }
}

#[derive(Debug, thiserror::Error)]
#[error("interrupted while spooling")]
struct Interrupted;

/// One export's rows in 256 bucket files.
pub struct Spool {
    dir: tempfile::TempDir,
}

/// A spooled record: its hashed key's bytes, its key and data.
struct Entry {
    hash: [u8; 16],
    record: Record,
}

impl Spool {
    /// Reads every record of `as_of` once and files it under its hash. `None`: stopped.
    async fn build<F, Fut>(
        pool: &sqlx::PgPool,
        as_of: &AsOf<'_>,
        hasher: &ColumnHasher,
        mut keep_going: F,
    ) -> anyhow::Result<Option<Spool>>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<bool>>,
    {
        let dir = tempfile::Builder::new().prefix("exportd-spool-").tempdir().context("creating a spool directory")?;
        let mut buckets = Vec::with_capacity(BUCKETS);
        for bucket in 0..BUCKETS {
            let file = std::fs::File::create(dir.path().join(bucket.to_string())).context("creating a spool file")?;
            buckets.push(BufWriter::with_capacity(32 << 10, file));
        }
        let mut tx = KeyOrder::Key.begin(pool).await?;
        let mut rows = as_of.stream(&mut tx, None, i64::MAX);
        let mut read = 0u64;
        while let Some(record) = rows.try_next().await? {
            let hash = hasher.hash_bytes(record.key.as_bytes());
            let out = &mut buckets[usize::from(hash[0])];
            out.write_all(&hash)?;
            for part in [record.key.as_bytes(), record.data.as_bytes()] {
                out.write_all(&(part.len() as u32).to_le_bytes())?;
                out.write_all(part)?;
            }
            read += 1;
            if read.is_multiple_of(CHECK_EVERY) && !keep_going().await? {
                return Ok(None);
            }
        }
        drop(rows);
        tx.commit().await?;
        for out in buckets {
            out.into_inner().map_err(|e| e.into_error()).context("writing a spool file")?;
        }
        Ok(Some(Spool { dir }))
    }

    fn path(&self, bucket: usize) -> PathBuf {
        self.dir.path().join(bucket.to_string())
    }

    /// Bucket `bucket`'s records, sorted by hash.
    async fn bucket(&self, bucket: usize) -> anyhow::Result<Vec<Entry>> {
        let bytes = tokio::fs::read(self.path(bucket)).await.context("reading a spool file")?;
        let mut entries = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let hash: [u8; 16] = bytes[at..at + 16].try_into().expect("16 bytes");
            at += 16;
            let mut text = || {
                let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
                let part = String::from_utf8(bytes[at + 4..at + 4 + len].to_vec()).expect("written from a String");
                at += 4 + len;
                part
            };
            let (key, data) = (text(), text());
            entries.push(Entry { hash, record: Record { key, data } });
        }
        entries.sort_unstable_by_key(|e| e.hash);
        Ok(entries)
    }

    /// The records after position `after` (a hashed key in hex; `None`: from the start).
    pub fn read_after(self: Arc<Spool>, after: Option<&str>) -> anyhow::Result<SpoolReader> {
        let after = match after {
            Some(text) => Some(<[u8; 16]>::try_from(hex::decode(text)?.as_slice()).context("a hashed position")?),
            None => None,
        };
        let next = after.map_or(0, |hash| usize::from(hash[0]));
        Ok(SpoolReader { spool: self, after, next, current: VecDeque::new() })
    }
}

/// Records of a spool in hashed-key order, a bucket at a time.
pub struct SpoolReader {
    spool: Arc<Spool>,
    after: Option<[u8; 16]>,
    /// The next bucket to load.
    next: usize,
    current: VecDeque<Entry>,
}

impl SpoolReader {
    /// The next record and its position (its hashed key in hex); `None` at the end.
    pub async fn next(&mut self) -> anyhow::Result<Option<(Record, String)>> {
        while self.current.is_empty() {
            if self.next == BUCKETS {
                return Ok(None);
            }
            let entries = self.spool.bucket(self.next).await?;
            self.next += 1;
            let after = self.after;
            self.current = entries.into_iter().filter(|e| after.is_none_or(|a| e.hash > a)).collect();
        }
        Ok(self.current.pop_front().map(|e| (e.record, hex::encode(e.hash))))
    }

    /// How many records follow (at most `limit`), and the last one's position.
    pub async fn span(mut self, limit: u64) -> anyhow::Result<(i64, Option<String>)> {
        let (mut rows, mut last) = (0, None);
        while rows < limit as i64 {
            let Some((_, position)) = self.next().await? else { break };
            rows += 1;
            last = Some(position);
        }
        Ok((rows, last))
    }
}
