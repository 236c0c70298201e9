//! A job's lease and every write its worker makes, conditioned on the lease generation. A
//! write that matches no row means another worker took over (or the user cancelled): the
//! caller stops. Rows are locked in the order the [module](super) gives.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::plan::{HAS_LIVE_WRITERS, NEEDS_COORDINATOR, Progress, ShardLease};
use super::{CLAIM_LOCK, JOB_COLUMNS, millis};
use crate::exports::states::UNFINISHED;
use crate::exports::{ExportJob, ExportState, ShardRecord};

/// The right to work on one job, for one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub job_id: Uuid,
    pub generation: i64,
}

/// The lease is no longer ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease lost: another worker owns the job now")]
pub struct LeaseLost;

/// A claimed job, and whether its previous holder yielded it cleanly between shards.
#[derive(Debug, sqlx::FromRow)]
pub struct Claimed {
    #[sqlx(flatten)]
    pub job: ExportJob,
    pub was_yielded: bool,
}

/// Claims the next job fairly: among tenants below their `max_running_exports` (given as
/// `limits`; a job counts as running while its lease or one of its shard writers' is live),
/// the one served least recently; within it, its oldest job that is QUEUED, whose lease expired
/// or was given back with work left for its lease holder, or that awaits its cancellation. QUEUED becomes RUNNING; the
/// generation grows; a yielded job's claim is not counted as another attempt, and a claim that
/// finds a new checkpoint since the previous one starts the stalled count again.
///
/// Tenants in `resting` (over their scan rate in this process) are passed over until they may
/// read again.
///
/// Claims are serialized cluster-wide by an advisory lock (one short statement each), so
/// `max_running_exports` and the round-robin hold with any number of worker processes.
/// Candidates are ranked without row locks and only the chosen row is locked (`SKIP LOCKED`),
/// so a claim holds one job row, then the tenant's `scheduler_turns` row (the lock order above).
pub async fn claim(
    pool: &PgPool,
    worker_id: &str,
    ttl: Duration,
    limits: &[(String, i32)],
    resting: &[String],
) -> sqlx::Result<Option<Claimed>> {
    let (tenants, max_running): (Vec<&str>, Vec<i32>) = limits.iter().map(|(t, m)| (t.as_str(), *m)).unzip();
    let mut tx = pool.begin().await?;
    // Claims run one at a time across the cluster: two claimers ranking at once would both see
    // a tenant below max_running_exports and take two of its jobs (each locks only its own).
    // The next statement's snapshot is taken after the lock, so it sees the previous claim.
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(CLAIM_LOCK).execute(&mut *tx).await?;
    let claimed: Option<Claimed> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH limits AS (SELECT * FROM unnest($3::text[], $4::int[]) AS l(tenant, max_running)),
         busy AS (
             SELECT j.tenant, count(*) AS running FROM export_jobs j
             WHERE j.state IN ('RUNNING', 'CANCEL_REQUESTED') AND (j.lease_expires_at >= now() OR {HAS_LIVE_WRITERS})
             GROUP BY j.tenant),
         waiting AS (
             SELECT DISTINCT j.tenant FROM export_jobs j
             WHERE j.state IN {UNFINISHED}
               AND (j.lease_expires_at IS NULL OR j.lease_expires_at < now()) AND {NEEDS_COORDINATOR}
               AND j.tenant <> ALL($5::text[])),
         ranked AS (
             SELECT c.id, row_number() OVER (ORDER BY t.last_claimed_at NULLS FIRST, c.created_at, c.id) AS turn
             FROM waiting w
             LEFT JOIN limits l ON l.tenant = w.tenant
             LEFT JOIN busy b ON b.tenant = w.tenant
             LEFT JOIN scheduler_turns t ON t.tenant = w.tenant
             CROSS JOIN LATERAL (
                 SELECT j.id, j.created_at FROM export_jobs j
                 WHERE j.tenant = w.tenant AND j.state IN {UNFINISHED}
                   AND (j.lease_expires_at IS NULL OR j.lease_expires_at < now()) AND {NEEDS_COORDINATOR}
                   -- A job whose shards are being written already counts as running.
                   AND (coalesce(b.running, 0) < coalesce(l.max_running, 1) OR {HAS_LIVE_WRITERS})
                 ORDER BY j.created_at, j.id
                 LIMIT 4) c),
         candidate AS (
             SELECT j.id, j.yielded FROM export_jobs j JOIN ranked r ON r.id = j.id
             WHERE j.state IN {UNFINISHED}
               AND (j.lease_expires_at IS NULL OR j.lease_expires_at < now())
             ORDER BY r.turn
             LIMIT 1
             FOR UPDATE OF j SKIP LOCKED)
         UPDATE export_jobs j SET
             state = CASE WHEN j.state = 'QUEUED' THEN 'RUNNING' ELSE j.state END,
             lease_generation = j.lease_generation + 1,
             lease_owner = $1,
             lease_expires_at = now() + $2 * interval '1 millisecond',
             attempts = j.attempts + CASE WHEN j.yielded THEN 0 ELSE 1 END,
             stalled_attempts = CASE WHEN j.yielded OR j.shards_done > j.shards_at_claim THEN 1
                                     WHEN j.interrupted THEN j.stalled_attempts
                                     ELSE j.stalled_attempts + 1 END,
             shards_at_claim = j.shards_done,
             yielded = false,
             interrupted = false,
             started_at = coalesce(j.started_at, now())
         FROM candidate
         WHERE j.id = candidate.id
         RETURNING {columns}, candidate.yielded AS was_yielded",
        columns = JOB_COLUMNS.split(", ").map(|c| format!("j.{c}")).collect::<Vec<_>>().join(", ")
    )))
    .bind(worker_id)
    .bind(millis(ttl))
    .bind(&tenants)
    .bind(&max_running)
    .bind(resting)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(claimed) = &claimed {
        sqlx::query(
            "INSERT INTO scheduler_turns (tenant, last_claimed_at) VALUES ($1, clock_timestamp())
             ON CONFLICT ON CONSTRAINT scheduler_turns_pkey DO UPDATE SET last_claimed_at = clock_timestamp()",
        )
        .bind(&claimed.job.tenant)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(claimed)
}

