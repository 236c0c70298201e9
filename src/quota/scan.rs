//! The scan rate: rows a tenant's exports may read per second, across this process's workers
//! (`governor`, one bucket per tenant holding one second's worth). A shard takes its budget up
//! front when it starts; a worker whose tenant is over its rate there gives the job back and
//! serves another tenant meanwhile. Rows beyond one second's worth are waited for page by page.

use std::collections::HashMap;
use std::num::NonZeroU32;

use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
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

    /// Takes up to one second's worth of `rows` now if the budget allows; otherwise how long to
    /// wait. Returns the rows taken (the rest must be acquired as the shard goes).
    pub fn try_acquire(&self, tenant: &str, rows: u64) -> Result<u64, Duration> {
        let Some((limiter, burst)) = self.per_tenant.get(tenant) else { return Ok(rows) };
        let take = rows.min(u64::from(burst.get())) as u32;
        let Some(cells) = NonZeroU32::new(take) else { return Ok(0) };
        match limiter.check_n(cells) {
            Ok(Ok(())) => Ok(u64::from(take)),
            Ok(Err(not_until)) => Err(not_until.wait_time_from(DefaultClock::default().now())),
            Err(_) => Ok(0), // cannot happen: `take` never exceeds the burst
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_budget_defers_the_next_shard() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tenants");
        let registry = Registry::load(&dir).unwrap();
        let limits = ScanLimits::new(&registry); // initech: 200 rows per second
        assert_eq!(limits.try_acquire("initech", 200), Ok(200));
        let wait = limits.try_acquire("initech", 200).unwrap_err();
        assert!(wait > Duration::from_millis(500), "{wait:?}");
        assert_eq!(limits.try_acquire("nobody", 5), Ok(5), "unknown tenants are not limited");
    }
}
