//! Where a shard's rows come from: the dataset as of the watermark (full exports) or the feed's
//! window chain (incremental exports). Either reads in pages from a resumable position.

use sqlx::PgPool;

use crate::exports::with_op;

use crate::feeds::{self, ChainPosition, Feed, Op};
use crate::records::{AsOf, Record};

/// A page of rows stops early past this many bytes, so memory follows bytes, not rows (records
/// may be up to 1 MiB each).
pub const PAGE_BYTES: usize = 8 << 20;

pub enum Source<'a> {
    Snapshot(AsOf<'a>),
    Changes {
        feed: Feed<'a>,
        /// The chain starts at this snapshot ...
        from: &'a str,
        /// ... after this key of its first window (a cursor from the middle of a window).
        start_after: Option<&'a str>,
        until_tick: i64,
    },
}

/// Rows, the positions of the first and last row read (the last is where to resume), and
/// whether nothing follows.
pub struct SourcePage {
    pub rows: Vec<Record>,
    pub first: Option<String>,
    pub last: Option<String>,
    pub exhausted: bool,
}

impl Source<'_> {
    /// Up to `limit` rows after position `after` (a key, or `window/key` for changes).
    pub async fn page(&self, pool: &PgPool, after: Option<&str>, limit: i64) -> anyhow::Result<SourcePage> {
        match self {
            Source::Snapshot(query) => {
                let (rows, exhausted) = query.page_within(pool, after, limit, PAGE_BYTES).await?;
                let (first, last) = (rows.first().map(|r| r.key.clone()), rows.last().map(|r| r.key.clone()));
                Ok(SourcePage { rows, first, last, exhausted })
            }
            Source::Changes { feed, from, start_after, until_tick } => {
                let position = match after {
                    Some(text) => Some(decode(text)?),
                    None => match start_after {
                        Some(key) => {
                            let window = feeds::next_window(pool, feed.tenant, feed.dataset, from, feed.seal).await?;
                            window.map(|w| ChainPosition { window_id: w.id, after: (*key).to_owned() })
                        }
                        None => None,
                    },
                };
                let (changes, last, exhausted) =
                    feeds::chain_page(pool, feed, from, *until_tick, position.as_ref(), limit as usize).await?;
                let first = changes.first().map(|(p, _)| encode(p));
                let rows = changes
                    .into_iter()
                    .map(|(_, change)| {
                        let data = match (change.op, change.data) {
                            (Op::Upsert, Some(data)) => with_op("upsert", data.get()),
                            _ => with_op("delete", "{}"),
                        };
                        Record { key: change.key, data }
                    })
                    .collect();
                Ok(SourcePage { rows, first, last: last.as_ref().map(encode), exhausted })
            }
        }
    }
}

fn encode(position: &ChainPosition) -> String {
    format!("{}/{}", position.window_id, position.after)
}

fn decode(text: &str) -> anyhow::Result<ChainPosition> {
    let (window, key) = text.split_once('/').ok_or_else(|| anyhow::anyhow!("bad chain position {text:?}"))?;
    Ok(ChainPosition { window_id: window.parse()?, after: key.to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_positions_round_trip() {
        let position = ChainPosition { window_id: 7, after: "a/b".into() };
        assert_eq!(decode(&encode(&position)).unwrap(), position);
    }
}
