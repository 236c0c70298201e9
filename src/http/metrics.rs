//! `GET /metrics`: Prometheus text format. Export counts and oldest ages per tenant and state,
//! how much of each quota tenants use, partners' feed positions, attached host tables' lag, and
//! the webhook backlog are read from PostgreSQL (every process reports the same, shared truth),
//! with whether the artifact store answers — at most once per `max_age` and one refresh at a time, whatever the number of
//! scrapers, each under a time limit; a scrape meanwhile gets the last figures. The rendered
//! text is reused for a second.
//! Counters and histograms are this process's. The page names every tenant, so it is closed
//! unless the operator sets `EXPORTD_METRICS_TOKEN` (or opens it with `EXPORTD_METRICS_PUBLIC`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use secrecy::{ExposeSecret, SecretString};
use sqlx::PgPool;
use subtle::ConstantTimeEq;
use time::OffsetDateTime;

use super::error::{ApiError, ApiResult};
use super::state::AppState;
use crate::exports::ExportState;
use crate::storage::ArtifactStore;
use crate::tenants::Registry;

/// Who may scrape.
#[derive(Debug, Clone)]
pub enum MetricsAccess {
    /// Nobody: the default, since the page lists every tenant.
    Closed,
    /// Whoever presents this bearer token (compared in constant time).
    Token(SecretString),
    /// Anybody: opened on purpose (`EXPORTD_METRICS_PUBLIC=true`).
    Open,
}

/// Access, the database-backed gauges' last refresh, and the last page rendered.
pub struct MetricsPage {
    pub access: MetricsAccess,
    /// Figures at most this old are served without asking the database again.
    pub max_age: Duration,
    refreshed: tokio::sync::Mutex<Option<Instant>>,
    /// Scrapes within [`RENDER_MAX_AGE`] (or `max_age`, if shorter) get the same text: a
    /// scraping loop costs a copy, not a rendering, each time.
    rendered: std::sync::Mutex<Option<(Instant, axum::body::Bytes)>>,
}

/// How long a rendered page is served again.
const RENDER_MAX_AGE: Duration = Duration::from_secs(1);

/// Default of [`MetricsPage::max_age`].
pub const GAUGES_MAX_AGE: Duration = Duration::from_secs(5);

impl MetricsPage {
    pub fn new(access: MetricsAccess) -> Arc<MetricsPage> {
        MetricsPage::with_max_age(access, GAUGES_MAX_AGE)
    }

    pub fn with_max_age(access: MetricsAccess, max_age: Duration) -> Arc<MetricsPage> {
        Arc::new(MetricsPage {
            access,
            max_age,
            refreshed: tokio::sync::Mutex::new(None),
            rendered: std::sync::Mutex::new(None),
        })
    }

    fn admit(&self, headers: &HeaderMap) -> ApiResult<()> {
        match &self.access {
            MetricsAccess::Open => Ok(()),
            MetricsAccess::Closed => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "metrics-closed",
                "metrics are closed on this server: the operator sets EXPORTD_METRICS_TOKEN (or EXPORTD_METRICS_PUBLIC=true)",
            )),
            MetricsAccess::Token(expected) => {
                let given = super::extract::bearer_token_of(headers);
                let expected = expected.expose_secret().as_bytes();
                if given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(expected))) {
                    Ok(())
                } else {
                    Err(ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "give the metrics token"))
                }
            }
        }
    }

    /// Refreshes the gauges if they are older than `max_age` and nobody else is refreshing.
    async fn refresh(&self, pool: &PgPool, registry: &Registry, store: &ArtifactStore) {
        let Ok(mut refreshed) = self.refreshed.try_lock() else { return };
        if refreshed.is_some_and(|at| at.elapsed() < self.max_age) {
            return;
        }
        // Counted from the attempt, whatever its outcome: a failing or slow database is asked
        // once per `max_age` too.
        *refreshed = Some(Instant::now());
        match tokio::time::timeout(REFRESH_PATIENCE, set_gauges(pool, registry, store)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "metrics: could not read the export gauges"),
            Err(_) => tracing::warn!("metrics: reading the export gauges took too long"),
        }
    }
}

/// A refresh that takes longer is abandoned; the scrape gets the previous figures.
const REFRESH_PATIENCE: Duration = Duration::from_secs(2);

