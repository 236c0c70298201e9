//! The object-storage backend, one generic code path for every cloud: an `object_store`
//! store built by [`super::bucket`] (SigV4 or the cloud's own signing, retries and multipart are
//! its job) behind `Arc<dyn RemoteObjects>`. exportd's artifact store and partners' buckets
//! (deliveries) both go through it.
//!
//! Objects are written with multipart uploads, so a reader never sees a partial object: it
//! appears when the upload completes. Uploads in progress are registered in PostgreSQL
//! (`pending_uploads`, under the store's tag) so the cleaner can abort the ones whose writer died.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{BoxStream, StreamExt, TryStreamExt};
use object_store::multipart::PartId;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tokio::runtime::Handle;
use tokio::task::JoinSet;

use super::bucket::{BucketConfig, Reach, RemoteObjects};
use super::error::{StoreError, StoreResult};
use super::{ObjectKey, StoredObject};

/// Every part but the last has exactly this size (some S3 implementations require equal parts).
const PART_BYTES: usize = 8 * 1024 * 1024;
/// Parts uploading while the encoder fills the next one: memory is (1 + this) × PART_BYTES.
const PARTS_IN_FLIGHT: usize = 2;

/// A bucket (under a prefix) reached through `object_store`. Cheap to clone.
#[derive(Clone)]
pub struct Remote {
    store: Arc<dyn RemoteObjects>,
    prefix: Arc<str>,
    described: Arc<str>,
    /// Which store's uploads are ours in `pending_uploads` ('' = the artifact store).
    tag: Arc<str>,
    pool: PgPool,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote").field("store", &self.described).finish_non_exhaustive()
    }
}

impl Remote {
    /// The bucket of `config`, reached as `reach` says, its uploads registered in `pool` under `tag`.
    pub fn connect(config: &BucketConfig, reach: &Reach, tag: &str, pool: PgPool) -> anyhow::Result<Remote> {
        Ok(Remote {
            store: config.build(reach)?,
            prefix: config.url.prefix.as_str().into(),
            described: config.describe().into(),
            tag: tag.into(),
            pool,
        })
    }

    pub fn describe(&self) -> String {
        self.described.to_string()
    }

    fn path(&self, key: &str) -> Path {
        if self.prefix.is_empty() { Path::from(key) } else { Path::from(format!("{}/{key}", self.prefix)) }
    }

    fn prefix_path(&self, prefix: Option<&ObjectKey>) -> Option<Path> {
        match prefix {
            Some(key) => Some(self.path(key.as_str())),
            None if self.prefix.is_empty() => None,
            None => Some(Path::from(&*self.prefix)),
        }
    }

    /// A cheap authenticated request, so a wrong endpoint or credentials show at start-up.
    pub async fn probe(&self) -> StoreResult<()> {
        self.probe_raw().await.map_err(Into::into)
    }

