//! The ticker: one tick about every second across all processes.

use std::time::Duration;

use sqlx::PgPool;

/// Advisory lock key of the ticker ("exportd-ticker").
const TICKER_LOCK: i64 = 0x6578_7064_7469_636b;
/// Records `pg_current_snapshot()` as a new tick unless another process holds the ticker lock or
/// ticked less than `min_gap` ago (several processes run tickers). Must run on the primary (a
/// standby's snapshot lacks the in-progress list). Returns the new tick's id.
pub async fn tick(pool: &PgPool, min_gap: Duration) -> sqlx::Result<Option<i64>> {
    let mut tx = pool.begin().await?;
    let locked: bool = sqlx::query_scalar!(r#"SELECT pg_try_advisory_xact_lock($1) AS "locked!""#, TICKER_LOCK)
        .fetch_one(&mut *tx)
        .await?;
    if !locked {
        return Ok(None);
    }
    // Ticks must be monotone: each new snapshot sees everything the previous one saw.
    let id: Option<i64> = sqlx::query_scalar!(
        "INSERT INTO feed_ticks (snapshot)
         SELECT pg_current_snapshot()
         WHERE NOT EXISTS (SELECT 1 FROM feed_ticks
                           WHERE created_at > clock_timestamp() - $1 * interval '1 millisecond')
           AND coalesce((SELECT exportd_snapshot_dominates(pg_current_snapshot(), snapshot)
                         FROM feed_ticks ORDER BY id DESC LIMIT 1), true)
         RETURNING id",
        min_gap.as_secs_f64() * 1000.0
    )
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(id)
}

/// Ticks every `every` until `shutdown` turns true.
pub async fn run_ticker(pool: PgPool, every: Duration, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    while !*shutdown.borrow() {
        if let Err(e) = tick(&pool, every.mul_f32(0.9)).await {
            tracing::warn!(error = %e, "feed tick failed");
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.changed() => {}
        }
    }
}
