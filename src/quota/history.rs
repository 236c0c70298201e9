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

/// Days of hourly history kept.
pub const KEPT_DAYS: i64 = 90;

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
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
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
    #[sqlx(json)]
    pub refusals: BTreeMap<String, i64>,
    pub stored_bytes_max: i64,
    pub queued_max: i64,
    pub running_max: i64,
    pub oldest_queued_seconds_max: i64,
}

/// Records the current and the previous hour of every tenant in `tenants`, unless another
/// process is recording right now. Returns whether this one did.
pub async fn record(pool: &PgPool, tenants: &[&str]) -> sqlx::Result<bool> {
    let mut tx = pool.begin().await?;
    let locked: bool =
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)").bind(RECORD_LOCK).fetch_one(&mut *tx).await?;
    if !locked {
        return Ok(false);
    }
    for (hours_ago, sample_gauges) in [(1, false), (0, true)] {
        sqlx::query(sqlx::AssertSqlSafe(record_hour_sql()))
            .bind(hours_ago)
            .bind(tenants)
            .bind(sample_gauges)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// One hour (`$1` hours before the current one) of tenants `$2`; `$3`: sample the gauges now.
fn record_hour_sql() -> String {
    format!(
        "
WITH span AS (SELECT date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - $1 * interval '1 hour' AS hour),
tenants AS (SELECT DISTINCT unnest($2::text[]) AS tenant),
egress AS (
    SELECT a.tenant, sum(a.bytes)::bigint AS bytes FROM audit_log a, span
    WHERE a.action = 'downloaded' AND a.at >= span.hour AND a.at < span.hour + interval '1 hour' AND a.tenant = ANY($2)
    GROUP BY a.tenant),
finished AS (
    SELECT j.tenant,
           coalesce(sum(j.rows_done) FILTER (WHERE j.state IN {published}), 0)::bigint AS rows,
           count(*) FILTER (WHERE j.state IN {published})::int AS succeeded,
           count(*) FILTER (WHERE j.state = 'FAILED')::int AS failed,
           count(*) FILTER (WHERE j.state = 'CANCELLED')::int AS cancelled,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.finished_at - j.created_at))
               FILTER (WHERE j.state IN {published}) AS p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM j.finished_at - j.created_at))
               FILTER (WHERE j.state IN {published}) AS p95
    FROM export_jobs j, span
    WHERE j.finished_at >= span.hour AND j.finished_at < span.hour + interval '1 hour' AND j.tenant = ANY($2)
    GROUP BY j.tenant),
refused AS (
    SELECT r.tenant, jsonb_object_agg(r.kind, r.count) AS refusals FROM tenant_refusal_hours r, span
    WHERE r.hour = span.hour AND r.tenant = ANY($2)
    GROUP BY r.tenant),
gauges AS (
    SELECT j.tenant,
           coalesce(sum(j.bytes_done) FILTER (WHERE j.files_deleted_at IS NULL), 0)::bigint AS stored,
           count(*) FILTER (WHERE j.state = 'QUEUED')::int AS queued,
           count(*) FILTER (WHERE j.state = 'RUNNING')::int AS running,
           coalesce(floor(extract(epoch FROM now() - min(j.created_at) FILTER (WHERE j.state = 'QUEUED'))), 0)::bigint AS oldest
    FROM export_jobs j
    WHERE $3 AND j.tenant = ANY($2)
    GROUP BY j.tenant)
INSERT INTO tenant_usage_hours AS h (tenant, hour, egress_bytes, rows_exported, exports_succeeded, exports_failed,
    exports_cancelled, export_seconds_p50, export_seconds_p95, refusals, stored_bytes_max, queued_max, running_max,
    oldest_queued_seconds_max)
SELECT t.tenant, span.hour, coalesce(e.bytes, 0), coalesce(f.rows, 0), coalesce(f.succeeded, 0), coalesce(f.failed, 0),
       coalesce(f.cancelled, 0), f.p50, f.p95, coalesce(r.refusals, '{{}}'), coalesce(g.stored, 0), coalesce(g.queued, 0),
       coalesce(g.running, 0), coalesce(g.oldest, 0)
FROM tenants t CROSS JOIN span
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
        published = crate::exports::states::PUBLISHED
    )
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
    let mut points: Vec<Point> = sqlx::query_as(
        "WITH buckets AS (
             -- Stepped in UTC: a day is 24 hours whatever the session's time zone says of DST.
             SELECT s AT TIME ZONE 'UTC' AS start
             FROM generate_series($3::timestamptz AT TIME ZONE 'UTC', $4::timestamptz AT TIME ZONE 'UTC' - interval '1 second',
                                  ('1 ' || $2)::interval) s),
         kept AS (
             SELECT date_trunc($2, h.hour AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS start, h.* FROM tenant_usage_hours h
             WHERE h.tenant = $1 AND h.hour >= $3 AND h.hour < $4)
         SELECT b.start,
                coalesce(sum(k.egress_bytes), 0)::bigint AS egress_bytes,
                coalesce(sum(k.rows_exported), 0)::bigint AS rows_exported,
                coalesce(sum(k.exports_succeeded), 0)::bigint AS exports_succeeded,
                coalesce(sum(k.exports_failed), 0)::bigint AS exports_failed,
                coalesce(sum(k.exports_cancelled), 0)::bigint AS exports_cancelled,
                max(k.export_seconds_p50) AS export_seconds_p50,
                max(k.export_seconds_p95) AS export_seconds_p95,
                coalesce((SELECT jsonb_object_agg(e.key, e.n) FROM (
                              SELECT e.key, sum(e.value::bigint) AS n FROM kept k2, jsonb_each_text(k2.refusals) e
                              WHERE k2.start = b.start GROUP BY e.key) e), '{}') AS refusals,
                coalesce(max(k.stored_bytes_max), 0)::bigint AS stored_bytes_max,
                coalesce(max(k.queued_max), 0)::bigint AS queued_max,
                coalesce(max(k.running_max), 0)::bigint AS running_max,
                coalesce(max(k.oldest_queued_seconds_max), 0)::bigint AS oldest_queued_seconds_max
         FROM buckets b LEFT JOIN kept k ON k.start = b.start
         GROUP BY b.start ORDER BY b.start",
    )
    .bind(tenant)
    .bind(granularity.unit())
    .bind(from)
    .bind(to)
    .fetch_all(pool)
    .await?;
    for point in &mut points {
        for kind in super::RefusalKind::ALL {
            point.refusals.entry(kind.as_str().to_owned()).or_insert(0);
        }
    }
    Ok(points)
}

/// Deletes hours older than [`KEPT_DAYS`] before `now` (the cleaner's pass).
pub async fn collect(pool: &PgPool, now: OffsetDateTime) -> sqlx::Result<u64> {
    let oldest = now - time::Duration::days(KEPT_DAYS);
    Ok(sqlx::query("DELETE FROM tenant_usage_hours WHERE hour < $1").bind(oldest).execute(pool).await?.rows_affected())
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
