//! `GET /v1/usage`: the tenant's limits next to its usage, for tenant admins.

use axum::extract::State;
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::state::AppState;
use crate::auth::Caller;
use crate::quota::{self, Usage};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(usage))
}

/// Every limit of the tenant next to its current usage, queue depth and ages.
#[utoipa::path(get, path = "/v1/usage", tag = "quotas", security(("bearer" = [])),
    responses((status = 200, body = Usage), (status = 403, description = "not a tenant admin")))]
async fn usage(State(state): State<AppState>, caller: Caller) -> ApiResult<axum::Json<Usage>> {
    if !caller.principal.is_admin() {
        return Err(ApiError::forbidden("only tenant admins can read usage"));
    }
    Ok(axum::Json(tenant_usage(&state, &caller.tenant).await?))
}

/// The usage report, with the refusals this process counted and has not flushed yet.
pub(super) async fn tenant_usage(state: &AppState, tenant: &crate::tenants::Tenant) -> sqlx::Result<Usage> {
    quota::usage(&state.pool, tenant, &state.limits.refusals, state.clock.now()).await
}
