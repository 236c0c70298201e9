//! Start-up of the long-running process: configuration, database, then the HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use secrecy::ExposeSecret;
use sqlx::PgPool;

use tokio::sync::watch;

use crate::clock::Clock;
use crate::cluster::{Membership, Roles};
use crate::config::Settings;
use crate::db;
use crate::feeds;
use crate::http::{self, AppState};
use crate::jobs::{self, WorkerConfig, WorkerDeps};
use crate::links::LinkKeys;
use crate::quota::{RateLimits, ScanLimits};
use crate::replicas::Replicas;
use crate::storage::{ArtifactStore, Deployment, MARKER, OwnershipError};
use crate::tenants::Registry;
use crate::webhooks::{self, Deliverer};

/// Connections of the API's pool in `serve`.
const API_CONNECTIONS: u32 = 16;

/// Connections for `workers` export workers: three each (a shard's rows, streamed for the whole
/// shard; heartbeats and checkpoints; a spare, so counting ahead and retries never wait for
/// another slot), plus the ticker, the cleaner and the webhook deliveries.
fn worker_connections(workers: usize) -> u32 {
    3 * workers as u32 + 3
}

/// How often the feed ticker records a snapshot.
const TICK_EVERY: Duration = Duration::from_secs(1);
/// How often `exportd worker` runs the cleaner (`serve` takes `--clean-every`).
const CLEAN_EVERY: Duration = Duration::from_secs(60);
/// In-flight requests get this long after a shutdown signal.
const DRAIN: Duration = Duration::from_secs(20);

/// Loads tenants, prepares the database (create, migrate, sync catalogue) and returns both.
/// A transient database error (a restart, a terminated connection) is retried for a while, so
/// a process started during a database blip comes up instead of exiting.
pub async fn prepare(settings: &Settings, max_connections: u32) -> anyhow::Result<(PgPool, Arc<Registry>)> {
    let prepared = prepare_reporting(settings, max_connections).await?;
    Ok((prepared.pool, prepared.registry))
}

/// What [`prepare`] did: the pool, the tenants, and how many migrations it applied.
pub struct Prepared {
    pub pool: PgPool,
    pub registry: Arc<Registry>,
    pub migrations_applied: usize,
}

/// [`prepare`], also saying how many migrations were applied (`exportd migrate`).
pub async fn prepare_reporting(settings: &Settings, max_connections: u32) -> anyhow::Result<Prepared> {
    let mut registry = Registry::load(&settings.tenants_dir)?;
    let (pool, migrations_applied, versions) = patiently(|| async {
        db::create_database_if_missing(&settings.database_url).await?;
        let pool = db::connect(&settings.database_url, max_connections).await?;
        let migrations_applied = db::migrate(&pool).await?;
        // Versions first: a breaking change refused here leaves the write functions' catalogue
        // as it was.
        let versions = crate::tenants::register(&pool, &registry, &settings.tenants_dir).await?;
        crate::tenants::sync_catalogue(&pool, &registry).await?;
        Ok((pool, migrations_applied, versions))
    })
    .await?;
    registry.set_schema_versions(versions);
    Ok(Prepared { pool, registry: Arc::new(registry), migrations_applied })
}

/// Runs a start-up step again while it fails with a transient database error (a restart, a
/// terminated connection), for at most [`STARTUP_PATIENCE`]: a process started during a
/// database blip comes up instead of exiting.
async fn patiently<T, F, Fut>(mut step: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let started = std::time::Instant::now();
    let mut delays = db::retry_delays();
    let mut said = false;
    loop {
        match step().await {
            Err(e) if db::is_transient_chain(&e) && started.elapsed() < STARTUP_PATIENCE => {
                // Said once: the final error (if it comes to that) repeats the cause anyway.
                if !said {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        patience_seconds = STARTUP_PATIENCE.as_secs(),
                        "database not ready at start-up; trying again"
                    );
                    said = true;
                }
                tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(1))).await;
            }
            done => return done,
        }
    }
}

