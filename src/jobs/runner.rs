//! Running one claimed export as the holder of its lease, one observable step at a time: plan
//! the shards, verify the shards an earlier attempt checkpointed, write the shards nobody else
//! is writing, publish. Every write is fenced.

use anyhow::Context;

use super::WorkerDeps;
use super::ending::{self, authorized};
use super::heartbeat::Heartbeat;
use super::plan::{self, Plan};
use super::planner::{self, Appended};
use super::publication::Consequences;
use super::shard_task::{ShardTask, Written};
use crate::exports::store::lease::{self, Fence, Lease, LeaseLost, Publication, Refused};
use crate::exports::store::plan::{self as shard_plan, NewShard, PlannedShard};
use crate::exports::{
    self, ExportJob, ExportState, Layout, Manifest, ManifestFile, ManifestShard, ShardRecord, shard_name,
};
use crate::masking::ColumnPolicy;
use crate::storage::ObjectKey;
use crate::writers::sha256_hex;

/// What one step did. Steps after which the run is over are "final".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A shard an earlier attempt wrote still matches its checkpoint.
    ShardVerified {
        index: u32,
    },
    /// A checkpointed shard was missing or corrupt and was written again, identically.
    ShardRewritten {
        index: u32,
    },
    ShardWritten {
        index: u32,
        rows: u64,
        last: bool,
    },
    Published,
    Cancelled,
    Failed {
        code: String,
    },
    /// Another worker owns the job now; this one stopped without writing anything more.
    LeaseLost,
    /// Given back on shutdown; another worker continues from the last checkpoint.
    Released,
    /// Given back after a shard so other tenants' work can interleave; claimable at once.
    Yielded,
    /// The tenant is over its scan rate: nothing written; the job is given back meanwhile.
    Throttled {
        wait: std::time::Duration,
    },
    /// Every shard left is being written by other workers: the job is given back, and becomes
    /// claimable again when they finish (or vanish).
    Waiting,
}

