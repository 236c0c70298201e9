//! `POST /v1/exports` bodies: parsed, defaulted into a canonical form, validated into a spec.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::auth::Caller;
use crate::masking::{ColumnPolicy, ColumnRule};
use crate::schemas::ServedSchema;
use crate::served::{NotServed, ServedView};
use crate::tenants::{DatasetName, DatasetSchema};
use crate::writers::{Format, OutputColumn};

use super::ExportError;

pub const DEFAULT_SHARD_ROWS: u32 = 100_000;
/// The column of incremental exports saying `upsert` or `delete`.
pub const OP_COLUMN: &str = "_op";
pub const MAX_SHARD_ROWS: u32 = 1_000_000;

/// The record's JSON object with the `_op` field first.
pub fn with_op(op: &str, data: &str) -> String {
    crate::records::with_leading_field(OP_COLUMN, op, data)
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Full,
    Incremental,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Full => "full",
            Mode::Incremental => "incremental",
        }
    }
}

crate::db::text_column!(Mode);

impl TryFrom<String> for Mode {
    type Error = String;
    fn try_from(text: String) -> Result<Mode, String> {
        [Mode::Full, Mode::Incremental]
            .into_iter()
            .find(|m| m.as_str() == text)
            .ok_or_else(|| format!("unknown mode {text}"))
    }
}

/// The request body. Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExportRequest {
    /// One of the caller's tenant's datasets.
    #[schema(min_length = 1, max_length = 63)]
    pub dataset: String,
    pub format: Format,
    #[serde(default)]
    pub mode: Mode,
    /// Dataset columns to export, each once, in this order, after the key column (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_items = 1)]
    pub columns: Option<Vec<String>>,
    /// Column = value equalities every exported row must satisfy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub filter: Option<Map<String, Value>>,
    /// Rows per shard file (1 to 1 000 000, default 100 000).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub shard_rows: Option<u32>,
    /// Start cursor of an incremental export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

impl ExportRequest {
    /// The request with defaults filled in, as canonical JSON (sorted keys, no spaces): two
    /// bodies that mean the same thing have the same canonical form.
    pub fn canonical(&self) -> (Value, String) {
        let mut filled = self.clone();
        filled.shard_rows.get_or_insert(DEFAULT_SHARD_ROWS);
        let value = serde_json::to_value(&filled).expect("serializable");
        let text = value.to_string();
        (value, text)
    }
}

/// A validated request: everything a worker needs, frozen at creation.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSpec {
    pub dataset: DatasetName,
    pub format: Format,
    pub mode: Mode,
    pub columns: Vec<OutputColumn>,
    pub filter: Map<String, Value>,
    pub row_filter: Map<String, Value>,
    /// The fingerprint of the partner's column policy for the dataset.
    pub column_policy: Option<String>,
    /// Rows are ordered and cut by the partner's hashed key.
    pub hashed_key_order: bool,
    pub shard_rows: u32,
    /// The sha256 (see [`DatasetSchema::sha256`]) and version of the dataset schema the caller
    /// receives (an older major if it is pinned): the columns come from it.
    pub schema_sha256: String,
    pub schema_version: String,
}

impl ExportSpec {
    /// Checks the request against the caller's tenant, grants and the dataset's columns.
    pub fn validate(request: &ExportRequest, caller: &Caller) -> Result<ExportSpec, ExportError> {
        let view = ServedView::of(&caller.tenant, &caller.principal, &request.dataset).map_err(|e| match e {
            NotServed::NoSuchDataset => ExportError::DatasetNotFound,
            NotServed::NotGranted => ExportError::DatasetNotGranted,
        })?;
        let (served, policy) = (view.schema, view.policy);
        let schema = &*served.schema;
        if request.mode == Mode::Full && request.since.is_some() {
            return Err(invalid("since", "`since` applies to incremental exports only"));
        }
        if request.mode == Mode::Incremental && request.filter.is_some() {
            return Err(invalid(
                "filter",
                "incremental exports follow the feed: no filter (partners keep their row filter)",
            ));
        }
        let shard_rows = request.shard_rows.unwrap_or(DEFAULT_SHARD_ROWS);
        if !(1..=MAX_SHARD_ROWS).contains(&shard_rows) {
            return Err(invalid("shard_rows", format!("must be between 1 and {MAX_SHARD_ROWS}")));
        }
        let mut columns = output_columns(schema, policy, request.columns.as_deref())?;
        for column in columns.iter_mut().filter(|c| served.is_retired(&c.name)) {
            column.retire();
        }
        if request.mode == Mode::Incremental {
            // A delete carries its key alone: every dataset column may be null.
            columns.iter_mut().skip(1).for_each(|c| c.required = false);
            // `_op` cannot clash with a dataset column: column names start with a letter.
            columns.insert(1, OutputColumn::key(OP_COLUMN));
        }
        Ok(ExportSpec {
            dataset: schema.name.clone(),
            format: request.format,
            mode: request.mode,
            columns,
            filter: check_filter(served, policy, request.filter.clone().unwrap_or_default())?,
            row_filter: view.row_filter_fields(),
            column_policy: view.policy_fingerprint().map(str::to_owned),
            hashed_key_order: view.key_order().is_hashed(),
            shard_rows,
            schema_sha256: view.schema_sha256(),
            schema_version: served.version.to_string(),
        })
    }
}

