//! `share_versions`: which published export is which version of a shared table.

use sqlx::{PgPool, Postgres, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use super::changes::ChangeFile;
use crate::history;

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
    #[error(
        "version {asked} was published by history that a database failover lost (the table went on at version {went_on}, on timeline {timeline}): what you read of it may not exist. Read version {went_on} or later as a whole snapshot and take changes from there"
    )]
    LostInFailover { asked: i64, went_on: i64, timeline: i32 },
    #[error(
        "versions {start} to {end} are more than one request spans ({max_versions}): ask up to version {fits} first"
    )]
    TooMany { start: i64, end: i64, max_versions: usize, fits: i64 },
    #[error("the table has no version at or before that timestamp")]
    BeforeFirst,
    #[error("the table has no version at or after that timestamp")]
    AfterLast,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// How many numbers the first version published on a newer timeline skips: more than a lost
/// stretch of history could have published (each version is a full export), so no number the
/// lost history handed out is ever given to another version.
pub const FAILOVER_SKIP: i64 = 1_000_000;

/// The number the next version takes after the table's latest (its number and the timeline it
/// was published on), on timeline `timeline`; and where the numbers it skips start.
fn next_number(latest: Option<(i64, i32)>, timeline: i32) -> (i64, Option<i64>) {
    match latest {
        None => (0, None),
        Some((version, published_on)) if published_on == timeline => (version + 1, None),
        // A failover (or a restore) since the latest version: versions published after it on
        // the old timeline may be lost, and their numbers are not ours to give.
        Some((version, _)) => (version + 1 + FAILOVER_SKIP, Some(version + 1)),
    }
}

/// An export publishing as a table version: a full Parquet export of the whole dataset
/// (`exportd_is_table_version`).
#[derive(Debug)]
pub struct NewVersion<'a> {
    pub tenant: &'a str,
    pub principal: &'a str,
    pub dataset: &'a str,
    pub export_id: Uuid,
    /// When its snapshot was taken: the version's Delta timestamp.
    pub snapshot_at: OffsetDateTime,
}

