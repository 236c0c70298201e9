//! What changed between two versions of a dataset schema, and whether a partner loading the
//! old shape keeps working (compatible: a minor version) or may lose data (breaking: a major one).

use serde::{Deserialize, Serialize};

use crate::dataset::ColumnRule;
use crate::dataset::{Column, ColumnType, DatasetSchema};
use crate::masking::ColumnPolicy;

/// One difference between two schemas, as recorded with the newer one and told to partners.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum ColumnChange {
    /// A new column (breaking when required: records stored before lack it).
    Added {
        column: String,
        #[serde(rename = "type")]
        ty: String,
        required: bool,
    },
    /// A column is gone.
    Removed {
        column: String,
        #[serde(rename = "type")]
        ty: String,
    },
    /// A column gone and a new one of the same type in its place: most likely a rename.
    Renamed { column: String, to: String },
    /// The type changed in a way some values of the old type do not survive.
    Retyped { column: String, from: String, to: String },
    /// The type grew, losing nothing (integer → number, a wider decimal).
    Widened { column: String, from: String, to: String },
    /// An optional column became required.
    Required { column: String },
    /// A required column became optional.
    Optional { column: String },
    /// The key column has another name.
    KeyRenamed { column: String, to: String },
}

impl ColumnChange {
    pub fn is_breaking(&self) -> bool {
        match self {
            ColumnChange::Added { required, .. } => *required,
            ColumnChange::Widened { .. } | ColumnChange::Optional { .. } => false,
            ColumnChange::Removed { .. }
            | ColumnChange::Renamed { .. }
            | ColumnChange::Retyped { .. }
            | ColumnChange::Required { .. }
            | ColumnChange::KeyRenamed { .. } => true,
        }
    }

    /// The columns it names (the old name first), so a partner's view can leave out a change
    /// of a column its policy drops.
    pub fn columns(&self) -> Vec<&str> {
        match self {
            ColumnChange::Renamed { column, to } | ColumnChange::KeyRenamed { column, to } => vec![column, to],
            ColumnChange::Added { column, .. }
            | ColumnChange::Removed { column, .. }
            | ColumnChange::Retyped { column, .. }
            | ColumnChange::Widened { column, .. }
            | ColumnChange::Required { column }
            | ColumnChange::Optional { column } => vec![column],
        }
    }

    /// What the change is and what a partner reading the old shape would lose.
    pub fn explain(&self) -> String {
        match self {
            ColumnChange::Added { column, ty, required: true } => format!(
                "column `{column}` ({ty}) is added as required: records stored before have no value for it, \
                 so the dataset's existing rows would not fit the schema partners are told"
            ),
            ColumnChange::Added { column, ty, .. } => format!("column `{column}` ({ty}) is added"),
            ColumnChange::Removed { column, ty } => {
                format!("column `{column}` ({ty}) is removed: partners would lose its values")
            }
            ColumnChange::Renamed { column, to } => format!(
                "column `{column}` is renamed to `{to}`: partners reading `{column}` would lose its values \
                 (records stored before keep them under the old name, so `{to}` is null for them)"
            ),
            ColumnChange::Retyped { column, from, to } => format!(
                "column `{column}` changes type from {from} to {to}: partners loading it as {from} would fail \
                 or lose values"
            ),
            ColumnChange::Widened { column, from, to } => format!("column `{column}` widens from {from} to {to}"),
            ColumnChange::Required { column } => format!(
                "column `{column}` becomes required: rows stored without a value no longer fit, and partners \
                 whose loaders declare it nullable see a changed contract"
            ),
            ColumnChange::Optional { column } => format!("column `{column}` may now be null"),
            ColumnChange::KeyRenamed { column, to } => format!(
                "the key column is renamed from `{column}` to `{to}`: partners matching rows by `{column}` \
                 would lose their key"
            ),
        }
    }
}

/// The changes a partner under `policy` is told of, each with its `explanation`: none of a column
/// its policy drops (the column does not exist for it).
pub fn as_seen(changes: &[ColumnChange], policy: Option<&ColumnPolicy>) -> Vec<serde_json::Value> {
    let dropped = |column: &str| policy.is_some_and(|p| p.rule(column) == Some(ColumnRule::Drop));
    changes
        .iter()
        .filter(|c| !c.columns().iter().any(|column| dropped(column)))
        .map(|c| {
            let mut value = serde_json::to_value(c).expect("serializable");
            value["explanation"] = c.explain().into();
            value
        })
        .collect()
}

