//! Dataset schemas (`tenants/datasets/<name>.toml`): a key column plus typed columns in a fixed order.

use serde::{Deserialize, Serialize};

use super::names::{ColumnName, DatasetName};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ColumnType {
    String,
    Integer,
    Number,
    Boolean,
    /// RFC 3339 text, e.g. `2026-11-30T10:00:00Z`.
    Timestamp,
    /// Any JSON value, exported as its JSON text.
    Json,
}

impl ColumnType {
    /// Whether a JSON value of this column is written to CSV as a bare number.
    pub fn is_numeric(self) -> bool {
        matches!(self, ColumnType::Integer | ColumnType::Number)
    }

    /// Whether `value` can be compared for equality with this column in a filter (a request's
    /// `filter` or a partner's `row_filter`). JSON columns cannot be filtered.
    pub fn accepts_filter_value(self, value: &serde_json::Value) -> bool {
        match self {
            ColumnType::String | ColumnType::Timestamp => value.is_string(),
            ColumnType::Integer => value.is_i64() || value.is_u64(),
            ColumnType::Number => value.is_number(),
            ColumnType::Boolean => value.is_boolean(),
            ColumnType::Json => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Column {
    pub name: ColumnName,
    #[serde(rename = "type")]
    pub ty: ColumnType,
    /// A required column must be present and non-null in every record.
    #[serde(default)]
    pub required: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSchema {
    pub name: DatasetName,
    /// Name under which a record's key appears in exports (always the first column).
    pub key_column: ColumnName,
    pub columns: Vec<Column>,
}

impl DatasetSchema {
    pub fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|c| c.name.as_str() == name)
    }

    /// Checks what serde cannot: at least one column, no duplicates, key column not redeclared.
    /// Returns the offending field path and a message.
    pub fn check(&self) -> Result<(), (String, String)> {
        if self.columns.is_empty() {
            return Err(("columns".into(), "a dataset needs at least one column".into()));
        }
        for (i, column) in self.columns.iter().enumerate() {
            if column.name == self.key_column {
                return Err((format!("columns[{i}].name"), format!("`{}` is already the key column", column.name)));
            }
            if self.columns[..i].iter().any(|c| c.name == column.name) {
                return Err((format!("columns[{i}].name"), format!("duplicate column `{}`", column.name)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(text: &str) -> DatasetSchema {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn duplicate_and_key_columns_are_refused() {
        let dup = schema(
            "name='t'\nkey_column='id'\n[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='a'\ntype='integer'",
        );
        assert_eq!(dup.check().unwrap_err().0, "columns[1].name");
        let key = schema("name='t'\nkey_column='id'\n[[columns]]\nname='id'\ntype='string'");
        assert_eq!(key.check().unwrap_err().0, "columns[0].name");
    }

    #[test]
    fn unknown_column_types_are_refused() {
        let err = toml::from_str::<DatasetSchema>("name='t'\nkey_column='id'\n[[columns]]\nname='a'\ntype='float'")
            .unwrap_err();
        assert!(err.to_string().contains("unknown variant `float`"), "{err}");
    }
}
