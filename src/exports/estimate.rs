//! Estimates before kick-off: how many rows, bytes and shards an export created now would have,
//! and how long it would take — from a bounded census of the dataset, a sample of its records
//! run through the export's own encoder, and the tenant's recent exports. Nothing is queued.

use serde::Serialize;
use sqlx::PgPool;

use super::incremental::{self, FeedContext};
use super::store::facts;
use super::{ExportError, ExportRequest, ExportSpec, FileFacts, Mode, with_op};
use crate::auth::Caller;
use crate::masking::ColumnHasher;
use crate::records::Record;
use crate::records::census::{self, Census, Count};
use crate::replicas::Replicas;
use crate::served::ServedView;
use crate::writers::{ShardDigest, ShardWriter};

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
    /// Everything to download: the whole file (csv, jsonl) or every shard file (parquet).
    pub download: u64,
    /// csv and jsonl: the whole file decompressed (CSV or JSONL text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uncompressed: Option<u64>,
    /// csv and jsonl: the whole file as downloaded (gzip), the same as `download`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gzip: Option<u64>,
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

/// The estimate for `request` as the caller would create it now. Validates like a create. The
/// census reads on a standby of `replicas` that has everything the primary had committed when
/// it began (its pages are the primary's, so a sample takes the same rows), else the primary.
pub async fn estimate(
    pool: &PgPool,
    replicas: &Replicas,
    caller: &Caller,
    request: &ExportRequest,
    feed: &FeedContext<'_>,
) -> Result<Estimate, ExportError> {
    let spec = ExportSpec::validate(request, caller)?;
    let (count, sample, method) = census_of(pool, replicas, caller, &spec, request, feed).await?;
    let shards = count.rows.div_ceil(u64::from(spec.shard_rows)).max(1);
    let view = ServedView::of(&caller.tenant, &caller.principal, spec.dataset.as_str()).ok();
    let hasher = view.and_then(|v| v.hasher());
    let bytes = encoded_size(&spec, hasher, &sample, count.rows, shards);
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
    replicas: &Replicas,
    caller: &Caller,
    spec: &ExportSpec,
    request: &ExportRequest,
    feed: &FeedContext<'_>,
) -> Result<(Count, Vec<Record>, &'static str), ExportError> {
    let from = match spec.mode {
        Mode::Full => None,
        Mode::Incremental => Some(incremental::start(pool, caller, spec, request.since.as_deref(), feed).await?.from),
    };
    let reader = replicas.reader_now(pool).await?;
    let census = census(spec, from.as_deref());
    let (count, sample) =
        census::count(reader, &caller.tenant.id, &spec.dataset, census, SAMPLE_ROWS, SAMPLE_BYTES).await?;
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
/// (1.96 √rows) plus 10 % for the sample's layout. The sample's own variance would widen with
/// other tenants' data in the same table (fewer of this dataset's pages are sampled). 10 %: a
/// 2 048-page sample of a dataset whose every record was rewritten, or a quarter deleted, missed
/// by up to 7 % (tests/it/exports.rs, over 12 sample seeds).
fn value_interval(rows: u64) -> Count {
    let margin = (1.96 * (rows as f64).sqrt() + 0.10 * rows as f64).ceil() as u64;
    Count { rows, low: rows.saturating_sub(margin), high: rows + margin, sampled: true }
}

/// The export's size if `rows` records like `sample` were exported in `files` shard files: the
/// sample written by the export's own writer, once whole and once its first half, gives the
/// bytes each row adds and what a file has besides (the gzip framing and CSV header, once for
/// the whole file; each Parquet shard's header, column chunks' metadata and footer).
fn encoded_size(
    spec: &ExportSpec,
    hasher: Option<&ColumnHasher>,
    sample: &[Record],
    rows: u64,
    files: u64,
) -> BytesEstimate {
    let facts = FileFacts {
        export_id: uuid::Uuid::nil(),
        dataset: spec.dataset.as_str(),
        mode: spec.mode,
        watermark: Some("0:0:"), // an admin's footer; a partner's is the ~40 bytes smaller
        schema_sha256: &spec.schema_sha256,
        schema_version: &spec.schema_version,
        exportd_version: crate::VERSION,
        columns: &spec.columns,
        column_policy: spec.column_policy.as_deref(),
        hashed_key_order: spec.hashed_key_order,
    };
    let shard_spec = super::shard_spec(spec.format, spec.format.spec().codec, &facts, hasher);
    let write = |records: &[Record]| -> ShardDigest {
        let mut writer = ShardWriter::new(std::io::sink(), &shard_spec).expect("writing to a sink");
        for record in records {
            let data = match spec.mode {
                Mode::Full => record.data.clone(),
                Mode::Incremental if record.data == "{}" => with_op("delete", "{}"),
                Mode::Incremental => with_op("upsert", &record.data),
            };
            // A record the encoder refuses would fail the export too; it is left out of the sample.
            let _ = writer.write_row(&record.key, &data);
        }
        writer.finish().expect("writing to a sink").1
    };
    let (full, half) = (write(sample), write(&sample[..sample.len() / 2]));
    let per_row = |total: u64, fewer: u64| {
        if full.rows == half.rows { 0.0 } else { total.saturating_sub(fewer) as f64 / (full.rows - half.rows) as f64 }
    };
    let row_bytes = per_row(full.bytes, half.bytes);
    let fixed = (full.bytes as f64 - row_bytes * full.rows as f64).max(0.0);
    let spliceable = spec.format.spec().spliceable();
    let fixed_files = if spliceable { 1 } else { files };
    let download = (fixed_files as f64 * fixed + row_bytes * rows as f64).round() as u64;
    let raw_row_bytes = per_row(full.body.raw_len, half.body.raw_len);
    BytesEstimate {
        download,
        uncompressed: spliceable.then(|| full.head.raw_len + (raw_row_bytes * rows as f64).round() as u64),
        gzip: spliceable.then_some(download),
        method: "sample_encoded",
        sample_rows: full.rows,
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
