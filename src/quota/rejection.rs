//! Why a request was refused by a quota: one type for every admission decision on the request
//! path, with its refusal kind (how it is counted), problem code, explanation and when to retry.
//! The edge turns it into a 429 in one place (`http::error`).

use std::time::Duration;

use super::RefusalKind;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// `api_requests_per_second` (per partner, or the tenant's admins together).
    #[error("too many requests: the tenant's api_requests_per_second is exceeded")]
    Rate { retry_after: Duration },
    /// `max_concurrent_requests` of the tenant are in progress in this process.
    #[error("the tenant's max_concurrent_requests are in progress; retry when one has finished")]
    Concurrency,
    /// One estimate's census at a time per tenant and process.
    #[error("one of the tenant's estimates is running; retry when it is done")]
    EstimateInProgress,
    /// `max_concurrent_downloads` of the tenant are streaming.
    #[error("the tenant's max_concurrent_downloads are streaming; retry when one has finished")]
    Downloads,
    /// `egress_bytes_per_day` would be exceeded by this download.
    #[error("the tenant's egress_bytes_per_day is used up; it resets at midnight UTC")]
    Egress { retry_after: Duration },
    /// `max_queued_exports` (or a partner's `max_queued_exports_per_partner`) are queued.
    #[error("{queued} exports are already queued (quota {limit_name} = {limit})")]
    Queued { limit_name: &'static str, limit: u64, queued: u64 },
}

impl Rejection {
    /// The kind it is counted under (`GET /v1/usage`'s `refusals_today`).
    pub fn kind(&self) -> RefusalKind {
        match self {
            Rejection::Rate { .. } => RefusalKind::Rate,
            Rejection::Concurrency | Rejection::EstimateInProgress => RefusalKind::Concurrency,
            Rejection::Downloads => RefusalKind::Downloads,
            Rejection::Egress { .. } => RefusalKind::Egress,
            Rejection::Queued { .. } => RefusalKind::Queued,
        }
    }

    /// The problem+json `code`.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::Rate { .. } => "rate-limited",
            Rejection::Concurrency => "too-many-concurrent-requests",
            Rejection::EstimateInProgress => "estimate-in-progress",
            Rejection::Downloads => "too-many-downloads",
            Rejection::Egress { .. } => "egress-quota-exceeded",
            Rejection::Queued { .. } => "quota-exceeded",
        }
    }

    /// When a retry may succeed (`Retry-After`, whole seconds, at least one).
    pub fn retry_after(&self) -> Duration {
        match self {
            Rejection::Rate { retry_after } | Rejection::Egress { retry_after } => *retry_after,
            // A queued export starts (and leaves the queue) within seconds to minutes.
            Rejection::Queued { .. } => Duration::from_secs(30),
            Rejection::Concurrency | Rejection::EstimateInProgress | Rejection::Downloads => Duration::from_secs(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rejection_names_its_kind_code_and_retry() {
        let queued = Rejection::Queued { limit_name: "max_queued_exports", limit: 5, queued: 5 };
        assert_eq!((queued.kind(), queued.code()), (RefusalKind::Queued, "quota-exceeded"));
        assert_eq!(queued.to_string(), "5 exports are already queued (quota max_queued_exports = 5)");
        assert_eq!(Rejection::EstimateInProgress.kind(), RefusalKind::Concurrency);
        let egress = Rejection::Egress { retry_after: Duration::from_secs(7) };
        assert_eq!(egress.retry_after(), Duration::from_secs(7));
    }
}
