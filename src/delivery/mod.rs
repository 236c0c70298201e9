//! Delivery into partners' own buckets.
//!
//! - A tenant file declares **destinations** (a partner's bucket, credentials by reference) and
//!   **subscriptions** (a dataset and format to deliver there: every full export the partner
//!   creates, and/or an incremental export on a schedule chained by the subscription's cursor).
//!   [`subscriptions::sync`] mirrors them into PostgreSQL at start-up.
//! - A published export gets one delivery per subscription that wants it, from a trigger in the
//!   publishing transaction (migration `bucket_deliveries.sql`).
//! - Every `serve` and `worker` process runs [`run`]: one loop creates the scheduled exports that
//!   are due ([`subscriptions::schedule`]); another keeps `EXPORTD_DELIVERY_PARALLEL` slots busy:
//!   whenever one frees it leases the next due delivery (a lease with a fencing generation, one
//!   delivery at a time per subscription, fair between tenants and principals: [`Slots`]) and
//!   copies it ([`copy`]) within `EXPORTD_DELIVERY_ATTEMPT_TIMEOUT`, then records the outcome:
//!   delivered, retried with jittered exponential backoff for passing errors until
//!   `EXPORTD_DELIVERY_RETRY_FOR`, or failed at once when the store refuses. A slow bucket holds
//!   its own slot, never another tenant's delivery. `delivery.succeeded` and `delivery.failed`
//!   webhook events come from a trigger.

pub mod copy;
pub mod store;
pub mod subscriptions;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinSet;
use tracing::Instrument;
use uuid::Uuid;

use crate::clock::Clock;
use crate::config::DeliverySettings;
use crate::links::LinkKeys;
use crate::outbound::{self, AddressGuard, GuardedConnector};
use crate::storage::bucket::{self, Reach};
use crate::storage::{ArtifactStore, Remote};
use crate::tenants::{Destination, Registry};
use store::{Claimed, Outcome};

/// How often an idle loop looks for work.
const IDLE_POLL: Duration = Duration::from_millis(500);
/// Uploads to a partner's bucket not touched for this long are aborted by the sweep.
const ABANDONED_AFTER: Duration = Duration::from_secs(3600);
/// How often the sweep of abandoned uploads runs.
const SWEEP_EVERY: Duration = Duration::from_secs(300);

/// What the delivery loop needs; cheap to clone.
#[derive(Clone)]
pub struct Courier {
    pub pool: PgPool,
    pub registry: Arc<Registry>,
    /// exportd's own store, where the files come from.
    pub artifacts: ArtifactStore,
    /// Sign the cursors of scheduled incremental exports.
    pub keys: Arc<LinkKeys>,
    pub settings: DeliverySettings,
    pub lease_ttl: Duration,
    pub clock: Clock,
    connector: GuardedConnector,
    owner: String,
}

impl Courier {
    pub fn new(
        pool: PgPool,
        registry: Arc<Registry>,
        artifacts: ArtifactStore,
        keys: Arc<LinkKeys>,
        settings: DeliverySettings,
        lease_ttl: Duration,
        clock: Clock,
    ) -> Courier {
        let guard = Arc::new(AddressGuard::named(settings.delivery_allow_nets.clone(), "EXPORTD_DELIVERY_ALLOW_NETS"));
        let connector = GuardedConnector::new(guard, bucket::REQUEST_TIMEOUT, bucket::CONNECT_TIMEOUT);
        let owner = format!("{}-{}", std::process::id(), Uuid::new_v4().simple());
        Courier { pool, registry, artifacts, keys, settings, lease_ttl, clock, connector, owner }
    }

    /// The destination's bucket, its credentials resolved now, reached through the guarded
    /// outbound client (a literal address in the endpoint is refused here, before connecting).
    /// The error says what to fix.
    pub async fn connect(&self, tenant: &str, destination: &Destination) -> Result<Remote, String> {
        let config = destination.bucket().map_err(|e| format!("destination `{}`: {e}", destination.name))?;
        if let Some(endpoint) = &config.endpoint {
            let url = reqwest::Url::parse(endpoint).map_err(|e| format!("endpoint: {e}"))?;
            outbound::check_literal(self.connector.guard(), url.host_str().unwrap_or_default())
                .map_err(|e| format!("destination `{}` endpoint: {e}", destination.name))?;
        }
        let reach = Reach::Partner(self.connector.clone());
        Remote::connect(&config, &reach, &destination.upload_tag(tenant), self.pool.clone())
            .map_err(|e| format!("destination `{}`: {e:#}", destination.name))
    }

    /// A passing failure: try again after the backoff for this attempt.
    pub fn retry_later(&self, claimed: &Claimed, error: String) -> Outcome {
        Outcome::Retry {
            error,
            after: crate::webhooks::retry_delay(self.settings.delivery_first_retry, claimed.attempts),
        }
    }

    /// One deterministic step (the tests drive deliveries with it): scheduled exports that are
    /// due, then as many due deliveries as the slots take, each run to its end. Returns how many
    /// deliveries ran.
    pub async fn pass(&self) -> anyhow::Result<usize> {
        subscriptions::schedule(self).await?;
        let mut slots = Slots::new(self.clone());
        let ran = slots.fill().await?;
        while slots.next_done().await.is_some() {}
        Ok(ran)
    }

