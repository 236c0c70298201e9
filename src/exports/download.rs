//! What a download may serve: the object, its layout and validator, after every check.

use uuid::Uuid;

use super::{ExportError, ExportJob, Layout, get};
use crate::auth::Caller;

/// A downloadable object of an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Object {
    /// The whole export as one gzip file.
    File,
    Shard(u32),
    /// A table version's change file (Delta Sharing `cdf`).
    Changes,
}

impl Object {
    /// The name links are bound to: `file` or `shard-<n>`.
    pub fn name(self) -> String {
        match self {
            Object::File => "file".to_owned(),
            Object::Shard(n) => format!("shard-{n}"),
            Object::Changes => "changes".to_owned(),
        }
    }

    /// Its path under `/v1/exports/{id}/`.
    pub fn path(self) -> String {
        match self {
            Object::File => "file".to_owned(),
            Object::Shard(n) => format!("shards/{n}"),
            Object::Changes => "changes-file".to_owned(),
        }
    }
}

pub struct Download {
    pub job: ExportJob,
    pub object: Object,
    pub layout: Layout,
    /// Strong ETag: the quoted sha256 of the bytes.
    pub etag: String,
    pub filename: String,
}

/// Checks, at every download, that the caller may see the export, is still granted its dataset
/// (a partner: under the same row filter), and that the export still has files; then lays the
/// object out. The job and its shards are read at once, on two connections (one round trip
/// before the first byte instead of two); the shards of an export the caller may not see come
/// back empty.
pub async fn open(pool: &sqlx::PgPool, caller: &Caller, id: Uuid, object: Object) -> Result<Download, ExportError> {
    let (job, shards) = tokio::join!(get(pool, caller, id), super::store::shards::visible(pool, caller, id));
    let (job, shards) = (job?, shards?);
    let dataset = caller.tenant.dataset(&job.dataset).ok_or(ExportError::DatasetNotGranted)?;
    if !caller.principal.is_granted(&dataset.name) {
        return Err(ExportError::DatasetNotGranted);
    }
    super::ensure_published(caller, &job)?;
    let extension = job.format.extension();
    let (layout, sha256, filename) = match object {
        Object::File if !job.format.spec().spliceable() => return Err(ExportError::NoWholeFile(job.format)),
        Object::File => (
            Layout::whole_file(&shards),
            job.file_sha256.clone().unwrap_or_default(),
            format!("{}-{}.{extension}", job.dataset, job.id),
        ),
        Object::Shard(n) => {
            let shard = shards.get(n as usize).ok_or(ExportError::NotFound)?;
            (Layout::shard(shard), shard.sha256.clone(), format!("{}-{}-shard-{n:05}.{extension}", job.dataset, job.id))
        }
        Object::Changes => {
            let file = crate::sharing::changes::of_export(pool, id).await?.ok_or(ExportError::NotFound)?;
            let key = crate::storage::ObjectKey::parse(&file.object_key)
                .expect("object keys are validated before they are stored");
            let layout = Layout::object(key, file.bytes as u64);
            (layout, file.sha256, format!("{}-{}-changes-from-v{}.parquet", job.dataset, job.id, file.from_version))
        }
    };
    Ok(Download { etag: format!("\"{sha256}\""), job, object, layout, filename })
}