    /// [`Remote::probe`] with object_store's own error, whose kind says whether access was denied.
    pub async fn probe_raw(&self) -> Result<(), object_store::Error> {
        match self.store.head(&self.path("exportd-probe")).await {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// An upload of `key`: written in parts, visible whole once finished.
    pub fn writer(&self, key: &ObjectKey) -> RemoteWriter {
        RemoteWriter {
            remote: self.clone(),
            path: self.path(key.as_str()),
            handle: Handle::current(),
            buf: Vec::with_capacity(PART_BYTES),
            upload: None,
            in_flight: JoinSet::new(),
            parts: Vec::new(),
        }
    }

    /// The size and ETag of the stored object `key`, or `None` when it does not exist.
    pub async fn head(&self, key: &ObjectKey) -> StoreResult<Option<(u64, Option<String>)>> {
        match self.store.head(&self.path(key.as_str())).await {
            Ok(meta) => Ok(Some((meta.size, meta.e_tag))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes a small object whole (a marker, a manifest), replacing any.
    pub async fn put_small(&self, key: &ObjectKey, bytes: Bytes) -> StoreResult<()> {
        self.store.put(&self.path(key.as_str()), PutPayload::from(bytes)).await?;
        Ok(())
    }

    pub async fn read(
        &self,
        key: &ObjectKey,
        offset: u64,
        len: u64,
    ) -> StoreResult<BoxStream<'static, StoreResult<Bytes>>> {
        if len == 0 {
            return Ok(futures_util::stream::empty().boxed());
        }
        let options = GetOptions { range: Some(GetRange::Bounded(offset..offset + len)), ..GetOptions::default() };
        let result = match self.store.get_opts(&self.path(key.as_str()), options).await {
            Ok(result) => result,
            Err(object_store::Error::NotFound { .. }) => return Err(StoreError::Missing(key.as_str().to_owned())),
            Err(e) => return Err(e.into()),
        };
        Ok(result.into_stream().map_err(StoreError::from).boxed())
    }

    pub async fn digest(&self, key: &ObjectKey) -> StoreResult<Option<(u64, String)>> {
        let mut stream = match self.store.get(&self.path(key.as_str())).await {
            Ok(result) => result.into_stream(),
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let (mut hasher, mut bytes) = (Sha256::new(), 0u64);
        while let Some(chunk) = stream.try_next().await? {
            hasher.update(&chunk);
            bytes += chunk.len() as u64;
        }
        Ok(Some((bytes, hex::encode(hasher.finalize()))))
    }

    /// A small object's bytes, or `None` when it does not exist.
    pub async fn get_small(&self, key: &ObjectKey) -> StoreResult<Option<Bytes>> {
        match self.store.get(&self.path(key.as_str())).await {
            Ok(result) => Ok(Some(result.bytes().await?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes a small object only if none exists (`If-None-Match: *`; a store without
    /// conditional writes overwrites, and the caller reads back what won). Returns whether this
    /// call wrote it.
    pub async fn create(&self, key: &ObjectKey, bytes: Vec<u8>) -> StoreResult<bool> {
        let path = self.path(key.as_str());
        let options = PutOptions { mode: PutMode::Create, ..PutOptions::default() };
        match self.store.put_opts(&path, PutPayload::from(bytes.clone()), options).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => Ok(false),
            Err(object_store::Error::NotImplemented { .. }) => {
                self.store.put(&path, PutPayload::from(bytes)).await?;
                Ok(true)
            }
            Err(e) => Err(e.into()),
        }
    }

    pub async fn delete(&self, key: &ObjectKey) -> StoreResult<u64> {
        let path = self.path(key.as_str());
        let bytes = match self.store.head(&path).await {
            Ok(meta) => meta.size,
            Err(object_store::Error::NotFound { .. }) => return Ok(0),
            Err(e) => return Err(e.into()),
        };
        match self.store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(bytes),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn list(&self, prefix: Option<&ObjectKey>) -> StoreResult<Vec<StoredObject>> {
        let strip = if self.prefix.is_empty() { String::new() } else { format!("{}/", self.prefix) };
        let metas: Vec<_> = self.store.list(self.prefix_path(prefix).as_ref()).try_collect().await?;
        Ok(metas
            .into_iter()
            .filter_map(|meta| {
                let key = ObjectKey::parse(meta.location.as_ref().strip_prefix(&strip)?).ok()?;
                Some(StoredObject { key, bytes: meta.size })
            })
            .collect())
    }

    /// Aborts uploads whose writer has not sent a part for `age`. Returns how many.
    pub async fn sweep_abandoned(&self, age: Duration) -> StoreResult<(u64, u64)> {
        let stale = sqlx::query_as!(
            Registered,
            "SELECT upload_id, object_path FROM pending_uploads
              WHERE store = $2 AND touched_at < now() - make_interval(secs => $1)",
            age.as_secs_f64(),
            &*self.tag,
        )
        .fetch_all(&self.pool)
        .await
        .map_err(|e| StoreError::Unavailable(format!("listing pending uploads: {e}")))?;
        Ok((self.abort_registered(stale).await?, 0))
    }

    /// Aborts every upload registered under the folder `folder` at once, whatever its age: for
    /// a writer known to be dead or fenced (a delivery taken over). Returns how many.
    pub async fn abort_uploads_under(&self, folder: &ObjectKey) -> StoreResult<u64> {
        let under = format!("{}/", self.path(folder.as_str()));
        let left = sqlx::query_as!(
            Registered,
            "SELECT upload_id, object_path FROM pending_uploads WHERE store = $1 AND starts_with(object_path, $2)",
            &*self.tag,
            under,
        )
        .fetch_all(&self.pool)
        .await
        .map_err(|e| StoreError::Unavailable(format!("listing pending uploads: {e}")))?;
        self.abort_registered(left).await
    }

    async fn abort_registered(&self, uploads: Vec<Registered>) -> StoreResult<u64> {
        let mut aborted = 0;
        for upload in uploads {
            match self.store.abort_multipart(&Path::from(upload.object_path), &upload.upload_id).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            forget_upload(self, &upload.upload_id).await?;
            aborted += 1;
        }
        Ok(aborted)
    }
}

/// An upload registered in `pending_uploads`.
struct Registered {
    upload_id: String,
    object_path: String,
}

/// An object being uploaded: from a blocking thread (the shard encoder, through
/// `std::io::Write`) or from async code ([`RemoteWriter::push`], [`RemoteWriter::complete`]).
/// Full parts go up in the background while the next one fills.
pub struct RemoteWriter {
    remote: Remote,
    path: Path,
    handle: Handle,
    buf: Vec<u8>,
    upload: Option<String>,
    in_flight: JoinSet<StoreResult<(usize, PartId)>>,
    parts: Vec<Option<PartId>>,
}

impl RemoteWriter {
    /// Completes the object; it becomes visible whole. Blocking. On error the upload is aborted
    /// (when dropped).
    pub(super) fn finish(mut self) -> StoreResult<()> {
        let handle = self.handle.clone();
        handle.block_on(self.complete())
    }

    /// Adds `data` to the object, sending each full part (waiting while too many are in flight).
    pub async fn push(&mut self, mut data: &[u8]) -> StoreResult<()> {
        while !data.is_empty() {
            let take = data.len().min(PART_BYTES - self.buf.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == PART_BYTES {
                self.send_part().await?;
            }
        }
        Ok(())
    }

    /// Completes the object; it becomes visible whole. On error (or if never called) the upload
    /// is aborted when the writer is dropped.
    pub async fn complete(&mut self) -> StoreResult<()> {
        let Some(upload) = self.upload.clone() else {
            // It fits in one part: a single PUT is atomic too.
            let payload = PutPayload::from(std::mem::take(&mut self.buf));
            self.remote.store.put(&self.path, payload).await?;
            return Ok(());
        };
        if !self.buf.is_empty() {
            self.send_part().await?;
        }
        while let Some(done) = self.in_flight.join_next().await {
            self.note_part(done)?;
        }
        let parts = self.parts.drain(..).collect::<Option<Vec<_>>>().expect("every part was uploaded");
        self.remote.store.complete_multipart(&self.path, &upload, parts).await?;
        self.upload = None;
        forget_upload(&self.remote, &upload).await
    }

    /// Starts uploading the buffer as the next part; waits while too many are in flight.
    async fn send_part(&mut self) -> StoreResult<()> {
        let upload = match &self.upload {
            Some(upload) => upload.clone(),
            None => {
                let upload = self.remote.store.create_multipart(&self.path).await?;
                let path: &str = self.path.as_ref();
                sqlx::query!(
                    "INSERT INTO pending_uploads (store, upload_id, object_path) VALUES ($1, $2, $3)",
                    &*self.remote.tag,
                    upload,
                    path
                )
                .execute(&self.remote.pool)
                .await
                .map_err(|e| StoreError::Unavailable(format!("registering an upload: {e}")))?;
                self.upload = Some(upload.clone());
                upload
            }
        };
        while self.in_flight.len() >= PARTS_IN_FLIGHT {
            let done = self.in_flight.join_next().await.expect("in flight");
            self.note_part(done)?;
        }
        let index = self.parts.len();
        self.parts.push(None);
        let payload = PutPayload::from(std::mem::replace(&mut self.buf, Vec::with_capacity(PART_BYTES)));
        let (remote, path) = (self.remote.clone(), self.path.clone());
        self.in_flight.spawn_on(
            async move {
                let part = remote.store.put_part(&path, &upload, index, payload).await?;
                // A part was sent: the writer is alive (see `sweep_abandoned`).
                let _ = sqlx::query!(
                    "UPDATE pending_uploads SET touched_at = now() WHERE store = $1 AND upload_id = $2",
                    &*remote.tag,
                    upload
                )
                .execute(&remote.pool)
                .await;
                Ok((index, part))
            },
            &self.handle,
        );
        Ok(())
    }

    fn note_part(&mut self, done: Result<StoreResult<(usize, PartId)>, tokio::task::JoinError>) -> StoreResult<()> {
        let (index, part) = done.map_err(|e| StoreError::Unavailable(format!("part upload task: {e}")))??;
        self.parts[index] = Some(part);
        Ok(())
    }
}

impl Drop for RemoteWriter {
    /// An unfinished upload is aborted in the background (parts in flight stop with the
    /// `JoinSet`). If that fails too, the registration stays and the cleaner aborts it later.
    fn drop(&mut self) {
        if let Some(upload) = self.upload.take() {
            let (remote, path) = (self.remote.clone(), self.path.clone());
            self.handle.spawn(async move {
                if remote.store.abort_multipart(&path, &upload).await.is_ok() {
                    let _ = forget_upload(&remote, &upload).await;
                }
            });
        }
    }
}

impl std::io::Write for RemoteWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let take = data.len().min(PART_BYTES - self.buf.len());
        self.buf.extend_from_slice(&data[..take]);
        if self.buf.len() == PART_BYTES {
            let handle = self.handle.clone();
            handle.block_on(self.send_part()).map_err(StoreError::into_io)?;
        }
        Ok(take)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn forget_upload(remote: &Remote, upload: &str) -> StoreResult<()> {
    sqlx::query!("DELETE FROM pending_uploads WHERE store = $1 AND upload_id = $2", &*remote.tag, upload)
        .execute(&remote.pool)
        .await
        .map_err(|e| StoreError::Unavailable(format!("forgetting an upload: {e}")))?;
    Ok(())
}
