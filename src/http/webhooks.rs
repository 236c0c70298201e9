//! `GET /v1/webhooks/deliveries`, `POST /v1/webhooks/deliveries/{id}/retry`: what was sent to
//! the tenant's endpoints, for tenant admins.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::{router::OpenApiRouter, routes};
use uuid::Uuid;

use super::error::{ApiError, ApiResult};
use super::extract::{Path, Query};
use super::listing;
use super::state::AppState;
use crate::auth::Caller;
use crate::tenants::WebhookEvent;
use crate::webhooks::outbox::{self, DeliveryFilter, DeliveryView};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(deliveries)).routes(routes!(retry_delivery))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeliveriesParams {
    /// Only this endpoint (its `name` in the tenant file).
    #[param(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    endpoint: Option<String>,
    /// Only this event type.
    #[param(
        pattern = r"^(export\.(succeeded|failed|cancelled|expired|revoked)|feed\.lagging|schema\.changed|delivery\.(succeeded|failed))$"
    )]
    event: Option<String>,
    /// Only deliveries in this state.
    #[param(pattern = "^(pending|delivered|failed)$")]
    state: Option<String>,
    /// Only events about this export.
    #[param(format = Uuid)]
    export_id: Option<String>,
    /// `next_cursor` of the previous page: an opaque token this API handed out (any other text
    /// is refused with 400 naming `cursor`).
    #[param(pattern = "^[1-9][0-9]{0,17}$")]
    cursor: Option<String>,
    /// Page size, 1 to 500 (default 100).
    #[param(minimum = 1, maximum = 500)]
    limit: Option<u32>,
}

#[derive(Serialize, ToSchema)]
pub struct DeliveriesPage {
    deliveries: Vec<DeliveryView>,
    next_cursor: Option<String>,
}

/// Deliveries to the tenant's webhook endpoints, newest first: event, endpoint, attempts, last
/// status and error, next attempt.
#[utoipa::path(get, path = "/v1/webhooks/deliveries", tag = "webhooks", security(("bearer" = [])),
    params(DeliveriesParams),
    responses((status = 200, body = DeliveriesPage), (status = 403, description = "not a tenant admin")))]
async fn deliveries(
    State(state): State<AppState>,
    caller: Caller,
    Query(params): Query<DeliveriesParams>,
) -> ApiResult<axum::Json<DeliveriesPage>> {
    admin(&caller)?;
    let limit = listing::limit(params.limit)?;
    let endpoint = listing::name("endpoint", params.endpoint.as_deref())?;
    let event = match params.event.as_deref() {
        Some(text) => Some(WebhookEvent::parse(text).ok_or_else(|| {
            let known: Vec<&str> = WebhookEvent::ALL.iter().map(|e| e.as_str()).collect();
            ApiError::invalid_field("event", format!("one of {}", known.join(", ")))
        })?),
        None => None,
    };
    let state_filter = listing::state(params.state.as_deref())?;
    let export_id = match params.export_id.as_deref() {
        Some(text) => {
            Some(Uuid::parse_str(text).map_err(|_| ApiError::invalid_field("export_id", "not an export id"))?)
        }
        None => None,
    };
    let before = listing::before(params.cursor.as_deref())?;
    let filter = DeliveryFilter { endpoint, event, state: state_filter, export_id, before };
    let (deliveries, next) = outbox::list(&state.pool, caller.tenant.id.as_str(), &filter, limit).await?;
    Ok(axum::Json(DeliveriesPage { deliveries, next_cursor: next.map(|seq| seq.to_string()) }))
}

/// Schedules a delivered or failed delivery again now (same event id and body, a fresh retry
/// period); a pending one is left as it is.
#[utoipa::path(post, path = "/v1/webhooks/deliveries/{id}/retry", tag = "webhooks", security(("bearer" = [])),
    params(("id" = String, Path)),
    responses((status = 202, body = DeliveryView, description = "scheduled (or still pending)"),
        (status = 403, description = "not a tenant admin"), (status = 404, description = "no such delivery")))]
async fn retry_delivery(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, axum::Json<DeliveryView>)> {
    admin(&caller)?;
    let missing = || ApiError::not_found("no such delivery");
    let id = Uuid::parse_str(&id).map_err(|_| missing())?;
    let view = outbox::retry(&state.pool, caller.tenant.id.as_str(), id, state.webhook_retry_for).await?;
    let view = view.ok_or_else(missing)?;
    Ok((StatusCode::ACCEPTED, axum::Json(view)))
}

fn admin(caller: &Caller) -> ApiResult<()> {
    if caller.principal.is_admin() {
        Ok(())
    } else {
        Err(ApiError::forbidden("only tenant admins can see webhook deliveries"))
    }
}
