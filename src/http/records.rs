//! Datasets and record ingest: `GET /v1/datasets`, `POST /v1/datasets/{dataset}/records`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::extract::{JsonBody, Path};
use super::state::AppState;
use crate::auth::Caller;
use crate::masking::{ColumnRule, PolicySummary};
use crate::records::{self, BatchOutcome, RecordWrite, WriteError};
use crate::served::ServedView;
use crate::tenants::{Column, DatasetSchema};

/// Most records accepted in one ingest request.
pub const MAX_BATCH: usize = 10_000;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_datasets)).routes(routes!(ingest))
}

#[derive(Serialize, ToSchema)]
pub struct DatasetList {
    datasets: Vec<DatasetView>,
}

#[derive(Serialize, ToSchema)]
pub struct DatasetView {
    name: String,
    key_column: String,
    #[schema(value_type = Vec<Object>)]
    columns: Vec<Column>,
    /// The row filter applied to this caller's exports and feeds (partners only).
    #[schema(value_type = Object)]
    row_filter: Map<String, Value>,
    /// The caller's column policy for the dataset (partners only; absent: every column whole):
    /// its fingerprint and each masked column's rule. Dropped columns are not in `columns`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    column_policy: Option<PolicySummary>,
    /// The schema version the caller receives (`major.minor`; see `GET /v1/datasets/{dataset}/schema`).
    schema_version: String,
    /// The older major version the caller is pinned to, if any: `columns` are that version's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pinned_major: Option<u32>,
}

/// The datasets the caller may read, with their columns.
#[utoipa::path(get, path = "/v1/datasets", tag = "datasets", security(("bearer" = [])),
    responses((status = 200, body = DatasetList), (status = 401, description = "no or bad token")))]
async fn list_datasets(caller: Caller) -> axum::Json<DatasetList> {
    let row_filter: Map<String, Value> =
        caller.principal.row_filter.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let datasets = caller
        .tenant
        .datasets
        .keys()
        .filter_map(|name| {
            let view = ServedView::of(&caller.tenant, &caller.principal, name.as_str()).ok()?;
            let (served, policy) = (view.schema, view.policy);
            let schema = &served.schema;
            let dropped = |c: &&Column| policy.and_then(|p| p.rule(c.name.as_str())) == Some(ColumnRule::Drop);
            Some(DatasetView {
                name: name.to_string(),
                key_column: schema.key_column.to_string(),
                columns: schema.columns.iter().filter(|c| !dropped(c)).cloned().collect(),
                row_filter: row_filter.clone(),
                column_policy: policy.map(|p| p.summary()),
                schema_version: served.version.to_string(),
                pinned_major: caller.tenant.effective_pin(name.as_str(), &caller.principal),
            })
        })
        .collect();
    axum::Json(DatasetList { datasets })
}

/// One element of an ingest batch: `{key, data}` to upsert, `{key, deleted: true}` to delete.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestRecord {
    key: String,
    data: Option<Map<String, Value>>,
    #[serde(default)]
    deleted: bool,
}

/// Written by hand because the two shapes exclude each other (an upsert needs `data`, a delete
/// must not carry it), which a derived schema of the one struct cannot say.
impl utoipa::PartialSchema for IngestRecord {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{AdditionalProperties, ObjectBuilder, OneOfBuilder, Type};
        let key = || {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
                // The store's limit is 512 bytes of UTF-8; 512 characters is the most it can be.
                .max_length(Some(512))
                .pattern(Some("^[^\\u0000]+$"))
                .description(Some("the record's key, unique in the dataset: 1 to 512 bytes of UTF-8, no U+0000"))
        };
        let deleted = |value: bool| ObjectBuilder::new().schema_type(Type::Boolean).enum_values(Some([value]));
        let upsert = ObjectBuilder::new()
            .title(Some("upsert"))
            .property("key", key())
            .property(
                "data",
                ObjectBuilder::new()
                    .schema_type(Type::Object)
                    .description(Some("the record's columns, named and typed as `GET /v1/datasets` lists them")),
            )
            .property("deleted", deleted(false))
            .required("key")
            .required("data")
            .additional_properties(Some(AdditionalProperties::FreeForm(false)));
        let delete = ObjectBuilder::new()
            .title(Some("delete"))
            .property("key", key())
            .property("data", ObjectBuilder::new().schema_type(Type::Null).description(Some("absent or null")))
            .property("deleted", deleted(true))
            .required("key")
            .required("deleted")
            .additional_properties(Some(AdditionalProperties::FreeForm(false)));
        OneOfBuilder::new().item(upsert).item(delete).into()
    }
}

