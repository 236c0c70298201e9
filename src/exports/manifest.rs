//! The manifest: an immutable description of a published export. Its bytes depend only on the
//! job and its data, never on the run (no timestamps of the run, hosts or attempts).

use serde::Serialize;
use serde_json::Value;

use super::Mode;
use crate::masking::{ColumnHasher, PolicySummary};
use crate::schemas::SchemaStamp;
use crate::writers::{Codec, ColumnStats, FileColumn, Format, OutputColumn, ShardSpec};

pub const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize)]
pub struct Manifest {
    pub manifest_version: u32,
    pub export_id: String,
    pub dataset: String,
    pub mode: Mode,
    pub format: Format,
    pub compression: &'static str,
    /// The dataset schema version the export was written with (absent: an export older than
    /// schema versions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema: Option<SchemaStamp>,
    /// The key column first, then the exported columns in file order.
    pub columns: Vec<OutputColumn>,
    /// Formats whose files declare their columns (Parquet): the columns as every shard file
    /// declares them (type and nullability).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_schema: Option<Vec<FileColumn>>,
    /// The request's filter and the partner's row filter, both applied.
    pub filter: Value,
    pub row_filter: Value,
    /// The partner's column policy its values went through (absent: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column_policy: Option<PolicySummary>,
    /// `pg_current_snapshot()` taken when the export was created — in an admin's export only:
    /// its transaction ids tell the whole cluster's write rate, which a partner has no use for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_watermark: Option<String>,
    pub created_at: String,
    /// Where an incremental feed continues from (filled in by the feeds capability).
    pub from_cursor: Option<String>,
    pub next_cursor: Option<String>,
    pub total_rows: u64,
    pub total_bytes: u64,
    /// The whole export as one gzip file (`GET …/file`): the shards spliced, one header. Null
    /// for formats whose shards are self-contained files (Parquet).
    pub file: Option<ManifestFile>,
    pub shards: Vec<ManifestShard>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ManifestFile {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ManifestShard {
    pub index: u32,
    /// File name for downloads (`shard-00000.csv.gz`, `shard-00000.parquet`).
    pub name: String,
    pub rows: u64,
    pub bytes: u64,
    pub sha256: String,
    pub first_key: Option<String>,
    pub last_key: Option<String>,
    /// Self-contained files (Parquet): each column's statistics, as the file's footer has them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<Vec<ColumnStats>>,
}

impl Manifest {
    /// The published bytes: pretty JSON in declaration order, newline-terminated.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("serializable");
        bytes.push(b'\n');
        bytes
    }
}

pub fn shard_name(index: u32, extension: &str) -> String {
    format!("shard-{index:05}.{extension}")
}

/// What every file of an export says of it in its own metadata (a Parquet footer).
pub struct FileFacts<'a> {
    pub export_id: uuid::Uuid,
    pub dataset: &'a str,
    pub mode: Mode,
    /// The export's snapshot, in an admin's export only (see [`Manifest::snapshot_watermark`]).
    pub watermark: Option<&'a str>,
    pub schema_sha256: &'a str,
    pub schema_version: &'a str,
    pub exportd_version: &'a str,
    pub columns: &'a [OutputColumn],
    /// The fingerprint of the partner's column policy, if it has one.
    pub column_policy: Option<&'a str>,
    /// Rows come in the order of the partner's hashed keys (see [`crate::records::KeyOrder`]).
    pub hashed_key_order: bool,
}

/// What every shard of an export of `format` and `codec` is written as: its columns, whether
/// rows come in the order of the key column as written (full exports: the key's order, or the
/// hashed key's where the partner's keys are hashed), the files' metadata and the partner's
/// hash key (`hash` rules).
pub fn shard_spec(format: Format, codec: Codec, facts: &FileFacts<'_>, hasher: Option<&ColumnHasher>) -> ShardSpec {
    ShardSpec {
        format,
        codec,
        columns: facts.columns.to_vec(),
        sorted_by_key: facts.mode == Mode::Full
            && (facts.hashed_key_order || facts.columns.first().is_some_and(|key| key.masked.is_none())),
        metadata: file_metadata(facts),
        hasher: hasher.cloned(),
    }
}

/// The key-value metadata of an export's files: `exportd.`-prefixed keys, in a fixed order.
fn file_metadata(facts: &FileFacts<'_>) -> Vec<(String, String)> {
    [
        ("exportd.export_id", facts.export_id.to_string()),
        ("exportd.dataset", facts.dataset.to_owned()),
        ("exportd.mode", facts.mode.as_str().to_owned()),
        ("exportd.snapshot_watermark", facts.watermark.unwrap_or_default().to_owned()),
        ("exportd.schema_sha256", facts.schema_sha256.to_owned()),
        ("exportd.version", facts.exportd_version.to_owned()),
        ("exportd.columns", serde_json::to_string(facts.columns).expect("serializable")),
    ]
    .into_iter()
    .filter(|(key, _)| *key != "exportd.snapshot_watermark" || facts.watermark.is_some())
    .chain(facts.column_policy.map(|fingerprint| ("exportd.column_policy", fingerprint.to_owned())))
    // Jobs created before schema versions rewrite their shards without it: same bytes.
    .chain(Some(facts.schema_version).filter(|v| !v.is_empty()).map(|v| ("exportd.schema_version", v.to_owned())))
    .map(|(key, value)| (key.to_owned(), value))
    .collect()
}