/// Makes the export of `job`, published in `tx`, the next version of its principal's table when
/// its snapshot is newer than the table's latest version (an export that publishes after a
/// newer one would take the table back in time: it stays an export only). `changes`, written
/// from the version that was latest when its worker looked, is recorded with it if that version
/// is still the one before it. Returns the version.
pub async fn record_version(
    tx: &mut Transaction<'_, Postgres>,
    job: &NewVersion<'_>,
    changes: Option<&ChangeFile>,
) -> sqlx::Result<Option<i64>> {
    // Publications of one table take their numbers one at a time.
    sqlx::query!(
        "SELECT pg_advisory_xact_lock(hashtext('exportd.share_versions'), hashtext($1 || '/' || $2 || '/' || $3))",
        job.tenant,
        job.principal,
        job.dataset,
    )
    .execute(&mut **tx)
    .await?;
    let now = sqlx::query!(
        r#"SELECT exportd_timeline() AS "timeline!", l.version AS "version?", l.timeline AS "published_on?",
                  l.snapshot_at AS "snapshot_at?"
           FROM (SELECT) o LEFT JOIN LATERAL (
               SELECT version, timeline, snapshot_at FROM share_versions
               WHERE tenant = $1 AND principal = $2 AND dataset = $3 ORDER BY version DESC LIMIT 1) l ON true"#,
        job.tenant,
        job.principal,
        job.dataset,
    )
    .fetch_one(&mut **tx)
    .await?;
    if now.snapshot_at.is_some_and(|latest| latest >= job.snapshot_at) {
        return Ok(None);
    }
    let latest = now.version.zip(now.published_on);
    let (number, skipped_from) = next_number(latest, now.timeline);
    let changes = changes.filter(|c| now.version == Some(c.from_version));
    let version = sqlx::query_scalar!(
        "INSERT INTO share_versions (tenant, principal, dataset, version, skipped_from, export_id, snapshot_at,
                                     changes_from, changes_object, changes_rows, changes_bytes, changes_sha256)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
         ON CONFLICT (export_id) DO NOTHING
         RETURNING version",
        job.tenant,
        job.principal,
        job.dataset,
        number,
        skipped_from,
        job.export_id,
        job.snapshot_at,
        changes.map(|c| c.from_version),
        changes.map(|c| c.object_key.clone()),
        changes.map(|c| c.rows),
        changes.map(|c| c.bytes),
        changes.map(|c| c.sha256.clone()),
    )
    .fetch_optional(&mut **tx)
    .await?;
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
    if let Which::Number(asked) = which
        && let Some(skip) = skip_holding(pool, (tenant, principal, dataset), asked).await?
    {
        refuse_lost(pool, (tenant, principal, dataset), asked, skip).await?;
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

/// The skip `number` lies in, if a failover skipped it (see [`FAILOVER_SKIP`]): the version that
/// ended the skip and its timeline.
async fn skip_holding(
    pool: &PgPool,
    (tenant, principal, dataset): (&str, &str, &str),
    number: i64,
) -> sqlx::Result<Option<(i64, i32)>> {
    let skip = sqlx::query!(
        "SELECT version, timeline FROM share_versions
         WHERE tenant = $1 AND principal = $2 AND dataset = $3 AND skipped_from <= $4 AND version > $4",
        tenant,
        principal,
        dataset,
        number,
    )
    .fetch_optional(pool)
    .await?;
    Ok(skip.map(|s| (s.version, s.timeline)))
}

/// Refuses `asked` for the skip that ended at `went_on`; the refusal is counted with the
/// feed's (`failover_refusals`, `feed.history_lost`).
async fn refuse_lost(
    pool: &PgPool,
    table: (&str, &str, &str),
    asked: i64,
    (went_on, timeline): (i64, i32),
) -> Result<std::convert::Infallible, VersionError> {
    history::count_refusal(pool, table, timeline, OffsetDateTime::now_utc()).await?;
    Err(VersionError::LostInFailover { asked, went_on, timeline })
}

/// What a change request from `start` to `end` reads: the version before `start` (none for 0)
/// and then those in `start..=end`, oldest first — at most `max_versions` of them, or
/// [`VersionError::TooMany`] naming the last ending version that fits. A client that asks from
/// `start` has read the version `start - 1`; when that number is one a failover skipped past its
/// first, what it read is refused ([`VersionError::LostInFailover`]). (Asking from the first
/// skipped number means having read the last version kept; asking from the version that ended
/// the skip asks for its own changes, and only a client that learnt its number can.)
pub async fn change_range(
    pool: &PgPool,
    tenant: &str,
    principal: &str,
    dataset: &str,
    (start, end): (i64, i64),
    max_versions: usize,
) -> Result<Vec<ShareVersion>, VersionError> {
    if start > 0
        && let Some(skip) = skip_holding(pool, (tenant, principal, dataset), start - 1).await?
        && skip.0 != start
    {
        refuse_lost(pool, (tenant, principal, dataset), start - 1, skip).await?;
    }
    let versions = sqlx::query_as!(
        ShareVersion,
        "SELECT version, export_id, snapshot_at, changes_from, changes_object, changes_rows, changes_bytes, changes_sha256
         FROM share_versions
         WHERE tenant = $1 AND principal = $2 AND dataset = $3 AND version <= $5
           AND version >= coalesce((SELECT max(version) FROM share_versions
                                    WHERE tenant = $1 AND principal = $2 AND dataset = $3 AND version < $4), $4)
         ORDER BY version LIMIT $6",
        tenant,
        principal,
        dataset,
        start,
        end,
        max_versions as i64 + 2,
    )
    .fetch_all(pool)
    .await?;
    let asked: Vec<&ShareVersion> = versions.iter().filter(|v| v.version >= start).collect();
    if asked.len() > max_versions {
        return Err(VersionError::TooMany { start, end, max_versions, fits: asked[max_versions - 1].version });
    }
    if asked.is_empty() {
        return Err(VersionError::NoVersion);
    }
    Ok(versions)
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

/// What a version without a change file changed, file by file (by `id`, a file's sha256): the
/// files of the version `before` that it no longer has (their rows are deletes) and its own
/// that `before` did not have (inserts), each in its version's order. Applying both by key to
/// `before` gives `after` exactly.
pub fn file_diff<'a, T>(before: &'a [T], after: &'a [T], id: impl Fn(&T) -> &str) -> (Vec<&'a T>, Vec<&'a T>) {
    let after_ids: std::collections::HashSet<&str> = after.iter().map(&id).collect();
    let before_ids: std::collections::HashSet<&str> = before.iter().map(&id).collect();
    let removed = before.iter().filter(|f| !after_ids.contains(id(f))).collect();
    let added = after.iter().filter(|f| !before_ids.contains(id(f))).collect();
    (removed, added)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_count_on_one_timeline_and_skip_after_a_failover() {
        assert_eq!(next_number(None, 1), (0, None), "the first version");
        assert_eq!(next_number(Some((4, 1)), 1), (5, None));
        assert_eq!(next_number(None, 3), (0, None), "a table first published after a failover");
        let (number, skipped_from) = next_number(Some((4, 1)), 2);
        assert_eq!(skipped_from, Some(5), "the lost history may have published 5 and on");
        assert_eq!(number, 5 + FAILOVER_SKIP);
        assert_eq!(next_number(Some((number, 2)), 2), (number + 1, None), "and counts on from there");
    }

    #[test]
    fn a_version_without_a_change_file_removes_what_it_lost_and_adds_what_is_new() {
        let files = |ids: &[&str]| ids.iter().map(|id| id.to_string()).collect::<Vec<_>>();
        let (before, after) = (files(&["a", "b", "c"]), files(&["b", "d", "c", "e"]));
        let (removed, added) = file_diff(&before, &after, String::as_str);
        assert_eq!((removed, added), (vec![&before[0]], vec![&after[1], &after[3]]));
        let same = files(&["a"]);
        let (removed, added) = file_diff(&same, &same, String::as_str);
        assert!(removed.is_empty() && added.is_empty(), "an unchanged file is neither");
        let (removed, added) = file_diff(&[], &after, String::as_str);
        assert_eq!((removed.len(), added.len()), (0, 4));
    }
}
