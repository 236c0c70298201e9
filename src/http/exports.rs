//! Export jobs over HTTP: create (idempotent), read, list, cancel, manifest.

use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, ETAG, IF_NONE_MATCH, LOCATION};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};
use uuid::Uuid;

use super::error::{ApiError, ApiResult};
use super::extract::{JsonBody, Path, Query};
use super::state::AppState;
use crate::audit::{self, AuditEvent};
use crate::auth::Caller;
use crate::exports::download::Object;
use crate::exports::estimate::Estimate;
use crate::exports::{
    self, Cancel, ExportError, ExportJob, ExportRequest, ExportState, FeedContext, IdempotencyKey, Mode, Revoke,
};
use crate::writers::Format;

const DEFAULT_PAGE: u32 = 50;
const MAX_PAGE: u32 = 200;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_export, list_exports))
        .routes(routes!(estimate_export))
        .routes(routes!(get_export, revoke_export))
        .routes(routes!(cancel_export))
        .routes(routes!(get_manifest))
}

/// The answer to a create: the job, and whether this was a replay of an earlier create.
#[derive(Serialize, ToSchema)]
pub struct CreatedView {
    id: Uuid,
    state: ExportState,
    status_url: String,
    replayed: bool,
}

#[derive(Serialize, ToSchema)]
pub struct ExportView {
    id: Uuid,
    state: ExportState,
    dataset: String,
    format: Format,
    mode: Mode,
    requested_by: String,
    #[serde(with = "time::serde::rfc3339")]
    created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    started_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    finished_at: Option<OffsetDateTime>,
    progress: Progress,
    /// How long to wait before polling again; absent once the job is terminal.
    next_poll_after_seconds: Option<u32>,
    error: Option<ErrorView>,
    status_url: String,
    manifest_url: Option<String>,
    /// On SUCCEEDED: the whole file's size and sha256 (also in the manifest).
    file: Option<FileView>,
    /// When the files will be deleted (SUCCEEDED only).
    #[serde(with = "time::serde::rfc3339::option")]
    expires_at: Option<OffsetDateTime>,
    /// On SUCCEEDED: short-lived signed download links, fresh on every request.
    links: Option<Links>,
    #[serde(with = "time::serde::rfc3339::option")]
    links_expire_at: Option<OffsetDateTime>,
}

#[derive(Serialize, ToSchema)]
pub struct FileView {
    bytes: i64,
    sha256: String,
}

#[derive(Serialize, ToSchema)]
pub struct Links {
    /// The whole export as one gzip file (csv and jsonl; absent for parquet, whose shards are
    /// self-contained files that do not concatenate).
    file: Option<String>,
    /// Links to shards `shards_from`, `shards_from + 1`, … — at most 100 per response.
    shards: Vec<String>,
    shards_from: u32,
    /// The status request that signs the next shards' links, while there are more.
    shards_next: Option<String>,
}

/// Shard links signed per status response.
const SHARD_LINKS_PER_PAGE: u32 = 100;

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StatusParams {
    /// The first shard whose link to sign (default 0); at most 100 shard links per response.
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4_294_967_295_i64)]
    shard_links_from: Option<u32>,
}

