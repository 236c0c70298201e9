//! Where a shard's rows come from: the dataset as of the watermark (full exports) or the feed's
//! window chain (incremental exports). Either is read in pages from a resumable position.

use futures_util::TryStreamExt;
use futures_util::stream::BoxStream;
use sqlx::{PgPool, Postgres, Transaction};

use crate::exports::with_op;

use super::spool::{Spool, SpoolReader};
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

/// What reading a shard holds open: for a snapshot, the transaction its rows stream in.
#[derive(Default)]
pub struct Reading(Option<Transaction<'static, Postgres>>);

impl Reading {
    /// Ends the read (commits its read-only transaction, so the connection goes back clean).
    pub async fn end(self) -> sqlx::Result<()> {
        match self.0 {
            Some(tx) => tx.commit().await,
            None => Ok(()),
        }
    }
}

/// One shard's rows, page after page.
pub enum Pages<'c> {
    /// A snapshot's rows: one statement for the whole shard, cut into pages as they arrive, so
    /// PostgreSQL produces rows while the encoder works instead of waiting for the next query.
    Stream { rows: BoxStream<'c, sqlx::Result<Record>>, ended: bool },
    /// A snapshot's rows in hashed-key order, from the export's spool.
    Spooled { reader: SpoolReader, ended: bool },
    /// A feed's changes: one query per page.
    Changes { source: &'c Source<'c>, pool: &'c PgPool, after: Option<String> },
}

impl<'a> Source<'a> {
    /// The rows after position `after` (a key, a hashed key when they come from `spool`, or
    /// `window/key` for changes), at most `rows`;
    /// whatever the read holds open is kept in `reading`.
    pub async fn pages<'c>(
        &'c self,
        pool: &'c PgPool,
        reading: &'c mut Reading,
        after: Option<&'c str>,
        rows: u64,
        spool: Option<std::sync::Arc<Spool>>,
    ) -> anyhow::Result<Pages<'c>> {
        match (self, spool) {
            (Source::Snapshot(_), Some(spool)) => Ok(Pages::Spooled { reader: spool.read_after(after)?, ended: false }),
            (Source::Snapshot(query), None) => {
                let tx = reading.0.insert(crate::records::in_key_order(pool).await?);
                Ok(Pages::Stream { rows: query.stream(tx, after, rows as i64), ended: false })
            }
            (Source::Changes { .. }, _) => Ok(Pages::Changes { source: self, pool, after: after.map(str::to_owned) }),
        }
    }

    /// Up to `limit` changes after position `after`.
    async fn changes_page(&self, pool: &PgPool, after: Option<&str>, limit: i64) -> anyhow::Result<SourcePage> {
        let Source::Changes { feed, from, start_after, until_tick } = self else {
            anyhow::bail!("not a feed's changes");
        };
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

impl Pages<'_> {
    /// The next page: up to `limit` rows, fewer once they hold [`PAGE_BYTES`].
    pub async fn next(&mut self, limit: usize) -> anyhow::Result<SourcePage> {
        match self {
            Pages::Stream { rows, ended } => {
                let (mut page, mut bytes) = (Vec::new(), 0);
                while !*ended && page.len() < limit && bytes < PAGE_BYTES {
                    match rows.try_next().await? {
                        Some(record) => {
                            bytes += record.key.len() + record.data.len();
                            page.push(record);
                        }
                        None => *ended = true,
                    }
                }
                let (first, last) = (page.first().map(|r| r.key.clone()), page.last().map(|r| r.key.clone()));
                Ok(SourcePage { rows: page, first, last, exhausted: *ended })
            }
            Pages::Spooled { reader, ended } => {
                let (mut page, mut bytes, mut first, mut last) = (Vec::new(), 0, None, None);
                while !*ended && page.len() < limit && bytes < PAGE_BYTES {
                    match reader.next().await? {
                        Some((record, position)) => {
                            bytes += record.key.len() + record.data.len();
                            first.get_or_insert_with(|| position.clone());
                            last = Some(position);
                            page.push(record);
                        }
                        None => *ended = true,
                    }
                }
                Ok(SourcePage { rows: page, first, last, exhausted: *ended })
            }
            Pages::Changes { source, pool, after } => {
                let page = source.changes_page(pool, after.as_deref(), limit as i64).await?;
                if page.last.is_some() {
                    after.clone_from(&page.last);
                }
                Ok(page)
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
