//! Estimates before kick-off: how many rows, bytes and shards an export created now would have,
//! and how long it would take — from a bounded census of the dataset, a sample of its records
//! run through the export's own encoder, and the tenant's recent exports. Nothing is queued.

use serde::Serialize;
use sqlx::PgPool;

use super::incremental::{self, FeedContext};
use super::store::facts;
use super::{ExportError, ExportRequest, ExportSpec, Mode, with_op};
use crate::auth::Caller;
use crate::records::Record;
use crate::records::census::{self, Census, Count};
use crate::writers::{Codec, Format, OutputColumn, ShardWriter, gzip};

/// Records encoded to measure bytes per row, and the bytes they may hold.
const SAMPLE_ROWS: i64 = 1000;
const SAMPLE_BYTES: usize = 4 << 20;
/// Recent exports smaller than this say more about start-up than about throughput.
const MIN_ROWS_FOR_RATE: i64 = 10_000;
/// Rows per second assumed before the tenant has exported anything big enough to measure
/// (about what one worker writes on two cores; see README's performance table).
pub const DEFAULT_ROWS_PER_SECOND: f64 = 200_000.0;

/// What an export created now would be. Every number is an estimate; `method` fields say how
/// each was reached.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Estimate {
    /// Always `true`: nothing here is a promise.
    pub estimate: bool,
    pub rows: RowsEstimate,
    pub bytes: BytesEstimate,
    /// Shard files: rows / `shard_rows`, at least one.
    pub shards: u64,
    pub duration: DurationEstimate,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RowsEstimate {
    pub value: u64,
    /// A 95 % interval (equal to `value` when counted).
    pub low: u64,
    pub high: u64,
    /// `counted` (the dataset is small enough to count), `sampled` (a block sample of the record
    /// store), `changes_counted` or `changes_sampled` (incremental: the keys changed since the
    /// cursor); for a partner with a row filter `estimated` or `changes_estimated` either way.
    pub method: &'static str,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct BytesEstimate {
    /// The whole file decompressed (CSV or JSONL text).
    pub uncompressed: u64,
    /// The whole file as downloaded (gzip).
    pub gzip: u64,
    /// `sample_encoded`: this many sampled records written by the export's encoder and compressor.
    pub method: &'static str,
    pub sample_rows: u64,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DurationEstimate {
    /// Waiting in the queue plus running.
    pub seconds: u64,
    pub queue_seconds: u64,
    pub run_seconds: u64,
    /// The rate assumed: measured on recent exports, capped by the tenant's scan rate.
    pub rows_per_second: u64,
    /// `recent_exports_of_dataset`, `recent_exports_of_tenant` or `default_rate`.
    pub method: &'static str,
    /// Whether the tenant's `scan_rows_per_second` quota is what bounds the rate.
    pub limited_by_scan_rate: bool,
    /// Exports queued or running before this one (a partner counts its own).
    pub exports_ahead: u64,
}

/// The estimate for `request` as the caller would create it now. Validates like a create.
pub async fn estimate(
    pool: &PgPool,
    caller: &Caller,
    request: &ExportRequest,
    feed: &FeedContext<'_>,
) -> Result<Estimate, ExportError> {
    let spec = ExportSpec::validate(request, caller)?;
    let (count, sample, method) = census_of(pool, caller, &spec, request, feed).await?;
    let bytes = encoded_size(spec.format, &spec.columns, &sample, count.rows, spec.mode);
    let shards = count.rows.div_ceil(u64::from(spec.shard_rows)).max(1);
    let duration = duration(pool, caller, &spec, count.rows).await?;
    Ok(Estimate {
        estimate: true,
        rows: RowsEstimate { value: count.rows, low: count.low, high: count.high, method },
        bytes,
        shards,
        duration,
    })
}

/// Counts the rows a just-created job should have and stores them as its `rows_estimate`
/// (unless the job already has one).
pub async fn store_rows(
    pool: &PgPool,
    caller: &Caller,
    spec: &ExportSpec,
    from: Option<&str>,
    job_id: uuid::Uuid,
) -> sqlx::Result<Option<i64>> {
    let (count, _) = census::count(pool, &caller.tenant.id, &spec.dataset, census(spec, from), 0, 0).await?;
    let rows = count.rows.min(i64::MAX as u64) as i64;
    super::store::jobs::store_rows_estimate(pool, job_id, rows).await
}

fn census<'a>(spec: &'a ExportSpec, from: Option<&'a str>) -> Census<'a> {
    let row_filter = Some(&spec.row_filter).filter(|f| !f.is_empty());
    match from {
        Some(since) => Census::ChangedSince { since, row_filter },
        None => Census::Live { filters: [Some(&spec.filter).filter(|f| !f.is_empty()), row_filter] },
    }
}

async fn census_of(
    pool: &PgPool,
    caller: &Caller,
    spec: &ExportSpec,
    request: &ExportRequest,
    feed: &FeedContext<'_>,
) -> Result<(Count, Vec<Record>, &'static str), ExportError> {
    let from = match spec.mode {
        Mode::Full => None,
        Mode::Incremental => Some(incremental::start(pool, caller, spec, request.since.as_deref(), feed).await?.from),
    };
    let (count, sample) =
        census::count(pool, &caller.tenant.id, &spec.dataset, census(spec, from.as_deref()), SAMPLE_ROWS, SAMPLE_BYTES)
            .await?;
    if !spec.row_filter.is_empty() {
        // Whether the census counted or sampled, and how wide a sample's interval is, depend on
        // records outside the caller's row filter (and on other tenants' data): a partner with
        // a filter is told neither. Its interval is a function of the value alone.
        let method = if spec.mode == Mode::Full { "estimated" } else { "changes_estimated" };
        return Ok((Count { sampled: true, ..value_interval(count.rows) }, sample, method));
    }
    let method = match (spec.mode, count.sampled) {
        (Mode::Full, false) => "counted",
        (Mode::Full, true) => "sampled",
        (Mode::Incremental, false) => "changes_counted",
        (Mode::Incremental, true) => "changes_sampled",
    };
    let count = if count.sampled { Count { sampled: true, ..value_interval(count.rows) } } else { count };
    Ok((count, sample, method))
}

/// The interval around an estimated `rows` that depends on nothing else: that of a Poisson count
/// (1.96 √rows) plus 5 % for the sample's layout. The sample's own variance would widen with
/// other tenants' data in the same table (fewer of this dataset's pages are sampled).
fn value_interval(rows: u64) -> Count {
    let margin = (1.96 * (rows as f64).sqrt() + 0.05 * rows as f64).ceil() as u64;
    Count { rows, low: rows.saturating_sub(margin), high: rows + margin, sampled: true }
}

/// The file's size if `rows` records like `sample` were exported: the sample's encoded and
/// compressed size per row, plus the format's head once and the gzip framing.
fn encoded_size(format: Format, columns: &[OutputColumn], sample: &[Record], rows: u64, mode: Mode) -> BytesEstimate {
    let mut writer =
        ShardWriter::new(std::io::sink(), format, Codec::CURRENT, columns.to_vec()).expect("writing to a sink");
    for record in sample {
        let data = match mode {
            Mode::Full => record.data.clone(),
            Mode::Incremental if record.data == "{}" => with_op("delete", "{}"),
            Mode::Incremental => with_op("upsert", &record.data),
        };
        // A record the encoder refuses would fail the export too; it is left out of the sample.
        let _ = writer.write_row(&record.key, &data);
    }
    let (_, digest) = writer.finish().expect("writing to a sink");
    let per_row = |total: u64| if digest.rows == 0 { 0.0 } else { total as f64 / digest.rows as f64 };
    let framing = 10 + gzip::SHARD_TAIL_BYTES;
    BytesEstimate {
        uncompressed: digest.head.raw_len + (per_row(digest.body.raw_len) * rows as f64).round() as u64,
        gzip: framing + digest.head.compressed_len + (per_row(digest.body.compressed_len) * rows as f64).round() as u64,
        method: "sample_encoded",
        sample_rows: digest.rows,
    }
}

/// Queue wait and run time at the rate the tenant's recent exports of this mode achieved.
async fn duration(pool: &PgPool, caller: &Caller, spec: &ExportSpec, rows: u64) -> sqlx::Result<DurationEstimate> {
    // Whole seconds of running (claim to publish) and rows of recent exports big enough to say
    // something, of this dataset if there are any, else of any dataset — the caller's own if
    // it is a partner: other principals' exports are not its to measure.
    let measured = facts::recent_throughput(pool, caller, spec.mode, spec.dataset.as_str(), MIN_ROWS_FOR_RATE).await?;
    let (measured_rate, method) = match measured {
        Some(facts::Throughput { same_dataset, rows, seconds }) if seconds > 0.0 => {
            (rows / seconds, if same_dataset { "recent_exports_of_dataset" } else { "recent_exports_of_tenant" })
        }
        _ => (DEFAULT_ROWS_PER_SECOND, "default_rate"),
    };
    let scan_rate = f64::from(caller.tenant.quota.scan_rows_per_second.max(1));
    let rate = measured_rate.min(scan_rate);
    let ahead = work_ahead(pool, caller).await?;
    let slots = f64::from(caller.tenant.quota.max_running_exports.max(1));
    let queue_seconds = if ahead.exports < u64::from(caller.tenant.quota.max_running_exports) {
        0.0
    } else {
        ahead.rows as f64 / rate / slots
    };
    let run_seconds = (rows as f64 / rate).max(1.0);
    Ok(DurationEstimate {
        seconds: (queue_seconds + run_seconds).ceil() as u64,
        queue_seconds: queue_seconds.ceil() as u64,
        run_seconds: run_seconds.ceil() as u64,
        rows_per_second: rate.round() as u64,
        method,
        limited_by_scan_rate: scan_rate < measured_rate,
        exports_ahead: ahead.exports,
    })
}

struct Ahead {
    exports: u64,
    /// Rows the exports ahead have left, by their own estimates.
    rows: u64,
}

async fn work_ahead(pool: &PgPool, caller: &Caller) -> sqlx::Result<Ahead> {
    let (exports, rows) = facts::work_ahead(pool, caller).await?;
    Ok(Ahead { exports: exports.max(0) as u64, rows: rows.max(0) as u64 })
}

/// A job's expected size and finish while it runs, refined as its shards are planned and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outlook {
    /// Exact once a full export's plan is complete (and once it succeeded), else the census's
    /// estimate at creation, never below what is planned or done.
    pub rows_total_estimate: Option<u64>,
    /// Rows left at the rate of the rows done since the job started; while RUNNING and some
    /// rows are done.
    pub eta_seconds: Option<u64>,
}

impl super::ExportJob {
    pub fn outlook(&self, now: time::OffsetDateTime) -> Outlook {
        use super::ExportState;
        let done = self.rows_done.max(0) as u64;
        let total = match self.state {
            ExportState::Succeeded => Some(done),
            ExportState::Queued | ExportState::Running | ExportState::CancelRequested => {
                let planned = self.planned_rows.max(0) as u64;
                if self.mode == Mode::Full && self.plan_complete {
                    Some(planned)
                } else {
                    self.rows_estimate.map(|estimate| (estimate.max(0) as u64).max(planned).max(done))
                }
            }
            _ => None,
        };
        let elapsed = self.started_at.map(|at| (now - at).as_seconds_f64()).unwrap_or(0.0);
        let eta_seconds = match total {
            Some(total) if self.state == ExportState::Running && done > 0 && elapsed > 0.0 => {
                let rate = done as f64 / elapsed;
                Some((total.saturating_sub(done) as f64 / rate).ceil() as u64)
            }
            _ => None,
        };
        Outlook { rows_total_estimate: total, eta_seconds }
    }
}
