//! `GET /v1/usage` and `GET /v1/usage/history`: the tenant's limits next to its usage, now and
//! over time, for tenant admins.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::extract::Query;
use super::state::AppState;
use crate::auth::Caller;
use crate::usage::history::{self, Granularity, Point};
use crate::usage::{self, Usage};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(usage)).routes(routes!(usage_history))
}

/// Every limit of the tenant next to its current usage, queue depth and ages.
#[utoipa::path(get, path = "/v1/usage", tag = "quotas", security(("bearer" = [])),
    responses((status = 200, body = Usage), (status = 403, description = "not a tenant admin")))]
async fn usage(State(state): State<AppState>, caller: Caller) -> ApiResult<axum::Json<Usage>> {
    if !caller.principal.is_admin() {
        return Err(ApiError::forbidden("only tenant admins can read usage"));
    }
    Ok(axum::Json(tenant_usage(&state, &caller.tenant).await?))
}

/// The usage report, with the refusals this process counted and has not flushed yet.
pub(super) async fn tenant_usage(state: &AppState, tenant: &crate::tenants::Tenant) -> sqlx::Result<Usage> {
    usage::usage(&state.pool, tenant, &state.limits.refusals, state.clock.now()).await
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct HistoryParams {
    /// RFC 3339; rounded down to its bucket (default: 30 days or 24 hours before `to`). From
    /// `from` to `to` spans at most 400 days (`day`) or 744 hours (`hour`): a longer span is
    /// refused with 400 naming `from`.
    #[param(value_type = Option<String>, format = DateTime)]
    from: Option<String>,
    /// RFC 3339, excluded; rounded up to a bucket boundary (default: the end of the current bucket).
    #[param(value_type = Option<String>, format = DateTime)]
    to: Option<String>,
    /// `day` (default; at most 400 buckets) or `hour` (at most 744: 31 days).
    #[param(pattern = "^(hour|day)$")]
    granularity: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct History {
    tenant: String,
    granularity: Granularity,
    #[serde(with = "time::serde::rfc3339")]
    from: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    to: OffsetDateTime,
    /// The limits the series are drawn against (today's: limits have no history).
    limits: HistoryLimits,
    /// Every bucket from `from` to `to`, oldest first; zeros where nothing happened.
    points: Vec<Point>,
}

#[derive(Serialize, ToSchema)]
pub struct HistoryLimits {
    storage_bytes: u64,
    egress_bytes_per_day: u64,
    max_queued_exports: u32,
    max_running_exports: u32,
}

/// The tenant's usage per UTC hour or day: egress, rows exported, exports by outcome and their
/// durations, refusals by kind, the highest stored bytes and queue seen. Kept 90 days.
#[utoipa::path(get, path = "/v1/usage/history", tag = "quotas", security(("bearer" = [])),
    params(HistoryParams),
    responses((status = 200, body = History), (status = 400, description = "bad from, to or granularity (`field` names it)"),
        (status = 403, description = "not a tenant admin")))]
async fn usage_history(
    State(state): State<AppState>,
    caller: Caller,
    Query(params): Query<HistoryParams>,
) -> ApiResult<axum::Json<History>> {
    if !caller.principal.is_admin() {
        return Err(ApiError::forbidden("only tenant admins can read usage"));
    }
    let granularity = match params.granularity.as_deref() {
        None => Granularity::Day,
        Some(text) => {
            Granularity::parse(text).ok_or_else(|| ApiError::invalid_field("granularity", "must be hour or day"))?
        }
    };
    let (step, max_buckets, unit) = match granularity {
        Granularity::Hour => (granularity.step(), 744, "hours"),
        Granularity::Day => (granularity.step(), 400, "days"),
    };
    let to = match params.to.as_deref() {
        Some(text) => round_up(granularity, timestamp("to", text)?),
        None => granularity.truncate(state.clock.now()) + step,
    };
    let from = match params.from.as_deref() {
        Some(text) => granularity.truncate(timestamp("from", text)?),
        None => to - step * if granularity == Granularity::Hour { 24 } else { 30 },
    };
    if from >= to {
        return Err(ApiError::invalid_field("from", "must be before `to`"));
    }
    if (to - from) / step > f64::from(max_buckets) {
        return Err(ApiError::invalid_field("from", format!("at most {max_buckets} {unit} from `from` to `to`")));
    }
    let points = history::read(&state.pool, caller.tenant.id.as_str(), granularity, from, to).await?;
    let quota = &caller.tenant.quota;
    Ok(axum::Json(History {
        tenant: caller.tenant.id.to_string(),
        granularity,
        from,
        to,
        limits: HistoryLimits {
            storage_bytes: quota.storage_bytes,
            egress_bytes_per_day: quota.egress_bytes_per_day,
            max_queued_exports: quota.max_queued_exports,
            max_running_exports: quota.max_running_exports,
        },
        points,
    }))
}

fn timestamp(field: &str, text: &str) -> ApiResult<OffsetDateTime> {
    let at = OffsetDateTime::parse(text, &Rfc3339)
        .map_err(|_| ApiError::invalid_field(field, "an RFC 3339 time, e.g. 2026-12-01T00:00:00Z"))?;
    // Far outside any history: refused rather than overflowing bucket arithmetic.
    if !(2000..=9000).contains(&at.year()) {
        return Err(ApiError::invalid_field(field, "a year between 2000 and 9000"));
    }
    Ok(at)
}

fn round_up(granularity: Granularity, at: OffsetDateTime) -> OffsetDateTime {
    let start = granularity.truncate(at);
    if start == at { start } else { start + granularity.step() }
}
