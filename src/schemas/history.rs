//! The recorded versions of a dataset's schema, oldest first (`GET /v1/datasets/{ds}/schema`).

use anyhow::Context;
use sqlx::PgPool;
use time::OffsetDateTime;

use super::{ColumnChange, SchemaVersion};
use crate::dataset::DatasetSchema;

/// One `dataset_schemas` row: a version and the schema it was.
pub struct Recorded {
    pub version: SchemaVersion,
    pub sha256: String,
    pub schema: DatasetSchema,
}

impl Recorded {
    /// The row's columns as stored (the table's CHECK keeps `major` and `minor` non-negative).
    pub(super) fn from_row(major: i32, minor: i32, sha256: String, schema: serde_json::Value) -> anyhow::Result<Self> {
        Ok(Recorded {
            version: SchemaVersion { major: major as u32, minor: minor as u32 },
            sha256,
            schema: serde_json::from_value(schema).context("a recorded dataset schema")?,
        })
    }
}

pub struct HistoryEntry {
    pub recorded: Recorded,
    /// `initial`, `compatible` or `breaking`.
    pub change: String,
    pub changes: Vec<ColumnChange>,
    pub recorded_at: OffsetDateTime,
}

pub async fn history(pool: &PgPool, dataset: &str) -> anyhow::Result<Vec<HistoryEntry>> {
    let rows = sqlx::query!(
        "SELECT major, minor, sha256, schema, change, changes, recorded_at FROM dataset_schemas
         WHERE dataset = $1 ORDER BY major, minor",
        dataset,
    )
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(|row| {
            Ok(HistoryEntry {
                recorded: Recorded::from_row(row.major, row.minor, row.sha256, row.schema)?,
                change: row.change,
                changes: serde_json::from_value(row.changes).context("recorded schema changes")?,
                recorded_at: row.recorded_at,
            })
        })
        .collect()
}
