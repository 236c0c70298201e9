//! What tenants have used, for `GET /v1/usage`, its hourly history and the dashboard: read from
//! the export store's facts, the audit log, egress and refusal counts. Sits above both
//! [`crate::quota`] (the policy) and [`crate::exports`].

pub mod history;
pub mod partners;
mod report;

pub use report::{Counters, Queue, Usage, usage};
