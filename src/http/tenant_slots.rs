//! Per-tenant in-flight requests: however slow a tenant's requests are (big feed pages, batches
//! waiting on locks), it holds at most `max_concurrent_requests` of this process's request
//! handlers — and so of its database connections — at once, shared between its principals
//! ([`crate::quota::SharedSlots`]); the rest stay for other tenants. One more gets 429 at once,
//! costing nothing shared. A body is read before the request slot is taken, under an upload
//! slot of its own (as many, shared alike) and a stall limit: a client that drips its body holds
//! an upload slot for at most [`BODY_STALL`] between bytes, never a request slot, and a flood of
//! bodies is bounded in number (and so in memory) before any of it is read.

use std::time::Duration;

use axum::RequestExt;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use http_body_util::BodyExt;

use super::error::ApiError;
use super::state::AppState;
use crate::auth::Caller;

/// Who a request's credential names — a valid bearer token or download link — if anyone.
/// Invalid credentials pass through untouched: the handler refuses them.
fn requesting_caller(state: &AppState, request: &Request) -> Option<Caller> {
    if let Some(token) = super::extract::bearer_token_of(request.headers()) {
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
    let request = if has_body(&request) {
        let _upload = match state.limits.upload_slot(&caller) {
            Ok(slot) => slot,
            Err(rejection) => return ApiError::from(rejection).into_response(),
        };
        match with_body_read(request).await {
            Ok(request) => request,
            Err(problem) => return problem.into_response(),
        }
    } else {
        request
    };
    let _slot = match state.limits.request_slot(&caller) {
        Ok(slot) => slot,
        Err(rejection) => return ApiError::from(rejection).into_response(),
    };
    next.run(request).await
}

/// A body that sends nothing for this long is abandoned (408).
pub const BODY_STALL: Duration = Duration::from_secs(10);

/// Whether the request says a body follows.
fn has_body(request: &Request) -> bool {
    let headers = request.headers();
    headers.contains_key(TRANSFER_ENCODING)
        || headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim() != "0")
}

/// The request with its whole body already received (within the body limit, each piece within
/// [`BODY_STALL`] of the previous).
async fn with_body_read(request: Request) -> Result<Request, ApiError> {
    let (parts, mut body) = request.with_limited_body().into_parts();
    let mut bytes = BytesMut::new();
    loop {
        let frame = match tokio::time::timeout(BODY_STALL, body.frame()).await {
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "body-stalled",
                    format!("the request body stopped arriving (nothing for {} s)", BODY_STALL.as_secs()),
                ));
            }
            Ok(None) => break,
            Ok(Some(frame)) => frame.map_err(|e| body_problem(&e))?,
        };
        if let Ok(data) = frame.into_data() {
            bytes.extend_from_slice(&data);
        }
    }
    Ok(Request::from_parts(parts, Body::from(bytes.freeze())))
}

/// 413 past the body limit, else 400.
fn body_problem(e: &axum::Error) -> ApiError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
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
}