#[derive(Serialize, ToSchema)]
pub struct Progress {
    shards_done: i32,
    rows_done: i64,
    bytes_done: i64,
    /// Known once the export has succeeded (the row count at the watermark is not computed up front).
    shards_total: Option<i32>,
    rows_total: Option<i64>,
    /// The rows the export is expected to have: exact once a full export's shards are planned,
    /// before that the estimate taken at creation (see `POST /v1/exports/estimate`).
    rows_total_estimate: Option<u64>,
    /// Seconds until the export is expected to finish, from the rows done so far and their rate;
    /// while RUNNING, once some rows are done.
    eta_seconds: Option<u64>,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorView {
    code: String,
    detail: String,
}

impl ExportView {
    /// The job as its status resource shows it at `now`.
    fn new(job: ExportJob, now: OffsetDateTime) -> Self {
        let done = job.state == ExportState::Succeeded;
        let outlook = job.outlook(now);
        let status_url = format!("/v1/exports/{}", job.id);
        ExportView {
            manifest_url: done.then(|| format!("{status_url}/manifest")),
            next_poll_after_seconds: match job.state {
                ExportState::Queued => Some(5),
                ExportState::Running | ExportState::CancelRequested => Some(2),
                _ => None,
            },
            error: job.error_code.map(|code| ErrorView { code, detail: job.error_detail.unwrap_or_default() }),
            progress: Progress {
                shards_done: job.shards_done,
                rows_done: job.rows_done,
                bytes_done: job.bytes_done,
                shards_total: done.then_some(job.shards_done),
                rows_total: done.then_some(job.rows_done),
                rows_total_estimate: outlook.rows_total_estimate,
                eta_seconds: outlook.eta_seconds,
            },
            file: match (done, job.file_bytes, job.file_sha256) {
                (true, Some(bytes), Some(sha256)) => Some(FileView { bytes, sha256 }),
                _ => None,
            },
            expires_at: if done { job.expires_at } else { None },
            links: None,
            links_expire_at: None,
            id: job.id,
            state: job.state,
            dataset: job.dataset,
            format: job.format,
            mode: job.mode,
            requested_by: job.principal,
            created_at: job.created_at,
            started_at: job.started_at,
            finished_at: job.finished_at,
            status_url,
        }
    }
}

/// Creates an export sealed at a snapshot watermark taken now. Requires `Idempotency-Key`:
/// the same key and request replay the job (200), the same key with another request is 422.
#[utoipa::path(post, path = "/v1/exports", tag = "exports", security(("bearer" = [])),
    request_body = ExportRequest,
    params(("Idempotency-Key" = String, Header, description = "1-255 visible ASCII characters",
        min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$")),
    responses(
        (status = 202, body = CreatedView, description = "created; `Location` names the status resource"),
        (status = 200, body = CreatedView, description = "replay of an earlier create with this key"),
        (status = 400, description = "missing/invalid Idempotency-Key or body, or no such dataset (`field` names it)"),
        (status = 403, description = "dataset not granted"),
        (status = 422, description = "Idempotency-Key reused with a different request")))]
async fn create_export(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    JsonBody(request): JsonBody<ExportRequest>,
) -> ApiResult<Response> {
    let key = idempotency_key(&headers)?;
    let database = crate::history::Database::identify(&state.pool).await?;
    let feed = FeedContext { keys: &state.links, database: &database, now: state.clock.now() };
    let created = exports::create(&state.pool, &caller, &key, &request, &feed).await.inspect_err(|e| match e {
        ExportError::IdempotencyKeyReused => metrics::counter!("exportd_idempotency_conflicts_total").increment(1),
        ExportError::Rejected(rejection) => state.limits.refusals.count(&caller.tenant.id, rejection.kind()),
        _ => {}
    })?;
    if created.replayed {
        metrics::counter!("exportd_idempotency_replays_total").increment(1);
    }
    let job = created.job;
    tracing::Span::current().record("export", tracing::field::display(job.id));
    if !created.replayed {
        audit::record(&state.pool, event(&caller, "created", job.id)).await;
    }
    let status_url = format!("/v1/exports/{}", job.id);
    let body = CreatedView { id: job.id, state: job.state, status_url: status_url.clone(), replayed: created.replayed };
    let status = if created.replayed { StatusCode::OK } else { StatusCode::ACCEPTED };
    let location = HeaderValue::from_str(&status_url).expect("a path is a valid header");
    Ok((status, [(LOCATION, location)], axum::Json(body)).into_response())
}

/// What an export with this body would be if created now: rows, bytes, shards and duration,
/// each with the method that estimated it. Validates and authorizes like a create; nothing is
/// queued and no Idempotency-Key is needed.
#[utoipa::path(post, path = "/v1/exports/estimate", tag = "exports", security(("bearer" = [])),
    request_body = ExportRequest,
    responses(
        (status = 200, body = Estimate, description = "an estimate; nothing was created"),
        (status = 400, description = "invalid body, no such dataset or bad cursor (`field` names it)"),
        (status = 403, description = "dataset not granted"),
        (status = 429, description = "rate limited, or another of the tenant's estimates is running (`estimate-in-progress`)")))]
