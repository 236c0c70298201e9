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

use super::refusals::Refusals;
use super::rejection::Rejection;
use super::shares::{Holder, SharedSlots, Slot};
use crate::auth::Caller;
use crate::tenants::{Registry, TenantId};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sqlx::PgPool;

/// Estimates' censuses running at once per tenant (one per principal, see [`SharedSlots`]).
const ESTIMATES_PER_TENANT: u32 = 4;

/// Who shares a tenant's slots: its admins together, and each enabled partner.
fn holders(tenant: &crate::tenants::Tenant) -> usize {
    let enabled = tenant.principals.values().filter(|p| !p.disabled);
    let (admins, partners): (Vec<_>, Vec<_>) = enabled.partition(|p| p.is_admin());
    usize::from(!admins.is_empty()) + partners.len()
}

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
    downloads: HashMap<TenantId, Arc<SharedSlots>>,
    requests: HashMap<TenantId, Arc<SharedSlots>>,
    /// Request bodies arriving (read before a request slot is taken).
    uploads: HashMap<TenantId, Arc<SharedSlots>>,
    /// One estimate's census at a time per principal, four per tenant.
    estimates: HashMap<TenantId, Arc<SharedSlots>>,
    /// Turns on the CPU for work a request sizes (predicate hints).
    cpu: super::CpuTurns,
    clock: DefaultClock,
}

impl RateLimits {
    pub fn new(registry: &Registry) -> RateLimits {
        let api_quotas: HashMap<TenantId, (u32, u32)> =
            registry.tenants().map(|t| (t.id.clone(), (t.quota.api_requests_per_second, t.quota.api_burst))).collect();
        let api = RwLock::new(Arc::new(api_buckets(&api_quotas, 1)));
        let slots = |capacity: fn(&crate::tenants::Tenant) -> u32| {
            registry.tenants().map(|t| (t.id.clone(), SharedSlots::new(capacity(t), holders(t)))).collect()
        };
        let downloads = slots(|t| t.quota.max_concurrent_downloads);
        let requests = slots(|t| t.quota.max_concurrent_requests);
        let uploads = slots(|t| t.quota.max_concurrent_requests);
        let estimates = registry
            .tenants()
            .map(|t| (t.id.clone(), SharedSlots::with_per_holder(ESTIMATES_PER_TENANT, 1, holders(t))))
            .collect();
        RateLimits {
            api,
            api_quotas,
            share: AtomicU32::new(1),
            refusals: Refusals::new(registry),
            downloads,
            requests,
            uploads,
            estimates,
            cpu: super::CpuTurns::new(registry),
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

    /// One of the tenant's `slots` for the caller's share, or the (counted) `rejection` when
    /// none is free for it.
    fn slot(
        &self,
        slots: &HashMap<TenantId, Arc<SharedSlots>>,
        caller: &Caller,
        rejection: Rejection,
    ) -> Result<Slot, Rejection> {
        let slot = slots.get(&caller.tenant.id).and_then(|s| s.try_take(Holder::of(caller)));
        slot.ok_or_else(|| self.refuse(&caller.tenant.id, rejection))
    }

    /// A slot for one streaming download of the caller, held until the body ends.
    pub fn download_slot(&self, caller: &Caller) -> Result<Slot, Rejection> {
        self.slot(&self.downloads, caller, Rejection::Downloads)
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

    /// A slot for one request body of the caller arriving (as many as `max_concurrent_requests`,
    /// apart from them: a body that drips holds one of these, never a request slot).
    pub fn upload_slot(&self, caller: &Caller) -> Result<Slot, Rejection> {
        self.slot(&self.uploads, caller, Rejection::Concurrency)
    }

    /// A slot for one request of the caller in progress (`max_concurrent_requests`).
    pub fn request_slot(&self, caller: &Caller) -> Result<Slot, Rejection> {
        self.slot(&self.requests, caller, Rejection::Concurrency)
    }

    /// The tenants these limits are for.
    pub fn tenants(&self) -> Vec<&str> {
        self.requests.keys().map(TenantId::as_str).collect()
    }

    /// The caller's one slot for an estimate (each reads up to a few MiB of the record store):
    /// a principal's estimates cost one census at a time, a tenant's at most four, and a
    /// partner's never take the admins' turn.
    pub fn estimate_slot(&self, caller: &Caller) -> Result<Slot, Rejection> {
        self.slot(&self.estimates, caller, Rejection::EstimateInProgress)
    }

    /// The caller's tenant's turn on the CPU for work the request sizes (one at a time per
    /// tenant, all but one core for all tenants); refused (and counted) after waiting 10 s.
    pub async fn cpu_turn(&self, caller: &Caller) -> Result<super::CpuTurn, Rejection> {
        self.cpu.turn(&caller.tenant.id).await.map_err(|rejection| self.refuse(&caller.tenant.id, rejection))
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
        let tenant = registry.get("acme").unwrap().clone();
        let caller = |id: &str| Caller { tenant: tenant.clone(), principal: tenant.principal(id).unwrap().clone() };
        let (alice, zen, crm) = (caller("alice"), caller("zenpartner"), caller("crmsync"));
        let max = tenant.quota.max_concurrent_downloads as usize;
        let mut held: Vec<_> = std::iter::from_fn(|| limits.download_slot(&zen).ok()).collect();
        assert_eq!(held.len(), max / 2, "one partner holds half");
        held.extend(std::iter::from_fn(|| limits.download_slot(&crm).ok()));
        held.extend(std::iter::from_fn(|| limits.download_slot(&alice).ok()));
        assert_eq!(held.len(), max, "the others share the rest");
        assert_eq!(limits.download_slot(&alice).err(), Some(Rejection::Downloads), "one more is refused");
        assert_eq!(limits.refusals.unflushed(&tenant.id, super::super::RefusalKind::Downloads), 4, "and counted");
        drop(held);
        assert!(limits.download_slot(&zen).is_ok(), "slots return when downloads end");
    }
}
