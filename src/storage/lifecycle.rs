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

/// Deletes every file of one export and records why; marks the job's files as gone.
pub async fn delete_export_files(
    pool: &PgPool,
    store: &ArtifactStore,
    tenant: &str,
    export_id: Uuid,
    reason: &str,
) -> anyhow::Result<(u64, u64)> {
    let prefix = ObjectKey::parse(&format!("{tenant}/{export_id}")).map_err(anyhow::Error::msg)?;
    let (files, bytes) = store.delete_prefix(&prefix).await.context("deleting an export's files")?;
    sqlx::query("UPDATE export_jobs SET files_deleted_at = now() WHERE id = $1 AND files_deleted_at IS NULL")
        .bind(export_id)
        .execute(pool)
        .await?;
    if files > 0 {
        record(pool, Some(tenant), Some(export_id), reason, files, bytes).await?;
    }
    Ok((files, bytes))
}

/// Files no job references: exports that do not exist, and files of older attempts that no
/// checkpoint points at. A running job's files of each shard's current attempt (directory
/// `s{index}-a{attempt}`, see the worker) are never touched.
pub async fn sweep_orphans(pool: &PgPool, store: &ArtifactStore) -> anyhow::Result<Vec<Reclaimed>> {
    let mut reclaimed = Vec::new();
    for ((tenant, export_dir), objects) in by_export(store.list(None).await.context("listing stored files")?) {
        let Ok(export_id) = Uuid::parse_str(&export_dir) else { continue };
        let state: Option<String> = sqlx::query_scalar("SELECT state FROM export_jobs WHERE id = $1 AND tenant = $2")
            .bind(export_id)
            .bind(&tenant)
            .fetch_optional(pool)
            .await?;
        let Some(state) = state else {
            let (files, bytes) = delete_export_files(pool, store, &tenant, export_id, "orphan").await?;
            reclaimed.push(("orphan".into(), files, bytes));
            continue;
        };
        let referenced: HashSet<String> =
            sqlx::query_scalar::<_, String>("SELECT object_key FROM export_shards WHERE export_id = $1")
                .bind(export_id)
                .fetch_all(pool)
                .await?
                .into_iter()
                .collect();
        // A running job's shards being written now: each planned shard's current attempt.
        let writing: HashSet<String> = if matches!(state.as_str(), "QUEUED" | "RUNNING" | "CANCEL_REQUESTED") {
            sqlx::query_scalar::<_, String>(
                "SELECT 's' || shard_index || '-a' || writer_attempt FROM export_shard_plan WHERE export_id = $1",
            )
            .bind(export_id)
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect()
        } else {
            HashSet::new()
        };
        let (mut files, mut bytes) = (0, 0);
        for object in objects {
            let attempt_dir = object.key.segments().nth(2).unwrap_or_default();
            let in_use = referenced.contains(object.key.as_str()) || writing.contains(attempt_dir);
            if !in_use {
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
    sqlx::query("INSERT INTO storage_reclaims (tenant, export_id, reason, files, bytes) VALUES ($1, $2, $3, $4, $5)")
        .bind(tenant)
        .bind(export_id)
        .bind(reason)
        .bind(files as i32)
        .bind(bytes as i64)
        .execute(pool)
        .await?;
    Ok(())
}
