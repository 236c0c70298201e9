//! Workers: claim export jobs with `FOR UPDATE SKIP LOCKED`, hold a lease whose generation
//! fences every write, and run them shard by shard; a worker with no job of its own helps write
//! another export's planned shards. Many processes on many machines share the work through
//! PostgreSQL alone.

mod change_file;
mod ending;
mod heartbeat;
mod helper;
mod plan;
mod planner;
mod publication;
mod runner;
mod shard;
mod shard_task;
mod source;
mod spool;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;
use tracing::Instrument;

pub use crate::exports::store::lease::{Lease, LeaseLost};
pub use runner::{ClaimedExport, Step};
pub use spool::Spools;

use time::OffsetDateTime;

use crate::links::LinkKeys;
use crate::quota::ScanLimits;
use crate::storage::ArtifactStore;
use crate::tenants::Registry;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// A lease not renewed for this long may be taken over by another worker.
    pub lease_ttl: Duration,
    /// Rows fetched per keyset page.
    pub page_rows: u32,
    /// How long an idle worker waits before looking for work again.
    pub poll_interval: Duration,
    /// Claims in a row that find no new checkpoint since the previous claim (workers dying or
    /// erring without progress), or takeovers of one shard whose writers vanished, before a job
    /// may fail with `attempts-exhausted` …
    pub max_attempts: i32,
    /// … and how long that must have been going on: a storm of killed workers ends many attempts
    /// quickly, an export that kills every worker keeps doing it (`EXPORTD_GIVE_UP_AFTER`).
    pub give_up_after: Duration,
    /// Give the job back after every shard, so the next claim can serve another tenant.
    pub yield_between_shards: bool,
    /// Shards one export may have (else `too-many-shards`): each is a file, a checkpoint row and
    /// a link, so a tiny `shard_rows` over a big dataset would otherwise cost without bound.
    pub max_shards: u32,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            lease_ttl: Duration::from_secs(30),
            page_rows: 2_000,
            poll_interval: Duration::from_secs(1),
            max_attempts: 5,
            give_up_after: Duration::from_secs(600),
            yield_between_shards: true,
            max_shards: 10_000,
        }
    }
}

impl WorkerConfig {
    /// Whether `count` stalls (or takeovers) that began at `since` are enough to give up: more
    /// than `max_attempts`, for at least `give_up_after`.
    pub fn exhausted(&self, count: i32, since: Option<OffsetDateTime>) -> bool {
        count > self.max_attempts && lasted(since) >= self.give_up_after
    }

    /// The wait before claiming a job again after attempts in a row ended without a checkpoint:
    /// a sixth of the lease, doubling, at most two leases. With the defaults (30 s leases, 10
    /// minutes), an export that kills every worker taking it ends about 11 workers before it
    /// fails, within `give_up_after` + one lease + one longest wait (about 11.5 minutes).
    pub fn stall_backoff(&self) -> crate::exports::store::lease::StallBackoff {
        crate::exports::store::lease::StallBackoff { first: self.lease_ttl / 6, most: self.lease_ttl * 2 }
    }
}

/// How long ago `since` was (zero for none).
fn lasted(since: Option<OffsetDateTime>) -> Duration {
    since.map_or(Duration::ZERO, |since| (OffsetDateTime::now_utc() - since).unsigned_abs())
}

/// How long ago `since` was, in whole seconds for messages (`0s` for none).
pub(crate) fn since(since: Option<OffsetDateTime>) -> String {
    humantime::format_duration(Duration::from_secs(lasted(since).as_secs())).to_string()
}

/// Everything a worker needs; cheap to clone.
#[derive(Clone)]
pub struct WorkerDeps {
    pub pool: PgPool,
    pub registry: Arc<Registry>,
    pub store: ArtifactStore,
    /// Server keys: sign the `next_cursor` in manifests.
    pub keys: Arc<LinkKeys>,
    /// Rows per second each tenant's exports may read.
    pub scan: Arc<ScanLimits>,
    pub config: WorkerConfig,
    /// Hashed-key exports' rows, spooled once per export and worker (see [`spool`]).
    pub spools: Arc<Spools>,
    /// Hot standbys that read full exports' rows (none: the primary reads everything).
    pub replicas: Arc<crate::replicas::Replicas>,
}

#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Ran a job until it ended (or its lease was lost or released); the last step says how.
    Ran(Step),
    /// No job was waiting.
    Idle,
}

/// Claims one job and runs it to its end. Tests call this to drain work deterministically.
pub async fn run_next_job(
    deps: &WorkerDeps,
    worker_id: &str,
    shutdown: &watch::Receiver<bool>,
) -> anyhow::Result<Outcome> {
    let Some(run) = ClaimedExport::claim(deps, worker_id).await? else {
        return match helper::help(deps, worker_id).await? {
            None => Ok(Outcome::Idle),
            Some(step) => {
                count(&step);
                // A helper's shard is not the end of a run: only the export's end is.
                let step =
                    if matches!(step, Step::ShardWritten { .. } | Step::LeaseLost) { Step::Yielded } else { step };
                Ok(Outcome::Ran(step))
            }
        };
    };
    let span = run.span();
    run_claimed(deps, run, shutdown).instrument(span).await
}

