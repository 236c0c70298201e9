//! Shard files: rows encoded as CSV or JSONL, gzip-compressed with a fixed header, checksummed.
//!
//! The bytes of a shard depend only on its rows: gzip mtime 0 and no name, one pinned flate2
//! backend (miniz_oxide) and level, no mid-stream flushes. A golden-hash test guards this.

mod escape;

use std::io::{self, Write};

use flate2::write::GzEncoder;
use flate2::{Compression, GzBuilder};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

pub use escape::{csv_cell, escape_formula};

use crate::tenants::ColumnType;

/// Changing this changes every shard's bytes (and the golden hash).
const GZIP_LEVEL: u32 = 6;
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Csv,
    Jsonl,
}

impl Format {
    pub fn extension(self) -> &'static str {
        match self {
            Format::Csv => "csv.gz",
            Format::Jsonl => "jsonl.gz",
        }
    }
}

/// One output column: the key column comes first, then the selected dataset columns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputColumn {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: ColumnType,
}

/// What a finished shard file is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardDigest {
    pub rows: u64,
    pub bytes: u64,
    pub sha256: String,
}

/// The CSV variant is the larger; one encoder lives per shard, so the size does not matter.
#[allow(clippy::large_enum_variant)]
enum Encoder<W: Write> {
    Csv(csv::Writer<GzEncoder<HashingWriter<W>>>),
    Jsonl(GzEncoder<HashingWriter<W>>),
}

/// Streams rows into one compressed shard. Memory stays bounded by the encoders' buffers.
pub struct ShardWriter<W: Write> {
    encoder: Encoder<W>,
    columns: Vec<OutputColumn>,
    rows: u64,
    line: Vec<u8>,
}

impl<W: Write> ShardWriter<W> {
    /// Starts a shard; a CSV shard begins with a BOM and the header row.
    pub fn new(out: W, format: Format, columns: Vec<OutputColumn>) -> io::Result<Self> {
        let gzip = GzBuilder::new().mtime(0).write(HashingWriter::new(out), Compression::new(GZIP_LEVEL));
        let encoder = match format {
            Format::Csv => {
                let mut gzip = gzip;
                gzip.write_all(UTF8_BOM)?;
                let mut csv = csv::WriterBuilder::new()
                    .quote_style(csv::QuoteStyle::Always)
                    .terminator(csv::Terminator::CRLF)
                    .from_writer(gzip);
                csv.write_record(columns.iter().map(|c| c.name.as_str()))?;
                Encoder::Csv(csv)
            }
            Format::Jsonl => Encoder::Jsonl(gzip),
        };
        Ok(ShardWriter { encoder, columns, rows: 0, line: Vec::new() })
    }

    /// Appends one record: its key, and the selected columns from `data` (absent = null).
    pub fn write_row(&mut self, key: &str, data: &Map<String, Value>) -> io::Result<()> {
        let (key_column, data_columns) = self.columns.split_first().expect("the key column is always there");
        match &mut self.encoder {
            Encoder::Csv(csv) => {
                let mut record = Vec::with_capacity(self.columns.len());
                record.push(escape_formula(key));
                record.extend(data_columns.iter().map(|c| csv_cell(data.get(&c.name), c.ty)));
                csv.write_record(record.iter().map(|cell| cell.as_bytes()))?;
            }
            Encoder::Jsonl(gzip) => {
                // serde_json's Map is a BTreeMap (preserve_order stays off): keys come out sorted.
                let mut object = Map::new();
                object.insert(key_column.name.clone(), Value::String(key.to_owned()));
                for column in data_columns {
                    object.insert(column.name.clone(), data.get(&column.name).cloned().unwrap_or(Value::Null));
                }
                self.line.clear();
                serde_json::to_writer(&mut self.line, &object)?;
                self.line.push(b'\n');
                gzip.write_all(&self.line)?;
            }
        }
        self.rows += 1;
        Ok(())
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Ends the gzip stream and returns the inner writer with the shard's size and sha256.
    pub fn finish(self) -> io::Result<(W, ShardDigest)> {
        let gzip = match self.encoder {
            Encoder::Csv(csv) => csv.into_inner().map_err(|e| e.into_error())?,
            Encoder::Jsonl(gzip) => gzip,
        };
        let hashing = gzip.finish()?;
        let (out, bytes, sha256) = hashing.into_parts();
        Ok((out, ShardDigest { rows: self.rows, bytes, sha256 }))
    }
}

/// Counts and hashes everything written through it.
pub struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
}

