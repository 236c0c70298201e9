//! Delta Sharing over HTTP, under `/delta-sharing` (the protocol's REST API, so pandas, Spark,
//! DuckDB and Power BI read a principal's share with their own connectors), and
//! `GET /v1/sharing/profile` (the profile file those connectors take).
//!
//! Handlers answer with [`ApiError`] like every other route; one layer turns those problems
//! into the protocol's `{"errorCode", "message"}` bodies (see [`as_protocol_error`]).

use axum::body::Body;
use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, HOST};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::extract::{Path, Query, bearer_token_of};
use super::state::AppState;
use crate::auth::Caller;
use crate::exports::ShardRecord;
use crate::exports::download::Object;
use crate::exports::{self, ExportError, ExportJob};
use crate::sharing::{
    ChangeFile, FileAction, FileKind, Share, ShareVersion, TableMetadata, VersionError, Which, file_stats, predicate,
    predicate::Predicate,
};
use crate::tenants::DatasetName;
use crate::writers::OutputColumn;

/// Where the protocol's endpoints live (a profile's `endpoint` ends with it).
pub const PREFIX: &str = "/delta-sharing";
const TABLE_VERSION: &str = "delta-table-version";
const NDJSON: &str = "application/x-ndjson; charset=utf-8";
/// Page size of the listings when the client names none, and the most it may ask for.
const DEFAULT_PAGE: usize = 500;
const MAX_PAGE: usize = 1000;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_shares))
        .routes(routes!(get_share))
        .routes(routes!(list_schemas))
        .routes(routes!(list_tables))
        .routes(routes!(list_all_tables))
        .routes(routes!(table_version))
        .routes(routes!(table_metadata))
        .routes(routes!(query_table))
        .routes(routes!(table_changes))
        .layer(axum::middleware::map_response(as_protocol_error))
}

pub fn profile_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(profile))
}

// ---- listings -------------------------------------------------------------------------------

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct Paging {
    /// Items per page, 1 to 1000 (default 500).
    #[serde(rename = "maxResults")]
    #[param(minimum = 1, maximum = 1000)]
    max_results: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(rename = "pageToken")]
    page_token: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct Page<T: ToSchema> {
    items: Vec<T>,
    #[serde(rename = "nextPageToken", skip_serializing_if = "Option::is_none")]
    next_page_token: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct ShareItem {
    name: String,
    id: String,
}

#[derive(Serialize, ToSchema)]
pub struct ShareView {
    share: ShareItem,
}

#[derive(Serialize, ToSchema)]
pub struct SchemaItem {
    name: String,
    share: String,
}

#[derive(Serialize, ToSchema)]
pub struct TableItem {
    name: String,
    schema: String,
    share: String,
    #[serde(rename = "shareId")]
    share_id: String,
    id: String,
}

/// One page of `items` (sorted by name) after `paging`'s token.
fn page<T: ToSchema>(items: Vec<T>, name: impl Fn(&T) -> &str, paging: &Paging) -> ApiResult<Page<T>> {
    const MARK: &str = "exportd:";
    let size = match paging.max_results {
        None => DEFAULT_PAGE,
        Some(n) if (1..=MAX_PAGE as i64).contains(&n) => n as usize,
        Some(_) => return Err(ApiError::invalid_field("maxResults", format!("must be between 1 and {MAX_PAGE}"))),
    };
    let after = match paging.page_token.as_deref() {
        None | Some("") => None,
        Some(token) => {
            let text = URL_SAFE_NO_PAD.decode(token).ok().and_then(|bytes| String::from_utf8(bytes).ok());
            let start = text.as_deref().and_then(|t| t.strip_prefix(MARK)).map(str::to_owned);
            Some(start.ok_or_else(|| ApiError::invalid_field("pageToken", "not a nextPageToken of this listing"))?)
        }
    };
    let mut rest: Vec<T> = items.into_iter().filter(|item| after.as_deref().is_none_or(|a| name(item) >= a)).collect();
    let next_page_token = (rest.len() > size).then(|| URL_SAFE_NO_PAD.encode(format!("{MARK}{}", name(&rest[size]))));
    rest.truncate(size);
    Ok(Page { items: rest, next_page_token })
}

fn not_found(what: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not-found", format!("no such {what}, or not shared with you"))
}

fn share_item(share: &Share) -> ShareItem {
    ShareItem { name: share.name().to_owned(), id: share.id() }
}

fn table_item(share: &Share, table: &DatasetName) -> TableItem {
    TableItem {
        name: table.to_string(),
        schema: share.schema().to_owned(),
        share: share.name().to_owned(),
        share_id: share.id(),
        id: share.table_id(table),
    }
}

/// The shares the caller may read: its own.
#[utoipa::path(get, path = "/delta-sharing/shares", tag = "sharing", security(("bearer" = [])), params(Paging),
    responses((status = 200, body = Page<ShareItem>)))]
