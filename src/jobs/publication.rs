//! An export's publication and everything that becomes true with it, in one transaction: the
//! export is SUCCEEDED with its manifest; a subscription's chain, or an incremental export's
//! stored cursor, moves to its `next_cursor`; a full Parquet export of the whole dataset becomes
//! the next version of the principal's shared table, with its change file. The export store,
//! deliveries and sharing each own their rows; the worker composes them here.

use sqlx::PgPool;

use crate::exports::store::lease::{self, Lease, LeaseLost, Publication};
use crate::sharing::{ChangeFile, NewVersion};

/// What the export's publication moves besides the export.
pub(super) struct Consequences<'a> {
    /// Incremental exports: the cursor to store for the principal and dataset.
    pub stored_cursor: Option<&'a str>,
    /// The manifest's `next_cursor`: where a subscription's chain goes on from this export.
    pub next_cursor: Option<&'a str>,
    /// Table versions: what changed since the version before (Delta Sharing).
    pub changes: Option<&'a ChangeFile>,
}

/// Publishes under `lease`; `Err(LeaseLost)` changes nothing.
pub(super) async fn publish(
    pool: &PgPool,
    lease: Lease,
    publication: &Publication<'_>,
    then: &Consequences<'_>,
) -> sqlx::Result<Result<(), LeaseLost>> {
    let mut tx = pool.begin().await?;
    let job = match lease::publish(&mut tx, lease, publication).await? {
        Ok(job) => job,
        Err(lost) => return Ok(Err(lost)),
    };
    match (job.subscription_id, then.stored_cursor) {
        // A subscription's export moves the subscription's chain, never the principal's own
        // cursor: the partner's pulls and the scheduled deliveries do not skip each other's changes.
        (Some(subscription), _) => crate::delivery::advance_chain(&mut tx, subscription, then.next_cursor).await?,
        (None, Some(cursor)) => {
            crate::exports::store_cursor(&mut tx, &job.tenant, &job.principal, &job.dataset, cursor).await?
        }
        (None, None) => {}
    }
    if job.is_table_version {
        let version = NewVersion {
            tenant: &job.tenant,
            principal: &job.principal,
            dataset: &job.dataset,
            export_id: lease.job_id,
            snapshot_at: job.created_at,
        };
        crate::sharing::record_version(&mut tx, &version, then.changes).await?;
    }
    tx.commit().await?;
    Ok(Ok(()))
}
