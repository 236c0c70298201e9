//! The shard plan of an export and the per-shard writer leases that let several workers — in
//! one process or many — write one export's shards at once.
//!
//! Each plan row says where a shard starts and, once someone counted or wrote it, where it ends
//! and how many rows it holds under the frozen snapshot. A full export's plan grows one shard
//! at a time as far as someone needs it (see `jobs::planner`); a counted shard can be written
//! in any order, by anyone, with the bytes of a one-worker run. An incremental export is
//! planned one shard at a time, where the last ended.
//!
//! A shard's writer holds the row's lease; `writer_attempt` is the fencing token its checkpoint
//! is recorded under ([`super::lease::record_shard`]). Rows are locked after `export_jobs` and
//! `export_shards` and before `scheduler_turns` (the lock order in [`super`]). A row is free to
//! take when it is not done and its writer (if any) gave it back or vanished (SQL function
//! `exportd_shard_free`).

use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::lease::{Lease, LeaseLost};
use super::{CLAIM_LOCK, job_query, millis, turn_taken};
use crate::exports::{ExportJob, ExportState};

/// One planned shard, as a writer took it.
#[derive(Debug, Clone)]
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
    /// When the first of those writers vanished.
    pub first_takeover_at: Option<time::OffsetDateTime>,
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

/// The next shard to plan: where it starts and, if counted, where it ends and how many rows it
/// holds (a coordinator's next shard is open-ended: it ends wherever its row limit stops).
pub struct NewShard<'a> {
    pub index: i32,
    pub after_key: Option<&'a str>,
    pub last_key: Option<&'a str>,
    pub rows: Option<i64>,
}

/// Where an open-ended shard turned out to end (counted by someone who needs to plan past it).
pub struct ShardEnd<'a> {
    pub index: i32,
    pub last_key: Option<&'a str>,
    pub rows: i64,
}

/// Who may grow a plan: the job's lease holder, or any worker while the job runs under a live
/// lease (a helper planning the shard it will write; plan rows are the same whoever counts them).
#[derive(Debug, Clone, Copy)]
pub enum Planner {
    Holder(Lease),
    Helper(Uuid),
}

/// Records the frontier's `end` (if given), adds `shard` to the plan (if given) and records
/// whether the plan is now complete — only while the job is RUNNING under a live lease (the
/// holder's own generation, for the holder): a holder that stalled past its lease stops
/// planning, so no planner holds the job's row while another worker tries to take over (claims
/// skip locked rows). Repeating a step changes nothing. A shard checkpointed before the plan
/// existed (a job from before plans) is planned as done.
///
/// `planned_rows` grows to the rows up to the end of the last shard whose end is known: every
/// shard of a full export but the last holds exactly `shard_rows` rows.
pub async fn extend(
    pool: &PgPool,
    planner: Planner,
    end: Option<&ShardEnd<'_>>,
    shard: Option<&NewShard<'_>>,
    complete: bool,
) -> sqlx::Result<Result<(), LeaseLost>> {
    let (job_id, generation) = match planner {
        Planner::Holder(lease) => (lease.job_id, Some(lease.generation)),
        Planner::Helper(job_id) => (job_id, None),
    };
    let ends = [end.map(|e| (e.index, e.rows)), shard.and_then(|s| s.rows.map(|rows| (s.index, rows)))];
    let (known_index, known_rows) = ends.into_iter().flatten().max().map(|(i, rows)| (i64::from(i), rows)).unzip();
    let mut tx = pool.begin().await?;
    let fenced = sqlx::query!(
        "UPDATE export_jobs SET planned_shards = GREATEST(planned_shards, $3),
             plan_complete = plan_complete OR $4,
             planned_rows = GREATEST(planned_rows, $5::bigint * shard_rows + $6::bigint)
         WHERE id = $1 AND ($2::bigint IS NULL OR lease_generation = $2) AND state = 'RUNNING'
           AND lease_expires_at >= now() AND ($2::bigint IS NOT NULL OR NOT plan_complete)",
        job_id,
        generation,
        shard.map_or(0, |s| s.index + 1),
        complete,
        known_index,
        known_rows,
    )
    .execute(&mut *tx)
    .await?;
    if fenced.rows_affected() == 0 {
        return Ok(Err(LeaseLost));
    }
    if let Some(end) = end {
        sqlx::query!(
            "UPDATE export_shard_plan SET rows = $3, last_key = $4
             WHERE export_id = $1 AND shard_index = $2 AND rows IS NULL",
            job_id,
            end.index,
            end.rows,
            end.last_key,
        )
        .execute(&mut *tx)
        .await?;
    }
    if let Some(shard) = shard {
        sqlx::query!(
            "INSERT INTO export_shard_plan (export_id, shard_index, after_key, last_key, rows, done)
             SELECT $1, $2, $3, $4, $5,
                    EXISTS (SELECT 1 FROM export_shards s WHERE s.export_id = $1 AND s.shard_index = $2)
             ON CONFLICT ON CONSTRAINT export_shard_plan_pkey DO NOTHING",
            job_id,
            shard.index,
            shard.after_key,
            shard.last_key,
            shard.rows,
        )
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Ok(()))
}

