//! `GET /v1/audit`: the tenant's audit log, for tenant admins.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::extract::Query;
use super::state::AppState;
use crate::audit::{self, AuditEntry};
use crate::auth::Caller;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(audit_log))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditParams {
    /// `next_cursor` of the previous page: an opaque token this API handed out (any other text
    /// is refused with 400 naming `cursor`).
    #[param(min_length = 1)]
    cursor: Option<String>,
    /// Page size, 1 to 500 (default 100).
    #[param(minimum = 1, maximum = 500)]
    limit: Option<u32>,
}

#[derive(Serialize, ToSchema)]
pub struct AuditPage {
    events: Vec<AuditEntry>,
    next_cursor: Option<String>,
}

/// Who created, cancelled, revoked and downloaded what, newest first.
#[utoipa::path(get, path = "/v1/audit", tag = "audit", security(("bearer" = [])), params(AuditParams),
    responses((status = 200, body = AuditPage), (status = 403, description = "not a tenant admin")))]
async fn audit_log(
    State(state): State<AppState>,
    caller: Caller,
    Query(params): Query<AuditParams>,
) -> ApiResult<axum::Json<AuditPage>> {
    if !caller.principal.is_admin() {
        return Err(ApiError::forbidden("only tenant admins can read the audit log"));
    }
    let limit = params.limit.unwrap_or(100);
    if !(1..=500).contains(&limit) {
        return Err(ApiError::invalid_field("limit", "must be between 1 and 500"));
    }
    let before = match params.cursor.as_deref().map(str::parse::<i64>) {
        Some(Ok(id)) => Some(id),
        Some(Err(_)) => return Err(ApiError::invalid_field("cursor", "not a cursor from this listing")),
        None => None,
    };
    let (events, next_cursor) = audit::page(&state.pool, caller.tenant.id.as_str(), before, limit).await?;
    Ok(axum::Json(AuditPage { events, next_cursor }))
}
