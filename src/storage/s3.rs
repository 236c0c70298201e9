//! The S3-compatible backend, through `object_store` (SigV4, retries and multipart are its job).
//!
//! Objects are written with multipart uploads, so a reader never sees a partial object: it
//! appears when the upload completes. Uploads in progress are registered in PostgreSQL
//! (`pending_uploads`) so the cleaner can abort the ones whose writer died.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{BoxStream, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig,
};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tokio::runtime::Handle;
use tokio::task::JoinSet;

use super::error::{StoreError, StoreResult};
use super::{ObjectKey, StoredObject};

/// Every part but the last has exactly this size (some S3 implementations require equal parts).
const PART_BYTES: usize = 8 * 1024 * 1024;
/// Parts uploading while the encoder fills the next one: memory is (1 + this) × PART_BYTES.
const PARTS_IN_FLIGHT: usize = 2;

/// Where and how to reach the bucket. Credentials never appear in `Debug`.
#[derive(Clone)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix inside the bucket (no leading or trailing `/`; may be empty).
    pub prefix: String,
    /// e.g. `http://127.0.0.1:8333` for SeaweedFS or MinIO; `None` = AWS.
    pub endpoint: Option<String>,
    pub region: String,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub(super) struct S3 {
    store: Arc<AmazonS3>,
    config: Arc<S3Config>,
    pool: PgPool,
}

