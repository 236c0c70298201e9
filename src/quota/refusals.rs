//! Refusals: every admission refusal of every kind is counted once, durably, per tenant, day and
//! kind. On the request path a refusal costs no database work: it is counted in memory and the
//! counts are flushed in one statement about every second (kept on failure, so none is lost).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use sqlx::PgPool;

use crate::tenants::{Registry, TenantId};

/// Why a request or an export was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    /// `api_requests_per_second` (429 `rate-limited`).
    Rate,
    /// `max_concurrent_requests` (429 `too-many-concurrent-requests`).
    Concurrency,
    /// `max_concurrent_downloads` (429 `too-many-downloads`).
    Downloads,
    /// `egress_bytes_per_day` (429 `egress-quota-exceeded`).
    Egress,
    /// `max_queued_exports` or `max_queued_exports_per_partner` (429 `quota-exceeded`).
    Queued,
    /// `storage_bytes` (the export FAILED `storage-quota-exceeded`).
    Storage,
}

impl RefusalKind {
    pub const ALL: [RefusalKind; 6] = [
        RefusalKind::Rate,
        RefusalKind::Concurrency,
        RefusalKind::Downloads,
        RefusalKind::Egress,
        RefusalKind::Queued,
        RefusalKind::Storage,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefusalKind::Rate => "rate",
            RefusalKind::Concurrency => "concurrency",
            RefusalKind::Downloads => "downloads",
            RefusalKind::Egress => "egress",
            RefusalKind::Queued => "queued",
            RefusalKind::Storage => "storage",
        }
    }
}

/// Refusals counted by this process and not yet flushed, per tenant and kind.
pub struct Refusals {
    unflushed: HashMap<TenantId, [AtomicU64; RefusalKind::ALL.len()]>,
    /// Held for writing while a flush moves counts from memory to the database, so a reader of
    /// both never sees a count twice or not at all.
    flushing: tokio::sync::RwLock<()>,
}

impl Refusals {
    pub fn new(registry: &Registry) -> Refusals {
        let unflushed = registry.tenants().map(|t| (t.id.clone(), Default::default())).collect();
        Refusals { unflushed, flushing: tokio::sync::RwLock::new(()) }
    }

    /// While held, no flush runs: durable and unflushed counts read together add up exactly.
    pub async fn steady(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.flushing.read().await
    }

