//! In-process admission limits. API rates with `governor`: one keyed limiter per tenant (its own
//! quota), keyed by the tenant for admins and by tenant + principal for partners. With several
//! API processes each enforces its share (rate and burst divided by the live API processes, see
//! [`crate::cluster`]), so the rate holds cluster-wide. A refusal costs no database work: it is
//! counted in memory ([`Refusals`]) and the counts are flushed in one statement every second or
//! so. Concurrent downloads and requests in progress: a semaphore per tenant each.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::refusals::Refusals;
use super::rejection::Rejection;
use crate::auth::Caller;
use crate::tenants::{Registry, TenantId};

type ApiBuckets = HashMap<TenantId, DefaultKeyedRateLimiter<String>>;

pub struct RateLimits {
    /// Rebuilt when the share changes (the buckets start full again then).
    api: RwLock<Arc<ApiBuckets>>,
    /// Each tenant's configured (rate, burst) for the whole cluster.
    api_quotas: HashMap<TenantId, (u32, u32)>,
    /// Live API processes sharing the rates.
    share: AtomicU32,
    /// Every refusal of this process, of any kind, until flushed.
    pub refusals: Refusals,
    downloads: HashMap<TenantId, Arc<Semaphore>>,
    requests: HashMap<TenantId, Arc<Semaphore>>,
    /// One estimate's census at a time per tenant.
    estimates: HashMap<TenantId, Arc<Semaphore>>,
    clock: DefaultClock,
}

impl RateLimits {
    pub fn new(registry: &Registry) -> RateLimits {
        let api_quotas: HashMap<TenantId, (u32, u32)> =
            registry.tenants().map(|t| (t.id.clone(), (t.quota.api_requests_per_second, t.quota.api_burst))).collect();
        let api = RwLock::new(Arc::new(api_buckets(&api_quotas, 1)));
        let downloads = registry
            .tenants()
            .map(|t| (t.id.clone(), Arc::new(Semaphore::new(t.quota.max_concurrent_downloads as usize))))
            .collect();
        let requests = registry
            .tenants()
            .map(|t| (t.id.clone(), Arc::new(Semaphore::new(t.quota.max_concurrent_requests as usize))))
            .collect();
        let estimates = registry.tenants().map(|t| (t.id.clone(), Arc::new(Semaphore::new(1)))).collect();
        RateLimits {
            api,
            api_quotas,
            share: AtomicU32::new(1),
            refusals: Refusals::new(registry),
            downloads,
            requests,
            estimates,
            clock: DefaultClock::default(),
        }
    }

    /// Splits every tenant's API rate and burst between `processes` live API processes.
    pub fn set_share(&self, processes: u32) {
        let processes = processes.max(1);
        if self.share.swap(processes, Ordering::Relaxed) != processes {
            *self.api.write().expect("not poisoned") = Arc::new(api_buckets(&self.api_quotas, processes));
        }
    }

    /// The live API processes this one shares the rates with (itself included).
    pub fn share(&self) -> u32 {
        self.share.load(Ordering::Relaxed)
    }

    fn buckets(&self) -> Arc<ApiBuckets> {
        self.api.read().expect("not poisoned").clone()
    }

    /// Counts a refusal (in memory, flushed about every second) and returns it.
    pub fn refuse(&self, tenant: &TenantId, rejection: Rejection) -> Rejection {
        self.refusals.count(tenant, rejection.kind());
        rejection
    }

    /// One permit of `slots`, or the (counted) `rejection` when none is free.
    fn slot(
        &self,
        slots: &HashMap<TenantId, Arc<Semaphore>>,
        tenant: &TenantId,
        rejection: Rejection,
    ) -> Result<OwnedSemaphorePermit, Rejection> {
        let permit = slots.get(tenant).and_then(|s| s.clone().try_acquire_owned().ok());
        permit.ok_or_else(|| self.refuse(tenant, rejection))
    }

    /// A slot for one streaming download of the tenant, held until the body ends.
    pub fn download_slot(&self, tenant: &TenantId) -> Result<OwnedSemaphorePermit, Rejection> {
        self.slot(&self.downloads, tenant, Rejection::Downloads)
    }