/// An open-ended shard turned out empty: the previous one was the last.
/// Removes it and completes the plan, only under the job's lease.
pub async fn drop_empty(pool: &PgPool, lease: Lease, index: i32) -> sqlx::Result<Result<(), LeaseLost>> {
    let mut tx = pool.begin().await?;
    let fenced = sqlx::query!(
        "UPDATE export_jobs SET planned_shards = $3, plan_complete = true,
             planned_rows = CASE WHEN mode = 'full' THEN $3::int::bigint * shard_rows ELSE planned_rows END
         WHERE id = $1 AND lease_generation = $2 AND state = 'RUNNING'",
        lease.job_id,
        lease.generation,
        index,
    )
    .execute(&mut *tx)
    .await?;
    if fenced.rows_affected() == 0 {
        return Ok(Err(LeaseLost));
    }
    sqlx::query!(
        "DELETE FROM export_shard_plan WHERE export_id = $1 AND shard_index = $2 AND NOT done",
        lease.job_id,
        index,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// The last planned shard of a plan, where planning continues.
#[derive(Debug, Clone)]
pub struct Frontier {
    pub shard_index: i32,
    pub after_key: Option<String>,
    /// Its end, if known (counted, or written).
    pub last_key: Option<String>,
    pub rows: Option<i64>,
    /// Nobody is writing it and it is not written: free to take.
    pub free: bool,
}

pub async fn frontier(pool: &PgPool, job_id: Uuid) -> sqlx::Result<Option<Frontier>> {
    sqlx::query_as!(
        Frontier,
        r#"SELECT shard_index, after_key, last_key, rows, exportd_shard_free(done, writer_expires_at) AS "free!"
           FROM export_shard_plan WHERE export_id = $1 ORDER BY shard_index DESC LIMIT 1"#,
        job_id,
    )
    .fetch_optional(pool)
    .await
}

/// Running full exports whose plan a helper may grow (incomplete, under a live lease or handed
/// back between two shards, their tenants not resting): the first few, tenants served least
/// recently first, as for claims. ([`extend`] then needs the lease live.)
pub async fn plannable(pool: &PgPool, resting: &[String]) -> sqlx::Result<Vec<ExportJob>> {
    job_query!(
        "SELECT",
        "FROM export_jobs JOIN (
             SELECT j.id AS candidate,
                    row_number() OVER (ORDER BY t.last_claimed_at NULLS FIRST, j.created_at, j.id) AS turn
             FROM export_jobs j LEFT JOIN scheduler_turns t ON t.tenant = j.tenant
             WHERE j.state = 'RUNNING' AND j.mode = 'full' AND NOT j.plan_complete
               AND (j.lease_expires_at >= now() OR j.yielded) AND j.tenant <> ALL($1::text[])
             ORDER BY turn LIMIT 4) r ON r.candidate = export_jobs.id
         ORDER BY r.turn",
        resting
    )
    .fetch_all(pool)
    .await
}

/// How far the job is: shards recorded, shards planned, and whether the plan is complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    sqlx::query_as!(
        Progress,
        "SELECT shards_done, planned_shards, plan_complete FROM export_jobs WHERE id = $1",
        job_id
    )
    .fetch_one(pool)
    .await
}

/// Whether a full export is still being planned: its shards will soon be free to help with,
/// or the export itself to claim, so a draining worker waits instead of exiting. Whatever its
/// lease: one handed back between shards (no lease for a moment) is claimed again at once, and
/// a worker that looked while the lease was held must not leave the moment it is handed back.
pub async fn being_planned(pool: &PgPool) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM export_jobs WHERE state = 'RUNNING' AND mode = 'full'
                          AND NOT plan_complete) AS "planning!""#,
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
    let mut tx = pool.begin().await?;
    let chosen = match index {
        Some(index) => {
            sqlx::query_scalar!(
                "SELECT p.shard_index FROM export_shard_plan p
                 JOIN export_jobs j ON j.id = p.export_id AND j.lease_generation = $2 AND j.state = 'RUNNING'
                 WHERE p.export_id = $1 AND p.shard_index = $3
                 FOR UPDATE OF p SKIP LOCKED",
                lease.job_id,
                lease.generation,
                index,
            )
            .fetch_optional(&mut *tx)
            .await?
        }
        None => {
            sqlx::query_scalar!(
                "SELECT p.shard_index FROM export_shard_plan p
                 JOIN export_jobs j ON j.id = p.export_id AND j.lease_generation = $2 AND j.state = 'RUNNING'
                 WHERE p.export_id = $1 AND exportd_shard_free(p.done, p.writer_expires_at)
                 ORDER BY p.shard_index LIMIT 1
                 FOR UPDATE OF p SKIP LOCKED",
                lease.job_id,
                lease.generation,
            )
            .fetch_optional(&mut *tx)
            .await?
        }
    };
    let Some(index) = chosen else {
        tx.commit().await?;
        return Ok(None);
    };
    let shard = assign_writer(&mut tx, lease.job_id, index, worker, ttl).await?;
    tx.commit().await?;
    Ok(Some(shard))
}

