//! Writing one shard: keyset pages stream from PostgreSQL into an encoder on a blocking thread
//! (CSV/JSONL → gzip → sha256 → temp file), then the file is fsynced and renamed into place.
//! At most two pages are in flight, so memory does not grow with the export.

use std::io::{self, BufWriter};
use std::path::PathBuf;

use anyhow::Context;
use tokio::sync::mpsc;

use super::source::Source;
use crate::quota::ScanLimits;
use crate::records::Record;
use crate::storage::{ArtifactStore, ObjectKey};
use crate::writers::{Format, OutputColumn, ShardDigest, ShardWriter};

/// Pages buffered between the reader and the encoder.
const PAGES_IN_FLIGHT: usize = 2;
const FILE_BUFFER_BYTES: usize = 256 * 1024;

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
    pub format: Format,
    pub columns: &'a [OutputColumn],
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
    let mut limit = job.page_rows.min(job.shard_rows) as i64;
    prepaid = pay(job.scan, job.tenant, prepaid, limit as u64).await;
    let mut page = job.source.page(pool, job.after.as_deref(), limit).await.context("reading records")?;
    if page.rows.is_empty() && page.exhausted && !job.is_first {
        return Ok(Err(ShardStop::NoRows));
    }

    let (pages, encoder) = spawn_encoder(job.store.clone(), job.format, job.columns.to_vec())?;
    let mut rows = 0u64;
    let mut first_key = None;
    let mut last_key: Option<String> = job.after.clone();
    // Errors are held until the encoder has finished, so its temp file never outlives the shard.
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
            limit = job.page_rows.min(job.shard_rows - rows) as i64;
            prepaid = pay(job.scan, job.tenant, prepaid, limit as u64).await;
            page = job.source.page(pool, last_key.as_deref(), limit).await.context("reading records")?;
        }
    }
    .await;
    drop(pages);
    let (temp, file, digest) = encoder.await.context("shard encoder panicked")?.context("encoding shard")?;
    let unfinished = match stop {
        Ok(None) => None,
        Ok(Some(stop)) => Some(Ok(Err(stop))),
        Err(e) => Some(Err(e)),
    };
    if let Some(outcome) = unfinished {
        let _ = std::fs::remove_file(&temp);
        return outcome;
    }
    let store = job.store.clone();
    let key = job.object_key.clone();
    tokio::task::spawn_blocking(move || store.persist(&temp, file, &key).map(|()| temp))
        .await
        .context("persist task panicked")?
        .context("persisting shard file")?;
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

type Encoded = io::Result<(PathBuf, std::fs::File, ShardDigest)>;

fn spawn_encoder(
    store: ArtifactStore,
    format: Format,
    columns: Vec<OutputColumn>,
) -> anyhow::Result<(mpsc::Sender<Vec<Record>>, tokio::task::JoinHandle<Encoded>)> {
    let (tx, mut rx) = mpsc::channel::<Vec<Record>>(PAGES_IN_FLIGHT);
    let handle = tokio::task::spawn_blocking(move || -> Encoded {
        let (path, file) = store.temp_file()?;
        let result = (|| {
            let mut writer = ShardWriter::new(BufWriter::with_capacity(FILE_BUFFER_BYTES, file), format, columns)?;
            while let Some(page) = rx.blocking_recv() {
                for record in &page {
                    writer.write_row(&record.key, &record.data)?;
                }
            }
            let (buffered, digest) = writer.finish()?;
            let file = buffered.into_inner().map_err(|e| e.into_error())?;
            Ok((file, digest))
        })();
        match result {
            Ok((file, digest)) => Ok((path, file, digest)),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    });
    Ok((tx, handle))
}
