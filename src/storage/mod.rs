//! The artifact store: where export shard files live, whichever backend holds them.
//!
//! Two backends behind one type: a local directory (`EXPORTD_DATA_DIR/objects`, the default on
//! one machine) and a bucket in object storage (`EXPORTD_STORAGE=s3://bucket/prefix`, `gs://…`
//! or `az://…`, for API and workers on separate hosts). Nothing outside this module knows which one is in use:
//! objects are written through [`ObjectWriter`] and read as byte ranges, and no path escapes.
//! An object is visible only once complete (rename into place; completed multipart upload).

pub mod bucket;
mod error;

pub mod lifecycle;
mod local;
pub mod ownership;
mod remote;

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{BoxStream, StreamExt};
use sqlx::PgPool;

pub use bucket::{BucketConfig, BucketUrl, Credentials, Provider};
pub use error::{RemoteReason, StoreError, StoreResult, find as find_store_error};
pub use ownership::{Deployment, MARKER, OwnershipError};
pub use remote::{Remote, RemoteWriter};

use local::{LocalDir, LocalWriter};

/// The artifact store's uploads in `pending_uploads` (partners' buckets have tags of their own).
const ARTIFACT_STORE_TAG: &str = "";

/// The environment variables holding each cloud's credentials for `EXPORTD_STORAGE`.
fn credential_names(provider: Provider) -> &'static str {
    match provider {
        Provider::S3 => "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        Provider::Gcs => "GOOGLE_SERVICE_ACCOUNT_KEY",
        Provider::Azure => "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY",
    }
}

/// Bytes read from a local file per chunk of a download or digest stream.
const READ_CHUNK: usize = 256 * 1024;

/// A relative object path of `[A-Za-z0-9._-]` segments (no `..`, no empty segment).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(String);

impl ObjectKey {
    pub fn parse(text: &str) -> Result<ObjectKey, String> {
        let valid_segment = |s: &str| {
            !s.is_empty() && s != "." && s != ".." && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        };
        if text.len() <= 512 && text.split('/').all(valid_segment) {
            Ok(ObjectKey(text.to_owned()))
        } else {
            Err(format!("`{text}` is not a valid object key"))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key's `/`-separated segments.
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }
}

/// An object found by [`ArtifactStore::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredObject {
    pub key: ObjectKey,
    pub bytes: u64,
}

/// Where artifacts are stored, from `EXPORTD_STORAGE`.
#[derive(Debug, Clone)]
pub enum StorageLocation {
    Local(PathBuf),
    Bucket(BucketConfig),
}

impl StorageLocation {
    /// `file://<dir>`, `s3://<bucket>[/<prefix>]` (also `gs://`, `az://`), or `None` (= the
    /// local `data_dir`). `env` supplies the endpoint (`EXPORTD_S3_ENDPOINT`, for any provider)
    /// and each cloud's usual credentials: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
    /// `AWS_REGION`; `GOOGLE_SERVICE_ACCOUNT_KEY`; `AZURE_STORAGE_ACCOUNT_NAME` and
    /// `AZURE_STORAGE_ACCOUNT_KEY`. Without them the environment's own identity is used.
    pub fn parse(
        url: Option<&str>,
        data_dir: &Path,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<StorageLocation, String> {
        let Some(url) = url.filter(|u| !u.is_empty()) else { return Ok(StorageLocation::Local(data_dir.join(""))) };
        if let Some(dir) = url.strip_prefix("file://") {
            return if dir.is_empty() {
                Err("file:// needs a directory, e.g. file:///var/lib/exportd".into())
            } else {
                Ok(StorageLocation::Local(PathBuf::from(dir)))
            };
        }
        let url = BucketUrl::parse(url).map_err(|e| format!("{e} (or file://<dir>)"))?;
        let endpoint = env("EXPORTD_S3_ENDPOINT").filter(|e| !e.is_empty());
        if let Some(endpoint) = &endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(format!("EXPORTD_S3_ENDPOINT `{endpoint}` must start with http:// or https://"));
        }
        let secret = |name: &str| env(name).map(secrecy::SecretString::from);
        let credentials = match url.provider {
            Provider::S3 => match (env("AWS_ACCESS_KEY_ID"), secret("AWS_SECRET_ACCESS_KEY")) {
                (Some(access_key_id), Some(secret_access_key)) => Credentials::S3 { access_key_id, secret_access_key },
                _ => Credentials::Ambient,
            },
            Provider::Gcs => match secret("GOOGLE_SERVICE_ACCOUNT_KEY") {
                Some(service_account_key) => Credentials::Gcs { service_account_key },
                None => Credentials::Ambient,
            },
            Provider::Azure => match (env("AZURE_STORAGE_ACCOUNT_NAME"), secret("AZURE_STORAGE_ACCOUNT_KEY")) {
                (Some(account), Some(access_key)) => Credentials::Azure { account, access_key },
                _ => Credentials::Ambient,
            },
        };
        let region = env("AWS_REGION").or_else(|| env("AWS_DEFAULT_REGION"));
        Ok(StorageLocation::Bucket(BucketConfig { url, endpoint, region, credentials }))
    }
}

