//! Pages of changes: the keys of consecutive windows in byte order, each with its state at the
//! window's end compared with its state at the window's start.

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;
use sqlx::PgPool;
use time::OffsetDateTime;

use super::cursor::Cursor;
use super::window::{Seal, Window, next_window, window_by_id};
use crate::history::HistoryPoint;
use crate::records::KeyOrder;
use crate::replicas::Replicas;
use crate::served::ServedView;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Upsert,
    Delete,
}

/// One key's change within a window: its latest state, or a tombstone.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub op: Op,
    pub key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Box<RawValue>>,
}

impl Change {
    /// What the change adds to a page: its key and data.
    fn bytes(&self) -> usize {
        self.key.len() + self.data.as_ref().map_or(0, |d| d.get().len())
    }
}

#[derive(Debug)]
pub struct ChangePage {
    pub changes: Vec<Change>,
    pub next: Cursor,
    /// Caught up with the newest sealed window.
    pub end_of_stream: bool,
}

impl Change {
    /// The change's data as `served` has it (its columns only, retired ones null).
    pub fn projected(mut self, served: &crate::schemas::ServedSchema) -> serde_json::Result<Change> {
        if let Some(data) = &self.data {
            self.data = Some(RawValue::from_string(served.project(data.get())?)?);
        }
        Ok(self)
    }

    /// The change through the partner's column policy (key and data).
    pub fn masked(mut self, policy: &crate::masking::ColumnPolicy) -> serde_json::Result<Change> {
        self.key = policy.key(&self.key).into_owned();
        if let Some(data) = &self.data {
            self.data = Some(RawValue::from_string(policy.record(data.get())?)?);
        }
        Ok(self)
    }

    /// The change as `view` serves it: projected onto its schema version, then through its
    /// column policy.
    pub fn as_served(self, view: &ServedView<'_>) -> serde_json::Result<Change> {
        let change = if view.projects() { self.projected(view.schema)? } else { self };
        match view.policy {
            Some(policy) => change.masked(policy),
            None => Ok(change),
        }
    }
}

/// How a page's changes are shown to its reader (projected to its schema version, through its
/// column policy): applied before a change counts towards the page's bytes, so where a page ends
/// depends only on what the reader receives.
pub type Shape<'a> = &'a (dyn Fn(Change) -> serde_json::Result<Change> + Sync);

/// What to read: whose changes, narrowed how, sealed by when.
pub struct Feed<'a> {
    pub tenant: &'a str,
    pub dataset: &'a str,
    /// The partner's row filter (`{}` for none): a record that stops matching is a delete, one
    /// that starts matching an upsert.
    pub row_filter: &'a Value,
    /// Which ticks new windows may end at.
    pub seal: Seal,
    /// The order of a window's changes, and what a position in it is (a key or a hashed key).
    pub order: KeyOrder<'a>,
}

/// A page of changes ends early once its keys and data reach this many bytes (one record may
/// take it past, by at most the 1 MiB a record may have).
pub const PAGE_BYTES: usize = 8 << 20;

/// Keys read from a window at a time (at least) while looking for a page's changes.
const SCAN_BATCH: usize = 2_000;

/// Up to `limit` changes after `position`, crossing window boundaries as needed. Windows are
/// fixed once cut, so the same cursor reads the same page (or, at the head of the stream,
/// possibly more once newer windows are sealed).
///
/// Positions only ever name what this partner receives: keys are read past the last change
/// delivered until `limit` changes are found or the window ends, and the cursor stops at the
/// last change delivered — never at a key outside the partner's row filter, so neither the
/// cursor nor the page depends on records the partner may not see.
///
/// Windows are cut on `pool` (the primary); their changes are read on a standby of `replicas`
/// that has replayed everything the primary had committed once the window was there (a
/// window's keys and every record version its end tick saw), else on the primary.
pub async fn page(
    pool: &PgPool,
    replicas: &Replicas,
    feed: &Feed<'_>,
    mut position: Cursor,
    limit: usize,
    shape: Shape<'_>,
) -> sqlx::Result<ChangePage> {
    let mut filling = Filling::new(limit);
    loop {
        let window = next_window(pool, feed.tenant, feed.dataset, &position.from, feed.seal).await?;
        let Some(window) = window else {
            return Ok(ChangePage { changes: filling.items, next: position, end_of_stream: true });
        };
        let start = position.after.clone().unwrap_or_default();
        let reader = if window.keys == 0 { pool } else { replicas.reader_now(pool).await? };
        if let Some(last) = collect(reader, feed, &window, &start, &mut filling, shape, |c| c).await? {
            position.after = Some(last);
            return Ok(ChangePage { changes: filling.items, next: position, end_of_stream: false });
        }
        position.from = window.to_snapshot.clone();
        position.at = Some(window.to_point());
        position.after = None;
        position.ts = window.to_created_at.unix_timestamp();
    }
}