/// Extends the lease; returns the job's state (a cancel request shows up here).
pub async fn heartbeat(pool: &PgPool, lease: Lease, ttl: Duration) -> sqlx::Result<Result<ExportState, LeaseLost>> {
    let state: Option<String> = sqlx::query_scalar(
        "UPDATE export_jobs SET lease_expires_at = now() + $3 * interval '1 millisecond'
         WHERE id = $1 AND lease_generation = $2 AND state IN ('RUNNING', 'CANCEL_REQUESTED')
         RETURNING state",
    )
    .bind(lease.job_id)
    .bind(lease.generation)
    .bind(millis(ttl))
    .fetch_optional(pool)
    .await?;
    Ok(state.and_then(|s| ExportState::parse(&s)).ok_or(LeaseLost))
}

/// Why a checkpoint was not recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    LeaseLost,
    /// The tenant's stored files plus this shard would exceed `storage_bytes`.
    StorageQuota {
        stored: u64,
        limit: u64,
    },
}

/// Records a shard file and advances progress, only while the job is RUNNING, the shard's
/// writer lease is this attempt's, and the tenant's stored bytes stay within `storage_limit`.
/// The tenant's usage row is locked first, so concurrent writers count one after another.
/// Stored bytes are the `bytes_done` of the tenant's jobs whose files exist (one row per job,
/// kept equal to the sum of its checkpoints), with this shard's earlier checkpoint replaced: a
/// rewritten shard or a retried attempt is never charged twice, and the cost does not grow
/// with the number of shards. Returns the job's progress after this shard.
pub async fn record_shard(
    pool: &PgPool,
    lease: ShardLease,
    writer: &str,
    tenant: &str,
    storage_limit: u64,
    shard: &ShardRecord,
) -> sqlx::Result<Result<Progress, Refused>> {
    let mut tx = pool.begin().await?;
    crate::quota::lock_tenant(&mut tx, tenant).await?;
    let (stored, replaced, replaced_rows, replaced_bytes): (i64, bool, i64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(bytes_done), 0)::bigint FROM export_jobs WHERE tenant = $1 AND files_deleted_at IS NULL),
                s.export_id IS NOT NULL, coalesce(s.rows, 0), coalesce(s.bytes, 0)
         FROM (SELECT 1) one LEFT JOIN export_shards s ON s.export_id = $2 AND s.shard_index = $3",
    )
    .bind(tenant)
    .bind(lease.job_id)
    .bind(shard.shard_index)
    .fetch_one(&mut *tx)
    .await?;
    let stored = (stored - replaced_bytes).max(0) as u64 + shard.bytes as u64;
    if stored > storage_limit {
        return Ok(Err(Refused::StorageQuota { stored, limit: storage_limit }));
    }
    let progress: Option<Progress> = sqlx::query_as(
        "UPDATE export_jobs SET
             shards_done = shards_done + CASE WHEN $2 THEN 0 ELSE 1 END,
             rows_done = rows_done - $3 + $4,
             bytes_done = bytes_done - $5 + $6
         WHERE id = $1 AND state = 'RUNNING'
         RETURNING shards_done, planned_shards, plan_complete",
    )
    .bind(lease.job_id)
    .bind(replaced)
    .bind(replaced_rows)
    .bind(shard.rows)
    .bind(replaced_bytes)
    .bind(shard.bytes)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(progress) = progress else {
        return Ok(Err(Refused::LeaseLost));
    };
    sqlx::query(
        "INSERT INTO export_shards (export_id, shard_index, first_key, last_key, rows, bytes, sha256, object_key,
             head_bytes, head_crc32, head_raw_bytes, body_bytes, body_crc32, body_raw_bytes, written_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
         ON CONFLICT ON CONSTRAINT export_shards_pkey
         DO UPDATE SET object_key = EXCLUDED.object_key, written_by = EXCLUDED.written_by",
    )
    .bind(lease.job_id)
    .bind(shard.shard_index)
    .bind(&shard.first_key)
    .bind(&shard.last_key)
    .bind(shard.rows)
    .bind(shard.bytes)
    .bind(&shard.sha256)
    .bind(&shard.object_key)
    .bind(shard.head_bytes)
    .bind(shard.head_crc32)
    .bind(shard.head_raw_bytes)
    .bind(shard.body_bytes)
    .bind(shard.body_crc32)
    .bind(shard.body_raw_bytes)
    .bind(writer)
    .execute(&mut *tx)
    .await?;
    let fenced = sqlx::query(
        "UPDATE export_shard_plan SET done = true, writer = NULL, writer_expires_at = NULL
         WHERE export_id = $1 AND shard_index = $2 AND writer_attempt = $3 AND writer IS NOT NULL",
    )
    .bind(lease.job_id)
    .bind(lease.shard_index)
    .bind(lease.attempt)
    .execute(&mut *tx)
    .await?;
    if fenced.rows_affected() == 0 {
        return Ok(Err(Refused::LeaseLost));
    }
    tx.commit().await?;
    Ok(Ok(progress))
}

