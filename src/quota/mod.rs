//! Per-tenant API rate limits with `governor`: one keyed limiter per tenant (its own quota), keyed
//! by the tenant for admins and by tenant + principal for partners; and the usage report.

mod egress;
mod scan;
mod usage;

pub use egress::admit_download;
pub use scan::ScanLimits;
pub use usage::{Counters, Queue, Usage, usage};

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

use crate::auth::Caller;
use crate::tenants::{Registry, TenantId};

/// Locks the tenant's usage row (creating it) for the rest of the transaction: every quota
/// decision of one tenant (queued exports, stored bytes, egress) then counts after the previous.
/// It is the first row lock of any transaction that takes it (lock order: `jobs::fenced`).
pub async fn lock_tenant(tx: &mut sqlx::PgConnection, tenant: &str) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO tenant_usage (tenant) VALUES ($1)
         ON CONFLICT ON CONSTRAINT tenant_usage_pkey DO UPDATE SET tenant = EXCLUDED.tenant",
    )
    .bind(tenant)
    .execute(tx)
    .await?;
    Ok(())
}

pub struct RateLimits {
    api: HashMap<TenantId, DefaultKeyedRateLimiter<String>>,
    clock: DefaultClock,
}

impl RateLimits {
    pub fn new(registry: &Registry) -> RateLimits {
        let api = registry
            .tenants()
            .map(|t| {
                let rate = NonZeroU32::new(t.quota.api_requests_per_second).expect("validated > 0");
                let burst = NonZeroU32::new(t.quota.api_burst).expect("validated > 0");
                (t.id.clone(), RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst)))
            })
            .collect();
        RateLimits { api, clock: DefaultClock::default() }
    }

    /// Takes one request from the caller's bucket; `Err(wait)` when it is empty.
    pub fn check_api(&self, caller: &Caller) -> Result<(), Duration> {
        let Some(limiter) = self.api.get(&caller.tenant.id) else { return Ok(()) };
        let key = if caller.principal.is_admin() { String::new() } else { caller.principal.id.to_string() };
        limiter.check_key(&key).map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    /// Forgets idle keys (call periodically: the key maps would otherwise only grow).
    pub fn retain_recent(&self) {
        for limiter in self.api.values() {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
    }
}
