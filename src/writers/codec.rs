//! What produces a shard's bytes: for gzip formats the deflate implementation and level, for
//! Parquet the writer's version and its compression.
//!
//! Deflate output is not specified by the format: two implementations (or two levels) give
//! different bytes for the same input; a Parquet writer's bytes change with its version. So the codec is chosen once, when an export is created,
//! and recorded on the job; every shard of it — written later, rewritten after a crash, by
//! another process or a newer binary — uses that codec and comes out byte-identical to its
//! checkpoint. A codec's name is forever: a dependency update that changes a codec's bytes
//! needs a new name (the golden-hash tests in [`super`] catch it).

use std::io;

use flate2::{Compress, Compression, FlushCompress};
use zlib_rs::{Deflate, DeflateFlush};

/// Declares the codecs: each variant with its stored name, the one place a codec is named.
macro_rules! codecs {
    ($($(#[$doc:meta])* $variant:ident => $name:literal),+ $(,)?) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Codec {
            $($(#[$doc])* $variant),+
        }

        impl Codec {
            pub const ALL: &[Codec] = &[$(Codec::$variant),+];

            /// As stored on export jobs and named in the contract.
            pub fn name(self) -> &'static str {
                match self {
                    $(Codec::$variant => $name),+
                }
            }
        }
    };
}

codecs! {
    /// miniz_oxide (flate2's default backend) at level 3: exports created before zlib-rs.
    MinizOxide3 => "miniz_oxide/3",
    /// zlib-rs 0.6.8 (a Rust port of zlib-ng) at level 3: on synthetic tickets 1.6× the speed
    /// of `miniz_oxide/3` for 7 % more bytes. Its output does not depend on the CPU's features.
    ZlibRs3 => "zlib-rs/3",
    /// The `parquet` crate 60.1.0 with zstd (libzstd 1.5.7) at level 3, every option pinned in
    /// [`super::parquet`]. Not a deflate codec.
    ParquetZstd3 => "parquet-60/zstd-3",
}

impl Codec {
    /// The codecs of gzip formats.
    pub const GZIP: &[Codec] = &[Codec::MinizOxide3, Codec::ZlibRs3];

    /// The raw deflate stream of a gzip codec; an error for a codec that does not deflate.
    pub(super) fn deflater(self) -> io::Result<Deflater> {
        match self {
            Codec::MinizOxide3 => Ok(Deflater::Miniz(Compress::new(Compression::new(3), false))),
            Codec::ZlibRs3 => Ok(Deflater::ZlibRs(Deflate::new(3, false, 15))),
            other => Err(io::Error::other(format!("codec {} does not deflate", other.name()))),
        }
    }
}

crate::db::text_column!(Codec);

impl TryFrom<String> for Codec {
    type Error = String;
    fn try_from(name: String) -> Result<Codec, String> {
        Codec::ALL.iter().copied().find(|c| c.name() == name).ok_or_else(|| format!("unknown codec {name}"))
    }
}

/// A raw deflate stream (no zlib or gzip framing) of one codec.
pub(super) enum Deflater {
    Miniz(Compress),
    ZlibRs(Deflate),
}

impl Deflater {
    /// Compresses from `input` into the spare capacity of `out` (ending with a sync flush if
    /// `sync`); returns how many input bytes were taken.
    pub fn compress(&mut self, input: &[u8], out: &mut Vec<u8>, sync: bool) -> io::Result<usize> {
        match self {
            Deflater::Miniz(deflate) => {
                let before = deflate.total_in();
                let flush = if sync { FlushCompress::Sync } else { FlushCompress::None };
                deflate.compress_vec(input, out, flush).map_err(io::Error::other)?;
                Ok((deflate.total_in() - before) as usize)
            }
            Deflater::ZlibRs(deflate) => {
                let (in_before, out_before) = (deflate.total_in(), deflate.total_out());
                let start = out.len();
                out.resize(out.capacity(), 0);
                let flush = if sync { DeflateFlush::SyncFlush } else { DeflateFlush::NoFlush };
                let result = deflate.compress(input, &mut out[start..], flush);
                out.truncate(start + (deflate.total_out() - out_before) as usize);
                result.map_err(|e| io::Error::other(format!("zlib-rs: {e:?}")))?;
                Ok((deflate.total_in() - in_before) as usize)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_distinct() {
        for &codec in Codec::ALL {
            assert_eq!(Codec::try_from(codec.name().to_owned()), Ok(codec));
        }
        assert!(Codec::try_from("zstd/3".to_owned()).is_err());
    }
}
