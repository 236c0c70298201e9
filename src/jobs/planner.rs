//! A full export's shard plan, grown only as far as someone needs it.
//!
//! Every shard but the last holds exactly `shard_rows` rows: shard k is the next `shard_rows`
//! rows (in key order, under the snapshot) after shard k-1's last key. So the coordinator plans
//! its next shard open-ended — it ends wherever its row limit stops — and a worker writing an
//! export alone never counts a row it does not write (counting every shard ahead used to cost a
//! tenth of a one-slot export, on the same cores). A helper with nothing to take counts ahead
//! instead: the frontier shard's end if nobody knows it yet, then the shard after it, which it
//! plans with its rows and last key and then takes. A boundary is the same whoever finds it, so
//! the bytes equal a one-worker run. The limits follow from the same arithmetic: shard k starts
//! after `k × shard_rows` rows.

use super::WorkerDeps;
use super::plan::Plan;
use crate::exports::ExportJob;
use crate::exports::store::lease::{Lease, LeaseLost};
use crate::exports::store::plan::{self as shard_plan, Frontier, NewShard, Planner, ShardEnd};

/// What the coordinator's planning step did.
pub(super) enum Appended {
    /// Planned one more shard, or learned that the plan is complete.
    Grown,
    /// The last planned shard is free: write it first.
    FrontierFree,
    /// The export would break a limit: fail it with this code and detail.
    Failed {
        code: &'static str,
        detail: String,
    },
    LeaseLost,
}

/// The coordinator's step: plans the shard after the frontier, open-ended, or completes the
/// plan when the frontier is the last shard.
pub(super) async fn append(deps: &WorkerDeps, job: &ExportJob, plan: &Plan, lease: Lease) -> anyhow::Result<Appended> {
    let holder = Planner::Holder(lease);
    let Some(front) = shard_plan::frontier(&deps.pool, job.id).await? else {
        let first = NewShard { index: 0, after_key: None, last_key: None, rows: None };
        return grown(shard_plan::extend(&deps.pool, holder, None, Some(&first), false).await?);
    };
    if front.free {
        return Ok(Appended::FrontierFree);
    }
    let end = end_of(deps, job.id, plan, &front).await?;
    let (rows, last_key) = (end.rows, end.last_key.as_deref());
    let index = front.shard_index + 1;
    let mut complete = (rows as u64) < plan.shard_rows;
    if !complete && index as u32 >= deps.config.max_shards {
        // The limit matters only if a row follows.
        let (more, _) = plan.span(deps, job.id, last_key, 1).await?;
        if more > 0 {
            let max_shards = deps.config.max_shards;
            let detail = format!(
                "the export would have more than {max_shards} shards; create it again with a larger shard_rows"
            );
            return Ok(Appended::Failed { code: "too-many-shards", detail });
        }
        complete = true;
    }
    let next = NewShard { index, after_key: last_key, last_key: None, rows: None };
    let shard = (!complete).then_some(&next);
    grown(shard_plan::extend(&deps.pool, holder, end.to_record(front.shard_index).as_ref(), shard, complete).await?)
}

fn grown(extended: Result<(), LeaseLost>) -> anyhow::Result<Appended> {
    Ok(match extended {
        Ok(()) => Appended::Grown,
        Err(LeaseLost) => Appended::LeaseLost,
    })
}

/// A helper's step: plans the shard after `job`'s frontier with its rows counted, so that it
/// can be taken. `false`: nothing to plan (no first shard yet, the plan is complete, a limit is
/// reached — the coordinator fails the export when it gets there — or the job stopped).
pub(super) async fn count_ahead(deps: &WorkerDeps, job: &ExportJob) -> anyhow::Result<bool> {
    let plan = Plan::from_job(deps, job)?;
    let Some(front) = shard_plan::frontier(&deps.pool, job.id).await? else {
        return Ok(false);
    };
    let end = end_of(deps, job.id, &plan, &front).await?;
    let (rows, last_key) = (end.rows, end.last_key.as_deref());
    let end = end.to_record(front.shard_index);
    let helper = Planner::Helper(job.id);
    let record_end = async |complete: bool| -> anyhow::Result<bool> {
        if end.is_some() || complete {
            shard_plan::extend(&deps.pool, helper, end.as_ref(), None, complete).await?.ok();
        }
        Ok(false)
    };
    if (rows as u64) < plan.shard_rows {
        return record_end(true).await; // the frontier is the last shard
    }
    let index = front.shard_index + 1;
    let before = index as u64 * plan.shard_rows;
    let max_rows = deps.registry.get(&job.tenant).map_or(0, |t| t.quota.max_rows_per_export);
    if index as u32 >= deps.config.max_shards || before >= max_rows {
        return record_end(false).await;
    }
    let (next_rows, next_last) = plan.span(deps, job.id, last_key, plan.shard_rows).await?;
    if next_rows == 0 {
        return record_end(true).await;
    }
    if before + next_rows as u64 > max_rows {
        return record_end(false).await;
    }
    let next = NewShard { index, after_key: last_key, last_key: next_last.as_deref(), rows: Some(next_rows) };
    let complete = (next_rows as u64) < plan.shard_rows;
    Ok(shard_plan::extend(&deps.pool, helper, end.as_ref(), Some(&next), complete).await?.is_ok())
}

/// Where the frontier shard ends.
struct End {
    rows: i64,
    last_key: Option<String>,
    /// Counted just now: to be recorded in the plan.
    counted: bool,
}

impl End {
    fn to_record(&self, index: i32) -> Option<ShardEnd<'_>> {
        self.counted.then_some(ShardEnd { index, last_key: self.last_key.as_deref(), rows: self.rows })
    }
}

/// Where the frontier ends: known (counted or written), or counted now.
async fn end_of(deps: &WorkerDeps, id: uuid::Uuid, plan: &Plan, front: &Frontier) -> anyhow::Result<End> {
    if let Some(rows) = front.rows {
        return Ok(End { rows, last_key: front.last_key.clone(), counted: false });
    }
    let (rows, last_key) = plan.span(deps, id, front.after_key.as_deref(), plan.shard_rows).await?;
    Ok(End { rows, last_key, counted: true })
}