async fn estimate_export(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(request): JsonBody<ExportRequest>,
) -> ApiResult<axum::Json<Estimate>> {
    let _slot = state.limits.estimate_slot(&caller)?;
    let database = crate::history::Database::identify(&state.pool).await?;
    let feed = FeedContext { keys: &state.links, database: &database, now: state.clock.now() };
    Ok(axum::Json(exports::estimate::estimate(&state.pool, &state.replicas, &caller, &request, &feed).await?))
}

fn idempotency_key(headers: &HeaderMap) -> ApiResult<IdempotencyKey> {
    let raw = headers.get("idempotency-key").ok_or_else(|| {
        ApiError::new(StatusCode::BAD_REQUEST, "idempotency-key-required", "send an Idempotency-Key header")
            .with("field", "Idempotency-Key")
    })?;
    let text = raw.to_str().unwrap_or("\u{0}");
    IdempotencyKey::parse(text).map_err(|detail| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid-idempotency-key", format!("Idempotency-Key {detail}"))
            .with("field", "Idempotency-Key")
    })
}

/// One export's state and progress. 404 when it does not exist or is not the caller's to see.
#[utoipa::path(get, path = "/v1/exports/{id}", tag = "exports", security(("bearer" = [])),
    params(("id" = String, Path), StatusParams),
    responses((status = 200, body = ExportView), (status = 404, description = "absent or not visible")))]
async fn get_export(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(params): Query<StatusParams>,
) -> ApiResult<axum::Json<ExportView>> {
    let job = exports::get(&state.pool, &caller, export_id(&id)?).await?;
    let from = params.shard_links_from.unwrap_or(0);
    let links = (job.state == ExportState::Succeeded).then(|| sign_links(&state, &caller, &job, from));
    let mut view = ExportView::new(job, state.clock.now());
    if let Some((links, expire_at)) = links {
        view.links = Some(links);
        view.links_expire_at = Some(expire_at);
    }
    Ok(axum::Json(view))
}

/// Links for the whole file and a page of shards from `from`, bound to the caller and this export.
fn sign_links(state: &AppState, caller: &Caller, job: &ExportJob, from: u32) -> (Links, OffsetDateTime) {
    let now = state.clock.unix_seconds();
    let sign = |object: Object| {
        let (tenant, principal) = (caller.tenant.id.as_str(), caller.principal.id.as_str());
        let token = state.links.sign(tenant, principal, job.id, &object.name(), now, state.link_ttl);
        format!("/v1/exports/{}/{}?token={token}", job.id, object.path())
    };
    let total = job.shards_done.max(0) as u32;
    let until = from.saturating_add(SHARD_LINKS_PER_PAGE).min(total);
    let shards = (from..until).map(|n| sign(Object::Shard(n))).collect();
    let shards_next = (until < total).then(|| format!("/v1/exports/{}?shard_links_from={until}", job.id));
    let file = job.format.spec().spliceable().then(|| sign(Object::File));
    let links = Links { file, shards, shards_from: from, shards_next };
    let expire_at = OffsetDateTime::from_unix_timestamp((now + state.link_ttl.as_secs()) as i64)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH);
    (links, expire_at)
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Only jobs in this state.
    #[param(pattern = "^(QUEUED|RUNNING|CANCEL_REQUESTED|SUCCEEDED|FAILED|CANCELLED|EXPIRED|REVOKED)$")]
    state: Option<String>,
    /// `next_cursor` of the previous page: an opaque token this API handed out (any other text
    /// is refused with 400 naming `cursor`).
    #[param(min_length = 1)]
    cursor: Option<String>,
    /// Page size, 1 to 200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    limit: Option<u32>,
}

