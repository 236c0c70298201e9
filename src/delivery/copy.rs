//! One delivery attempt: the export's shard files, then its manifest, then `_SUCCESS`, copied
//! from exportd's store into the partner's bucket under `{prefix}/{dataset}/{export_id}/`.
//!
//! Each file is streamed (multipart, memory flat) and hashed on the way; an upload whose bytes
//! do not hash to the manifest's sha256 is aborted before it completes, so no wrong object ever
//! becomes visible. After completing, the stored size and ETag are read back and checkpointed
//! under the lease. Names are deterministic: a retry or another worker taking over aborts the
//! uploads the earlier attempt left open in the folder, skips the files still there as they were
//! completed (same size and ETag) and writes the rest, the same bytes under the same names.
//!
//! Each file's bytes are counted against the tenant's egress quota before they are sent, every
//! time they are sent.

use bytes::Bytes;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};

use super::Courier;
use super::store::{self, Charge, Claimed, Completed, LeaseLost, Outcome};
use crate::exports::{ExportState, store as export_store};
use crate::storage::{ObjectKey, Remote, StoreError};

/// The marker a loader waits for: written last, after every file of the export.
pub const SUCCESS_MARKER: &str = "_SUCCESS";
/// The manifest's name in the bucket.
pub const MANIFEST_NAME: &str = "manifest.json";

/// One file to copy.
struct File {
    /// Name inside the export's folder.
    name: String,
    source: Source,
    bytes: u64,
    sha256: String,
}

enum Source {
    /// An object of exportd's store.
    Stored(ObjectKey),
    Inline(Bytes),
}

/// Why an attempt stopped before an outcome.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    #[error("the lease was lost")]
    LeaseLost,
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl From<LeaseLost> for Stop {
    fn from(_: LeaseLost) -> Self {
        Stop::LeaseLost
    }
}

/// The folder of an export in a destination: `{dataset}/{export_id}` under its prefix.
pub fn folder(dataset: &str, export_id: uuid::Uuid) -> String {
    format!("{dataset}/{export_id}")
}

/// Runs the attempt to an outcome (`None`: the lease was lost; the newer attempt decides). The
/// outcome's error is what the partner reads (`last_error`): a bucket's failure only as its
/// reason code; the whole error goes to the log.
pub async fn attempt(courier: &Courier, claimed: &Claimed) -> Result<Option<Outcome>, sqlx::Error> {
    let stopped = match copy(courier, claimed).await {
        Ok(path) => return Ok(Some(Outcome::Delivered { path })),
        Err(Stop::LeaseLost) => return Ok(None),
        Err(Stop::Database(e)) => return Err(e),
        Err(stopped) => stopped,
    };
    if let Stop::Store(e) = &stopped {
        tracing::warn!(error = %e, "a request to the partner's bucket failed");
    }
    Ok(Some(match stopped {
        Stop::Refused(error) => Outcome::Fail { error },
        Stop::Store(StoreError::Remote { reason, .. }) if reason.is_refusal() => {
            Outcome::Fail { error: reason.to_string() }
        }
        Stop::Store(e) => courier.retry_later(claimed, e.public()),
        Stop::Other(e) => courier.retry_later(claimed, format!("{e:#}")),
        Stop::LeaseLost | Stop::Database(_) => unreachable!("returned above"),
    }))
}

/// Copies what the bucket lacks; returns the folder's path as the API names it.
async fn copy(courier: &Courier, claimed: &Claimed) -> Result<String, Stop> {
    let tenant = courier.registry.get(&claimed.tenant).ok_or_else(|| Stop::Refused("the tenant is gone".into()))?;
    let subscribed = tenant.subscriptions.iter().any(|s| s.name == claimed.subscription);
    if !subscribed {
        return Err(Stop::Refused(format!("the subscription `{}` is no longer configured", claimed.subscription)));
    }
    let destination = tenant
        .destination(&claimed.destination)
        .ok_or_else(|| Stop::Refused(format!("the destination `{}` is no longer configured", claimed.destination)))?;
    let files = export_files(courier, claimed).await?;
    let remote = courier.connect(tenant.id.as_str(), destination).await.map_err(Stop::Refused)?;
    let folder = folder(&claimed.dataset, claimed.export_id);
    // Credentials the bucket refuses fail here, before any egress is counted.
    remote.probe().await?;
    if claimed.attempts > 1 {
        // An earlier attempt that died or lost its lease may have left an upload open here.
        let under = ObjectKey::parse(&folder).map_err(|e| Stop::Other(anyhow::anyhow!(e)))?;
        let aborted = remote.abort_uploads_under(&under).await?;
        if aborted > 0 {
            tracing::info!(aborted, "aborted the uploads an earlier attempt left open");
        }
    }
    let key = |name: &str| ObjectKey::parse(&format!("{folder}/{name}")).map_err(|e| Stop::Other(anyhow::anyhow!(e)));
    // Files an earlier attempt completed are skipped while the bucket still holds them as
    // completed; the others (gone, or replaced by someone) are sent again.
    let completed = if claimed.files_done > 0 { store::completed_files(&courier.pool, claimed).await? } else { vec![] };
    let mut bytes_done = claimed.bytes_done;
    for (ordinal, file) in files.iter().enumerate() {
        let key = key(&file.name)?;
        if let Some(was) = completed.get(ordinal) {
            if still_there(&remote, &key, file, was).await? {
                continue;
            }
            tracing::info!(file = %file.name, "a file an earlier attempt completed is gone or changed; sending it again");
        } else {
            bytes_done += file.bytes as i64;
        }
        match store::charge(&courier.pool, tenant, claimed, file.bytes, courier.clock.now()).await? {
            Charge::Counted => {}
            Charge::LeaseLost => return Err(Stop::LeaseLost),
            Charge::OverQuota(rejection) => {
                return Err(Stop::Other(anyhow::anyhow!("{rejection} (the tenant's egress_bytes_per_day)")));
            }
        }
        let written = copy_file(courier, &remote, file, &key).await?;
        metrics::counter!("exportd_bucket_delivery_bytes_total").increment(file.bytes);
        store::checkpoint(&courier.pool, claimed, ordinal as i32, &written, bytes_done).await??;
    }
    remote.put_small(&key(SUCCESS_MARKER)?, Bytes::new()).await?;
    Ok(destination.url.join(&format!("{folder}/")))
}

