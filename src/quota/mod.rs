//! Quota policy: every admission question (API rate, concurrency, queued exports, egress, scan
//! rate) and the one [`Rejection`] a refusal is, counted per kind ([`refusals`]). What a tenant
//! has used is reported by [`crate::usage`], above both this and the export store.

mod cpu;
pub mod egress;
mod rate;
pub mod refusals;
mod rejection;
mod scan;
mod shares;

pub use cpu::{CpuTurn, CpuTurns};
pub use egress::{Admitted, admit_download, egress_today, refund_unsent};
pub use rate::{RateLimits, run_housekeeping};
pub use refusals::{RefusalKind, Refusals};
pub use rejection::Rejection;
pub use scan::ScanLimits;
pub use shares::{Holder, SharedSlots, Slot};

/// Locks the tenant's usage row (creating it) for the rest of the transaction: every quota
/// decision of one tenant (queued exports, stored bytes, egress) then counts after the previous.
/// It is the first row lock of any transaction that takes it (lock order: [`crate::exports::store`]).
pub async fn lock_tenant(tx: &mut sqlx::PgConnection, tenant: &str) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO tenant_usage (tenant) VALUES ($1)
         ON CONFLICT ON CONSTRAINT tenant_usage_pkey DO UPDATE SET tenant = EXCLUDED.tenant",
        tenant,
    )
    .execute(tx)
    .await?;
    Ok(())
}
