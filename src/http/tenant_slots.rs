//! Per-tenant in-flight requests: however slow a tenant's requests are (big feed pages, batches
//! waiting on locks), it holds at most `max_concurrent_requests` of this process's request
//! handlers — and so of its database connections — at once, shared between its principals
//! ([`crate::quota::SharedSlots`]); the rest stay for other tenants. One more gets 429 at once,
//! costing nothing shared. The body is read before a slot is taken: a client that drips its
//! body holds a connection (bounded by the response deadline), never a slot.

use axum::RequestExt;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::state::AppState;
use crate::auth::Caller;

/// Who a request's credential names — a valid bearer token or download link — if anyone.
/// Invalid credentials pass through untouched: the handler refuses them.
fn requesting_caller(state: &AppState, request: &Request) -> Option<Caller> {
    let bearer = request.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    if let Some(token) = bearer.and_then(|h| h.split_once(' ')).map(|(_, token)| token.trim()) {
        return crate::auth::authenticate(&state.registry, token).ok();
    }
    let link = request.uri().query()?.split('&').find_map(|pair| pair.strip_prefix("token="))?;
    let claims = state.links.verify(link, state.clock.unix_seconds()).ok()?;
    let tenant = state.registry.get(&claims.tenant)?;
    let principal = tenant.principal(&claims.sub).filter(|p| !p.disabled)?.clone();
    Some(Caller { tenant: tenant.clone(), principal })
}

pub async fn bound_per_tenant(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(caller) = requesting_caller(&state, &request) else {
        return next.run(request).await;
    };
    let request = match with_body_read(request).await {
        Ok(request) => request,
        Err(problem) => return problem.into_response(),
    };
    let _slot = match state.limits.request_slot(&caller) {
        Ok(slot) => slot,
        Err(rejection) => return ApiError::from(rejection).into_response(),
    };
    next.run(request).await
}

/// The request with its whole body already received (within the body limit).
async fn with_body_read(request: Request) -> Result<Request, ApiError> {
    let (parts, body) = request.with_limited_body().into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.map_err(|e| {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(error) = source {
            if error.is::<http_body_util::LengthLimitError>() {
                return ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload-too-large",
                    "the body is larger than the server accepts",
                );
            }
            source = error.source();
        }
        ApiError::new(StatusCode::BAD_REQUEST, "invalid-body", "the request body could not be read")
    })?;
    Ok(Request::from_parts(parts, Body::from(bytes)))
}
