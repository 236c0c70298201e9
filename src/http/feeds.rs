//! Incremental feeds over HTTP: `GET /v1/datasets/{ds}/changes`, `GET /v1/datasets/{ds}/cursor`.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::extract::{Path, Query};
use super::records::exposed_dataset;
use super::state::AppState;
use crate::auth::Caller;
use crate::feeds::{self, Change, Cursor, CursorError, CursorOwner, Feed, Seal};
use crate::history::Database;
use crate::records::KeyOrder;
use crate::schemas::SchemaStamp;
use crate::tenants::DatasetSchema;

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
    let schema = readable_dataset(&caller, &dataset)?;
    if crate::attach::backfill_running(&state.pool, caller.tenant.id.as_str(), schema.name.as_str()).await? {
        return Err(crate::exports::ExportError::BackfillRunning.into());
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
    let row_filter = caller.principal.row_filter_json();
    let owner = cursor_owner(&caller, &schema, &database, &row_filter);
    let cursor = Cursor::open(&state.pool, &state.links, &text, &owner, oldest, now).await?.map_err(cursor_problem)?;
    let (principal, position) = (caller.principal.id.as_str(), cursor.ts);
    crate::webhooks::lag::record_position(&state.pool, &caller.tenant, principal, schema.name.as_str(), position, now)
        .await?;
    let feed = Feed {
        tenant: owner.tenant,
        dataset: schema.name.as_str(),
        row_filter: &row_filter,
        seal: Seal::Delayed { now, safety_delay_seconds: caller.tenant.feeds.safety_delay_seconds },
        order: key_order(&caller, schema.name.as_str()),
    };
    let versions = caller.tenant.versions(schema.name.as_str()).expect("an exposed dataset has versions");
    let served = versions.served(caller.principal.schema_pin(schema.name.as_str()));
    let projects = versions.projects(served);
    let policy = caller.principal.column_policy(schema.name.as_str());
    // Shaped before it counts towards the page's bytes: where a page ends depends only on what
    // the caller receives.
    let shape = |change: feeds::Change| {
        let change = if projects { change.projected(served)? } else { change };
        match policy {
            Some(policy) => change.masked(policy),
            None => Ok(change),
        }
    };
    let page = feeds::page(&state.pool, &state.replicas, &feed, cursor, limit, &shape).await?;
    let retry = page.end_of_stream.then(|| caller.tenant.feeds.safety_delay_seconds.clamp(1, 30));
    Ok(axum::Json(ChangesPage {
        changes: page.changes,
        next_cursor: page.next.encode(&state.links),
        end_of_stream: page.end_of_stream,
        retry_after_seconds: retry,
        schema: served.stamp_for(policy),
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
    let schema = readable_dataset(&caller, &dataset)?;
    let database = Database::identify(&state.pool).await?;
    let (snapshot, at) = crate::history::current_snapshot(&state.pool).await?;
    let row_filter = caller.principal.row_filter_json();
    let owner = cursor_owner(&caller, &schema, &database, &row_filter);
    let cursor = Cursor::new(&owner, snapshot.as_str(), at, state.clock.now().unix_timestamp());
    Ok(axum::Json(CursorView { cursor: cursor.encode(&state.links) }))
}

fn cursor_owner<'a>(
    caller: &'a Caller,
    schema: &'a DatasetSchema,
    database: &'a Database,
    row_filter: &'a serde_json::Value,
) -> CursorOwner<'a> {
    CursorOwner {
        tenant: caller.tenant.id.as_str(),
        principal: caller.principal.id.as_str(),
        dataset: schema.name.as_str(),
        database,
        row_filter,
        column_policy: caller.principal.policy_fingerprint(schema.name.as_str()),
        hashed_positions: key_order(caller, schema.name.as_str()).is_hashed(),
    }
}

/// The order the caller receives `dataset`'s records in.
pub(super) fn key_order<'a>(caller: &'a Caller, dataset: &str) -> KeyOrder<'a> {
    caller.principal.column_policy(dataset).map_or(KeyOrder::Key, crate::masking::ColumnPolicy::key_order)
}

pub(super) fn readable_dataset(caller: &Caller, name: &str) -> ApiResult<std::sync::Arc<DatasetSchema>> {
    let schema = exposed_dataset(caller, name)?;
    if !caller.principal.is_granted(&schema.name) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "dataset-not-granted",
            "the dataset is not granted to this principal",
        ));
    }
    Ok(schema)
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
