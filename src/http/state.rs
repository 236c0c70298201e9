//! What every handler can reach.

use std::sync::Arc;

use sqlx::PgPool;

use crate::tenants::Registry;

#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub registry: Arc<Registry>,
}
