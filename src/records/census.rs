//! Counting a dataset's records cheaply, for estimates: an exact count while the dataset is small,
//! else a block sample of the table (`TABLESAMPLE SYSTEM`) with a 95 % interval. Either reads a
//! bounded number of rows and pages, whatever the dataset's size, and needs no table statistics.

use futures_util::TryStreamExt;
use sqlx::PgPool;
use sqlx::types::Json;

use super::{Record, in_key_order};
use crate::dataset::{DatasetName, TenantId};

/// Versions an exact count reads at most; a larger dataset is sampled instead.
pub const EXACT_COUNT_LIMIT: i64 = 50_000;
/// Table pages a sample reads (16 MiB at the default block size).
const SAMPLE_PAGES: f64 = 2048.0;
/// Keeps estimates stable between calls while the data does not change.
const SAMPLE_SEED: i32 = 20_261_202;
/// A census that takes longer than this fails instead of holding a connection.
const STATEMENT_TIMEOUT: &str = "SET LOCAL statement_timeout = '5s'";

/// Column = value equalities a record's data must contain (`data @> filter`).
pub type Filter = serde_json::Map<String, serde_json::Value>;

/// Which records a census counts.
#[derive(Debug, Clone, Copy)]
pub enum Census<'a> {
    /// The dataset's records as of now that contain both filters (what a full export reads).
    Live { filters: [Option<&'a Filter>; 2] },
    /// The keys changed since snapshot `since` as a feed from there delivers them: their version
    /// (or tombstone) live now was written after it, and it contains `row_filter` (an upsert)
    /// or the version live at `since` did (a delete: the record was visible to the caller
    /// then). A key created and deleted since, or never inside the filter, does not count.
    ChangedSince { since: &'a str, row_filter: Option<&'a Filter> },
}

/// How many records there are, as an interval around a best guess.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Count {
    pub rows: u64,
    pub low: u64,
    pub high: u64,
    /// `false`: counted exactly (`low == rows == high`).
    pub sampled: bool,
}

/// Counts the census: exactly if the dataset has at most [`EXACT_COUNT_LIMIT`] versions in the
/// census's range, else by sampling. Returns the count and up to `sample_rows` of the records
/// (holding at most `sample_bytes`), to measure what they encode to.
pub async fn count(
    pool: &PgPool,
    tenant: &TenantId,
    dataset: &DatasetName,
    census: Census<'_>,
    sample_rows: i64,
    sample_bytes: usize,
) -> sqlx::Result<(Count, Vec<Record>)> {
    let sql = CensusSql::of(census);
    let mut tx = in_key_order(pool).await?;
    sqlx::raw_sql(STATEMENT_TIMEOUT).execute(&mut *tx).await?;
    let (scanned, matched): (i64, i64) = census
        .bind(sqlx::query_as(sqlx::AssertSqlSafe(sql.bounded_count())), tenant, dataset)
        .bind(EXACT_COUNT_LIMIT)
        .fetch_one(&mut *tx)
        .await?;
    if scanned < EXACT_COUNT_LIMIT {
        let rows = matched.max(0) as u64;
        let mut records = Vec::new();
        if sample_rows > 0 {
            let query = census.bind(sqlx::query_as(sqlx::AssertSqlSafe(sql.first_rows())), tenant, dataset);
            records = collect(query.bind(sample_rows).fetch(&mut *tx), sample_bytes).await?;
        }
        tx.commit().await?;
        return Ok((Count { rows, low: rows, high: rows, sampled: false }, records));
    }
    let pages = sqlx::query_scalar!(
        r#"SELECT pg_relation_size('record_versions') / current_setting('block_size')::bigint AS "pages!""#
    )
    .fetch_one(&mut *tx)
    .await?;
    let percent = (SAMPLE_PAGES / pages.max(1) as f64 * 100.0).min(100.0);
    let (sum, sum_of_squares): (f64, f64) = census
        .bind(sqlx::query_as(sqlx::AssertSqlSafe(sql.block_sample())), tenant, dataset)
        .bind(percent)
        .bind(SAMPLE_SEED)
        .fetch_one(&mut *tx)
        .await?;
    let mut records = Vec::new();
    if sample_rows > 0 {
        let query = census.bind(sqlx::query_as(sqlx::AssertSqlSafe(sql.sampled_rows())), tenant, dataset);
        let rows = query.bind(percent).bind(SAMPLE_SEED).bind(sample_rows).fetch(&mut *tx);
        records = collect(rows, sample_bytes).await?;
    }
    tx.commit().await?;
    Ok((page_sample_estimate(percent / 100.0, sum, sum_of_squares), records))
}

