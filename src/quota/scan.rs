//! The scan rate: rows a tenant's exports may read per second, across this process's workers
//! (`governor`, one bucket per tenant holding one second's worth). A worker waits for its tenant's
//! budget before each page; other workers meanwhile serve other tenants.

use std::collections::HashMap;
use std::num::NonZeroU32;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use crate::tenants::{Registry, TenantId};

/// `governor` rounds replenish intervals below a nanosecond to zero: stay under 1e9 per second.
const MAX_RATE: u32 = 1_000_000_000;

pub struct ScanLimits {
    per_tenant: HashMap<TenantId, (DefaultDirectRateLimiter, NonZeroU32)>,
}

impl ScanLimits {
    pub fn new(registry: &Registry) -> ScanLimits {
        let per_tenant = registry
            .tenants()
            .map(|t| {
                let rate = NonZeroU32::new(t.quota.scan_rows_per_second.min(MAX_RATE)).expect("validated > 0");
                (t.id.clone(), (RateLimiter::direct(Quota::per_second(rate)), rate))
            })
            .collect();
        ScanLimits { per_tenant }
    }

    /// Waits until the tenant may read `rows` more rows.
    pub async fn acquire(&self, tenant: &str, rows: u64) {
        let Some((limiter, burst)) = self.per_tenant.get(tenant) else { return };
        let mut left = rows;
        while left > 0 {
            // A request above the burst could never pass: take it one second's worth at a time.
            let take = left.min(u64::from(burst.get())) as u32;
            let cells = NonZeroU32::new(take).expect("take > 0");
            // Cannot fail: `take` never exceeds the burst.
            let _ = limiter.until_n_ready(cells).await;
            left -= u64::from(take);
        }
    }
}
