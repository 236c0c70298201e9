//! Export jobs: creation with an idempotency key and a sealed snapshot watermark, reading,
//! listing, cancelling, and the published manifest. Workers run them (see `jobs`).

pub mod download;
pub mod estimate;
mod incremental;
pub mod layout;
mod manifest;
mod request;
mod state;
pub mod store;

use base64::Engine;
use serde_json::Value;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

pub use incremental::{FeedContext, store_cursor};
pub use layout::{Layout, Segment, ShardRecord};
pub use manifest::{FileFacts, MANIFEST_VERSION, Manifest, ManifestFile, ManifestShard, shard_name, shard_spec};
pub use request::{DEFAULT_SHARD_ROWS, ExportRequest, ExportSpec, MAX_SHARD_ROWS, Mode, OP_COLUMN, with_op};
pub use state::ExportState;
use store::jobs::Inserted;

use crate::auth::Caller;
use crate::served::{ServedView, ViewChanged};
use crate::writers::{Codec, Format, sha256_hex};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{field}: {detail}")]
    InvalidField { field: String, detail: String },
    #[error(
        "a {} export has no whole file: each shard is a self-contained file; download the shards (`links.shards`, or `exportd-client download`)",
        .0.name()
    )]
    NoWholeFile(Format),
    #[error("no such dataset")]
    DatasetNotFound,
    #[error("the dataset is not granted to this principal")]
    DatasetNotGranted,
    #[error("the principal's row filter changed since this export was created; create a new export")]
    RowFilterChanged,
    #[error(
        "the principal's column policy changed since this export was created (its files follow the old one); create a new export"
    )]
    ColumnPolicyChanged,
    #[error("{detail}")]
    InvalidCursor { field: &'static str, detail: String },
    #[error("{0}")]
    CursorExpired(String),
    /// The start cursor's history was lost in a failover, or cannot be checked.
    #[error(transparent)]
    CursorHistory(crate::feeds::CursorError),
    #[error(transparent)]
    Rejected(#[from] crate::quota::Rejection),
    #[error("an incremental export of this dataset is already queued or running for this principal")]
    IncrementalInProgress,
    #[error(
        "the dataset is fed by an attached host table whose backfill has not finished: its records are incomplete until it does (`exportd attachments` shows its progress)"
    )]
    BackfillRunning,
    #[error(
        "the dataset is fed by an attached host table whose replication slot the host dropped: changes since are missing until an operator resyncs it (`exportd attach --resync`)"
    )]
    CaptureLost,
    #[error("this Idempotency-Key was already used with a different request")]
    IdempotencyKeyReused,
    #[error("no such export")]
    NotFound,
    #[error("the export is already {}", .0.as_str())]
    AlreadyTerminal(ExportState),
    #[error("the export is {}, not SUCCEEDED", .0.as_str())]
    NotPublished(ExportState),
    #[error("only a SUCCEEDED export can be revoked; this one is {} (cancel it instead)", .0.as_str())]
    NotRevocable(ExportState),
    #[error("the export is {}; it has no files", .0.as_str())]
    Gone(ExportState),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// `Idempotency-Key`: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Keys starting with this are exportd's own (subscriptions' scheduled exports).
    const RESERVED_PREFIX: &str = "exportd:";

    pub fn parse(text: &str) -> Result<IdempotencyKey, String> {
        if !((1..=255).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_graphic())) {
            Err("must be 1 to 255 visible ASCII characters".to_owned())
        } else if text.starts_with(Self::RESERVED_PREFIX) {
            Err(format!("keys starting with `{}` are exportd's own", Self::RESERVED_PREFIX))
        } else {
            Ok(IdempotencyKey(text.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key of a subscription's `run`-th scheduled export: a retried run replays its export.
    pub fn of_subscription_run(subscription: Uuid, run: i64) -> IdempotencyKey {
        IdempotencyKey(format!("{}subscription:{subscription}:{run}", Self::RESERVED_PREFIX))
    }
}

/// One export job as stored.
#[derive(Debug, Clone)]
pub struct ExportJob {
    pub id: Uuid,
    pub tenant: String,
    pub principal: String,
    pub dataset: String,
    pub mode: Mode,
    pub format: Format,
    /// What writes the shards' bytes: the format's codec when the job was created.
    pub codec: Codec,
    /// The dataset schema's sha256 and version (empty for jobs older than versions) and the
    /// exportd version at creation (manifests, Parquet footers).
    pub schema_sha256: String,
    pub schema_version: String,
    pub exportd_version: String,
    pub request: Value,
    pub request_sha256: String,
    pub state: ExportState,
    pub watermark: String,
    /// Where in the database's history the watermark was taken.
    pub watermark_timeline: i32,
    pub watermark_wal_position: i64,
    pub columns: Value,
    pub filter: Value,
    pub row_filter: Value,
    /// The fingerprint of the partner's column policy the export was cut under.
    pub column_policy: Option<String>,
    /// Rows are ordered and cut by the partner's hashed key (its policy hashes the key).
    pub hashed_key_order: bool,
    pub shard_rows: i32,
    pub created_at: OffsetDateTime,
    pub started_at: Option<OffsetDateTime>,
    pub finished_at: Option<OffsetDateTime>,
    pub lease_generation: i64,
    pub attempts: i32,
    /// Consecutive claims without a new checkpoint in between (the `attempts-exhausted` count).
    pub stalled_attempts: i32,
    /// When that run of claims without a new checkpoint began.
    pub stalled_since: Option<OffsetDateTime>,
    pub shards_done: i32,
    pub rows_done: i64,
    pub bytes_done: i64,
    pub error_code: Option<String>,
    pub error_detail: Option<String>,
    pub manifest_sha256: Option<String>,
    pub file_bytes: Option<i64>,
    pub file_sha256: Option<String>,
    pub expires_at: Option<OffsetDateTime>,
    pub from_cursor: Option<String>,
    pub start_from: Option<String>,
    pub start_after: Option<String>,
    pub until_tick: Option<i64>,
    /// Rows a census expected at creation (see [`estimate`]).
    pub rows_estimate: Option<i64>,
    /// Rows of the shard plan so far; the exact total once a full export's plan is complete.
    pub planned_rows: i64,
    pub plan_complete: bool,
}

impl ExportJob {
    /// The schema version and hash the export was written with (none for jobs older than
    /// schema versions).
    pub fn schema_stamp(&self) -> Option<crate::schemas::SchemaStamp> {
        (!self.schema_version.is_empty()).then(|| crate::schemas::SchemaStamp {
            version: self.schema_version.clone(),
            sha256: self.schema_sha256.clone(),
        })
    }
}

/// The outcome of a create: the job, and whether it already existed for this key.
#[derive(Debug)]
pub struct Created {
    pub job: ExportJob,
    pub replayed: bool,
}

/// Creates an export job, or replays the one created earlier with the same key and request.
///
/// One transaction authorizes (the grant and row filter are frozen into the job), takes
/// `pg_current_snapshot()` as the watermark and inserts the job QUEUED. A concurrent create with
/// the same key loses on the unique constraint and is answered as a replay.
pub async fn create(
    pool: &PgPool,
    caller: &Caller,
    key: &IdempotencyKey,
    request: &ExportRequest,
    feed: &FeedContext<'_>,
) -> Result<Created, ExportError> {
    create_for(pool, caller, key, request, feed, None).await
}

/// [`create`], for `subscription`'s schedule when given: the export then carries the
/// subscription, whose cursor it advances instead of the principal's.
pub async fn create_for(
    pool: &PgPool,
    caller: &Caller,
    key: &IdempotencyKey,
    request: &ExportRequest,
    feed: &FeedContext<'_>,
    subscription: Option<Uuid>,
) -> Result<Created, ExportError> {
    let (canonical, canonical_text) = request.canonical();
    let request_sha256 = sha256_hex(canonical_text.as_bytes());
    if let Some(existing) = find_by_key(pool, caller, key).await? {
        return replay(existing, &request_sha256);
    }
    let spec = ExportSpec::validate(request, caller)?;
    if let Some(incomplete) = crate::attach::incomplete(pool, caller.tenant.id.as_str(), &request.dataset).await? {
        return Err(incomplete.into());
    }
    let start = match spec.mode {
        Mode::Full => None,
        Mode::Incremental => Some(incremental::start(pool, caller, &spec, request.since.as_deref(), feed).await?),
    };
    let mut tx = pool.begin().await?;
    // Serialize this tenant's creates on its usage row, then count: exactly max_queued_exports
    // creates succeed however many arrive at once.
    crate::quota::lock_tenant(&mut tx, caller.tenant.id.as_str()).await?;
    // A partner also has a share of its own, so partners can never queue admins out.
    let (queued, mine) =
        store::jobs::count_queued(&mut tx, caller.tenant.id.as_str(), caller.principal.id.as_str()).await?;
    let quota = &caller.tenant.quota;
    let refusal = if queued as u64 >= u64::from(quota.max_queued_exports) {
        Some(("max_queued_exports", quota.max_queued_exports, queued))
    } else if !caller.principal.is_admin() && mine as u64 >= u64::from(quota.max_queued_exports_per_partner) {
        Some(("max_queued_exports_per_partner", quota.max_queued_exports_per_partner, mine))
    } else {
        None
    };
    if let Some((limit_name, limit, queued)) = refusal {
        drop(tx);
        let rejection = crate::quota::Rejection::Queued { limit_name, limit: u64::from(limit), queued: queued as u64 };
        return Err(rejection.into());
    }
    let new_job = store::jobs::NewJob {
        tenant: caller.tenant.id.as_str(),
        principal: caller.principal.id.as_str(),
        dataset: spec.dataset.as_str(),
        mode: spec.mode.as_str(),
        format: spec.format.name(),
        codec: spec.format.spec().codec.name(),
        schema_sha256: &spec.schema_sha256,
        schema_version: &spec.schema_version,
        exportd_version: crate::VERSION,
        request: &canonical,
        request_sha256: &request_sha256,
        idempotency_key: &key.0,
        columns: serde_json::to_value(&spec.columns).expect("serializable"),
        filter: Value::Object(spec.filter.clone()),
        row_filter: Value::Object(spec.row_filter.clone()),
        column_policy: spec.column_policy.as_deref(),
        hashed_key_order: spec.hashed_key_order,
        shard_rows: spec.shard_rows as i32,
        from_cursor: start.as_ref().map(|s| s.cursor.as_str()),
        start_from: start.as_ref().map(|s| s.from.as_str()),
        start_after: start.as_ref().and_then(|s| s.after.as_deref()),
        until_tick: start.as_ref().map(|s| s.until_tick),
        subscription_id: subscription,
    };
    let inserted = match store::jobs::insert(&mut tx, &new_job).await? {
        Inserted::IncrementalInProgress => return Err(ExportError::IncrementalInProgress), // rolls back
        Inserted::KeyTaken => None,
        Inserted::Job(job) => Some(*job),
    };
    tx.commit().await?;
    match inserted {
        Some(mut job) => {
            // After the commit, so a refused create costs no census; best effort: a job without
            // an estimate only lacks an ETA until its plan is known.
            let from = start.as_ref().map(|s| s.from.as_str());
            match estimate::store_rows(pool, caller, &spec, from, job.id).await {
                Ok(rows) => job.rows_estimate = rows,
                Err(e) => tracing::warn!(export = %job.id, error = %e, "estimating a new export's rows failed"),
            }
            if let Some(start) = &start {
                // An incremental export reads the feed from its start, as a changes page does.
                let (principal, dataset) = (caller.principal.id.as_str(), spec.dataset.as_str());
                crate::webhooks::lag::record_position(
                    pool,
                    &caller.tenant,
                    principal,
                    dataset,
                    start.position_ts,
                    feed.now,
                )
                .await?;
            }
            Ok(Created { job, replayed: false })
        }
        None => {
            let existing = find_by_key(pool, caller, key).await?.ok_or(ExportError::NotFound)?;
            replay(existing, &request_sha256)
        }
    }
}

fn replay(existing: ExportJob, request_sha256: &str) -> Result<Created, ExportError> {
    if existing.request_sha256 == request_sha256 {
        Ok(Created { job: existing, replayed: true })
    } else {
        Err(ExportError::IdempotencyKeyReused)
    }
}

async fn find_by_key(pool: &PgPool, caller: &Caller, key: &IdempotencyKey) -> sqlx::Result<Option<ExportJob>> {
    store::jobs::find_by_key(pool, caller, &key.0).await
}

/// The job if the caller may see it: admins see their tenant's jobs, partners their own.
/// Anything else — another tenant's job, another partner's, a made-up id — is `NotFound`.
pub async fn get(pool: &PgPool, caller: &Caller, id: Uuid) -> Result<ExportJob, ExportError> {
    store::jobs::get(pool, caller, id).await?.ok_or(ExportError::NotFound)
}

/// A page of the caller's jobs, newest first.
pub struct Page {
    pub jobs: Vec<ExportJob>,
    pub next_cursor: Option<String>,
}

/// Keyset-paginated listing; `cursor` is the opaque `next_cursor` of the previous page.
pub async fn list(
    pool: &PgPool,
    caller: &Caller,
    state: Option<ExportState>,
    cursor: Option<&str>,
    limit: u32,
) -> Result<Page, ExportError> {
    let after = cursor.map(decode_list_cursor).transpose()?;
    let mut jobs = store::jobs::list(pool, caller, state, after, i64::from(limit) + 1).await?;
    let next_cursor = if jobs.len() > limit as usize {
        jobs.truncate(limit as usize);
        jobs.last().map(|j| encode_list_cursor(j.created_at, j.id))
    } else {
        None
    };
    Ok(Page { jobs, next_cursor })
}

fn encode_list_cursor(at: OffsetDateTime, id: Uuid) -> String {
    let micros = at.unix_timestamp_nanos() / 1000;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{micros}/{id}"))
}

fn decode_list_cursor(cursor: &str) -> Result<(OffsetDateTime, Uuid), ExportError> {
    let invalid =
        || ExportError::InvalidField { field: "cursor".into(), detail: "not a cursor from this listing".into() };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(cursor).map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let (micros, id) = text.split_once('/').ok_or_else(invalid)?;
    let micros: i128 = micros.parse().map_err(|_| invalid())?;
    let at = OffsetDateTime::from_unix_timestamp_nanos(micros * 1000).map_err(|_| invalid())?;
    Ok((at, id.parse().map_err(|_| invalid())?))
}

/// What a cancel request did.
pub enum Cancel {
    /// QUEUED or RUNNING became CANCEL_REQUESTED.
    Requested(ExportJob),
    /// Already CANCEL_REQUESTED or CANCELLED: nothing changed.
    AlreadyCancelling(ExportJob),
}

pub async fn cancel(pool: &PgPool, caller: &Caller, id: Uuid) -> Result<Cancel, ExportError> {
    let mut tx = pool.begin().await?;
    let job = store::jobs::lock(&mut tx, caller, id).await?.ok_or(ExportError::NotFound)?;
    match job.state {
        ExportState::Queued | ExportState::Running => {
            let job = store::jobs::request_cancel(&mut tx, id).await?.ok_or(ExportError::NotFound)?;
            tx.commit().await?;
            Ok(Cancel::Requested(job))
        }
        ExportState::CancelRequested | ExportState::Cancelled => Ok(Cancel::AlreadyCancelling(job)),
        terminal => Err(ExportError::AlreadyTerminal(terminal)),
    }
}

/// What a revoke did.
pub enum Revoke {
    Revoked(ExportJob),
    AlreadyRevoked(ExportJob),
}

/// SUCCEEDED → REVOKED, then the files are deleted. Downloads answer 410 from the commit on.
pub async fn revoke(
    pool: &PgPool,
    store: &crate::storage::ArtifactStore,
    caller: &Caller,
    id: Uuid,
) -> Result<Revoke, ExportError> {
    let revoked = store::jobs::revoke(pool, caller.tenant.id.as_str(), id).await?;
    let Some(job) = revoked else {
        let job = get(pool, caller, id).await?;
        return match job.state {
            ExportState::Revoked => Ok(Revoke::AlreadyRevoked(job)),
            other => Err(ExportError::NotRevocable(other)),
        };
    };
    // Failing here leaves the files to the cleaner, which deletes the files of every REVOKED job.
    if let Err(e) = delete_files(pool, store, &job.tenant, job.id, "revoked").await {
        tracing::error!(export = %job.id, error = format!("{e:#}"), "revoked, but deleting files failed; the cleaner will retry");
    }
    Ok(Revoke::Revoked(job))
}

/// Whether the caller may be served `job`'s files and manifest: published, and cut with the
/// view the caller still has.
pub fn ensure_published(caller: &Caller, job: &ExportJob) -> Result<(), ExportError> {
    ensure_same_view(caller, job)?;
    match job.state {
        ExportState::Succeeded => Ok(()),
        ExportState::Queued | ExportState::Running | ExportState::CancelRequested => {
            Err(ExportError::NotPublished(job.state))
        }
        gone => Err(ExportError::Gone(gone)),
    }
}

/// The published manifest bytes and their sha256.
pub async fn manifest(pool: &PgPool, caller: &Caller, id: Uuid) -> Result<(Vec<u8>, String), ExportError> {
    ensure_published(caller, &get(pool, caller, id).await?)?;
    let Some((bytes, sha256)) = store::jobs::manifest(pool, id).await? else {
        // Revoked or expired since the read above.
        return Err(ExportError::Gone(get(pool, caller, id).await?.state));
    };
    Ok((bytes, sha256))
}

/// A partner's files and manifest were cut with the row filter and column policy it had then;
/// once either changed they are no longer what it may see (keys, totals, checksums included).
pub fn ensure_same_view(caller: &Caller, job: &ExportJob) -> Result<(), ExportError> {
    if caller.principal.is_admin() {
        return Ok(());
    }
    // A dataset the tenant no longer exposes serves nothing: its exports look missing.
    let Ok(view) = ServedView::exposed(&caller.tenant, &caller.principal, &job.dataset) else {
        return Err(ExportError::NotFound);
    };
    view.check_cut(&job.row_filter, job.column_policy.as_deref()).map_err(|changed| match changed {
        ViewChanged::RowFilter => ExportError::RowFilterChanged,
        ViewChanged::ColumnPolicy => ExportError::ColumnPolicyChanged,
    })
}

/// Deletes the export's files (storage records what was reclaimed and why), then marks them gone
/// so they no longer count towards the tenant's stored bytes. Idempotent.
pub async fn delete_files(
    pool: &PgPool,
    store: &crate::storage::ArtifactStore,
    tenant: &str,
    id: Uuid,
    reason: &str,
) -> anyhow::Result<(u64, u64)> {
    let deleted = crate::storage::lifecycle::delete_export_files(pool, store, tenant, id, reason).await?;
    store::jobs::mark_files_deleted(pool, id).await?;
    Ok(deleted)
}

/// Tells the history collector which snapshots and windows exports still read.
pub struct HistoryReaders<'a>(pub &'a PgPool);

impl crate::feeds::gc::Readers for HistoryReaders<'_> {
    async fn live_snapshots(&self, tenant: &str) -> sqlx::Result<Vec<String>> {
        store::facts::live_snapshots(self.0, tenant).await
    }

    async fn incremental_unfinished(&self, tenant: &str) -> sqlx::Result<bool> {
        store::facts::incremental_unfinished(self.0, tenant).await
    }
}