/// A page being filled: its items and the bytes of their keys and data.
struct Filling<T> {
    items: Vec<T>,
    bytes: usize,
    limit: usize,
}

impl<T> Filling<T> {
    fn new(limit: usize) -> Self {
        Filling { items: Vec::new(), bytes: 0, limit }
    }
}

/// Reads `window`'s changes after position `after` into `page` (shaped by `shape`, then through
/// `wrap`) until it holds its limit of changes or [`PAGE_BYTES`] of shaped changes: then returns
/// the position of the last change taken. `None` when the window ran out first.
async fn collect<T>(
    pool: &PgPool,
    feed: &Feed<'_>,
    window: &Window,
    after: &str,
    page: &mut Filling<T>,
    shape: Shape<'_>,
    wrap: impl Fn(Change) -> T,
) -> sqlx::Result<Option<String>> {
    use futures_util::TryStreamExt;
    if window.keys == 0 {
        return Ok(None);
    }
    let mut after = after.to_owned();
    loop {
        // Without a row filter every key is a change: one read of what is missing suffices.
        let batch = (page.limit - page.items.len()).max(SCAN_BATCH);
        // In key order: walk the window's key index even where statistics are missing (a window
        // just cut).
        let mut tx = feed.order.begin(pool).await?;
        let mut rows = window_changes(&mut tx, feed, window, &after, batch);
        let (mut read, mut last_read) = (0, None);
        while let Some(row) = rows.try_next().await? {
            read += 1;
            let position = feed.order.position(&row.key);
            last_read = Some(position.clone());
            let Some(change) = row.change() else { continue };
            let last = position;
            let change = shape(change).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            page.bytes += change.bytes();
            page.items.push(wrap(change));
            if page.items.len() == page.limit || page.bytes >= PAGE_BYTES {
                return Ok(Some(last));
            }
        }
        drop(rows);
        tx.commit().await?;
        match last_read {
            Some(key) if read == batch => after = key,
            _ => return Ok(None),
        }
    }
}

/// One changed key of a window, as read: its data at the window's end if it matches the
/// partner's row filter there, and whether it matched at the window's start.
struct KeyState {
    key: String,
    /// Changed after the reader's start (every key of a window read from its own start).
    changed: bool,
    data: Option<String>,
    matches_at_end: bool,
    matched_at_start: bool,
}

impl KeyState {
    /// Upsert when the record exists and matches at the end, delete when it matched at the
    /// start but no longer does, nothing otherwise (unchanged since the reader's start, created
    /// and deleted within the window, or never visible to this partner).
    fn change(self) -> Option<Change> {
        if !self.changed {
            None
        } else if self.matches_at_end {
            let data = self.data.and_then(|d| RawValue::from_string(d).ok());
            Some(Change { op: Op::Upsert, key: self.key, data })
        } else if self.matched_at_start {
            Some(Change { op: Op::Delete, key: self.key, data: None })
        } else {
            None
        }
    }
}

/// Up to `limit` of `window`'s changed keys after position `after`, in the feed's order, with their states. The
/// version live at the end is read by the id stored when the window was cut (windows cut before
/// ids were stored search the key's versions); a key changed after the reader's start is one
/// whose end version its start does not see (if that version was collected, its change is older
/// than any live cursor). The start is looked at only when the end does not decide (a delete, or
/// a record outside the row filter), and data is rendered only for records the partner receives.
fn window_changes<'a>(
    conn: &'a mut sqlx::PgConnection,
    feed: &'a Feed<'_>,
    window: &'a Window,
    after: &'a str,
    limit: usize,
) -> futures_util::stream::BoxStream<'a, sqlx::Result<KeyState>> {
    match feed.order {
        KeyOrder::Key => window_changes_query!("k.key > $2", "k.key", conn, feed, window, after, limit),
        // Every page hashes the window's keys: windows are cut per tick, so they stay small.
        KeyOrder::Hashed(hasher) => window_changes_query!(
            "exportd_keyed_hash(k.key, $9, $10) > decode($2, 'hex')",
            "exportd_keyed_hash(k.key, $9, $10)",
            conn,
            feed,
            window,
            after,
            limit,
            &hasher.pads().inner,
            &hasher.pads().outer,
        ),
    }
}

