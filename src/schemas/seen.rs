//! A schema as one caller sees it: the columns it receives (after its column policy) and the
//! sha256 it is shown. A caller served the whole schema is shown the declared schema's sha256; a
//! caller with a column policy the sha256 of exactly what it is served, so nothing it is not
//! served — a dropped column, a hashed column's declared type — can be recovered by guessing
//! schemas until one hashes alike.

use serde_json::json;

use super::ServedSchema;
use crate::dataset::DatasetSchema;
use crate::dataset::OutputColumn;
use crate::masking::ColumnPolicy;

/// The key column, then `schema`'s columns, as a caller under `policy` receives them.
pub fn columns_seen(schema: &DatasetSchema, policy: Option<&ColumnPolicy>) -> Vec<OutputColumn> {
    let key = OutputColumn::key(schema.key_column.as_str());
    std::iter::once(key)
        .chain(schema.columns.iter().map(OutputColumn::of))
        .filter_map(|column| match policy {
            Some(policy) => policy.output_column(column),
            None => Some(column),
        })
        .collect()
}

/// [`columns_seen`] of a served version: a pinned version's columns the current one removed or
/// retyped say `retired`.
pub fn served_columns(served: &ServedSchema, policy: Option<&ColumnPolicy>) -> Vec<OutputColumn> {
    let mut columns = columns_seen(&served.schema, policy);
    columns.iter_mut().filter(|c| served.is_retired(&c.name)).for_each(OutputColumn::retire);
    columns
}

/// The sha256 a caller under `policy` is shown for a schema whose declared sha256 is `declared`
/// and whose columns it receives are `seen`: `declared` without a policy, else the sha256 of
/// `{"columns": seen, "dataset": name}` as compact JSON with sorted keys.
pub fn sha256_seen(dataset: &str, declared: &str, seen: &[OutputColumn], policy: Option<&ColumnPolicy>) -> String {
    match policy {
        None => declared.to_owned(),
        Some(_) => {
            // A Value's objects keep their keys sorted (serde_json without preserve_order).
            let document = json!({"dataset": dataset, "columns": seen});
            crate::dataset::sha256_hex(&serde_json::to_vec(&document).expect("serializable"))
        }
    }
}

/// The sha256 a caller under `policy` is shown for the version it is served.
pub fn served_sha256(served: &ServedSchema, policy: Option<&ColumnPolicy>) -> String {
    let seen = served_columns(served, policy);
    sha256_seen(served.schema.name.as_str(), &served.sha256, &seen, policy)
}
