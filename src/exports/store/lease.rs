//! A job's lease and every write its worker makes, conditioned on the lease generation. A
//! write that matches no row means another worker took over (or the user cancelled): the
//! caller stops. Rows are locked in the order the [module](super) gives.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::plan::{Progress, ShardLease};
use super::{CLAIM_LOCK, job_query, millis, turn_taken};
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
#[derive(Debug)]
pub struct Claimed {
    pub job: ExportJob,
    pub was_yielded: bool,
}

/// Claims the next job fairly: among tenants below their `max_running_exports` (given as
/// `limits`; a job counts as running while its lease or one of its shard writers' is live),
/// the one served least recently; within it, its oldest job that is QUEUED, whose lease expired
/// or was given back with work left for its lease holder, or that awaits its cancellation.
/// QUEUED becomes RUNNING; the generation grows; a yielded job's claim is not counted as another
/// attempt, and a claim that finds a new checkpoint since the previous one starts the stalled
/// count again.
///
/// A job has work for its lease holder when it is not RUNNING (starting, cancelling), its plan
/// is incomplete, every shard is written (publish), or a planned shard is free. A job whose
/// remaining shards are all being written by live helpers is not claimed: the helper finishing
/// last makes it claimable again.
///
/// Tenants in `resting` (over their scan rate in this process) are passed over until they may
/// read again.
///
/// Claims are serialized cluster-wide by an advisory lock (one short statement each), so
/// `max_running_exports` and the round-robin hold with any number of worker processes.
/// Candidates are ranked without row locks and only the chosen row is locked (`SKIP LOCKED`),
/// so a claim holds one job row, then the tenant's `scheduler_turns` row (the lock order).
///
/// A job whose last attempts ended without a checkpoint is claimed again only after `backoff`,
/// so an export that kills its workers does not kill one per lease period.
pub async fn claim(
    pool: &PgPool,
    worker_id: &str,
    ttl: Duration,
    backoff: StallBackoff,
    limits: &[(String, i32)],
    resting: &[String],
) -> sqlx::Result<Option<Claimed>> {
    let (tenants, max_running): (Vec<String>, Vec<i32>) = limits.iter().cloned().unzip();
    let mut tx = pool.begin().await?;
    // Claims run one at a time across the cluster: two claimers ranking at once would both see
    // a tenant below max_running_exports and take two of its jobs (each locks only its own).
    // The next statement's snapshot is taken after the lock, so it sees the previous claim.
    sqlx::query!("SELECT pg_advisory_xact_lock($1)", CLAIM_LOCK).execute(&mut *tx).await?;
    let candidate = sqlx::query!(
        r#"WITH limits AS (SELECT * FROM unnest($1::text[], $2::int[]) AS l(tenant, max_running)),
           unfinished AS (
               SELECT j.id, j.tenant, j.state, j.created_at,
                      -- After the second attempt in a row that ended without a checkpoint, the
                      -- next waits $4 ms past the lapsed lease, doubling each time up to $5.
                      j.lease_expires_at IS NULL OR j.lease_expires_at
                          + CASE WHEN j.yielded OR j.interrupted OR j.shards_done > j.shards_at_claim
                                      OR j.stalled_attempts < 2 THEN 0
                                 ELSE least($4 * 2 ^ (j.stalled_attempts - 2), $5) END * interval '1 millisecond'
                          < now() AS lease_free,
                      j.state IN ('RUNNING', 'CANCEL_REQUESTED') AND j.lease_expires_at >= now() AS leased,
                      EXISTS (SELECT 1 FROM export_shard_plan p WHERE p.export_id = j.id
                              AND NOT p.done AND p.writer_expires_at >= now()) AS has_live_writers,
                      (j.state <> 'RUNNING' OR NOT j.plan_complete OR j.shards_done >= j.planned_shards
                       OR EXISTS (SELECT 1 FROM export_shard_plan p WHERE p.export_id = j.id
                                  AND exportd_shard_free(p.done, p.writer_expires_at))) AS needs_coordinator
               FROM export_jobs j WHERE exportd_export_unfinished(j.state)),
           busy AS (
               SELECT u.tenant, count(*) AS running FROM unfinished u
               WHERE u.state IN ('RUNNING', 'CANCEL_REQUESTED') AND (u.leased OR u.has_live_writers)
               GROUP BY u.tenant),
           waiting AS (
               SELECT DISTINCT u.tenant FROM unfinished u
               WHERE u.lease_free AND u.needs_coordinator AND u.tenant <> ALL($3::text[])),
           ranked AS (
               SELECT c.id, row_number() OVER (ORDER BY t.last_claimed_at NULLS FIRST, c.created_at, c.id) AS turn
               FROM waiting w
               LEFT JOIN limits l ON l.tenant = w.tenant
               LEFT JOIN busy b ON b.tenant = w.tenant
               LEFT JOIN scheduler_turns t ON t.tenant = w.tenant
               CROSS JOIN LATERAL (
                   SELECT u.id, u.created_at FROM unfinished u
                   WHERE u.tenant = w.tenant AND u.lease_free AND u.needs_coordinator
                     -- A job whose shards are being written already counts as running.
                     AND (coalesce(b.running, 0) < coalesce(l.max_running, 1) OR u.has_live_writers)
                   ORDER BY u.created_at, u.id
                   LIMIT 4) c)
           SELECT j.id, j.yielded FROM export_jobs j JOIN ranked r ON r.id = j.id
           WHERE exportd_export_unfinished(j.state) AND (j.lease_expires_at IS NULL OR j.lease_expires_at < now())
           ORDER BY r.turn
           LIMIT 1
           FOR UPDATE OF j SKIP LOCKED"#,
        &tenants,
        &max_running,
        resting,
        millis(backoff.first),
        millis(backoff.most),
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(candidate) = candidate else {
        tx.commit().await?;
        return Ok(None);
    };
    let job = job_query!(
        "UPDATE export_jobs SET
             state = CASE WHEN state = 'QUEUED' THEN 'RUNNING' ELSE state END,
             lease_generation = lease_generation + 1,
             lease_owner = $2,
             lease_expires_at = now() + $3 * interval '1 millisecond',
             attempts = attempts + CASE WHEN yielded THEN 0 ELSE 1 END,
             stalled_attempts = CASE WHEN yielded OR shards_done > shards_at_claim THEN 1
                                     WHEN interrupted THEN stalled_attempts
                                     ELSE stalled_attempts + 1 END,
             stalled_since = CASE WHEN yielded OR shards_done > shards_at_claim THEN now()
                                  ELSE coalesce(stalled_since, now()) END,
             shards_at_claim = shards_done,
             yielded = false,
             interrupted = false,
             started_at = coalesce(started_at, now())
         WHERE id = $1
         RETURNING",
        "",
        candidate.id,
        worker_id,
        millis(ttl),
    )
    .fetch_one(&mut *tx)
    .await?;
    turn_taken(&mut tx, &job.tenant).await?;
    tx.commit().await?;
    Ok(Some(Claimed { job, was_yielded: candidate.yielded }))
}

/// The wait before claiming a job again after its second, third, … attempt in a row ended
/// without a checkpoint: `first`, doubling, at most `most`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallBackoff {
    pub first: Duration,
    pub most: Duration,
}