/// The total from a sample that took each page with probability `fraction` (`TABLESAMPLE
/// SYSTEM`), `sum` matches in all and `sum_of_squares` of the matches per sampled page: the
/// Horvitz–Thompson estimate `sum / fraction`, with the 95 % interval of its unbiased variance
/// estimate `(1 − fraction) × sum_of_squares / fraction²`. A page the sample took but that holds
/// no live tuple (only dead ones: rewritten or deleted records) yields no row to count, so an
/// estimate that divided by the pages seen would count them as missing and overestimate; this one
/// never needs to know how many pages were taken.
fn page_sample_estimate(fraction: f64, sum: f64, sum_of_squares: f64) -> Count {
    let fraction = fraction.clamp(f64::MIN_POSITIVE, 1.0);
    let estimate = sum / fraction;
    let margin = 1.96 * ((1.0 - fraction) * sum_of_squares).sqrt() / fraction;
    Count {
        rows: estimate.round() as u64,
        low: (estimate - margin).max(sum).round() as u64,
        high: (estimate + margin).round() as u64,
        sampled: true,
    }
}

async fn collect(
    mut stream: impl futures_util::Stream<Item = sqlx::Result<Record>> + Unpin,
    max_bytes: usize,
) -> sqlx::Result<Vec<Record>> {
    let (mut records, mut bytes) = (Vec::new(), 0usize);
    while let Some(record) = stream.try_next().await? {
        bytes += record.key.len() + record.data.len();
        records.push(record);
        if bytes >= max_bytes {
            break;
        }
    }
    Ok(records)
}

type CensusQuery<'q, O> = sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>;

impl<'a> Census<'a> {
    /// Binds `$1` to `$4`: tenant, dataset and the census's two parameters.
    fn bind<'q, O>(
        self,
        query: CensusQuery<'q, O>,
        tenant: &'q TenantId,
        dataset: &'q DatasetName,
    ) -> CensusQuery<'q, O>
    where
        'a: 'q,
    {
        let query = query.bind(tenant.as_str()).bind(dataset.as_str());
        match self {
            Census::Live { filters: [a, b] } => query.bind(a.map(Json)).bind(b.map(Json)),
            Census::ChangedSince { since, row_filter } => query.bind(since).bind(row_filter.map(Json)),
        }
    }
}

/// A sampled record as the caller would receive it: its data if it matches the row filter `$4`
/// (every live record of a `Live` census does), else `{}` — a delete, whose data the caller
/// never sees (a record that left the filter must not lend its bytes to the estimate).
const AS_DELIVERED: &str = "CASE WHEN v.data @> coalesce($4::jsonb, '{}') THEN v.data::text ELSE '{}' END";

/// The statements of one kind of census, over `record_versions v`.
struct CensusSql {
    /// Narrows the dataset's versions to an index range, walked in `order`.
    range: &'static str,
    order: &'static str,
    /// Whether a version in the range is counted.
    matches: &'static str,
}

impl CensusSql {
    fn of(census: Census<'_>) -> CensusSql {
        match census {
            Census::Live { .. } => CensusSql {
                range: "true",
                order: "v.key",
                matches: "exportd_live_at(v.created_xid, v.closed_xid, pg_current_snapshot()) AND v.data IS NOT NULL
                          AND ($3::jsonb IS NULL OR v.data @> $3) AND ($4::jsonb IS NULL OR v.data @> $4)",
            },
            Census::ChangedSince { .. } => CensusSql {
                range: "v.created_xid >= pg_snapshot_xmin($3::pg_snapshot)",
                order: "v.created_xid",
                matches: "NOT pg_visible_in_snapshot(v.created_xid, $3::pg_snapshot)
                          AND exportd_live_at(v.created_xid, v.closed_xid, pg_current_snapshot())
                          AND (v.data @> coalesce($4::jsonb, '{}') OR EXISTS (
                              SELECT 1 FROM record_versions s
                              WHERE s.tenant = v.tenant AND s.dataset = v.dataset AND s.key = v.key
                                AND s.data @> coalesce($4::jsonb, '{}')
                                AND exportd_live_at(s.created_xid, s.closed_xid, $3::pg_snapshot)))",
            },
        }
    }