    /// Runs one leased delivery to its outcome, renewing the lease meanwhile.
    async fn deliver(&self, claimed: Claimed) -> anyhow::Result<()> {
        let span = tracing::info_span!("delivery", tenant = %claimed.tenant, delivery = %claimed.id,
            export = %claimed.export_id, destination = %claimed.destination, attempt = claimed.attempts);
        async {
            let renewing = async {
                loop {
                    tokio::time::sleep(self.lease_ttl / 3).await;
                    match store::heartbeat(&self.pool, &claimed, self.lease_ttl).await {
                        Ok(Ok(())) => {}
                        Ok(Err(store::LeaseLost)) => return,
                        Err(e) => tracing::warn!(error = %e, "renewing a delivery's lease failed"),
                    }
                }
            };
            // Losing the lease, or the attempt's time running out, drops the copy: its upload in
            // progress is aborted; the files it completed stay checkpointed.
            let limit = self.settings.delivery_attempt_timeout;
            let outcome = tokio::select! {
                outcome = tokio::time::timeout(limit, copy::attempt(self, &claimed)) => match outcome {
                    Ok(outcome) => outcome?,
                    Err(_) => Some(self.retry_later(&claimed, format!(
                        "timeout: the attempt ran longer than {} (EXPORTD_DELIVERY_ATTEMPT_TIMEOUT); the next one resumes after the last file completed",
                        humantime::format_duration(limit)
                    ))),
                },
                () = renewing => None,
            };
            let Some(outcome) = outcome else {
                tracing::warn!("a delivery attempt lost its lease; the attempt holding it decides");
                return Ok(());
            };
            let state = store::record(&self.pool, &claimed, &outcome).await?;
            metrics::counter!("exportd_bucket_deliveries_total", "outcome" => outcome.label()).increment(1);
            match (&outcome, state) {
                (_, None) => tracing::warn!("a delivery attempt outlived its lease; its outcome was not recorded"),
                (Outcome::Delivered { .. }, _) => tracing::info!("export delivered"),
                (Outcome::Retry { error, .. } | Outcome::Fail { error }, Some(state)) => {
                    tracing::warn!(error = %error, state = %state, "delivery attempt failed");
                }
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Aborts uploads into partners' buckets whose writer died (not touched for an hour).
    pub async fn sweep_abandoned(&self) -> u64 {
        let mut aborted = 0;
        for tenant in self.registry.tenants() {
            for destination in &tenant.destinations {
                let Ok(remote) = self.connect(tenant.id.as_str(), destination).await else { continue };
                match remote.sweep_abandoned(ABANDONED_AFTER).await {
                    Ok((count, _)) => aborted += count,
                    Err(e) => {
                        tracing::warn!(destination = %destination.name, error = %e, "sweeping abandoned uploads failed")
                    }
                }
            }
        }
        aborted
    }
}

/// Moves a subscription's chain to `next_cursor` (inside the transaction publishing its export).
pub async fn advance_chain(
    tx: &mut sqlx::PgConnection,
    subscription: Uuid,
    next_cursor: Option<&str>,
) -> sqlx::Result<()> {
    if let Some(cursor) = next_cursor {
        sqlx::query!("UPDATE subscriptions SET cursor = $2 WHERE id = $1", subscription, cursor).execute(tx).await?;
    }
    Ok(())
}

/// The deliveries one process runs at once: a tenant holds at most half of the slots (rounded
/// up), one principal at most half of its tenant's, so a slow bucket can only slow its own.
pub struct Slots {
    courier: Courier,
    running: JoinSet<()>,
    /// (tenant, principal) of each task running, by task id.
    holders: std::collections::HashMap<tokio::task::Id, (String, String)>,
}

impl Slots {
    pub fn new(courier: Courier) -> Slots {
        Slots { courier, running: JoinSet::new(), holders: Default::default() }
    }

    fn capacity(&self) -> usize {
        self.courier.settings.delivery_parallel.max(1)
    }

    /// Leases due deliveries into the free slots; returns how many it started.
    pub async fn fill(&mut self) -> anyhow::Result<usize> {
        let mut started = 0;
        while self.running.len() < self.capacity() {
            let claimed = {
                let shares = full_shares(self.capacity(), self.holders.values());
                let courier = &self.courier;
                let settings = &courier.settings;
                store::claim(&courier.pool, &courier.owner, courier.lease_ttl, settings.delivery_retry_for, &shares)
                    .await?
            };
            let Some(claimed) = claimed else { break };
            let holder = (claimed.tenant.clone(), claimed.principal.clone());
            let courier = self.courier.clone();
            let task = self.running.spawn(async move {
                if let Err(e) = courier.deliver(claimed).await {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "a delivery attempt stopped; its lease expires and it is retried"
                    );
                }
            });
            self.holders.insert(task.id(), holder);
            started += 1;
        }
        Ok(started)
    }

    /// Waits for a running delivery to end (`None`: none is running).
    pub async fn next_done(&mut self) -> Option<()> {
        let done = self.running.join_next_with_id().await?;
        let id = match done {
            Ok((id, ())) => id,
            Err(e) => e.id(),
        };
        self.holders.remove(&id);
        Some(())
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }
}

/// Who holds their whole share of `capacity` slots, given the (tenant, principal) of each running
/// delivery: a tenant at most half of them (rounded up), one principal at most half of its
/// tenant's.
fn full_shares<'a>(capacity: usize, holders: impl Iterator<Item = &'a (String, String)>) -> store::Shares<'a> {
    let tenant_share = capacity.div_ceil(2);
    let principal_share = tenant_share.div_ceil(2);
    let mut tenants: std::collections::HashMap<&str, usize> = Default::default();
    let mut principals: std::collections::HashMap<(&str, &str), usize> = Default::default();
    for (tenant, principal) in holders {
        *tenants.entry(tenant).or_default() += 1;
        *principals.entry((tenant, principal)).or_default() += 1;
    }
    store::Shares {
        full_tenants: tenants.into_iter().filter(|(_, n)| *n >= tenant_share).map(|(t, _)| t).collect(),
        full_principals: principals.into_iter().filter(|(_, n)| *n >= principal_share).map(|(p, _)| p).collect(),
    }
}