/// Extends the lease; returns the job's state (a cancel request shows up here).
pub async fn heartbeat(pool: &PgPool, lease: Lease, ttl: Duration) -> sqlx::Result<Result<ExportState, LeaseLost>> {
    let state = sqlx::query_scalar!(
        r#"UPDATE export_jobs SET lease_expires_at = now() + $3 * interval '1 millisecond'
           WHERE id = $1 AND lease_generation = $2 AND state IN ('RUNNING', 'CANCEL_REQUESTED')
           RETURNING state AS "state: ExportState""#,
        lease.job_id,
        lease.generation,
        millis(ttl),
    )
    .fetch_optional(pool)
    .await?;
    Ok(state.ok_or(LeaseLost))
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
/// with the number of shards. An open-ended shard's plan row learns its end here. Returns the
/// job's progress after this shard.
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
    let stored = super::facts::stored_bytes(&mut *tx, tenant).await?;
    let earlier = sqlx::query!(
        "SELECT rows, bytes FROM export_shards WHERE export_id = $1 AND shard_index = $2",
        lease.job_id,
        shard.shard_index,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let (replaced, replaced_rows, replaced_bytes) = earlier.map_or((false, 0, 0), |e| (true, e.rows, e.bytes));
    let stored = (stored - replaced_bytes).max(0) as u64 + shard.bytes as u64;
    if stored > storage_limit {
        return Ok(Err(Refused::StorageQuota { stored, limit: storage_limit }));
    }
    let progress = sqlx::query_as!(
        Progress,
        "UPDATE export_jobs SET
             shards_done = shards_done + CASE WHEN $2 THEN 0 ELSE 1 END,
             rows_done = rows_done - $3 + $4,
             bytes_done = bytes_done - $5 + $6,
             planned_rows = CASE WHEN mode = 'full' THEN GREATEST(planned_rows, $7::bigint * shard_rows + $4)
                                 ELSE planned_rows END
         WHERE id = $1 AND state = 'RUNNING'
         RETURNING shards_done, planned_shards, plan_complete",
        lease.job_id,
        replaced,
        replaced_rows,
        shard.rows,
        replaced_bytes,
        shard.bytes,
        i64::from(shard.shard_index),
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(progress) = progress else {
        return Ok(Err(Refused::LeaseLost));
    };
    sqlx::query!(
        "INSERT INTO export_shards (export_id, shard_index, first_key, last_key, rows, bytes, sha256, object_key,
             head_bytes, head_crc32, head_raw_bytes, body_bytes, body_crc32, body_raw_bytes, written_by, stats)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
         ON CONFLICT ON CONSTRAINT export_shards_pkey
         DO UPDATE SET object_key = EXCLUDED.object_key, written_by = EXCLUDED.written_by",
        lease.job_id,
        shard.shard_index,
        shard.first_key,
        shard.last_key,
        shard.rows,
        shard.bytes,
        shard.sha256,
        shard.object_key,
        shard.head_bytes,
        shard.head_crc32,
        shard.head_raw_bytes,
        shard.body_bytes,
        shard.body_crc32,
        shard.body_raw_bytes,
        writer,
        shard.stats as _,
    )
    .execute(&mut *tx)
    .await?;
    let fenced = sqlx::query!(
        "UPDATE export_shard_plan SET done = true, writer = NULL, writer_expires_at = NULL,
             rows = coalesce(rows, $4), last_key = CASE WHEN rows IS NULL THEN $5 ELSE last_key END
         WHERE export_id = $1 AND shard_index = $2 AND writer_attempt = $3 AND writer IS NOT NULL",
        lease.job_id,
        lease.shard_index,
        lease.attempt,
        shard.rows,
        shard.last_key,
    )
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
    /// The whole file, for formats whose shards splice into one.
    pub file_bytes: Option<i64>,
    pub file_sha256: Option<&'a str>,
    /// The export expires this many hours after publishing.
    pub artifact_hours: u32,
}

/// The export as its publication left it: what else its publication makes true is decided by
/// the worker composing it (a subscription's chain, the stored cursor, a table version).
#[derive(Debug)]
pub struct Published {
    pub tenant: String,
    pub principal: String,
    pub dataset: String,
    pub subscription_id: Option<Uuid>,
    /// A full Parquet export of the whole dataset (`exportd_is_table_version`): the next version
    /// of the principal's shared table.
    pub is_table_version: bool,
    /// When its snapshot was taken.
    pub created_at: time::OffsetDateTime,
}

/// RUNNING → SUCCEEDED with the manifest in `tx`, only under this lease and once every planned
/// shard is recorded; the shard plan is forgotten with it. `Err(LeaseLost)` also when a cancel
/// request won the race: the caller then looks at the state.
pub async fn publish(
    tx: &mut Transaction<'_, Postgres>,
    lease: Lease,
    p: &Publication<'_>,
) -> sqlx::Result<Result<Published, LeaseLost>> {
    let published = sqlx::query_as!(
        Published,
        r#"UPDATE export_jobs SET state = 'SUCCEEDED', manifest = $3, manifest_sha256 = $4,
             shards_done = $5, rows_done = $6, bytes_done = $7, file_bytes = $8, file_sha256 = $9,
             published_at = now(), expires_at = now() + $10 * interval '1 hour',
             finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
         WHERE id = $1 AND lease_generation = $2 AND state = 'RUNNING'
           AND plan_complete AND shards_done >= planned_shards
         RETURNING tenant, principal, dataset, subscription_id, created_at,
                   exportd_is_table_version(mode, format, request) AS "is_table_version!""#,
        lease.job_id,
        lease.generation,
        p.manifest,
        p.manifest_sha256,
        p.shards,
        p.rows,
        p.bytes,
        p.file_bytes,
        p.file_sha256,
        f64::from(p.artifact_hours),
    )
    .fetch_optional(&mut **tx)
    .await?;
    let Some(published) = published else {
        return Ok(Err(LeaseLost));
    };
    sqlx::query!("DELETE FROM export_shard_plan WHERE export_id = $1", lease.job_id).execute(&mut **tx).await?;
    Ok(Ok(published))
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
    let (id, from, to) = (fence.job_id(), from.as_str(), to.as_str());
    let (code, detail) = (error.map(|e| e.0), error.map(|e| e.1));
    let mut tx = pool.begin().await?;
    let done = match fence {
        Fence::Job(lease) => {
            sqlx::query!(
                "UPDATE export_jobs SET state = $3, error_code = $4, error_detail = $5,
                 finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
             WHERE id = $1 AND state = $2 AND lease_generation = $6",
                id,
                from,
                to,
                code,
                detail,
                lease.generation,
            )
            .execute(&mut *tx)
            .await?
        }
        Fence::Shard(lease) => {
            sqlx::query!(
                "UPDATE export_jobs SET state = $3, error_code = $4, error_detail = $5,
                 finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
             WHERE id = $1 AND state = $2
               AND EXISTS (SELECT 1 FROM export_shard_plan p WHERE p.export_id = $1 AND p.shard_index = $6
                           AND p.writer_attempt = $7 AND p.writer IS NOT NULL)",
                id,
                from,
                to,
                code,
                detail,
                lease.shard_index,
                lease.attempt,
            )
            .execute(&mut *tx)
            .await?
        }
    };
    if done.rows_affected() == 0 {
        return Ok(Err(LeaseLost));
    }
    sqlx::query!("DELETE FROM export_shards WHERE export_id = $1", id).execute(&mut *tx).await?;
    sqlx::query!("DELETE FROM export_shard_plan WHERE export_id = $1", id).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// Gives the job back after a finished shard (shutdown, or yielding to other tenants): another
/// worker may claim it at once, without re-verifying the files or counting an attempt.
pub async fn release(pool: &PgPool, lease: Lease) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE export_jobs SET lease_owner = NULL, lease_expires_at = NULL, yielded = true
         WHERE id = $1 AND lease_generation = $2 AND state = 'RUNNING'",
        lease.job_id,
        lease.generation,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Gives the job back after an error: claimable at once, and (unlike [`release`]) the next
/// claim verifies the checkpoints and counts an attempt. A run `interrupted` by an outage
/// (database or object store) does not count towards attempts-exhausted.
pub async fn give_back(pool: &PgPool, lease: Lease, interrupted: bool) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE export_jobs SET lease_owner = NULL, lease_expires_at = NULL, interrupted = $3
         WHERE id = $1 AND lease_generation = $2 AND state IN ('RUNNING', 'CANCEL_REQUESTED')",
        lease.job_id,
        lease.generation,
        interrupted,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The job's state, generation and failure code, to tell a cancel from a takeover (or from our
/// own terminal write) after a refused write.
pub async fn current(pool: &PgPool, job_id: Uuid) -> sqlx::Result<(ExportState, i64, Option<String>)> {
    let row = sqlx::query!(
        r#"SELECT state AS "state: ExportState", lease_generation, error_code FROM export_jobs WHERE id = $1"#,
        job_id,
    )
    .fetch_one(pool)
    .await?;
    Ok((row.state, row.lease_generation, row.error_code))
}
