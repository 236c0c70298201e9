//! `share_versions`: which published export is which version of a shared table.

use sqlx::{PgPool, Postgres, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use super::changes::ChangeFile;

/// One version of a principal's table.
#[derive(Debug, Clone, PartialEq)]
pub struct ShareVersion {
    pub version: i64,
    pub export_id: Uuid,
    /// When the export's snapshot was taken: the version's Delta timestamp.
    pub snapshot_at: OffsetDateTime,
    /// Its change file's columns (see [`ShareVersion::change_file`]).
    pub changes_from: Option<i64>,
    pub changes_object: Option<String>,
    pub changes_rows: Option<i64>,
    pub changes_bytes: Option<i64>,
    pub changes_sha256: Option<String>,
}

impl ShareVersion {
    /// What the version changed since the one before, row by row, if that was written.
    pub fn change_file(&self) -> Option<ChangeFile> {
        Some(ChangeFile {
            from_version: self.changes_from?,
            object_key: self.changes_object.clone()?,
            rows: self.changes_rows?,
            bytes: self.changes_bytes?,
            sha256: self.changes_sha256.clone()?,
        })
    }
}

/// Which version a request asks for.
#[derive(Debug, Clone, Copy)]
pub enum Which {
    Latest,
    Number(i64),
    /// The newest version whose snapshot is at or before this time.
    AsOf(OffsetDateTime),
}

#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    #[error(
        "no version of this table is published yet: a full Parquet export of the whole dataset (POST /v1/exports) becomes its next version"
    )]
    NoVersion,
    #[error("version {asked} does not exist: the table's latest version is {latest}")]
    Beyond { asked: i64, latest: i64 },
    #[error("the table has no version at or before that timestamp")]
    BeforeFirst,
    #[error("the table has no version at or after that timestamp")]
    AfterLast,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Makes the export `export_id`, published in `tx`, the next version of its principal's table
/// when it is one (`exportd_is_table_version`) whose snapshot is newer than the table's latest
/// version (an export that publishes after a newer one would take the table back in time: it
/// stays an export only). `changes`, written from the version that was latest when its worker
/// looked, is recorded with it if that version is still the one before it. Returns the version.
pub async fn record_version(
    tx: &mut Transaction<'_, Postgres>,
    export_id: Uuid,
    changes: Option<&ChangeFile>,
) -> sqlx::Result<Option<i64>> {
    let job = sqlx::query!(
        "SELECT tenant, principal, dataset, created_at FROM export_jobs
         WHERE id = $1 AND exportd_is_table_version(mode, format, request)",
        export_id,
    )
    .fetch_optional(&mut **tx)
    .await?;
    let Some(job) = job else { return Ok(None) };
    // Publications of one table take their numbers one at a time.
    sqlx::query!(
        "SELECT pg_advisory_xact_lock(hashtext('exportd.share_versions'), hashtext($1 || '/' || $2 || '/' || $3))",
        job.tenant,
        job.principal,
        job.dataset,
    )
    .execute(&mut **tx)
    .await?;
    let version = sqlx::query_scalar!(
        "INSERT INTO share_versions (tenant, principal, dataset, version, export_id, snapshot_at)
         SELECT $1, $2, $3, coalesce(max(version) + 1, 0), $4, $5 FROM share_versions
         WHERE tenant = $1 AND principal = $2 AND dataset = $3
         HAVING coalesce(max(snapshot_at) < $5, true)
         ON CONFLICT (export_id) DO NOTHING
         RETURNING version",
        job.tenant,
        job.principal,
        job.dataset,
        export_id,
        job.created_at,
    )
    .fetch_optional(&mut **tx)
    .await?;
    if let (Some(version), Some(changes)) = (version, changes)
        && version == changes.from_version + 1
    {
        sqlx::query!(
            "UPDATE share_versions SET changes_from = $2, changes_object = $3, changes_rows = $4,
                 changes_bytes = $5, changes_sha256 = $6
             WHERE export_id = $1",
            export_id,
            changes.from_version,
            changes.object_key,
            changes.rows,
            changes.bytes,
            changes.sha256,
        )
        .execute(&mut **tx)
        .await?;
    }
    Ok(version)
}

