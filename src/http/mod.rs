//! The HTTP API: one file per resource, merged here with the middleware every request passes.

mod attachments;
mod audit;
mod dashboard;
mod deliveries;
mod downloads;
mod error;
mod exports;
mod extract;
mod feeds;
mod health;
mod listener;
mod listing;
mod metrics;
mod openapi;
mod range;
mod records;
mod schemas;
mod session;
mod sharing;
mod stall;
mod state;
mod tenant_slots;
mod usage;
mod webhooks;

use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::{MatchedPath, Request};
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, X_CONTENT_TYPE_OPTIONS};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::set_header::SetResponseHeaderLayer;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

pub use error::{ApiError, ApiResult};
pub use listener::{ConnectionLimits, serve};
pub use metrics::{MetricsAccess, MetricsPage};
pub use state::AppState;

/// Hard cap on request bodies (an ingest batch of 10 000 records fits comfortably).
const BODY_LIMIT_BYTES: usize = 16 << 20;
/// Time allowed until the response head; download bodies stream past it.
const RESPONSE_HEAD_TIMEOUT: Duration = Duration::from_secs(30);
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The whole application: routes, `/openapi.json`, and the middleware stack.
pub fn app(state: AppState) -> Router {
    let (api, mut openapi) = openapi::routes().split_for_parts();
    openapi::add_common_responses(&mut openapi);
    openapi::add_links(&mut openapi);
    let openapi_json = serde_json::to_string(&openapi).expect("the OpenAPI document serializes");
    api.route(
        "/openapi.json",
        axum::routing::get(
            move || async move { ([(axum::http::header::CONTENT_TYPE, "application/json")], openapi_json) },
        ),
    )
    .route("/metrics", axum::routing::get(metrics::metrics))
    .merge(dashboard::router())
    .fallback(error::fallback)
    .layer(axum::middleware::from_fn_with_state(state.clone(), tenant_slots::bound_per_tenant))
    .with_state(state)
    // Router::layer: the last added is the outermost.
    // Applies to every body extractor (Bytes, Json, Form); past it a problem+json 413.
    .layer(DefaultBodyLimit::max(BODY_LIMIT_BYTES))
    .layer(axum::middleware::map_response(error::method_not_allowed_as_problem))
    .layer(axum::middleware::from_fn(head_deadline))
    .layer(CatchPanicLayer::custom(|_| {
        axum::response::IntoResponse::into_response(ApiError::internal(anyhow::anyhow!("handler panicked")))
    }))
    .layer(SetResponseHeaderLayer::if_not_present(CACHE_CONTROL, HeaderValue::from_static("private, no-store")))
    .layer(SetResponseHeaderLayer::if_not_present(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")))
    .layer(PropagateRequestIdLayer::new(REQUEST_ID))
    .layer(
        TraceLayer::new_for_http()
            .make_span_with(request_span)
            .on_response(DefaultOnResponse::new().level(Level::INFO)),
    )
    .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
    .layer(axum::middleware::map_request(drop_untrusted_request_id))
    .layer(SetSensitiveRequestHeadersLayer::new([AUTHORIZATION]))
}

/// Every response head within [`RESPONSE_HEAD_TIMEOUT`], else a problem saying so (never a bare
/// status): the handler is abandoned, its open transaction rolled back.
async fn head_deadline(request: Request, next: axum::middleware::Next) -> axum::response::Response {
    match tokio::time::timeout(RESPONSE_HEAD_TIMEOUT, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!("request abandoned: no response within the deadline");
            let mut problem = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "timed-out",
                format!(
                    "no answer within {} s; the request was abandoned — retry later (a create with the same Idempotency-Key)",
                    RESPONSE_HEAD_TIMEOUT.as_secs()
                ),
            );
            problem.retry_after_seconds = Some(5);
            axum::response::IntoResponse::into_response(problem)
        }
    }
}

/// The span of one request: route template and ids only. The query string is left out on
/// purpose: it may carry a signed link token.
fn request_span(request: &Request) -> tracing::Span {
    let route = request.extensions().get::<MatchedPath>().map_or("-", |p| p.as_str());
    let request_id = request.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
    tracing::info_span!(
        "request",
        method = %request.method(),
        route,
        request_id,
        tenant = tracing::field::Empty,
        principal = tracing::field::Empty,
        export = tracing::field::Empty,
    )
}

/// A client may pass its own request id for correlation, but only a short, plain one.
async fn drop_untrusted_request_id(mut request: Request) -> Request {
    let trusted = request.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()).is_some_and(|id| {
        !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    });
    if !trusted {
        request.headers_mut().remove(&REQUEST_ID);
    }
    request
}