    /// Counts one refusal (in memory; also the `exportd_quota_rejections_total` metric).
    pub fn count(&self, tenant: &TenantId, kind: RefusalKind) {
        metrics::counter!("exportd_quota_rejections_total", "kind" => kind.as_str()).increment(1);
        if let Some(counts) = self.unflushed.get(tenant) {
            counts[kind as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// This tenant's refusals counted here and not yet flushed.
    pub fn unflushed(&self, tenant: &TenantId, kind: RefusalKind) -> u64 {
        self.unflushed.get(tenant).map_or(0, |counts| counts[kind as usize].load(Ordering::Relaxed))
    }

    /// Adds the counts since the last flush to the durable ones, in one statement. On failure
    /// they are kept for the next flush: nothing is lost.
    pub async fn flush(&self, pool: &PgPool) -> sqlx::Result<()> {
        let _flushing = self.flushing.write().await;
        let mut taken: Vec<(&TenantId, RefusalKind, u64)> = Vec::new();
        for (tenant, counts) in &self.unflushed {
            for kind in RefusalKind::ALL {
                let n = counts[kind as usize].swap(0, Ordering::Relaxed);
                if n > 0 {
                    taken.push((tenant, kind, n));
                }
            }
        }
        if taken.is_empty() {
            return Ok(());
        }
        // Rows are locked in one order in every process, so concurrent flushes never deadlock.
        taken.sort_by(|a, b| (a.0.as_str(), a.1).cmp(&(b.0.as_str(), b.1)));
        let flushed = add(pool, &taken).await;
        if flushed.is_err() {
            for (tenant, kind, n) in taken {
                self.unflushed[tenant][kind as usize].fetch_add(n, Ordering::Relaxed);
            }
        }
        flushed
    }
}

/// Counts one refusal made outside a request (a worker's), durably at once.
pub async fn count_now(pool: &PgPool, tenant: &TenantId, kind: RefusalKind) -> sqlx::Result<()> {
    metrics::counter!("exportd_quota_rejections_total", "kind" => kind.as_str()).increment(1);
    add(pool, &[(tenant, kind, 1)]).await
}

/// Adds counts to today's and this hour's rows per tenant and kind (UTC) and to the tenants' totals.
async fn add(pool: &PgPool, counts: &[(&TenantId, RefusalKind, u64)]) -> sqlx::Result<()> {
    let tenants: Vec<String> = counts.iter().map(|(t, _, _)| t.to_string()).collect();
    let kinds: Vec<String> = counts.iter().map(|(_, k, _)| k.as_str().to_owned()).collect();
    let ns: Vec<i64> = counts.iter().map(|(_, _, n)| *n as i64).collect();
    sqlx::query!(
        "WITH counts AS (SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS c(tenant, kind, n, at)),
         daily AS (
             INSERT INTO tenant_refusals (tenant, day, kind, count)
             SELECT tenant, (now() AT TIME ZONE 'UTC')::date, kind, n FROM counts ORDER BY at
             ON CONFLICT ON CONSTRAINT tenant_refusals_pkey DO UPDATE SET count = tenant_refusals.count + EXCLUDED.count),
         hourly AS (
             INSERT INTO tenant_refusal_hours (tenant, hour, kind, count)
             SELECT tenant, date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', kind, n FROM counts ORDER BY at
             ON CONFLICT ON CONSTRAINT tenant_refusal_hours_pkey DO UPDATE SET count = tenant_refusal_hours.count + EXCLUDED.count)
         INSERT INTO tenant_usage (tenant, rate_limited, quota_rejections)
         SELECT tenant, coalesce(sum(n) FILTER (WHERE kind = 'rate'), 0), coalesce(sum(n) FILTER (WHERE kind <> 'rate'), 0)
         FROM counts GROUP BY tenant ORDER BY tenant
         ON CONFLICT ON CONSTRAINT tenant_usage_pkey DO UPDATE
         SET rate_limited = tenant_usage.rate_limited + EXCLUDED.rate_limited,
             quota_rejections = tenant_usage.quota_rejections + EXCLUDED.quota_rejections",
        &tenants,
        &kinds,
        &ns,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// This tenant's durable refusals of one UTC day, per kind (every kind present).
pub async fn of_day(pool: &PgPool, tenant: &TenantId, day: time::Date) -> sqlx::Result<Vec<(RefusalKind, i64)>> {
    let rows =
        sqlx::query!("SELECT kind, count FROM tenant_refusals WHERE tenant = $1 AND day = $2", tenant.as_str(), day)
            .fetch_all(pool)
            .await?;
    Ok(RefusalKind::ALL
        .iter()
        .map(|&kind| (kind, rows.iter().find(|r| r.kind == kind.as_str()).map_or(0, |r| r.count)))
        .collect())
}

/// Days of refusal counts kept (the history charts need 30).
const KEPT_DAYS: i64 = 400;

/// Days of hourly refusal counts kept: as long as the usage history keeps its hours.
pub const HOURS_KEPT_DAYS: i64 = 90;

/// Deletes refusal counts of days older than [`KEPT_DAYS`] before `now`, and hourly ones older
/// than the usage history (the cleaner's pass).
pub async fn collect(pool: &PgPool, now: time::OffsetDateTime) -> sqlx::Result<u64> {
    let oldest = (now - time::Duration::days(KEPT_DAYS)).date();
    let hours_before = now - time::Duration::days(HOURS_KEPT_DAYS);
    let hours = sqlx::query!("DELETE FROM tenant_refusal_hours WHERE hour < $1", hours_before).execute(pool).await?;
    let days = sqlx::query!("DELETE FROM tenant_refusals WHERE day < $1", oldest).execute(pool).await?;
    Ok(days.rows_affected() + hours.rows_affected())
}
