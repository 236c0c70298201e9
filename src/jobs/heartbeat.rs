//! Renewing a worker's leases while it works: the job's (its lease holder) and the shard's it
//! is writing (anyone writing one), at most every third of their lifetime.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::WorkerDeps;
use crate::exports::ExportState;
use crate::exports::store::lease::{self, Lease, LeaseLost};
use crate::exports::store::plan::{self as shard_plan, ShardLease};

pub(super) struct Heartbeat {
    deps: WorkerDeps,
    job: Option<Lease>,
    shard: Mutex<Option<ShardLease>>,
    last: Mutex<Instant>,
}

impl Heartbeat {
    /// Renews `job` (the lease holder) or nothing but the shard being written (a helper).
    pub(super) fn new(deps: &WorkerDeps, job: Option<Lease>) -> Heartbeat {
        Heartbeat { deps: deps.clone(), job, shard: Mutex::new(None), last: Mutex::new(Instant::now()) }
    }

    /// The shard being written from now on (none: between shards).
    pub(super) fn writing(&self, shard: Option<ShardLease>) {
        *self.shard.lock().expect("not poisoned") = shard;
    }

    pub(super) fn shard(&self) -> Option<ShardLease> {
        *self.shard.lock().expect("not poisoned")
    }

    /// Renews every lease held; the job's state, or `LeaseLost` if any lease is gone.
    pub(super) async fn beat(&self) -> anyhow::Result<Result<ExportState, LeaseLost>> {
        let ttl = self.deps.config.lease_ttl;
        let mut state = None;
        if let Some(job) = self.job {
            match lease::heartbeat(&self.deps.pool, job, ttl).await? {
                Ok(s) => state = Some(s),
                Err(lost) => return Ok(Err(lost)),
            }
        }
        if let Some(shard) = self.shard() {
            match shard_plan::heartbeat(&self.deps.pool, shard, ttl).await? {
                Ok(s) => state = Some(s),
                Err(lost) => return Ok(Err(lost)),
            }
        }
        *self.last.lock().expect("not poisoned") = Instant::now();
        Ok(state.ok_or(LeaseLost))
    }

    /// How long the leases surely last without another beat.
    pub(super) fn remaining(&self) -> Duration {
        self.deps.config.lease_ttl.saturating_sub(self.last.lock().expect("not poisoned").elapsed())
    }

    /// `true` while the job is still RUNNING under these leases.
    pub(super) async fn keep_going(&self) -> anyhow::Result<bool> {
        let due = self.last.lock().expect("not poisoned").elapsed() >= self.deps.config.lease_ttl / 3;
        if !due {
            return Ok(true);
        }
        Ok(self.beat().await? == Ok(ExportState::Running))
    }
}
