//! The output formats, each registered once: its name, file extension, whether its shards
//! splice into one whole file, and its row encoder (one file per format).

use std::io;

use serde::{Deserialize, Serialize};

use super::cell::Fields;
use super::{OutputColumn, csv, jsonl};

/// How one format writes a shard's rows; implemented once per format.
pub trait RowEncoder: Send {
    /// What precedes the rows, compressed as the shard's head part (e.g. BOM and header row);
    /// a whole file keeps the first shard's head only.
    fn head(&mut self) -> io::Result<Vec<u8>>;
    /// Appends one record — its key and its fields — to `line`.
    fn encode(&mut self, key: &str, fields: &Fields<'_>, line: &mut Vec<u8>) -> io::Result<()>;
}

/// What the rest of the product needs to know of a format.
pub struct FormatSpec {
    /// As in requests, job rows and manifests.
    pub name: &'static str,
    /// Of shard and whole files.
    pub extension: &'static str,
    /// Whether shards splice into one whole file (the first shard's head, then every body).
    pub spliceable: bool,
    /// A new encoder for a shard of these output columns (the key column first).
    pub encoder: fn(&[OutputColumn]) -> Box<dyn RowEncoder>,
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
            assert!(format.extension().starts_with(format.name()) && format.extension().ends_with(".gz"));
        }
        assert!(Format::try_from("parquet".to_owned()).is_err());
    }
}