#[derive(Debug, Clone)]
enum Backend {
    Local(LocalDir),
    Remote(Remote),
}

/// The artifact store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ArtifactStore {
    backend: Backend,
    /// The last reachability check (see [`ArtifactStore::reachable`]), shared by clones.
    health: std::sync::Arc<tokio::sync::Mutex<Option<LastCheck>>>,
}

/// When the store was last asked whether it answers, and what it said.
type LastCheck = (std::time::Instant, Result<(), String>);

/// A reachability answer is reused for this long, so `/healthz` (open to anyone) costs the store
/// at most one request per period.
const HEALTH_TTL: Duration = Duration::from_secs(5);
/// A store that has not answered a reachability check within this long is unreachable.
const HEALTH_PATIENCE: Duration = Duration::from_secs(3);

impl ArtifactStore {
    /// The local-directory store under `data_dir` (created if missing).
    pub fn open_local(data_dir: &Path) -> std::io::Result<ArtifactStore> {
        Ok(ArtifactStore::new(Backend::Local(LocalDir::open(data_dir)?)))
    }

    /// The store at `location`. Object storage keeps its multipart uploads in progress in
    /// `pool`'s database; a store it cannot reach is reported, not fatal (it may come back); one
    /// that refuses the credentials is fatal, and so are missing credentials for an endpoint.
    pub async fn connect(location: &StorageLocation, pool: &PgPool) -> anyhow::Result<ArtifactStore> {
        let store = match location {
            StorageLocation::Local(dir) => ArtifactStore::open_local(dir)
                .map_err(|e| anyhow::anyhow!("opening the artifact store in {}: {e}", dir.display()))?,
            StorageLocation::Bucket(config) => {
                let remote = Remote::connect(config, &bucket::Reach::Own, ARTIFACT_STORE_TAG, pool.clone())
                    .map_err(|e| anyhow::anyhow!("EXPORTD_STORAGE {}: {e}", config.url))?;
                match remote.probe_raw().await {
                    Ok(()) => {}
                    // Wrong keys do not fix themselves: refuse to start rather than fail every export.
                    Err(
                        e
                        @ (object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }),
                    ) => anyhow::bail!(
                        "the object store {} denied access: check {} (and that they may read and write the bucket): {e}",
                        remote.describe(),
                        credential_names(config.url.provider)
                    ),
                    // Unreachable may pass (a store starting up, a network blip): workers retry.
                    Err(e) => {
                        tracing::warn!(store = remote.describe(), error = %e, "the object store does not answer yet")
                    }
                }
                ArtifactStore::new(Backend::Remote(remote))
            }
        };
        Ok(store)
    }

    fn new(backend: Backend) -> ArtifactStore {
        ArtifactStore { backend, health: Default::default() }
    }

    /// Whether the store answers (an authenticated request for S3, the directory for a local
    /// store), checked at most once per [`HEALTH_TTL`] whoever asks; the error says why not.
    pub async fn reachable(&self) -> Result<(), String> {
        let mut last = self.health.lock().await;
        if let Some((at, answer)) = last.as_ref()
            && at.elapsed() < HEALTH_TTL
        {
            return answer.clone();
        }
        let check = async {
            match &self.backend {
                Backend::Local(dir) => {
                    let dir = dir.clone();
                    blocking(move || dir.check()).await
                }
                Backend::Remote(remote) => remote.probe().await,
            }
        };
        let answer = match tokio::time::timeout(HEALTH_PATIENCE, check).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} s", HEALTH_PATIENCE.as_secs())),
        };
        *last = Some((std::time::Instant::now(), answer.clone()));
        answer
    }

    /// `file:///abs/dir` or `s3://bucket/prefix at endpoint`, for logs and `/healthz`.
    pub fn describe(&self) -> String {
        match &self.backend {
            Backend::Local(dir) => dir.describe(),
            Backend::Remote(remote) => remote.describe(),
        }
    }

    /// A writer for the object `key`, to be used on a blocking thread (it blocks on uploads).
    /// The object appears only on [`ObjectWriter::finish`].
    pub fn writer(&self, key: &ObjectKey) -> StoreResult<ObjectWriter> {
        Ok(match &self.backend {
            Backend::Local(dir) => ObjectWriter(WriterBackend::Local(dir.writer(key)?)),
            Backend::Remote(remote) => ObjectWriter(WriterBackend::Remote(Box::new(remote.writer(key)))),
        })
    }

    /// `len` bytes of `key` from `offset`, streamed. Errors opening the object come here,
    /// before any byte; errors later come in the stream.
    pub async fn read(
        &self,
        key: &ObjectKey,
        offset: u64,
        len: u64,
    ) -> StoreResult<BoxStream<'static, StoreResult<Bytes>>> {
        match &self.backend {
            Backend::Local(dir) => {
                let (dir, owned_key) = (dir.clone(), key.clone());
                let reader = blocking(move || dir.open_range(&owned_key, offset, len)).await.map_err(|e| match e {
                    StoreError::Io(e) if e.kind() == std::io::ErrorKind::NotFound => StoreError::Missing(key.0.clone()),
                    other => other,
                })?;
                Ok(blocking_chunks(reader))
            }
            Backend::Remote(remote) => remote.read(key, offset, len).await,
        }
    }

    /// A small object's bytes (a marker, not an export file), or `None` when it does not exist.
    pub async fn get_small(&self, key: &ObjectKey) -> StoreResult<Option<Bytes>> {
        match &self.backend {
            Backend::Local(dir) => {
                let (dir, key) = (dir.clone(), key.clone());
                Ok(blocking(move || dir.read_all(&key)).await?.map(Bytes::from))
            }
            Backend::Remote(remote) => remote.get_small(key).await,
        }
    }

    /// Writes a small object unless one exists. Returns whether this call wrote it.
    pub async fn create_small(&self, key: &ObjectKey, bytes: Vec<u8>) -> StoreResult<bool> {
        match &self.backend {
            Backend::Local(dir) => {
                let (dir, key) = (dir.clone(), key.clone());
                blocking(move || dir.create(&key, &bytes)).await
            }
            Backend::Remote(remote) => remote.create(key, bytes).await,
        }
    }

    /// Size and sha256 of the stored bytes of `key`, or `None` when it does not exist.
    pub async fn digest(&self, key: &ObjectKey) -> StoreResult<Option<(u64, String)>> {
        match &self.backend {
            Backend::Local(dir) => {
                let (dir, key) = (dir.clone(), key.clone());
                blocking(move || dir.digest(&key)).await
            }
            Backend::Remote(remote) => remote.digest(key).await,
        }
    }

    /// Deletes an object; a missing one is fine. Returns the bytes freed.
    pub async fn delete(&self, key: &ObjectKey) -> StoreResult<u64> {
        match &self.backend {
            Backend::Local(dir) => {
                let (dir, key) = (dir.clone(), key.clone());
                blocking(move || dir.delete(&key)).await
            }
            Backend::Remote(remote) => remote.delete(key).await,
        }
    }

    /// Every object under `prefix/` (all objects for `None`).
    pub async fn list(&self, prefix: Option<&ObjectKey>) -> StoreResult<Vec<StoredObject>> {
        match &self.backend {
            Backend::Local(dir) => {
                let (dir, prefix) = (dir.clone(), prefix.cloned());
                blocking(move || dir.list(prefix.as_ref())).await
            }
            Backend::Remote(remote) => remote.list(prefix).await,
        }
    }

    /// Deletes every object under `prefix/` (e.g. one export's). Returns (objects, bytes).
    pub async fn delete_prefix(&self, prefix: &ObjectKey) -> StoreResult<(u64, u64)> {
        let (mut objects, mut bytes) = (0, 0);
        for object in self.list(Some(prefix)).await? {
            bytes += self.delete(&object.key).await?;
            objects += 1;
        }
        if let Backend::Local(dir) = &self.backend {
            dir.prune(prefix);
        }
        Ok((objects, bytes))
    }

    /// Cleans up after writers that died: temp files (local) or multipart uploads (S3) not
    /// written to for `age`. Returns (items, bytes) reclaimed (bytes unknown for uploads: 0).
    pub async fn sweep_abandoned(&self, age: Duration) -> StoreResult<(u64, u64)> {
        match &self.backend {
            Backend::Local(dir) => {
                let dir = dir.clone();
                blocking(move || dir.sweep_abandoned(age)).await
            }
            Backend::Remote(remote) => remote.sweep_abandoned(age).await,
        }
    }
}

