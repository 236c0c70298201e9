//! Quotas: API rate limits (`rate`), scan rates, egress admission, refusal counts, and the usage
//! report.

mod egress;
pub mod history;
pub mod partners;
mod rate;
pub mod refusals;
mod rejection;
mod scan;
mod usage;

pub use egress::admit_download;
pub use rate::{RateLimits, run_housekeeping};
pub use refusals::{RefusalKind, Refusals};
pub use rejection::Rejection;
pub use scan::ScanLimits;
pub use usage::{Counters, Queue, Usage, usage};

/// Locks the tenant's usage row (creating it) for the rest of the transaction: every quota
/// decision of one tenant (queued exports, stored bytes, egress) then counts after the previous.
/// It is the first row lock of any transaction that takes it (lock order: `jobs::fenced`).
pub async fn lock_tenant(tx: &mut sqlx::PgConnection, tenant: &str) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO tenant_usage (tenant) VALUES ($1)
         ON CONFLICT ON CONSTRAINT tenant_usage_pkey DO UPDATE SET tenant = EXCLUDED.tenant",
    )
    .bind(tenant)
    .execute(tx)
    .await?;
    Ok(())
}
