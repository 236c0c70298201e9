//! Checkpointed shard files (`export_shards`, written by [`super::lease::record_shard`]) and
//! which files a job still needs.

use std::collections::HashSet;

use sqlx::PgPool;
use uuid::Uuid;

use crate::auth::Caller;
use crate::exports::ShardRecord;

/// `SELECT <every column of a checkpoint> FROM export_shards s <rest>` as a [`ShardRecord`] query.
macro_rules! shard_query {
    ($rest:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            ShardRecord,
            r#"SELECT s.shard_index, s.first_key, s.last_key, s.rows, s.bytes, s.sha256, s.object_key,
                    s.head_bytes, s.head_crc32, s.head_raw_bytes, s.body_bytes, s.body_crc32, s.body_raw_bytes,
                    s.stats AS "stats: sqlx::types::Json<Vec<crate::writers::ColumnStats>>"
               FROM export_shards s "# + $rest
            $(, $arg)*
        )
    };
}

/// The checkpointed shards of an export, in order.
pub async fn all(pool: &PgPool, export_id: Uuid) -> sqlx::Result<Vec<ShardRecord>> {
    shard_query!("WHERE s.export_id = $1 ORDER BY s.shard_index", export_id).fetch_all(pool).await
}

/// [`all`], if the export is one `caller` may see (else none, as for an export that does not
/// exist): a download asks for them together with the job, before it knows it may see the job.
pub async fn visible(pool: &PgPool, caller: &Caller, export_id: Uuid) -> sqlx::Result<Vec<ShardRecord>> {
    shard_query!(
        "JOIN export_jobs j ON j.id = s.export_id
         WHERE s.export_id = $1 AND j.tenant = $2 AND ($3 OR j.principal = $4) ORDER BY s.shard_index",
        export_id,
        caller.tenant.id.as_str(),
        caller.principal.is_admin(),
        caller.principal.id.as_str(),
    )
    .fetch_all(pool)
    .await
}

/// The export's last checkpoint, if any (where its next shard starts): one index probe.
pub async fn last(pool: &PgPool, export_id: Uuid) -> sqlx::Result<Option<ShardRecord>> {
    shard_query!("WHERE s.export_id = $1 ORDER BY s.shard_index DESC LIMIT 1", export_id).fetch_optional(pool).await
}

/// The object keys the export's checkpoints point at.
pub async fn object_keys(pool: &PgPool, export_id: Uuid) -> sqlx::Result<HashSet<String>> {
    let keys = sqlx::query_scalar!("SELECT object_key FROM export_shards WHERE export_id = $1", export_id)
        .fetch_all(pool)
        .await?;
    Ok(keys.into_iter().collect())
}

/// Every file of every export that downloads serve (published, files not ended with it), its
/// shards and a table version's change file:
/// (tenant, export, object key).
pub async fn published_object_keys(pool: &PgPool) -> sqlx::Result<Vec<(String, Uuid, String)>> {
    let rows = sqlx::query!(
        r#"SELECT j.tenant, j.id, f.object_key AS "object_key!"
           FROM export_jobs j
           JOIN (SELECT export_id, object_key FROM export_shards
                 UNION ALL SELECT export_id, changes_object FROM share_versions WHERE changes_object IS NOT NULL) f
             ON f.export_id = j.id
           WHERE exportd_export_published(j.state) AND NOT exportd_export_ended_without_files(j.state)
             AND j.files_deleted_at IS NULL"#,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.tenant, r.id, r.object_key)).collect())
}

/// The attempt directories (`s{index}-a{attempt}`) of each planned shard's current writer:
/// files being written now.
pub async fn attempts_being_written(pool: &PgPool, export_id: Uuid) -> sqlx::Result<HashSet<String>> {
    let dirs = sqlx::query_scalar!(
        r#"SELECT 's' || shard_index || '-a' || writer_attempt AS "dir!" FROM export_shard_plan WHERE export_id = $1"#,
        export_id,
    )
    .fetch_all(pool)
    .await?;
    Ok(dirs.into_iter().collect())
}