impl S3 {
    pub(super) fn connect(config: S3Config, pool: PgPool) -> anyhow::Result<S3> {
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_virtual_hosted_style_request(false)
            // Short: a worker's lease is 30 s by default, and it retries whole steps itself.
            .with_retry(RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: 2,
                retry_timeout: Duration::from_secs(15),
            })
            .with_client_options(
                ClientOptions::new().with_connect_timeout(Duration::from_secs(5)).with_timeout(Duration::from_secs(30)),
            );
        if let Some(endpoint) = &config.endpoint {
            builder = builder.with_endpoint(endpoint).with_allow_http(endpoint.starts_with("http://"));
        }
        match (&config.access_key_id, &config.secret_access_key) {
            (Some(id), Some(secret)) => builder = builder.with_access_key_id(id).with_secret_access_key(secret),
            // Without keys object_store asks the cloud's instance metadata (169.254.169.254),
            // which an S3-compatible server elsewhere does not have: say what to set instead.
            _ if config.endpoint.is_some() => anyhow::bail!(
                "no credentials for the object store at {}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                config.endpoint.as_deref().unwrap_or_default()
            ),
            _ => {}
        }
        Ok(S3 { store: Arc::new(builder.build()?), config: Arc::new(config), pool })
    }

    pub(super) fn describe(&self) -> String {
        let endpoint = self.config.endpoint.as_deref().map(|e| format!(" at {e}")).unwrap_or_default();
        format!("s3://{}/{}{endpoint}", self.config.bucket, self.config.prefix)
    }

    fn path(&self, key: &str) -> Path {
        if self.config.prefix.is_empty() {
            Path::from(key)
        } else {
            Path::from(format!("{}/{key}", self.config.prefix))
        }
    }

    fn prefix_path(&self, prefix: Option<&ObjectKey>) -> Option<Path> {
        match prefix {
            Some(key) => Some(self.path(key.as_str())),
            None if self.config.prefix.is_empty() => None,
            None => Some(Path::from(self.config.prefix.as_str())),
        }
    }

    /// A cheap authenticated request, so a wrong endpoint or credentials show at start-up.
    pub(super) async fn probe(&self) -> StoreResult<()> {
        self.probe_raw().await.map_err(Into::into)
    }

    /// [`S3::probe`] with object_store's own error, whose kind says whether access was denied.
    pub(super) async fn probe_raw(&self) -> Result<(), object_store::Error> {
        match self.store.head(&self.path("exportd-probe")).await {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub(super) fn writer(&self, key: &ObjectKey) -> RemoteWriter {
        RemoteWriter {
            s3: self.clone(),
            path: self.path(key.as_str()),
            handle: Handle::current(),
            buf: Vec::with_capacity(PART_BYTES),
            upload: None,
            in_flight: JoinSet::new(),
            parts: Vec::new(),
        }
    }

    pub(super) async fn read(
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

    pub(super) async fn digest(&self, key: &ObjectKey) -> StoreResult<Option<(u64, String)>> {
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
    pub(super) async fn get_small(&self, key: &ObjectKey) -> StoreResult<Option<Bytes>> {
        match self.store.get(&self.path(key.as_str())).await {
            Ok(result) => Ok(Some(result.bytes().await?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes a small object only if none exists (`If-None-Match: *`; a store without
    /// conditional writes overwrites, and the caller reads back what won). Returns whether this
    /// call wrote it.
    pub(super) async fn create(&self, key: &ObjectKey, bytes: Vec<u8>) -> StoreResult<bool> {
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

    pub(super) async fn delete(&self, key: &ObjectKey) -> StoreResult<u64> {
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

    pub(super) async fn list(&self, prefix: Option<&ObjectKey>) -> StoreResult<Vec<StoredObject>> {
        let strip = if self.config.prefix.is_empty() { String::new() } else { format!("{}/", self.config.prefix) };
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
    pub(super) async fn sweep_abandoned(&self, age: Duration) -> StoreResult<(u64, u64)> {
        let stale = sqlx::query!(
            "SELECT upload_id, object_path FROM pending_uploads WHERE touched_at < now() - make_interval(secs => $1)",
            age.as_secs_f64(),
        )
        .fetch_all(&self.pool)
        .await
        .map_err(|e| StoreError::Unavailable(format!("listing pending uploads: {e}")))?;
        let mut aborted = 0;
        for upload in stale {
            let upload_id = upload.upload_id;
            match self.store.abort_multipart(&Path::from(upload.object_path), &upload_id).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            forget_upload(&self.pool, &upload_id).await?;
            aborted += 1;
        }
        Ok((aborted, 0))
    }
}

/// An object being uploaded, written from a blocking thread (the shard encoder). Full parts go
/// up in the background while the next one fills.
pub(super) struct RemoteWriter {
    s3: S3,
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

    async fn complete(&mut self) -> StoreResult<()> {
        let Some(upload) = self.upload.clone() else {
            // It fits in one part: a single PUT is atomic too.
            let payload = PutPayload::from(std::mem::take(&mut self.buf));
            self.s3.store.put(&self.path, payload).await?;
            return Ok(());
        };
        if !self.buf.is_empty() {
            self.send_part().await?;
        }
        while let Some(done) = self.in_flight.join_next().await {
            self.note_part(done)?;
        }
        let parts = self.parts.drain(..).collect::<Option<Vec<_>>>().expect("every part was uploaded");
        self.s3.store.complete_multipart(&self.path, &upload, parts).await?;
        self.upload = None;
        forget_upload(&self.s3.pool, &upload).await
    }

    /// Starts uploading the buffer as the next part; waits while too many are in flight.
    async fn send_part(&mut self) -> StoreResult<()> {
        let upload = match &self.upload {
            Some(upload) => upload.clone(),
            None => {
                let upload = self.s3.store.create_multipart(&self.path).await?;
                let path: &str = self.path.as_ref();
                sqlx::query!("INSERT INTO pending_uploads (upload_id, object_path) VALUES ($1, $2)", upload, path)
                    .execute(&self.s3.pool)
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
        let (s3, path) = (self.s3.clone(), self.path.clone());
        self.in_flight.spawn_on(
            async move {
                let part = s3.store.put_part(&path, &upload, index, payload).await?;
                // A part was sent: the writer is alive (see `sweep_abandoned`).
                let _ = sqlx::query!("UPDATE pending_uploads SET touched_at = now() WHERE upload_id = $1", upload)
                    .execute(&s3.pool)
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
            let (s3, path) = (self.s3.clone(), self.path.clone());
            self.handle.spawn(async move {
                if s3.store.abort_multipart(&path, &upload).await.is_ok() {
                    let _ = forget_upload(&s3.pool, &upload).await;
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

async fn forget_upload(pool: &PgPool, upload: &str) -> StoreResult<()> {
    sqlx::query!("DELETE FROM pending_uploads WHERE upload_id = $1", upload)
        .execute(pool)
        .await
        .map_err(|e| StoreError::Unavailable(format!("forgetting an upload: {e}")))?;
    Ok(())
}
