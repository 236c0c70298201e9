//! Writing one shard: its rows stream from PostgreSQL, in pages, into an encoder on a blocking
//! thread (CSV/JSONL → gzip, or Arrow batches → Parquet; → sha256 → the store's object writer), and the object is made visible
//! only once the shard is complete. At most two pages are in flight, so memory does not grow with
//! the export.

use anyhow::Context;
use tokio::sync::mpsc;

use super::source::{Reading, Source};
use crate::quota::ScanLimits;
use crate::records::Record;
use crate::storage::{ArtifactStore, ObjectKey, ObjectWriter};
use crate::writers::{ShardDigest, ShardSpec, ShardWriter};

/// Pages buffered between the reader and the encoder.
const PAGES_IN_FLIGHT: usize = 2;

/// A shard file written and persisted under its object key.
#[derive(Debug)]
pub struct WrittenShard {
    pub first_key: Option<String>,
    pub last_key: Option<String>,
    pub digest: ShardDigest,
    pub object_key: ObjectKey,
}

/// Why a shard was not finished.
#[derive(Debug)]
pub enum ShardStop {
    /// `index > 0` and no row is left: the previous shard was the last.
    NoRows,
    /// The export would exceed the rows it is allowed.
    TooManyRows,
    /// A heartbeat found the lease gone or a cancel request.
    Interrupted,
    /// The tenant is over its scan rate; nothing was read. Retry after this long.
    Throttled(std::time::Duration),
}

pub struct ShardJob<'a> {
    pub store: &'a ArtifactStore,
    pub source: Source<'a>,
    pub spec: &'a ShardSpec,
    pub after: Option<String>,
    pub shard_rows: u64,
    pub page_rows: u64,
    /// Rows the export may still add before `max_rows_per_export` is exceeded.
    pub rows_allowed: u64,
    pub is_first: bool,
    pub object_key: ObjectKey,
    pub scan: &'a ScanLimits,
    pub tenant: &'a str,
    /// Give up (`Throttled`) instead of waiting when the tenant's scan budget is spent at the start.
    pub may_defer: bool,
    /// Where a snapshot's rows come from in hashed-key order (see [`super::spool`]).
    pub spool: Option<std::sync::Arc<super::spool::Spool>>,
}

/// Writes one shard. `keep_going` is called between pages (heartbeats); `false` stops.
pub async fn write_shard<F, Fut>(
    pool: &sqlx::PgPool,
    job: ShardJob<'_>,
    mut keep_going: F,
) -> anyhow::Result<Result<WrittenShard, ShardStop>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    // The shard's budget, up to one second's worth, is taken before anything is read.
    let mut prepaid = match job.scan.try_acquire(job.tenant, job.shard_rows) {
        Ok(rows) => rows,
        Err(wait) if job.may_defer => return Ok(Err(ShardStop::Throttled(wait))),
        Err(_) => 0,
    };
    let mut reading = Reading::default();
    let after = job.after.as_deref();
    let mut source = job
        .source
        .pages(pool, &mut reading, after, job.shard_rows, job.spool.clone())
        .await
        .context("reading records")?;
    let mut limit = job.page_rows.min(job.shard_rows);
    prepaid = pay(job.scan, job.tenant, prepaid, limit).await;
    let mut page = source.next(limit as usize).await.context("reading records")?;
    if page.rows.is_empty() && page.exhausted && !job.is_first {
        return Ok(Err(ShardStop::NoRows));
    }

    let (pages, encoder) = spawn_encoder(job.store.clone(), job.object_key.clone(), job.spec.clone());
    let mut rows = 0u64;
    let mut first_key = None;
    let mut last_key: Option<String> = job.after.clone();
    // Errors are held until the encoder has finished, so its unfinished object never outlives the shard.
    let stop: anyhow::Result<Option<ShardStop>> = async {
        loop {
            rows += page.rows.len() as u64;
            if rows > job.rows_allowed {
                return Ok(Some(ShardStop::TooManyRows));
            }
            first_key = first_key.take().or(page.first);
            last_key = page.last.or(last_key.take());
            if !page.rows.is_empty() && pages.send(page.rows).await.is_err() {
                return Ok(None); // the encoder failed; its error is reported below
            }
            if rows >= job.shard_rows || page.exhausted {
                return Ok((rows == 0 && !job.is_first).then_some(ShardStop::NoRows));
            }
            if !keep_going().await? {
                return Ok(Some(ShardStop::Interrupted));
            }
            limit = job.page_rows.min(job.shard_rows - rows);
            prepaid = pay(job.scan, job.tenant, prepaid, limit).await;
            page = source.next(limit as usize).await.context("reading records")?;
        }
    }
    .await;
    drop(source);
    let stop = match stop {
        Ok(None) => reading.end().await.context("reading records").map(|()| None),
        other => other, // the read is rolled back with its connection
    };
    drop(pages);
    let (writer, digest) = encoder.await.context("shard encoder panicked")?.context("encoding shard")?;
    let unfinished = match stop {
        Ok(None) => None,
        Ok(Some(stop)) => Some(Ok(Err(stop))),
        Err(e) => Some(Err(e)),
    };
    if let Some(outcome) = unfinished {
        tokio::task::spawn_blocking(move || drop(writer)).await.context("discarding task panicked")?;
        return outcome;
    }
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .context("finishing task panicked")?
        .context("storing the shard")?;
    Ok(Ok(WrittenShard { first_key, last_key, digest, object_key: job.object_key }))
}

/// Pays for reading `rows` from what was prepaid, waiting for the rest. Returns what is left prepaid.
async fn pay(scan: &ScanLimits, tenant: &str, prepaid: u64, rows: u64) -> u64 {
    if rows > prepaid {
        scan.acquire(tenant, rows - prepaid).await;
        0
    } else {
        prepaid - rows
    }
}

type Encoded = anyhow::Result<(ObjectWriter, ShardDigest)>;

pub(super) fn spawn_encoder(
    store: ArtifactStore,
    key: ObjectKey,
    spec: ShardSpec,
) -> (mpsc::Sender<Vec<Record>>, tokio::task::JoinHandle<Encoded>) {
    let (tx, mut rx) = mpsc::channel::<Vec<Record>>(PAGES_IN_FLIGHT);
    let handle = tokio::task::spawn_blocking(move || -> Encoded {
        // On any error the object writer is dropped, which discards what it wrote.
        let mut writer = ShardWriter::new(store.writer(&key)?, &spec)?;
        while let Some(page) = rx.blocking_recv() {
            for record in &page {
                writer.write_row(&record.key, &record.data)?;
            }
        }
        Ok(writer.finish()?)
    });
    (tx, handle)
}
