//! The copy of a log attachment's host table: the rows there, in key order, in batches, each
//! batch one statement on the host (its rows and its snapshot together) and one transaction in
//! exportd (its images, records and snapshot, and the position reached). Resumable: a kill
//! loses at most the batch in flight, which is read again. The slot exists before the first
//! batch, so every change a batch's snapshot does not see is in the log.

use std::num::NonZeroU32;

use futures_util::TryStreamExt;
use governor::{Quota, RateLimiter};
use sqlx::{PgPool, Row};

use super::images::{self, Image, Op};
use super::{connect, ensure_slot};
use crate::attach::Attachment;
use crate::attach::backfill::{BackfillOptions, Progress, advance, progress};
use crate::attach::resolve::{self, Evaluated, Resolved};
use crate::tenants::Registry;

/// Runs (or resumes) the attachment's copy to its end; `report` is called after each batch.
pub async fn copy(
    pool: &PgPool,
    registry: &Registry,
    attachment: &Attachment,
    options: BackfillOptions,
    mut report: impl FnMut(&Progress),
) -> anyhow::Result<Progress> {
    let source = attachment.spec.source.as_deref().ok_or_else(|| anyhow::anyhow!("a log attachment has a source"))?;
    let host = connect(source, 2).await?;
    let resolved = resolve::resolve(pool, &host, registry, &attachment.spec, Evaluated::OverImages).await?;
    let statement = batch_statement(&resolved);
    let limiter = RateLimiter::direct(Quota::per_second(options.rows_per_second));
    let result = loop {
        let progress = match batch(pool, &host, attachment, &resolved, &statement, options.batch_rows).await {
            Ok(progress) => progress,
            Err(e) => break Err(e),
        };
        report(&progress);
        if progress.finished {
            sqlx::raw_sql("ANALYZE record_versions, record_heads, attachment_rows").execute(pool).await?;
            break Ok(progress);
        }
        let rows = NonZeroU32::new(options.batch_rows.min(options.rows_per_second.get())).expect("non-zero");
        let _ = limiter.until_n_ready(rows).await;
    };
    host.close().await;
    result
}

/// Up to `$2` rows after key position `$1` (NULL: from the start), in key order, each with its
/// key position and its image.
fn batch_statement(r: &Resolved) -> String {
    let key_list: Vec<&str> = r.key.iter().map(|(name, _)| name.as_str()).collect();
    let position: Vec<String> = r.key.iter().map(|(name, _)| format!("({name})::text")).collect();
    let after: Vec<String> =
        r.key.iter().enumerate().map(|(i, (_, ty))| format!("($1::text[])[{}]::{ty}", i + 1)).collect();
    format!(
        "SELECT ARRAY[{position}] AS position, to_jsonb(src) AS image
         FROM {table} AS src
         WHERE $1::text[] IS NULL OR ({keys}) > ({after})
         ORDER BY {keys} LIMIT $2",
        position = position.join(", "),
        table = r.table,
        keys = key_list.join(", "),
        after = after.join(", "),
    )
}

async fn batch(
    pool: &PgPool,
    host: &PgPool,
    attachment: &Attachment,
    resolved: &Resolved,
    statement: &str,
    limit: u32,
) -> anyhow::Result<Progress> {
    let id = attachment.id;
    let mut tx = pool.begin().await?;
    // Concurrent copies of one attachment take turns on its row.
    let at = sqlx::query!(
        "SELECT backfill_after, state, copy_round, slot,
                (SELECT coalesce(max(batch), 0) FROM attachment_copy_batches b
                  WHERE b.attachment = a.id AND b.round = a.copy_round) AS \"batches!\"
         FROM attachments a WHERE id = $1 FOR UPDATE",
        id
    )
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| anyhow::anyhow!("the attachment was detached during its copy"))?;
    if at.state != "backfilling" {
        tx.rollback().await?;
        return Ok(progress(pool, id).await?);
    }
    let slot = at.slot.ok_or_else(|| anyhow::anyhow!("a log attachment has a slot"))?;
    if at.batches == 0 {
        // A resync's first batch: its new slot, before anything is read.
        ensure_slot(host, &slot, resolved).await?;
    }
    // The batch's snapshot and rows, in one short read-only transaction on the host.
    let mut read = host.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await?;
    let snapshot: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text").fetch_one(&mut *read).await?;
    let rows: Vec<sqlx::postgres::PgRow> = sqlx::query(sqlx::AssertSqlSafe(statement.to_owned()))
        .bind(&at.backfill_after)
        .bind(i64::from(limit))
        .fetch(&mut *read)
        .try_collect()
        .await?;
    read.commit().await?;
    let finished = rows.len() < limit as usize;
    let round = at.copy_round;
    let number = at.batches + 1;
    let position: Option<Vec<String>> = rows.last().map(|r| r.try_get("position")).transpose()?;
    // The range it read: after the last batch's last row, up to its own (the last batch: to
    // the end, where every later row of the host is).
    let last = if finished { None } else { position.clone() };
    sqlx::query!(
        "INSERT INTO attachment_copy_batches (attachment, round, batch, snapshot, after, last)
         VALUES ($1, $2, $3, $4::text::pg_snapshot, $5, $6)",
        id,
        round,
        number,
        snapshot,
        at.backfill_after.as_deref(),
        last.as_deref(),
    )
    .execute(&mut *tx)
    .await?;
    let mut written = 0;
    if !rows.is_empty() {
        let images: Vec<Image> = rows
            .iter()
            .map(|r| r.try_get::<sqlx::types::Json<Image>, _>("image").map(|j| j.0))
            .collect::<Result<_, _>>()?;
        let refs: Vec<&Image> = images.iter().collect();
        let evaluated = images::evaluate(&mut tx, resolved, &refs).await?;
        let keys: Vec<String> = evaluated.iter().map(|e| e.key.clone()).collect();
        let kept = images::kept(&mut tx, id, &keys).await?;
        let ops: Vec<Op> = evaluated
            .into_iter()
            .zip(images)
            .map(|(row, image)| {
                let old = kept.get(&row.key).map(|k| (k.tenant.clone(), row.key.clone()));
                Op::Put { row, image, old, copied: Some((round, number)), lsn: None }
            })
            .collect();
        written += images::apply(&mut tx, id, &resolved.dataset, &ops).await?;
        images::announce_quarantined(&mut tx, id, &resolved.dataset).await?;
    }
    if finished {
        // Rows of an earlier round the host no longer has (a resync's copy) are gone.
        let batches: Vec<i32> = (1..=number).collect();
        written += images::apply(&mut tx, id, &resolved.dataset, &[Op::KeepOnly { round, batches }]).await?;
    }
    advance(&mut tx, id, position.as_deref(), rows.len() as i64, written, finished).await?;
    tx.commit().await?;
    Ok(progress(pool, id).await?)
}
