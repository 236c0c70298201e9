//! Webhooks: tenants' endpoints told about export and feed events, signed the Standard Webhooks
//! way, delivered at least once from a transactional outbox.
//!
//! - Export events are written by a trigger on `export_jobs` in the transaction of the state
//!   change itself (migration `webhooks.sql`); `feed.lagging` by [`lag::raise_lagging`].
//! - Every `serve` and `worker` process runs [`run`]: it routes new events into one delivery per
//!   subscribed endpoint (body fixed then), leases due deliveries (`SKIP LOCKED`, one in flight
//!   per endpoint, oldest first), attempts them, and records each outcome under its lease:
//!   delivered, or retried with exponential, jittered backoff until the give-up time, then failed.

pub mod lag;
pub mod outbox;
pub mod send;
pub mod signing;

use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use sqlx::PgPool;
use tracing::Instrument;

use crate::clock::Clock;
use crate::config::WebhookSettings;
use crate::outbound::AddressGuard;
use crate::tenants::Registry;
use outbox::{Attempt, Outcome};
use send::Sender;

/// Deliveries attempted at once by one process, and at most this many of one tenant.
const PARALLEL_ATTEMPTS: i64 = 16;
const PARALLEL_ATTEMPTS_PER_TENANT: i64 = 4;
/// How often an idle loop looks for work.
const IDLE_POLL: Duration = Duration::from_millis(500);
/// How often lagging partners are looked for.
const LAG_CHECK_EVERY: Duration = Duration::from_secs(30);
/// Delivered and failed events are kept this long for the deliveries listing.
pub const KEEP_EVENTS: Duration = Duration::from_secs(30 * 86_400);
/// Retries wait at most this long.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(2 * 3600);

/// What a delivery loop needs.
#[derive(Clone)]
pub struct Deliverer {
    pool: PgPool,
    registry: Arc<Registry>,
    settings: WebhookSettings,
    sender: Arc<Sender>,
    owner: String,
}

impl Deliverer {
    pub fn new(pool: PgPool, registry: Arc<Registry>, settings: WebhookSettings) -> anyhow::Result<Deliverer> {
        let guard = AddressGuard::new(settings.webhook_allow_nets.clone());
        let sender = Arc::new(Sender::new(guard, settings.webhook_allow_http, settings.webhook_timeout)?);
        let owner = format!("{}-{}", std::process::id(), uuid::Uuid::new_v4().simple());
        Ok(Deliverer { pool, registry, settings, sender, owner })
    }

    /// Endpoints this process would refuse on every attempt (http without
    /// EXPORTD_WEBHOOK_ALLOW_HTTP, a literal internal address), each named by tenant file and
    /// field. Start-up warns about them; it does not stop: one tenant's endpoint never takes
    /// the others down, and its deliveries record the same reason as their `last_error`.
    pub fn endpoint_problems(&self, tenants_dir: &std::path::Path) -> Vec<String> {
        let mut problems = Vec::new();
        for tenant in self.registry.tenants() {
            for (i, endpoint) in tenant.webhooks.iter().enumerate() {
                if let Err(reason) = self.sender.admissible(endpoint) {
                    let file = tenants_dir.join(format!("{}.toml", tenant.id));
                    problems.push(format!("{}: webhooks[{i}].url: {reason}", file.display()));
                }
            }
        }
        problems
    }

    /// One pass: route new events, then attempt every due delivery. Returns how many attempts
    /// were made.
    pub async fn pass(&self) -> anyhow::Result<usize> {
        let public_url = self.settings.public_url.as_ref();
        outbox::route(&self.pool, &self.registry, public_url, self.settings.webhook_retry_for).await?;
        // An attempt takes at most the timeout (it bounds the whole request); then its result is recorded.
        let lease = self.settings.webhook_timeout + Duration::from_secs(5);
        let attempts =
            outbox::claim(&self.pool, &self.owner, lease, PARALLEL_ATTEMPTS, PARALLEL_ATTEMPTS_PER_TENANT).await?;
        let count = attempts.len();
        let runs = attempts.into_iter().map(|attempt| self.deliver(attempt));
        for result in futures_util::future::join_all(runs).await {
            result?;
        }
        Ok(count)
    }

