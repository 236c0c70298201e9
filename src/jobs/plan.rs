//! What a claimed job reads: its frozen plan (where rows come from, what the manifest's cursor
//! is), parsed once.

use anyhow::Context;
use serde_json::Value;

use super::WorkerDeps;
use super::source::Source;
use crate::exports::{ExportJob, FileFacts, shard_spec};
use crate::feeds::{self, Cursor, CursorOwner, Feed, Seal};
use crate::history::HistoryPoint;
use crate::masking::{ColumnHasher, ColumnPolicy};
use crate::records::{AsOf, KeyOrder, Snapshot};
use crate::tenants::{DatasetName, TenantId};
use crate::writers::{OutputColumn, ShardSpec};

/// The job as the worker reads it, parsed once from the frozen request.
pub(super) struct Plan {
    pub(super) tenant: TenantId,
    pub(super) dataset: DatasetName,
    /// Format, codec, columns and file metadata of every shard, fixed when the job was created.
    pub(super) shard_spec: ShardSpec,
    pub(super) filter: Value,
    pub(super) row_filter: Value,
    pub(super) watermark: Snapshot,
    /// Where in the database's history the watermark was taken.
    pub(super) watermark_point: HistoryPoint,
    pub(super) shard_rows: u64,
    /// The manifest and file metadata show the snapshot (an admin's export).
    pub(super) shows_watermark: bool,
    /// Incremental exports: where the window chain starts and the tick it runs to.
    pub(super) chain: Option<Chain>,
    /// Rows come in the order of the partner's hashed keys (see [`KeyOrder`]).
    pub(super) hashed_order: Option<ColumnHasher>,
}

pub(super) struct Chain {
    pub(super) from: String,
    pub(super) start_after: Option<String>,
    pub(super) until_tick: i64,
}

impl Plan {
    pub(super) fn from_job(deps: &WorkerDeps, job: &ExportJob) -> anyhow::Result<Plan> {
        let columns: Vec<OutputColumn> = serde_json::from_value(job.columns.clone()).context("job columns")?;
        // Only an admin's files and manifest show the snapshot (a partner has no use for the
        // cluster's transaction ids); a principal no longer configured is treated as a partner.
        let by_admin =
            deps.registry.get(&job.tenant).and_then(|t| t.principal(&job.principal)).is_some_and(|p| p.is_admin());
        let facts = FileFacts {
            export_id: job.id,
            dataset: &job.dataset,
            mode: job.mode,
            watermark: by_admin.then_some(job.watermark.as_str()),
            schema_sha256: &job.schema_sha256,
            schema_version: &job.schema_version,
            exportd_version: &job.exportd_version,
            columns: &columns,
            column_policy: job.column_policy.as_deref(),
            hashed_key_order: job.hashed_key_order,
        };
        let policy = column_policy(deps, job);
        let shard_spec = shard_spec(job.format, job.codec, &facts, policy.and_then(ColumnPolicy::hasher));
        let hashed_order = match (job.hashed_key_order, policy.map(ColumnPolicy::key_order)) {
            (false, _) => None,
            (true, Some(KeyOrder::Hashed(hasher))) => Some(hasher.clone()),
            // Never fall back to the real key's order; the job's authorization check fails it.
            (true, _) => anyhow::bail!("the column policy that ordered export {} by hashed key changed", job.id),
        };
        Ok(Plan {
            tenant: TenantId::parse(&job.tenant).map_err(anyhow::Error::msg)?,
            dataset: DatasetName::parse(&job.dataset).map_err(anyhow::Error::msg)?,
            shard_spec,
            filter: job.filter.clone(),
            row_filter: job.row_filter.clone(),
            watermark: Snapshot::parse(&job.watermark).map_err(anyhow::Error::msg)?,
            watermark_point: HistoryPoint {
                timeline: job.watermark_timeline,
                wal_position: job.watermark_wal_position,
            },
            shard_rows: u64::try_from(job.shard_rows).context("shard_rows")?,
            shows_watermark: by_admin,
            chain: job.start_from.clone().map(|from| Chain {
                from,
                start_after: job.start_after.clone(),
                until_tick: job.until_tick.unwrap_or(0),
            }),
            hashed_order,
        })
    }

