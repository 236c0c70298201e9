//! Deciding a dataset file's schema version from what PostgreSQL recorded before (the rules in
//! [`crate::schemas`]), and what each dataset then serves. Start-up registration
//! (`tenants::register`) drives it for every tenant file.

use std::collections::BTreeMap;
use std::sync::Arc;

use sqlx::{Postgres, Transaction};

use super::history::Recorded;
use super::{ColumnChange, DatasetVersions, SchemaVersion, ServedSchema, classify};
use crate::dataset::DatasetSchema;

/// What start-up does with a dataset file's schema.
#[derive(Debug, PartialEq)]
pub(crate) enum Decision {
    /// Recorded before as this version (unchanged, or a process of a rolling deploy that still
    /// has an earlier file of the same major).
    Known(SchemaVersion),
    /// A new version to record and announce.
    New { version: SchemaVersion, change: &'static str, changes: Vec<ColumnChange> },
}

pub(crate) async fn recorded(tx: &mut Transaction<'_, Postgres>, dataset: &str) -> anyhow::Result<Vec<Recorded>> {
    let rows = sqlx::query!(
        "SELECT major, minor, sha256, schema FROM dataset_schemas WHERE dataset = $1 ORDER BY major, minor",
        dataset,
    )
    .fetch_all(&mut **tx)
    .await?;
    rows.into_iter().map(|row| Recorded::from_row(row.major, row.minor, row.sha256, row.schema)).collect()
}

/// The version of `schema` given what is recorded (oldest first), or the field of the dataset
/// file to fix and why.
pub(crate) fn decide(
    recorded: &[Recorded],
    schema: &DatasetSchema,
    sha256: &str,
) -> Result<Decision, (&'static str, String)> {
    let declared = schema.version;
    let Some(latest) = recorded.last() else {
        let version = SchemaVersion { major: declared, minor: 0 };
        return Ok(Decision::New { version, change: "initial", changes: Vec::new() });
    };
    if let Some(known) = recorded.iter().rev().find(|r| r.sha256 == sha256 && r.version.major == latest.version.major) {
        return Ok(Decision::Known(known.version));
    }
    let current = latest.version;
    let next = current.major + 1;
    if declared < current.major {
        let why = format!(
            "declares version {declared}, but dataset `{}` already published version {current}: versions never go \
             back (declare version = {} for a compatible change, {next} for a breaking one)",
            schema.name, current.major
        );
        return Err(("version", why));
    }
    if declared > next {
        let why = format!("declares version {declared}, but the next major after {current} is {next}");
        return Err(("version", why));
    }
    let changes = classify(&latest.schema, schema);
    let breaking: Vec<String> = changes.iter().filter(|c| c.is_breaking()).map(ColumnChange::explain).collect();
    let change = if breaking.is_empty() { "compatible" } else { "breaking" };
    if declared == next {
        return Ok(Decision::New { version: SchemaVersion { major: next, minor: 0 }, change, changes });
    }
    if !breaking.is_empty() {
        let why = format!(
            "dataset `{}` changes incompatibly from schema version {current}: {}. Declare `version = {next}` in \
             the file to publish it as a new major version (a partner that must keep the old shape can be \
             pinned with `schema_pins.{} = {}`)",
            schema.name,
            breaking.join("; "),
            schema.name,
            current.major
        );
        return Err(("version", why));
    }
    Ok(Decision::New { version: SchemaVersion { major: current.major, minor: current.minor + 1 }, change, changes })
}

/// What a dataset serves: `schema` as `version`, and the newest recorded version of each older
/// major for partners pinned to it.
pub(crate) fn versions(recorded: &[Recorded], schema: Arc<DatasetSchema>, version: SchemaVersion) -> DatasetVersions {
    let mut older = BTreeMap::new();
    for r in recorded.iter().filter(|r| r.version.major < version.major) {
        // Oldest first: the last one of each major wins.
        older.insert(r.version.major, ServedSchema::pinned(r.schema.clone(), r.version, &schema));
    }
    let stale_fields =
        recorded.iter().flat_map(|r| &r.schema.columns).any(|c| schema.column(c.name.as_str()).is_none());
    DatasetVersions { current: ServedSchema::current(schema, version), older, stale_fields }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(version: u32, columns: &str) -> DatasetSchema {
        toml::from_str(&format!("name='t'\nversion={version}\nkey_column='id'\n{columns}")).unwrap()
    }

    const V1: &str = "[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'";

    fn recorded(versions: &[(u32, u32, &str)]) -> Vec<Recorded> {
        versions
            .iter()
            .map(|(major, minor, columns)| {
                let schema = schema(*major, columns);
                Recorded { version: SchemaVersion { major: *major, minor: *minor }, sha256: schema.sha256(), schema }
            })
            .collect()
    }

    fn decision(history: &[(u32, u32, &str)], schema: &DatasetSchema) -> Result<Decision, (&'static str, String)> {
        decide(&recorded(history), schema, &schema.sha256())
    }

    #[test]
    fn the_first_schema_is_its_declared_major() {
        let first = decision(&[], &schema(2, V1)).unwrap();
        let version = SchemaVersion { major: 2, minor: 0 };
        assert_eq!(first, Decision::New { version, change: "initial", changes: vec![] });
        assert_eq!(
            decision(&[(1, 0, V1)], &schema(1, V1)).unwrap(),
            Decision::Known(SchemaVersion { major: 1, minor: 0 })
        );
    }

    #[test]
    fn compatible_changes_are_minors_and_breaking_ones_need_the_next_major() {
        let added = format!("{V1}\n[[columns]]\nname='z'\ntype='string'");
        let Decision::New { version, change, .. } = decision(&[(1, 0, V1)], &schema(1, &added)).unwrap() else {
            panic!("not recorded")
        };
        assert_eq!((version.to_string(), change), ("1.1".into(), "compatible"));
        let renamed = "[[columns]]\nname='b'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'";
        let (field, why) = decision(&[(1, 0, V1), (1, 1, &added)], &schema(1, renamed)).unwrap_err();
        assert_eq!(field, "version");
        assert!(why.contains("column `a` is renamed to `b`"), "{why}");
        assert!(why.contains("Declare `version = 2`"), "{why}");
        let Decision::New { version, change, .. } = decision(&[(1, 0, V1)], &schema(2, renamed)).unwrap() else {
            panic!("not recorded")
        };
        assert_eq!((version.to_string(), change), ("2.0".into(), "breaking"));
        assert_eq!(decision(&[(1, 0, V1)], &schema(3, renamed)).unwrap_err().0, "version");
        assert_eq!(decision(&[(1, 0, V1), (2, 0, renamed)], &schema(1, V1)).unwrap_err().0, "version");
    }

    #[test]
    fn an_earlier_file_of_the_current_major_serves_its_recorded_version() {
        let added = format!("{V1}\n[[columns]]\nname='z'\ntype='string'");
        let history = [(1, 0, V1), (1, 1, added.as_str())];
        assert_eq!(decision(&history, &schema(1, V1)).unwrap(), Decision::Known(SchemaVersion { major: 1, minor: 0 }));
    }
}
