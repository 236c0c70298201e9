//! Writing one planned shard under its writer lease, the same way for the job's lease holder
//! and for helpers: read the shard's rows, stream them into the store, check them against the
//! plan, record the checkpoint.

use std::time::Duration;

use super::WorkerDeps;
use super::heartbeat::Heartbeat;
use super::plan::Plan;
use super::shard::{self, ShardJob, ShardStop};
use crate::exports::store::lease::{self, Refused};
use crate::exports::store::plan::{PlannedShard, Progress, ShardLease};
use crate::exports::{ExportJob, ShardRecord, shard_name};
use crate::storage::ObjectKey;

pub(super) struct ShardTask<'a> {
    pub deps: &'a WorkerDeps,
    pub worker_id: &'a str,
    pub job: &'a ExportJob,
    pub plan: &'a Plan,
    pub shard: PlannedShard,
    /// Rows the export may still add (incremental exports; a full export's plan counted them).
    pub rows_allowed: u64,
    /// A checkpoint the new file must reproduce exactly (rewriting a missing or corrupt file).
    pub expect: Option<&'a ShardRecord>,
    /// Give up (`Throttled`) instead of waiting when the tenant's scan budget is spent.
    pub may_defer: bool,
}

pub(super) enum Written {
    Recorded {
        checkpoint: ShardRecord,
        progress: Progress,
    },
    /// An incremental export's shard found no rows: the previous shard was the last.
    Empty,
    /// A lease is gone or the job is no longer RUNNING; nothing was recorded.
    Stopped,
    Throttled(Duration),
    TooManyRows,
    /// The rows differ from the plan or from the checkpoint being rewritten.
    Mismatch(String),
    Refused(Refused),
}

/// Where an attempt writes a shard: its own directory per shard and attempt, so a stale writer
/// never overwrites a newer attempt's file (see the orphan sweep).
pub(super) fn object_key(job: &ExportJob, shard: &PlannedShard, extension: &str) -> ObjectKey {
    let index = shard.shard_index;
    let name = shard_name(index as u32, extension);
    ObjectKey::parse(&format!("{}/{}/s{index}-a{}/{name}", job.tenant, job.id, shard.writer_attempt))
        .expect("built from validated parts")
}

impl<'a> ShardTask<'a> {
    /// A new shard of `job`: no row limit beyond the plan's, nothing to reproduce, may defer.
    pub(super) fn new(
        deps: &'a WorkerDeps,
        worker_id: &'a str,
        job: &'a ExportJob,
        plan: &'a Plan,
        shard: PlannedShard,
    ) -> Self {
        ShardTask { deps, worker_id, job, plan, shard, rows_allowed: u64::MAX, expect: None, may_defer: true }
    }

    pub(super) fn lease(&self) -> ShardLease {
        self.shard.lease(self.job.id)
    }

    pub(super) async fn run(self, heartbeat: &Heartbeat) -> anyhow::Result<Written> {
        let index = self.shard.shard_index;
        let deps = self.deps;
        let object_key = object_key(self.job, &self.shard, self.plan.shard_spec.format.extension());
        let reader = self.plan.reader(deps).await;
        let spool = match self.plan.spooled() {
            None => None,
            Some(hasher) => {
                let keep_going = || heartbeat.keep_going();
                match deps.spools.get(self.job.id, reader, &self.plan.as_of(), hasher, keep_going).await? {
                    Some(spool) => Some(spool),
                    None => return Ok(Written::Stopped),
                }
            }
        };
        let job = ShardJob {
            store: &deps.store,
            source: self.plan.source(),
            spec: &self.plan.shard_spec,
            after: self.shard.after_key.clone(),
            shard_rows: self.shard.rows.map_or(self.plan.shard_rows, |rows| rows.max(0) as u64),
            page_rows: u64::from(deps.config.page_rows),
            rows_allowed: self.rows_allowed,
            is_first: index == 0,
            object_key,
            scan: &deps.scan,
            tenant: &self.job.tenant,
            may_defer: self.may_defer,
            spool,
        };
        let written = match shard::write_shard(reader, job, || heartbeat.keep_going()).await? {
            Ok(written) => written,
            Err(ShardStop::NoRows) => return Ok(Written::Empty),
            Err(ShardStop::TooManyRows) => return Ok(Written::TooManyRows),
            Err(ShardStop::Interrupted) => return Ok(Written::Stopped),
            Err(ShardStop::Throttled(wait)) => return Ok(Written::Throttled(wait)),
        };
        let digest = &written.digest;
        let checkpoint = ShardRecord {
            shard_index: index,
            first_key: written.first_key,
            last_key: written.last_key,
            rows: digest.rows as i64,
            bytes: digest.bytes as i64,
            sha256: digest.sha256.clone(),
            object_key: written.object_key.as_str().to_owned(),
            head_bytes: digest.head.compressed_len as i64,
            head_crc32: i64::from(digest.head.crc32),
            head_raw_bytes: digest.head.raw_len as i64,
            body_bytes: digest.body.compressed_len as i64,
            body_crc32: i64::from(digest.body.crc32),
            body_raw_bytes: digest.body.raw_len as i64,
            stats: digest.stats.clone().map(sqlx::types::Json),
        };
        if let Some(problem) = self.differs(&checkpoint) {
            deps.store.delete(&written.object_key).await?;
            return Ok(Written::Mismatch(problem));
        }
        let limit = deps.registry.get(&self.job.tenant).map_or(0, |t| t.quota.storage_bytes);
        match lease::record_shard(&deps.pool, self.lease(), self.worker_id, &self.job.tenant, limit, &checkpoint)
            .await?
        {
            Ok(progress) => {
                tracing::info!(export = %self.job.id, shard = index, attempt = self.shard.writer_attempt, worker = self.worker_id, "wrote shard");
                Ok(Written::Recorded { checkpoint, progress })
            }
            Err(refused) => {
                deps.store.delete(&written.object_key).await?;
                Ok(Written::Refused(refused))
            }
        }
    }

    /// Under a fixed snapshot the same shard always has the same rows and bytes.
    fn differs(&self, written: &ShardRecord) -> Option<String> {
        let index = self.shard.shard_index;
        if let Some(rows) = self.shard.rows
            && (written.rows != rows || written.last_key != self.shard.last_key)
        {
            return Some(format!("shard {index} differs from its plan ({} rows, {rows} planned)", written.rows));
        }
        let expected = self.expect?;
        let same = written.sha256 == expected.sha256
            && written.rows == expected.rows
            && written.first_key == expected.first_key
            && written.last_key == expected.last_key;
        (!same).then(|| format!("shard {index} came out different on rerun"))
    }
}
