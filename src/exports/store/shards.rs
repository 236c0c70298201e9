//! Checkpointed shard files (`export_shards`, written by [`super::lease::record_shard`]) and
//! which files a job still needs.

use std::collections::HashSet;

use sqlx::PgPool;
use uuid::Uuid;

use crate::exports::ShardRecord;

/// The checkpointed shards of an export, in order.
pub async fn all(pool: &PgPool, export_id: Uuid) -> sqlx::Result<Vec<ShardRecord>> {
    sqlx::query_as!(
        ShardRecord,
        "SELECT shard_index, first_key, last_key, rows, bytes, sha256, object_key,
                head_bytes, head_crc32, head_raw_bytes, body_bytes, body_crc32, body_raw_bytes
         FROM export_shards WHERE export_id = $1 ORDER BY shard_index",
        export_id,
    )
    .fetch_all(pool)
    .await
}

/// The export's last checkpoint, if any (where its next shard starts): one index probe.
pub async fn last(pool: &PgPool, export_id: Uuid) -> sqlx::Result<Option<ShardRecord>> {
    sqlx::query_as!(
        ShardRecord,
        "SELECT shard_index, first_key, last_key, rows, bytes, sha256, object_key,
                head_bytes, head_crc32, head_raw_bytes, body_bytes, body_crc32, body_raw_bytes
         FROM export_shards WHERE export_id = $1 ORDER BY shard_index DESC LIMIT 1",
        export_id,
    )
    .fetch_optional(pool)
    .await
}

/// The object keys the export's checkpoints point at.
pub async fn object_keys(pool: &PgPool, export_id: Uuid) -> sqlx::Result<HashSet<String>> {
    let keys = sqlx::query_scalar!("SELECT object_key FROM export_shards WHERE export_id = $1", export_id)
        .fetch_all(pool)
        .await?;
    Ok(keys.into_iter().collect())
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