/// Whether the bucket still holds `file` as an earlier attempt completed it (size and ETag).
async fn still_there(remote: &Remote, key: &ObjectKey, file: &File, was: &Completed) -> Result<bool, Stop> {
    Ok(match remote.head(key).await? {
        Some((size, e_tag)) => size == file.bytes && was.bytes == size as i64 && e_tag == was.e_tag,
        None => false,
    })
}

/// The export's files in delivery order: its shards, then its manifest.
async fn export_files(courier: &Courier, claimed: &Claimed) -> Result<Vec<File>, Stop> {
    let state = export_store::jobs::state(&courier.pool, &claimed.tenant, claimed.export_id).await?;
    if state != Some(ExportState::Succeeded) {
        let state = state.map_or("gone", |s| s.as_str());
        return Err(Stop::Refused(format!("the export is {state}: its files can no longer be delivered")));
    }
    let (manifest, manifest_sha256) = export_store::jobs::manifest(&courier.pool, claimed.export_id)
        .await?
        .ok_or_else(|| Stop::Refused("the export has no manifest".into()))?;
    let parsed: serde_json::Value =
        serde_json::from_slice(&manifest).map_err(|e| Stop::Other(anyhow::anyhow!("reading the manifest: {e}")))?;
    let names: Vec<&str> = parsed["shards"]
        .as_array()
        .map(|shards| shards.iter().filter_map(|s| s["name"].as_str()).collect())
        .unwrap_or_default();
    let shards = export_store::shards::all(&courier.pool, claimed.export_id).await?;
    if names.len() != shards.len() {
        return Err(Stop::Refused("the export's manifest and its checkpoints disagree".into()));
    }
    let mut files: Vec<File> = shards
        .iter()
        .zip(names)
        .map(|(shard, name)| File {
            name: name.to_owned(),
            source: Source::Stored(shard.key()),
            bytes: shard.bytes as u64,
            sha256: shard.sha256.clone(),
        })
        .collect();
    files.push(File {
        name: MANIFEST_NAME.into(),
        bytes: manifest.len() as u64,
        source: Source::Inline(Bytes::from(manifest)),
        sha256: manifest_sha256,
    });
    Ok(files)
}

/// A failure of exportd's own store, where the files come from: retried, and not the partner's
/// to read about beyond that.
fn own_store(error: StoreError) -> Stop {
    tracing::warn!(error = %error, "reading an export's file from exportd's store failed");
    Stop::Other(anyhow::anyhow!("exportd's own store is unavailable; the delivery is retried"))
}

/// Streams one file into the bucket; completes the upload only if the bytes hash to the
/// expected sha256, then checks the stored size. Returns the size and ETag the bucket reports.
async fn copy_file(courier: &Courier, remote: &Remote, file: &File, key: &ObjectKey) -> Result<Completed, Stop> {
    let mut writer = remote.writer(key);
    let mut hasher = Sha256::new();
    let mut sent = 0u64;
    match &file.source {
        Source::Inline(bytes) => {
            hasher.update(bytes);
            writer.push(bytes).await?;
            sent = bytes.len() as u64;
        }
        Source::Stored(source) => {
            let mut stream = courier.artifacts.read(source, 0, file.bytes).await.map_err(own_store)?;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(own_store)?;
                hasher.update(&chunk);
                writer.push(&chunk).await?;
                sent += chunk.len() as u64;
            }
        }
    }
    let sha256 = hex::encode(hasher.finalize());
    if sent != file.bytes || sha256 != file.sha256 {
        // Dropping the writer aborts the upload: nothing of it becomes visible.
        return Err(Stop::Other(anyhow::anyhow!(
            "{} read back from exportd's store as {sent} bytes with sha256 {sha256}, not {} bytes with {}",
            file.name,
            file.bytes,
            file.sha256
        )));
    }
    writer.complete().await?;
    match remote.head(key).await? {
        Some((size, e_tag)) if size == file.bytes => Ok(Completed { bytes: size as i64, e_tag }),
        found => Err(Stop::Other(anyhow::anyhow!(
            "{} was written but the bucket reports {:?} bytes, not {}",
            file.name,
            found.map(|(size, _)| size),
            file.bytes
        ))),
    }
}
