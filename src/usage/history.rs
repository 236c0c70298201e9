//! Usage over time: per tenant and UTC hour, recorded about once a minute by every API process,
//! read per hour or per day by `GET /v1/usage/history` and the dashboard.
//!
//! Counters (egress, rows exported, exports by outcome and their durations, refusals by kind) are
//! recomputed from the durable records for the current and the previous hour, so a late flush or
//! a second process recording the same hour changes nothing. Gauges (stored bytes, queued and
//! running exports, the oldest queued export's age) can only be sampled: the hour keeps the
//! highest value seen.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::exports::store::facts;

/// Days of hourly history kept.
pub const KEPT_DAYS: i64 = crate::quota::refusals::HOURS_KEPT_DAYS;

/// Only one process records at a time; the others skip that minute.
const RECORD_LOCK: i64 = 0x6578_706f_7274_6801;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Granularity {
    Hour,
    Day,
}

impl Granularity {
    pub fn parse(text: &str) -> Option<Granularity> {
        match text {
            "hour" => Some(Granularity::Hour),
            "day" => Some(Granularity::Day),
            _ => None,
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Granularity::Hour => "hour",
            Granularity::Day => "day",
        }
    }

    pub fn step(self) -> time::Duration {
        match self {
            Granularity::Hour => time::Duration::HOUR,
            Granularity::Day => time::Duration::DAY,
        }
    }

    /// The start of the bucket holding `at` (UTC).
    pub fn truncate(self, at: OffsetDateTime) -> OffsetDateTime {
        let at = at.to_offset(time::UtcOffset::UTC);
        let hour = at.replace_time(time::Time::from_hms(at.hour(), 0, 0).expect("a valid hour"));
        match self {
            Granularity::Hour => hour,
            Granularity::Day => at.replace_time(time::Time::MIDNIGHT),
        }
    }
}

/// One bucket of a tenant's history. Days sum their hours' counters and keep their hours'
/// highest gauges and duration percentiles.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Point {
    #[serde(with = "time::serde::rfc3339")]
    pub start: OffsetDateTime,
    pub egress_bytes: i64,
    pub rows_exported: i64,
    pub exports_succeeded: i64,
    pub exports_failed: i64,
    pub exports_cancelled: i64,
    /// Seconds from create to publish of the exports that succeeded (a day: its hours' highest).
    pub export_seconds_p50: Option<f64>,
    pub export_seconds_p95: Option<f64>,
    /// Refusals per kind; every kind present.
    pub refusals: BTreeMap<String, i64>,
    pub stored_bytes_max: i64,
    pub queued_max: i64,
    pub running_max: i64,
    pub oldest_queued_seconds_max: i64,
}