pub async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<impl IntoResponse> {
    let page = &state.metrics;
    page.admit(&headers)?;
    let fresh = RENDER_MAX_AGE.min(page.max_age);
    let cached = page.rendered.lock().expect("not poisoned").clone();
    let text = match cached {
        Some((at, text)) if at.elapsed() < fresh => text,
        _ => {
            page.refresh(&state.pool, &state.registry, &state.store).await;
            let handle = crate::telemetry::prometheus();
            handle.run_upkeep();
            let text = axum::body::Bytes::from(handle.render());
            *page.rendered.lock().expect("not poisoned") = Some((Instant::now(), text.clone()));
            text
        }
    };
    Ok(([(CONTENT_TYPE, "text/plain; version=0.0.4")], text))
}

async fn set_gauges(pool: &PgPool, registry: &Registry, store: &ArtifactStore) -> sqlx::Result<()> {
    let rows = crate::exports::store::facts::by_tenant_and_state(pool).await?;
    let now = OffsetDateTime::now_utc();
    for tenant in registry.tenants() {
        // How much of each quota the tenant uses (1 = at the limit: the next one is refused).
        let count = |state: ExportState| {
            rows.iter().find(|r| r.tenant == tenant.id.as_str() && r.state == state).map_or(0, |r| r.count)
        };
        let id = tenant.id.as_str();
        let quota = &tenant.quota;
        let used = [
            ("running_exports", count(ExportState::Running) as f64, f64::from(quota.max_running_exports)),
            ("queued_exports", count(ExportState::Queued) as f64, f64::from(quota.max_queued_exports)),
            (
                "storage_bytes",
                crate::exports::store::facts::stored_bytes(pool, id).await? as f64,
                quota.storage_bytes as f64,
            ),
            (
                "egress_bytes_per_day",
                crate::quota::egress_today(pool, id, now).await? as f64,
                quota.egress_bytes_per_day as f64,
            ),
        ];
        for (name, used, limit) in used {
            let labels = [("tenant", tenant.id.to_string()), ("quota", name.to_owned())];
            metrics::gauge!("exportd_quota_used_ratio", &labels).set(if limit > 0.0 { used / limit } else { 0.0 });
        }
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
    // Partners' feeds: how old the position each last read from is, and whether it is lagging
    // (past the tenant's `lagging_after_minutes`, as `feed.lagging` says).
    for feed in crate::webhooks::lag::positions(pool).await? {
        let labels = [("tenant", feed.tenant), ("principal", feed.principal), ("dataset", feed.dataset)];
        metrics::gauge!("exportd_feed_position_age_seconds", &labels)
            .set((now - feed.position_at).as_seconds_f64().max(0.0));
        metrics::gauge!("exportd_feed_lagging", &labels).set(if feed.lagging { 1.0 } else { 0.0 });
    }
    // Attached host tables (log capture): the slot's retained WAL and lag, quarantined rows,
    // and whether the host lost the slot.
    for a in crate::attach::list(pool).await? {
        let labels = [("attachment", a.id.to_string()), ("dataset", a.dataset.clone())];
        metrics::gauge!("exportd_attachment_lost", &labels).set(if a.state == "lost" { 1.0 } else { 0.0 });
        metrics::gauge!("exportd_attachment_quarantined_rows", &labels).set(a.quarantined as f64);
        if a.capture == "log" {
            metrics::gauge!("exportd_attachment_lag_bytes", &labels).set(a.lag_bytes.unwrap_or(0) as f64);
            metrics::gauge!("exportd_attachment_retained_wal_bytes", &labels).set(a.retained_bytes.unwrap_or(0) as f64);
        }
    }
    metrics::gauge!("exportd_store_reachable").set(if store.reachable().await.is_ok() { 1.0 } else { 0.0 });
    let (pending, oldest) = crate::webhooks::outbox::pending(pool).await?;
    metrics::gauge!("exportd_webhook_deliveries_pending").set(pending as f64);
    let oldest_age = oldest.map_or(0.0, |at| (now - at).as_seconds_f64().max(0.0));
    metrics::gauge!("exportd_webhook_oldest_pending_seconds").set(oldest_age);
    Ok(())
}
