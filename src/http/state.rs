//! What every handler can reach.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

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
    /// When set, `GET /metrics` requires `Authorization: Bearer <token>`.
    pub metrics_token: Option<secrecy::SecretString>,
}
