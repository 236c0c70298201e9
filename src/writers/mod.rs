//! Shard files: rows encoded as CSV or JSONL and gzip-compressed (spliceable into one whole
//! file), or gathered into Arrow batches and written as self-contained Parquet files; either way
//! checksummed as they are written.
//!
//! The bytes of a shard depend only on its rows, its [`ShardSpec`] and its export's [`Codec`]:
//! fixed gzip header (mtime 0, no name), one pinned deflate implementation and level per codec,
//! input fed in fixed-size chunks, no flush except where the framing in [`gzip`] needs one; for
//! Parquet, a pinned writer version and every writer option fixed (see [`parquet`]), batches cut
//! by the data alone. Golden-hash tests guard this, one per codec and format.

mod cell;
mod codec;
mod columnar;
mod compressor;
mod csv;
mod escape;
mod format;
pub mod gzip;
mod jsonl;
mod parquet;
mod pipe;

use std::io::{self, Write};

use sha2::{Digest, Sha256};

pub use crate::dataset::Cell;
pub use cell::{FieldIndex, Fields};
pub use codec::Codec;
pub use columnar::{ColumnStats, DoesNotFit, FileColumn};
pub use escape::{csv_cell, escape_formula};
pub use format::{Format, FormatSpec, Framing, RowEncoder};

use crate::dataset::ColumnHasher;
pub use crate::dataset::{OutputColumn, sha256_hex};
use crate::masking::ColumnMasks;
use columnar::ColumnarShard;
use compressor::Compressor;
use gzip::Part;

/// What every shard of an export is written as, fixed when the export is created.
#[derive(Debug, Clone)]
pub struct ShardSpec {
    pub format: Format,
    pub codec: Codec,
    /// The key column first.
    pub columns: Vec<OutputColumn>,
    /// Whether rows come in key order (full exports), which a Parquet footer then declares.
    pub sorted_by_key: bool,
    /// Key-value metadata for formats whose files carry it (a Parquet footer).
    pub metadata: Vec<(String, String)>,
    /// The partner's hash key, when a column is `masked` by `hash`.
    pub hasher: Option<ColumnHasher>,
}

impl ShardSpec {
    /// Compares two versions of a record as a file of this spec serves them.
    pub fn comparer(&self) -> Result<ServedComparer, String> {
        let index = || {
            let masks = ColumnMasks::of(&self.columns, self.hasher.as_ref())?;
            Ok::<_, String>(FieldIndex::new(self.columns.iter().map(|c| c.name.as_str())).masked(masks))
        };
        Ok(ServedComparer { before: index()?, after: index()?, columns: self.columns.len() })
    }
}

/// Whether two versions of a record are served alike: every column of the spec, after the
/// partner's column policy, holds the same value in both (so a change only to a dropped, nulled
/// or truncated-away value is no change at all to the partner).
pub struct ServedComparer {
    before: FieldIndex,
    after: FieldIndex,
    columns: usize,
}

impl ServedComparer {
    pub fn alike(&mut self, before: &str, after: &str) -> io::Result<bool> {
        let (before, after) = (self.before.read(before)?, self.after.read(after)?);
        for column in 0..self.columns {
            if before.get(column).map_err(io::Error::other)? != after.get(column).map_err(io::Error::other)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// What a finished shard file is, including where its parts lie (see [`gzip`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ShardDigest {
    pub rows: u64,
    pub bytes: u64,
    pub sha256: String,
    /// Spliceable formats: the head (BOM and CSV header; empty for JSONL), right after the
    /// 10-byte gzip header. Zero for self-contained files.
    pub head: Part,
    /// Spliceable formats: the rows, right after the head.
    pub body: Part,
    /// Self-contained files: each column's statistics as the file's footer holds them.
    pub stats: Option<Vec<ColumnStats>>,
}

/// Streams rows into one shard file. Memory stays bounded by the encoder's buffers. Rows are
/// read and encoded on the caller's thread and compressed (or written out) on a second one.
pub struct ShardWriter<W: Write + Send + 'static> {
    fields: FieldIndex,
    rows: u64,
    sink: Sink<W>,
}

enum Sink<W: Write + Send + 'static> {
    Gzip { encoder: Box<dyn RowEncoder>, compressor: Compressor<W>, line: Vec<u8> },
    Columnar(ColumnarShard<W>),
}