#[derive(Serialize, ToSchema)]
pub struct ExportList {
    exports: Vec<ExportView>,
    next_cursor: Option<String>,
}

/// The caller's exports (admins: the tenant's), newest first.
#[utoipa::path(get, path = "/v1/exports", tag = "exports", security(("bearer" = [])),
    params(ListParams), responses((status = 200, body = ExportList), (status = 400, description = "bad state, cursor or limit")))]
async fn list_exports(
    State(state): State<AppState>,
    caller: Caller,
    Query(params): Query<ListParams>,
) -> ApiResult<axum::Json<ExportList>> {
    let wanted = params
        .state
        .as_deref()
        .map(|s| {
            ExportState::parse(s)
                .ok_or_else(|| ApiError::invalid_field("state", format!("must be one of {}", export_state_names())))
        })
        .transpose()?;
    let limit = params.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid_field("limit", format!("must be between 1 and {MAX_PAGE}")));
    }
    let page = exports::list(&state.pool, &caller, wanted, params.cursor.as_deref(), limit).await?;
    Ok(axum::Json(ExportList {
        exports: page.jobs.into_iter().map(|job| ExportView::new(job, state.clock.now())).collect(),
        next_cursor: page.next_cursor,
    }))
}

/// Asks the workers to stop: QUEUED or RUNNING → CANCEL_REQUESTED (202), later CANCELLED.
#[utoipa::path(post, path = "/v1/exports/{id}/cancel", tag = "exports", security(("bearer" = [])),
    params(("id" = String, Path)),
    responses((status = 202, body = ExportView), (status = 200, body = ExportView, description = "already cancelling or cancelled"),
        (status = 404, description = "absent or not visible"), (status = 409, description = "already-terminal")))]
async fn cancel_export(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> ApiResult<Response> {
    let (status, job) = match exports::cancel(&state.pool, &caller, export_id(&id)?).await? {
        Cancel::Requested(job) => {
            audit::record(&state.pool, event(&caller, "cancelled", job.id)).await;
            (StatusCode::ACCEPTED, job)
        }
        Cancel::AlreadyCancelling(job) => (StatusCode::OK, job),
    };
    Ok((status, axum::Json(ExportView::new(job, state.clock.now()))).into_response())
}

/// Revokes a SUCCEEDED export (tenant admins): state REVOKED, files deleted, downloads 410.
#[utoipa::path(delete, path = "/v1/exports/{id}", tag = "exports", security(("bearer" = [])),
    params(("id" = String, Path)),
    responses((status = 200, body = ExportView, description = "revoked (also when it already was)"),
        (status = 403, description = "not a tenant admin"), (status = 404, description = "absent or not visible"),
        (status = 409, description = "not-revocable: not SUCCEEDED")))]
async fn revoke_export(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<axum::Json<ExportView>> {
    if !caller.principal.is_admin() {
        return Err(ApiError::forbidden("only tenant admins can revoke exports"));
    }
    let job = match exports::revoke(&state.pool, &state.store, &caller, export_id(&id)?).await? {
        Revoke::Revoked(job) => {
            audit::record(&state.pool, event(&caller, "revoked", job.id)).await;
            job
        }
        Revoke::AlreadyRevoked(job) => job,
    };
    Ok(axum::Json(ExportView::new(job, state.clock.now())))
}

fn event<'a>(caller: &'a Caller, action: &'a str, id: Uuid) -> AuditEvent<'a> {
    AuditEvent {
        tenant: caller.tenant.id.as_str(),
        principal: caller.principal.id.as_str(),
        action,
        export_id: Some(id),
        ..AuditEvent::default()
    }
}

/// The immutable manifest, byte for byte as published; `ETag` is its sha256.
#[utoipa::path(get, path = "/v1/exports/{id}/manifest", tag = "exports", security(("bearer" = [])),
    params(("id" = String, Path)),
    responses((status = 200, description = "the manifest JSON"), (status = 304, description = "If-None-Match matched"),
        (status = 404, description = "absent or not visible"), (status = 409, description = "not SUCCEEDED yet"),
        (status = 410, description = "revoked or expired")))]
