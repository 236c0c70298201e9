//! Cutting windows: fixed sets of changed keys between two ticks, shared by every reader of a
//! dataset. A dataset's windows never overlap; a reader whose start lies inside one reads it
//! from its own start (only the keys changed after that), so storage grows with changes, not
//! with readers.

use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;

use crate::history::HistoryPoint;

/// The id of a window with no changes, which is never stored.
pub const EMPTY: i64 = 0;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// [`EMPTY`] for a window without changes (not stored).
    pub id: i64,
    /// Where the window starts: a tick's snapshot (shared windows), or a reader's own start
    /// when no tick was older (exact-start windows, like every window cut before sharing).
    pub from_snapshot: String,
    /// The tick the window starts at; `None` for an exact-start window.
    pub from_tick: Option<i64>,
    /// Where this reader reads the window from: its own position, which sees everything
    /// `from_snapshot` sees. Keys changed before it are not this reader's changes.
    pub start: String,
    /// The end tick's snapshot; the next window starts here.
    pub to_snapshot: String,
    pub to_tick: i64,
    pub to_created_at: OffsetDateTime,
    /// Where in the database's history the end tick was taken.
    pub to_timeline: i32,
    pub to_wal_position: i64,
    pub keys: i64,
}

impl Window {
    /// Where in the database's history the next window starts.
    pub fn to_point(&self) -> HistoryPoint {
        HistoryPoint { timeline: self.to_timeline, wal_position: self.to_wal_position }
    }

    fn read_from(self, start: &str) -> Window {
        Window { start: start.to_owned(), ..self }
    }
}

/// `query_as!` of [`Window`]s meeting `$conditions`, each read from its own start.
macro_rules! select_windows {
    ($conditions:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            Window,
            r#"SELECT w.id, w.from_snapshot, w.from_tick, w.from_snapshot AS "start!", t.snapshot::text AS "to_snapshot!",
                      w.to_tick, t.created_at AS to_created_at, t.timeline AS to_timeline,
                      t.wal_position AS to_wal_position, w.keys
               FROM feed_windows w JOIN feed_ticks t ON t.id = w.to_tick WHERE "#
                + $conditions
            $(, $arg)*
        )
    };
}

/// Which ticks a new window may end at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seal {
    /// Ticks at least the safety delay old at `now` (feed reads).
    Delayed { now: OffsetDateTime, safety_delay_seconds: u32 },
    /// Ticks up to this one, sealed when an incremental export was created (its runs).
    UpTo(i64),
}

impl Seal {
    fn bounds(self) -> (Option<OffsetDateTime>, Option<i64>) {
        match self {
            Seal::Delayed { now, safety_delay_seconds } => {
                (Some(now - time::Duration::seconds(i64::from(safety_delay_seconds))), None)
            }
            Seal::UpTo(tick) => (None, Some(tick)),
        }
    }
}

/// The newest tick sealed by `now - safety_delay` (the end of a window cut now), if any.
pub async fn newest_sealed_tick(
    pool: &PgPool,
    now: OffsetDateTime,
    safety_delay_seconds: u32,
) -> sqlx::Result<Option<i64>> {
    let sealed_before = now - time::Duration::seconds(i64::from(safety_delay_seconds));
    sqlx::query_scalar!("SELECT max(id) FROM feed_ticks WHERE created_at <= $1", sealed_before).fetch_one(pool).await
}

/// The window a reader at `from` reads next: the exact-start window cut from `from` if there is
/// one, else the shared window `from` lies in, else a new window cut from the newest tick `from`
/// sees to the newest tick sealed under `seal` (or to the next shared window's start, filling
/// the gap). `None` when no sealed tick is newer than `from` yet (the reader is caught up).
pub async fn next_window(
    pool: &PgPool,
    tenant: &str,
    dataset: &str,
    from: &str,
    seal: Seal,
) -> sqlx::Result<Option<Window>> {
    if let Some(window) = exact_start_window(pool, tenant, dataset, from).await? {
        return Ok(Some(window.read_from(from)));
    }
    let mut conn = pool.acquire().await?;
    let Some(base) = newest_tick_seen_by(&mut conn, from).await? else {
        // No tick is as old as `from` (a cursor taken before the first tick): a window of its own.
        return cut(pool, tenant, dataset, Start::Exact(from), seal).await;
    };
    if let Some(window) = shared_window_at(&mut conn, tenant, dataset, base).await?
        && window.from_tick.is_some_and(|t| t <= base)
    {
        return Ok(Some(window.read_from(from)));
    }
    drop(conn);
    Ok(cut(pool, tenant, dataset, Start::Shared { tick: base }, seal).await?.map(|w| w.read_from(from)))
}

