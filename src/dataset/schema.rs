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
    /// `number` columns only: the `DECIMAL(precision, scale)` Parquet writes the column as,
    /// exactly (a value that does not fit fails the export, never rounds). Without it Parquet
    /// carries the number's text, as CSV does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<u8>,
    /// Digits after the point, with `precision`; 0 when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<u8>,
}

/// The widest decimal exportd writes (Arrow's Decimal128, Parquet's 16-byte fixed length).
pub const MAX_DECIMAL_PRECISION: u8 = 38;

impl Column {
    /// `(precision, scale)` of a number column declared as a decimal.
    pub fn decimal(&self) -> Option<(u8, u8)> {
        self.precision.map(|p| (p, self.scale.unwrap_or(0)))
    }

    /// Checks the decimal declaration; returns the offending field (`precision` or `scale`) and
    /// a message.
    fn check_decimal(&self) -> Result<(), (&'static str, String)> {
        match (self.ty, self.precision, self.scale) {
            (_, None, None) => Ok(()),
            (ColumnType::Number, None, Some(_)) => Err(("scale", "give `precision` too".into())),
            (ColumnType::Number, Some(p), scale) => {
                if !(1..=MAX_DECIMAL_PRECISION).contains(&p) {
                    return Err(("precision", format!("must be between 1 and {MAX_DECIMAL_PRECISION}")));
                }
                match scale {
                    Some(s) if s > p => Err(("scale", format!("must be at most the precision ({p})"))),
                    _ => Ok(()),
                }
            }
            (ty, precision, _) => {
                let field = if precision.is_some() { "precision" } else { "scale" };
                Err((field, format!("applies to `number` columns only, not {ty:?}").to_lowercase()))
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSchema {
    pub name: DatasetName,
    /// The major schema version the file declares (1 when left out). A breaking change is
    /// refused at start-up unless it comes with the next major (see `crate::schemas`).
    #[serde(default = "first_version", skip_serializing_if = "is_first_version")]
    pub version: u32,
    /// Name under which a record's key appears in exports (always the first column).
    pub key_column: ColumnName,
    pub columns: Vec<Column>,
}

fn first_version() -> u32 {
    1
}

/// Left out of the hash input, so files that never declared a version keep their hash.
fn is_first_version(version: &u32) -> bool {
    *version == 1
}

impl DatasetSchema {
    pub fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|c| c.name.as_str() == name)
    }

    /// Checks what serde cannot: at least one column, no duplicates, key column not redeclared.
    /// Returns the offending field path and a message.
    pub fn check(&self) -> Result<(), (String, String)> {
        if self.version == 0 {
            return Err(("version".into(), "schema versions start at 1".into()));
        }
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
            column.check_decimal().map_err(|(field, message)| (format!("columns[{i}].{field}"), message))?;
        }
        Ok(())
    }

    /// sha256 of the schema as declared (name, key column, columns with their types), frozen
    /// into each export and written into Parquet footers.
    pub fn sha256(&self) -> String {
        super::sha256_hex(&serde_json::to_vec(self).expect("serializable"))
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
    fn decimals_are_declared_on_number_columns_within_bounds() {
        let with = |column: &str| schema(&format!("name='t'\nkey_column='id'\n[[columns]]\nname='a'\n{column}"));
        assert_eq!(with("type='number'\nprecision=18\nscale=2").columns[0].decimal(), Some((18, 2)));
        assert_eq!(with("type='number'\nprecision=38").columns[0].decimal(), Some((38, 0)));
        let refused = [
            ("type='number'\nprecision=39", "columns[0].precision"),
            ("type='number'\nprecision=0", "columns[0].precision"),
            ("type='number'\nprecision=4\nscale=5", "columns[0].scale"),
            ("type='number'\nscale=2", "columns[0].scale"),
            ("type='integer'\nprecision=10", "columns[0].precision"),
        ];
        for (column, field) in refused {
            assert_eq!(with(column).check().unwrap_err().0, field, "{column}");
        }
    }

    #[test]
    fn unknown_column_types_are_refused() {
        let err = toml::from_str::<DatasetSchema>("name='t'\nkey_column='id'\n[[columns]]\nname='a'\ntype='float'")
            .unwrap_err();
        assert!(err.to_string().contains("unknown variant `float`"), "{err}");
    }
}
