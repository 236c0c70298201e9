//! gzip framing that lets shards be spliced into one file without recompressing.
//!
//! A shard is one ordinary gzip member:
//!
//! ```text
//! [10-byte header][head: deflate of BOM + CSV header, sync-flushed][body: deflate of the rows,
//!  sync-flushed][03 00: final empty block][CRC-32][ISIZE]
//! ```
//!
//! Head and body come from separate compressors, so the body never refers back into the head,
//! and both end byte-aligned. The whole export is then one gzip member too: shard 0's header,
//! head and body, every other shard's body, `03 00`, and a trailer computed from the parts'
//! CRCs. Downloads serve it by reading byte ranges of the shard files.

use std::io;

use super::codec::{Codec, Deflater};

/// The fixed gzip header: deflate, no flags, mtime 0, no extra flags, OS "unknown".
pub const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0x00, 0xff];
/// A final, empty, fixed-Huffman deflate block.
pub const FINAL_BLOCK: [u8; 2] = [0x03, 0x00];
/// Bytes after the body in every shard: the final block and the 8-byte trailer.
pub const SHARD_TAIL_BYTES: u64 = (FINAL_BLOCK.len() + 8) as u64;

/// One part (head or body) of a shard: compressed bytes and what the trailer needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Part {
    pub compressed_len: u64,
    pub crc32: u32,
    pub raw_len: u64,
}

/// A raw-deflate compressor whose output ends with a sync flush (byte-aligned, not final).
pub struct PartCompressor {
    deflate: Deflater,
    crc: crc32fast::Hasher,
    raw_len: u64,
    compressed_len: u64,
}

impl PartCompressor {
    pub fn new(codec: Codec) -> io::Result<Self> {
        let deflate = codec.deflater()?;
        Ok(PartCompressor { deflate, crc: crc32fast::Hasher::new(), raw_len: 0, compressed_len: 0 })
    }

    /// Compresses `input`, appending whatever output is ready to `out`.
    pub fn write(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        self.crc.update(input);
        self.raw_len += input.len() as u64;
        self.run(input, false, out)
    }

    /// Ends the part with a sync flush and returns its description.
    pub fn finish(mut self, out: &mut Vec<u8>) -> io::Result<Part> {
        self.run(&[], true, out)?;
        Ok(Part { compressed_len: self.compressed_len, crc32: self.crc.finalize(), raw_len: self.raw_len })
    }

    fn run(&mut self, input: &[u8], sync: bool, out: &mut Vec<u8>) -> io::Result<()> {
        let mut consumed = 0;
        loop {
            out.reserve(64 * 1024);
            let out_before = out.len();
            consumed += self.deflate.compress(&input[consumed..], out, sync)?;
            self.compressed_len += (out.len() - out_before) as u64;
            // Done once all input is taken and the compressor stopped before filling the buffer.
            if consumed == input.len() && out.len() < out.capacity() {
                return Ok(());
            }
        }
    }
}

/// The gzip trailer for data made of `parts` in order: CRC-32 and length mod 2^32, little-endian.
pub fn trailer(parts: &[Part]) -> [u8; 8] {
    let mut crc = crc32fast::Hasher::new();
    let mut len = 0u64;
    for part in parts {
        crc.combine(&crc32fast::Hasher::new_with_initial_len(part.crc32, part.raw_len));
        len += part.raw_len;
    }
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&crc.finalize().to_le_bytes());
    out[4..].copy_from_slice(&(len as u32).to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn part(codec: Codec, data: &[u8], out: &mut Vec<u8>) -> Part {
        let mut compressor = PartCompressor::new(codec).unwrap();
        for piece in data.chunks(1000) {
            compressor.write(piece, out).unwrap();
        }
        compressor.finish(out).unwrap()
    }

    fn gunzip_single_member(bytes: &[u8]) -> Vec<u8> {
        // GzDecoder reads exactly one member: a spliced file must be one member.
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes).read_to_end(&mut out).unwrap();
        out
    }

    /// Parts splice whatever codec wrote each of them: every part stands alone.
    #[test]
    fn parts_splice_into_one_valid_gzip_member() {
        let head = b"id,name\r\n".repeat(3);
        let bodies: Vec<Vec<u8>> = (0..3).map(|i| format!("row {i}\r\n").repeat(5000).into_bytes()).collect();
        let codecs = Codec::GZIP.iter().copied().cycle();
        for first in Codec::GZIP {
            let mut file = GZIP_HEADER.to_vec();
            let mut parts = vec![part(*first, &head, &mut file)];
            for (body, codec) in bodies.iter().zip(codecs.clone()) {
                parts.push(part(codec, body, &mut file));
            }
            file.extend_from_slice(&FINAL_BLOCK);
            file.extend_from_slice(&trailer(&parts));
            let mut expected = head.clone();
            bodies.iter().for_each(|b| expected.extend_from_slice(b));
            assert_eq!(gunzip_single_member(&file), expected, "head by {first:?}");
        }
    }

    #[test]
    fn an_empty_part_is_still_a_valid_member() {
        for &codec in Codec::GZIP {
            let mut file = GZIP_HEADER.to_vec();
            let parts = [part(codec, b"", &mut file), part(codec, b"x", &mut file)];
            file.extend_from_slice(&FINAL_BLOCK);
            file.extend_from_slice(&trailer(&parts));
            assert_eq!(gunzip_single_member(&file), b"x", "{codec:?}");
        }
    }
}
