//! The protocol's descriptions of a table: its Spark schema, `metaData` and `file` actions, and
//! per-file statistics, from what an export's manifest already knows.

use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::tenants::ColumnType;
use crate::writers::{ColumnStats, OutputColumn};

/// The table's schema as the protocol's `schemaString`: Spark `StructType` JSON of the columns
/// as the version's Parquet files declare them (the key first).
pub fn schema_string(columns: &[OutputColumn]) -> String {
    let fields: Vec<Value> = columns
        .iter()
        .map(|column| json!({"name": column.name, "type": spark_type(column), "nullable": !column.required, "metadata": {}}))
        .collect();
    json!({"type": "struct", "fields": fields}).to_string()
}

/// Spark's name for the type exportd writes the column as in Parquet (see
/// `writers::columnar::arrow_schema`): numbers without a declared decimal and JSON are text;
/// timestamps are microseconds in UTC (`timestamp`, never `timestamp_ntz`).
fn spark_type(column: &OutputColumn) -> String {
    match (column.ty, column.decimal()) {
        (ColumnType::String | ColumnType::Json | ColumnType::Number, None) => "string".to_owned(),
        (ColumnType::Number, Some((precision, scale))) => format!("decimal({precision},{scale})"),
        (ColumnType::Integer, _) => "long".to_owned(),
        (ColumnType::Boolean, _) => "boolean".to_owned(),
        (ColumnType::Timestamp, _) => "timestamp".to_owned(),
        (ColumnType::String | ColumnType::Json, Some(_)) => "string".to_owned(),
    }
}

/// A file's statistics as the protocol's `stats` (a string of JSON): its row count, each
/// column's null count, and the exact smallest and largest values the file's footer recorded
/// (decimals left out: the footer renders them as text, the protocol wants numbers). Clients use
/// them only to skip files.
pub fn file_stats(rows: i64, stats: Option<&[ColumnStats]>, columns: &[OutputColumn]) -> String {
    let (mut min_values, mut max_values, mut null_count) = (Map::new(), Map::new(), Map::new());
    for stat in stats.unwrap_or_default() {
        null_count.insert(stat.column.clone(), json!(stat.null_count));
        let decimal = columns.iter().any(|c| c.name == stat.column && c.decimal().is_some());
        if decimal {
            continue;
        }
        if let (Some(min), true) = (&stat.min, stat.min_exact) {
            min_values.insert(stat.column.clone(), min.clone());
        }
        if let (Some(max), true) = (&stat.max, stat.max_exact) {
            max_values.insert(stat.column.clone(), max.clone());
        }
    }
    json!({"numRecords": rows, "minValues": min_values, "maxValues": max_values, "nullCount": null_count}).to_string()
}

/// `{"metaData": …}`: a table version's id, format, schema and size.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TableMetadata {
    pub id: String,
    pub name: String,
    pub format: Value,
    pub schema_string: String,
    pub partition_columns: Vec<String>,
    pub configuration: Map<String, Value>,
    pub version: i64,
    pub size: i64,
    pub num_files: i64,
}

impl TableMetadata {
    pub fn new(id: String, name: String, columns: &[OutputColumn], version: i64, size: i64, num_files: i64) -> Self {
        TableMetadata {
            id,
            name,
            format: json!({"provider": "parquet"}),
            schema_string: schema_string(columns),
            partition_columns: Vec::new(),
            configuration: Map::new(),
            version,
            size,
            num_files,
        }
    }

    /// The two lines every metadata and query response starts with.
    pub fn lines(&self) -> String {
        format!("{}\n{}\n", json!({"protocol": {"minReaderVersion": 1}}), json!({"metaData": self}))
    }
}

/// What a file action says of its file: part of the version (`file`, a query's answer), or, in
/// a change feed, added (its rows are inserts) or removed (its rows are deletes) by a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Add,
    Remove,
    /// A change file: rows with `_change_type` (a change feed's `cdf`).
    Cdf,
}

impl FileKind {
    fn name(self) -> &'static str {
        match self {
            FileKind::File => "file",
            FileKind::Add => "add",
            FileKind::Remove => "remove",
            FileKind::Cdf => "cdf",
        }
    }
}

/// One Parquet file of a version, readable at `url` until `expiration_timestamp`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileAction {
    pub url: String,
    pub id: String,
    pub partition_values: Map<String, Value>,
    pub size: i64,
    /// Data files only (change files have none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<String>,
    pub version: i64,
    /// The version's timestamp, milliseconds since the epoch.
    pub timestamp: i64,
    /// When `url` stops working, milliseconds since the epoch.
    pub expiration_timestamp: i64,
}

impl FileAction {
    /// The action's NDJSON line: `{"file": …}`, `{"add": …}`, `{"remove": …}` or `{"cdf": …}`.
    pub fn line(&self, kind: FileKind) -> String {
        let mut action = Map::new();
        action.insert(kind.name().to_owned(), json!(self));
        format!("{}\n", Value::Object(action))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(name: &str, ty: ColumnType, required: bool) -> OutputColumn {
        OutputColumn { ty, required, ..OutputColumn::key(name) }
    }

    #[test]
    fn schemas_are_spark_struct_types_of_the_parquet_columns() {
        let mut amount = column("amount", ColumnType::Number, false);
        amount.precision = Some(12);
        amount.scale = Some(2);
        let columns = [
            OutputColumn::key("id"),
            column("n", ColumnType::Integer, true),
            amount,
            column("loose", ColumnType::Number, false),
            column("at", ColumnType::Timestamp, false),
            column("ok", ColumnType::Boolean, false),
            column("doc", ColumnType::Json, false),
        ];
        let schema: Value = serde_json::from_str(&schema_string(&columns)).unwrap();
        let types: Vec<(&str, &str, bool)> = schema["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["name"].as_str().unwrap(), f["type"].as_str().unwrap(), f["nullable"].as_bool().unwrap()))
            .collect();
        assert_eq!(
            types,
            [
                ("id", "string", false),
                ("n", "long", false),
                ("amount", "decimal(12,2)", true),
                ("loose", "string", true),
                ("at", "timestamp", true),
                ("ok", "boolean", true),
                ("doc", "string", true),
            ]
        );
    }

    #[test]
    fn stats_keep_exact_bounds_and_leave_out_decimals() {
        let mut amount = column("amount", ColumnType::Number, false);
        amount.precision = Some(12);
        let stat = |column: &str, min: Value, exact: bool| ColumnStats {
            column: column.to_owned(),
            min: Some(min.clone()),
            max: Some(min),
            null_count: 1,
            min_exact: exact,
            max_exact: exact,
        };
        let stats =
            [stat("id", json!("a"), true), stat("subject", json!("lo"), false), stat("amount", json!("1.50"), true)];
        let text = file_stats(7, Some(&stats), &[OutputColumn::key("id"), amount]);
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["numRecords"], 7);
        assert_eq!(value["minValues"], json!({"id": "a"}));
        assert_eq!(value["maxValues"], json!({"id": "a"}));
        assert_eq!(value["nullCount"], json!({"id": 1, "subject": 1, "amount": 1}));
    }
}