/// Records the current and the previous hour of every tenant in `tenants`, unless another
/// process is recording right now. Returns whether this one did.
pub async fn record(pool: &PgPool, tenants: &[&str]) -> sqlx::Result<bool> {
    let tenants: Vec<String> = tenants.iter().map(|t| (*t).to_owned()).collect();
    let mut tx = pool.begin().await?;
    let locked: bool = sqlx::query_scalar!(r#"SELECT pg_try_advisory_xact_lock($1) AS "locked!""#, RECORD_LOCK)
        .fetch_one(&mut *tx)
        .await?;
    if !locked {
        return Ok(false);
    }
    let current =
        sqlx::query_scalar!(r#"SELECT date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS "hour!""#)
            .fetch_one(&mut *tx)
            .await?;
    for (hour, sample_gauges) in [(current - time::Duration::HOUR, false), (current, true)] {
        let finished = facts::finished_in_hour(&mut tx, hour, &tenants).await?;
        let gauges = if sample_gauges { facts::gauges(&mut tx, &tenants).await? } else { Vec::new() };
        record_hour(&mut tx, hour, &tenants, &finished, &gauges).await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// Records the history a minute at a time, from the first second on, until `shutdown` (every
/// API process; one records while the others skip).
pub async fn run_recording(pool: PgPool, tenants: Vec<String>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let tenants: Vec<&str> = tenants.iter().map(String::as_str).collect();
    while !*shutdown.borrow() {
        if let Err(e) = record(&pool, &tenants).await {
            tracing::warn!(error = %e, "could not record the usage history; trying again in a minute");
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(60)) => {}
            _ = shutdown.changed() => {}
        }
    }
}

/// Writes one hour of tenants `tenants`: egress and refusals read here, the exports that
/// finished and the export gauges (none when not sampled) as the export store gave them.
async fn record_hour(
    tx: &mut sqlx::PgConnection,
    hour: OffsetDateTime,
    tenants: &[String],
    finished: &[facts::FinishedInHour],
    gauges: &[facts::Gauges],
) -> sqlx::Result<()> {
    sqlx::query!(
        "
WITH tenants AS (SELECT DISTINCT unnest($2::text[]) AS tenant),
egress AS (
    SELECT a.tenant, sum(a.bytes)::bigint AS bytes FROM audit_log a
    WHERE a.action IN ('downloaded', 'delivered') AND a.at >= $1 AND a.at < $1 + interval '1 hour' AND a.tenant = ANY($2)
    GROUP BY a.tenant),
finished AS (
    SELECT * FROM unnest($3::text[], $4::bigint[], $5::int[], $6::int[], $7::int[], $8::float8[], $9::float8[])
        AS f(tenant, rows, succeeded, failed, cancelled, p50, p95)),
refused AS (
    SELECT r.tenant, jsonb_object_agg(r.kind, r.count) AS refusals FROM tenant_refusal_hours r
    WHERE r.hour = $1 AND r.tenant = ANY($2)
    GROUP BY r.tenant),
gauges AS (
    SELECT * FROM unnest($10::text[], $11::bigint[], $12::int[], $13::int[], $14::bigint[])
        AS g(tenant, stored, queued, running, oldest))
INSERT INTO tenant_usage_hours AS h (tenant, hour, egress_bytes, rows_exported, exports_succeeded, exports_failed,
    exports_cancelled, export_seconds_p50, export_seconds_p95, refusals, stored_bytes_max, queued_max, running_max,
    oldest_queued_seconds_max)
SELECT t.tenant, $1, coalesce(e.bytes, 0), coalesce(f.rows, 0), coalesce(f.succeeded, 0), coalesce(f.failed, 0),
       coalesce(f.cancelled, 0), f.p50, f.p95, coalesce(r.refusals, '{}'), coalesce(g.stored, 0), coalesce(g.queued, 0),
       coalesce(g.running, 0), coalesce(g.oldest, 0)
FROM tenants t
LEFT JOIN egress e ON e.tenant = t.tenant LEFT JOIN finished f ON f.tenant = t.tenant
LEFT JOIN refused r ON r.tenant = t.tenant LEFT JOIN gauges g ON g.tenant = t.tenant
ORDER BY t.tenant
ON CONFLICT ON CONSTRAINT tenant_usage_hours_pkey DO UPDATE SET
    egress_bytes = EXCLUDED.egress_bytes, rows_exported = EXCLUDED.rows_exported,
    exports_succeeded = EXCLUDED.exports_succeeded, exports_failed = EXCLUDED.exports_failed,
    exports_cancelled = EXCLUDED.exports_cancelled, export_seconds_p50 = EXCLUDED.export_seconds_p50,
    export_seconds_p95 = EXCLUDED.export_seconds_p95, refusals = EXCLUDED.refusals,
    stored_bytes_max = greatest(h.stored_bytes_max, EXCLUDED.stored_bytes_max),
    queued_max = greatest(h.queued_max, EXCLUDED.queued_max),
    running_max = greatest(h.running_max, EXCLUDED.running_max),
    oldest_queued_seconds_max = greatest(h.oldest_queued_seconds_max, EXCLUDED.oldest_queued_seconds_max)",
        hour,
        tenants,
        &finished.iter().map(|f| f.tenant.clone()).collect::<Vec<_>>(),
        &finished.iter().map(|f| f.rows).collect::<Vec<_>>(),
        &finished.iter().map(|f| f.succeeded).collect::<Vec<_>>(),
        &finished.iter().map(|f| f.failed).collect::<Vec<_>>(),
        &finished.iter().map(|f| f.cancelled).collect::<Vec<_>>(),
        &finished.iter().map(|f| f.p50).collect::<Vec<_>>() as &[Option<f64>],
        &finished.iter().map(|f| f.p95).collect::<Vec<_>>() as &[Option<f64>],
        &gauges.iter().map(|g| g.tenant.clone()).collect::<Vec<_>>(),
        &gauges.iter().map(|g| g.stored_bytes).collect::<Vec<_>>(),
        &gauges.iter().map(|g| g.queued).collect::<Vec<_>>(),
        &gauges.iter().map(|g| g.running).collect::<Vec<_>>(),
        &gauges.iter().map(|g| g.oldest_queued_seconds).collect::<Vec<_>>(),
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// The tenant's buckets from `from` to `to` (bucket starts, `to` excluded), every bucket present
/// (zeros where nothing was recorded).
pub async fn read(
    pool: &PgPool,
    tenant: &str,
    granularity: Granularity,
    from: OffsetDateTime,
    to: OffsetDateTime,
) -> sqlx::Result<Vec<Point>> {
    let rows = sqlx::query!(
        r#"WITH buckets AS (
             -- Stepped in UTC: a day is 24 hours whatever the session's time zone says of DST.
             SELECT s AT TIME ZONE 'UTC' AS start
             FROM generate_series($3::timestamptz AT TIME ZONE 'UTC', $4::timestamptz AT TIME ZONE 'UTC' - interval '1 second',
                                  ('1 ' || $2)::interval) s),
         kept AS (
             SELECT date_trunc($2, h.hour AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS start, h.* FROM tenant_usage_hours h
             WHERE h.tenant = $1 AND h.hour >= $3 AND h.hour < $4),
         -- Refusals per bucket and kind in one pass (not a subquery per bucket).
         refused AS (
             SELECT r.start, jsonb_object_agg(r.key, r.n) AS refusals FROM (
                 SELECT k.start, e.key, sum(e.value::bigint) AS n FROM kept k, jsonb_each_text(k.refusals) e
                 GROUP BY k.start, e.key) r
             GROUP BY r.start)
         SELECT b.start AS "start!",
                coalesce(sum(k.egress_bytes), 0)::bigint AS "egress_bytes!",
                coalesce(sum(k.rows_exported), 0)::bigint AS "rows_exported!",
                coalesce(sum(k.exports_succeeded), 0)::bigint AS "exports_succeeded!",
                coalesce(sum(k.exports_failed), 0)::bigint AS "exports_failed!",
                coalesce(sum(k.exports_cancelled), 0)::bigint AS "exports_cancelled!",
                max(k.export_seconds_p50) AS export_seconds_p50,
                max(k.export_seconds_p95) AS export_seconds_p95,
                coalesce(r.refusals, '{}') AS "refusals!: sqlx::types::Json<BTreeMap<String, i64>>",
                coalesce(max(k.stored_bytes_max), 0)::bigint AS "stored_bytes_max!",
                coalesce(max(k.queued_max), 0)::bigint AS "queued_max!",
                coalesce(max(k.running_max), 0)::bigint AS "running_max!",
                coalesce(max(k.oldest_queued_seconds_max), 0)::bigint AS "oldest_queued_seconds_max!"
         FROM buckets b LEFT JOIN kept k ON k.start = b.start LEFT JOIN refused r ON r.start = b.start
         GROUP BY b.start, r.refusals ORDER BY b.start"#,
        tenant,
        granularity.unit(),
        from,
        to,
    )
    .fetch_all(pool)
    .await?;
    let mut points: Vec<Point> = rows
        .into_iter()
        .map(|r| Point {
            start: r.start,
            egress_bytes: r.egress_bytes,
            rows_exported: r.rows_exported,
            exports_succeeded: r.exports_succeeded,
            exports_failed: r.exports_failed,
            exports_cancelled: r.exports_cancelled,
            export_seconds_p50: r.export_seconds_p50,
            export_seconds_p95: r.export_seconds_p95,
            refusals: r.refusals.0,
            stored_bytes_max: r.stored_bytes_max,
            queued_max: r.queued_max,
            running_max: r.running_max,
            oldest_queued_seconds_max: r.oldest_queued_seconds_max,
        })
        .collect();
    for point in &mut points {
        for kind in crate::quota::RefusalKind::ALL {
            point.refusals.entry(kind.as_str().to_owned()).or_insert(0);
        }
    }
    Ok(points)
}

/// Deletes hours older than [`KEPT_DAYS`] before `now` (the cleaner's pass).
pub async fn collect(pool: &PgPool, now: OffsetDateTime) -> sqlx::Result<u64> {
    let oldest = now - time::Duration::days(KEPT_DAYS);
    Ok(sqlx::query!("DELETE FROM tenant_usage_hours WHERE hour < $1", oldest).execute(pool).await?.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn buckets_start_on_the_utc_hour_or_day() {
        let at = datetime!(2026-12-02 13:47:12 +01:00);
        assert_eq!(Granularity::Hour.truncate(at), datetime!(2026-12-02 12:00 UTC));
        assert_eq!(Granularity::Day.truncate(at), datetime!(2026-12-02 00:00 UTC));
        assert_eq!(Granularity::parse("week"), None);
    }
}
