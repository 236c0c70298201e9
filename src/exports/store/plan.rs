//! The shard plan of an export and the per-shard writer leases that let several workers — in
//! one process or many — write one export's shards at once.
//!
//! A full export's shards are planned ahead by the worker holding the job's lease: each plan
//! row says where the shard starts, where it ends and how many rows it holds under the frozen
//! snapshot, so the shards can be written in any order, by anyone, with the bytes of a
//! one-worker run. An incremental export is planned one shard at a time, where the last ended.
//!
//! A shard's writer holds the row's lease; `writer_attempt` is the fencing token its checkpoint
//! is recorded under ([`super::lease::record_shard`]). Rows are locked after `export_jobs` and
//! `export_shards` and before `scheduler_turns` (the lock order in [`super`]).

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::lease::{Lease, LeaseLost};
use super::{CLAIM_LOCK, JOB_COLUMNS, millis};
use crate::exports::{ExportJob, ExportState};

/// One planned shard, as a writer took it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PlannedShard {
    pub shard_index: i32,
    /// The shard holds the rows after this position (none: from the start).
    pub after_key: Option<String>,
    pub last_key: Option<String>,
    /// Rows the shard holds; unknown (`None`) for incremental exports.
    pub rows: Option<i64>,
    pub writer_attempt: i32,
    /// Takes of this row whose previous writer vanished without giving it back.
    pub takeovers: i32,
}

/// The right to write one shard of one job, for one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLease {
    pub job_id: Uuid,
    pub shard_index: i32,
    pub attempt: i32,
}

impl PlannedShard {
    pub fn lease(&self, job_id: Uuid) -> ShardLease {
        ShardLease { job_id, shard_index: self.shard_index, attempt: self.writer_attempt }
    }
}

const PLANNED_COLUMNS: &str = "p.shard_index, p.after_key, p.last_key, p.rows, p.writer_attempt, p.takeovers";

/// A row nobody is writing: never finished, and its writer (if any) gave it back or vanished.
const FREE: &str = "NOT p.done AND (p.writer_expires_at IS NULL OR p.writer_expires_at < now())";

/// SQL (over `export_jobs j`): the job has work for the worker holding its lease — it is not
/// RUNNING (starting, cancelling), its plan is incomplete, every shard is written (publish), or
/// a planned shard is free. A job whose remaining shards are all being written by live helpers
/// is not claimed: the helper finishing last makes it claimable again.
pub(super) const NEEDS_COORDINATOR: &str = "(j.state <> 'RUNNING' OR NOT j.plan_complete
    OR j.shards_done >= j.planned_shards
    OR EXISTS (SELECT 1 FROM export_shard_plan p WHERE p.export_id = j.id
               AND NOT p.done AND (p.writer_expires_at IS NULL OR p.writer_expires_at < now())))";

/// SQL (over `export_jobs j`): someone is writing one of the job's shards right now.
pub(super) const HAS_LIVE_WRITERS: &str = "EXISTS (SELECT 1 FROM export_shard_plan p WHERE p.export_id = j.id
    AND NOT p.done AND p.writer_expires_at >= now())";

/// The next shard to plan, as the planner found it.
pub struct NewShard<'a> {
    pub index: i32,
    pub after_key: Option<&'a str>,
    pub last_key: Option<&'a str>,
    pub rows: Option<i64>,
}

/// Adds `shard` to the plan (if given) and records whether the plan is now complete, only
/// under the job's lease. Repeating a step adds nothing twice; a shard checkpointed before the
/// plan existed (a job from before plans) is planned as done.
pub async fn extend(
    pool: &PgPool,
    lease: Lease,
    shard: Option<&NewShard<'_>>,
    complete: bool,
) -> sqlx::Result<Result<(), LeaseLost>> {
    let mut tx = pool.begin().await?;
    let planned = shard.map_or(0, |s| s.index + 1);
    let fenced = sqlx::query(
        "UPDATE export_jobs SET planned_shards = GREATEST(planned_shards, $3), plan_complete = $4
         WHERE id = $1 AND lease_generation = $2 AND state = 'RUNNING'",
    )
    .bind(lease.job_id)
    .bind(lease.generation)
    .bind(planned)
    .bind(complete)
    .execute(&mut *tx)
    .await?;
    if fenced.rows_affected() == 0 {
        return Ok(Err(LeaseLost));
    }
    if let Some(shard) = shard {
        // The job's planned rows grow by the row only if it is new: a repeated step adds nothing.
        sqlx::query(
            "WITH planned AS (
                 INSERT INTO export_shard_plan (export_id, shard_index, after_key, last_key, rows, done)
                 SELECT $1, $2, $3, $4, $5,
                        EXISTS (SELECT 1 FROM export_shards s WHERE s.export_id = $1 AND s.shard_index = $2)
                 ON CONFLICT ON CONSTRAINT export_shard_plan_pkey DO NOTHING
                 RETURNING rows)
             UPDATE export_jobs SET planned_rows = planned_rows + (SELECT coalesce(sum(rows), 0) FROM planned)
             WHERE id = $1",
        )
        .bind(lease.job_id)
        .bind(shard.index)
        .bind(shard.after_key)
        .bind(shard.last_key)
        .bind(shard.rows)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Ok(()))
}

