//! Where the bytes of a shard, or of the whole export, are: the checkpointed shards and the
//! byte ranges of their files that make up each downloadable object.

use bytes::Bytes;
use futures_util::stream::{BoxStream, StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};

use crate::storage::{ArtifactStore, ObjectKey, StoreResult};
use crate::writers::ColumnStats;
use crate::writers::gzip::{FINAL_BLOCK, GZIP_HEADER, Part, trailer};

/// A shard file as checkpointed by the worker that wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardRecord {
    pub shard_index: i32,
    pub first_key: Option<String>,
    pub last_key: Option<String>,
    pub rows: i64,
    pub bytes: i64,
    pub sha256: String,
    pub object_key: String,
    pub head_bytes: i64,
    pub head_crc32: i64,
    pub head_raw_bytes: i64,
    pub body_bytes: i64,
    pub body_crc32: i64,
    pub body_raw_bytes: i64,
    /// Self-contained files: the footer's column statistics.
    pub stats: Option<sqlx::types::Json<Vec<ColumnStats>>>,
}

impl ShardRecord {
    pub fn head(&self) -> Part {
        Part {
            compressed_len: self.head_bytes as u64,
            crc32: self.head_crc32 as u32,
            raw_len: self.head_raw_bytes as u64,
        }
    }

    pub fn body(&self) -> Part {
        Part {
            compressed_len: self.body_bytes as u64,
            crc32: self.body_crc32 as u32,
            raw_len: self.body_raw_bytes as u64,
        }
    }

    pub fn key(&self) -> ObjectKey {
        ObjectKey::parse(&self.object_key).expect("object keys are validated before they are stored")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// `len` bytes of an object from `offset`.
    Object {
        key: ObjectKey,
        offset: u64,
        len: u64,
    },
    Inline(Vec<u8>),
}

impl Segment {
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> u64 {
        match self {
            Segment::Object { len, .. } => *len,
            Segment::Inline(bytes) => bytes.len() as u64,
        }
    }
}

/// A downloadable object as a list of byte ranges; nothing is copied to build it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub segments: Vec<Segment>,
}

impl Layout {
    pub fn shard(shard: &ShardRecord) -> Layout {
        Layout::object(shard.key(), shard.bytes as u64)
    }

    /// One stored object of `len` bytes, whole.
    pub fn object(key: ObjectKey, len: u64) -> Layout {
        Layout { segments: vec![Segment::Object { key, offset: 0, len }] }
    }

    /// The whole export as one gzip member: shard 0 up to the end of its body, every other
    /// shard's body, then the final block and a trailer for all of it.
    pub fn whole_file(shards: &[ShardRecord]) -> Layout {
        let mut segments = Vec::with_capacity(shards.len() + 1);
        let mut parts = Vec::with_capacity(shards.len() + 1);
        for (i, shard) in shards.iter().enumerate() {
            let head_end = GZIP_HEADER.len() as u64 + shard.head_bytes as u64;
            let (offset, len) = if i == 0 {
                parts.push(shard.head());
                (0, head_end + shard.body_bytes as u64)
            } else {
                (head_end, shard.body_bytes as u64)
            };
            parts.push(shard.body());
            segments.push(Segment::Object { key: shard.key(), offset, len });
        }
        let mut tail = FINAL_BLOCK.to_vec();
        tail.extend_from_slice(&trailer(&parts));
        segments.push(Segment::Inline(tail));
        Layout { segments }
    }

    pub fn len(&self) -> u64 {
        self.segments.iter().map(Segment::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The parts of the segments that cover `start ..= end` (inclusive), in order.
    pub fn slice(&self, start: u64, end: u64) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut at = 0u64;
        for segment in &self.segments {
            let len = segment.len();
            let (lo, hi) = (start.max(at), end.min(at + len.saturating_sub(1)));
            if len > 0 && lo <= hi {
                let (from, take) = (lo - at, hi - lo + 1);
                out.push(match segment {
                    Segment::Object { key, offset, .. } => {
                        Segment::Object { key: key.clone(), offset: offset + from, len: take }
                    }
                    Segment::Inline(bytes) => Segment::Inline(bytes[from as usize..(from + take) as usize].to_vec()),
                });
            }
            at += len;
        }
        out
    }

    /// sha256 of the laid-out bytes, read from the store.
    pub async fn sha256(&self, store: &ArtifactStore) -> StoreResult<String> {
        let mut hasher = Sha256::new();
        let mut bytes = read(store.clone(), self.segments.clone());
        while let Some(chunk) = bytes.next().await {
            hasher.update(&chunk?);
        }
        Ok(hex::encode(hasher.finalize()))
    }
}

/// The bytes of `segments`, in order. Each object range is opened when the stream reaches it.
pub fn read(store: ArtifactStore, segments: Vec<Segment>) -> BoxStream<'static, StoreResult<Bytes>> {
    futures_util::stream::iter(segments)
        .then(move |segment| {
            let store = store.clone();
            async move {
                match segment {
                    Segment::Inline(bytes) => Ok(futures_util::stream::once(async { Ok(Bytes::from(bytes)) }).boxed()),
                    Segment::Object { key, offset, len } => store.read(&key, offset, len).await,
                }
            }
        })
        .try_flatten()
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        let key = ObjectKey::parse("t/e/g1/s").unwrap();
        Layout {
            segments: vec![
                Segment::Object { key: key.clone(), offset: 0, len: 10 },
                Segment::Object { key, offset: 50, len: 5 },
                Segment::Inline(vec![1, 2, 3]),
            ],
        }
    }

    #[test]
    fn slices_map_ranges_onto_segments() {
        let layout = layout();
        assert_eq!(layout.len(), 18);
        assert_eq!(layout.slice(0, 17), layout.segments);
        let key = ObjectKey::parse("t/e/g1/s").unwrap();
        assert_eq!(
            layout.slice(8, 16),
            vec![
                Segment::Object { key: key.clone(), offset: 8, len: 2 },
                Segment::Object { key, offset: 50, len: 5 },
                Segment::Inline(vec![1, 2]),
            ]
        );
        assert_eq!(layout.slice(17, 17), vec![Segment::Inline(vec![3])]);
    }
}
