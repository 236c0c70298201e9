//! The output formats, each registered once: its name, file extension, content type, how its
//! shards are framed and written, and the codec new exports use (one file per format).

use std::io;

use serde::{Deserialize, Serialize};

use super::cell::Fields;
use super::columnar::BatchWriterStart;
use super::{Codec, FileColumn, OutputColumn, csv, jsonl, parquet};

/// How one gzip format writes a shard's rows; implemented once per format.
pub trait RowEncoder: Send {
    /// What precedes the rows, compressed as the shard's head part (e.g. BOM and header row);
    /// a whole file keeps the first shard's head only.
    fn head(&mut self) -> io::Result<Vec<u8>>;
    /// Appends one record — its key and its fields — to `line`.
    fn encode(&mut self, key: &str, fields: &Fields<'_>, line: &mut Vec<u8>) -> io::Result<()>;
}

/// How a format's shards are made.
pub enum Framing {
    /// Rows encoded as text into one gzip stream per shard, framed so that the shards splice
    /// into one whole file without recompressing (see [`super::gzip`]).
    Gzip(fn(&[OutputColumn]) -> Box<dyn RowEncoder>),
    /// Rows gathered into typed Arrow batches (see [`super::columnar`]) and written by the
    /// format's file writer: every shard a self-contained file with its own footer, so there is
    /// no whole file.
    Columnar {
        writer: BatchWriterStart,
        /// The columns as the file declares them (for the manifest).
        schema: fn(&[OutputColumn]) -> io::Result<Vec<FileColumn>>,
    },
}

/// What the rest of the product needs to know of a format.
pub struct FormatSpec {
    /// As in requests, job rows and manifests.
    pub name: &'static str,
    /// Of shard and whole files.
    pub extension: &'static str,
    /// Of downloads.
    pub content_type: &'static str,
    /// The manifest's `compression`.
    pub compression: &'static str,
    pub framing: Framing,
    /// What new exports of the format are written with.
    pub codec: Codec,
}

impl FormatSpec {
    /// Whether shards splice into one whole file (the first shard's head, then every body).
    pub fn spliceable(&self) -> bool {
        matches!(self.framing, Framing::Gzip(_))
    }

    /// The columns as the files declare them, for formats that carry a schema.
    pub fn file_schema(&self, columns: &[OutputColumn]) -> io::Result<Option<Vec<FileColumn>>> {
        match self.framing {
            Framing::Gzip(_) => Ok(None),
            Framing::Columnar { schema, .. } => schema(columns).map(Some),
        }
    }
}

/// Declares the formats: each variant with its [`FormatSpec`], the one place a format is named.
macro_rules! formats {
    ($($(#[$doc:meta])* $variant:ident => $spec:expr),+ $(,)?) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
        #[serde(rename_all = "lowercase")]
        pub enum Format {
            $($(#[$doc])* $variant),+
        }

        impl Format {
            pub const ALL: &[Format] = &[$(Format::$variant),+];

            pub fn spec(self) -> &'static FormatSpec {
                match self {
                    $(Format::$variant => &$spec),+
                }
            }
        }
    };
}

formats! {
    /// Gzip CSV: BOM, header row, every field quoted, CRLF, formula-injection escaping.
    Csv => csv::SPEC,
    /// Gzip JSON Lines: one object per record, keys sorted.
    Jsonl => jsonl::SPEC,
    /// Parquet: typed columns, zstd, statistics and page index; one file per shard.
    Parquet => parquet::SPEC,
}

impl Format {
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    pub fn extension(self) -> &'static str {
        self.spec().extension
    }
}

crate::db::text_column!(Format);

impl TryFrom<String> for Format {
    type Error = String;
    fn try_from(name: String) -> Result<Format, String> {
        Format::ALL.iter().copied().find(|f| f.name() == name).ok_or_else(|| format!("unknown format {name}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_match_serde() {
        for &format in Format::ALL {
            assert_eq!(Format::try_from(format.name().to_owned()), Ok(format));
            assert_eq!(serde_json::to_value(format).unwrap(), format.name());
            assert!(format.extension().starts_with(format.name()));
            assert_eq!(format.extension().ends_with(".gz"), format.spec().spliceable(), "{format:?}");
        }
        assert!(Format::try_from("avro".to_owned()).is_err());
    }
}
