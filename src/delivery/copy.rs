//! One delivery attempt: the export's shard files, then its manifest, then `_SUCCESS`, copied
//! from exportd's store into the partner's bucket under `{prefix}/{dataset}/{export_id}/`.
//!
//! Each file is streamed (multipart, memory flat) and hashed on the way; an upload whose bytes
//! do not hash to the manifest's sha256 is aborted before it completes, so no wrong object ever
//! becomes visible. After completing, the stored size is read back. Names are deterministic: a
//! retry or another worker taking over writes the same bytes under the same names, after
//! aborting the uploads the earlier attempt left open in the folder. Progress is checkpointed
//! per file under the lease.

use bytes::Bytes;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};

use super::Courier;
use super::store::{self, Claimed, LeaseLost, Outcome};
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
        Ok(()) => return Ok(Some(Outcome::Delivered)),
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

async fn copy(courier: &Courier, claimed: &Claimed) -> Result<(), Stop> {
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
    if !claimed.egress_counted {
        let total: u64 = files.iter().map(|f| f.bytes).sum();
        let path = destination.url.join(&format!("{folder}/"));
        let now = courier.clock.now();
        if let Err(rejection) = store::count_egress(&courier.pool, tenant, claimed, total, &path, now).await? {
            return Err(Stop::Other(anyhow::anyhow!("{rejection} (the tenant's egress_bytes_per_day)")));
        }
    }
    let (mut done, mut bytes) = (claimed.files_done.max(0) as usize, claimed.bytes_done);
    for file in files.iter().skip(done) {
        let key = ObjectKey::parse(&format!("{folder}/{}", file.name)).map_err(|e| Stop::Other(anyhow::anyhow!(e)))?;
        copy_file(courier, &remote, file, &key).await?;
        done += 1;
        bytes += file.bytes as i64;
        store::checkpoint(&courier.pool, claimed, done as i32, bytes).await??;
        metrics::counter!("exportd_bucket_delivery_bytes_total").increment(file.bytes);
    }
    let marker = ObjectKey::parse(&format!("{folder}/{SUCCESS_MARKER}")).expect("a valid key");
    remote.put_small(&marker, Bytes::new()).await?;
    Ok(())
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
/// expected sha256, then checks the stored size.
async fn copy_file(courier: &Courier, remote: &Remote, file: &File, key: &ObjectKey) -> Result<(), Stop> {
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
    match remote.size(key).await? {
        Some(size) if size == file.bytes => Ok(()),
        found => Err(Stop::Other(anyhow::anyhow!(
            "{} was written but the bucket reports {found:?} bytes, not {}",
            file.name,
            file.bytes
        ))),
    }
}