/// An object being written (see [`ArtifactStore::writer`]). Dropping it without `finish`
/// discards what was written; nothing becomes visible.
pub struct ObjectWriter(WriterBackend);

enum WriterBackend {
    Local(LocalWriter),
    Remote(Box<RemoteWriter>),
}

impl ObjectWriter {
    /// Makes the object visible, whole and durable. Blocking.
    pub fn finish(self) -> StoreResult<()> {
        match self.0 {
            WriterBackend::Local(writer) => Ok(writer.finish()?),
            WriterBackend::Remote(writer) => writer.finish(),
        }
    }
}

impl std::io::Write for ObjectWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.0 {
            WriterBackend::Local(writer) => writer.write(buf),
            WriterBackend::Remote(writer) => writer.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.0 {
            WriterBackend::Local(writer) => writer.flush(),
            WriterBackend::Remote(writer) => writer.flush(),
        }
    }
}

async fn blocking<T: Send + 'static>(work: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> StoreResult<T> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => Ok(result?),
        Err(e) => Err(StoreError::Io(std::io::Error::other(e))),
    }
}

/// A blocking reader as a stream of chunks, each read on the blocking pool, one chunk ahead:
/// the next read runs while the body sends the chunk before it (at most two chunks per reader).
fn blocking_chunks<R: std::io::Read + Send + 'static>(reader: R) -> BoxStream<'static, StoreResult<Bytes>> {
    fn read_chunk<R: std::io::Read + Send + 'static>(
        mut reader: R,
    ) -> tokio::task::JoinHandle<std::io::Result<(R, Vec<u8>)>> {
        tokio::task::spawn_blocking(move || {
            use std::io::Read;
            // Into spare capacity: `read_to_end` does not zero the buffer first.
            let mut chunk = Vec::with_capacity(READ_CHUNK);
            (&mut reader).take(READ_CHUNK as u64).read_to_end(&mut chunk)?;
            Ok((reader, chunk))
        })
    }
    futures_util::stream::try_unfold(Some(read_chunk(reader)), |reading| async move {
        let Some(reading) = reading else { return Ok(None) };
        let (reader, chunk) = reading.await.map_err(std::io::Error::other)??;
        Ok(if chunk.is_empty() {
            None
        } else {
            let next = (chunk.len() == READ_CHUNK).then(|| read_chunk(reader));
            Some((Bytes::from(chunk), next))
        })
    })
    .boxed()
}

