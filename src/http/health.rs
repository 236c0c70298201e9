//! `GET /healthz`: the process is up and the database answers.

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::state::AppState;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(healthz))
}

#[derive(Serialize, ToSchema)]
pub struct Health {
    status: &'static str,
    database: &'static str,
}

/// Liveness and database reachability.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, body = Health), (status = 503, description = "database unreachable")))]
async fn healthz(State(state): State<AppState>) -> ApiResult<axum::Json<Health>> {
    sqlx::query!("SELECT 1 AS one").fetch_one(&state.pool).await.map_err(|e| {
        tracing::warn!(error = %e, "health check: database unreachable");
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database-unavailable", "the database does not answer")
    })?;
    Ok(axum::Json(Health { status: "ok", database: "ok" }))
}
