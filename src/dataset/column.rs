//! A column of an output file, as a partner receives it.

use serde::{Deserialize, Serialize};

use super::{Column, ColumnRule, ColumnType};

/// One output column: the key column comes first, then the selected dataset columns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputColumn {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: ColumnType,
    /// Never null: the key, `_op`, and a full export's required columns (Parquet declares them
    /// REQUIRED).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub required: bool,
    /// A number column's declared `DECIMAL(precision, scale)` (see the dataset file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<u8>,
    /// The rule of the partner's column policy its values went through (`null`, `truncate(n)`,
    /// `hash`); a dropped column is not there at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masked: Option<ColumnRule>,
    /// A column of a partner's pinned (older) schema version that the current version removed
    /// or retyped: always null.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retired: bool,
}

impl OutputColumn {
    /// The record key's column (or `_op`): text, never null.
    pub fn key(name: &str) -> Self {
        OutputColumn {
            name: name.to_owned(),
            ty: ColumnType::String,
            required: true,
            precision: None,
            scale: None,
            masked: None,
            retired: false,
        }
    }

    /// A dataset column as declared.
    pub fn of(column: &Column) -> Self {
        OutputColumn {
            name: column.name.to_string(),
            ty: column.ty,
            required: column.required,
            precision: column.precision,
            scale: column.scale,
            masked: None,
            retired: false,
        }
    }

    /// Makes this a retired column of a pinned schema: nullable, always null.
    pub fn retire(&mut self) {
        self.retired = true;
        self.required = false;
    }

    /// `(precision, scale)` of a number column declared as a decimal.
    pub fn decimal(&self) -> Option<(u8, u8)> {
        self.precision.map(|p| (p, self.scale.unwrap_or(0)))
    }
}
