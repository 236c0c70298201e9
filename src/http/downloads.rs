//! Downloads of the whole file and of single shards: bearer token or signed link, checked on
//! every request; RFC 9110 ranges; streamed from storage with bounded memory.

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::header::{
    ACCEPT_RANGES, AUTHORIZATION, CONTENT_DISPOSITION, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, ETAG, IF_RANGE,
    RANGE,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{StreamExt, TryStreamExt};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_axum::{router::OpenApiRouter, routes};
use uuid::Uuid;

use super::error::{ApiError, ApiResult};
use super::exports::export_id;
use super::extract::{Path, Query, admit, caller_from_headers};
use super::range::{RangeAnswer, decide};
use super::state::AppState;
use crate::audit::{self, AuditEvent};
use crate::auth::Caller;
use crate::exports::download::{self, Download, Object};
use crate::exports::layout;
use crate::links::LinkError;

use crate::quota;
use crate::storage::{ArtifactStore, StoreError};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(download_file))
        .routes(routes!(download_shard))
        .routes(routes!(download_changes))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LinkQuery {
    /// A signed link token from the export's status (instead of a bearer token).
    token: Option<String>,
}

/// The whole export as one gzip file (one CSV header); csv and jsonl exports only.
#[utoipa::path(get, path = "/v1/exports/{id}/file", tag = "downloads", params(("id" = String, Path), LinkQuery),
    responses((status = 200, description = "the file"), (status = 206, description = "a range of it"),
        (status = 403, description = "bad, expired or foreign link; principal disabled or no longer granted"),
        (status = 404, description = "absent or not visible"), (status = 409, description = "not published yet"),
        (status = 410, description = "revoked, expired, cancelled or failed"),
        (status = 416, description = "range not satisfiable; `Content-Range: bytes */len`")))]
async fn download_file(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<LinkQuery>,
    method: Method,
    headers: HeaderMap,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> ApiResult<Response> {
    serve(&state, &id, Object::File, query.token.as_deref(), &method, &headers, peer).await
}

/// One shard file.
#[utoipa::path(get, path = "/v1/exports/{id}/shards/{n}", tag = "downloads",
    params(("id" = String, Path), ("n" = u32, Path), LinkQuery),
    responses((status = 200, description = "the shard"), (status = 206, description = "a range of it"),
        (status = 403, description = "bad, expired or foreign link"), (status = 404, description = "absent"),
        (status = 409, description = "not published yet"),
        (status = 410, description = "gone"), (status = 416, description = "range not satisfiable")))]
async fn download_shard(
    State(state): State<AppState>,
    Path((id, n)): Path<(String, u32)>,
    Query(query): Query<LinkQuery>,
    method: Method,
    headers: HeaderMap,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> ApiResult<Response> {
    serve(&state, &id, Object::Shard(n), query.token.as_deref(), &method, &headers, peer).await
}

/// The change file of a table version: its rows changed since the version before, with
/// `_change_type` (Delta Sharing `cdf` files link here).
#[utoipa::path(get, path = "/v1/exports/{id}/changes-file", tag = "downloads",
    params(("id" = String, Path), LinkQuery),
    responses((status = 200, description = "the Parquet change file"), (status = 206, description = "a range of it"),
        (status = 403, description = "bad, expired or foreign link"),
        (status = 404, description = "absent, or the export is not a table version with a change file"),
        (status = 409, description = "not published yet"),
        (status = 410, description = "gone"), (status = 416, description = "range not satisfiable")))]