    /// Takes one request from the caller's bucket (partners each have their own, admins share one).
    pub fn check_api(&self, caller: &Caller) -> Result<(), Rejection> {
        let buckets = self.buckets();
        let Some(limiter) = buckets.get(&caller.tenant.id) else { return Ok(()) };
        let key = if caller.principal.is_admin() { String::new() } else { caller.principal.id.to_string() };
        limiter.check_key(&key).map_err(|not_until| {
            let retry_after = not_until.wait_time_from(self.clock.now());
            self.refuse(&caller.tenant.id, Rejection::Rate { retry_after })
        })
    }

    /// A slot for one request of the tenant in progress (`max_concurrent_requests`).
    pub fn request_slot(&self, tenant: &TenantId) -> Result<OwnedSemaphorePermit, Rejection> {
        self.slot(&self.requests, tenant, Rejection::Concurrency)
    }

    /// The tenants these limits are for.
    pub fn tenants(&self) -> Vec<&str> {
        self.requests.keys().map(TenantId::as_str).collect()
    }

    /// The tenant's one slot for an estimate (each reads up to a few MiB of the record store),
    /// so a tenant's estimates cost at most one census at a time.
    pub fn estimate_slot(&self, tenant: &TenantId) -> Result<OwnedSemaphorePermit, Rejection> {
        self.slot(&self.estimates, tenant, Rejection::EstimateInProgress)
    }

    /// Forgets idle keys (call periodically: the key maps would otherwise only grow).
    pub fn retain_recent(&self) {
        for limiter in self.buckets().values() {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
    }
}

/// Keyed limiters with each tenant's `(rate, burst)` divided by `share` processes.
fn api_buckets(quotas: &HashMap<TenantId, (u32, u32)>, share: u32) -> ApiBuckets {
    quotas
        .iter()
        .map(|(tenant, &(rate, burst))| (tenant.clone(), RateLimiter::keyed(shared_quota(rate, burst, share))))
        .collect()
}

/// `rate` per second and `burst` split `share` ways: exact fractional rates (one cell every
/// `share / rate` seconds), the burst rounded up so every process admits at least one.
pub(crate) fn shared_quota(rate: u32, burst: u32, share: u32) -> Quota {
    let share = share.max(1);
    let period = Duration::from_secs_f64(f64::from(share) / f64::from(rate.max(1)));
    let burst = NonZeroU32::new(burst.div_ceil(share).max(1)).expect("at least 1");
    Quota::with_period(period.max(Duration::from_nanos(1))).expect("a positive period").allow_burst(burst)
}

/// Flushes refusal counts every second and forgets idle limiter keys every minute, until
/// `shutdown`; flushes once more on the way out.
pub async fn run_housekeeping(
    limits: std::sync::Arc<RateLimits>,
    pool: PgPool,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut ticks = 0u64;
    while !*shutdown.borrow() {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = shutdown.changed() => {}
        }
        if let Err(e) = limits.refusals.flush(&pool).await {
            tracing::warn!(error = %e, "could not flush refusal counts; keeping them for the next try");
        }
        ticks += 1;
        if ticks.is_multiple_of(60) {
            limits.retain_recent();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_gets_at_most_its_concurrent_download_slots_and_they_come_back() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tenants");
        let registry = Registry::load(&dir).unwrap();
        let limits = RateLimits::new(&registry);
        let acme = TenantId::parse("acme").unwrap();
        let max = registry.get("acme").unwrap().quota.max_concurrent_downloads as usize;
        let held: Vec<_> = (0..max).map(|_| limits.download_slot(&acme).expect("a slot")).collect();
        assert_eq!(limits.download_slot(&acme).err(), Some(Rejection::Downloads), "one more is refused");
        assert_eq!(limits.refusals.unflushed(&acme, super::super::RefusalKind::Downloads), 1, "and counted");
        drop(held);
        assert!(limits.download_slot(&acme).is_ok(), "slots return when downloads end");
    }
}
