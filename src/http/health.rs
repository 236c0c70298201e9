//! `GET /healthz`: the process is up and the database answers (else 503); and whether the
//! artifact store answers (`degraded` when it does not: feeds and the API still work, exports
//! wait and downloads answer 503, so a load balancer should keep sending traffic).

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
    /// `ok`, or `degraded` when the store does not answer.
    status: &'static str,
    database: &'static str,
    /// `ok` or `unreachable`.
    store: &'static str,
    /// Why the store is unreachable (absent when it answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    store_error: Option<String>,
}

/// Liveness, database and store reachability.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, body = Health), (status = 503, description = "database unreachable")))]
async fn healthz(State(state): State<AppState>) -> ApiResult<axum::Json<Health>> {
    sqlx::query!("SELECT 1 AS one").fetch_one(&state.pool).await.map_err(|e| {
        tracing::warn!(error = %e, "health check: database unreachable");
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database-unavailable", "the database does not answer")
    })?;
    let store_error = state.store.reachable().await.err();
    if let Some(error) = &store_error {
        tracing::warn!(error, "health check: the artifact store does not answer");
    }
    let (status, store) = if store_error.is_some() { ("degraded", "unreachable") } else { ("ok", "ok") };
    Ok(axum::Json(Health { status, database: "ok", store, store_error }))
}
