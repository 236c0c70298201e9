//! The manifest: an immutable description of a published export. Its bytes depend only on the
//! job and its data, never on the run (no timestamps of the run, hosts or attempts).

use serde::Serialize;
use serde_json::Value;

use super::Mode;
use crate::writers::{Format, OutputColumn};

pub const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize)]
pub struct Manifest {
    pub manifest_version: u32,
    pub export_id: String,
    pub dataset: String,
    pub mode: Mode,
    pub format: Format,
    pub compression: &'static str,
    /// The key column first, then the exported columns in file order.
    pub columns: Vec<OutputColumn>,
    /// The request's filter and the partner's row filter, both applied.
    pub filter: Value,
    pub row_filter: Value,
    /// `pg_current_snapshot()` taken when the export was created.
    pub snapshot_watermark: String,
    pub created_at: String,
    /// Where an incremental feed continues from (filled in by the feeds capability).
    pub from_cursor: Option<String>,
    pub next_cursor: Option<String>,
    pub total_rows: u64,
    pub total_bytes: u64,
    /// The whole export as one gzip file (`GET …/file`): the shards spliced, one header.
    pub file: ManifestFile,
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
    /// File name for downloads (`shard-00000.csv.gz`).
    pub name: String,
    pub rows: u64,
    pub bytes: u64,
    pub sha256: String,
    pub first_key: Option<String>,
    pub last_key: Option<String>,
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
