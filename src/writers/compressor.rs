//! Deflating on a thread of its own, into the shard framing of [`super::gzip`].

use std::io::{self, Write};

use super::HashingWriter;
use super::codec::Codec;
use super::gzip::{FINAL_BLOCK, GZIP_HEADER, Part, PartCompressor, trailer};
use super::pipe::{Items, Pipe};

/// A framed shard as written.
pub struct Framed {
    pub bytes: u64,
    pub sha256: String,
    pub head: Part,
    pub body: Part,
}

/// Plain body bytes go in; a thread of its own deflates them. The body reaches the deflater in
/// chunks of exactly `CHUNK` bytes (the last one shorter) — miniz_oxide's output depends on how
/// its input is split — so the output depends only on the data and the codec, never on timing.
pub struct Compressor<W> {
    pending: Vec<u8>,
    chunks: Pipe<Vec<u8>, (W, Framed)>,
}

impl<W: Write + Send + 'static> Compressor<W> {
    pub const CHUNK: usize = 256 * 1024;

    /// Starts a shard with `head` (BOM and CSV header, or nothing) as its own part.
    pub fn start(out: W, codec: Codec, head: Vec<u8>) -> Self {
        let chunks = Pipe::spawn(2, move |received: Items<Vec<u8>>| {
            let mut out = HashingWriter::new(out);
            let mut buf = Vec::with_capacity(Self::CHUNK);
            out.write_all(&GZIP_HEADER)?;
            let mut head_part = PartCompressor::new(codec)?;
            head_part.write(&head, &mut buf)?;
            let head = head_part.finish(&mut buf)?;
            let mut body_part = PartCompressor::new(codec)?;
            for chunk in received {
                body_part.write(&chunk?, &mut buf)?;
                out.write_all(&buf)?;
                buf.clear();
            }
            let body = body_part.finish(&mut buf)?;
            buf.extend_from_slice(&FINAL_BLOCK);
            buf.extend_from_slice(&trailer(&[head, body]));
            out.write_all(&buf)?;
            let (out, bytes, sha256) = out.into_parts();
            Ok((out, Framed { bytes, sha256, head, body }))
        });
        Compressor { pending: Vec::with_capacity(Self::CHUNK), chunks }
    }

    /// Sends what is left and ends the shard.
    pub fn finish(mut self) -> io::Result<(W, Framed)> {
        let last = std::mem::take(&mut self.pending);
        if !last.is_empty() {
            self.chunks.send(last)?;
        }
        self.chunks.finish()
    }
}

impl<W: Write + Send + 'static> Write for Compressor<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(buf);
        while self.pending.len() >= Self::CHUNK {
            let rest = self.pending.split_off(Self::CHUNK);
            let chunk = std::mem::replace(&mut self.pending, rest);
            self.chunks.send(chunk)?;
        }
        Ok(buf.len())
    }

    /// Deliberately nothing: a flush would end a deflate block early and change the bytes.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// However a caller splits its writes, the bytes are the same — and the same as ever: the
    /// hashes pin each codec on megabytes of input (many chunks, long matches), where the
    /// shard golden tests only see a few rows. Never change one; add a codec instead.
    #[test]
    fn compressed_bytes_do_not_depend_on_write_sizes() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8 ^ (i / 7919) as u8).collect();
        let golden = [
            (Codec::MinizOxide3, "7ef6362be3a03cca894f4d8e55a24e76e84e64358ec45d5c8e619d1c595037a1"),
            (Codec::ZlibRs3, "f091b86ada28ce3565cbf36015196a919d30128fbceefb726ec528567f499865"),
        ];
        for (codec, sha256) in golden {
            assert_eq!(compressed_bytes_do_not_depend_on_write_sizes_with(codec, &data), sha256, "{codec:?}");
        }
        assert_eq!(golden.len(), Codec::GZIP.len(), "every gzip codec is pinned");
    }

    /// The sha256 of `data` compressed with `codec`, after checking it is the same however the
    /// writes are split.
    fn compressed_bytes_do_not_depend_on_write_sizes_with(codec: Codec, data: &[u8]) -> String {
        let compress = |piece: usize| {
            let mut compressor = Compressor::start(Vec::new(), codec, b"head\n".to_vec());
            for part in data.chunks(piece) {
                compressor.write_all(part).unwrap();
            }
            compressor.finish().unwrap()
        };
        let (one, framed) = compress(data.len());
        assert_eq!((one.len() as u64, super::super::sha256_hex(&one)), (framed.bytes, framed.sha256.clone()));
        for piece in [1, 4096, 100_003, Compressor::<Vec<u8>>::CHUNK + 1] {
            assert_eq!(compress(piece).1.sha256, framed.sha256, "{codec:?}, writes of {piece} bytes");
        }
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&one[..]).read_to_end(&mut plain).unwrap();
        assert_eq!(&plain[..5], b"head\n");
        assert_eq!(&plain[5..], data);
        framed.sha256
    }
}