/// What publishing records besides the state.
pub struct Publication<'a> {
    pub manifest: &'a [u8],
    pub manifest_sha256: &'a str,
    pub shards: i32,
    pub rows: i64,
    pub bytes: i64,
    pub file_bytes: i64,
    pub file_sha256: &'a str,
    /// The export expires this many hours after publishing.
    pub artifact_hours: u32,
    /// Incremental exports: the cursor to store for the principal and dataset.
    pub stored_cursor: Option<&'a str>,
}

/// RUNNING → SUCCEEDED with the manifest, only under this lease and once every planned shard is
/// recorded. `Err(LeaseLost)` also when a cancel request won the race: the caller then looks at
/// the state.
pub async fn publish(pool: &PgPool, lease: Lease, p: &Publication<'_>) -> sqlx::Result<Result<(), LeaseLost>> {
    let mut tx = pool.begin().await?;
    let published: Option<(String, String, String)> = sqlx::query_as(
        "UPDATE export_jobs SET state = 'SUCCEEDED', manifest = $3, manifest_sha256 = $4,
             shards_done = $5, rows_done = $6, bytes_done = $7, file_bytes = $8, file_sha256 = $9,
             published_at = now(), expires_at = now() + $10 * interval '1 hour',
             finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
         WHERE id = $1 AND lease_generation = $2 AND state = 'RUNNING'
           AND plan_complete AND shards_done >= planned_shards
         RETURNING tenant, principal, dataset",
    )
    .bind(lease.job_id)
    .bind(lease.generation)
    .bind(p.manifest)
    .bind(p.manifest_sha256)
    .bind(p.shards)
    .bind(p.rows)
    .bind(p.bytes)
    .bind(p.file_bytes)
    .bind(p.file_sha256)
    .bind(f64::from(p.artifact_hours))
    .fetch_optional(&mut *tx)
    .await?;
    let Some((tenant, principal, dataset)) = published else {
        return Ok(Err(LeaseLost));
    };
    if let Some(cursor) = p.stored_cursor {
        crate::exports::store_cursor(&mut tx, &tenant, &principal, &dataset, cursor).await?;
    }
    sqlx::query("DELETE FROM export_shard_plan WHERE export_id = $1").bind(lease.job_id).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// Whose right a terminal write is made under: the job's lease holder, or the writer of one of
/// its shards (a shard that cannot be written fails the whole export).
#[derive(Debug, Clone, Copy)]
pub enum Fence {
    Job(Lease),
    Shard(ShardLease),
}

impl Fence {
    pub fn job_id(&self) -> Uuid {
        match self {
            Fence::Job(lease) => lease.job_id,
            Fence::Shard(lease) => lease.job_id,
        }
    }
}

/// Ends the job in `to` (CANCELLED from CANCEL_REQUESTED, FAILED from RUNNING) and forgets its
/// checkpoints and plan, in one transaction, only under `fence`. Files are deleted afterwards
/// by the caller: a stale worker never deletes files a newer attempt needs.
pub async fn finish(
    pool: &PgPool,
    fence: Fence,
    from: ExportState,
    to: ExportState,
    error: Option<(&str, &str)>,
) -> sqlx::Result<Result<(), LeaseLost>> {
    let (condition, a, b) = match fence {
        Fence::Job(lease) => ("lease_generation = $6", lease.generation, 0),
        Fence::Shard(lease) => (
            "EXISTS (SELECT 1 FROM export_shard_plan p WHERE p.export_id = $1 AND p.shard_index = $6
                     AND p.writer_attempt = $7 AND p.writer IS NOT NULL)",
            i64::from(lease.shard_index),
            lease.attempt,
        ),
    };
    let mut tx = pool.begin().await?;
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE export_jobs SET state = $3, error_code = $4, error_detail = $5,
             finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
         WHERE id = $1 AND state = $2 AND {condition} AND $7 = $7"
    )))
    .bind(fence.job_id())
    .bind(from.as_str())
    .bind(to.as_str())
    .bind(error.map(|e| e.0))
    .bind(error.map(|e| e.1))
    .bind(a)
    .bind(b)
    .execute(&mut *tx)
    .await?;
    if done.rows_affected() == 0 {
        return Ok(Err(LeaseLost));
    }
    sqlx::query("DELETE FROM export_shards WHERE export_id = $1").bind(fence.job_id()).execute(&mut *tx).await?;
    sqlx::query("DELETE FROM export_shard_plan WHERE export_id = $1").bind(fence.job_id()).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// Gives the job back after a finished shard (shutdown, or yielding to other tenants): another
