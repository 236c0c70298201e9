//! Helping: a worker with no job of its own writes a free counted shard of a running full
//! export — counting the next one itself when none is free — so one export's shards run on
//! every free worker slot, in any process. The helper holds only that shard's lease; the job's
//! lease holder verifies and publishes.

use tracing::Instrument;

use super::WorkerDeps;
use super::ending::{self, authorized};
use super::heartbeat::Heartbeat;
use super::plan::Plan;
use super::planner;
use super::runner::Step;
use super::shard_task::{ShardTask, Written};
use crate::exports::ExportJob;
use crate::exports::store::lease::{Fence, LeaseLost};
use crate::exports::store::plan::{self as shard_plan, PlannedShard, ShardLease};

/// Takes a free counted shard, if any — counting one ahead when none is free — and writes it.
/// `None`: nothing to help with.
pub async fn help(deps: &WorkerDeps, worker_id: &str) -> anyhow::Result<Option<Step>> {
    let resting = deps.scan.resting().tenants;
    // Another helper or the coordinator may take the shard just counted, or the coordinator may
    // be between two shards (its lease handed back for a moment): a few tries, then idle.
    for _ in 0..3 {
        let claimed = shard_plan::claim_any(&deps.pool, worker_id, deps.config.lease_ttl, &resting).await?;
        if let Some((job, shard)) = claimed {
            let span = tracing::info_span!("export", export = %job.id, tenant = %job.tenant, shard = shard.shard_index);
            return write_planned_shard(deps, worker_id, job, shard).instrument(span).await.map(Some);
        }
        let plannable = shard_plan::plannable(&deps.pool, &resting).await?;
        if plannable.is_empty() {
            return Ok(None);
        }
        // An export at a limit, or not started, has nothing to count: try the next.
        for job in plannable {
            if planner::count_ahead(deps, &job).await? {
                break;
            }
        }
    }
    Ok(None)
}

/// Writes a planned shard of `job` under its own lease (the helper's whole part in an export).
async fn write_planned_shard(
    deps: &WorkerDeps,
    worker_id: &str,
    job: ExportJob,
    shard: PlannedShard,
) -> anyhow::Result<Step> {
    let lease = shard.lease(job.id);
    let index = shard.shard_index;
    tracing::debug!(export = %job.id, shard = index, attempt = lease.attempt, "helping with a shard");
    let fail = async |code: &str, detail: &str| -> anyhow::Result<Step> {
        Ok(match ending::fail(deps, &job, Fence::Shard(lease), code, detail).await? {
            Ok(()) => Step::Failed { code: code.to_owned() },
            Err(LeaseLost) => Step::LeaseLost,
        })
    };
    let plan = Plan::from_job(deps, &job)?;
    if deps.config.exhausted(shard.takeovers, shard.first_takeover_at) {
        let detail = format!(
            "gave up after the writers of shard {index} vanished {} times, over {}",
            shard.takeovers,
            super::since(shard.first_takeover_at)
        );
        return fail("attempts-exhausted", &detail).await;
    }
    if let Err(reason) = authorized(deps, &job, &plan) {
        return fail("permission-revoked", &reason).await;
    }
    let heartbeat = Heartbeat::new(deps, None);
    heartbeat.writing(Some(lease));
    let task = ShardTask::new(deps, worker_id, &job, &plan, shard);
    let written = match task.run(&heartbeat).await {
        Ok(written) => written,
        Err(e) if ending::is_unencodable(&e) => {
            let (code, detail) = ending::unencodable(&job, &e);
            return fail(code, &detail).await;
        }
        Err(e) => {
            give_back(deps, lease).await;
            return Err(e);
        }
    };
    let step = match written {
        Written::Recorded { checkpoint, progress } => {
            Step::ShardWritten { index: index as u32, rows: checkpoint.rows as u64, last: progress.all_written() }
        }
        Written::Stopped => {
            give_back(deps, lease).await;
            Step::LeaseLost
        }
        Written::Throttled(wait) => {
            give_back(deps, lease).await;
            Step::Throttled { wait }
        }
        Written::Mismatch(detail) => fail("non-deterministic-output", &detail).await?,
        Written::Refused(refused) => match ending::refusal(deps, &job, refused).await {
            None => Step::LeaseLost,
            Some((code, detail)) => fail(code, &detail).await?,
        },
        // A helper writes only counted shards, never empty ones past the first; neither happens.
        Written::Empty | Written::TooManyRows => fail("non-deterministic-output", "a planned shard changed").await?,
    };
    Ok(step)
}

/// The shard goes back to be taken at once; if even that fails, its lease expiring is the fallback.
async fn give_back(deps: &WorkerDeps, lease: ShardLease) {
    if let Err(e) = shard_plan::release(&deps.pool, lease).await {
        tracing::warn!(error = format!("{e:#}"), "could not give a shard back; its lease will expire");
    }
}
