//! Dataset schema versions. Every distinct schema exportd serves is recorded in PostgreSQL as
//! `major.minor` when a process starts with a changed dataset file: a compatible change (an
//! optional column added, a lossless widening) is the next minor version; a breaking one
//! (removed, renamed or retyped column, a column made required) is refused unless the file
//! declares the next major (`version = N+1`). Every export and feed page names the version it
//! was written with, and a partner may pin an older major to keep receiving its shape.

mod change;
mod history;
mod seen;
pub(crate) mod versioning;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

pub use change::{ColumnChange, as_seen, classify};
pub use history::{HistoryEntry, Recorded, history};
pub use seen::{columns_seen, served_columns, served_sha256, sha256_seen};

use crate::dataset::{ColumnName, DatasetName, DatasetSchema};

/// `major.minor`: the major is the dataset file's declared `version`; the minor counts the
/// compatible changes recorded since.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SchemaVersion {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for SchemaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl Serialize for SchemaVersion {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// What a manifest, a feed page or a Parquet footer says of the schema it was written with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SchemaStamp {
    /// `major.minor`.
    pub version: String,
    pub sha256: String,
}

/// One recorded schema as this process serves it.
#[derive(Debug, Clone)]
pub struct ServedSchema {
    pub version: SchemaVersion,
    pub sha256: String,
    pub schema: Arc<DatasetSchema>,
    /// An older major's columns that the current schema removed or retyped: a partner pinned to
    /// it receives them as null (stored values may not fit the old type any more).
    pub retired: BTreeSet<ColumnName>,
}

impl ServedSchema {
    fn current(schema: Arc<DatasetSchema>, version: SchemaVersion) -> Self {
        ServedSchema { version, sha256: schema.sha256(), schema, retired: BTreeSet::new() }
    }

    /// An older version, as a partner pinned to it receives it while `current` is served.
    fn pinned(schema: DatasetSchema, version: SchemaVersion, current: &DatasetSchema) -> Self {
        let retired = schema
            .columns
            .iter()
            .filter(|old| {
                current.column(old.name.as_str()).is_none_or(|now| (now.ty, now.decimal()) != (old.ty, old.decimal()))
            })
            .map(|c| c.name.clone())
            .collect();
        ServedSchema { version, sha256: schema.sha256(), schema: Arc::new(schema), retired }
    }

    /// What a caller under `policy` is told of this version: its sha256 as that caller sees it.
    pub fn stamp_for(&self, policy: Option<&crate::masking::ColumnPolicy>) -> SchemaStamp {
        SchemaStamp { version: self.version.to_string(), sha256: served_sha256(self, policy) }
    }

    pub fn is_retired(&self, column: &str) -> bool {
        self.retired.contains(column)
    }

    /// A stored record's JSON object as this schema shows it: its columns only (a stored record
    /// may hold a field of an older version), retired ones null.
    pub fn project(&self, data: &str) -> serde_json::Result<String> {
        let mut stored: Map<String, Value> = serde_json::from_str(data)?;
        let mut shown = Map::new();
        for column in &self.schema.columns {
            let name = column.name.as_str();
            if self.is_retired(name) {
                shown.insert(name.to_owned(), Value::Null);
            } else if let Some(value) = stored.remove(name) {
                shown.insert(name.to_owned(), value);
            }
        }
        serde_json::to_string(&shown)
    }
}

/// A dataset's schemas this process serves: the current one and the newest of each older major.
#[derive(Debug, Clone)]
pub struct DatasetVersions {
    pub current: ServedSchema,
    older: BTreeMap<u32, ServedSchema>,
    /// Whether some recorded version has a column the current schema lacks: stored records may
    /// then hold fields that feed pages leave out.
    stale_fields: bool,
}

impl DatasetVersions {
    /// The file's schema as its declared major, before start-up recorded it (the registry as
    /// loaded; [`register`] replaces it with what PostgreSQL holds).
    pub fn provisional(schema: Arc<DatasetSchema>) -> Self {
        let version = SchemaVersion { major: schema.version, minor: 0 };
        DatasetVersions { current: ServedSchema::current(schema, version), older: BTreeMap::new(), stale_fields: false }
    }

    /// The schema a partner pinned to `pin` (a major) receives: that major's newest version if
    /// it is older than the current one, else the current one.
    /// Whether `major` was published (the current one or an older one kept for pins).
    pub fn has_major(&self, major: u32) -> bool {
        major == self.current.version.major || self.older.contains_key(&major)
    }

    pub fn served(&self, pin: Option<u32>) -> &ServedSchema {
        pin.and_then(|major| self.older.get(&major)).unwrap_or(&self.current)
    }

    /// Whether feed data must be projected to show `served`.
    pub fn projects(&self, served: &ServedSchema) -> bool {
        self.stale_fields || served.version.major != self.current.version.major
    }

    /// The older majors a partner may pin.
    pub fn older_majors(&self) -> impl Iterator<Item = u32> + '_ {
        self.older.keys().copied()
    }
}

/// Every served dataset's versions, as start-up recorded them.
pub type SchemaCatalog = BTreeMap<DatasetName, DatasetVersions>;

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(columns: &str) -> DatasetSchema {
        toml::from_str(&format!("name='t'\nkey_column='id'\n{columns}")).unwrap()
    }

    #[test]
    fn a_pinned_schema_nulls_what_the_current_one_removed_or_retyped() {
        let old = schema(
            "[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'\n[[columns]]\nname='gone'\ntype='string'",
        );
        let now = schema(
            "[[columns]]\nname='n'\ntype='string'\n[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='new'\ntype='string'",
        );
        let pinned = ServedSchema::pinned(old, SchemaVersion { major: 1, minor: 3 }, &now);
        assert_eq!(pinned.retired.iter().map(|c| c.as_str()).collect::<Vec<_>>(), ["gone", "n"]);
        let shown = pinned.project(r#"{"a": "x", "n": "7", "new": 1, "gone": "old value"}"#).unwrap();
        assert_eq!(shown, r#"{"a":"x","gone":null,"n":null}"#);
        assert_eq!(pinned.project(r#"{"new": 1}"#).unwrap(), r#"{"gone":null,"n":null}"#, "absent stays absent");
        assert_eq!(SchemaVersion { major: 1, minor: 3 }.to_string(), "1.3");
    }
}