/// The changes from `old` to `new`, in column order.
pub fn classify(old: &DatasetSchema, new: &DatasetSchema) -> Vec<ColumnChange> {
    let mut changes = Vec::new();
    if old.key_column != new.key_column {
        changes.push(ColumnChange::KeyRenamed { column: old.key_column.to_string(), to: new.key_column.to_string() });
    }
    let removed: Vec<(usize, &Column)> =
        old.columns.iter().enumerate().filter(|(_, c)| new.column(c.name.as_str()).is_none()).collect();
    let added: Vec<(usize, &Column)> =
        new.columns.iter().enumerate().filter(|(_, c)| old.column(c.name.as_str()).is_none()).collect();
    // A removed column whose place a new column of the same type takes reads as a rename.
    let renamed_to = |at: usize, column: &Column| {
        added.iter().find(|(i, c)| *i == at && c.ty == column.ty && c.decimal() == column.decimal()).map(|(_, c)| *c)
    };
    let mut renamed_targets = Vec::new();
    for (at, column) in &removed {
        match renamed_to(*at, column) {
            Some(target) => {
                renamed_targets.push(target.name.as_str());
                changes.push(ColumnChange::Renamed { column: column.name.to_string(), to: target.name.to_string() });
            }
            None => changes.push(ColumnChange::Removed { column: column.name.to_string(), ty: type_text(column) }),
        }
    }
    for before in &old.columns {
        let Some(after) = new.column(before.name.as_str()) else { continue };
        let column = before.name.to_string();
        if (before.ty, before.decimal()) != (after.ty, after.decimal()) {
            let (from, to) = (type_text(before), type_text(after));
            changes.push(if widens(before, after) {
                ColumnChange::Widened { column: column.clone(), from, to }
            } else {
                ColumnChange::Retyped { column: column.clone(), from, to }
            });
        }
        match (before.required, after.required) {
            (false, true) => changes.push(ColumnChange::Required { column }),
            (true, false) => changes.push(ColumnChange::Optional { column }),
            _ => {}
        }
    }
    for (_, column) in added.iter().filter(|(_, c)| !renamed_targets.contains(&c.name.as_str())) {
        changes.push(ColumnChange::Added {
            column: column.name.to_string(),
            ty: type_text(column),
            required: column.required,
        });
    }
    changes
}

/// Whether every value of `from`'s type is a value of `to`'s, written the same in every format:
/// an integer as a plain number; a decimal as one with at least as many digits on both sides
/// of the point. (A decimal to a plain number changes its Parquet type, so it is a retype.)
fn widens(from: &Column, to: &Column) -> bool {
    match ((from.ty, from.decimal()), (to.ty, to.decimal())) {
        ((ColumnType::Integer, _), (ColumnType::Number, None)) => true,
        ((ColumnType::Number, Some((p, s))), (ColumnType::Number, Some((p2, s2)))) => s2 >= s && p2 - s2 >= p - s,
        _ => false,
    }
}

/// A column's type as partners read it: `integer`, `number(12,2)`, `string`.
fn type_text(column: &Column) -> String {
    let name = format!("{:?}", column.ty).to_lowercase();
    match column.decimal() {
        Some((p, s)) => format!("{name}({p},{s})"),
        None => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(columns: &str) -> DatasetSchema {
        toml::from_str(&format!("name='t'\nkey_column='id'\n{columns}")).unwrap()
    }

    const BASE: &str = "[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'\n\
                        [[columns]]\nname='m'\ntype='number'\nprecision=12\nscale=2";

    fn changes(new: &str) -> Vec<ColumnChange> {
        classify(&schema(BASE), &schema(new))
    }

    #[test]
    fn optional_additions_and_widenings_are_compatible() {
        let added = changes(&format!("{BASE}\n[[columns]]\nname='z'\ntype='boolean'"));
        assert_eq!(added, [ColumnChange::Added { column: "z".into(), ty: "boolean".into(), required: false }]);
        assert!(!added[0].is_breaking());
        let widened = changes(
            "[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='n'\ntype='number'\n\
             [[columns]]\nname='m'\ntype='number'\nprecision=14\nscale=3",
        );
        assert_eq!(widened.len(), 2, "{widened:?}");
        assert!(widened.iter().all(|c| matches!(c, ColumnChange::Widened { .. })), "{widened:?}");
        assert!(changes(BASE).is_empty());
    }

    #[test]
    fn removals_renames_retypes_and_requirements_break() {
        let renamed = changes(
            "[[columns]]\nname='b'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'\n[[columns]]\nname='m'\ntype='number'\nprecision=12\nscale=2",
        );
        assert_eq!(renamed, [ColumnChange::Renamed { column: "a".into(), to: "b".into() }]);
        assert!(renamed[0].explain().contains("partners reading `a` would lose its values"));
        let removed = changes("[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'");
        assert_eq!(removed, [ColumnChange::Removed { column: "m".into(), ty: "number(12,2)".into() }]);
        let narrowed = changes(
            "[[columns]]\nname='a'\ntype='string'\nrequired=true\n[[columns]]\nname='n'\ntype='string'\n\
             [[columns]]\nname='m'\ntype='number'\nprecision=12\nscale=1",
        );
        assert_eq!(narrowed.len(), 3, "{narrowed:?}");
        assert!(narrowed.iter().all(ColumnChange::is_breaking), "{narrowed:?}");
        let required = changes(&format!("{BASE}\n[[columns]]\nname='z'\ntype='string'\nrequired=true"));
        assert!(required[0].is_breaking());
        let key = classify(&schema(BASE), &toml::from_str(&format!("name='t'\nkey_column='k'\n{BASE}")).unwrap());
        assert_eq!(key, [ColumnChange::KeyRenamed { column: "id".into(), to: "k".into() }]);
    }

    #[test]
    fn a_removed_column_with_another_type_in_its_place_is_not_a_rename() {
        let replaced = changes(
            "[[columns]]\nname='b'\ntype='integer'\n[[columns]]\nname='n'\ntype='integer'\n[[columns]]\nname='m'\ntype='number'\nprecision=12\nscale=2",
        );
        assert_eq!(replaced.len(), 2);
        assert!(matches!(replaced[0], ColumnChange::Removed { .. }));
        assert!(matches!(replaced[1], ColumnChange::Added { .. }));
    }
}
