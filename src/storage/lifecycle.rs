//! The life of stored files after they are written: deleting an export's files, sweeping
//! files no job references, and reclaiming what dead writers left. Every deletion is
//! idempotent and recorded in `storage_reclaims` (reason, files, bytes).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use uuid::Uuid;

use super::{ArtifactStore, ObjectKey, StoredObject};

/// Temp files and uploads not written to for this long belong to a writer that died.
pub const ABANDONED_AFTER: Duration = Duration::from_secs(3600);

/// (reason, files, bytes) for one deletion.
pub type Reclaimed = (String, u64, u64);

/// Deletes every file of one export and records why. The export store marks the job's files
/// gone ([`crate::exports::delete_files`]).
pub async fn delete_export_files(
    pool: &PgPool,
    store: &ArtifactStore,
    tenant: &str,
    export_id: Uuid,
    reason: &str,
) -> anyhow::Result<(u64, u64)> {
    let prefix = ObjectKey::parse(&format!("{tenant}/{export_id}")).map_err(anyhow::Error::msg)?;
    let (files, bytes) = store.delete_prefix(&prefix).await.context("deleting an export's files")?;
    if files > 0 {
        record(pool, Some(tenant), Some(export_id), reason, files, bytes).await?;
    }
    Ok((files, bytes))
}

/// Which files of an export directory are still needed, as the export store answers it.
#[derive(Debug, Default)]
pub struct InUse {
    /// Object keys its checkpoints point at.
    pub referenced: HashSet<String>,
    /// Attempt directories (`s{index}-a{attempt}`) being written now.
    pub writing: HashSet<String>,
}

/// Who knows which stored files are still needed: the export store.
pub trait Owner: Sync {
    /// `None`: no such export.
    fn in_use(&self, tenant: &str, export_id: Uuid) -> impl Future<Output = sqlx::Result<Option<InUse>>> + Send;
}

/// Files no job references: exports that do not exist (`in_use` answers `None`), and files of
/// older attempts that no checkpoint points at. A running job's files of each shard's current
/// attempt are never touched.
pub async fn sweep_orphans(pool: &PgPool, store: &ArtifactStore, owner: &impl Owner) -> anyhow::Result<Vec<Reclaimed>> {
    let mut reclaimed = Vec::new();
    for ((tenant, export_dir), objects) in by_export(store.list(None).await.context("listing stored files")?) {
        let Ok(export_id) = Uuid::parse_str(&export_dir) else { continue };
        let Some(needed) = owner.in_use(&tenant, export_id).await? else {
            let (files, bytes) = delete_export_files(pool, store, &tenant, export_id, "orphan").await?;
            reclaimed.push(("orphan".into(), files, bytes));
            continue;
        };
        let (mut files, mut bytes) = (0, 0);
        for object in objects {
            let attempt_dir = object.key.segments().nth(2).unwrap_or_default();
            if !needed.referenced.contains(object.key.as_str()) && !needed.writing.contains(attempt_dir) {
                bytes += store.delete(&object.key).await?;
                files += 1;
            }
        }
        if files > 0 {
            record(pool, Some(&tenant), Some(export_id), "unreferenced", files, bytes).await?;
            reclaimed.push(("unreferenced".into(), files, bytes));
        }
    }
    Ok(reclaimed)
}

/// Temp files or multipart uploads of writers that died.
pub async fn sweep_abandoned(pool: &PgPool, store: &ArtifactStore) -> anyhow::Result<Option<Reclaimed>> {
    let (files, bytes) = store.sweep_abandoned(ABANDONED_AFTER).await.context("sweeping abandoned writes")?;
    if files == 0 {
        return Ok(None);
    }
    record(pool, None, None, "stale-temp", files, bytes).await?;
    Ok(Some(("stale-temp".into(), files, bytes)))
}

/// Stored objects grouped by their `(tenant, export)` directory.
fn by_export(objects: Vec<StoredObject>) -> BTreeMap<(String, String), Vec<StoredObject>> {
    let mut groups: BTreeMap<(String, String), Vec<StoredObject>> = BTreeMap::new();
    for object in objects {
        let group = {
            let mut segments = object.key.segments();
            match (segments.next(), segments.next()) {
                (Some(tenant), Some(export)) => (tenant.to_owned(), export.to_owned()),
                _ => continue,
            }
        };
        groups.entry(group).or_default().push(object);
    }
    groups
}

async fn record(
    pool: &PgPool,
    tenant: Option<&str>,
    export_id: Option<Uuid>,
    reason: &str,
    files: u64,
    bytes: u64,
) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO storage_reclaims (tenant, export_id, reason, files, bytes) VALUES ($1, $2, $3, $4, $5)",
        tenant,
        export_id,
        reason,
        files as i32,
        bytes as i64,
    )
    .execute(pool)
    .await?;
    Ok(())
}
