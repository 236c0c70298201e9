//! How a worker ends an export, under the job's lease or under one of its shard writers'
//! leases: the checks that end it, failing it, and deleting its files once that is committed.

use anyhow::Context;

use super::WorkerDeps;
use super::plan::Plan;
use crate::exports::store::lease::{self, Fence, LeaseLost, Refused};
use crate::exports::{ExportJob, ExportState};
use crate::quota::{self, RefusalKind};
use crate::served::{ServedView, ViewChanged};
use crate::tenants::TenantId;
use crate::writers::DoesNotFit;

/// `failed` detail for a record the export's format cannot encode.
const UNENCODABLE: &str =
    "a record of the dataset cannot be encoded in the export's format; fix or delete it and create the export again";

/// The failure (code, detail) for a record the shard encoder refused: a value its column's
/// type cannot hold exactly (`value-does-not-fit`, naming the column, the rule and the record's
/// key), or a record it cannot read at all. The log names the column and rule, never data.
pub(super) fn unencodable(job: &ExportJob, error: &anyhow::Error) -> (&'static str, String) {
    match DoesNotFit::find(error) {
        Some(unfit) => {
            tracing::error!(export = %job.id, error = %unfit, "a value does not fit its column's type in this format");
            let detail =
                format!("{unfit} (the record with key {:?}); fix or delete it, or export in another format", unfit.key);
            ("value-does-not-fit", detail)
        }
        None => {
            tracing::error!(export = %job.id, error = format!("{error:#}"), "a record cannot be encoded");
            ("unencodable-record", UNENCODABLE.to_owned())
        }
    }
}

/// The principal must still exist, be enabled, be granted the dataset, and have the row filter
/// and column policy frozen into the job.
pub(super) fn authorized(deps: &WorkerDeps, job: &ExportJob, plan: &Plan) -> Result<(), String> {
    let tenant = deps.registry.get(&job.tenant).ok_or("the tenant is no longer configured")?;
    let principal = tenant.principal(&job.principal).ok_or("the principal no longer exists")?;
    if principal.disabled {
        return Err("the principal is disabled".into());
    }
    let view = ServedView::of(tenant, principal, &job.dataset)
        .map_err(|_| "the dataset is no longer granted to the principal".to_owned())?;
    view.check_cut(&plan.row_filter, job.column_policy.as_deref()).map_err(|changed| match changed {
        ViewChanged::RowFilter => "the principal's row filter changed".to_owned(),
        ViewChanged::ColumnPolicy => "the principal's column policy changed".to_owned(),
    })
}

/// The failure a refused checkpoint means (`None`: the lease was lost, nothing to fail). A
/// storage refusal is counted for the tenant's usage.
pub(super) async fn refusal(deps: &WorkerDeps, job: &ExportJob, refused: Refused) -> Option<(&'static str, String)> {
    match refused {
        Refused::LeaseLost => None,
        Refused::StorageQuota { stored, limit } => {
            let counted = match TenantId::parse(&job.tenant) {
                Ok(tenant) => quota::refusals::count_now(&deps.pool, &tenant, RefusalKind::Storage).await,
                Err(_) => Ok(()),
            };
            if let Err(e) = counted {
                tracing::warn!(error = %e, "could not count a storage refusal");
            }
            let detail =
                format!("the tenant's stored export files would reach {stored} bytes (quota storage_bytes = {limit})");
            Some(("storage-quota-exceeded", detail))
        }
    }
}

/// RUNNING → FAILED under `fence`, then the export's files are deleted.
pub(super) async fn fail(
    deps: &WorkerDeps,
    job: &ExportJob,
    fence: Fence,
    code: &str,
    detail: &str,
) -> anyhow::Result<Result<(), LeaseLost>> {
    let failed =
        lease::finish(&deps.pool, fence, ExportState::Running, ExportState::Failed, Some((code, detail))).await?;
    if failed.is_ok() {
        delete_files(deps, job, "failed").await?;
        tracing::warn!(export = %job.id, code, "export failed");
    }
    Ok(failed)
}

/// Only after the job's terminal state is committed under our lease: no newer attempt exists.
pub(super) async fn delete_files(deps: &WorkerDeps, job: &ExportJob, reason: &str) -> anyhow::Result<()> {
    crate::exports::delete_files(&deps.pool, &deps.store, &job.tenant, job.id, reason)
        .await
        .context("deleting export files")?;
    Ok(())
}

/// A record's stored JSON that the shard encoder refuses (serde_json reports it as
/// `InvalidData`), as opposed to a failing disk or connection.
pub(super) fn is_unencodable(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData)
    })
}