/// The window of a stored chain position, read from `from` if `from` lies in it (the chain's
/// first window), else from the window's own start.
pub async fn window_by_id(pool: &PgPool, id: i64, from: &str) -> sqlx::Result<Option<Window>> {
    let Some(window) = select_windows!("w.id = $1", id).fetch_optional(pool).await? else {
        return Ok(None);
    };
    let start = match window.from_tick {
        Some(first) => {
            let mut conn = pool.acquire().await?;
            let base = newest_tick_seen_by(&mut conn, from).await?;
            if base.is_some_and(|b| first <= b && b < window.to_tick) {
                from.to_owned()
            } else {
                window.from_snapshot.clone()
            }
        }
        None => window.from_snapshot.clone(),
    };
    Ok(Some(window.read_from(&start)))
}

/// The exact-start window cut from `from` (before windows were shared, or before any tick).
async fn exact_start_window(pool: &PgPool, tenant: &str, dataset: &str, from: &str) -> sqlx::Result<Option<Window>> {
    select_windows!(
        "w.tenant = $1 AND w.dataset = $2 AND w.from_tick IS NULL AND w.from_snapshot = $3",
        tenant,
        dataset,
        from
    )
    .fetch_optional(pool)
    .await
}

/// The newest tick `snapshot` sees everything of (at most the one after it can share its xmax).
async fn newest_tick_seen_by(conn: &mut PgConnection, snapshot: &str) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar!(
        "SELECT id FROM (SELECT id, snapshot FROM feed_ticks
                         WHERE pg_snapshot_xmax(snapshot) <= pg_snapshot_xmax($1::text::pg_snapshot)
                         ORDER BY pg_snapshot_xmax(snapshot) DESC LIMIT 4) t
         WHERE exportd_snapshot_dominates($1::text::pg_snapshot, t.snapshot)
         ORDER BY id DESC LIMIT 1",
        snapshot
    )
    .fetch_optional(conn)
    .await
}

/// The first shared window ending after tick `base`: the one `base` lies in if it starts at or
/// before `base`, else the next one.
async fn shared_window_at(
    conn: &mut PgConnection,
    tenant: &str,
    dataset: &str,
    base: i64,
) -> sqlx::Result<Option<Window>> {
    select_windows!(
        "w.tenant = $1 AND w.dataset = $2 AND w.from_tick IS NOT NULL AND w.to_tick > $3 ORDER BY w.to_tick LIMIT 1",
        tenant,
        dataset,
        base
    )
    .fetch_optional(conn)
    .await
}

/// Where a new window starts.
enum Start<'a> {
    /// At a tick, shared by every reader whose start lies after it.
    Shared { tick: i64 },
    /// At this snapshot exactly (no tick is older).
    Exact(&'a str),
}

/// Advisory lock class of window cuts (the second key is the dataset's hash): cuts of one
/// dataset's shared windows take turns, so they never overlap.
const CUT_LOCK_CLASS: i32 = 0x6665_6564; // "feed"

