//! `GET /metrics`: Prometheus text format. Export counts and oldest ages per tenant and state are
//! read from PostgreSQL at scrape time (every process reports the same, shared truth); counters
//! and histograms are this process's. Optionally guarded by `EXPORTD_METRICS_TOKEN`.

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use secrecy::ExposeSecret;
use subtle::ConstantTimeEq;
use time::OffsetDateTime;

use super::error::{ApiError, ApiResult};
use super::state::AppState;
use crate::exports::ExportState;

pub async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<impl IntoResponse> {
    if let Some(expected) = &state.metrics_token {
        let given = super::extract::bearer_token_of(&headers);
        let expected = expected.expose_secret().as_bytes();
        let matches = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(expected)));
        if !matches {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "give the metrics token"));
        }
    }
    let rows = crate::exports::store::facts::by_tenant_and_state(&state.pool).await?;
    let now = OffsetDateTime::now_utc();
    for tenant in state.registry.tenants() {
        for export_state in ExportState::ALL {
            let row = rows.iter().find(|r| r.tenant == tenant.id.as_str() && r.state == export_state);
            let labels = [("tenant", tenant.id.to_string()), ("state", export_state.as_str().to_owned())];
            metrics::gauge!("exportd_exports", &labels).set(row.map_or(0.0, |r| r.count as f64));
            if !export_state.is_terminal() {
                let age = row.and_then(|r| r.oldest).map_or(0.0, |at| (now - at).as_seconds_f64().max(0.0));
                metrics::gauge!("exportd_export_oldest_age_seconds", &labels).set(age);
            }
        }
    }
    let (pending, oldest) = crate::webhooks::outbox::pending(&state.pool).await?;
    metrics::gauge!("exportd_webhook_deliveries_pending").set(pending as f64);
    let oldest_age = oldest.map_or(0.0, |at| (now - at).as_seconds_f64().max(0.0));
    metrics::gauge!("exportd_webhook_oldest_pending_seconds").set(oldest_age);
    let handle = crate::telemetry::prometheus();
    handle.run_upkeep();
    Ok(([(CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()))
}