/// Size and sha256 of a local file, or `None` when it does not exist (blocking). For the
/// partner client's downloads, not for stored objects.
pub fn file_digest(path: &Path) -> std::io::Result<Option<(u64, String)>> {
    match std::fs::File::open(path) {
        Ok(file) => local::sha256_of(file).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_keys_cannot_escape_the_root() {
        assert!(ObjectKey::parse("acme/0f0e/g1/shard-00000.csv.gz").is_ok());
        for bad in ["", "/abs", "a//b", "../x", "a/../b", "a/./b", "a b", "a\\b"] {
            assert!(ObjectKey::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn storage_locations_parse_with_the_field_named_on_error() {
        let env = |name: &str| (name == "EXPORTD_S3_ENDPOINT").then(|| "http://127.0.0.1:8333".to_owned());
        let data = Path::new("/var/exportd");
        assert!(
            matches!(StorageLocation::parse(None, data, env), Ok(StorageLocation::Local(p)) if p.starts_with(data))
        );
        let Ok(StorageLocation::Bucket(s3)) = StorageLocation::parse(Some("s3://exports/prod/eu"), data, env) else {
            panic!("s3 url not parsed")
        };
        assert_eq!(
            (s3.url.provider, s3.url.bucket.as_str(), s3.url.prefix.as_str()),
            (Provider::S3, "exports", "prod/eu")
        );
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        let Ok(StorageLocation::Bucket(gcs)) = StorageLocation::parse(Some("gs://exports-eu"), data, env) else {
            panic!("gs url not parsed")
        };
        assert_eq!(gcs.url.provider, Provider::Gcs);
        for bad in ["s3://E", "s3://exports/../x", "ftp://bucket", "file://"] {
            assert!(StorageLocation::parse(Some(bad), data, env).is_err(), "{bad} accepted");
        }
        let bad_endpoint = |_: &str| Some("127.0.0.1:8333".to_owned());
        let error = StorageLocation::parse(Some("s3://exports"), data, bad_endpoint).unwrap_err();
        assert!(error.contains("EXPORTD_S3_ENDPOINT"), "{error}");
    }
}
