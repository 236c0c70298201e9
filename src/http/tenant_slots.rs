//! Per-tenant in-flight requests: however slow a tenant's requests are (big feed pages, batches
//! waiting on locks), it holds at most `max_concurrent_requests` of this process's request
//! handlers — and so of its database connections — at once; the rest stay for other tenants.
//! One more gets 429 at once, costing nothing shared.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::state::AppState;
use crate::tenants::TenantId;

/// The tenant a request's credential names — a valid bearer token or download link — if any.
/// Invalid credentials pass through untouched: the handler refuses them.
fn requesting_tenant(state: &AppState, request: &Request) -> Option<TenantId> {
    let bearer = request.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    if let Some(token) = bearer.and_then(|h| h.split_once(' ')).map(|(_, token)| token.trim()) {
        return crate::auth::authenticate(&state.registry, token).ok().map(|c| c.tenant.id.clone());
    }
    let link = request.uri().query()?.split('&').find_map(|pair| pair.strip_prefix("token="))?;
    let claims = state.links.verify(link, state.clock.unix_seconds()).ok()?;
    state.registry.get(&claims.tenant).map(|t| t.id.clone())
}

pub async fn bound_per_tenant(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(tenant) = requesting_tenant(&state, &request) else {
        return next.run(request).await;
    };
    let _slot = match state.limits.request_slot(&tenant) {
        Ok(slot) => slot,
        Err(rejection) => return ApiError::from(rejection).into_response(),
    };
    next.run(request).await
}