/// How long start-up retries a transient database error.
const STARTUP_PATIENCE: Duration = Duration::from_secs(10);

/// Options of `exportd serve` beyond the shared settings.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub workers: usize,
    pub link_ttl: Duration,
    pub clean_every: Duration,
    pub metrics: http::MetricsAccess,
    pub connections: http::ConnectionLimits,
}

/// `exportd serve`: the HTTP API, `workers` in-process workers and the cleaner, until SIGINT or
/// SIGTERM.
pub async fn serve(settings: &Settings, options: ServeOptions) -> anyhow::Result<()> {
    crate::telemetry::prometheus();
    let (pool, registry) = prepare(settings, API_CONNECTIONS).await?;
    // Exports get a pool of their own: however busy the workers are, API requests keep theirs.
    let export_pool = db::connect(&settings.database_url, worker_connections(options.workers)).await?;
    let deps = worker_deps(settings, export_pool.clone(), registry.clone()).await?;
    let listener =
        tokio::net::TcpListener::bind(options.listen).await.with_context(|| format!("binding {}", options.listen))?;
    tracing::info!(address = %listener.local_addr()?, tenants = registry.tenants().count(), workers = options.workers, "exportd listening");
    let shutdown = shutdown_channel();
    let deliverer = webhook_deliverer(settings, pool.clone(), registry.clone())?;
    let state = AppState {
        link_ttl: options.link_ttl,
        metrics: http::MetricsPage::new(options.metrics.clone()),
        webhook_retry_for: settings.webhooks.webhook_retry_for,
        delivery_retry_for: settings.deliveries.delivery_retry_for,
        public_url: settings.webhooks.public_url.clone(),
        replicas: deps.replicas.clone(),
        ..AppState::new(pool.clone(), registry, deps.store.clone(), deps.keys.clone(), Clock::system())
    };
    let (clock, limits) = (state.clock.clone(), state.limits.clone());
    let roles = Roles { api: true, workers: options.workers > 0 };
    let membership = Membership::join(&pool, roles, shutdown.clone());
    let mut handles = vec![tokio::spawn(follow_shares(membership, Some(limits.clone()), deps.scan.clone()))];
    handles.extend(jobs::spawn_workers(&deps, options.workers, &shutdown));
    handles.push(spawn_cleaner(&deps, clock.clone(), options.clean_every, &shutdown));
    handles.push(tokio::spawn(feeds::run_ticker(pool.clone(), TICK_EVERY, shutdown.clone())));
    handles.push(tokio::spawn(crate::quota::run_housekeeping(limits.clone(), pool.clone(), shutdown.clone())));
    let tenants = limits.tenants().into_iter().map(str::to_owned).collect();
    handles.push(tokio::spawn(crate::usage::history::run_recording(pool.clone(), tenants, shutdown.clone())));
    handles.push(tokio::spawn(webhooks::run(deliverer, clock.clone(), shutdown.clone())));
    if roles.workers {
        // Copying files into partners' buckets is worker's work: an API-only host does none.
        handles.push(tokio::spawn(crate::delivery::run(courier(settings, &deps, clock.clone()), shutdown.clone())));
        handles.push(spawn_capture(&deps, &shutdown));
    }
    let mut http_shutdown = shutdown.clone();
    let stopped = async move {
        let _ = http_shutdown.wait_for(|stop| *stop).await;
    };
    http::serve(listener, http::app(state), options.connections.fit_descriptors(), stopped, DRAIN).await?;
    join_workers(handles).await;
    pool.close().await;
    export_pool.close().await;
    tracing::info!("exportd stopped");
    Ok(())
}

fn spawn_cleaner(
    deps: &WorkerDeps,
    clock: Clock,
    every: Duration,
    shutdown: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let (pool, store, registry) = (deps.pool.clone(), deps.store.clone(), deps.registry.clone());
    tokio::spawn(crate::cleaner::run_periodically(pool, store, registry, clock, every, shutdown.clone()))
}

