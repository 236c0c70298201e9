//! The backfill of an attachment: the rows that were in the host table before its trigger, copied
//! into the record store in key order, in small batches, while the host keeps writing.
//!
//! Each batch reads its rows and its snapshot in one statement and writes each row through
//! `exportd_backfill_write`, which skips a key the trigger wrote after that snapshot (its state
//! is newer) — so a row updated or deleted during the backfill ends as the table has it. Batches
//! take no lock on the host's rows; a batch that would wait on a host writer's record lock gives
//! up at once (`lock_timeout`) and is tried again, so the host never waits on the backfill for
//! longer than one batch's writes. Progress is committed with each batch: after a crash or a
//! kill the backfill goes on from the last batch.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use governor::{Quota, RateLimiter};
use sqlx::{PgPool, Row};

use super::resolve::{self, Resolved};
use super::{Attachment, sql};
use crate::tenants::Registry;

#[derive(Debug, Clone, Copy)]
pub struct BackfillOptions {
    /// Rows per batch (one transaction each).
    pub batch_rows: u32,
    /// Rows per second at most.
    pub rows_per_second: NonZeroU32,
}

impl Default for BackfillOptions {
    fn default() -> Self {
        BackfillOptions { batch_rows: 500, rows_per_second: NonZeroU32::new(20_000).expect("non-zero") }
    }
}

/// Where a backfill stands.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    pub rows_done: i64,
    /// Rows written (the rest were skipped: newer, or already the same).
    pub rows_written: i64,
    pub rows_estimate: i64,
    pub finished: bool,
}

/// A batch that waits this long on a record lock (a host writer of the same key) gives up.
const LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '100ms'";

/// Runs (or resumes) a trigger attachment's backfill to its end; `report` is called after each batch.
pub async fn backfill(
    pool: &PgPool,
    registry: &Registry,
    attachment: &Attachment,
    options: BackfillOptions,
    mut report: impl FnMut(&Progress),
) -> anyhow::Result<Progress> {
    let resolved = resolve::resolve(pool, pool, registry, &attachment.spec, resolve::Evaluated::OnTheTable).await?;
    let statement = sql::backfill_batch(&resolved);
    let limiter = RateLimiter::direct(Quota::per_second(options.rows_per_second));
    let mut retries = 0u32;
    loop {
        match batch(pool, attachment.id, &resolved, &statement, options.batch_rows).await {
            Ok(progress) => {
                retries = 0;
                report(&progress);
                if progress.finished {
                    // A backfill is a burst of history autovacuum has not analyzed yet: without
                    // statistics the feed's page query picks plans that take seconds per page.
                    sqlx::raw_sql("ANALYZE record_versions, record_heads").execute(pool).await?;
                    return Ok(progress);
                }
                let rows = NonZeroU32::new(options.batch_rows.min(options.rows_per_second.get())).expect("non-zero");
                let _ = limiter.until_n_ready(rows).await;
            }
            // A host writer held a key the batch needed: it is rolled back and tried again.
            Err(e) if is_lock_timeout(&e) && retries < 1000 => {
                retries += 1;
                tokio::time::sleep(Duration::from_millis(20 * u64::from(retries.min(25)))).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).is_some_and(|c| c == "55P03" || c == "40P01")
}

/// One batch in one transaction: the attachment's row locked (concurrent backfills take turns),
/// the rows after its position read and written, the position and counts advanced.
async fn batch(pool: &PgPool, id: i64, resolved: &Resolved, statement: &str, limit: u32) -> sqlx::Result<Progress> {
    let started = Instant::now();
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(LOCK_TIMEOUT).execute(&mut *tx).await?;
    let at = sqlx::query!("SELECT backfill_after, state FROM attachments WHERE id = $1 FOR UPDATE", id)
        .fetch_optional(&mut *tx)
        .await?;
    let Some(at) = at else {
        return Err(sqlx::Error::Protocol("the attachment was detached during its backfill".into()));
    };
    let after = at.backfill_after;
    if at.state != "backfilling" {
        tx.rollback().await?;
        return progress(pool, id).await;
    }
    let rows: Vec<sqlx::postgres::PgRow> = sqlx::query(sqlx::AssertSqlSafe(statement.to_owned()))
        .bind(&after)
        .bind(i64::from(limit))
        .fetch(&mut *tx)
        .try_collect()
        .await?;
    let mut written = 0i64;
    for row in &rows {
        let tenant: Option<String> = row.try_get("tenant")?;
        let Some(tenant) = tenant else { continue };
        let (key, data, snapshot): (String, serde_json::Value, String) =
            (row.try_get("key")?, row.try_get("data")?, row.try_get("snapshot")?);
        let wrote = sqlx::query_scalar!(
            r#"SELECT exportd_backfill_write($1, $2, $3, $4, $5::text::pg_snapshot) AS "wrote!""#,
            tenant,
            resolved.dataset,
            key,
            data,
            snapshot,
        )
        .fetch_one(&mut *tx)
        .await?;
        written += i64::from(wrote);
    }
    let position: Option<Vec<String>> = rows.last().map(|r| r.try_get("position")).transpose()?;
    let finished = rows.len() < limit as usize;
    advance(&mut tx, id, position.as_deref(), rows.len() as i64, written, finished).await?;
    tx.commit().await?;
    tracing::debug!(
        attachment = id,
        rows = rows.len(),
        written,
        ms = started.elapsed().as_millis() as u64,
        "backfill batch"
    );
    progress(pool, id).await
}

/// Records a batch of the first copy (either capture): the key position reached, rows read and
/// written, and `live` once it was the last.
pub(crate) async fn advance(
    conn: &mut sqlx::PgConnection,
    id: i64,
    position: Option<&[String]>,
    rows: i64,
    written: i64,
    finished: bool,
) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE attachments SET backfill_after = coalesce($2, backfill_after), rows_done = rows_done + $3,
             rows_written = rows_written + $4, updated_at = now(),
             state = CASE WHEN $5 THEN 'live' ELSE state END,
             finished_at = CASE WHEN $5 THEN now() END
         WHERE id = $1",
        id,
        position,
        rows,
        written,
        finished,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(crate) async fn progress(pool: &PgPool, id: i64) -> sqlx::Result<Progress> {
    let at = sqlx::query!("SELECT rows_done, rows_written, rows_estimate, state FROM attachments WHERE id = $1", id)
        .fetch_one(pool)
        .await?;
    Ok(Progress {
        rows_done: at.rows_done,
        rows_written: at.rows_written,
        rows_estimate: at.rows_estimate,
        finished: at.state == "live",
    })
}
