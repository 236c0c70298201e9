//! Start-up of the long-running process: configuration, database, then the HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;

use crate::config::Settings;
use crate::db;
use crate::http::{self, AppState};
use crate::tenants::Registry;

/// In-flight requests get this long after a shutdown signal.
const DRAIN: Duration = Duration::from_secs(20);

/// Loads tenants, prepares the database (create, migrate, sync catalogue) and returns both.
pub async fn prepare(
    settings: &Settings,
    max_connections: u32,
) -> anyhow::Result<(PgPool, Arc<Registry>)> {
    let registry = Registry::load(&settings.tenants_dir)?;
    db::create_database_if_missing(&settings.database_url).await?;
    let pool = db::connect(&settings.database_url, max_connections).await?;
    db::migrate(&pool).await?;
    db::sync_catalogue(&pool, &registry).await?;
    Ok((pool, Arc::new(registry)))
}

/// `exportd serve`: runs until SIGINT or SIGTERM.
pub async fn serve(settings: &Settings, listen: SocketAddr) -> anyhow::Result<()> {
    let (pool, registry) = prepare(settings, 16).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    tracing::info!(address = %listener.local_addr()?, tenants = registry.tenants().count(), "exportd listening");
    let app = http::app(AppState {
        pool: pool.clone(),
        registry,
    });
    http::serve(listener, app, shutdown_signal(), DRAIN).await?;
    pool.close().await;
    tracing::info!("exportd stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { () = ctrl_c => {}, () = terminate => {} }
    tracing::info!("shutdown requested");
}