/// Cuts and stores a window from `start` to the newest tick sealed under `seal` that is newer
/// than it. Returns the window (or [`EMPTY`] when nothing changed: not kept, so caught-up
/// polls store nothing), `None` when no such tick exists.
async fn cut(pool: &PgPool, tenant: &str, dataset: &str, start: Start<'_>, seal: Seal) -> sqlx::Result<Option<Window>> {
    let mut tx = pool.begin().await?;
    let (sealed_before, up_to) = seal.bounds();
    let (from_tick, after_tick, until_tick, exact_from) = match start {
        Start::Shared { tick } => {
            sqlx::query!(
                "SELECT pg_advisory_xact_lock($1, hashtext($2 || '/' || $3))",
                CUT_LOCK_CLASS,
                tenant,
                dataset
            )
            .execute(&mut *tx)
            .await?;
            // Another reader may have cut it while this one waited.
            let following = shared_window_at(&mut tx, tenant, dataset, tick).await?;
            match following {
                Some(w) if w.from_tick.is_some_and(|t| t <= tick) => {
                    tx.commit().await?;
                    return Ok(Some(w));
                }
                // A gap before the next shared window: fill it, up to that window's start.
                Some(w) => (Some(tick), Some(tick), w.from_tick, None),
                None => (Some(tick), Some(tick), None, None),
            }
        }
        Start::Exact(from) => (None, None, None, Some(from)),
    };
    let end = sqlx::query!(
        r#"SELECT id, snapshot::text AS "snapshot!", created_at, timeline, wal_position FROM feed_ticks
           WHERE ($1::bigint IS NULL OR id > $1) AND ($2::bigint IS NULL OR id <= $2)
             AND ($3::timestamptz IS NULL OR created_at <= $3) AND ($4::bigint IS NULL OR id <= $4)
             AND ($5::text IS NULL OR (snapshot::text <> $5 AND exportd_snapshot_dominates(snapshot, $5::pg_snapshot)))
           ORDER BY id DESC LIMIT 1"#,
        after_tick,
        until_tick,
        sealed_before,
        up_to,
        exact_from,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(end) = end else {
        return Ok(None);
    };
    let from_snapshot: String = match (exact_from, from_tick) {
        (Some(from), _) => from.to_owned(),
        (None, tick) => {
            sqlx::query_scalar!(r#"SELECT snapshot::text AS "snapshot!" FROM feed_ticks WHERE id = $1"#, tick)
                .fetch_one(&mut *tx)
                .await?
        }
    };
    // Compiling the cut's plan (JIT, chosen for its million-row estimates) costs more than it saves.
    sqlx::query!("SET LOCAL jit = off").execute(&mut *tx).await?;
    // Two readers cutting the same exact-start window: the second waits here on the unique index
    // and then finds the first one's.
    let created: Option<i64> = sqlx::query_scalar!("INSERT INTO feed_windows (tenant, dataset, from_snapshot, from_tick, to_tick, keys) VALUES ($1, $2, $3, $4, $5, 0)
         ON CONFLICT DO NOTHING RETURNING id", tenant, dataset, &from_snapshot, from_tick, end.id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(id) = created else {
        tx.commit().await?;
        let found = exact_start_window(pool, tenant, dataset, &from_snapshot).await?;
        return Ok(found.map(|w| w.read_from(&from_snapshot)));
    };
    let keys = store_changed_keys(&mut tx, id, tenant, dataset, &from_snapshot, end.id).await?;
    let window = Window {
        id,
        start: from_snapshot.clone(),
        from_snapshot,
        from_tick,
        to_snapshot: end.snapshot,
        to_tick: end.id,
        to_created_at: end.created_at,
        to_timeline: end.timeline,
        to_wal_position: end.wal_position,
        keys: keys as i64,
    };
    if keys == 0 {
        // Nothing changed: the window is not kept. Caught-up partners polling every second
        // would otherwise store a window a second each; a later read from the same start cuts
        // up to a newer tick instead, which holds the same (no) changes and what came after.
        tx.rollback().await?;
        return Ok(Some(Window { id: EMPTY, ..window }));
    }
    sqlx::query!("UPDATE feed_windows SET keys = $2 WHERE id = $1", id, keys as i64).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(Some(window))
}

/// Stores the keys changed by a transaction visible at tick `end` and not at `from`, each with
/// its version live at the end. A key has one version live at any snapshot (a writer closes the
/// one it replaces), so the keys are unique without an `ON CONFLICT` check — which would double
/// the cut's time (a speculative insertion per key). Two index-range branches
/// (PgQ's trick): xids from the start's xmax to the end's xmax, plus the short list of
/// transactions that were running at the start. Inserted in key order: the index grows at its
/// right edge. Returns how many keys changed.
async fn store_changed_keys(
    tx: &mut PgConnection,
    window: i64,
    tenant: &str,
    dataset: &str,
    from: &str,
    end: i64,
) -> sqlx::Result<u64> {
    Ok(sqlx::query!(
        "WITH bounds AS (SELECT $4::text::pg_snapshot AS a, snapshot AS b FROM feed_ticks WHERE id = $5),
         changed AS (
             SELECT v.key, v.id, v.created_xid, v.closed_xid FROM record_versions v, bounds
             WHERE v.tenant = $2 AND v.dataset = $3
               AND v.created_xid >= pg_snapshot_xmax(bounds.a) AND v.created_xid < pg_snapshot_xmax(bounds.b)
             UNION ALL
             SELECT v.key, v.id, v.created_xid, v.closed_xid
             FROM record_versions v, bounds, pg_snapshot_xip(bounds.a) AS running(xid)
             WHERE v.tenant = $2 AND v.dataset = $3 AND v.created_xid = running.xid)
         INSERT INTO feed_window_keys (window_id, key, version_id)
         SELECT $1::bigint, c.key, c.id FROM changed c, bounds
         WHERE exportd_live_at(c.created_xid, c.closed_xid, bounds.b)
           AND NOT pg_visible_in_snapshot(c.created_xid, bounds.a)
         ORDER BY c.key",
        window,
        tenant,
        dataset,
        from,
        end
    )
    .execute(tx)
    .await?
    .rows_affected())
}
