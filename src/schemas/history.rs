//! The recorded versions of a dataset's schema, oldest first (`GET /v1/datasets/{ds}/schema`).

use anyhow::Context;
use sqlx::PgPool;
use time::OffsetDateTime;

use super::{ColumnChange, SchemaVersion};
use crate::tenants::DatasetSchema;

pub struct HistoryEntry {
    pub version: SchemaVersion,
    pub sha256: String,
    /// `initial`, `compatible` or `breaking`.
    pub change: String,
    pub changes: Vec<ColumnChange>,
    pub schema: DatasetSchema,
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
                version: SchemaVersion { major: row.major as u32, minor: row.minor as u32 },
                sha256: row.sha256,
                change: row.change,
                changes: serde_json::from_value(row.changes).context("recorded schema changes")?,
                schema: serde_json::from_value(row.schema).context("a recorded dataset schema")?,
                recorded_at: row.recorded_at,
            })
        })
        .collect()
}
