//! `GET /v1/datasets/{dataset}/schema`: the schema version the caller receives and every
//! recorded version, each as the caller sees it (after its column policy), with the sha256 it
//! is shown (`schemas::sha256_seen`).

use axum::extract::State;
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::ApiResult;
use super::extract::Path;
use super::feeds::served_view;
use super::state::AppState;
use crate::auth::Caller;
use crate::masking::ColumnPolicy;
use crate::schemas::{HistoryEntry, columns_seen, sha256_seen};
use crate::writers::OutputColumn;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(dataset_schema))
}

#[derive(Serialize, ToSchema)]
pub struct SchemaDocument {
    dataset: String,
    /// What the caller's exports and feed pages are written with now.
    served: ServedView,
    /// The dataset's current version (newer than `served.version` when the caller is pinned).
    current_version: String,
    /// The older major the caller is pinned to, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pinned_major: Option<u32>,
    /// Every recorded version, oldest first.
    history: Vec<VersionView>,
}

#[derive(Serialize, ToSchema)]
pub struct ServedView {
    version: String,
    sha256: String,
    /// The key column first, then the columns as the caller receives them: a column its policy
    /// drops is missing, a masked one says `masked`, and a column of a pinned version that the
    /// current one removed or retyped says `retired` (always null).
    #[schema(value_type = Vec<Object>)]
    columns: Vec<OutputColumn>,
}

#[derive(Serialize, ToSchema)]
pub struct VersionView {
    version: String,
    sha256: String,
    /// `initial`, `compatible` (a minor version) or `breaking` (a major one).
    change: String,
    /// What changed from the version before, each with an `explanation`.
    #[schema(value_type = Vec<Object>)]
    changes: Vec<Value>,
    #[schema(value_type = Vec<Object>)]
    columns: Vec<OutputColumn>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    recorded_at: time::OffsetDateTime,
}

/// The dataset's schema versions, for the caller.
#[utoipa::path(get, path = "/v1/datasets/{dataset}/schema", tag = "datasets", security(("bearer" = [])),
    params(("dataset" = String, Path)),
    responses((status = 200, body = SchemaDocument), (status = 403, description = "dataset not granted"),
        (status = 404, description = "no such dataset")))]
async fn dataset_schema(
    State(state): State<AppState>,
    caller: Caller,
    Path(dataset): Path<String>,
) -> ApiResult<axum::Json<SchemaDocument>> {
    let view = served_view(&caller, &dataset)?;
    let (name, policy) = (view.name().as_str(), view.policy);
    let versions = caller.tenant.versions(name).expect("an exposed dataset has versions");
    let history = crate::schemas::history(&state.pool, name).await?;
    Ok(axum::Json(SchemaDocument {
        dataset: name.to_owned(),
        served: ServedView {
            version: view.schema.version.to_string(),
            sha256: view.schema_sha256(),
            columns: view.columns(),
        },
        current_version: versions.current.version.to_string(),
        pinned_major: caller.tenant.effective_pin(name, &caller.principal),
        history: history.iter().map(|entry| version_view(entry, policy)).collect(),
    }))
}

fn version_view(entry: &HistoryEntry, policy: Option<&ColumnPolicy>) -> VersionView {
    let schema = &entry.recorded.schema;
    let columns = columns_seen(schema, policy);
    VersionView {
        version: entry.recorded.version.to_string(),
        sha256: sha256_seen(schema.name.as_str(), &entry.recorded.sha256, &columns, policy),
        change: entry.change.clone(),
        changes: crate::schemas::as_seen(&entry.changes, policy),
        columns,
        recorded_at: entry.recorded_at,
    }
}