/// `exportd worker`: workers only, sharing the jobs with every other process through PostgreSQL.
pub async fn work(settings: &Settings, workers: usize, exit_when_idle: bool) -> anyhow::Result<()> {
    let (pool, registry) = prepare(settings, worker_connections(workers)).await?;
    let deps = worker_deps(settings, pool.clone(), registry).await?;
    if exit_when_idle {
        let handles: Vec<_> = (0..workers.max(1))
            .map(|n| {
                let deps = deps.clone();
                tokio::spawn(async move { jobs::drain(&deps, &format!("drain-{n}")).await })
            })
            .collect();
        for handle in handles {
            for step in handle.await?? {
                tracing::info!(outcome = ?step, "job run ended");
            }
        }
    } else {
        let deliverer = webhook_deliverer(settings, deps.pool.clone(), deps.registry.clone())?;
        tracing::info!(workers, "exportd worker started");
        let shutdown = shutdown_channel();
        let roles = Roles { api: false, workers: true };
        let membership = Membership::join(&pool, roles, shutdown.clone());
        let mut handles = vec![tokio::spawn(follow_shares(membership, None, deps.scan.clone()))];
        handles.extend(jobs::spawn_workers(&deps, workers, &shutdown));
        handles.push(spawn_cleaner(&deps, Clock::system(), CLEAN_EVERY, &shutdown));
        handles.push(tokio::spawn(feeds::run_ticker(deps.pool.clone(), TICK_EVERY, shutdown.clone())));
        handles.push(spawn_capture(&deps, &shutdown));
        handles.push(tokio::spawn(webhooks::run(deliverer, Clock::system(), shutdown.clone())));
        handles.push(tokio::spawn(crate::delivery::run(courier(settings, &deps, Clock::system()), shutdown.clone())));
        // Runs until told to stop; only then do the workers get the drain time.
        let _ = shutdown.clone().wait_for(|stop| *stop).await;
        join_workers(handles).await;
        tracing::info!("exportd worker stopped");
    }
    pool.close().await;
    Ok(())
}

async fn worker_deps(settings: &Settings, pool: PgPool, registry: Arc<Registry>) -> anyhow::Result<WorkerDeps> {
    let store = ArtifactStore::connect(&settings.storage_location()?, &pool).await?;
    tracing::info!(store = store.describe(), "artifact store");
    patiently(|| claim_store(&store, &pool)).await?;
    let keys = Arc::new(patiently(|| server_keys(settings, &pool)).await?);
    let scan = Arc::new(ScanLimits::new(&registry));
    anyhow::ensure!(settings.lease_ttl >= Duration::from_secs(1), "EXPORTD_LEASE_TTL: must be at least 1s");
    let config = WorkerConfig {
        lease_ttl: settings.lease_ttl,
        give_up_after: settings.give_up_after,
        ..WorkerConfig::default()
    };
    let standby_connections = pool.options().get_max_connections();
    let replicas = match &settings.read_replicas {
        Some(urls) => Replicas::connect(urls, standby_connections, settings.read_replica_wait)?,
        None => Replicas::default(),
    };
    if !replicas.is_empty() {
        tracing::info!(standbys = replicas.describe(), "full exports and feed pages read on hot standbys");
    }
    Ok(WorkerDeps {
        pool,
        registry,
        store,
        keys,
        scan,
        config,
        spools: Default::default(),
        replicas: Arc::new(replicas),
    })
}

/// The loop following attached host tables from their write-ahead logs.
fn spawn_capture(deps: &WorkerDeps, shutdown: &watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
    let options = crate::attach::log::FollowOptions::default();
    tokio::spawn(crate::attach::log::run(deps.pool.clone(), deps.registry.clone(), options, shutdown.clone()))
}

/// The loop delivering exports into partners' buckets.
fn courier(settings: &Settings, deps: &WorkerDeps, clock: Clock) -> crate::delivery::Courier {
    crate::delivery::Courier::new(
        deps.pool.clone(),
        deps.registry.clone(),
        deps.store.clone(),
        deps.keys.clone(),
        settings.deliveries.clone(),
        settings.lease_ttl,
        clock,
    )
}

