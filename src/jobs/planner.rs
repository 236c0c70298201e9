//! A full export's shard plan, made while its first shards are already being written.
//!
//! The coordinator plans the first shard itself; a planner task plans the rest — one counting
//! index pass per shard, PostgreSQL's work — while the coordinator (and helpers in any process)
//! write the shards planned so far, so with one slot the planning no longer comes before the
//! writing. Every extension is fenced by the job's lease: the task ends when the plan is
//! complete, when the lease is lost (a takeover, a cancel request, or the job given back), or
//! when the export would break a limit. When the run that started it ends, the task is told to
//! stop and does so between two shards: it is never cut off inside a statement or transaction
//! (an aborted future could leave a transaction holding the job's row on a pooled connection).
//! A run that gives its lease up waits for the task first (see `ClaimedExport::release`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::WorkerDeps;
use super::plan::Plan;
use crate::exports::ExportJob;
use crate::exports::store::lease::{Lease, LeaseLost};
use crate::exports::store::plan::{self as shard_plan, NewShard, PlannedShard};

/// What one planning step did.
pub(super) enum Extended {
    /// Planned one more shard; more follow.
    More,
    /// The plan is complete.
    Complete,
    /// The export would break a limit: fail it with this code and detail.
    Failed {
        code: &'static str,
        detail: String,
    },
    LeaseLost,
}

/// Where planning stands: the last planned shard and the rows planned so far.
pub(super) struct Cursor {
    pub(super) last: Option<PlannedShard>,
    pub(super) planned_rows: u64,
}

/// Plans the shard after `cursor.last` (counting its rows under the snapshot) and records it,
/// or completes the plan when no full shard is left. With `stop` set once the rows are counted,
/// nothing is recorded (`More`, the cursor unchanged): a stopped planner never writes again.
pub(super) async fn plan_next(
    deps: &WorkerDeps,
    job: &ExportJob,
    plan: &Plan,
    lease: Lease,
    cursor: &mut Cursor,
    stop: Option<&AtomicBool>,
) -> anyhow::Result<Extended> {
    let last = &cursor.last;
    let index = last.as_ref().map_or(0, |l| l.shard_index + 1);
    let after = last.as_ref().and_then(|l| l.last_key.clone());
    let full_before = last.as_ref().is_none_or(|l| l.rows.unwrap_or(0) as u64 >= plan.shard_rows);
    let (rows, last_key) = if full_before {
        plan.as_of().span(&deps.pool, after.as_deref(), plan.shard_rows as i64).await?
    } else {
        (0, None)
    };
    if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
        return Ok(Extended::More);
    }
    let complete = (rows as u64) < plan.shard_rows;
    let next = NewShard { index, after_key: after.as_deref(), last_key: last_key.as_deref(), rows: Some(rows) };
    // Shard 0 exists even when empty (the header); an empty shard after it does not.
    let shard = (index == 0 || rows > 0).then_some(&next);
    if shard.is_some() {
        let max_shards = deps.config.max_shards;
        if index as u32 >= max_shards {
            let detail = format!(
                "the export would have more than {max_shards} shards; create it again with a larger shard_rows"
            );
            return Ok(Extended::Failed { code: "too-many-shards", detail });
        }
        let max_rows = deps.registry.get(&job.tenant).map_or(0, |t| t.quota.max_rows_per_export);
        if cursor.planned_rows + rows as u64 > max_rows {
            let detail = format!("the export has more than {max_rows} rows, the tenant's max_rows_per_export");
            return Ok(Extended::Failed { code: "too-many-rows", detail });
        }
    }
    if let Err(LeaseLost) = shard_plan::extend(&deps.pool, lease, shard, complete).await? {
        return Ok(Extended::LeaseLost);
    }
    if complete {
        return Ok(Extended::Complete);
    }
    cursor.planned_rows += rows as u64;
    cursor.last = Some(PlannedShard {
        shard_index: index,
        after_key: after,
        last_key,
        rows: Some(rows),
        writer_attempt: 0,
        takeovers: 0,
    });
    Ok(Extended::More)
}

/// The planner task of one run. Dropping it tells the task to stop after the current shard.
pub(super) struct Planner {
    task: JoinHandle<anyhow::Result<Extended>>,
    /// Shards the task has planned so far; closed when it ends.
    planned: watch::Receiver<u32>,
    stop: Arc<AtomicBool>,
}

impl Planner {
    /// Plans the rest of `job`'s shards after `cursor`, in the background.
    pub(super) fn start(
        deps: &WorkerDeps,
        job: &ExportJob,
        lease: Lease,
        mut cursor: Cursor,
    ) -> anyhow::Result<Planner> {
        let (deps, job) = (deps.clone(), job.clone());
        let plan = Plan::from_job(&job)?;
        let (planned_tx, planned) = watch::channel(0u32);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(
            async move {
                loop {
                    if stopped.load(Ordering::Relaxed) {
                        return Ok(Extended::More); // the run ended; the next one plans on
                    }
                    match plan_next(&deps, &job, &plan, lease, &mut cursor, Some(&stopped)).await? {
                        Extended::More => planned_tx.send_modify(|n| *n += 1),
                        end => return Ok(end),
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        Ok(Planner { task, planned, stop })
    }

    /// Tells the task to stop and waits until it has (after the shard it is planning, if any).
    pub(super) async fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Err(e) = (&mut self.task).await {
            tracing::warn!(error = %e, "the shard planner panicked");
        }
    }

    /// Waits until the task has planned another shard (`None`) or has ended (how).
    pub(super) async fn next(&mut self) -> anyhow::Result<Option<Extended>> {
        if self.planned.changed().await.is_ok() {
            return Ok(None);
        }
        let ended = (&mut self.task).await.context("the shard planner panicked")?;
        ended.map(Some)
    }
}

impl Drop for Planner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