/// Runs a claimed export until it ends, yields or is released.
async fn run_claimed(
    deps: &WorkerDeps,
    mut run: ClaimedExport,
    shutdown: &watch::Receiver<bool>,
) -> anyhow::Result<Outcome> {
    loop {
        if *shutdown.borrow() {
            run.release().await?;
            return Ok(Outcome::Ran(Step::Released));
        }
        let step = match run.step_with_retries().await {
            Ok(step) => step,
            Err(e) => {
                // Whatever stopped this run, another attempt may start now rather than after the
                // lease expires; if even that fails, expiry is the fallback.
                if let Err(give_back) = run.give_back(crate::db::is_transient_chain(&e)).await {
                    tracing::warn!(
                        error = format!("{give_back:#}"),
                        "could not give the export back; its lease will expire"
                    );
                }
                return Err(e);
            }
        };
        count(&step);
        if step.is_final() {
            return Ok(Outcome::Ran(step));
        }
        if let Step::Throttled { .. } | Step::Waiting = step {
            run.release().await?;
            return Ok(Outcome::Ran(step));
        }
        if deps.config.yield_between_shards && matches!(step, Step::ShardWritten { last: false, .. }) {
            run.release().await?;
            return Ok(Outcome::Ran(Step::Yielded));
        }
    }
}

/// Counts what workers do, for `/metrics`.
fn count(step: &Step) {
    let name = match step {
        Step::ShardWritten { .. } => "exportd_shards_written_total",
        Step::ShardVerified { .. } => "exportd_shards_skipped_total",
        Step::ShardRewritten { .. } => "exportd_shards_rewritten_total",
        Step::Throttled { .. } => "exportd_scan_throttled_total",
        other => {
            let outcome = match other {
                Step::Published => "published",
                Step::Cancelled => "cancelled",
                Step::Failed { .. } => "failed",
                Step::LeaseLost => "lease_lost",
                _ => "released",
            };
            metrics::counter!("exportd_export_runs_total", "outcome" => outcome).increment(1);
            return;
        }
    };
    metrics::counter!(name).increment(1);
}

/// Runs jobs until no job is left to run or help with (waiting while another worker plans an
/// export whose shards it can help write), then returns how each run ended (yields and helped
/// shards left out) (`exportd worker --exit-when-idle`, tests).
pub async fn drain(deps: &WorkerDeps, worker_id: &str) -> anyhow::Result<Vec<Step>> {
    let (_keep, shutdown) = watch::channel(false);
    let mut steps = Vec::new();
    loop {
        match run_next_job(deps, worker_id, &shutdown).await? {
            Outcome::Ran(step) => {
                if !matches!(step, Step::Yielded | Step::Throttled { .. } | Step::Waiting) {
                    steps.push(step);
                }
            }
            // Another worker is planning an export whose shards this one can help write.
            Outcome::Idle if crate::exports::store::plan::being_planned(&deps.pool).await? => {
                tokio::time::sleep(deps.config.poll_interval / 10).await;
            }
            // A throttled export waits for its tenant's budget: not done yet.
            Outcome::Idle if deps.scan.resting().soonest_end.is_some() => {
                tokio::time::sleep(idle_wait(deps)).await;
            }
            Outcome::Idle => return Ok(steps),
        }
    }
}

/// How long an idle worker waits before looking again: until a resting tenant may read again,
/// if that comes first (its throttled export is claimable then).
fn idle_wait(deps: &WorkerDeps) -> Duration {
    let poll = deps.config.poll_interval;
    deps.scan.resting().soonest_end.map_or(poll, |end| end.min(poll))
}

/// One worker loop: run jobs, poll when idle, stop (releasing its lease) on shutdown.
pub async fn run_worker(deps: WorkerDeps, worker_id: String, mut shutdown: watch::Receiver<bool>) {
    while !*shutdown.borrow() {
        let idle = match run_next_job(&deps, &worker_id, &shutdown).await {
            Ok(Outcome::Ran(step)) => {
                if !matches!(step, Step::Yielded | Step::Throttled { .. } | Step::Waiting) {
                    tracing::info!(worker = %worker_id, outcome = ?step, "job run ended");
                }
                false
            }
            Ok(Outcome::Idle) => true,
            Err(e) if crate::db::is_transient_chain(&e) => {
                tracing::warn!(worker = %worker_id, error = format!("{e:#}"), "database or object store unavailable; trying again");
                true
            }
            Err(e) => {
                tracing::error!(worker = %worker_id, error = format!("{e:#}"), "job run failed; the job was given back to be retried");
                true
            }
        };
        if idle {
            tokio::select! {
                _ = tokio::time::sleep(idle_wait(&deps)) => {}
                _ = shutdown.changed() => {}
            }
        }
    }
}

/// Starts `count` worker loops; they stop when `shutdown` turns true. A loop that panics is
/// logged and started again: the process keeps its workers until it is told to stop.
pub fn spawn_workers(
    deps: &WorkerDeps,
    count: usize,
    shutdown: &watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let process = uuid::Uuid::new_v4().simple().to_string();
    (0..count)
        .map(|n| tokio::spawn(supervise(deps.clone(), format!("{}-{n}", &process[..12]), shutdown.clone())))
        .collect()
}

async fn supervise(deps: WorkerDeps, worker_id: String, shutdown: watch::Receiver<bool>) {
    loop {
        let run = tokio::spawn(run_worker(deps.clone(), worker_id.clone(), shutdown.clone()));
        match run.await {
            Err(panic) if panic.is_panic() && !*shutdown.borrow() => {
                tracing::error!(worker = %worker_id, "worker panicked; starting it again");
                metrics::counter!("exportd_worker_restarts_total").increment(1);
                tokio::time::sleep(deps.config.poll_interval).await;
            }
            _ => return,
        }
    }
}
