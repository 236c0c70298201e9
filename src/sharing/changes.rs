//! Change files: what a table version changed since the version before it, row by row — the
//! protocol's `cdf` files, with `_change_type` `insert`, `update_preimage`, `update_postimage`
//! or `delete`.
//!
//! They come from the record history, like the incremental feed: every key whose live version
//! differs between the two versions' snapshots, with its row as the partner saw it at each end
//! (the row filter applied at each end, so a row that moved out of the filter is a `delete`);
//! a key whose two rows the partner is served alike (only a value it is not served changed)
//! is no change.
//! Before-images are exact (the history holds them), so updates come as a pre- and a
//! post-image, and a delete carries the row it removes. Rows are in key order and written with
//! the version's own file spec (columns, masking, pins), so a change file's bytes depend only on
//! the two snapshots: a worker that takes over from a crashed one writes the same bytes.

use crate::records::KeyOrder;
use futures_util::stream::BoxStream;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::records::Record;
use crate::storage::ObjectKey;
use crate::writers::{OutputColumn, ServedComparer, ShardSpec};

/// The column a change file adds to the table's columns.
pub const CHANGE_TYPE_COLUMN: &str = "_change_type";

/// A change file: written by the worker publishing its version, recorded with the version.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeFile {
    /// The version it starts from (the new version is the next one).
    pub from_version: i64,
    pub object_key: String,
    pub rows: i64,
    pub bytes: i64,
    pub sha256: String,
}

/// The version a new version's changes start from: the table's latest version, when the new one
/// will follow it and both were cut the same way.
#[derive(Debug, Clone, PartialEq)]
pub struct Predecessor {
    pub version: i64,
    /// Its export's snapshot.
    pub watermark: String,
}

/// Where the change file of export `export_id` from version `from` lives: in the export's own
/// directory (it goes with the export's files), under a name fixed by its content's inputs, so a
/// retry overwrites it with the same bytes.
pub fn object_key(tenant: &str, export_id: Uuid, from: i64) -> ObjectKey {
    ObjectKey::parse(&format!("{tenant}/{export_id}/{CHANGES_DIR}/from-v{from}.parquet"))
        .expect("built from valid parts")
}

/// The directory of an export's change files.
pub const CHANGES_DIR: &str = "changes";

/// A change file's spec: the version's, with `_change_type` after the columns. Every column but
/// the key may be null (a before-image from under an older minor schema may lack one).
pub fn spec(version_spec: &ShardSpec, from: i64) -> ShardSpec {
    let mut spec = version_spec.clone();
    for column in spec.columns.iter_mut().skip(1) {
        column.required = false;
    }
    spec.columns.push(OutputColumn::key(CHANGE_TYPE_COLUMN));
    spec.metadata.push(("exportd.changes_from_version".to_owned(), from.to_string()));
    spec
}

/// One changed key: its row at the earlier snapshot and at the later one, as the partner saw
/// them (absent where it did not exist or did not match the row filter).
#[derive(Debug)]
pub struct KeyChange {
    pub key: String,
    pub before: Option<String>,
    pub after: Option<String>,
}

impl KeyChange {
    /// The change file's rows for this key: none when the partner sees no difference — `served`
    /// compares the two rows as the version's files serve them, so a change only to a value the
    /// partner is not served (dropped, nulled, truncated away) is no change.
    pub fn rows(self, served: &mut ServedComparer) -> std::io::Result<Vec<Record>> {
        let row = |kind: &str, data: &str| Record { key: self.key.clone(), data: with_change_type(kind, data) };
        Ok(match (self.before.as_deref(), self.after.as_deref()) {
            (None, None) => vec![],
            (None, Some(after)) => vec![row("insert", after)],
            (Some(before), None) => vec![row("delete", before)],
            (Some(before), Some(after)) if before == after || served.alike(before, after)? => vec![],
            (Some(before), Some(after)) => vec![row("update_preimage", before), row("update_postimage", after)],
        })
    }
}

/// The record's JSON object with `_change_type` first.
fn with_change_type(kind: &str, data: &str) -> String {
    crate::records::with_leading_field(CHANGE_TYPE_COLUMN, kind, data)
}

/// Every key of `dataset` whose live version at snapshot `to` was written by a transaction that
/// `from` does not see, in `order`, with its rows at both ends under `row_filter`. One
/// statement, streamed on `conn`: PostgreSQL sorts the changed keys (spilling to disk if it
/// must), so memory stays flat for any number of changes. The changed versions are found by
/// their writers' xids as window cuts find them (see `feeds::window`).
pub fn key_changes<'c>(
    conn: &'c mut sqlx::PgConnection,
    tenant: &'c str,
    dataset: &'c str,
    from: &'c str,
    to: &'c str,
    row_filter: &'c Value,
    order: KeyOrder<'c>,
) -> BoxStream<'c, sqlx::Result<KeyChange>> {
    // A key order hashes nothing: every key's hash is NULL, and the key decides.
    let pads = match order {
        KeyOrder::Key => None,
        KeyOrder::Hashed(hasher) => Some(hasher.pads()),
    };
    sqlx::query_as!(
        KeyChange,
        r#"WITH bounds AS (SELECT $3::text::pg_snapshot AS a, $4::text::pg_snapshot AS b),
           changed AS (
               SELECT v.key, v.data, v.created_xid, v.closed_xid FROM record_versions v, bounds
               WHERE v.tenant = $1 AND v.dataset = $2
                 AND v.created_xid >= pg_snapshot_xmax(bounds.a) AND v.created_xid < pg_snapshot_xmax(bounds.b)
               UNION ALL
               SELECT v.key, v.data, v.created_xid, v.closed_xid
               FROM record_versions v, bounds, pg_snapshot_xip(bounds.a) AS running(xid)
               WHERE v.tenant = $1 AND v.dataset = $2 AND v.created_xid = running.xid)
           SELECT c.key AS "key!", s.data::text AS before, CASE WHEN c.data @> $5 THEN c.data::text END AS after
           FROM changed c CROSS JOIN bounds
           LEFT JOIN LATERAL (
               SELECT v.data FROM record_versions v
               WHERE v.tenant = $1 AND v.dataset = $2 AND v.key = c.key AND v.data IS NOT NULL AND v.data @> $5
                 AND exportd_live_at(v.created_xid, v.closed_xid, bounds.a)
               LIMIT 1) s ON true
           WHERE exportd_live_at(c.created_xid, c.closed_xid, bounds.b)
             AND NOT pg_visible_in_snapshot(c.created_xid, bounds.a)
           ORDER BY exportd_keyed_hash(c.key, $6, $7), c.key"#,
        tenant,
        dataset,
        from,
        to,
        row_filter,
        pads.map(|p| &p.inner),
        pads.map(|p| &p.outer),
    )
    .fetch(conn)
}

/// The change file recorded with the version that export `export_id` is, if any.
pub async fn of_export(pool: &PgPool, export_id: Uuid) -> sqlx::Result<Option<ChangeFile>> {
    sqlx::query_as!(
        ChangeFile,
        r#"SELECT changes_from AS "from_version!", changes_object AS "object_key!", changes_rows AS "rows!",
                  changes_bytes AS "bytes!", changes_sha256 AS "sha256!"
           FROM share_versions WHERE export_id = $1 AND changes_from IS NOT NULL"#,
        export_id,
    )
    .fetch_optional(pool)
    .await
}