    /// Versions read (at most `$5`) and how many of them match.
    fn bounded_count(&self) -> String {
        format!(
            "SELECT count(*), count(*) FILTER (WHERE {matches}) FROM (
                 SELECT v.tenant, v.dataset, v.key, v.created_xid, v.closed_xid, v.data FROM record_versions v
                 WHERE v.tenant = $1 AND v.dataset = $2 AND {range} ORDER BY {order} LIMIT $5) v",
            matches = self.matches,
            range = self.range,
            order = self.order
        )
    }

    /// The first `$5` matching records in index order.
    fn first_rows(&self) -> String {
        format!(
            "SELECT v.key, {as_delivered} AS data FROM record_versions v
             WHERE v.tenant = $1 AND v.dataset = $2 AND {range} AND {matches} ORDER BY {order} LIMIT $5",
            as_delivered = AS_DELIVERED,
            matches = self.matches,
            range = self.range,
            order = self.order
        )
    }

    /// Over the sampled pages (`$5` percent of them, seed `$6`): the matches, and the sum of
    /// squared matches per page.
    fn block_sample(&self) -> String {
        format!(
            "SELECT coalesce(sum(y), 0)::float8, coalesce(sum(y * y), 0)::float8 FROM (
                 SELECT count(*) FILTER (WHERE v.tenant = $1 AND v.dataset = $2 AND {range} AND {matches})::float8 AS y
                 FROM record_versions v TABLESAMPLE SYSTEM ($5) REPEATABLE ($6)
                 GROUP BY (v.ctid::text::point)[0]) pages",
            matches = self.matches,
            range = self.range
        )
    }

    /// Up to `$7` matching records of the same sample.
    fn sampled_rows(&self) -> String {
        format!(
            "SELECT v.key, {as_delivered} AS data
             FROM record_versions v TABLESAMPLE SYSTEM ($5) REPEATABLE ($6)
             WHERE v.tenant = $1 AND v.dataset = $2 AND {range} AND {matches} LIMIT $7",
            as_delivered = AS_DELIVERED,
            matches = self.matches,
            range = self.range
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenth_of_the_pages_with_20_matches_each_and_a_full_sample_is_exact() {
        // 1000 pages sampled at 10 %, 20 matches on each: 200 000, give or take 1.96 × sqrt(0.9 ×
        // 400 000) / 0.1 = 11 760.
        let count = page_sample_estimate(0.1, 20_000.0, 400_000.0);
        assert_eq!((count.rows, count.low, count.high), (200_000, 188_240, 211_760));
        // Every page sampled: no sampling error left, whatever the spread.
        let count = page_sample_estimate(1.0, 10.0, 40.0);
        assert_eq!((count.rows, count.low, count.high), (10, 10, 10));
    }

    #[test]
    fn pages_of_dead_tuples_do_not_inflate_the_estimate() {
        // 100 live rows on each of 500 pages, and 500 more pages holding only dead tuples. A 10 %
        // sample takes about 50 live pages and 50 dead ones; the dead ones yield no row. The
        // estimate depends only on what the live pages hold.
        let count = page_sample_estimate(0.1, 50.0 * 100.0, 50.0 * 100.0 * 100.0);
        assert_eq!(count.rows, 50_000);
        assert!(count.low < 50_000 && count.high > 50_000, "{count:?}");
        assert!(count.low >= 5000, "never below what the sample itself saw: {count:?}");
        assert_eq!(page_sample_estimate(0.1, 0.0, 0.0).rows, 0);
    }
}
