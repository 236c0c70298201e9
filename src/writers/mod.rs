//! Shard files: rows encoded as CSV or JSONL, gzip-compressed, checksummed.
//!
//! The bytes of a shard depend only on its rows and its export's [`Codec`]: fixed gzip header
//! (mtime 0, no name), one pinned deflate implementation and level per codec, input fed in
//! fixed-size chunks, no flush except where the framing in [`gzip`] needs one. Golden-hash tests
//! guard this, one per codec and format.

mod cell;
mod codec;
mod compressor;
mod csv;
mod escape;
mod format;
pub mod gzip;
mod jsonl;

use std::io::{self, Write};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use cell::{Cell, FieldIndex, Fields};
pub use codec::Codec;
pub use escape::{csv_cell, escape_formula};
pub use format::{Format, FormatSpec, RowEncoder};

use crate::tenants::ColumnType;
use compressor::Compressor;
use gzip::Part;

/// One output column: the key column comes first, then the selected dataset columns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputColumn {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: ColumnType,
}

/// What a finished shard file is, including where its parts lie (see [`gzip`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardDigest {
    pub rows: u64,
    pub bytes: u64,
    pub sha256: String,
    /// The format's head (BOM and CSV header; empty for JSONL), right after the 10-byte gzip header.
    pub head: Part,
    /// The rows, right after the head.
    pub body: Part,
}

/// Streams rows into one compressed shard. Memory stays bounded by the encoder's buffers.
/// Rows are encoded on the caller's thread and deflated on a second one.
pub struct ShardWriter<W: Write + Send + 'static> {
    encoder: Box<dyn RowEncoder>,
    fields: FieldIndex,
    compressor: Compressor<W>,
    rows: u64,
    line: Vec<u8>,
}

