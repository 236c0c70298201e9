//! `GET /v1/deliveries`, `GET /v1/deliveries/{id}`, `POST /v1/deliveries/{id}/retry`: exports
//! delivered into partners' buckets. Admins see their tenant's; a partner sees its own — another
//! partner's delivery, like another tenant's, is a 404.

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
use crate::delivery::copy::folder;
use crate::delivery::store::{self, DeliveryView};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_deliveries)).routes(routes!(get_delivery)).routes(routes!(retry_delivery))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeliveriesParams {
    /// Only deliveries in this state.
    #[param(pattern = "^(pending|delivered|failed)$")]
    state: Option<String>,
    /// Only this subscription (its `name` in the tenant file).
    #[param(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    subscription: Option<String>,
    /// `next_cursor` of the previous page.
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

/// The caller's deliveries (admins: the tenant's), newest first: state, attempts, files and bytes
/// written, the last error and where the export is in the bucket.
#[utoipa::path(get, path = "/v1/deliveries", tag = "deliveries", security(("bearer" = [])),
    params(DeliveriesParams),
    responses((status = 200, body = DeliveriesPage), (status = 400, description = "a bad filter (`field` names it)")))]
async fn list_deliveries(
    State(state): State<AppState>,
    caller: Caller,
    Query(params): Query<DeliveriesParams>,
) -> ApiResult<axum::Json<DeliveriesPage>> {
    let limit = listing::limit(params.limit)?;
    let state_filter = listing::state(params.state.as_deref())?;
    let subscription = listing::name("subscription", params.subscription.as_deref())?;
    let before = listing::before(params.cursor.as_deref())?;
    let tenant = caller.tenant.id.as_str();
    let mut deliveries =
        store::list(&state.pool, tenant, own(&caller), state_filter, subscription, before, i64::from(limit)).await?;
    let next_cursor =
        (deliveries.len() == limit as usize).then(|| deliveries.last().map(|d| d.seq.to_string())).flatten();
    deliveries.iter_mut().for_each(|d| d.path = bucket_path(&caller, d));
    Ok(axum::Json(DeliveriesPage { deliveries, next_cursor }))
}

/// One delivery.
#[utoipa::path(get, path = "/v1/deliveries/{id}", tag = "deliveries", security(("bearer" = [])),
    params(("id" = String, Path)),
    responses((status = 200, body = DeliveryView), (status = 404, description = "no such delivery")))]
async fn get_delivery(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<axum::Json<DeliveryView>> {
    Ok(axum::Json(find(&state, &caller, &id).await?))
}

/// A failed delivery is tried again now, with a fresh retry period (the files already in the
/// bucket are written again: same names, same bytes). A pending one is left as it is; a
/// delivered one is 409 `already-delivered` (its bytes were counted against egress once).
#[utoipa::path(post, path = "/v1/deliveries/{id}/retry", tag = "deliveries", security(("bearer" = [])),
    params(("id" = String, Path)),
    responses((status = 202, body = DeliveryView, description = "pending again (or still pending)"),
        (status = 404, description = "no such delivery"), (status = 409, description = "already delivered")))]
async fn retry_delivery(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, axum::Json<DeliveryView>)> {
    let found = find(&state, &caller, &id).await?;
    if found.state == "delivered" {
        return Err(ApiError::new(StatusCode::CONFLICT, "already-delivered", "this delivery already succeeded"));
    }
    store::retry(&state.pool, found.id, state.delivery_retry_for).await?;
    Ok((StatusCode::ACCEPTED, axum::Json(find(&state, &caller, &id).await?)))
}

async fn find(state: &AppState, caller: &Caller, id: &str) -> ApiResult<DeliveryView> {
    let missing = || ApiError::not_found("no such delivery");
    let id = Uuid::parse_str(id).map_err(|_| missing())?;
    let mut view = store::get(&state.pool, caller.tenant.id.as_str(), own(caller), id).await?.ok_or_else(missing)?;
    view.path = bucket_path(caller, &view);
    Ok(view)
}

/// Partners see only their own deliveries.
fn own(caller: &Caller) -> Option<&str> {
    (!caller.principal.is_admin()).then(|| caller.principal.id.as_str())
}

/// `s3://bucket/prefix/{dataset}/{export_id}/`, while the destination is configured.
fn bucket_path(caller: &Caller, view: &DeliveryView) -> Option<String> {
    let destination = caller.tenant.destination(&view.destination)?;
    Some(destination.url.join(&format!("{}/", folder(&view.dataset, view.export_id))))
}
