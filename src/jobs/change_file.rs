//! A table version's change file (see [`crate::sharing::changes`]): written by the worker that
//! publishes the version, after its shards and before its publication, so the version and its
//! changes appear together.

use anyhow::Context;
use futures_util::TryStreamExt;

use super::WorkerDeps;
use super::plan::Plan;
use crate::exports::ExportJob;
use crate::sharing::changes::{self, ChangeFile};

/// Rows handed to the encoder at a time.
const PAGE_ROWS: usize = 1_000;

/// Keeps clear of the history collector: a predecessor whose snapshot is within this much of
/// the tenant's tombstone window gets no change file.
const HISTORY_MARGIN: time::Duration = time::Duration::hours(1);

/// Writes the change file of `job`, the export about to publish, from the table version it will
/// follow, if it will follow one it can be compared with. Database errors are errors (the step
/// is retried); a file that cannot be encoded or stored is left out with a warning: the
/// version's changes then answer as whole files, which is exact too.
pub(super) async fn write(deps: &WorkerDeps, job: &ExportJob, plan: &Plan) -> anyhow::Result<Option<ChangeFile>> {
    let Some(tenant) = deps.registry.get(&job.tenant) else { return Ok(None) };
    let kept = time::Duration::days(i64::from(tenant.retention.tombstone_days));
    let history_from = time::OffsetDateTime::now_utc() - kept + HISTORY_MARGIN;
    let Some(from) = crate::exports::store::facts::table_version_predecessor(&deps.pool, job.id, history_from).await?
    else {
        return Ok(None);
    };
    let key = changes::object_key(&job.tenant, job.id, from.version);
    let spec = changes::spec(&plan.shard_spec, from.version);
    let mut served = plan.shard_spec.comparer().map_err(anyhow::Error::msg)?;
    let (pages, encoder) = super::shard::spawn_encoder(deps.store.clone(), key.clone(), spec);
    let read: anyhow::Result<()> = async {
        let mut tx = deps.pool.begin().await?;
        sqlx::raw_sql("SET LOCAL jit = off").execute(&mut *tx).await?;
        let (tenant, dataset) = (plan.tenant.as_str(), plan.dataset.as_str());
        let (from_watermark, to_watermark) = (from.watermark.as_str(), plan.watermark.as_str());
        let mut rows = changes::key_changes(
            &mut tx,
            tenant,
            dataset,
            from_watermark,
            to_watermark,
            &plan.row_filter,
            plan.key_order(),
        );
        let mut page = Vec::with_capacity(PAGE_ROWS + 1);
        while let Some(change) = rows.try_next().await? {
            page.extend(change.rows(&mut served)?);
            if page.len() >= PAGE_ROWS {
                deps.scan.acquire(tenant, page.len() as u64).await;
                if pages.send(std::mem::take(&mut page)).await.is_err() {
                    break; // the encoder failed; its error is reported below
                }
            }
        }
        if !page.is_empty() {
            deps.scan.acquire(tenant, page.len() as u64).await;
            let _ = pages.send(page).await;
        }
        drop(rows);
        tx.commit().await?;
        Ok(())
    }
    .await;
    drop(pages);
    let encoded = encoder.await.context("change file encoder panicked")?;
    let (writer, digest) = match (read, encoded) {
        (Err(e), encoded) => {
            if let Ok((writer, _)) = encoded {
                tokio::task::spawn_blocking(move || drop(writer)).await?;
            }
            return Err(e.context("reading the changes between two table versions"));
        }
        (Ok(()), Err(e)) => {
            tracing::warn!(export = %job.id, from = from.version, error = %e, "no change file: its changes answer as whole files");
            return Ok(None);
        }
        (Ok(()), Ok(written)) => written,
    };
    if let Err(e) = tokio::task::spawn_blocking(move || writer.finish()).await? {
        tracing::warn!(export = %job.id, from = from.version, error = %e, "no change file: its changes answer as whole files");
        return Ok(None);
    }
    Ok(Some(ChangeFile {
        from_version: from.version,
        object_key: key.as_str().to_owned(),
        rows: digest.rows as i64,
        bytes: digest.bytes as i64,
        sha256: digest.sha256,
    }))
}