/// Gives a planned row, locked by the caller, a new writer and attempt for `ttl`.
async fn assign_writer(
    tx: &mut PgConnection,
    job_id: Uuid,
    index: i32,
    worker: &str,
    ttl: Duration,
) -> sqlx::Result<PlannedShard> {
    sqlx::query_as!(
        PlannedShard,
        "UPDATE export_shard_plan SET writer = $3,
             writer_expires_at = now() + $4 * interval '1 millisecond',
             writer_attempt = writer_attempt + 1,
             takeovers = takeovers + CASE WHEN writer_expires_at IS NULL OR done THEN 0 ELSE 1 END,
             first_takeover_at = CASE WHEN writer_expires_at IS NULL OR done THEN first_takeover_at
                                      ELSE coalesce(first_takeover_at, now()) END
         WHERE export_id = $1 AND shard_index = $2
         RETURNING shard_index, after_key, last_key, rows, writer_attempt, takeovers, first_takeover_at",
        job_id,
        index,
        worker,
        millis(ttl),
    )
    .fetch_one(tx)
    .await
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
    sqlx::query!("SELECT pg_advisory_xact_lock($1)", CLAIM_LOCK).execute(&mut *tx).await?;
    let chosen = sqlx::query!(
        "WITH ranked AS (
             SELECT c.export_id, c.shard_index,
                    row_number() OVER (ORDER BY t.last_claimed_at NULLS FIRST, j.created_at, j.id, c.shard_index) AS turn
             FROM export_jobs j
             LEFT JOIN scheduler_turns t ON t.tenant = j.tenant
             CROSS JOIN LATERAL (
                 SELECT p.export_id, p.shard_index FROM export_shard_plan p
                 WHERE p.export_id = j.id AND exportd_shard_free(p.done, p.writer_expires_at)
                   -- Counted shards only (an open-ended one is its coordinator's to write),
                   -- and none found empty (its writer drops it).
                   AND p.rows IS NOT NULL AND (p.rows > 0 OR p.shard_index = 0)
                 ORDER BY p.shard_index LIMIT 2) c
             WHERE j.state = 'RUNNING' AND j.mode = 'full' AND j.tenant <> ALL($1::text[]))
         SELECT p.export_id, p.shard_index FROM export_shard_plan p
         JOIN ranked r ON (r.export_id, r.shard_index) = (p.export_id, p.shard_index)
         WHERE exportd_shard_free(p.done, p.writer_expires_at)
         ORDER BY r.turn LIMIT 1
         FOR UPDATE OF p SKIP LOCKED",
        resting,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(chosen) = chosen else {
        tx.commit().await?;
        return Ok(None);
    };
    let shard = assign_writer(&mut tx, chosen.export_id, chosen.shard_index, worker, ttl).await?;
    let job = job_query!("SELECT", "FROM export_jobs WHERE id = $1", chosen.export_id).fetch_one(&mut *tx).await?;
    turn_taken(&mut tx, &job.tenant).await?;
    tx.commit().await?;
    Ok(Some((job, shard)))
}

/// Extends a shard writer's lease; returns the job's state (a cancel request shows up here).
pub async fn heartbeat(
    pool: &PgPool,
    lease: ShardLease,
    ttl: Duration,
) -> sqlx::Result<Result<ExportState, LeaseLost>> {
    let state = sqlx::query_scalar!(
        r#"UPDATE export_shard_plan SET writer_expires_at = now() + $4 * interval '1 millisecond'
           WHERE export_id = $1 AND shard_index = $2 AND writer_attempt = $3 AND writer IS NOT NULL
           RETURNING (SELECT state FROM export_jobs WHERE id = $1) AS "state: ExportState""#,
        lease.job_id,
        lease.shard_index,
        lease.attempt,
        millis(ttl),
    )
    .fetch_optional(pool)
    .await?;
    Ok(state.flatten().ok_or(LeaseLost))
}

/// Gives an unfinished shard back (throttled, shutdown, error): another writer may take it at
/// once, and it does not count as a takeover.
pub async fn release(pool: &PgPool, lease: ShardLease) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE export_shard_plan SET writer = NULL, writer_expires_at = NULL
         WHERE export_id = $1 AND shard_index = $2 AND writer_attempt = $3 AND NOT done",
        lease.job_id,
        lease.shard_index,
        lease.attempt,
    )
    .execute(pool)
    .await?;
    Ok(())
}