/// Delivers until `shutdown` turns true (inside `serve` and `worker`): the schedule and the
/// sweep of abandoned uploads on a loop of their own, deliveries in slots that take the next due
/// one as soon as they free.
pub async fn run(courier: Courier, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    while let Err(e) = subscriptions::sync(&courier.pool, &courier.registry).await {
        tracing::warn!(error = %e, "recording the tenants' subscriptions failed; trying again");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = shutdown.changed() => return,
        }
    }
    let scheduling = tokio::spawn(schedule_loop(courier.clone(), shutdown.clone()));
    let sweeping = tokio::spawn(sweep_loop(courier.clone(), shutdown.clone()));
    let mut slots = Slots::new(courier);
    while !*shutdown.borrow() {
        if let Err(e) = slots.fill().await {
            tracing::warn!(error = format!("{e:#}"), "leasing deliveries failed; trying again");
        }
        tokio::select! {
            Some(()) = slots.next_done(), if !slots.is_empty() => {}
            _ = tokio::time::sleep(IDLE_POLL) => {}
            _ = shutdown.changed() => {}
        }
    }
    // Dropping the slots aborts the attempts running: their uploads are aborted, their files
    // completed stay checkpointed, and their leases expire for another process.
    drop(slots);
    let _ = tokio::join!(scheduling, sweeping);
}

/// Creates the scheduled exports that are due, apart from copying so it never waits behind a
/// slow bucket.
async fn schedule_loop(courier: Courier, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    while !*shutdown.borrow() {
        if let Err(e) = subscriptions::schedule(&courier).await {
            tracing::warn!(error = format!("{e:#}"), "creating scheduled exports failed; trying again");
        }
        tokio::select! {
            _ = tokio::time::sleep(IDLE_POLL) => {}
            _ = shutdown.changed() => {}
        }
    }
}

/// Aborts abandoned uploads in partners' buckets every `SWEEP_EVERY`.
async fn sweep_loop(courier: Courier, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    while !*shutdown.borrow() {
        tokio::select! {
            _ = courier.sweep_abandoned() => {}
            _ = shutdown.changed() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(SWEEP_EVERY) => {}
            _ = shutdown.changed() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(t, p)| (t.to_string(), p.to_string())).collect()
    }

    fn full(capacity: usize, holders: &[(String, String)]) -> (Vec<&str>, Vec<(&str, &str)>) {
        let mut shares = full_shares(capacity, holders.iter());
        shares.full_tenants.sort();
        shares.full_principals.sort();
        (shares.full_tenants, shares.full_principals)
    }

    #[test]
    fn a_tenant_holds_half_the_slots_and_a_principal_half_of_its_tenants() {
        // 4 slots: a tenant 2, a principal 1.
        let holders = running(&[("acme", "p1"), ("acme", "p2"), ("globex", "q1")]);
        assert_eq!(full(4, &holders), (vec!["acme"], vec![("acme", "p1"), ("acme", "p2"), ("globex", "q1")]));
        // 8 slots: a tenant 4, a principal 2.
        let holders = running(&[("acme", "p1"), ("acme", "p1"), ("acme", "p2"), ("globex", "q1")]);
        assert_eq!(full(8, &holders), (vec![], vec![("acme", "p1")]));
        // One slot: whoever holds it holds everything; nobody else waits on a share of zero.
        assert_eq!(full(1, &running(&[("acme", "p1")])), (vec!["acme"], vec![("acme", "p1")]));
        assert_eq!(full(2, &[]), (vec![], vec![]), "nothing running: nobody is full");
        // 2 slots: a tenant 1, so a second tenant always finds one free.
        assert_eq!(full(2, &running(&[("acme", "p1")])), (vec!["acme"], vec![("acme", "p1")]));
    }
}
