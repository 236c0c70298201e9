//! Cutting windows: from a start snapshot to the newest sealed tick. A window, once cut, is
//! fixed: its changed keys are stored, so every later read of it is the same.

use sqlx::PgPool;
use time::OffsetDateTime;

/// The id of a window with no changes, which is never stored.
pub const EMPTY: i64 = 0;

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Window {
    /// [`EMPTY`] for a window without changes (not stored).
    pub id: i64,
    pub from_snapshot: String,
    /// The end tick's snapshot; the next window starts here.
    pub to_snapshot: String,
    pub to_tick: i64,
    pub to_created_at: OffsetDateTime,
    pub keys: i64,
}

const SELECT_WINDOW: &str = "SELECT w.id, w.from_snapshot, t.snapshot::text AS to_snapshot, w.to_tick,
         t.created_at AS to_created_at, w.keys
     FROM feed_windows w JOIN feed_ticks t ON t.id = w.to_tick
     WHERE w.tenant = $1 AND w.dataset = $2 AND w.from_snapshot = $3";

/// Which ticks a new window may end at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seal {
    /// Ticks at least the safety delay old at `now` (feed reads).
    Delayed { now: OffsetDateTime, safety_delay_seconds: u32 },
    /// Ticks up to this one, sealed when an incremental export was created (its runs).
    UpTo(i64),
}

/// The newest tick sealed by `now - safety_delay` (the end of a window cut now), if any.
pub async fn newest_sealed_tick(
    pool: &PgPool,
    now: OffsetDateTime,
    safety_delay_seconds: u32,
) -> sqlx::Result<Option<i64>> {
    let sealed_before = now - time::Duration::seconds(i64::from(safety_delay_seconds));
    sqlx::query_scalar("SELECT max(id) FROM feed_ticks WHERE created_at <= $1")
        .bind(sealed_before)
        .fetch_one(pool)
        .await
}

/// The window starting at `from`: the one already cut, or a new one ending at the newest tick
/// sealed under `seal` that sees everything `from` sees. `None` when no such tick is
/// newer than `from` yet (the reader is caught up).
pub async fn next_window(
    pool: &PgPool,
    tenant: &str,
    dataset: &str,
    from: &str,
    seal: Seal,
) -> sqlx::Result<Option<Window>> {
    if let Some(window) = existing(pool, tenant, dataset, from).await? {
        return Ok(Some(window));
    }
    let (sealed_before, up_to) = match seal {
        Seal::Delayed { now, safety_delay_seconds } => {
            (Some(now - time::Duration::seconds(i64::from(safety_delay_seconds))), None)
        }
        Seal::UpTo(tick) => (None, Some(tick)),
    };
    let mut tx = pool.begin().await?;
    let end: Option<(i64, String, OffsetDateTime)> = sqlx::query_as(
        "SELECT id, snapshot::text, created_at FROM feed_ticks
         WHERE ($2::timestamptz IS NULL OR created_at <= $2) AND ($3::bigint IS NULL OR id <= $3)
           AND snapshot::text <> $1 AND exportd_snapshot_dominates(snapshot, $1::pg_snapshot)
         ORDER BY id DESC LIMIT 1",
    )
    .bind(from)
    .bind(sealed_before)
    .bind(up_to)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((end, to_snapshot, to_created_at)) = end else { return Ok(None) };
    // Compiling the cut's plan (JIT, chosen for its million-row estimates) costs more than it saves.
    sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
    // A concurrent reader cutting the same window waits here on the unique constraint and then
    // finds this one.
    let created: Option<i64> = sqlx::query_scalar(
        "INSERT INTO feed_windows (tenant, dataset, from_snapshot, to_tick, keys) VALUES ($1, $2, $3, $4, 0)
         ON CONFLICT ON CONSTRAINT feed_windows_start DO NOTHING RETURNING id",
    )
    .bind(tenant)
    .bind(dataset)
    .bind(from)
    .bind(end)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(id) = created {
        // Keys changed by a transaction visible at the end and not at the start, each with its
        // version live at the end (one per key, so no de-duplication). Two index-range branches
        // (PgQ's trick): xids from the start's xmax to the end's xmax, plus the short list of
        // transactions that were running at the start. Inserted in key order: the index grows
        // at its right edge.
        let keys = sqlx::query(
            "WITH bounds AS (SELECT $4::pg_snapshot AS a, snapshot AS b FROM feed_ticks WHERE id = $5),
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
             ORDER BY c.key
             ON CONFLICT ON CONSTRAINT feed_window_keys_pkey DO NOTHING",
        )
        .bind(id)
        .bind(tenant)
        .bind(dataset)
        .bind(from)
        .bind(end)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if keys == 0 {
            // Nothing changed: the window is not kept. Caught-up partners polling every second
            // would otherwise store a window a second each; a later read from `from` cuts up
            // to a newer tick instead, which holds the same (no) changes and what came after.
            tx.rollback().await?;
            let from_snapshot = from.to_owned();
            return Ok(Some(Window { id: EMPTY, from_snapshot, to_snapshot, to_tick: end, to_created_at, keys: 0 }));
        }
        sqlx::query("UPDATE feed_windows SET keys = $2 WHERE id = $1")
            .bind(id)
            .bind(keys as i64)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    existing(pool, tenant, dataset, from).await
}

async fn existing(pool: &PgPool, tenant: &str, dataset: &str, from: &str) -> sqlx::Result<Option<Window>> {
    sqlx::query_as(SELECT_WINDOW).bind(tenant).bind(dataset).bind(from).fetch_optional(pool).await
}