/// An incremental export's planned shard turned out empty: the previous one was the last.
/// Removes it and completes the plan, only under the job's lease.
pub async fn drop_empty(pool: &PgPool, lease: Lease, index: i32) -> sqlx::Result<Result<(), LeaseLost>> {
    let mut tx = pool.begin().await?;
    let fenced = sqlx::query(
        "UPDATE export_jobs SET planned_shards = $3, plan_complete = true
         WHERE id = $1 AND lease_generation = $2 AND state = 'RUNNING'",
    )
    .bind(lease.job_id)
    .bind(lease.generation)
    .bind(index)
    .execute(&mut *tx)
    .await?;
    if fenced.rows_affected() == 0 {
        return Ok(Err(LeaseLost));
    }
    sqlx::query("DELETE FROM export_shard_plan WHERE export_id = $1 AND shard_index = $2 AND NOT done")
        .bind(lease.job_id)
        .bind(index)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// The last planned shard, where planning continues, and the rows planned so far.
pub async fn last_planned(pool: &PgPool, job_id: Uuid) -> sqlx::Result<(Option<PlannedShard>, u64)> {
    let last = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {PLANNED_COLUMNS} FROM export_shard_plan p WHERE p.export_id = $1 ORDER BY p.shard_index DESC LIMIT 1"
    )))
    .bind(job_id)
    .fetch_optional(pool)
    .await?;
    let rows: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(rows), 0)::bigint FROM export_shard_plan WHERE export_id = $1")
            .bind(job_id)
            .fetch_one(pool)
            .await?;
    Ok((last, rows.max(0) as u64))
}

/// How far the job is: shards recorded, shards planned, and whether the plan is complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Progress {
    pub shards_done: i32,
    pub planned_shards: i32,
    pub plan_complete: bool,
}

impl Progress {
    /// Every shard of the export is written.
    pub fn all_written(&self) -> bool {
        self.plan_complete && self.shards_done >= self.planned_shards
    }
}

pub async fn progress(pool: &PgPool, job_id: Uuid) -> sqlx::Result<Progress> {
    sqlx::query_as("SELECT shards_done, planned_shards, plan_complete FROM export_jobs WHERE id = $1")
        .bind(job_id)
        .fetch_one(pool)
        .await
}

/// Whether a live worker is planning a full export right now: its shards will soon be free to
/// help with (a draining worker waits for them instead of exiting).
pub async fn being_planned(pool: &PgPool) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM export_jobs WHERE state = 'RUNNING' AND mode = 'full'
                        AND NOT plan_complete AND lease_expires_at >= now())",
    )
    .fetch_one(pool)
    .await
}

/// The job's lease holder takes a shard to write: `index`, or (none) the first free one.
/// Taking `index` also takes a finished shard (to rewrite a corrupt file on takeover).
pub async fn take(
    pool: &PgPool,
    lease: Lease,
    index: Option<i32>,
    worker: &str,
    ttl: Duration,
) -> sqlx::Result<Option<PlannedShard>> {
    let which = match index {
        Some(_) => "p.shard_index = $5",
        None => FREE,
    };
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH chosen AS (
             SELECT p.export_id, p.shard_index FROM export_shard_plan p
             JOIN export_jobs j ON j.id = p.export_id AND j.lease_generation = $2 AND j.state = 'RUNNING'
             WHERE p.export_id = $1 AND {which}
             ORDER BY p.shard_index LIMIT 1
             FOR UPDATE OF p SKIP LOCKED)
         {}
         FROM chosen WHERE (p.export_id, p.shard_index) = (chosen.export_id, chosen.shard_index)
         RETURNING {PLANNED_COLUMNS}",
        take_sql(3, 4)
    )))
    .bind(lease.job_id)
    .bind(lease.generation)
    .bind(worker)
    .bind(millis(ttl))
    .bind(index.unwrap_or(0))
    .fetch_optional(pool)
    .await
}

