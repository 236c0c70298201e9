//! The periodic cleaning pass: expires exports past their retention, has storage delete the
//! files of ended jobs, unreferenced attempts and abandoned writes
//! ([`crate::storage::lifecycle`]), reports published exports whose files are missing and
//! directories of exports this deployment does not know, and collects feed history. Safe on
//! several processes at once: one cleaner holds an advisory lock, and every deletion is
//! idempotent. Nothing is deleted from a store this deployment does not own.

use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::exports::{self, store};
use crate::storage::{ArtifactStore, Deployment, lifecycle};
use crate::tenants::Registry;

/// Advisory lock key of the cleaner ("exportd-cleaner").
const CLEANER_LOCK: i64 = 0x6578_706f_7274_636c;

/// What one pass did: (reason, files, bytes) per deletion, how many exports expired, what the
/// store holds that no job knows or lacks that a published export needs, and how much history
/// was collected.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub ran: bool,
    pub expired: u64,
    pub reclaimed: Vec<(String, u64, u64)>,
    /// Directories of exports this deployment has no job for, left alone: (directories, files, bytes).
    pub unknown: (u64, u64, u64),
    /// Published exports whose files are missing: (tenant, export, files).
    pub missing: Vec<(String, uuid::Uuid, u64)>,
    pub versions_collected: u64,
    pub windows_collected: u64,
}

impl Report {
    pub fn bytes(&self, reason: &str) -> u64 {
        self.reclaimed.iter().filter(|r| r.0 == reason).map(|r| r.2).sum()
    }
}

/// One cleaning pass at time `now`. Returns `ran: false` when another process holds the lock.
pub async fn run_once(
    pool: &PgPool,
    store: &ArtifactStore,
    registry: &Registry,
    now: OffsetDateTime,
) -> anyhow::Result<Report> {
    let mut lock = pool.acquire().await?;
    let locked: bool = sqlx::query_scalar!(r#"SELECT pg_try_advisory_lock($1) AS "locked!""#, CLEANER_LOCK)
        .fetch_one(&mut *lock)
        .await?;
    if !locked {
        return Ok(Report::default());
    }
    let result = match clean(pool, store, now).await {
        Ok(mut report) => collect_history(pool, registry, now, &mut report).await.map(|()| report),
        Err(e) => Err(e),
    };
    sqlx::query!("SELECT pg_advisory_unlock($1)", CLEANER_LOCK).fetch_one(&mut *lock).await?;
    result
}

async fn clean(pool: &PgPool, store: &ArtifactStore, now: OffsetDateTime) -> anyhow::Result<Report> {
    // Checked every pass (one small read): a store claimed by another deployment while this
    // one could not reach it is never swept.
    let us = Deployment::of(pool).await.context("reading the deployment's identity")?;
    store.claim(&us).await.context("checking who owns the artifact store")?;
    let mut report = Report { ran: true, ..Report::default() };
    let expired = store::jobs::expire_due(pool, now).await.context("expiring exports")?;
    report.expired = expired.len() as u64;

    for (id, tenant, state) in store::jobs::ended_with_files(pool).await? {
        let reason = state.as_str().to_lowercase();
        let (files, bytes) = exports::delete_files(pool, store, &tenant, id, &reason).await?;
        if files > 0 {
            report.reclaimed.push((reason, files, bytes));
        }
    }
    let audit = lifecycle::sweep_orphans(pool, store, &exports::FileOwner(pool)).await?;
    report.reclaimed.extend(audit.reclaimed);
    report.reclaimed.extend(lifecycle::sweep_abandoned(pool, store).await?);
    (report.unknown, report.missing) = (audit.unknown, audit.missing);
    metrics::gauge!("exportd_exports_missing_files").set(report.missing.len() as f64);
    metrics::gauge!("exportd_store_unknown_files").set(report.unknown.1 as f64);
    for (tenant, export, files) in &report.missing {
        tracing::error!(%tenant, %export, files, "a published export's files are missing from the store; its downloads answer 410 files-missing");
    }
    if report.unknown.0 > 0 {
        let (directories, files, bytes) = report.unknown;
        tracing::warn!(directories, files, bytes, "the store holds exports this deployment has no job for; left alone");
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
        let readers = crate::exports::HistoryReaders(pool);
        let collected = crate::feeds::gc::collect(pool, &readers, tenant, now).await.context("collecting history")?;
        report.versions_collected += collected.versions;
        report.windows_collected += collected.windows;
        oldest = oldest.min(now - time::Duration::days(i64::from(tenant.retention.tombstone_days)));
    }
    crate::feeds::gc::collect_ticks(pool, oldest).await?;
    crate::quota::refusals::collect(pool, now).await.context("collecting refusal counts")?;
    crate::usage::history::collect(pool, now).await.context("collecting usage history")?;
    crate::webhooks::outbox::collect(pool, now, crate::webhooks::KEEP_EVENTS)
        .await
        .context("collecting webhook events")?;
    Ok(())
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
