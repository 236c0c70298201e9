//! Garbage collection of history: closed record versions and tombstones older than the tenant's
//! tombstone window, and the feed windows and ticks before it — never a version that a queued or
//! running export still reads.

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::tenants::Tenant;

/// Who still reads a tenant's history: the export store (queued and running exports).
pub trait Readers: Sync {
    /// The snapshots of queued or running exports (watermarks and incremental starts).
    fn live_snapshots(&self, tenant: &str) -> impl Future<Output = sqlx::Result<Vec<String>>> + Send;
    /// Whether an incremental export of the tenant has not finished (it may be reading windows).
    fn incremental_unfinished(&self, tenant: &str) -> impl Future<Output = sqlx::Result<bool>> + Send;
}

const BATCH: i64 = 10_000;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Collected {
    pub versions: u64,
    pub windows: u64,
}

/// Collects one tenant's history older than `tombstone_days` before `now`.
///
/// The horizon is the newest tick taken before then: cursors older than it answer 410, so no
/// reader needs a version closed before it — except queued or running exports, whose watermarks
/// (and incremental starts) protect every version they can still see.
pub async fn collect(
    pool: &PgPool,
    readers: &impl Readers,
    tenant: &Tenant,
    now: OffsetDateTime,
) -> sqlx::Result<Collected> {
    let cutoff = now - time::Duration::days(i64::from(tenant.retention.tombstone_days));
    let horizon = sqlx::query!(
        r#"SELECT id, snapshot::text AS "snapshot!" FROM feed_ticks WHERE created_at <= $1 ORDER BY id DESC LIMIT 1"#,
        cutoff,
    )
    .fetch_optional(pool)
    .await?;
    let Some((horizon_tick, horizon)) = horizon.map(|h| (h.id, h.snapshot)) else { return Ok(Collected::default()) };
    let live = readers.live_snapshots(tenant.id.as_str()).await?;
    let mut collected = Collected::default();
    loop {
        // A closed version is dead once its closing transaction is visible to the horizon and to
        // every live reader; a current tombstone once its deleting transaction is.
        let deleted = sqlx::query!("DELETE FROM record_versions WHERE id IN (
                 SELECT v.id FROM record_versions v
                 WHERE v.tenant = $1
                   AND ((v.closed_xid IS NOT NULL AND pg_visible_in_snapshot(v.closed_xid, $2::text::pg_snapshot)
                         AND NOT EXISTS (SELECT 1 FROM unnest($3::text[]) AS s(snap)
                                         WHERE NOT pg_visible_in_snapshot(v.closed_xid, s.snap::pg_snapshot)))
                     OR (v.data IS NULL AND v.closed_xid IS NULL AND pg_visible_in_snapshot(v.created_xid, $2::text::pg_snapshot)
                         AND NOT EXISTS (SELECT 1 FROM unnest($3::text[]) AS s(snap)
                                         WHERE NOT pg_visible_in_snapshot(v.created_xid, s.snap::pg_snapshot))))
                 LIMIT $4)", tenant.id.as_str(), &horizon, &live, BATCH)
        .execute(pool)
        .await?
        .rows_affected();
        collected.versions += deleted;
        if deleted < BATCH as u64 {
            break;
        }
    }
    // Windows before the horizon, unless a live incremental export may still be reading its chain.
    // A window's keys go with it (they have no foreign key: checking one per key made cutting
    // a window of a million keys three times slower).
    if readers.incremental_unfinished(tenant.id.as_str()).await? {
        return Ok(collected);
    }
    let windows: i64 = sqlx::query_scalar!(
        "WITH gone AS (DELETE FROM feed_windows WHERE tenant = $1 AND to_tick < $2 RETURNING id),
         keys AS (DELETE FROM feed_window_keys k USING gone WHERE k.window_id = gone.id)
         SELECT count(*) AS \"collected!\" FROM gone",
        tenant.id.as_str(),
        horizon_tick
    )
    .fetch_one(pool)
    .await?;
    collected.windows = windows as u64;
    Ok(collected)
}

/// Ticks before the oldest horizon of all tenants that no window starts or ends at (a reader
/// inside a shared window finds it by its start tick).
pub async fn collect_ticks(pool: &PgPool, oldest_cutoff: OffsetDateTime) -> sqlx::Result<u64> {
    Ok(sqlx::query!(
        "DELETE FROM feed_ticks t WHERE t.created_at < $1
           AND t.id < (SELECT max(id) FROM feed_ticks WHERE created_at <= $1)
           AND NOT EXISTS (SELECT 1 FROM feed_windows w WHERE w.to_tick = t.id OR w.from_tick = t.id)",
        oldest_cutoff
    )
    .execute(pool)
    .await?
    .rows_affected())
}