/// The key column, then the requested columns (default: all), as the caller receives them: a
/// column its policy drops is missing (named, it is refused like an unknown one).
fn output_columns(
    schema: &DatasetSchema,
    policy: Option<&ColumnPolicy>,
    requested: Option<&[String]>,
) -> Result<Vec<OutputColumn>, ExportError> {
    let through_policy = |column: OutputColumn| match policy {
        Some(policy) => policy.output_column(column),
        None => Some(column),
    };
    let key = through_policy(OutputColumn::key(schema.key_column.as_str())).expect("keys are never dropped");
    let mut columns = vec![key];
    let Some(requested) = requested else {
        columns.extend(schema.columns.iter().map(OutputColumn::of).filter_map(through_policy));
        return Ok(columns);
    };
    if requested.is_empty() {
        return Err(invalid("columns", "list at least one column, or leave `columns` out for all"));
    }
    for (i, name) in requested.iter().enumerate() {
        let column = schema.column(name).map(OutputColumn::of).and_then(through_policy).ok_or_else(|| {
            invalid(&format!("columns[{i}]"), format!("dataset `{}` has no column `{name}`", schema.name))
        })?;
        if requested[..i].contains(name) {
            return Err(invalid(&format!("columns[{i}]"), format!("`{name}` is listed twice")));
        }
        columns.push(column);
    }
    Ok(columns)
}

/// A filter names columns the caller receives whole: filtering by a masked value would tell
/// what the mask hides.
fn check_filter(
    served: &ServedSchema,
    policy: Option<&ColumnPolicy>,
    filter: Map<String, Value>,
) -> Result<Map<String, Value>, ExportError> {
    let schema = &served.schema;
    for (name, value) in &filter {
        let field = format!("filter.{name}");
        let rule = policy.and_then(|p| p.rule(name));
        let column = schema
            .column(name)
            .filter(|_| rule != Some(ColumnRule::Drop))
            .ok_or_else(|| invalid(&field, format!("dataset `{}` has no column `{name}`", schema.name)))?;
        if let Some(rule) = rule {
            return Err(invalid(&field, format!("`{name}` reaches you masked ({rule}) and cannot be filtered")));
        }
        if served.is_retired(name) {
            let why =
                format!("`{name}` left the dataset's current schema: it reaches you as null and cannot be filtered");
            return Err(invalid(&field, why));
        }
        if !column.ty.accepts_filter_value(value) {
            return Err(invalid(&field, format!("a {:?} column is filtered by a value of its type", column.ty)));
        }
    }
    Ok(filter)
}

fn invalid(field: &str, detail: impl Into<String>) -> ExportError {
    ExportError::InvalidField { field: field.to_owned(), detail: detail.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> ExportRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn equivalent_bodies_have_one_canonical_form() {
        let a = parse(json!({"dataset": "tickets", "format": "csv"}));
        let b = parse(json!({"format": "csv", "mode": "full", "shard_rows": 100000, "dataset": "tickets"}));
        assert_eq!(a.canonical().1, b.canonical().1);
        let c = parse(json!({"dataset": "tickets", "format": "jsonl"}));
        assert_ne!(a.canonical().1, c.canonical().1);
        assert_eq!(a.canonical().1, r#"{"dataset":"tickets","format":"csv","mode":"full","shard_rows":100000}"#);
    }

    #[test]
    fn op_goes_first_in_the_record() {
        assert_eq!(with_op("upsert", r#"{"a": 1}"#), r#"{"_op":"upsert","a": 1}"#);
        assert_eq!(with_op("delete", "{}"), r#"{"_op":"delete"}"#);
    }

    #[test]
    fn unknown_fields_and_formats_are_refused() {
        assert!(serde_json::from_value::<ExportRequest>(json!({"dataset": "t", "format": "xml"})).is_err());
        assert!(serde_json::from_value::<ExportRequest>(json!({"dataset": "t", "format": "csv", "x": 1})).is_err());
    }
}