    async fn deliver(&self, attempt: Attempt) -> anyhow::Result<()> {
        let span = tracing::info_span!("webhook", tenant = %attempt.tenant, delivery = %attempt.id,
            endpoint = %attempt.endpoint, attempt = attempt.attempts);
        async {
            let endpoint = self.registry.get(&attempt.tenant).and_then(|t| t.webhook(&attempt.endpoint));
            let outcome = match endpoint {
                Some(endpoint) => self.sender.attempt(endpoint, &attempt.event_id.to_string(), &attempt.body).await,
                None => Outcome::GiveUp { error: "the endpoint is no longer configured".into() },
            };
            let delay = retry_delay(self.settings.webhook_first_retry, attempt.attempts);
            let state = outbox::record(&self.pool, &self.owner, &attempt, &outcome, delay).await?;
            metrics::counter!("exportd_webhook_deliveries_total", "outcome" => outcome.label()).increment(1);
            match (&outcome, state) {
                (_, None) => tracing::warn!("webhook attempt outlived its lease; its result was not recorded"),
                (Outcome::Delivered { status }, _) => tracing::info!(status, "webhook delivered"),
                (Outcome::Retry { error, .. } | Outcome::GiveUp { error }, Some(state)) => {
                    tracing::warn!(error = %error, state = %state, "webhook attempt failed");
                }
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Raises `feed.lagging` for every tenant at `now`.
    pub async fn check_lag(&self, now: time::OffsetDateTime) -> sqlx::Result<u64> {
        let mut raised = 0;
        for tenant in self.registry.tenants() {
            raised += lag::raise_lagging(&self.pool, tenant, now).await?;
        }
        Ok(raised)
    }
}

/// How long to wait after failed attempt number `attempt` (1-based): `first` × 4^(attempt-1),
/// at most two hours, plus up to as much again of jitter. Bucket deliveries back off alike.
pub(crate) fn retry_delay(first: Duration, attempt: i32) -> Duration {
    let steps = usize::try_from(attempt.max(1) - 1).unwrap_or(0);
    backon::ExponentialBuilder::new()
        .with_min_delay(first)
        .with_factor(4.0)
        .with_max_delay(MAX_RETRY_DELAY)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(steps)
        .unwrap_or(MAX_RETRY_DELAY)
}

/// Delivers until `shutdown` turns true (inside `serve` and `worker`); the lag check uses
/// `clock` (tests move it).
pub async fn run(deliverer: Deliverer, clock: Clock, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let mut last_lag_check: Option<std::time::Instant> = None;
    while !*shutdown.borrow() {
        if last_lag_check.is_none_or(|at| at.elapsed() >= LAG_CHECK_EVERY) {
            last_lag_check = Some(std::time::Instant::now());
            if let Err(e) = deliverer.check_lag(clock.now()).await {
                tracing::warn!(error = %e, "checking feed lag failed");
            }
        }
        let busy = match deliverer.pass().await {
            Ok(attempts) => attempts > 0,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "webhook pass failed; trying again");
                false
            }
        };
        if !busy {
            tokio::select! {
                _ = tokio::time::sleep(IDLE_POLL) => {}
                _ = shutdown.changed() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_exponentially_with_jitter_and_a_ceiling() {
        let first = Duration::from_secs(5);
        for attempt in 1..=3 {
            let base = first * 4u32.pow(attempt as u32 - 1);
            let delay = retry_delay(first, attempt);
            assert!(delay >= base && delay <= base * 2, "attempt {attempt}: {delay:?}");
        }
        assert!(retry_delay(first, 30) <= MAX_RETRY_DELAY * 2);
    }
}