    /// The dataset as of the watermark, narrowed by the request's and the principal's filters.
    pub(super) fn as_of(&self) -> AsOf<'_> {
        AsOf {
            tenant: &self.tenant,
            dataset: &self.dataset,
            snapshot: &self.watermark,
            filters: [&self.filter, &self.row_filter],
        }
    }

    /// The partner's hasher when the rows come from a spool (a full export in hashed-key order,
    /// see [`super::spool`]).
    pub(super) fn spooled(&self) -> Option<&ColumnHasher> {
        self.hashed_order.as_ref().filter(|_| self.chain.is_none())
    }

    /// How many rows follow position `after` (at most `limit`), and the last one's position:
    /// where a shard starting after `after` ends.
    pub(super) async fn span(
        &self,
        deps: &WorkerDeps,
        id: uuid::Uuid,
        after: Option<&str>,
        limit: u64,
    ) -> anyhow::Result<(i64, Option<String>)> {
        let reader = self.reader(deps).await;
        let Some(hasher) = self.spooled() else {
            return Ok(self.as_of().span(reader, after, limit as i64).await?);
        };
        let keep_going = || async { Ok(true) };
        let spool = deps.spools.get(id, reader, &self.as_of(), hasher, keep_going).await?;
        spool.context("spooling stopped")?.read_after(after)?.span(limit).await
    }

    /// Where the export's rows are read: a full export's snapshot on a standby that has replayed
    /// past its watermark (or the primary); a feed's changes on the primary, as reading them may
    /// cut windows.
    pub(super) async fn reader<'d>(&self, deps: &'d WorkerDeps) -> &'d sqlx::PgPool {
        if self.chain.is_some() || deps.replicas.is_empty() {
            return &deps.pool;
        }
        deps.replicas.reader(&deps.pool, self.watermark_point).await
    }

    pub(super) fn key_order(&self) -> KeyOrder<'_> {
        self.hashed_order.as_ref().map_or(KeyOrder::Key, KeyOrder::Hashed)
    }

    pub(super) fn source(&self) -> Source<'_> {
        match &self.chain {
            None => Source::Snapshot(self.as_of()),
            Some(chain) => Source::Changes {
                feed: self.feed(chain.until_tick),
                from: &chain.from,
                start_after: chain.start_after.as_deref(),
                until_tick: chain.until_tick,
            },
        }
    }

    pub(super) fn feed(&self, until_tick: i64) -> Feed<'_> {
        Feed {
            tenant: self.tenant.as_str(),
            dataset: self.dataset.as_str(),
            row_filter: &self.row_filter,
            seal: Seal::UpTo(until_tick),
            order: self.key_order(),
        }
    }

    /// The cursor the manifest hands out to continue after this export.
    pub(super) async fn next_cursor(&self, deps: &WorkerDeps, job: &ExportJob) -> anyhow::Result<String> {
        let database = crate::history::Database::identify(&deps.pool).await?;
        let cursor = |from: &str, at: HistoryPoint, ts: i64| {
            let owner = CursorOwner {
                tenant: &job.tenant,
                principal: &job.principal,
                dataset: &job.dataset,
                database: &database,
                row_filter: &job.row_filter,
                column_policy: job.column_policy.as_deref(),
                hashed_positions: job.hashed_key_order,
            };
            Cursor::new(&owner, from, at, ts).encode(&deps.keys)
        };
        Ok(match &self.chain {
            None => {
                let at = HistoryPoint { timeline: job.watermark_timeline, wal_position: job.watermark_wal_position };
                cursor(self.watermark.as_str(), at, job.created_at.unix_timestamp())
            }
            Some(chain) => {
                let feed = self.feed(chain.until_tick);
                match feeds::chain_end(&deps.pool, &feed, &chain.from, chain.until_tick).await? {
                    Some((end, point, at)) => cursor(&end, point, at.unix_timestamp()),
                    // No window was sealed: continue where this export started.
                    None => job.from_cursor.clone().unwrap_or_default(),
                }
            }
        })
    }
}

/// The job principal's column policy, if it is still the one frozen into the job (otherwise the
/// job fails its authorization check before writing anything).
pub(super) fn column_policy<'a>(deps: &'a WorkerDeps, job: &ExportJob) -> Option<&'a ColumnPolicy> {
    let principal = deps.registry.get(&job.tenant)?.principal(&job.principal)?;
    principal.column_policy(&job.dataset).filter(|p| Some(p.fingerprint()) == job.column_policy.as_deref())
}