async fn list_shares(caller: Caller, Query(paging): Query<Paging>) -> ApiResult<axum::Json<Page<ShareItem>>> {
    let share = Share::of(&caller);
    Ok(axum::Json(page(vec![share_item(&share)], |s| s.name.as_str(), &paging)?))
}

#[utoipa::path(get, path = "/delta-sharing/shares/{share}", tag = "sharing", security(("bearer" = [])),
    params(("share" = String, Path)),
    responses((status = 200, body = ShareView), (status = 404, description = "RESOURCE_DOES_NOT_EXIST")))]
async fn get_share(caller: Caller, Path(name): Path<String>) -> ApiResult<axum::Json<ShareView>> {
    let share = Share::of(&caller);
    if !share.is(&name, None) {
        return Err(not_found("share"));
    }
    Ok(axum::Json(ShareView { share: share_item(&share) }))
}

#[utoipa::path(get, path = "/delta-sharing/shares/{share}/schemas", tag = "sharing", security(("bearer" = [])),
    params(("share" = String, Path), Paging),
    responses((status = 200, body = Page<SchemaItem>), (status = 404, description = "RESOURCE_DOES_NOT_EXIST")))]
async fn list_schemas(
    caller: Caller,
    Path(name): Path<String>,
    Query(paging): Query<Paging>,
) -> ApiResult<axum::Json<Page<SchemaItem>>> {
    let share = Share::of(&caller);
    if !share.is(&name, None) {
        return Err(not_found("share"));
    }
    let schema = SchemaItem { name: share.schema().to_owned(), share: share.name().to_owned() };
    Ok(axum::Json(page(vec![schema], |s| s.name.as_str(), &paging)?))
}

#[utoipa::path(get, path = "/delta-sharing/shares/{share}/schemas/{schema}/tables", tag = "sharing",
    security(("bearer" = [])), params(("share" = String, Path), ("schema" = String, Path), Paging),
    responses((status = 200, body = Page<TableItem>), (status = 404, description = "RESOURCE_DOES_NOT_EXIST")))]
async fn list_tables(
    caller: Caller,
    Path((name, schema)): Path<(String, String)>,
    Query(paging): Query<Paging>,
) -> ApiResult<axum::Json<Page<TableItem>>> {
    tables_page(&caller, &name, Some(&schema), &paging)
}

#[utoipa::path(get, path = "/delta-sharing/shares/{share}/all-tables", tag = "sharing", security(("bearer" = [])),
    params(("share" = String, Path), Paging),
    responses((status = 200, body = Page<TableItem>), (status = 404, description = "RESOURCE_DOES_NOT_EXIST")))]
async fn list_all_tables(
    caller: Caller,
    Path(name): Path<String>,
    Query(paging): Query<Paging>,
) -> ApiResult<axum::Json<Page<TableItem>>> {
    tables_page(&caller, &name, None, &paging)
}

/// A page of the share's tables (of `schema`, when given: the share has one).
fn tables_page(
    caller: &Caller,
    name: &str,
    schema: Option<&str>,
    paging: &Paging,
) -> ApiResult<axum::Json<Page<TableItem>>> {
    let share = Share::of(caller);
    if !share.is(name, schema) {
        return Err(not_found(if schema.is_some() { "share or schema" } else { "share" }));
    }
    let tables = share.tables().into_iter().map(|t| table_item(&share, t)).collect();
    Ok(axum::Json(page(tables, |t| t.name.as_str(), paging)?))
}

