//! `GET /v1/attachments`: the attached host tables that feed the tenant's datasets, with their
//! backfill progress, for tenant admins.

use axum::extract::State;
use serde::Serialize;
use time::OffsetDateTime;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::state::AppState;
use crate::auth::Caller;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_attachments))
}

#[derive(Serialize, ToSchema)]
pub struct AttachmentList {
    attachments: Vec<AttachmentView>,
}

/// One attachment as the tenant sees it (the host's table name is the host's business).
#[derive(Serialize, ToSchema)]
pub struct AttachmentView {
    dataset: String,
    /// `log` (followed from the host's write-ahead log) or `trigger`.
    capture: String,
    /// `backfilling` (exports and feeds of the dataset answer 409 `backfill-running`), `live`,
    /// or `lost` (log capture: the host dropped the slot; 409 `capture-lost` until resynced).
    state: String,
    /// Why it is `lost`.
    lost_reason: Option<String>,
    /// Log capture: bytes of WAL the host keeps for the slot, and how far the records trail the
    /// host's WAL, when last looked.
    retained_wal_bytes: Option<i64>,
    lag_bytes: Option<i64>,
    /// Log capture: the follower's last failure, until it applies again.
    last_error: Option<String>,
    /// Host rows the dataset refused (never the values): kept out of exports and feeds.
    quarantined: i64,
    /// Rows of the host table the backfill has read, of the estimate at attach time.
    rows_done: i64,
    rows_estimate: i64,
    /// Rows the backfill wrote (the rest were newer from the trigger, or already the same).
    rows_written: i64,
    /// Seconds left at the backfill's average rate so far (while backfilling).
    eta_seconds: Option<i64>,
    #[serde(with = "time::serde::rfc3339")]
    attached_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    updated_at: OffsetDateTime,
}

/// The attachments feeding the caller's tenant.
#[utoipa::path(get, path = "/v1/attachments", tag = "attachments", security(("bearer" = [])),
    responses((status = 200, body = AttachmentList), (status = 403, description = "not a tenant admin")))]
async fn list_attachments(State(state): State<AppState>, caller: Caller) -> ApiResult<axum::Json<AttachmentList>> {
    if !caller.principal.is_admin() {
        return Err(ApiError::forbidden("only tenant admins can see attached tables"));
    }
    let attachments = crate::attach::of_tenant(&state.pool, caller.tenant.id.as_str())
        .await?
        .into_iter()
        .map(|a| {
            let eta_seconds = (a.state == "backfilling").then(|| a.eta()).flatten().map(|d| d.as_secs() as i64);
            AttachmentView {
                dataset: a.dataset,
                capture: a.capture,
                state: a.state,
                lost_reason: a.lost_reason,
                retained_wal_bytes: a.retained_bytes,
                lag_bytes: a.lag_bytes,
                last_error: a.last_error,
                quarantined: a.quarantined,
                rows_done: a.rows_done,
                rows_estimate: a.rows_estimate,
                rows_written: a.rows_written,
                eta_seconds,
                attached_at: a.created_at,
                updated_at: a.updated_at,
            }
        })
        .collect();
    Ok(axum::Json(AttachmentList { attachments }))
}
