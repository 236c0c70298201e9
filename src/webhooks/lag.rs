//! Where each partner's feed stands, and `feed.lagging` when a partner falls behind.

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::tenants::Tenant;

/// A partner presented a cursor at `position_ts` (unix seconds) to read changes at `now`.
/// Catching up (a position newer than the tenant's lag threshold) ends a lagging episode.
pub async fn record_position(
    pool: &PgPool,
    tenant: &Tenant,
    principal: &str,
    dataset: &str,
    position_ts: i64,
    now: OffsetDateTime,
) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO feed_positions (tenant, principal, dataset, position_at, last_read_at)
         VALUES ($1, $2, $3, to_timestamp($4), $5)
         ON CONFLICT ON CONSTRAINT feed_positions_pkey DO UPDATE SET
             position_at = greatest(feed_positions.position_at, EXCLUDED.position_at),
             last_read_at = EXCLUDED.last_read_at,
             lagging_since = CASE WHEN EXCLUDED.position_at >= $5 - make_interval(mins => $6) THEN NULL
                                  ELSE feed_positions.lagging_since END",
        tenant.id.as_str(),
        principal,
        dataset,
        position_ts as f64,
        now,
        tenant.feeds.lagging_after_minutes as i32
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Raises one `feed.lagging` event per partner and dataset whose position is older than the
/// tenant's threshold at `now` and that has not been raised for this episode yet — the mark and
/// the event in one statement (a threshold of 0 raises none). Returns how many were raised.
pub async fn raise_lagging(pool: &PgPool, tenant: &Tenant, now: OffsetDateTime) -> sqlx::Result<u64> {
    let raised = sqlx::query!(
        "WITH lagging AS (
             UPDATE feed_positions SET lagging_since = $2
              WHERE tenant = $1 AND $3 > 0 AND lagging_since IS NULL
                AND position_at < $2::timestamptz - make_interval(mins => $3)
              RETURNING principal, dataset, position_at, last_read_at)
         INSERT INTO webhook_events (tenant, type, principal, dataset, data)
         SELECT $1, 'feed.lagging', principal, dataset, jsonb_build_object(
                    'principal', principal, 'dataset', dataset,
                    'position_at', exportd_utc(position_at), 'last_read_at', exportd_utc(last_read_at),
                    'lag_seconds', floor(extract(epoch FROM $2::timestamptz - position_at))::bigint,
                    'lagging_after_minutes', $3)
           FROM lagging",
        tenant.id.as_str(),
        now,
        tenant.feeds.lagging_after_minutes as i32
    )
    .execute(pool)
    .await?;
    Ok(raised.rows_affected())
}

/// A partner's feed position, as `GET /metrics` reports it.
pub struct Position {
    pub tenant: String,
    pub principal: String,
    pub dataset: String,
    pub position_at: time::OffsetDateTime,
    pub lagging: bool,
}

/// Every partner's feed position.
pub async fn positions(pool: &PgPool) -> sqlx::Result<Vec<Position>> {
    sqlx::query_as!(
        Position,
        r#"SELECT tenant, principal, dataset, position_at, lagging_since IS NOT NULL AS "lagging!" FROM feed_positions
           ORDER BY tenant, principal, dataset"#
    )
    .fetch_all(pool)
    .await
}