impl ToSchema for IngestRecord {}

/// The ingest body as the document describes it: 1 to [`MAX_BATCH`] records.
pub struct IngestBatch;

impl utoipa::PartialSchema for IngestBatch {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ArrayBuilder::new()
            .items(<IngestRecord as utoipa::PartialSchema>::schema())
            .min_items(Some(1))
            .max_items(Some(MAX_BATCH))
            .into()
    }
}

impl ToSchema for IngestBatch {}

/// Writes a batch of records atomically: every record is validated against the dataset's
/// columns first, and one bad record stores nothing.
#[utoipa::path(post, path = "/v1/datasets/{dataset}/records", tag = "datasets",
    security(("bearer" = [])), request_body = IngestBatch,
    params(("dataset" = String, Path, description = "dataset name")),
    responses(
        (status = 200, body = Object, description = "`{upserted, deleted}`"),
        (status = 400, description = "malformed body or invalid record (names `index` and `field`)"),
        (status = 403, description = "caller is not a tenant admin"),
        (status = 404, description = "the tenant exposes no such dataset")))]
async fn ingest(
    State(state): State<AppState>,
    caller: Caller,
    Path(dataset): Path<String>,
    JsonBody(batch): JsonBody<Vec<IngestRecord>>,
) -> ApiResult<axum::Json<BatchOutcome>> {
    if !caller.principal.is_admin() {
        return Err(ApiError::forbidden("only tenant admins can write records"));
    }
    let schema = exposed_dataset(&caller, &dataset)?;
    let writes = into_writes(batch)?;
    records::write_batch(&state.pool, &caller.tenant.id, &schema.name, &writes).await.map(axum::Json).map_err(|e| {
        match e {
            WriteError::Invalid { index, field, message } => invalid_record(index, &field, message),
            WriteError::Database(e) => e.into(),
        }
    })
}

/// The dataset if the caller's tenant exposes it; otherwise the same 404 for "absent" and "not yours".
pub fn exposed_dataset(caller: &Caller, name: &str) -> ApiResult<Arc<DatasetSchema>> {
    caller
        .tenant
        .dataset(name)
        .cloned()
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "dataset-not-found", "no such dataset"))
}

fn into_writes(batch: Vec<IngestRecord>) -> ApiResult<Vec<RecordWrite>> {
    if batch.is_empty() || batch.len() > MAX_BATCH {
        return Err(ApiError::invalid_field("body", format!("send between 1 and {MAX_BATCH} records per request")));
    }
    batch
        .into_iter()
        .enumerate()
        .map(|(index, record)| match (record.deleted, record.data) {
            _ if record.key.contains('\0') => Err(invalid_record(index, "key", "must not contain U+0000".into())),
            (false, Some(data)) if contains_nul(&data) => {
                Err(invalid_record(index, "data", "strings must not contain U+0000".into()))
            }
            (false, Some(data)) => Ok(RecordWrite::Upsert { key: record.key, data }),
            (true, None) => Ok(RecordWrite::Delete { key: record.key }),
            (true, Some(_)) => Err(invalid_record(index, "data", "a delete carries no data".into())),
            (false, None) => Err(invalid_record(index, "data", "data is required unless deleted is true".into())),
        })
        .collect()
}

/// PostgreSQL's text and jsonb cannot hold U+0000; refuse it as bad input, not a server error.
fn contains_nul(data: &Map<String, Value>) -> bool {
    fn value_has_nul(value: &Value) -> bool {
        match value {
            Value::String(s) => s.contains('\0'),
            Value::Array(items) => items.iter().any(value_has_nul),
            Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || value_has_nul(v)),
            _ => false,
        }
    }
    data.iter().any(|(k, v)| k.contains('\0') || value_has_nul(v))
}

fn invalid_record(index: usize, field: &str, message: String) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid-record", format!("record {index}: {field}: {message}"))
        .with("index", index)
        .with("field", format!("[{index}].{field}"))
}