impl<W: Write + Send + 'static> ShardWriter<W> {
    /// Starts a shard (a CSV shard with its BOM and header row).
    pub fn new(out: W, spec: &ShardSpec) -> io::Result<Self> {
        let masks = ColumnMasks::of(&spec.columns, spec.hasher.as_ref())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let sink = match spec.format.spec().framing {
            Framing::Gzip(encoder) => {
                let mut encoder = encoder(&spec.columns);
                spec.codec.deflater()?; // refuses a codec that does not deflate
                let compressor = Compressor::start(out, spec.codec, encoder.head()?);
                Sink::Gzip { encoder, compressor, line: Vec::new() }
            }
            Framing::Columnar { writer, .. } => Sink::Columnar(ColumnarShard::start(out, spec, writer)?),
        };
        let fields = FieldIndex::new(spec.columns.iter().map(|c| c.name.as_str())).masked(masks);
        Ok(ShardWriter { fields, rows: 0, sink })
    }

    /// Appends one record: its key, and the selected columns read from `data`, the record's
    /// JSON object as text (absent columns are null).
    pub fn write_row(&mut self, key: &str, data: &str) -> io::Result<()> {
        let (key, fields) = self.fields.read_record(key, data)?;
        let key = key.as_ref();
        match &mut self.sink {
            Sink::Gzip { encoder, compressor, line } => {
                line.clear();
                encoder.encode(key, &fields, line)?;
                compressor.write_all(line)?;
            }
            Sink::Columnar(shard) => shard.push(key, &fields)?,
        }
        self.rows += 1;
        Ok(())
    }

    /// Ends the file (gzip trailer or footer) and returns the inner writer with the shard's
    /// size and sha256.
    pub fn finish(self) -> io::Result<(W, ShardDigest)> {
        let rows = self.rows;
        match self.sink {
            Sink::Gzip { compressor, .. } => {
                let (out, framed) = compressor.finish()?;
                let digest = ShardDigest {
                    rows,
                    bytes: framed.bytes,
                    sha256: framed.sha256,
                    head: framed.head,
                    body: framed.body,
                    stats: None,
                };
                Ok((out, digest))
            }
            Sink::Columnar(shard) => {
                let (out, file) = shard.finish()?;
                let (head, body) = (Part::default(), Part::default());
                Ok((
                    out,
                    ShardDigest { rows, bytes: file.bytes, sha256: file.sha256, head, body, stats: Some(file.stats) },
                ))
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::ColumnType;
    use flate2::read::GzDecoder;
    use serde_json::json;
    use std::io::Read;

    fn columns() -> Vec<OutputColumn> {
        let column = |name: &str, ty| OutputColumn { ty, required: false, ..OutputColumn::key(name) };
        vec![
            OutputColumn::key("id"),
            column("subject", ColumnType::String),
            column("amount", ColumnType::Number),
            column("tags", ColumnType::Json),
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
        shard_with(format, format.spec().codec)
    }

    fn shard_with(format: Format, codec: Codec) -> (Vec<u8>, ShardDigest) {
        let metadata = vec![("exportd.export_id".to_owned(), "e1".to_owned())];
        let spec = ShardSpec { format, codec, columns: columns(), sorted_by_key: true, metadata, hasher: None };
        let mut writer = ShardWriter::new(Vec::new(), &spec).unwrap();
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
            (Codec::ParquetZstd3, Format::Parquet, "8f08fac2a507e5efa9b68e7ab87fe991626250b97d4959767e851298e04c7049"),
        ];
        for (codec, format, sha256) in golden {
            assert_eq!(shard_with(format, codec).1.sha256, sha256, "{codec:?} {format:?}");
        }
        let gzip_pairs = Codec::GZIP.len() * Format::ALL.iter().filter(|f| f.spec().spliceable()).count();
        assert_eq!(golden.len(), gzip_pairs + 1, "every codec and format is pinned");
    }

    #[test]
    fn a_codec_refuses_a_format_it_does_not_write() {
        let spec = |format, codec| ShardSpec {
            format,
            codec,
            columns: columns(),
            sorted_by_key: true,
            metadata: vec![],
            hasher: None,
        };
        let refused = ShardWriter::new(Vec::new(), &spec(Format::Csv, Codec::ParquetZstd3)).err().unwrap();
        assert!(refused.to_string().contains("does not deflate"), "{refused}");
        let refused = ShardWriter::new(Vec::new(), &spec(Format::Parquet, Codec::ZlibRs3)).err().unwrap();
        assert!(refused.to_string().contains("does not write Parquet"), "{refused}");
    }
}