// ---- one table ------------------------------------------------------------------------------

/// `share.schema.table` of the path, if the caller may read it.
fn table<'a>(share: &Share<'a>, (name, schema, table): &(String, String, String)) -> ApiResult<&'a DatasetName> {
    share.table(name, schema, table).ok_or_else(|| not_found("share, schema or table"))
}

fn timestamp_param(field: &str, text: &str) -> ApiResult<OffsetDateTime> {
    OffsetDateTime::parse(text, &Rfc3339).map_err(|_| {
        ApiError::invalid_field(
            field.to_owned(),
            "must be an ISO 8601 timestamp with a zone, e.g. 2026-12-05T10:00:00Z",
        )
    })
}

fn version_param(field: &str, version: i64) -> ApiResult<i64> {
    if version < 0 {
        return Err(ApiError::invalid_field(field.to_owned(), "must be 0 or more"));
    }
    Ok(version)
}

/// Which version at most one of `version` and `timestamp` names.
fn which(version: Option<i64>, timestamp: Option<&str>) -> ApiResult<Which> {
    match (version, timestamp) {
        (Some(_), Some(_)) => Err(ApiError::invalid_field("version", "give at most one of version and timestamp")),
        (Some(v), None) => Ok(Which::Number(version_param("version", v)?)),
        (None, Some(t)) => Ok(Which::AsOf(timestamp_param("timestamp", t)?)),
        (None, None) => Ok(Which::Latest),
    }
}

impl From<VersionError> for ApiError {
    fn from(e: VersionError) -> Self {
        match e {
            VersionError::Database(e) => e.into(),
            VersionError::NoVersion => ApiError::new(StatusCode::NOT_FOUND, "no-table-version", e.to_string()),
            VersionError::LostInFailover { .. } => {
                ApiError::new(StatusCode::GONE, "version-lost-in-failover", e.to_string())
            }
            VersionError::TooMany { .. } => ApiError::invalid_field("endingVersion", e.to_string()),
            other => ApiError::invalid_field("version", other.to_string()),
        }
    }
}

/// A version's export, if the caller may still read its files, and its columns.
async fn version_export(
    state: &AppState,
    caller: &Caller,
    version: &ShareVersion,
) -> ApiResult<(ExportJob, Vec<OutputColumn>)> {
    let job = exports::get(&state.pool, caller, version.export_id).await?;
    exports::ensure_published(caller, &job).map_err(|e| match e {
        ExportError::Gone(state) => ApiError::invalid_field(
            "version",
            format!("version {} is no longer retained: its export is {}", version.version, state.as_str()),
        ),
        ExportError::RowFilterChanged | ExportError::ColumnPolicyChanged => ApiError::new(
            StatusCode::FORBIDDEN,
            "view-changed",
            format!(
                "{e} Version {} was cut before that: a newer full Parquet export makes the next version",
                version.version
            ),
        ),
        other => other.into(),
    })?;
    let columns = serde_json::from_value(job.columns.clone()).map_err(anyhow::Error::from)?;
    Ok((job, columns))
}

fn with_version(mut response: Response, version: i64) -> Response {
    response.headers_mut().insert(TABLE_VERSION, HeaderValue::from(version));
    response
}

fn ndjson(body: String, version: i64) -> Response {
    with_version(([(CONTENT_TYPE, NDJSON)], body).into_response(), version)
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct VersionParams {
    /// The oldest version whose snapshot is at or after this time (ISO 8601) instead of the latest.
    #[serde(rename = "startingTimestamp")]
    starting_timestamp: Option<String>,
}

/// The table's latest version (or the first at or after `startingTimestamp`) in the
/// `Delta-Table-Version` header.
#[utoipa::path(get, path = "/delta-sharing/shares/{share}/schemas/{schema}/tables/{table}/version", tag = "sharing",
    security(("bearer" = [])),
    params(("share" = String, Path), ("schema" = String, Path), ("table" = String, Path), VersionParams),
    responses((status = 200, description = "the version, in `Delta-Table-Version`"),
        (status = 404, description = "RESOURCE_DOES_NOT_EXIST: no such table, or no version published yet")))]
