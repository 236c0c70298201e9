//! The one owner of every statement on `export_jobs`, `export_shards` and `export_shard_plan`:
//! the API's creates, reads and cancels ([`jobs`]), the worker's fenced writes ([`lease`]), the
//! shard plan and its writer leases ([`plan`]), checkpoints ([`shards`]) and what usage,
//! history, metrics, estimates and feed GC read about exports ([`facts`]). Nothing else in
//! exportd names these tables, so a change of their shape or of a state rule is made here.
//!
//! **Lock order**, everywhere in exportd: a transaction that takes several row locks takes them
//! in this order, so no two transactions ever wait on each other in a cycle:
//! `tenant_usage` (quota decisions, [`crate::quota::lock_tenant`]) → `export_jobs` →
//! `export_shards` → `export_shard_plan` → `scheduler_turns` (claims only, last). Never an
//! earlier kind after a later one. Claims take the `CLAIM_LOCK` advisory lock before any row;
//! nothing else takes it, so it adds no cycle.

pub mod facts;
pub mod jobs;
pub mod lease;
pub mod plan;
pub mod shards;

use std::time::Duration;

/// `sqlx::query_as!` for [`ExportJob`](super::ExportJob) rows: the statement is `$before`, the
/// job's columns, then `$after` (checked against the schema at compile time like any `query!`).
macro_rules! job_query {
    ($before:literal, $after:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            crate::exports::ExportJob,
            $before
                + r#" id, tenant, principal, dataset, mode AS "mode: crate::exports::Mode",
                  format AS "format: crate::writers::Format", codec AS "codec: crate::writers::Codec", schema_sha256, schema_version, exportd_version, request, request_sha256,
                  state AS "state: crate::exports::ExportState", watermark::text AS "watermark!",
                  watermark_timeline, watermark_wal_position, columns,
                  filter, row_filter, column_policy, hashed_key_order, shard_rows, created_at, started_at, finished_at, lease_generation,
                  attempts, stalled_attempts, stalled_since, shards_done, rows_done, bytes_done, error_code, error_detail,
                  manifest_sha256, file_bytes, file_sha256, expires_at, from_cursor, start_from, start_after,
                  until_tick, rows_estimate, planned_rows, plan_complete "#
                + $after
            $(, $arg)*
        )
    };
}
use job_query;

/// Records that `tenant` was served now: claims and helpers' shards go round-robin by it.
async fn turn_taken(tx: &mut sqlx::PgConnection, tenant: &str) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO scheduler_turns (tenant, last_claimed_at) VALUES ($1, clock_timestamp())
         ON CONFLICT ON CONSTRAINT scheduler_turns_pkey DO UPDATE SET last_claimed_at = clock_timestamp()",
        tenant,
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// Lease lengths are bound as milliseconds.
fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Advisory lock key serializing claims of jobs and of helpers' shards ("exportd-claim").
const CLAIM_LOCK: i64 = 0x6578_706f_7274_636d;