async fn download_changes(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<LinkQuery>,
    method: Method,
    headers: HeaderMap,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> ApiResult<Response> {
    serve(&state, &id, Object::Changes, query.token.as_deref(), &method, &headers, peer).await
}

/// Authorize, find the object, decide the range; then (GET) take a download slot, read the
/// first bytes, charge the egress quota and stream.
async fn serve(
    state: &AppState,
    id: &str,
    object: Object,
    token: Option<&str>,
    method: &Method,
    headers: &HeaderMap,
    peer: SocketAddr,
) -> ApiResult<Response> {
    let caller = credential(state, id, object, token, headers)?;
    admit(state, &caller)?;
    let download = download::open(&state.pool, &caller, export_id(id)?, object).await?;
    let reply = Reply::decide(headers, &download);
    if method == Method::HEAD {
        return Ok(respond(&download, reply.answer, Body::empty()));
    }
    let slot = state.limits.download_slot(&caller)?;
    // The first bytes are read before anything is charged or answered, so a store that is down
    // gives a clean 503 rather than a cut-off body.
    let bytes = body(&state.store, &download, reply.answer, slot).await?;
    let admitted = charge(state, &caller, &download, &reply, peer).await?;
    let metered = Metered { bytes, sent: 0, pool: state.pool.clone(), tenant: caller.tenant.id.to_string(), admitted };
    Ok(respond(&download, reply.answer, Body::from_stream(metered)))
}

/// A download's body, counting the bytes handed to the connection. When it ends — all sent, the
/// client gone, or the store failed mid-body — what was admitted but not sent is given back
/// (egress, audit entry), however the client reads: ranges, early closes, retries.
struct Metered {
    bytes: BodyStream,
    sent: u64,
    pool: sqlx::PgPool,
    tenant: String,
    admitted: quota::Admitted,
}

impl futures_util::Stream for Metered {
    type Item = std::io::Result<bytes::Bytes>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let polled = self.bytes.poll_next_unpin(cx);
        if let std::task::Poll::Ready(Some(Ok(chunk))) = &polled {
            self.sent += chunk.len() as u64;
        }
        polled
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        metrics::counter!("exportd_egress_bytes_total", "tenant" => self.tenant.clone()).increment(self.sent);
        if self.sent >= self.admitted.bytes {
            return;
        }
        let (pool, tenant, admitted, sent) =
            (self.pool.clone(), std::mem::take(&mut self.tenant), self.admitted, self.sent);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            if let Err(e) = quota::refund_unsent(&pool, &tenant, admitted, sent).await {
                tracing::error!(error = %e, %tenant, "could not give back a download's unsent bytes");
            }
        });
    }
}

/// Who is downloading: the signed link's principal, or the bearer token's.
fn credential(
    state: &AppState,
    id: &str,
    object: Object,
    token: Option<&str>,
    headers: &HeaderMap,
) -> ApiResult<Caller> {
    let Some(token) = token else { return caller_from_headers(state, headers) };
    let linked = caller_from_link(state, token, id, object)?;
    // A link presented together with someone else's bearer token is not theirs to use.
    if headers.contains_key(AUTHORIZATION) {
        let bearer = caller_from_headers(state, headers)?;
        if bearer.tenant.id != linked.tenant.id || bearer.principal.id != linked.principal.id {
            return Err(ApiError::new(StatusCode::FORBIDDEN, "invalid-link", "the link belongs to another principal"));
        }
    }
    Ok(linked)
}

/// The answer to a request's `Range` (and `If-Range`): status, bytes sent, and the range as
/// the audit log records it.
struct Reply {
    answer: RangeAnswer,
    status: StatusCode,
    bytes: u64,
    byte_range: Option<String>,
}

impl Reply {
    fn decide(headers: &HeaderMap, download: &Download) -> Reply {
        let range = headers.get(RANGE).and_then(|v| v.to_str().ok());
        let if_range = headers.get(IF_RANGE).and_then(|v| v.to_str().ok());
        let answer = decide(range, if_range, &download.etag, download.layout.len());
        let (status, bytes, byte_range) = match answer {
            RangeAnswer::Full => (StatusCode::OK, download.layout.len(), None),
            RangeAnswer::Partial { start, end } => {
                (StatusCode::PARTIAL_CONTENT, end - start + 1, Some(format!("{start}-{end}")))
            }
            RangeAnswer::Unsatisfiable => (StatusCode::RANGE_NOT_SATISFIABLE, 0, range.map(str::to_owned)),
        };
        Reply { answer, status, bytes, byte_range }
    }

    fn event<'a>(
        &'a self,
        caller: &'a Caller,
        download: &Download,
        peer: SocketAddr,
        status: StatusCode,
        bytes: u64,
    ) -> AuditEvent<'a> {
        AuditEvent {
            tenant: caller.tenant.id.as_str(),
            principal: caller.principal.id.as_str(),
            action: "downloaded",
            export_id: Some(download.job.id),
            object: Some(download.object.name()),
            byte_range: self.byte_range.clone(),
            status: Some(status.as_u16()),
            address: Some(peer.ip().to_string()),
            bytes: Some(bytes),
        }
    }
}

/// Admits the download within today's egress quota and records it (audit log, metrics); a
/// refusal is counted and audited too.
async fn charge(
    state: &AppState,
    caller: &Caller,
    download: &Download,
    reply: &Reply,
    peer: SocketAddr,
) -> ApiResult<quota::Admitted> {
    let event = reply.event(caller, download, peer, reply.status, reply.bytes);
    match quota::admit_download(&state.pool, &caller.tenant, event, state.clock.now()).await? {
        Ok(admitted) => {
            metrics::counter!("exportd_downloads_total", "status" => reply.status.as_str().to_owned()).increment(1);
            Ok(admitted)
        }
        Err(rejection) => {
            metrics::counter!("exportd_downloads_total", "status" => "429").increment(1);
            audit::record(&state.pool, reply.event(caller, download, peer, StatusCode::TOO_MANY_REQUESTS, 0)).await;
            Err(state.limits.refuse(&caller.tenant.id, rejection).into())
        }
    }
}