async fn table_version(
    State(state): State<AppState>,
    caller: Caller,
    Path(path): Path<(String, String, String)>,
    Query(params): Query<VersionParams>,
) -> ApiResult<Response> {
    let share = Share::of(&caller);
    let table = table(&share, &path)?;
    let (tenant, principal) = (caller.tenant.id.as_str(), caller.principal.id.as_str());
    let version = match params.starting_timestamp.as_deref() {
        Some(text) => {
            let at = timestamp_param("startingTimestamp", text)?;
            crate::sharing::version_at_or_after(&state.pool, tenant, principal, table.as_str(), at).await?
        }
        None => crate::sharing::resolve(&state.pool, tenant, principal, table.as_str(), Which::Latest).await?,
    };
    Ok(with_version(StatusCode::OK.into_response(), version.version))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MetadataParams {
    /// A version instead of the latest.
    #[param(minimum = 0)]
    version: Option<i64>,
    /// The newest version at or before this time (ISO 8601) instead of the latest.
    timestamp: Option<String>,
}

/// The protocol line and the version's `metaData` (its schema), as NDJSON.
#[utoipa::path(get, path = "/delta-sharing/shares/{share}/schemas/{schema}/tables/{table}/metadata", tag = "sharing",
    security(("bearer" = [])),
    params(("share" = String, Path), ("schema" = String, Path), ("table" = String, Path), MetadataParams),
    responses((status = 200, description = "NDJSON: protocol, metaData", content_type = "application/x-ndjson"),
        (status = 404, description = "RESOURCE_DOES_NOT_EXIST")))]
async fn table_metadata(
    State(state): State<AppState>,
    caller: Caller,
    Path(path): Path<(String, String, String)>,
    Query(params): Query<MetadataParams>,
) -> ApiResult<Response> {
    let share = Share::of(&caller);
    let table = table(&share, &path)?;
    let which = which(params.version, params.timestamp.as_deref())?;
    let (tenant, principal) = (caller.tenant.id.as_str(), caller.principal.id.as_str());
    let version = crate::sharing::resolve(&state.pool, tenant, principal, table.as_str(), which).await?;
    let (job, columns) = version_export(&state, &caller, &version).await?;
    let metadata = metadata(&share, table, &version, &job, &columns);
    Ok(ndjson(metadata.lines(), version.version))
}

fn metadata(
    share: &Share,
    table: &DatasetName,
    version: &ShareVersion,
    job: &ExportJob,
    columns: &[OutputColumn],
) -> TableMetadata {
    TableMetadata::new(
        share.table_id(table),
        table.to_string(),
        columns,
        version.version,
        job.bytes_done,
        i64::from(job.shards_done),
    )
}

/// `POST …/query`: every field optional. Hints only let the server leave files out; the rows
/// a client keeps never depend on them.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueryRequest {
    /// SQL-like predicates (the protocol's older hints): accepted, not used.
    #[serde(rename = "predicateHints")]
    _predicate_hints: Option<Vec<String>>,
    /// A JSON predicate tree (text): files whose statistics prove no row matches are left out.
    json_predicate_hints: Option<String>,
    /// Enough files for at least this many rows are returned (all when absent).
    #[schema(minimum = 0)]
    limit_hint: Option<i64>,
    #[schema(minimum = 0)]
    version: Option<i64>,
    timestamp: Option<String>,
    /// Not supported: ask `GET …/changes` for what changed between versions.
    #[schema(minimum = 0)]
    starting_version: Option<i64>,
    #[schema(minimum = 0)]
    ending_version: Option<i64>,
}

/// The version's files: protocol, metaData, then one `file` line per Parquet file, each with a
/// signed link (`url`, `Range` supported, valid until `expirationTimestamp`) and statistics.
#[utoipa::path(post, path = "/delta-sharing/shares/{share}/schemas/{schema}/tables/{table}/query", tag = "sharing",
    security(("bearer" = [])),
    params(("share" = String, Path), ("schema" = String, Path), ("table" = String, Path)),
    request_body = Option<QueryRequest>,
    responses((status = 200, description = "NDJSON: protocol, metaData, file…", content_type = "application/x-ndjson"),
        (status = 404, description = "RESOURCE_DOES_NOT_EXIST")))]
