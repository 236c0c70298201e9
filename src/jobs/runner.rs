//! Running one claimed export, one observable step at a time: verify the shards an earlier
//! attempt checkpointed, write the remaining shards, publish. Every write is fenced.

use std::sync::Mutex;
use std::time::Instant;

use anyhow::Context;

use super::WorkerDeps;
use super::fenced::{self, Lease, LeaseLost, Publication, Refused};
use super::plan::{Heartbeat, Plan};
use super::shard::{self, ShardJob, ShardStop};
use crate::exports::{
    self, ExportJob, ExportState, Layout, Manifest, ManifestFile, ManifestShard, ShardRecord, shard_name,
};
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
}

impl Step {
    pub fn is_final(&self) -> bool {
        !matches!(
            self,
            Step::ShardVerified { .. }
                | Step::ShardRewritten { .. }
                | Step::ShardWritten { .. }
                | Step::Throttled { .. }
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Verify,
    Write,
    Publish,
}

pub struct ClaimedExport {
    deps: WorkerDeps,
    job: ExportJob,
    lease: Lease,
    plan: Plan,
    /// Checkpoints an earlier attempt left, to verify before going on (none after a clean
    /// hand-back: nothing happened to them since).
    to_verify: Vec<ShardRecord>,
    verified: usize,
    /// Rows checkpointed so far, and the last checkpoint (where the next shard starts): kept
    /// without reloading every checkpoint, so a shard costs the same however many precede it.
    rows_done: u64,
    last: Option<ShardRecord>,
    phase: Phase,
    heartbeat: Heartbeat,
}

impl ClaimedExport {
    /// Claims the next job, if any, with a fresh lease generation.
    pub async fn claim(deps: &WorkerDeps, worker_id: &str) -> anyhow::Result<Option<ClaimedExport>> {
        let limits: Vec<(String, i32)> =
            deps.registry.tenants().map(|t| (t.id.to_string(), t.quota.max_running_exports as i32)).collect();
        let claimed =
            fenced::claim(&deps.pool, worker_id, deps.config.lease_ttl, &limits).await.context("claiming a job")?;
        let Some(fenced::Claimed { job, was_yielded }) = claimed else {
            return Ok(None);
        };
        let lease = Lease { job_id: job.id, generation: job.lease_generation };
        if !was_yielded && job.attempts > 1 && job.state == ExportState::Running {
            metrics::counter!("exportd_lease_takeovers_total").increment(1);
        }
        tracing::info!(export = %job.id, tenant = %job.tenant, generation = lease.generation, attempt = job.attempts, "claimed export");
        let plan = Plan::from_job(&job)?;
        let rows_done = job.rows_done.max(0) as u64;
        // Files of a job given back cleanly between shards need no second look.
        let (to_verify, last) = if was_yielded {
            (Vec::new(), exports::last_shard(&deps.pool, job.id).await?)
        } else {
            let all = exports::shards(&deps.pool, job.id).await?;
            let last = all.last().cloned();
            (all, last)
        };
        let heartbeat = Heartbeat { deps: deps.clone(), lease, last: Mutex::new(Instant::now()) };
        Ok(Some(ClaimedExport {
            deps: deps.clone(),
            job,
            lease,
            plan,
            verified: 0,
            to_verify,
            rows_done,
            last,
            phase: Phase::Start,
            heartbeat,
        }))
    }

    pub fn lease(&self) -> Lease {
        self.lease
    }

    /// Does the next piece of work and says what it was.
    pub async fn step(&mut self) -> anyhow::Result<Step> {
        loop {
            match self.phase {
                Phase::Start => {
                    if self.job.state == ExportState::CancelRequested {
                        return self.finish_cancel().await;
                    }
                    if self.job.stalled_attempts > self.deps.config.max_attempts {
                        let detail = format!(
                            "gave up after {} attempts in a row without a new checkpoint",
                            self.deps.config.max_attempts
                        );
                        return self.fail("attempts-exhausted", &detail).await;
                    }
                    if let Err(reason) = self.authorized() {
                        return self.fail("permission-revoked", &reason).await;
                    }
                    self.phase = Phase::Verify;
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
                    let last_written = self.last.as_ref().is_some_and(|c| (c.rows as u64) < self.plan.shard_rows);
                    if last_written {
                        self.phase = Phase::Publish;
                        continue;
                    }
                    if let Some(stop) = self.renew().await? {
                        return Ok(stop);
                    }
                    return self.write_next_shard().await;
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
                Err(e) if is_unencodable(&e) => {
                    tracing::error!(export = %self.job.id, error = format!("{e:#}"), "a record cannot be encoded");
                    let detail = "a record of the dataset cannot be encoded in the export's format; fix or delete it and create the export again";
                    return self.fail("unencodable-record", detail).await;
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
                }
                other => return other,
            }
        }
    }

    /// Gives the job back so another worker can continue at once (shutdown, or yielding).
    pub async fn release(self) -> anyhow::Result<()> {
        fenced::release(&self.deps.pool, self.lease).await?;
        tracing::info!(export = %self.job.id, "released export lease");
        Ok(())
    }

    /// Gives the job back after a run that cannot go on (an error that outlived its retries):
    /// claimable at once instead of after the lease expires; the next claim verifies the
    /// checkpoints again and counts an attempt, unless the run was `interrupted` by an outage.
    pub async fn give_back(self, interrupted: bool) -> anyhow::Result<()> {
        fenced::give_back(&self.deps.pool, self.lease, interrupted).await?;
        tracing::info!(export = %self.job.id, "gave the export back after an error");
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

    /// The principal must still exist, be enabled, be granted the dataset, and have the row
    /// filter frozen into the job.
    fn authorized(&self) -> Result<(), String> {
        let tenant = self.deps.registry.get(&self.job.tenant).ok_or("the tenant is no longer configured")?;
        let principal = tenant.principal(&self.job.principal).ok_or("the principal no longer exists")?;
        if principal.disabled {
            return Err("the principal is disabled".into());
        }
        if tenant.dataset(&self.job.dataset).is_none() || !principal.is_granted(&self.plan.dataset) {
            return Err("the dataset is no longer granted to the principal".into());
        }
        if principal.row_filter_json() != self.plan.row_filter {
            return Err("the principal's row filter changed".into());
        }
        Ok(())
    }

    fn object_key(&self, index: u32) -> ObjectKey {
        let name = shard_name(index, self.plan.format.extension());
        ObjectKey::parse(&format!("{}/{}/g{}/{name}", self.job.tenant, self.job.id, self.lease.generation))
            .expect("built from validated parts")
    }

    fn shard_job(&self, index: u32, after: Option<String>, rows_allowed: u64) -> ShardJob<'_> {
        ShardJob {
            store: &self.deps.store,
            source: self.plan.source(),
            format: self.plan.format,
            columns: &self.plan.columns,
            after,
            shard_rows: self.plan.shard_rows,
            page_rows: u64::from(self.deps.config.page_rows),
            rows_allowed,
            is_first: index == 0,
            object_key: self.object_key(index),
            scan: &self.deps.scan,
            tenant: &self.job.tenant,
            may_defer: false,
        }
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
        let after = index.checked_sub(1).and_then(|i| self.to_verify[i].last_key.clone());
        let written = shard::write_shard(&self.deps.pool, self.shard_job(index as u32, after, u64::MAX), || {
            self.heartbeat.keep_going()
        })
        .await?;
        let written = match written {
            Ok(written) => written,
            Err(ShardStop::Interrupted) => return self.after_refused_write().await,
            Err(_) => {
                return self.fail("non-deterministic-output", &format!("shard {index} has no rows on rerun")).await;
            }
        };
        let same = written.digest.sha256 == checkpoint.sha256
            && written.digest.rows as i64 == checkpoint.rows
            && written.first_key == checkpoint.first_key
            && written.last_key == checkpoint.last_key;
        if !same {
            self.deps.store.delete(&written.object_key).await?;
            let detail = format!("shard {index} came out different on rerun");
            return self.fail("non-deterministic-output", &detail).await;
        }
        let rewritten = ShardRecord { object_key: written.object_key.as_str().to_owned(), ..checkpoint.clone() };
        if let Err(refused) = self.record(&rewritten).await? {
            self.deps.store.delete(&written.object_key).await?;
            return self.refused(refused).await;
        }
        if checkpoint.object_key != rewritten.object_key {
            self.deps.store.delete(&ObjectKey::parse(&checkpoint.object_key).map_err(anyhow::Error::msg)?).await?;
        }
        if self.last.as_ref().is_some_and(|l| l.shard_index == rewritten.shard_index) {
            self.last = Some(rewritten.clone());
        }
        self.to_verify[index] = rewritten;
        self.verified += 1;
        Ok(Step::ShardRewritten { index: index as u32 })
    }

    async fn write_next_shard(&mut self) -> anyhow::Result<Step> {
        let index = self.last.as_ref().map_or(0, |c| c.shard_index as u32 + 1);
        let max_shards = self.deps.config.max_shards;
        if index >= max_shards {
            let detail = format!(
                "the export would have more than {max_shards} shards; create it again with a larger shard_rows"
            );
            return self.fail("too-many-shards", &detail).await;
        }
        let after = self.last.as_ref().and_then(|c| c.last_key.clone());
        let rows_before = self.rows_done;
        let max_rows = self.deps.registry.get(&self.job.tenant).map_or(0, |t| t.quota.max_rows_per_export);
        let allowed = max_rows.saturating_sub(rows_before);
        // A new shard may wait for the tenant's scan budget elsewhere (Throttled); a rewrite may not.
        let job = ShardJob { may_defer: true, ..self.shard_job(index, after, allowed) };
        let written = shard::write_shard(&self.deps.pool, job, || self.heartbeat.keep_going()).await?;
        let written = match written {
            Ok(written) => written,
            Err(ShardStop::NoRows) => {
                self.phase = Phase::Publish;
                return self.publish().await;
            }
            Err(ShardStop::TooManyRows) => {
                let detail = format!("the export has more than {max_rows} rows, the tenant's max_rows_per_export");
                return self.fail("too-many-rows", &detail).await;
            }
            Err(ShardStop::Interrupted) => return self.after_refused_write().await,
            Err(ShardStop::Throttled(wait)) => return Ok(Step::Throttled { wait }),
        };
        let digest = &written.digest;
        let checkpoint = ShardRecord {
            shard_index: index as i32,
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
        };
        if let Err(refused) = self.record(&checkpoint).await? {
            self.deps.store.delete(&written.object_key).await?;
            return self.refused(refused).await;
        }
        let rows = checkpoint.rows as u64;
        let last = rows < self.plan.shard_rows;
        self.rows_done += rows;
        self.last = Some(checkpoint);
        if last {
            self.phase = Phase::Publish;
        }
        Ok(Step::ShardWritten { index, rows, last })
    }

    async fn publish(&mut self) -> anyhow::Result<Step> {
        if let Err(reason) = self.authorized() {
            return self.fail("permission-revoked", &reason).await;
        }
        let checkpoints = exports::shards(&self.deps.pool, self.job.id).await?;
        let layout = Layout::whole_file(&checkpoints);
        let file_sha256 = layout.sha256(&self.deps.store).await?;
        let next_cursor = self.plan.next_cursor(&self.deps, &self.job).await?;
        let manifest = self.manifest(
            &checkpoints,
            next_cursor,
            ManifestFile {
                name: format!("{}.{}", self.job.dataset, self.plan.format.extension()),
                bytes: layout.len(),
                sha256: file_sha256,
            },
        );
        let bytes = manifest.to_bytes();
        let artifact_hours = self.deps.registry.get(&self.job.tenant).map_or(0, |t| t.retention.artifact_hours);
        let publication = Publication {
            manifest: &bytes,
            manifest_sha256: &sha256_hex(&bytes),
            shards: checkpoints.len() as i32,
            rows: manifest.total_rows as i64,
            bytes: manifest.total_bytes as i64,
            file_bytes: manifest.file.bytes as i64,
            file_sha256: &manifest.file.sha256,
            artifact_hours,
            // An incremental export advances the principal's stored cursor as it succeeds.
            stored_cursor: self.plan.chain.as_ref().and(manifest.next_cursor.as_deref()),
        };
        match fenced::publish(&self.deps.pool, self.lease, &publication).await? {
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

    fn manifest(&self, checkpoints: &[ShardRecord], next_cursor: String, file: ManifestFile) -> Manifest {
        let shards: Vec<ManifestShard> = checkpoints
            .iter()
            .map(|c| ManifestShard {
                index: c.shard_index as u32,
                name: shard_name(c.shard_index as u32, self.plan.format.extension()),
                rows: c.rows as u64,
                bytes: c.bytes as u64,
                sha256: c.sha256.clone(),
                first_key: c.first_key.clone(),
                last_key: c.last_key.clone(),
            })
            .collect();
        Manifest {
            manifest_version: crate::exports::MANIFEST_VERSION,
            export_id: self.job.id.to_string(),
            dataset: self.job.dataset.clone(),
            mode: self.job.mode.clone(),
            format: self.job.format.clone(),
            compression: "gzip",
            columns: self.plan.columns.clone(),
            filter: self.plan.filter.clone(),
            row_filter: self.plan.row_filter.clone(),
            snapshot_watermark: self.plan.watermark.to_string(),
            created_at: self.job.created_at.format(&time::format_description::well_known::Rfc3339).expect("formats"),
            from_cursor: self.job.from_cursor.clone(),
            next_cursor: Some(next_cursor),
            total_rows: shards.iter().map(|s| s.rows).sum(),
            total_bytes: shards.iter().map(|s| s.bytes).sum(),
            file,
            shards,
        }
    }

    async fn record(&self, shard: &ShardRecord) -> anyhow::Result<Result<(), Refused>> {
        let limit = self.deps.registry.get(&self.job.tenant).map_or(0, |t| t.quota.storage_bytes);
        Ok(fenced::record_shard(&self.deps.pool, self.lease, &self.job.tenant, limit, shard).await?)
    }

    async fn refused(&mut self, refused: Refused) -> anyhow::Result<Step> {
        match refused {
            Refused::LeaseLost => self.after_refused_write().await,
            Refused::StorageQuota { stored, limit } => {
                metrics::counter!("exportd_quota_rejections_total", "kind" => "storage").increment(1);
                let detail = format!(
                    "the tenant's stored export files would reach {stored} bytes (quota storage_bytes = {limit})"
                );
                self.fail("storage-quota-exceeded", &detail).await
            }
        }
    }

    /// A fenced write matched nothing: a cancel request (still our generation), a takeover, or
    /// our own terminal write whose reply was lost with the connection (a retried step).
    async fn after_refused_write(&mut self) -> anyhow::Result<Step> {
        let (state, generation, error_code) = fenced::current(&self.deps.pool, self.job.id).await?;
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
        match fenced::finish(&self.deps.pool, self.lease, ExportState::CancelRequested, ExportState::Cancelled, None)
            .await?
        {
            Ok(()) => {
                self.delete_files("cancelled").await?;
                tracing::info!(export = %self.job.id, "cancelled export");
                Ok(Step::Cancelled)
            }
            Err(LeaseLost) => Ok(Step::LeaseLost),
        }
    }

    async fn fail(&mut self, code: &str, detail: &str) -> anyhow::Result<Step> {
        match fenced::finish(
            &self.deps.pool,
            self.lease,
            ExportState::Running,
            ExportState::Failed,
            Some((code, detail)),
        )
        .await?
        {
            Ok(()) => {
                self.delete_files("failed").await?;
                tracing::warn!(export = %self.job.id, code, "export failed");
                Ok(Step::Failed { code: code.to_owned() })
            }
            Err(LeaseLost) => self.after_refused_write().await,
        }
    }

    /// Only after the job's terminal state is committed under our lease: no newer attempt exists.
    async fn delete_files(&self, reason: &str) -> anyhow::Result<()> {
        crate::storage::lifecycle::delete_export_files(
            &self.deps.pool,
            &self.deps.store,
            &self.job.tenant,
            self.job.id,
            reason,
        )
        .await
        .context("deleting export files")?;
        Ok(())
    }
}

/// A record's stored JSON that the shard encoder refuses (serde_json reports it as
/// `InvalidData`), as opposed to a failing disk or connection.
fn is_unencodable(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData)
    })
}