/// worker may claim it at once, without re-verifying the files or counting an attempt.
pub async fn release(pool: &PgPool, lease: Lease) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE export_jobs SET lease_owner = NULL, lease_expires_at = NULL, yielded = true
         WHERE id = $1 AND lease_generation = $2 AND state = 'RUNNING'",
    )
    .bind(lease.job_id)
    .bind(lease.generation)
    .execute(pool)
    .await?;
    Ok(())
}

/// Gives the job back after an error: claimable at once, and (unlike [`release`]) the next
/// claim verifies the checkpoints and counts an attempt. A run `interrupted` by an outage
/// (database or object store) does not count towards attempts-exhausted.
pub async fn give_back(pool: &PgPool, lease: Lease, interrupted: bool) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE export_jobs SET lease_owner = NULL, lease_expires_at = NULL, interrupted = $3
         WHERE id = $1 AND lease_generation = $2 AND state IN ('RUNNING', 'CANCEL_REQUESTED')",
    )
    .bind(lease.job_id)
    .bind(lease.generation)
    .bind(interrupted)
    .execute(pool)
    .await?;
    Ok(())
}

/// The job's state, generation and failure code, to tell a cancel from a takeover (or from our
/// own terminal write) after a refused write.
pub async fn current(pool: &PgPool, job_id: Uuid) -> sqlx::Result<(ExportState, i64, Option<String>)> {
    let (state, generation, code): (String, i64, Option<String>) =
        sqlx::query_as("SELECT state, lease_generation, error_code FROM export_jobs WHERE id = $1")
            .bind(job_id)
            .fetch_one(pool)
            .await?;
    let state =
        ExportState::parse(&state).ok_or_else(|| sqlx::Error::Decode(format!("unknown state {state}").into()))?;
    Ok((state, generation, code))
}