/// The webhook delivery loop's parts, after warning about endpoints it will refuse.
fn webhook_deliverer(settings: &Settings, pool: PgPool, registry: Arc<Registry>) -> anyhow::Result<Deliverer> {
    let deliverer = Deliverer::new(pool, registry, settings.webhooks.clone())?;
    for problem in deliverer.endpoint_problems(&settings.tenants_dir) {
        tracing::warn!("{problem}; its deliveries fail with this reason until the URL or the setting changes");
    }
    Ok(deliverer)
}

/// Keeps this process's share of every per-tenant rate equal to 1 / the live processes that
/// enforce it, until the membership's heartbeat stops (at shutdown).
pub async fn follow_shares(membership: Membership, api: Option<Arc<RateLimits>>, scan: Arc<ScanLimits>) {
    let mut shares = membership.shares();
    loop {
        let now = *shares.borrow_and_update();
        if let Some(api) = &api {
            api.set_share(now.api);
        }
        scan.set_share(now.workers);
        if shares.changed().await.is_err() {
            return;
        }
    }
}

/// Makes sure the artifact store is this deployment's (or makes it so, when it has no owner
/// yet). A store that does not answer is checked again by every cleaner pass, which sweeps
/// nothing until it is. A store claimed just now, by a database that has published exports,
/// cannot hold their files: most likely the process points at another directory or bucket than
/// the one the exports were written to, and it says so before their downloads answer 410.
async fn claim_store(store: &ArtifactStore, pool: &PgPool) -> anyhow::Result<()> {
    let us = Deployment::of(pool).await.context("reading the deployment's identity")?;
    match store.claim(&us).await {
        Ok(false) => Ok(()),
        Ok(true) => {
            let published = crate::exports::store::facts::published_with_files(pool).await?;
            if published > 0 {
                tracing::error!(
                    store = store.describe(),
                    published,
                    "this store had no owner, yet the database has {published} published exports whose files \
                     should be in it: exportd is probably pointed at the wrong directory or bucket \
                     (EXPORTD_DATA_DIR, EXPORTD_STORAGE); their downloads answer 410 files-missing until it points \
                     at the store they were written to (the one whose {MARKER} names this database)",
                );
            }
            Ok(())
        }
        Err(OwnershipError::Store(e)) if e.is_transient() => {
            tracing::warn!(store = store.describe(), error = %e, "cannot check who owns the artifact store yet");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// The keys that sign links and cursors: `EXPORTD_LINK_KEYS`, or else the deployment's key
/// kept in the database (made by the first process that needs it).
async fn server_keys(settings: &Settings, pool: &PgPool) -> anyhow::Result<LinkKeys> {
    match &settings.link_keys {
        Some(spec) => LinkKeys::parse(spec.expose_secret()).map_err(|e| anyhow::anyhow!("EXPORTD_LINK_KEYS: {e}")),
        None => {
            let keys = LinkKeys::of_deployment(pool).await.context("reading the deployment's link key")?;
            tracing::warn!(
                "EXPORTD_LINK_KEYS is not set: signing links and sealing cursors with the key kept in the database \
                 (table `deployment`); set EXPORTD_LINK_KEYS to rotate keys or to keep them out of the database"
            );
            Ok(keys)
        }
    }
}

/// Turns true on SIGINT or SIGTERM.
fn shutdown_channel() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = tx.send(true);
    });
    rx
}

/// After shutdown was signalled: workers finish their current shard and release their leases;
/// wait for that, within the drain time.
async fn join_workers(handles: Vec<tokio::task::JoinHandle<()>>) {
    let all = futures_util::future::join_all(handles);
    if tokio::time::timeout(DRAIN, all).await.is_err() {
        tracing::warn!("workers still busy after the drain deadline; their leases will expire");
    }
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