async fn get_manifest(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let (bytes, sha256) = exports::manifest(&state.pool, &caller, export_id(&id)?).await?;
    let etag = HeaderValue::from_str(&format!("\"{sha256}\"")).expect("hex is a valid header");
    let matches = headers
        .get(IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|tag| tag.trim() == etag.to_str().unwrap_or_default() || tag.trim() == "*"));
    if matches {
        return Ok((StatusCode::NOT_MODIFIED, [(ETAG, etag)]).into_response());
    }
    Ok(([(CONTENT_TYPE, HeaderValue::from_static("application/json")), (ETAG, etag)], bytes).into_response())
}

/// A malformed id is answered like a missing export. A valid one names the export in the
/// request's span (so one export can be followed through the API's logs and the worker's).
pub(super) fn export_id(text: &str) -> ApiResult<Uuid> {
    let id = Uuid::parse_str(text).map_err(|_| ApiError::from(ExportError::NotFound))?;
    tracing::Span::current().record("export", tracing::field::display(id));
    Ok(id)
}

impl From<ExportError> for ApiError {
    fn from(e: ExportError) -> Self {
        let detail = e.to_string();
        match e {
            ExportError::InvalidField { field, detail } => ApiError::invalid_field(field, detail),
            ExportError::NoWholeFile(format) => {
                ApiError::new(StatusCode::NOT_FOUND, "no-whole-file", detail).with("format", format.name())
            }
            // A bad value in the body, not a missing resource: the request names it.
            ExportError::DatasetNotFound => ApiError::invalid_field("dataset", detail),
            ExportError::DatasetNotGranted => ApiError::new(StatusCode::FORBIDDEN, "dataset-not-granted", detail),
            ExportError::IdempotencyKeyReused => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused", detail)
            }
            ExportError::NotFound => ApiError::not_found(detail),
            ExportError::AlreadyTerminal(state) => {
                ApiError::new(StatusCode::CONFLICT, "already-terminal", detail).with("state", state.as_str())
            }
            ExportError::NotPublished(state) => {
                ApiError::new(StatusCode::CONFLICT, "not-ready", detail).with("state", state.as_str())
            }
            ExportError::InvalidCursor { field, .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid-cursor", detail).with("field", field)
            }
            ExportError::CursorExpired(_) => ApiError::new(StatusCode::GONE, "cursor-expired", detail),
            ExportError::CursorHistory(e) => super::feeds::cursor_problem(e),
            ExportError::RowFilterChanged => ApiError::new(StatusCode::FORBIDDEN, "row-filter-changed", detail),
            ExportError::ColumnPolicyChanged => ApiError::new(StatusCode::FORBIDDEN, "column-policy-changed", detail),
            ExportError::Rejected(rejection) => rejection.into(),
            ExportError::IncrementalInProgress => {
                ApiError::new(StatusCode::CONFLICT, "incremental-in-progress", detail)
            }
            ExportError::BackfillRunning => ApiError::new(StatusCode::CONFLICT, "backfill-running", detail),
            ExportError::CaptureLost => ApiError::new(StatusCode::CONFLICT, "capture-lost", detail),
            ExportError::NotRevocable(state) => {
                ApiError::new(StatusCode::CONFLICT, "not-revocable", detail).with("state", state.as_str())
            }
            ExportError::Gone(state) => {
                ApiError::new(StatusCode::GONE, "export-gone", detail).with("state", state.as_str())
            }
            ExportError::Database(e) => e.into(),
        }
    }
}

/// The states a list may be filtered by, as the problem detail names them.
fn export_state_names() -> String {
    ExportState::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
}
