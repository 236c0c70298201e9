//! Incremental feeds over HTTP: `GET /v1/datasets/{ds}/changes`, `GET /v1/datasets/{ds}/cursor`.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::extract::{Path, Query};
use super::state::AppState;
use crate::auth::Caller;
use crate::feeds::{self, Change, Cursor, CursorError, CursorOwner, Feed, Seal};
use crate::history::Database;
use crate::schemas::SchemaStamp;
use crate::served::{NotServed, ServedView};

pub const DEFAULT_LIMIT: usize = 1000;
pub const MAX_LIMIT: usize = 10_000;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(changes)).routes(routes!(current_cursor))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ChangesParams {
    /// Where to continue: a `next_cursor`, a full export's manifest `next_cursor`, or one from
    /// `GET /v1/datasets/{dataset}/cursor`.
    #[param(required = true, min_length = 1)]
    cursor: Option<String>,
    /// Changes per page, 1 to 10 000 (default 1000).
    #[param(minimum = 1, maximum = 10000)]
    limit: Option<usize>,
}

#[derive(Serialize, ToSchema)]
pub struct ChangesPage {
    #[schema(value_type = Vec<Object>)]
    changes: Vec<Change>,
    next_cursor: String,
    /// Caught up with the newest sealed window: poll again after `retry_after_seconds`.
    end_of_stream: bool,
    retry_after_seconds: Option<u32>,
    /// The dataset schema version (`major.minor`) and sha256 the page's `data` has: the current
    /// one, or the older major the caller is pinned to.
    #[schema(value_type = Object)]
    schema: SchemaStamp,
}

/// The next changes after a cursor: `{op: upsert|delete, key, data?}` per key, in window order
/// and key order within a window.
#[utoipa::path(get, path = "/v1/datasets/{dataset}/changes", tag = "feeds", security(("bearer" = [])),
    params(("dataset" = String, Path), ChangesParams),
    responses((status = 200, body = ChangesPage), (status = 400, description = "missing, malformed or tampered cursor"),
        (status = 403, description = "dataset not granted"), (status = 404, description = "no such dataset"),
        (status = 410, description = "cursor-expired: older than the tombstone window; cursor-lost-in-failover: from history a database failover lost; run a full export"),
        (status = 503, description = "history-unreadable: after a failover, the timeline history cannot be read to check the cursor")))]
async fn changes(
    State(state): State<AppState>,
    caller: Caller,
    Path(dataset): Path<String>,
    Query(params): Query<ChangesParams>,
) -> ApiResult<axum::Json<ChangesPage>> {
    let view = served_view(&caller, &dataset)?;
    let name = view.name().as_str();
    if let Some(incomplete) = crate::attach::incomplete(&state.pool, caller.tenant.id.as_str(), name).await? {
        return Err(crate::exports::ExportError::from(incomplete).into());
    }
    let limit = params.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::invalid_field("limit", format!("must be between 1 and {MAX_LIMIT}")));
    }
    let text = params.cursor.ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid-cursor",
            "give a cursor (see GET /v1/datasets/{dataset}/cursor)",
        )
        .with("field", "cursor")
    })?;
    let database = Database::identify(&state.pool).await?;
    let now = state.clock.now();
    let oldest = now.unix_timestamp() - i64::from(caller.tenant.retention.tombstone_days) * 86_400;
    let row_filter = view.row_filter();
    let owner = CursorOwner::of(caller_ids(&caller), &view, &database, &row_filter);
    let cursor = Cursor::open(&state.pool, &state.links, &text, &owner, oldest, now).await?.map_err(cursor_problem)?;
    let (principal, position) = (caller.principal.id.as_str(), cursor.ts);
    crate::webhooks::lag::record_position(&state.pool, &caller.tenant, principal, name, position, now).await?;
    let feed = Feed {
        tenant: owner.tenant,
        dataset: name,
        row_filter: &row_filter,
        seal: Seal::Delayed { now, safety_delay_seconds: caller.tenant.feeds.safety_delay_seconds },
        order: view.key_order(),
    };
    // Shaped before it counts towards the page's bytes: where a page ends depends only on what
    // the caller receives.
    let shape = |change: Change| change.as_served(&view);
    let page = feeds::page(&state.pool, &state.replicas, &feed, cursor, limit, &shape).await?;
    let retry = page.end_of_stream.then(|| caller.tenant.feeds.safety_delay_seconds.clamp(1, 30));
    Ok(axum::Json(ChangesPage {
        changes: page.changes,
        next_cursor: page.next.encode(&state.links),
        end_of_stream: page.end_of_stream,
        retry_after_seconds: retry,
        schema: view.stamp(),
    }))
}

#[derive(Serialize, ToSchema)]
pub struct CursorView {
    cursor: String,
}

/// A cursor at "now": the feed from it holds every change committed from this moment on.
#[utoipa::path(get, path = "/v1/datasets/{dataset}/cursor", tag = "feeds", security(("bearer" = [])),
    params(("dataset" = String, Path)),
    responses((status = 200, body = CursorView), (status = 403, description = "dataset not granted"),
        (status = 404, description = "no such dataset")))]
async fn current_cursor(
    State(state): State<AppState>,
    caller: Caller,
    Path(dataset): Path<String>,
) -> ApiResult<axum::Json<CursorView>> {
    let view = served_view(&caller, &dataset)?;
    let database = Database::identify(&state.pool).await?;
    let (snapshot, at) = crate::history::current_snapshot(&state.pool).await?;
    let row_filter = view.row_filter();
    let owner = CursorOwner::of(caller_ids(&caller), &view, &database, &row_filter);
    let cursor = Cursor::new(&owner, snapshot.as_str(), at, state.clock.now().unix_timestamp());
    Ok(axum::Json(CursorView { cursor: cursor.encode(&state.links) }))
}

/// The caller's tenant and principal ids.
fn caller_ids(caller: &Caller) -> (&str, &str) {
    (caller.tenant.id.as_str(), caller.principal.id.as_str())
}

/// What the caller is served of `dataset`, or the problem saying why nothing: a dataset the
/// tenant does not expose is missing (404), one not granted forbidden (403).
pub(super) fn served_view<'a>(caller: &'a Caller, dataset: &str) -> ApiResult<ServedView<'a>> {
    ServedView::of(&caller.tenant, &caller.principal, dataset).map_err(|e| match e {
        NotServed::NoSuchDataset => ApiError::new(StatusCode::NOT_FOUND, "dataset-not-found", e.to_string()),
        NotServed::NotGranted => ApiError::new(StatusCode::FORBIDDEN, "dataset-not-granted", e.to_string()),
    })
}

pub(super) fn cursor_problem(e: CursorError) -> ApiError {
    match e {
        CursorError::Invalid => {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid-cursor", e.to_string()).with("field", "cursor")
        }
        CursorError::UnknownKey(_) => ApiError::new(StatusCode::BAD_REQUEST, "invalid-cursor", e.to_string())
            .with("field", "cursor")
            .with("reason", "unknown-key"),
        CursorError::Expired => ApiError::new(StatusCode::GONE, "cursor-expired", e.to_string()),
        CursorError::LostInFailover { .. } => ApiError::new(StatusCode::GONE, "cursor-lost-in-failover", e.to_string()),
        CursorError::HistoryUnreadable(_) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "history-unreadable", e.to_string())
        }
    }
}
