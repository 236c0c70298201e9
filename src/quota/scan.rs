//! The scan rate: rows a tenant's exports may read per second, across all worker processes
//! (`governor`, one bucket per tenant holding one second's worth of this process's share: the
//! rate divided by the live worker processes, see [`crate::cluster`]). A shard takes its budget up
//! front when it starts; a worker whose tenant is over its rate there gives the job back and
//! serves another tenant meanwhile. Rows beyond one second's worth are waited for page by page.
//!
//! A tenant found over its rate *rests* until its budget is back: this process's claims pass
//! over its jobs and shards meanwhile and an otherwise idle worker sleeps until the rest ends,
//! so a throttled export is claimed once per budget, not again and again while it cannot start.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, RateLimiter};

use crate::tenants::{Registry, TenantId};

/// `governor` rounds replenish intervals below a nanosecond to zero: stay under 1e9 per second.
const MAX_RATE: u32 = 1_000_000_000;

/// Per tenant: the limiter and its burst (one second's worth of the share).
type Buckets = HashMap<TenantId, (Arc<DefaultDirectRateLimiter>, NonZeroU32)>;

pub struct ScanLimits {
    per_tenant: RwLock<Arc<Buckets>>,
    rates: HashMap<TenantId, u32>,
    share: AtomicU32,
    /// Tenants found over their rate, and when their budget is back.
    resting: Mutex<HashMap<String, Instant>>,
}

/// The tenants whose exports this process should not claim now, and the soonest any of them
/// may go on.
#[derive(Debug, Default, PartialEq)]
pub struct Resting {
    pub tenants: Vec<String>,
    pub soonest_end: Option<Duration>,
}

impl ScanLimits {
    pub fn new(registry: &Registry) -> ScanLimits {
        let rates: HashMap<TenantId, u32> =
            registry.tenants().map(|t| (t.id.clone(), t.quota.scan_rows_per_second.min(MAX_RATE))).collect();
        ScanLimits {
            per_tenant: RwLock::new(Arc::new(buckets(&rates, 1))),
            rates,
            share: AtomicU32::new(1),
            resting: Mutex::new(HashMap::new()),
        }
    }

    /// Splits every tenant's scan rate between `processes` live worker processes.
    pub fn set_share(&self, processes: u32) {
        let processes = processes.max(1);
        if self.share.swap(processes, Ordering::Relaxed) != processes {
            *self.per_tenant.write().expect("not poisoned") = Arc::new(buckets(&self.rates, processes));
        }
    }

    fn bucket(&self, tenant: &str) -> Option<(Arc<DefaultDirectRateLimiter>, NonZeroU32)> {
        self.per_tenant.read().expect("not poisoned").get(tenant).cloned()
    }

    /// Takes up to one second's worth of `rows` now if the budget allows; otherwise how long to
    /// wait. Returns the rows taken (the rest must be acquired as the shard goes).
    pub fn try_acquire(&self, tenant: &str, rows: u64) -> Result<u64, Duration> {
        let Some((limiter, burst)) = self.bucket(tenant) else { return Ok(rows) };
        let take = rows.min(u64::from(burst.get())) as u32;
        let Some(cells) = NonZeroU32::new(take) else { return Ok(0) };
        match limiter.check_n(cells) {
            Ok(Ok(())) => {
                if take == burst.get() {
                    // The whole second's worth was there and is now spent: the bucket is empty and
                    // full again in one second, so rest until then rather than claim in vain.
                    self.rest(tenant, Duration::from_secs(1));
                }
                Ok(u64::from(take))
            }
            Ok(Err(not_until)) => {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                self.rest(tenant, wait);
                Err(wait)
            }
            Err(_) => Ok(0), // cannot happen: `take` never exceeds the burst
        }
    }

    fn rest(&self, tenant: &str, wait: Duration) {
        self.resting.lock().expect("not poisoned").insert(tenant.to_owned(), Instant::now() + wait);
    }

    /// The tenants resting now (their rests that ended are forgotten).
    pub fn resting(&self) -> Resting {
        let now = Instant::now();
        let mut resting = self.resting.lock().expect("not poisoned");
        resting.retain(|_, until| *until > now);
        Resting {
            tenants: resting.keys().cloned().collect(),
            soonest_end: resting.values().min().map(|until| until.duration_since(now)),
        }
    }

    /// Waits until the tenant may read `rows` more rows.
    pub async fn acquire(&self, tenant: &str, rows: u64) {
        let Some((limiter, burst)) = self.bucket(tenant) else { return };
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

fn buckets(rates: &HashMap<TenantId, u32>, share: u32) -> Buckets {
    rates
        .iter()
        .map(|(tenant, &rate)| {
            // The burst is one second's worth of this process's share.
            let quota = super::rate::shared_quota(rate, rate, share);
            (tenant.clone(), (Arc::new(RateLimiter::direct(quota)), quota.burst_size()))
        })
        .collect()
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
        let resting = limits.resting();
        assert_eq!(resting.tenants, ["initech"], "the refused tenant rests");
        assert!(resting.soonest_end.is_some_and(|end| end <= wait), "{resting:?}");
    }
}
