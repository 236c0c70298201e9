//! `GET /healthz`: the process is up and the database answers as a writable primary (else 503,
//! `database: failing over`: it does not answer, or answers read-only — a standby not promoted
//! yet, or a primary being demoted; exportd reconnects by itself once a primary answers); and
//! whether the artifact store answers (`degraded` when it does not: feeds and the API still work, exports
//! wait and downloads answer 503, so a load balancer should keep sending traffic).

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

use super::error::{ApiError, ApiResult};
use super::state::AppState;

/// How long the health check waits for the database.
const DATABASE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(healthz))
}

#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`, or `degraded` when the store does not answer.
    status: &'static str,
    database: &'static str,
    /// The timeline the primary writes on: it changes with each failover.
    timeline: i32,
    /// `ok` or `unreachable`.
    store: &'static str,
    /// Why the store is unreachable (absent when it answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    store_error: Option<String>,
}

/// Liveness, database and store reachability.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, body = Health),
        (status = 503, description = "database-unavailable: the database does not answer, or is read-only (`database: failing over`)")))]
async fn healthz(State(state): State<AppState>) -> ApiResult<axum::Json<Health>> {
    let failing_over = |detail: &str| {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database-unavailable", detail)
            .with("database", "failing over");
        e.retry_after_seconds = Some(1);
        e
    };
    // Answer within a load balancer's patience, not the pool's acquire timeout.
    let answer = tokio::time::timeout(DATABASE_PATIENCE, primary_timeline(&state.pool)).await;
    let primary = answer.unwrap_or(Err(sqlx::Error::PoolTimedOut)).map_err(|e| {
        tracing::warn!(error = %e, "health check: database unreachable");
        failing_over("the database does not answer")
    })?;
    let Some(timeline) = primary else {
        tracing::warn!("health check: the database is read-only (in recovery)");
        return Err(failing_over(
            "the database answers read-only: a standby not promoted yet, or a primary being demoted",
        ));
    };
    let store_error = state.store.reachable().await.err();
    if let Some(error) = &store_error {
        tracing::warn!(error, "health check: the artifact store does not answer");
    }
    let (status, store) = if store_error.is_some() { ("degraded", "unreachable") } else { ("ok", "ok") };
    Ok(axum::Json(Health { status, database: "ok", timeline, store, store_error }))
}

/// The timeline the database writes on, or `None` while it is read-only. A connection in steady
/// use is handed out without a ping ([`crate::db::pool_options`]), so right after a quick
/// switchover one whose server went away can fail; the pool drops it, and that failure speaks
/// for the connection, not the database: ask again on the next one, at most once per
/// connection that was idle in the pool.
async fn primary_timeline(pool: &sqlx::PgPool) -> Result<Option<i32>, sqlx::Error> {
    let mut stale_at_most = pool.num_idle();
    loop {
        let asked =
            sqlx::query!(r#"SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE exportd_timeline() END AS timeline"#)
                .fetch_one(pool)
                .await
                .map(|row| row.timeline);
        match asked {
            Err(sqlx::Error::Io(_) | sqlx::Error::Protocol(_)) if stale_at_most > 0 => stale_at_most -= 1,
            answer => return answer,
        }
    }
}