/// [`window_changes`]' statement: the keys after position `$position`, in order `$order`
/// (literals), the padded hash key as `$9` and `$10` where the order is hashed.
macro_rules! window_changes_query {
    ($position:literal, $order:literal, $conn:expr, $feed:expr, $window:expr, $after:expr, $limit:expr $(, $pad:expr)* $(,)?) => {
        sqlx::query_as!(
            KeyState,
            r#"SELECT k.key, coalesce(NOT pg_visible_in_snapshot(e.created_xid, $6::text::pg_snapshot), false) AS "changed!",
                    CASE WHEN e.data @> $7 THEN e.data::text END AS data,
                    coalesce(e.data @> $7, false) AS "matches_at_end!", s.data IS NOT NULL AS "matched_at_start!"
             FROM feed_window_keys k
             LEFT JOIN LATERAL (
                 SELECT v.data, v.created_xid FROM record_versions v WHERE v.id = k.version_id
                 UNION ALL
                 SELECT v.data, v.created_xid FROM record_versions v
                 WHERE k.version_id IS NULL AND v.tenant = $4 AND v.dataset = $5 AND v.key = k.key
                   AND exportd_live_at(v.created_xid, v.closed_xid, $8::text::pg_snapshot)
                 LIMIT 1) e ON true
             LEFT JOIN LATERAL (
                 SELECT v.data FROM record_versions v
                 WHERE NOT coalesce(e.data @> $7, false) AND NOT pg_visible_in_snapshot(e.created_xid, $6::text::pg_snapshot)
                   AND v.tenant = $4 AND v.dataset = $5 AND v.key = k.key AND v.data IS NOT NULL
                   AND v.data @> $7 AND exportd_live_at(v.created_xid, v.closed_xid, $6::text::pg_snapshot)
                 LIMIT 1) s ON true
             WHERE k.window_id = $1 AND "#
                + $position
                + " ORDER BY "
                + $order
                + " LIMIT $3",
            $window.id,
            $after,
            $limit as i64,
            $feed.tenant,
            $feed.dataset,
            &$window.start,
            $feed.row_filter,
            &$window.to_snapshot,
            $($pad),*
        )
        .fetch($conn)
    };
}
use window_changes_query;

/// A position inside a chain of windows: the window and the last key read in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainPosition {
    pub window_id: i64,
    pub after: String,
}

/// The changes after `position` (or from the chain's start at `from`), for incremental exports:
/// up to `limit`, stopping after the window that reaches tick `until`. Each change comes with
/// the position to resume after it; like cursors, positions only name changes delivered.
/// Returns the changes, the position after the last one (or `position`), and whether the chain
/// is exhausted.
pub async fn chain_page(
    pool: &PgPool,
    feed: &Feed<'_>,
    from: &str,
    until: i64,
    position: Option<&ChainPosition>,
    limit: usize,
) -> sqlx::Result<(Vec<(ChainPosition, Change)>, Option<ChainPosition>, bool)> {
    let mut filling = Filling::new(limit);
    let (mut window, mut after) = match position {
        Some(p) => (window_by_id(pool, p.window_id, from).await?, p.after.clone()),
        None => (next_window(pool, feed.tenant, feed.dataset, from, feed.seal).await?, String::new()),
    };
    while let Some(w) = window {
        let id = w.id;
        let wrap = |change: Change| (ChainPosition { window_id: id, after: feed.order.position(&change.key) }, change);
        if collect(pool, feed, &w, &after, &mut filling, &Ok, wrap).await?.is_some() {
            let last = filling.items.last().map(|(p, _)| p.clone());
            return Ok((filling.items, last, false));
        }
        if w.to_tick >= until {
            break;
        }
        window = next_window(pool, feed.tenant, feed.dataset, &w.to_snapshot, feed.seal).await?;
        after = String::new();
    }
    let last = filling.items.last().map(|(p, _)| p.clone()).or_else(|| position.cloned());
    Ok((filling.items, last, true))
}

/// Where a chain from `from` ends once it reaches tick `until`: the snapshot (its history point
/// and time) the next read continues from. `None` when no window was cut from `from`.
pub async fn chain_end(
    pool: &PgPool,
    feed: &Feed<'_>,
    from: &str,
    until: i64,
) -> sqlx::Result<Option<(String, HistoryPoint, OffsetDateTime)>> {
    let mut end = None;
    let mut at = from.to_owned();
    while let Some(w) = next_window(pool, feed.tenant, feed.dataset, &at, feed.seal).await? {
        end = Some((w.to_snapshot.clone(), w.to_point(), w.to_created_at));
        if w.to_tick >= until {
            break;
        }
        at = w.to_snapshot;
    }
    Ok(end)
}