async fn query_table(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(path): Path<(String, String, String)>,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    let share = Share::of(&caller);
    let table = table(&share, &path)?;
    let (request, hint) = query_request(&body)?;
    if request.starting_version.is_some() || request.ending_version.is_some() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "unsupported-operation",
            "startingVersion/endingVersion in a query are not supported: GET …/changes gives what changed between versions",
        )
        .with("field", "startingVersion"));
    }
    let which = which(request.version, request.timestamp.as_deref())?;
    // Judging a version's files and signing a link per file costs CPU in proportion to the
    // version's files and the client's hint: in the tenant's turn on the CPU.
    let _turn = state.limits.cpu_turn(&caller).await?;
    let (tenant, principal) = (caller.tenant.id.as_str(), caller.principal.id.as_str());
    let version = crate::sharing::resolve(&state.pool, tenant, principal, table.as_str(), which).await?;
    let (job, columns) = version_export(&state, &caller, &version).await?;
    let shards = exports::store::shards::all(&state.pool, job.id).await?;
    let (shards, keep) = match hint {
        None => {
            let keep = vec![true; shards.len()];
            (shards, keep)
        }
        // Judging files costs CPU in proportion to the client's hint: off the async runtime,
        // within the predicate's budget.
        Some(hint) => tokio::task::spawn_blocking(move || {
            let files = shards.iter().map(|shard| shard.stats.as_ref().map(|s| s.0.as_slice()).unwrap_or_default());
            let keep = hint.keep(files, predicate::BUDGET);
            (shards, keep)
        })
        .await
        .map_err(|e| ApiError::internal(anyhow::anyhow!("judging predicate hints: {e}")))?,
    };
    let mut body = metadata(&share, table, &version, &job, &columns).lines();
    let links = FileLinks::new(&state, &caller, &headers)?;
    let mut rows = 0i64;
    for (shard, _) in shards.iter().zip(keep).filter(|(_, keep)| *keep) {
        if request.limit_hint.is_some_and(|limit| rows >= limit) {
            break;
        }
        rows += shard.rows;
        body.push_str(&links.action(&version, &job, &columns, shard).line(FileKind::File));
    }
    Ok(ndjson(body, version.version))
}

/// A version's timestamp as the protocol has it: milliseconds since the epoch.
fn millis(version: &ShareVersion) -> i64 {
    (version.snapshot_at.unix_timestamp_nanos() / 1_000_000) as i64
}

/// Signs file URLs for the caller: the shard download links, valid for the link lifetime.
struct FileLinks<'a> {
    state: &'a AppState,
    caller: &'a Caller,
    base: String,
    now: u64,
}

impl<'a> FileLinks<'a> {
    fn new(state: &'a AppState, caller: &'a Caller, headers: &HeaderMap) -> ApiResult<Self> {
        Ok(FileLinks { state, caller, base: public_base(state, headers)?, now: state.clock.unix_seconds() })
    }

    /// The action of one shard file of `version`'s export.
    fn action(
        &self,
        version: &ShareVersion,
        job: &ExportJob,
        columns: &[OutputColumn],
        shard: &ShardRecord,
    ) -> FileAction {
        let stats = file_stats(shard.rows, shard.stats.as_ref().map(|s| s.0.as_slice()), columns);
        let object = Object::Shard(shard.shard_index as u32);
        self.file(version, job, object, &shard.sha256, shard.bytes, Some(stats))
    }

    /// The action of `version`'s change file (a `cdf` line).
    fn change_action(&self, version: &ShareVersion, job: &ExportJob, file: &ChangeFile) -> FileAction {
        self.file(version, job, Object::Changes, &file.sha256, file.bytes, None)
    }

