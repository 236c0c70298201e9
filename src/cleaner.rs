//! Storage lifecycle: expiring exports past their retention, deleting the files of ended jobs,
//! and sweeping orphans. Safe on several processes at once: one cleaner holds an advisory lock,
//! and every deletion is idempotent.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::storage::{ArtifactStore, ObjectKey};
use crate::tenants::Registry;

/// Advisory lock key of the cleaner ("exportd-cleaner").
const CLEANER_LOCK: i64 = 0x6578_706f_7274_636c;
/// Temp files older than this belong to a crashed writer.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// What one pass did: (reason, files, bytes) per deletion, how many exports expired, and how
/// much history was collected.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub ran: bool,
    pub expired: u64,
    pub reclaimed: Vec<(String, u64, u64)>,
    pub versions_collected: u64,
    pub windows_collected: u64,
}

impl Report {
    pub fn bytes(&self, reason: &str) -> u64 {
        self.reclaimed.iter().filter(|r| r.0 == reason).map(|r| r.2).sum()
    }
}

/// Deletes every file of one export and records why; marks the job's files as gone.
pub async fn delete_export_files(
    pool: &PgPool,
    store: &ArtifactStore,
    tenant: &str,
    export_id: Uuid,
    reason: &str,
) -> anyhow::Result<(u64, u64)> {
    let prefix = ObjectKey::parse(&format!("{tenant}/{export_id}")).map_err(anyhow::Error::msg)?;
    let store = store.clone();
    let (files, bytes) = tokio::task::spawn_blocking(move || store.delete_prefix_counted(&prefix)).await??;
    sqlx::query("UPDATE export_jobs SET files_deleted_at = now() WHERE id = $1 AND files_deleted_at IS NULL")
        .bind(export_id)
        .execute(pool)
        .await?;
    if files > 0 {
        record(pool, Some(tenant), Some(export_id), reason, files, bytes).await?;
    }
    Ok((files, bytes))
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

/// One cleaning pass at time `now`. Returns `ran: false` when another process holds the lock.
pub async fn run_once(
    pool: &PgPool,
    store: &ArtifactStore,
    registry: &Registry,
    now: OffsetDateTime,
) -> anyhow::Result<Report> {
    let mut lock = pool.acquire().await?;
    let locked: bool =
        sqlx::query_scalar("SELECT pg_try_advisory_lock($1)").bind(CLEANER_LOCK).fetch_one(&mut *lock).await?;
    if !locked {
        return Ok(Report::default());
    }
    let result = match clean(pool, store, now).await {
        Ok(mut report) => collect_history(pool, registry, now, &mut report).await.map(|()| report),
        Err(e) => Err(e),
    };
    sqlx::query("SELECT pg_advisory_unlock($1)").bind(CLEANER_LOCK).execute(&mut *lock).await?;
    result
}

async fn clean(pool: &PgPool, store: &ArtifactStore, now: OffsetDateTime) -> anyhow::Result<Report> {
    let mut report = Report { ran: true, ..Report::default() };
    let expired: Vec<(Uuid, String)> = sqlx::query_as(
        "UPDATE export_jobs SET state = 'EXPIRED' WHERE state = 'SUCCEEDED' AND expires_at <= $1 RETURNING id, tenant",
    )
    .bind(now)
    .fetch_all(pool)
    .await
    .context("expiring exports")?;
    report.expired = expired.len() as u64;

    let ended: Vec<(Uuid, String, String)> = sqlx::query_as(
        "SELECT id, tenant, lower(state) FROM export_jobs
         WHERE state IN ('CANCELLED', 'FAILED', 'REVOKED', 'EXPIRED') AND files_deleted_at IS NULL",
    )
    .fetch_all(pool)
    .await?;
    for (id, tenant, reason) in ended {
        let (files, bytes) = delete_export_files(pool, store, &tenant, id, &reason).await?;
        if files > 0 {
            report.reclaimed.push((reason, files, bytes));
        }
    }
    sweep_orphans(pool, store, &mut report).await?;
    let store_for_temp = store.clone();
    let (files, bytes) =
        tokio::task::spawn_blocking(move || store_for_temp.delete_temp_older_than(STALE_TEMP)).await??;
    if files > 0 {
        record(pool, None, None, "stale-temp", files, bytes).await?;
        report.reclaimed.push(("stale-temp".into(), files, bytes));
    }
    Ok(report)
}

/// Old record versions, tombstones, windows and ticks (see [`crate::feeds::gc`]).
async fn collect_history(
    pool: &PgPool,
    registry: &Registry,
    now: OffsetDateTime,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut oldest = now;
    for tenant in registry.tenants() {
        let collected = crate::feeds::gc::collect(pool, tenant, now).await.context("collecting history")?;
        report.versions_collected += collected.versions;
        report.windows_collected += collected.windows;
        oldest = oldest.min(now - time::Duration::days(i64::from(tenant.retention.tombstone_days)));
    }
    crate::feeds::gc::collect_ticks(pool, oldest).await?;
    Ok(())
}

/// Files no job references: exports that do not exist, and files of older attempts that no
/// checkpoint points at. Files of the current attempt of a running job are never touched.
async fn sweep_orphans(pool: &PgPool, store: &ArtifactStore, report: &mut Report) -> anyhow::Result<()> {
    let listing = {
        let store = store.clone();
        tokio::task::spawn_blocking(move || store.list_export_dirs()).await??
    };
    for (tenant, export_dir) in listing {
        let Ok(export_id) = Uuid::parse_str(&export_dir) else { continue };
        let job: Option<(String, i64)> =
            sqlx::query_as("SELECT state, lease_generation FROM export_jobs WHERE id = $1 AND tenant = $2")
                .bind(export_id)
                .bind(&tenant)
                .fetch_optional(pool)
                .await?;
        let Some((state, generation)) = job else {
            let (files, bytes) = delete_export_files(pool, store, &tenant, export_id, "orphan").await?;
            report.reclaimed.push(("orphan".into(), files, bytes));
            continue;
        };
        let referenced: HashSet<String> =
            sqlx::query_scalar::<_, String>("SELECT object_key FROM export_shards WHERE export_id = $1")
                .bind(export_id)
                .fetch_all(pool)
                .await?
                .into_iter()
                .collect();
        let running = matches!(state.as_str(), "QUEUED" | "RUNNING" | "CANCEL_REQUESTED");
        let current_generation = format!("g{generation}");
        let prefix = format!("{tenant}/{export_id}");
        let store = store.clone();
        let (files, bytes) = tokio::task::spawn_blocking(move || {
            store.delete_matching(&prefix, |key: &str, generation_dir: &str| {
                let in_use = referenced.contains(key) || (running && generation_dir == current_generation);
                !in_use
            })
        })
        .await??;
        if files > 0 {
            record(pool, Some(&tenant), Some(export_id), "unreferenced", files, bytes).await?;
            report.reclaimed.push(("unreferenced".into(), files, bytes));
        }
    }
    Ok(())
}

/// Whether a file's modification time is older than `age`.
pub(crate) fn older_than(path: &Path, age: Duration) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|modified| SystemTime::now().duration_since(modified).ok())
        .is_some_and(|elapsed| elapsed > age)
}

/// Runs a pass every `every` until `shutdown` turns true (inside `serve` and `worker`).
pub async fn run_periodically(
    pool: PgPool,
    store: ArtifactStore,
    registry: std::sync::Arc<Registry>,
    clock: crate::clock::Clock,
    every: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    while !*shutdown.borrow() {
        match run_once(&pool, &store, &registry, clock.now()).await {
            Ok(report) if report.ran && (report.expired > 0 || !report.reclaimed.is_empty()) => {
                let bytes: u64 = report.reclaimed.iter().map(|r| r.2).sum();
                tracing::info!(expired = report.expired, reclaimed_bytes = bytes, "cleaner pass");
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = format!("{e:#}"), "cleaner pass failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.changed() => {}
        }
    }
}