impl Step {
    pub fn is_final(&self) -> bool {
        !matches!(
            self,
            Step::ShardVerified { .. }
                | Step::ShardRewritten { .. }
                | Step::ShardWritten { .. }
                | Step::Throttled { .. }
                | Step::Waiting
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Plan,
    Verify,
    Write,
    Publish,
}

pub struct ClaimedExport {
    deps: WorkerDeps,
    worker_id: String,
    job: ExportJob,
    lease: Lease,
    plan: Plan,
    /// Checkpoints an earlier attempt left, to verify before going on (none after a clean
    /// hand-back: nothing happened to them since).
    to_verify: Vec<ShardRecord>,
    verified: usize,
    /// Rows checkpointed so far (incremental exports check `max_rows_per_export` as they go).
    rows_done: u64,
    phase: Phase,
    heartbeat: Heartbeat,
}

/// What a planning step left to do.
enum Planning {
    /// Go on writing.
    Write,
    /// Nothing was planned: the last planned shard is free, so writing takes it.
    FrontierFree,
    Stop(Step),
}

impl ClaimedExport {
    /// Claims the next job, if any, with a fresh lease generation.
    pub async fn claim(deps: &WorkerDeps, worker_id: &str) -> anyhow::Result<Option<ClaimedExport>> {
        let limits: Vec<(String, i32)> =
            deps.registry.tenants().map(|t| (t.id.to_string(), t.quota.max_running_exports as i32)).collect();
        let resting = deps.scan.resting().tenants;
        let claimed =
            lease::claim(&deps.pool, worker_id, deps.config.lease_ttl, deps.config.stall_backoff(), &limits, &resting)
                .await
                .context("claiming a job")?;
        let Some(lease::Claimed { job, was_yielded }) = claimed else {
            return Ok(None);
        };
        let lease = Lease { job_id: job.id, generation: job.lease_generation };
        if !was_yielded && job.attempts > 1 && job.state == ExportState::Running {
            metrics::counter!("exportd_lease_takeovers_total").increment(1);
        }
        tracing::info!(export = %job.id, tenant = %job.tenant, generation = lease.generation, attempt = job.attempts, "claimed export");
        let plan = Plan::from_job(deps, &job)?;
        // Files of a job given back cleanly between shards need no second look.
        let to_verify = if was_yielded { Vec::new() } else { exports::store::shards::all(&deps.pool, job.id).await? };
        Ok(Some(ClaimedExport {
            deps: deps.clone(),
            worker_id: worker_id.to_owned(),
            rows_done: job.rows_done.max(0) as u64,
            job,
            lease,
            plan,
            verified: 0,
            to_verify,
            phase: Phase::Start,
            heartbeat: Heartbeat::new(deps, Some(lease)),
        }))
    }

    pub fn lease(&self) -> Lease {
        self.lease
    }

    /// The span every log line of this run is recorded in: export and tenant, so one export
    /// can be followed through the logs of any process.
    pub fn span(&self) -> tracing::Span {
        tracing::info_span!("export", export = %self.job.id, tenant = %self.job.tenant)
    }

    /// Does the next piece of work and says what it was.
    pub async fn step(&mut self) -> anyhow::Result<Step> {
        let mut frontier_free = false;
        loop {
            match self.phase {
                Phase::Start => {
                    if self.job.state == ExportState::CancelRequested {
                        return self.finish_cancel().await;
                    }
                    if self.deps.config.exhausted(self.job.stalled_attempts, self.job.stalled_since) {
                        let detail = format!(
                            "gave up after {} attempts in a row without a new checkpoint, over {}",
                            self.job.stalled_attempts - 1,
                            crate::jobs::since(self.job.stalled_since),
                        );
                        return self.fail("attempts-exhausted", &detail).await;
                    }
                    if let Err(reason) = authorized(&self.deps, &self.job, &self.plan) {
                        return self.fail("permission-revoked", &reason).await;
                    }
                    self.phase = Phase::Plan;
                }
                Phase::Plan => {
                    match self.extend_plan().await? {
                        Planning::Stop(stop) => return Ok(stop),
                        Planning::FrontierFree => frontier_free = true,
                        Planning::Write => {}
                    }
                    self.phase = if self.verified < self.to_verify.len() { Phase::Verify } else { Phase::Write };
                }
                Phase::Verify => {
                    if let Some(stop) = self.renew().await? {
                        return Ok(stop);
                    }
                    if self.verified < self.to_verify.len() {
                        return self.verify_shard(self.verified).await;
                    }
                    self.phase = Phase::Write;
                }
                Phase::Write => {
                    if let Some(stop) = self.renew().await? {
                        return Ok(stop);
                    }
                    let taken = shard_plan::take(
                        &self.deps.pool,
                        self.lease,
                        None,
                        &self.worker_id,
                        self.deps.config.lease_ttl,
                    )
                    .await?;
                    if let Some(shard) = taken {
                        return self.write_shard(shard).await;
                    }
                    let progress = shard_plan::progress(&self.deps.pool, self.job.id).await?;
                    if progress.all_written() {
                        self.phase = Phase::Publish;
                    } else if !progress.plan_complete && !frontier_free {
                        self.phase = Phase::Plan;
                    } else {
                        // Everything planned is being written by others (or just taken).
                        return Ok(Step::Waiting);
                    }
                }
                // No heartbeat here: publish's own conditional update is the check, so a cancel
                // that lands after the last shard is still seen.
                Phase::Publish => return self.publish().await,
            }
        }
    }

    /// [`step`](Self::step), retrying a transient error (database connection lost, failover,
    /// deadlock victim; object store unreachable) in place with backoff while the lease is safely ours. Every step may be
    /// repeated: its writes are fenced, idempotent checkpoints, and a shard is rewritten whole.
    pub async fn step_with_retries(&mut self) -> anyhow::Result<Step> {
        let mut delays = crate::db::retry_delays();
        loop {
            match self.step().await {
                // The same rows would fail the same way on every attempt: fail now, clearly.
                Err(e) if ending::is_unencodable(&e) => {
                    let (code, detail) = ending::unencodable(&self.job, &e);
                    return self.fail(code, &detail).await;
                }
                Err(e) if crate::db::is_transient_chain(&e) => {
                    let delay = delays.next().unwrap_or(self.deps.config.lease_ttl);
                    // Keep a sixth of the lease as margin: the retried step renews it first.
                    if self.heartbeat.remaining() <= delay + self.deps.config.lease_ttl / 6 {
                        return Err(e);
                    }
                    metrics::counter!("exportd_transient_retries_total", "where" => "worker").increment(1);
                    tracing::warn!(export = %self.job.id, error = format!("{e:#}"), retry_in_ms = delay.as_millis() as u64, "transient database or storage error; retrying the step");
                    tokio::time::sleep(delay).await;
                    // The shard being written starts over; if it cannot be given back now, its
                    // lease expiring frees it.
                    let _ = self.release_shard().await;
                }
                other => {
                    if other.as_ref().is_ok_and(Step::is_final) {
                        self.deps.spools.forget(self.job.id);
                    }
                    return other;
                }
            }
        }
    }

    /// Gives the job back so another worker can continue at once (shutdown, or yielding).
    pub async fn release(self) -> anyhow::Result<()> {
        self.release_shard().await?;
        lease::release(&self.deps.pool, self.lease).await?;
        tracing::info!(export = %self.job.id, "released export lease");
        Ok(())
    }

    /// Gives the job back after a run that cannot go on (an error that outlived its retries):
    /// claimable at once instead of after the lease expires; the next claim verifies the
    /// checkpoints again and counts an attempt, unless the run was `interrupted` by an outage.
    pub async fn give_back(self, interrupted: bool) -> anyhow::Result<()> {
        self.release_shard().await?;
        lease::give_back(&self.deps.pool, self.lease, interrupted).await?;
        tracing::info!(export = %self.job.id, "gave the export back after an error");
        Ok(())
    }

    /// The shard this run was writing when it stopped, if any, goes back to be taken at once.
    async fn release_shard(&self) -> anyhow::Result<()> {
        if let Some(shard) = self.heartbeat.shard() {
            shard_plan::release(&self.deps.pool, shard).await?;
            self.heartbeat.writing(None);
        }
        Ok(())
    }

    /// Renews the lease; a cancel request or a lost lease ends the run here.
    async fn renew(&mut self) -> anyhow::Result<Option<Step>> {
        match self.heartbeat.beat().await? {
            Ok(ExportState::Running) => Ok(None),
            Ok(ExportState::CancelRequested) => Ok(Some(self.finish_cancel().await?)),
            _ => Ok(Some(self.after_refused_write().await?)),
        }
    }

    /// Plans the next shard, if one is needed: a full export's open-ended after the last
    /// planned one (see [`planner`]); an incremental export's where the last one ended, once
    /// every planned one is written.
    async fn extend_plan(&mut self) -> anyhow::Result<Planning> {
        let progress = shard_plan::progress(&self.deps.pool, self.job.id).await?;
        if progress.plan_complete {
            return Ok(Planning::Write);
        }
        if self.plan.chain.is_some() {
            if progress.planned_shards > progress.shards_done {
                return Ok(Planning::Write);
            }
            let last = exports::store::shards::last(&self.deps.pool, self.job.id).await?;
            let complete = last.as_ref().is_some_and(|c| (c.rows as u64) < self.plan.shard_rows);
            let next = NewShard {
                index: last.as_ref().map_or(0, |c| c.shard_index + 1),
                after_key: last.as_ref().and_then(|c| c.last_key.as_deref()),
                last_key: None,
                rows: None,
            };
            let shard = (!complete).then_some(&next);
            let holder = shard_plan::Planner::Holder(self.lease);
            return match shard_plan::extend(&self.deps.pool, holder, None, shard, complete).await? {
                Ok(()) => Ok(Planning::Write),
                Err(LeaseLost) => Ok(Planning::Stop(self.after_refused_write().await?)),
            };
        }
        if let Some(stop) = self.renew().await? {
            return Ok(Planning::Stop(stop));
        }
        Ok(match planner::append(&self.deps, &self.job, &self.plan, self.lease).await? {
            Appended::Grown => Planning::Write,
            Appended::FrontierFree => Planning::FrontierFree,
            Appended::Failed { code, detail } => Planning::Stop(self.fail(code, &detail).await?),
            Appended::LeaseLost => Planning::Stop(self.after_refused_write().await?),
        })
    }

    /// Counts and plans every shard of a full export left to plan, now, as helpers do one at a
    /// time. For tests and diagnostics: a run plans no further than it writes.
    pub async fn plan_ahead(&self) -> anyhow::Result<()> {
        while planner::count_ahead(&self.deps, &self.job).await? {}
        Ok(())
    }

    async fn verify_shard(&mut self, index: usize) -> anyhow::Result<Step> {
        let checkpoint = self.to_verify[index].clone();
        let key = ObjectKey::parse(&checkpoint.object_key).map_err(anyhow::Error::msg)?;
        let found = self.deps.store.digest(&key).await?;
        if found == Some((checkpoint.bytes as u64, checkpoint.sha256.clone())) {
            self.verified += 1;
            return Ok(Step::ShardVerified { index: index as u32 });
        }
        tracing::warn!(export = %self.job.id, shard = index, "checkpointed shard file is missing or corrupt; rewriting it");
        let shard_index = checkpoint.shard_index;
        let taken = shard_plan::take(
            &self.deps.pool,
            self.lease,
            Some(shard_index),
            &self.worker_id,
            self.deps.config.lease_ttl,
        )
        .await?;
        let Some(shard) = taken else {
            return self.after_refused_write().await;
        };
        let task = ShardTask { expect: Some(&checkpoint), may_defer: false, ..self.task(shard) };
        self.heartbeat.writing(Some(task.lease()));
        let written = task.run(&self.heartbeat).await?;
        match written {
            Written::Recorded { checkpoint: rewritten, .. } => {
                self.heartbeat.writing(None);
                if checkpoint.object_key != rewritten.object_key {
                    self.deps.store.delete(&key).await?;
                }
                self.to_verify[index] = rewritten;
                self.verified += 1;
                Ok(Step::ShardRewritten { index: index as u32 })
            }
            other => self.not_written(shard_index, other).await,
        }
    }

    fn task(&self, shard: PlannedShard) -> ShardTask<'_> {
        ShardTask::new(&self.deps, &self.worker_id, &self.job, &self.plan, shard)
    }

    async fn write_shard(&mut self, shard: PlannedShard) -> anyhow::Result<Step> {
        if self.deps.config.exhausted(shard.takeovers, shard.first_takeover_at) {
            let detail = format!(
                "gave up after the writers of shard {} vanished {} times, over {}",
                shard.shard_index,
                shard.takeovers,
                crate::jobs::since(shard.first_takeover_at)
            );
            return self.fail("attempts-exhausted", &detail).await;
        }
        let max_rows = self.deps.registry.get(&self.job.tenant).map_or(0, |t| t.quota.max_rows_per_export);
        let index = shard.shard_index;
        let planned_rows = shard.rows;
        // Every shard of a full export before this one holds `shard_rows` rows.
        let rows_before =
            if self.plan.chain.is_some() { self.rows_done } else { index.max(0) as u64 * self.plan.shard_rows };
        // A new shard may wait for the tenant's scan budget elsewhere (Throttled); a rewrite may not.
        let task = ShardTask { rows_allowed: max_rows.saturating_sub(rows_before), ..self.task(shard) };
        self.heartbeat.writing(Some(task.lease()));
        match task.run(&self.heartbeat).await? {
            Written::Recorded { checkpoint, progress } => {
                self.heartbeat.writing(None);
                let rows = checkpoint.rows as u64;
                self.rows_done += rows;
                // An open-ended shard that is not full is the last: the plan is complete then.
                let last = progress.all_written() || (planned_rows.is_none() && rows < self.plan.shard_rows);
                if progress.all_written() && self.plan.chain.is_none() {
                    self.phase = Phase::Publish;
                } else if last {
                    self.phase = Phase::Plan;
                }
                Ok(Step::ShardWritten { index: index as u32, rows, last })
            }
            Written::Empty => {
                self.heartbeat.writing(None);
                if let Err(LeaseLost) = shard_plan::drop_empty(&self.deps.pool, self.lease, index).await? {
                    return self.after_refused_write().await;
                }
                if !shard_plan::progress(&self.deps.pool, self.job.id).await?.all_written() {
                    return Ok(Step::Waiting); // helpers are still writing earlier shards
                }
                self.phase = Phase::Publish;
                self.publish().await
            }
            other => self.not_written(index, other).await,
        }
    }

    /// A shard that was not recorded: why, as a step.
    async fn not_written(&mut self, index: i32, written: Written) -> anyhow::Result<Step> {
        match written {
            Written::Recorded { .. } | Written::Empty => unreachable!("handled by the caller"),
            Written::Stopped => {
                self.release_shard().await?;
                self.after_refused_write().await
            }
            Written::Throttled(wait) => {
                self.release_shard().await?;
                Ok(Step::Throttled { wait })
            }
            Written::TooManyRows => {
                let max_rows = self.deps.registry.get(&self.job.tenant).map_or(0, |t| t.quota.max_rows_per_export);
                let detail = format!("the export has more than {max_rows} rows, the tenant's max_rows_per_export");
                self.fail("too-many-rows", &detail).await
            }
            Written::Mismatch(detail) => {
                tracing::error!(export = %self.job.id, shard = index, "a shard came out different from its plan or checkpoint");
                self.fail("non-deterministic-output", &detail).await
            }
            Written::Refused(refused) => self.refused(refused).await,
        }
    }

    async fn publish(&mut self) -> anyhow::Result<Step> {
        if let Err(reason) = authorized(&self.deps, &self.job, &self.plan) {
            return self.fail("permission-revoked", &reason).await;
        }
        let checkpoints = exports::store::shards::all(&self.deps.pool, self.job.id).await?;
        let format = self.plan.shard_spec.format;
        let file = if format.spec().spliceable() {
            let layout = Layout::whole_file(&checkpoints);
            Some(ManifestFile {
                name: format!("{}.{}", self.job.dataset, format.extension()),
                bytes: layout.len(),
                sha256: layout.sha256(&self.deps.store).await?,
            })
        } else {
            None
        };
        let next_cursor = self.plan.next_cursor(&self.deps, &self.job).await?;
        let manifest = self.manifest(&checkpoints, next_cursor, file)?;
        let changes = super::change_file::write(&self.deps, &self.job, &self.plan).await?;
        if changes.is_some()
            && let Some(stop) = self.renew().await?
        {
            return Ok(stop);
        }
        let bytes = manifest.to_bytes();
        let artifact_hours = self.deps.registry.get(&self.job.tenant).map_or(0, |t| t.retention.artifact_hours);
        let publication = Publication {
            manifest: &bytes,
            manifest_sha256: &sha256_hex(&bytes),
            shards: checkpoints.len() as i32,
            rows: manifest.total_rows as i64,
            bytes: manifest.total_bytes as i64,
            file_bytes: manifest.file.as_ref().map(|f| f.bytes as i64),
            file_sha256: manifest.file.as_ref().map(|f| f.sha256.as_str()),
            artifact_hours,
        };
        let then = Consequences {
            // An incremental export advances the principal's stored cursor as it succeeds.
            stored_cursor: self.plan.chain.as_ref().and(manifest.next_cursor.as_deref()),
            next_cursor: manifest.next_cursor.as_deref(),
            changes: changes.as_ref(),
        };
        match super::publication::publish(&self.deps.pool, self.lease, &publication, &then).await? {
            Ok(()) => {
                let started = self.job.started_at.unwrap_or(self.job.created_at);
                let seconds = (time::OffsetDateTime::now_utc() - started).as_seconds_f64().max(0.0);
                metrics::histogram!("exportd_export_duration_seconds", "tenant" => self.job.tenant.clone())
                    .record(seconds);
                tracing::info!(export = %self.job.id, rows = manifest.total_rows, shards = checkpoints.len(), "published export");
                Ok(Step::Published)
            }
            Err(LeaseLost) => self.after_refused_write().await,
        }
    }

    fn manifest(
        &self,
        checkpoints: &[ShardRecord],
        next_cursor: String,
        file: Option<ManifestFile>,
    ) -> anyhow::Result<Manifest> {
        let spec = &self.plan.shard_spec;
        let policy = plan::column_policy(&self.deps, &self.job);
        // Checkpoints hold positions: hashed keys when rows come in hashed order, else real keys,
        // which a partner with hashed keys (of a job planned before hashed order) sees hashed.
        let hashes = policy.filter(|_| !self.job.hashed_key_order);
        let shown = |key: &Option<String>| key.as_deref().map(|k| hashes.map_or(k.into(), |p| p.key(k)).into_owned());
        let shards: Vec<ManifestShard> = checkpoints
            .iter()
            .map(|c| ManifestShard {
                index: c.shard_index as u32,
                name: shard_name(c.shard_index as u32, spec.format.extension()),
                rows: c.rows as u64,
                bytes: c.bytes as u64,
                sha256: c.sha256.clone(),
                first_key: shown(&c.first_key),
                last_key: shown(&c.last_key),
                stats: c.stats.clone().map(|stats| stats.0),
            })
            .collect();
        Ok(Manifest {
            manifest_version: crate::exports::MANIFEST_VERSION,
            export_id: self.job.id.to_string(),
            dataset: self.job.dataset.clone(),
            mode: self.job.mode,
            format: self.job.format,
            compression: spec.format.spec().compression,
            schema: self.job.schema_stamp(),
            columns: spec.columns.clone(),
            file_schema: spec.format.spec().file_schema(&spec.columns)?,
            filter: self.plan.filter.clone(),
            row_filter: self.plan.row_filter.clone(),
            column_policy: policy.map(ColumnPolicy::summary),
            snapshot_watermark: self.plan.shows_watermark.then(|| self.plan.watermark.to_string()),
            created_at: self.job.created_at.format(&time::format_description::well_known::Rfc3339).expect("formats"),
            from_cursor: self.job.from_cursor.clone(),
            next_cursor: Some(next_cursor),
            total_rows: shards.iter().map(|s| s.rows).sum(),
            total_bytes: shards.iter().map(|s| s.bytes).sum(),
            file,
            shards,
        })
    }

    async fn refused(&mut self, refused: Refused) -> anyhow::Result<Step> {
        match ending::refusal(&self.deps, &self.job, refused).await {
            None => self.after_refused_write().await,
            Some((code, detail)) => self.fail(code, &detail).await,
        }
    }

    /// A fenced write matched nothing: a cancel request (still our generation), a takeover, or
    /// our own terminal write whose reply was lost with the connection (a retried step).
    async fn after_refused_write(&mut self) -> anyhow::Result<Step> {
        let (state, generation, error_code) = lease::current(&self.deps.pool, self.job.id).await?;
        if generation == self.lease.generation {
            match state {
                ExportState::CancelRequested => return self.finish_cancel().await,
                ExportState::Succeeded => return Ok(Step::Published),
                ExportState::Cancelled => return Ok(Step::Cancelled),
                ExportState::Failed => return Ok(Step::Failed { code: error_code.unwrap_or_default() }),
                _ => {}
            }
        }
        tracing::info!(export = %self.job.id, generation = self.lease.generation, "lease lost; stopping");
        Ok(Step::LeaseLost)
    }

    async fn finish_cancel(&mut self) -> anyhow::Result<Step> {
        let fence = Fence::Job(self.lease);
        match lease::finish(&self.deps.pool, fence, ExportState::CancelRequested, ExportState::Cancelled, None).await? {
            Ok(()) => {
                ending::delete_files(&self.deps, &self.job, "cancelled").await?;
                tracing::info!(export = %self.job.id, "cancelled export");
                Ok(Step::Cancelled)
            }
            Err(LeaseLost) => Ok(Step::LeaseLost),
        }
    }

    async fn fail(&mut self, code: &str, detail: &str) -> anyhow::Result<Step> {
        match ending::fail(&self.deps, &self.job, Fence::Job(self.lease), code, detail).await? {
            Ok(()) => Ok(Step::Failed { code: code.to_owned() }),
            Err(LeaseLost) => self.after_refused_write().await,
        }
    }
}
