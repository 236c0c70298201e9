//! What every handler can reach.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::metrics::{MetricsAccess, MetricsPage};
use crate::clock::Clock;
use crate::links::LinkKeys;
use crate::quota::RateLimits;
use crate::storage::ArtifactStore;
use crate::tenants::Registry;

#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub registry: Arc<Registry>,
    pub store: ArtifactStore,
    pub links: Arc<LinkKeys>,
    pub clock: Clock,
    /// Lifetime of the signed download links in export status responses.
    pub link_ttl: Duration,
    pub limits: Arc<RateLimits>,
    /// Who may read `GET /metrics`, and its cached gauges.
    pub metrics: Arc<MetricsPage>,
    /// A delivery retried by hand is tried again for this long (EXPORTD_WEBHOOK_RETRY_FOR).
    pub webhook_retry_for: Duration,
    /// A bucket delivery retried by hand is tried again for this long (EXPORTD_DELIVERY_RETRY_FOR).
    pub delivery_retry_for: Duration,
    /// The API's public base URL (EXPORTD_PUBLIC_URL): Delta Sharing profiles and file URLs are
    /// absolute; without it they take the request's `Host`.
    pub public_url: Option<reqwest::Url>,
    /// Hot standbys that read feed pages (EXPORTD_READ_REPLICAS); none by default.
    pub replicas: Arc<crate::replicas::Replicas>,
}

/// Default of EXPORTD_WEBHOOK_RETRY_FOR.
pub const DEFAULT_WEBHOOK_RETRY_FOR: Duration = Duration::from_secs(24 * 3600);

/// Default lifetime of signed download links.
pub const DEFAULT_LINK_TTL: Duration = Duration::from_secs(300);

impl AppState {
    /// The state `serve` and the tests run the API with: fresh in-process limits for the
    /// registry's tenants, links valid for [`DEFAULT_LINK_TTL`], `/metrics` closed.
    pub fn new(
        pool: PgPool,
        registry: Arc<Registry>,
        store: ArtifactStore,
        links: Arc<LinkKeys>,
        clock: Clock,
    ) -> Self {
        let limits = Arc::new(RateLimits::new(&registry));
        AppState {
            pool,
            registry,
            store,
            links,
            clock,
            link_ttl: DEFAULT_LINK_TTL,
            limits,
            metrics: MetricsPage::new(MetricsAccess::Closed),
            webhook_retry_for: DEFAULT_WEBHOOK_RETRY_FOR,
            delivery_retry_for: DEFAULT_WEBHOOK_RETRY_FOR,
            public_url: None,
            replicas: Default::default(),
        }
    }
}