/// Gives a planned row a new writer (`$worker`) and attempt for `$ttl` ms.
fn take_sql(worker: u8, ttl: u8) -> String {
    format!(
        "UPDATE export_shard_plan p SET writer = ${worker},
             writer_expires_at = now() + ${ttl} * interval '1 millisecond',
             writer_attempt = p.writer_attempt + 1,
             takeovers = p.takeovers + CASE WHEN p.writer_expires_at IS NULL OR p.done THEN 0 ELSE 1 END"
    )
}

/// A worker with no job of its own helps: it takes a free planned shard of a running full
/// export, tenants served round-robin like job claims (and serialized with them).
pub async fn claim_any(
    pool: &PgPool,
    worker: &str,
    ttl: Duration,
    resting: &[String],
) -> sqlx::Result<Option<(ExportJob, PlannedShard)>> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(CLAIM_LOCK).execute(&mut *tx).await?;
    let taken: Option<(Uuid, PlannedShard)> = sqlx::query_as::<_, (Uuid, i32, Option<String>, Option<String>, Option<i64>, i32, i32)>(
        sqlx::AssertSqlSafe(format!(
            "WITH ranked AS (
                 SELECT c.export_id, c.shard_index,
                        row_number() OVER (ORDER BY t.last_claimed_at NULLS FIRST, j.created_at, j.id, c.shard_index) AS turn
                 FROM export_jobs j
                 LEFT JOIN scheduler_turns t ON t.tenant = j.tenant
                 CROSS JOIN LATERAL (
                     SELECT p.export_id, p.shard_index FROM export_shard_plan p
                     WHERE p.export_id = j.id AND {FREE}
                     ORDER BY p.shard_index LIMIT 2) c
                 WHERE j.state = 'RUNNING' AND j.mode = 'full' AND j.tenant <> ALL($3::text[])),
             chosen AS (
                 SELECT p.export_id, p.shard_index FROM export_shard_plan p
                 JOIN ranked r ON (r.export_id, r.shard_index) = (p.export_id, p.shard_index)
                 WHERE {FREE}
                 ORDER BY r.turn LIMIT 1
                 FOR UPDATE OF p SKIP LOCKED)
             {}
             FROM chosen WHERE (p.export_id, p.shard_index) = (chosen.export_id, chosen.shard_index)
             RETURNING p.export_id, {PLANNED_COLUMNS}",
            take_sql(1, 2)
        )),
    )
    .bind(worker)
    .bind(millis(ttl))
    .bind(resting)
    .fetch_optional(&mut *tx)
    .await?
    .map(|(id, shard_index, after_key, last_key, rows, writer_attempt, takeovers)| {
        (id, PlannedShard { shard_index, after_key, last_key, rows, writer_attempt, takeovers })
    });
    let Some((job_id, shard)) = taken else {
        tx.commit().await?;
        return Ok(None);
    };
    let job: ExportJob =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT {JOB_COLUMNS} FROM export_jobs WHERE id = $1")))
            .bind(job_id)
            .fetch_one(&mut *tx)
            .await?;
    sqlx::query(
        "INSERT INTO scheduler_turns (tenant, last_claimed_at) VALUES ($1, clock_timestamp())
         ON CONFLICT ON CONSTRAINT scheduler_turns_pkey DO UPDATE SET last_claimed_at = clock_timestamp()",
    )
    .bind(&job.tenant)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some((job, shard)))
}

/// Extends a shard writer's lease; returns the job's state (a cancel request shows up here).
pub async fn heartbeat(
    pool: &PgPool,
    lease: ShardLease,
    ttl: Duration,
) -> sqlx::Result<Result<ExportState, LeaseLost>> {
    let state: Option<Option<String>> = sqlx::query_scalar(
        "UPDATE export_shard_plan SET writer_expires_at = now() + $4 * interval '1 millisecond'
         WHERE export_id = $1 AND shard_index = $2 AND writer_attempt = $3 AND writer IS NOT NULL
         RETURNING (SELECT state FROM export_jobs WHERE id = $1)",
    )
    .bind(lease.job_id)
    .bind(lease.shard_index)
    .bind(lease.attempt)
    .bind(millis(ttl))
    .fetch_optional(pool)
    .await?;
    Ok(state.flatten().and_then(|s| ExportState::parse(&s)).ok_or(LeaseLost))
}

/// Gives an unfinished shard back (throttled, shutdown, error): another writer may take it at
/// once, and it does not count as a takeover.
pub async fn release(pool: &PgPool, lease: ShardLease) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE export_shard_plan SET writer = NULL, writer_expires_at = NULL
         WHERE export_id = $1 AND shard_index = $2 AND writer_attempt = $3 AND NOT done",
    )
    .bind(lease.job_id)
    .bind(lease.shard_index)
    .bind(lease.attempt)
    .execute(pool)
    .await?;
    Ok(())
}
