//! The life of stored files after they are written: deleting an export's files, sweeping
//! files no checkpoint references, reclaiming what dead writers left, and auditing what is
//! stored against what should be. Every deletion is idempotent and recorded in
//! `storage_reclaims` (reason, files, bytes); nothing of an export this deployment does not
//! know is ever deleted.

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

    /// Every file a published export's download reads: (tenant, export, object key).
    fn published(&self) -> impl Future<Output = sqlx::Result<Vec<(String, Uuid, String)>>> + Send;
}

/// What the sweep found besides what it deleted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Audit {
    /// Deleted files of older attempts no checkpoint points at.
    pub reclaimed: Vec<Reclaimed>,
    /// Export directories this deployment has no job for, left alone: (directories, files, bytes).
    pub unknown: (u64, u64, u64),
    /// Published exports whose files are not in the store: (tenant, export, files missing).
    pub missing: Vec<(String, Uuid, u64)>,
}

/// Files of older attempts that no checkpoint points at are deleted; a running job's files of
/// each shard's current attempt are never touched. Directories of exports this deployment does
/// not know are left alone and counted: this deployment never created them (jobs are never
/// deleted), so they belong to someone else — an operator's copy, a restored backup, another
/// deployment despite the owner marker. Published exports whose files are gone are reported.
pub async fn sweep_orphans(pool: &PgPool, store: &ArtifactStore, owner: &impl Owner) -> anyhow::Result<Audit> {
    let mut audit = Audit::default();
    // Asked before listing: a file of an export published after the listing is not missing.
    let published = owner.published().await?;
    let objects = store.list(None).await.context("listing stored files")?;
    let stored: HashSet<String> = objects.iter().map(|o| o.key.as_str().to_owned()).collect();
    for ((tenant, export_dir), objects) in by_export(objects) {
        let Ok(export_id) = Uuid::parse_str(&export_dir) else { continue };
        let Some(needed) = owner.in_use(&tenant, export_id).await? else {
            audit.unknown.0 += 1;
            audit.unknown.1 += objects.len() as u64;
            audit.unknown.2 += objects.iter().map(|o| o.bytes).sum::<u64>();
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
            audit.reclaimed.push(("unreferenced".into(), files, bytes));
        }
    }
    let mut missing: BTreeMap<(String, Uuid), u64> = BTreeMap::new();
    for (tenant, export_id, key) in published {
        if !stored.contains(&key) {
            *missing.entry((tenant, export_id)).or_default() += 1;
        }
    }
    audit.missing = missing.into_iter().map(|((tenant, id), files)| (tenant, id, files)).collect();
    Ok(audit)
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