/// The version `which` names of `dataset` in `principal`'s share.
pub async fn resolve(
    pool: &PgPool,
    tenant: &str,
    principal: &str,
    dataset: &str,
    which: Which,
) -> Result<ShareVersion, VersionError> {
    let (number, as_of) = match which {
        Which::Latest => (None, None),
        Which::Number(n) => (Some(n), None),
        Which::AsOf(at) => (None, Some(at)),
    };
    let found = sqlx::query_as!(
        ShareVersion,
        "SELECT version, export_id, snapshot_at, changes_from, changes_object, changes_rows, changes_bytes, changes_sha256
         FROM share_versions
         WHERE tenant = $1 AND principal = $2 AND dataset = $3
           AND ($4::bigint IS NULL OR version = $4) AND ($5::timestamptz IS NULL OR snapshot_at <= $5)
         ORDER BY version DESC LIMIT 1",
        tenant,
        principal,
        dataset,
        number,
        as_of,
    )
    .fetch_optional(pool)
    .await?;
    if let Some(found) = found {
        return Ok(found);
    }
    let latest = resolve_latest(pool, tenant, principal, dataset).await?;
    Err(match (which, latest) {
        (_, None) => VersionError::NoVersion,
        (Which::Number(asked), Some(latest)) => VersionError::Beyond { asked, latest: latest.version },
        _ => VersionError::BeforeFirst,
    })
}

async fn resolve_latest(
    pool: &PgPool,
    tenant: &str,
    principal: &str,
    dataset: &str,
) -> sqlx::Result<Option<ShareVersion>> {
    sqlx::query_as!(
        ShareVersion,
        "SELECT version, export_id, snapshot_at, changes_from, changes_object, changes_rows, changes_bytes, changes_sha256
         FROM share_versions
         WHERE tenant = $1 AND principal = $2 AND dataset = $3 ORDER BY version DESC LIMIT 1",
        tenant,
        principal,
        dataset,
    )
    .fetch_optional(pool)
    .await
}

/// The versions `from..=to`, oldest first.
pub async fn versions_between(
    pool: &PgPool,
    tenant: &str,
    principal: &str,
    dataset: &str,
    from: i64,
    to: i64,
) -> sqlx::Result<Vec<ShareVersion>> {
    sqlx::query_as!(
        ShareVersion,
        "SELECT version, export_id, snapshot_at, changes_from, changes_object, changes_rows, changes_bytes, changes_sha256
         FROM share_versions
         WHERE tenant = $1 AND principal = $2 AND dataset = $3 AND version BETWEEN $4 AND $5
         ORDER BY version",
        tenant,
        principal,
        dataset,
        from,
        to,
    )
    .fetch_all(pool)
    .await
}

/// The oldest version whose snapshot is at or after `at` (`GET …/version?startingTimestamp=`).
pub async fn version_at_or_after(
    pool: &PgPool,
    tenant: &str,
    principal: &str,
    dataset: &str,
    at: OffsetDateTime,
) -> Result<ShareVersion, VersionError> {
    let found = sqlx::query_as!(
        ShareVersion,
        "SELECT version, export_id, snapshot_at, changes_from, changes_object, changes_rows, changes_bytes, changes_sha256
         FROM share_versions
         WHERE tenant = $1 AND principal = $2 AND dataset = $3 AND snapshot_at >= $4
         ORDER BY version LIMIT 1",
        tenant,
        principal,
        dataset,
        at,
    )
    .fetch_optional(pool)
    .await?;
    match found {
        Some(found) => Ok(found),
        None if resolve_latest(pool, tenant, principal, dataset).await?.is_none() => Err(VersionError::NoVersion),
        None => Err(VersionError::AfterLast),
    }
}