    fn file(
        &self,
        version: &ShareVersion,
        job: &ExportJob,
        object: Object,
        sha256: &str,
        size: i64,
        stats: Option<String>,
    ) -> FileAction {
        let (tenant, principal) = (self.caller.tenant.id.as_str(), self.caller.principal.id.as_str());
        let ttl = self.state.link_ttl;
        let token = self.state.links.sign(tenant, principal, job.id, &object.name(), self.now, ttl);
        FileAction {
            url: format!("{}/v1/exports/{}/{}?token={token}", self.base, job.id, object.path()),
            id: sha256.to_owned(),
            partition_values: Default::default(),
            size,
            stats,
            version: version.version,
            timestamp: millis(version),
            expiration_timestamp: (self.now + ttl.as_secs()) as i64 * 1000,
        }
    }
}

/// The largest query body read.
const MAX_QUERY_BODY: usize = 1 << 20;

/// The body of a query (empty means `{}`) and its predicate tree, checked for form and size.
fn query_request(body: &[u8]) -> ApiResult<(QueryRequest, Option<Predicate>)> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok((QueryRequest::default(), None));
    }
    // A hint's text is at most 64 KiB: a query body has no use for more, and parsing is not free.
    if body.len() > MAX_QUERY_BODY {
        return Err(ApiError::invalid_field("body", format!("must be at most {MAX_QUERY_BODY} bytes")));
    }
    // A JSON object only: serde would also read a struct from an array of its fields in order.
    let object: serde_json::Map<String, Value> = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid-body",
            match e.classify() {
                serde_json::error::Category::Data => "the query body must be a JSON object",
                _ => "the query body is not valid JSON",
            },
        )
        .with("field", "body")
    })?;
    let request: QueryRequest = serde_json::from_value(Value::Object(object)).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid-body",
            match e.classify() {
                serde_json::error::Category::Data => "a field of the query body has the wrong type",
                _ => "the query body is not valid JSON",
            },
        )
        .with("field", "body")
    })?;
    if request.limit_hint.is_some_and(|n| n < 0) {
        return Err(ApiError::invalid_field("limitHint", "must be 0 or more"));
    }
    let hint = request
        .json_predicate_hints
        .as_deref()
        .map(Predicate::parse)
        .transpose()
        .map_err(|e| ApiError::invalid_field("jsonPredicateHints", e))?;
    Ok((request, hint))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ChangesParams {
    /// The first version whose changes are returned (or `startingTimestamp`).
    #[serde(rename = "startingVersion")]
    #[param(minimum = 0)]
    starting_version: Option<i64>,
    /// The oldest version at or after this time (ISO 8601) is the first.
    #[serde(rename = "startingTimestamp")]
    starting_timestamp: Option<String>,
    /// The last version (default: the latest; or `endingTimestamp`).
    #[serde(rename = "endingVersion")]
    #[param(minimum = 0)]
    ending_version: Option<i64>,
    /// The newest version at or before this time (ISO 8601) is the last.
    #[serde(rename = "endingTimestamp")]
    ending_timestamp: Option<String>,
    /// Accepted; every file carries its own version's columns.
    #[serde(rename = "includeHistoricalMetadata")]
    _include_historical_metadata: Option<String>,
}

/// Versions one change request may span: its answer holds every file of the range.
const MAX_CHANGE_VERSIONS: usize = 100;
/// File actions one changes response holds at most (each is a signed link, about 1 KiB): a
/// range whose versions hold more is refused, naming the last ending version that fits. One
/// version always fits (an export has at most `max_shards` files, removed and added).
const MAX_CHANGE_FILES: usize = 25_000;

/// What versions `startingVersion..=endingVersion` changed. Version 0 adds every file. A later
/// version answers with its change file (`cdf`): its rows changed since the version before, as
/// `insert`, `update_preimage`/`update_postimage` and `delete`. A version without one (see
/// `sharing::changes`) answers with files instead: those of the version before that it no
/// longer has are removed (their rows are deletes) and its own the version before did not have
/// are added (inserts). Either way, applying a version's changes by key to the version before
/// gives it exactly.
#[utoipa::path(get, path = "/delta-sharing/shares/{share}/schemas/{schema}/tables/{table}/changes", tag = "sharing",
    security(("bearer" = [])),
    params(("share" = String, Path), ("schema" = String, Path), ("table" = String, Path), ChangesParams),
    responses((status = 200, description = "NDJSON: protocol, metaData, add/remove…", content_type = "application/x-ndjson"),
        (status = 404, description = "RESOURCE_DOES_NOT_EXIST")))]
