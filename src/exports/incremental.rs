//! Where an incremental export starts and ends, and the principal's stored cursor.

use sqlx::PgPool;
use time::OffsetDateTime;

use super::{ExportError, ExportSpec};
use crate::auth::Caller;
use crate::feeds::{self, Cursor, CursorError, CursorOwner};
use crate::history::Database;
use crate::links::LinkKeys;
use crate::served::ServedView;

/// What creating an incremental export needs to read and sign cursors.
pub struct FeedContext<'a> {
    pub keys: &'a LinkKeys,
    pub database: &'a Database,
    pub now: OffsetDateTime,
}

pub struct Start {
    /// The start cursor as given (or as stored).
    pub cursor: String,
    pub from: String,
    pub after: Option<String>,
    /// When the start position was taken (unix seconds): where the partner's feed stands.
    pub position_ts: i64,
    /// The newest tick sealed now: the export ends with the window that reaches it.
    pub until_tick: i64,
}

/// The start: `since`, else the principal's stored cursor, else a 400 asking for `since`.
pub async fn start(
    pool: &PgPool,
    caller: &Caller,
    spec: &ExportSpec,
    since: Option<&str>,
    feed: &FeedContext<'_>,
) -> Result<Start, ExportError> {
    let (tenant, principal, dataset) = (caller.tenant.id.as_str(), caller.principal.id.as_str(), spec.dataset.as_str());
    let (text, field) = match since {
        Some(since) => (since.to_owned(), "since"),
        None => {
            let stored = sqlx::query_scalar!(
                "SELECT cursor FROM feed_cursors WHERE tenant = $1 AND principal = $2 AND dataset = $3",
                tenant,
                principal,
                dataset,
            )
            .fetch_optional(pool)
            .await?;
            let stored = stored.ok_or_else(|| ExportError::InvalidCursor {
                field: "since",
                detail: "no stored cursor yet: give `since` (a full export's next_cursor or a feed cursor)".into(),
            })?;
            (stored, "stored cursor")
        }
    };
    let oldest = feed.now.unix_timestamp() - i64::from(caller.tenant.retention.tombstone_days) * 86_400;
    // The spec was validated against this view a moment ago.
    let view =
        ServedView::of(&caller.tenant, &caller.principal, dataset).map_err(|_| ExportError::DatasetNotGranted)?;
    let row_filter = view.row_filter();
    let owner = CursorOwner::of((tenant, principal), &view, feed.database, &row_filter);
    let cursor = Cursor::open(pool, feed.keys, &text, &owner, oldest, feed.now).await?.map_err(|e| match e {
        CursorError::Invalid | CursorError::UnknownKey(_) => {
            ExportError::InvalidCursor { field: "since", detail: format!("{field}: {e}") }
        }
        CursorError::Expired => ExportError::CursorExpired(e.to_string()),
        CursorError::LostInFailover { .. } | CursorError::HistoryUnreadable(_) => ExportError::CursorHistory(e),
    })?;
    let until_tick =
        feeds::newest_sealed_tick(pool, feed.now, caller.tenant.feeds.safety_delay_seconds).await?.unwrap_or(0);
    Ok(Start { cursor: text, from: cursor.from, after: cursor.after, position_ts: cursor.ts, until_tick })
}

/// Sets the principal's stored cursor for a dataset (inside the publishing transaction).
pub async fn store_cursor(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
    principal: &str,
    dataset: &str,
    cursor: &str,
) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO feed_cursors (tenant, principal, dataset, cursor) VALUES ($1, $2, $3, $4)
         ON CONFLICT ON CONSTRAINT feed_cursors_pkey DO UPDATE SET cursor = EXCLUDED.cursor, updated_at = now()",
        tenant,
        principal,
        dataset,
        cursor,
    )
    .execute(tx)
    .await?;
    Ok(())
}