impl<W: Write + Send + 'static> ShardWriter<W> {
    /// Starts a shard with the format's head (a CSV shard: BOM and header row).
    pub fn new(out: W, format: Format, codec: Codec, columns: Vec<OutputColumn>) -> io::Result<Self> {
        let mut encoder = (format.spec().encoder)(&columns);
        let compressor = Compressor::start(out, codec, encoder.head()?);
        let fields = FieldIndex::new(columns.iter().map(|c| c.name.as_str()));
        Ok(ShardWriter { encoder, fields, compressor, rows: 0, line: Vec::new() })
    }

    /// Appends one record: its key, and the selected columns read from `data`, the record's
    /// JSON object as text (absent columns are null).
    pub fn write_row(&mut self, key: &str, data: &str) -> io::Result<()> {
        let fields = self.fields.read(data)?;
        self.line.clear();
        self.encoder.encode(key, &fields, &mut self.line)?;
        self.compressor.write_all(&self.line)?;
        self.rows += 1;
        Ok(())
    }

    /// Ends the gzip stream and returns the inner writer with the shard's size and sha256.
    pub fn finish(self) -> io::Result<(W, ShardDigest)> {
        let (out, framed) = self.compressor.finish()?;
        let digest = ShardDigest {
            rows: self.rows,
            bytes: framed.bytes,
            sha256: framed.sha256,
            head: framed.head,
            body: framed.body,
        };
        Ok((out, digest))
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
    use flate2::read::GzDecoder;
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

    /// Records as PostgreSQL renders jsonb text.
    fn rows() -> Vec<(&'static str, String)> {
        vec![
            ("k1", json!({"subject": "=HYPERLINK(\"x\")", "amount": -3.5, "tags": ["a"]}).to_string()),
            ("k2", json!({"subject": "say \"hi\",\r\nthen go", "amount": null}).to_string()),
            ("k3", r#"{"tags": {"z": 1, "a": 2}, "amount": 12.50, "subject": "Zürich 東京"}"#.to_owned()),
        ]
    }

    fn shard(format: Format) -> (Vec<u8>, ShardDigest) {
        shard_with(format, Codec::CURRENT)
    }

    fn shard_with(format: Format, codec: Codec) -> (Vec<u8>, ShardDigest) {
        let mut writer = ShardWriter::new(Vec::new(), format, codec, columns()).unwrap();
        for (key, data) in rows() {
            writer.write_row(key, &data).unwrap();
        }
        writer.finish().unwrap()
    }

    /// Single-member decoding: a shard must be one gzip member.
    fn gunzip(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        GzDecoder::new(bytes).read_to_end(&mut out).unwrap();
        out
    }

    #[test]
    fn csv_shards_have_bom_header_crlf_and_quoted_escaped_fields() {
        let (bytes, digest) = shard(Format::Csv);
        assert_eq!(&bytes[..10], b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff", "fixed gzip header, mtime 0");
        assert_eq!(digest.head.raw_len, 3 + "\"id\",\"subject\",\"amount\",\"tags\"\r\n".len() as u64);
        assert_eq!(10 + digest.head.compressed_len + digest.body.compressed_len + gzip::SHARD_TAIL_BYTES, digest.bytes);
        assert_eq!(digest.rows, 3);
        assert_eq!(digest.bytes, bytes.len() as u64);
        assert_eq!(digest.sha256, sha256_hex(&bytes));
        let text = String::from_utf8(gunzip(&bytes)).unwrap();
        assert_eq!(
            text,
            "\u{feff}\"id\",\"subject\",\"amount\",\"tags\"\r\n\
             \"k1\",\"'=HYPERLINK(\"\"x\"\")\",\"-3.5\",\"[\"\"a\"\"]\"\r\n\
             \"k2\",\"say \"\"hi\"\",\r\nthen go\",\"\",\"\"\r\n\
             \"k3\",\"Zürich 東京\",\"12.50\",\"{\"\"a\"\":2,\"\"z\"\":1}\"\r\n"
        );
    }

    #[test]
    fn jsonl_shards_have_sorted_keys_and_nulls_for_missing_columns() {
        let (bytes, _) = shard(Format::Jsonl);
        let text = String::from_utf8(gunzip(&bytes)).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], r#"{"amount":-3.5,"id":"k1","subject":"=HYPERLINK(\"x\")","tags":["a"]}"#);
        assert_eq!(lines[1], r#"{"amount":null,"id":"k2","subject":"say \"hi\",\r\nthen go","tags":null}"#);
        assert_eq!(lines[2], r#"{"amount":12.50,"id":"k3","subject":"Zürich 東京","tags":{"a":2,"z":1}}"#);
        assert_eq!(lines.len(), 3);
    }

    /// If this fails, a dependency or setting changed the bytes of every shard of a codec: a
    /// shard of an export recorded with it would no longer match its checkpoint when rewritten.
    /// Never change a hash; a codec whose bytes must change becomes a new codec.
    #[test]
    fn golden_hashes_pin_the_shard_bytes_of_every_codec() {
        let golden = [
            (Codec::MinizOxide3, Format::Csv, "9cfaa75c99fb02fd2c004e5531a73fde82d4dfe0f398ef58de319c1ece6f6d37"),
            (Codec::MinizOxide3, Format::Jsonl, "628d0e3d0de56863f13f9ca83af83b6ea4f4c4a8cad5baeb9d7cbd4640d1ae9f"),
            (Codec::ZlibRs3, Format::Csv, "f4d59be70248cbbb7b6c8374b017a58ba25d0e2832839dbb9cd5f33d2b506646"),
            (Codec::ZlibRs3, Format::Jsonl, "7851114bc2988638dfe7b81571b1b5495651931ac62c0353b28d64e29a640ff4"),
        ];
        for (codec, format, sha256) in golden {
            assert_eq!(shard_with(format, codec).1.sha256, sha256, "{codec:?} {format:?}");
        }
        assert_eq!(golden.len(), Codec::ALL.len() * Format::ALL.len(), "every codec and format is pinned");
    }
}