async fn table_changes(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(path): Path<(String, String, String)>,
    Query(params): Query<ChangesParams>,
) -> ApiResult<Response> {
    let share = Share::of(&caller);
    let table = table(&share, &path)?;
    let (tenant, principal, dataset) = (caller.tenant.id.as_str(), caller.principal.id.as_str(), table.as_str());
    let pool = &state.pool;
    let start = match (params.starting_version, params.starting_timestamp.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_field(
                "startingVersion",
                "give one of startingVersion and startingTimestamp",
            ));
        }
        (Some(v), None) => version_param("startingVersion", v)?,
        (None, Some(t)) => {
            let at = timestamp_param("startingTimestamp", t)?;
            crate::sharing::version_at_or_after(pool, tenant, principal, dataset, at).await?.version
        }
        (None, None) => {
            return Err(ApiError::invalid_field("startingVersion", "give startingVersion or startingTimestamp"));
        }
    };
    let latest = crate::sharing::resolve(pool, tenant, principal, dataset, Which::Latest).await?;
    let end = match (params.ending_version, params.ending_timestamp.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_field(
                "endingVersion",
                "give at most one of endingVersion and endingTimestamp",
            ));
        }
        (Some(v), None) => version_param("endingVersion", v)?,
        (None, Some(t)) => {
            let at = timestamp_param("endingTimestamp", t)?;
            crate::sharing::resolve(pool, tenant, principal, dataset, Which::AsOf(at)).await?.version
        }
        (None, None) => latest.version,
    };
    if end > latest.version {
        return Err(ApiError::invalid_field(
            "endingVersion",
            format!("the table's latest version is {}", latest.version),
        ));
    }
    if start > end {
        return Err(ApiError::invalid_field("startingVersion", "must not be after the ending version"));
    }
    // A link per file of up to 100 versions: in the tenant's turn on the CPU.
    let _turn = state.limits.cpu_turn(&caller).await?;
    let versions =
        crate::sharing::change_range(pool, tenant, principal, dataset, (start, end), MAX_CHANGE_VERSIONS).await?;
    let Some(last) = versions.last() else { return Err(VersionError::NoVersion.into()) };
    let (job, columns) = version_export(&state, &caller, last).await?;
    let mut body = metadata(&share, table, last, &job, &columns).lines();
    let links = FileLinks::new(&state, &caller, &headers)?;
    // Version `start` is compared with the one before it (fetched above); version 0 with nothing.
    let first = usize::from(versions[0].version < start);
    let mut files = 0usize;
    for index in first..versions.len() {
        let version = &versions[index];
        if files > MAX_CHANGE_FILES {
            let fits = index.checked_sub(2).map_or(start, |i| versions[i].version);
            return Err(ApiError::invalid_field(
                "endingVersion",
                format!(
                    "versions {start} to {end} hold more than {MAX_CHANGE_FILES} files; ask up to version {} first",
                    fits.max(start)
                ),
            ));
        }
        let (job, columns) = version_export(&state, &caller, version).await?;
        if let Some(file) = version.change_file() {
            body.push_str(&links.change_action(version, &job, &file).line(FileKind::Cdf));
            files += 1;
            continue;
        }
        let shards = exports::store::shards::all(pool, job.id).await?;
        let Some(previous) = index.checked_sub(1).map(|i| &versions[i]) else {
            for shard in &shards {
                body.push_str(&links.action(version, &job, &columns, shard).line(FileKind::Add));
                files += 1;
            }
            continue;
        };
        let (previous_job, previous_columns) = version_export(&state, &caller, previous).await?;
        let before = exports::store::shards::all(pool, previous_job.id).await?;
        let (removed, added) = crate::sharing::file_diff(&before, &shards, |s| s.sha256.as_str());
        for shard in removed {
            // The removed file is read at the version before; it is removed by this one.
            let mut action = links.action(previous, &previous_job, &previous_columns, shard);
            action.version = version.version;
            action.timestamp = millis(version);
            body.push_str(&action.line(FileKind::Remove));
            files += 1;
        }
        for shard in added {
            body.push_str(&links.action(version, &job, &columns, shard).line(FileKind::Add));
            files += 1;
        }
    }
    Ok(ndjson(body, end))
}