/// A link is the caller's credential: its signature and expiry, its binding to this export and
/// object, and its principal (still present and enabled) are all checked.
fn caller_from_link(state: &AppState, token: &str, id: &str, object: Object) -> ApiResult<Caller> {
    let invalid = |detail: &str| ApiError::new(StatusCode::FORBIDDEN, "invalid-link", detail.to_owned());
    let claims = state.links.verify(token, state.clock.unix_seconds()).map_err(|e| match e {
        LinkError::Expired => {
            ApiError::new(StatusCode::FORBIDDEN, "link-expired", "the link has expired; ask for the status again")
        }
        LinkError::Invalid => invalid("the link is not valid"),
        LinkError::UnknownKey => invalid(
            "the link was signed with a key this server does not have (its keys changed since); ask for a new link",
        ),
    })?;
    if Uuid::parse_str(id).ok() != Some(claims.export) || claims.object != object.name() {
        return Err(invalid("the link is for another object"));
    }
    let tenant = state.registry.get(&claims.tenant).ok_or_else(|| invalid("the link is not valid"))?;
    let principal = tenant.principal(&claims.sub).filter(|p| !p.disabled).ok_or_else(|| {
        ApiError::new(StatusCode::FORBIDDEN, "principal-disabled", "the link's principal is disabled or removed")
    })?;
    let caller = Caller { tenant: tenant.clone(), principal: principal.clone() };
    super::extract::in_request_span(&caller);
    Ok(caller)
}

type BodyStream = futures_util::stream::BoxStream<'static, std::io::Result<bytes::Bytes>>;

/// How long a download waits for the store's first bytes before answering 503.
const FIRST_BYTE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// The bytes of `answer`, its first chunk already read; `slot` (the tenant's concurrent-download
/// permit) is held until the body has been sent or the client left (or stalled: the send
/// timeout closes its connection).
async fn body(
    store: &ArtifactStore,
    download: &Download,
    answer: RangeAnswer,
    slot: quota::Slot,
) -> Result<BodyStream, StoreError> {
    let (start, end) = match answer {
        RangeAnswer::Unsatisfiable => return Ok(futures_util::stream::empty().boxed()),
        _ if download.layout.is_empty() => return Ok(futures_util::stream::empty().boxed()),
        RangeAnswer::Full => (0, download.layout.len() - 1),
        RangeAnswer::Partial { start, end } => (start, end),
    };
    let mut bytes = layout::read(store.clone(), download.layout.slice(start, end));
    // A store that hangs (a long outage) is answered with a 503 well before the response
    // deadline, not left to it.
    let first = tokio::time::timeout(FIRST_BYTE_PATIENCE, bytes.try_next()).await.map_err(|_| {
        StoreError::Unavailable(format!("the store sent nothing within {} s", FIRST_BYTE_PATIENCE.as_secs()))
    })??;
    let rest = bytes.map(move |chunk| {
        let _slot = &slot;
        chunk.map_err(|e| {
            tracing::error!(error = %e, "a download stopped: the store failed mid-body");
            std::io::Error::other(e)
        })
    });
    Ok(futures_util::stream::iter(first.map(Ok)).chain(rest).boxed())
}

/// The response for `answer` with `body`.
fn respond(download: &Download, answer: RangeAnswer, body: Body) -> Response {
    let len = download.layout.len();
    let etag = HeaderValue::from_str(&download.etag).expect("hex");
    let (status, start, end) = match answer {
        RangeAnswer::Unsatisfiable => {
            let problem = ApiError::new(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "range-not-satisfiable",
                format!("the object has {len} bytes"),
            );
            let mut response = problem.into_response();
            let headers = response.headers_mut();
            headers.insert(CONTENT_RANGE, HeaderValue::from_str(&format!("bytes */{len}")).expect("ascii"));
            headers.insert(ACCEPT_RANGES, HeaderValue::from_static("bytes"));
            headers.insert(ETAG, etag);
            return response;
        }
        RangeAnswer::Full => (StatusCode::OK, 0, len.saturating_sub(1)),
        RangeAnswer::Partial { start, end } => (StatusCode::PARTIAL_CONTENT, start, end),
    };
    let body_len = if len == 0 { 0 } else { end - start + 1 };
    let disposition = format!("attachment; filename=\"{}\"", download.filename);
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(download.job.format.spec().content_type));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(body_len));
    headers.insert(ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    headers.insert(ETAG, etag);
    headers.insert(CONTENT_DISPOSITION, HeaderValue::from_str(&disposition).expect("ascii file name"));
    if status == StatusCode::PARTIAL_CONTENT {
        headers.insert(CONTENT_RANGE, HeaderValue::from_str(&format!("bytes {start}-{end}/{len}")).expect("ascii"));
    }
    response
}