/// Tells storage's orphan sweep which files exports still need.
pub struct FileOwner<'a>(pub &'a PgPool);

impl crate::storage::lifecycle::Owner for FileOwner<'_> {
    async fn in_use(&self, tenant: &str, id: Uuid) -> sqlx::Result<Option<crate::storage::lifecycle::InUse>> {
        let Some(state) = store::jobs::state(self.0, tenant, id).await? else { return Ok(None) };
        let mut referenced = store::shards::object_keys(self.0, id).await?;
        referenced.extend(crate::sharing::changes::of_export(self.0, id).await?.map(|c| c.object_key));
        let writing = if state.is_terminal() {
            Default::default()
        } else {
            let mut writing = store::shards::attempts_being_written(self.0, id).await?;
            // A table version's change file is written just before it publishes.
            writing.insert(crate::sharing::changes::CHANGES_DIR.to_owned());
            writing
        };
        Ok(Some(crate::storage::lifecycle::InUse { referenced, writing }))
    }

    async fn published(&self) -> sqlx::Result<Vec<(String, Uuid, String)>> {
        store::shards::published_object_keys(self.0).await
    }
}

impl From<crate::attach::Incomplete> for ExportError {
    fn from(incomplete: crate::attach::Incomplete) -> Self {
        match incomplete {
            crate::attach::Incomplete::Backfilling => ExportError::BackfillRunning,
            crate::attach::Incomplete::Lost => ExportError::CaptureLost,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_keys_are_visible_ascii() {
        assert!(IdempotencyKey::parse("a").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        for bad in ["", "has space", "tab\t", "é", &"k".repeat(256)] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn list_cursors_round_trip_and_reject_garbage() {
        let at = OffsetDateTime::from_unix_timestamp_nanos(1_764_500_000_123_456_000).unwrap();
        let id = Uuid::new_v4();
        assert_eq!(decode_list_cursor(&encode_list_cursor(at, id)).unwrap(), (at, id));
        assert!(decode_list_cursor("garbage!").is_err());
        assert!(decode_list_cursor("Zm9v").is_err());
    }
}