// ---- the profile ----------------------------------------------------------------------------

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    share_credentials_version: u32,
    endpoint: String,
    bearer_token: String,
    /// When the token expires (ISO 8601).
    expiration_time: String,
}

/// A Delta Sharing profile file for the caller's own share, carrying the bearer token of this
/// request (no new credential is made: it expires when that token does).
#[utoipa::path(get, path = "/v1/sharing/profile", tag = "sharing", security(("bearer" = [])),
    responses((status = 200, body = Profile)))]
async fn profile(State(state): State<AppState>, _caller: Caller, headers: HeaderMap) -> ApiResult<axum::Json<Profile>> {
    let token = bearer_token_of(&headers).ok_or_else(|| ApiError::unauthorized(&crate::auth::AuthError::Missing))?;
    let expires = crate::auth::expiry_of_verified(token)
        .and_then(|exp| OffsetDateTime::from_unix_timestamp(exp as i64).ok())
        .and_then(|at| at.format(&Rfc3339).ok())
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("a verified token without a readable exp")))?;
    Ok(axum::Json(Profile {
        share_credentials_version: 1,
        endpoint: format!("{}{PREFIX}", public_base(&state, &headers)?),
        bearer_token: token.to_owned(),
        expiration_time: expires,
    }))
}

/// The API's base URL as clients reach it: `EXPORTD_PUBLIC_URL`, else `http://` and the
/// request's `Host`.
fn public_base(state: &AppState, headers: &HeaderMap) -> ApiResult<String> {
    if let Some(url) = &state.public_url {
        return Ok(url.as_str().trim_end_matches('/').to_owned());
    }
    // Without a configured URL the request's Host would decide where profiles and file URLs
    // point: only a loopback name is taken (development on one machine), never another host.
    let host = headers.get(HOST).and_then(|h| h.to_str().ok()).filter(|host| is_loopback_host(host));
    let host = host.ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "public-url-required",
            "set EXPORTD_PUBLIC_URL (the address partners reach this server at): without it, profiles and \
             file URLs are only made for requests to a loopback address",
        )
        .with("field", "Host")
    })?;
    Ok(format!("http://{host}"))
}

/// `localhost`, `127.x.y.z` or `[::1]`, with an optional port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.rsplit_once(':') {
        Some((name, port)) if !host.ends_with(']') && port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

// ---- errors ---------------------------------------------------------------------------------

/// The protocol's error body, `{"errorCode", "message"}` as `application/json`, for every problem
/// a sharing route answers; status and headers (`Retry-After`, `WWW-Authenticate`) are kept.
async fn as_protocol_error(response: Response) -> Response {
    let is_problem = response.headers().get(CONTENT_TYPE).is_some_and(|v| v.as_bytes() == b"application/problem+json");
    if !is_problem {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let problem: Value = match axum::body::to_bytes(body, 64 << 10).await {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
        Err(_) => Value::Null,
    };
    let code = problem["code"].as_str().unwrap_or_default();
    let error_code = match (parts.status.as_u16(), code) {
        (_, "unsupported-operation") => "UNSUPPORTED_OPERATION",
        (_, "invalid-body") => "MALFORMED_REQUEST",
        (400, _) => "INVALID_PARAMETER_VALUE",
        (401, _) => "UNAUTHENTICATED",
        (403, _) => "PERMISSION_DENIED",
        (404, _) => "RESOURCE_DOES_NOT_EXIST",
        (429, _) => "RESOURCE_EXHAUSTED",
        (503, _) => "TEMPORARILY_UNAVAILABLE",
        (500..=599, _) => "INTERNAL_ERROR",
        _ => "INVALID_PARAMETER_VALUE",
    };
    let body = json!({"errorCode": error_code, "message": problem["detail"].as_str().unwrap_or_default()}).to_string();
    parts.headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body))
}