impl<W> HashingWriter<W> {
    pub fn new(inner: W) -> Self {
        HashingWriter { inner, hasher: Sha256::new(), bytes: 0 }
    }

    /// The inner writer, the byte count and the lowercase hex sha256.
    pub fn into_parts(self) -> (W, u64, String) {
        (self.inner, self.bytes, hex::encode(self.hasher.finalize()))
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::read::MultiGzDecoder;
    use serde_json::json;
    use std::io::Read;

    fn columns() -> Vec<OutputColumn> {
        vec![
            OutputColumn { name: "id".into(), ty: ColumnType::String },
            OutputColumn { name: "subject".into(), ty: ColumnType::String },
            OutputColumn { name: "amount".into(), ty: ColumnType::Number },
            OutputColumn { name: "tags".into(), ty: ColumnType::Json },
        ]
    }

    fn rows() -> Vec<(&'static str, Map<String, Value>)> {
        let row = |v: Value| v.as_object().unwrap().clone();
        vec![
            ("k1", row(json!({"subject": "=HYPERLINK(\"x\")", "amount": -3.5, "tags": ["a"]}))),
            ("k2", row(json!({"subject": "say \"hi\",\r\nthen go", "amount": null}))),
            ("k3", row(json!({"subject": "Zürich 東京", "amount": 12, "tags": {"z": 1, "a": 2}}))),
        ]
    }

    fn shard(format: Format) -> (Vec<u8>, ShardDigest) {
        let mut writer = ShardWriter::new(Vec::new(), format, columns()).unwrap();
        for (key, data) in rows() {
            writer.write_row(key, &data).unwrap();
        }
        writer.finish().unwrap()
    }

    fn gunzip(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        MultiGzDecoder::new(bytes).read_to_end(&mut out).unwrap();
        out
    }

    #[test]
    fn csv_shards_have_bom_header_crlf_and_quoted_escaped_fields() {
        let (bytes, digest) = shard(Format::Csv);
        assert_eq!(&bytes[..10], b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff", "fixed gzip header, mtime 0");
        assert_eq!(digest.rows, 3);
        assert_eq!(digest.bytes, bytes.len() as u64);
        assert_eq!(digest.sha256, sha256_hex(&bytes));
        let text = String::from_utf8(gunzip(&bytes)).unwrap();
        assert_eq!(
            text,
            "\u{feff}\"id\",\"subject\",\"amount\",\"tags\"\r\n\
             \"k1\",\"'=HYPERLINK(\"\"x\"\")\",\"-3.5\",\"[\"\"a\"\"]\"\r\n\
             \"k2\",\"say \"\"hi\"\",\r\nthen go\",\"\",\"\"\r\n\
             \"k3\",\"Zürich 東京\",\"12\",\"{\"\"a\"\":2,\"\"z\"\":1}\"\r\n"
        );
    }

    #[test]
    fn jsonl_shards_have_sorted_keys_and_nulls_for_missing_columns() {
        let (bytes, _) = shard(Format::Jsonl);
        let text = String::from_utf8(gunzip(&bytes)).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], r#"{"amount":-3.5,"id":"k1","subject":"=HYPERLINK(\"x\")","tags":["a"]}"#);
        assert_eq!(lines[1], r#"{"amount":null,"id":"k2","subject":"say \"hi\",\r\nthen go","tags":null}"#);
        assert_eq!(lines.len(), 3);
    }

    /// If this fails, a dependency or setting changed the bytes of every shard: exports of
    /// unchanged data would no longer match earlier checksums. Change it only on purpose.
    #[test]
    fn golden_hashes_pin_the_shard_bytes() {
        assert_eq!(shard(Format::Csv).1.sha256, "056727f7896624476628e13e0895ac8c63ce434ad21dde9c3f3070fc83a1433f");
        assert_eq!(shard(Format::Jsonl).1.sha256, "7dd5dbf220b633f3d0be8965d249034f9cecc1e88eb220eb97a0047393213ca1");
    }
}
