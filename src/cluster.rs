//! The processes of one deployment, as PostgreSQL sees them: each registers with a heartbeat,
//! and every process knows how many API and worker processes are alive, so per-tenant rates
//! (`governor` buckets, kept in memory) can be split between them and hold cluster-wide.

use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;
use uuid::Uuid;

/// How often a process renews its registration.
pub const HEARTBEAT: Duration = Duration::from_secs(2);
/// A process not heard from for this long is gone (killed, cut off): the others take over its share.
pub const PRESUMED_DEAD: Duration = Duration::from_secs(10);

/// What a process does, so each rate is split among the processes that enforce it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// Serves the HTTP API (splits `api_requests_per_second` / `api_burst`).
    pub api: bool,
    /// Runs export workers (splits `scan_rows_per_second`).
    pub workers: bool,
}

/// How many live processes share each rate (at least 1: this one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    pub api: u32,
    pub workers: u32,
}

impl Default for Shares {
    fn default() -> Self {
        Shares { api: 1, workers: 1 }
    }
}

/// This process's registration.
pub struct Membership {
    pub id: Uuid,
    shares: watch::Receiver<Shares>,
}

impl Membership {
    /// Starts this process's heartbeat, which registers it at once and renews it until
    /// `shutdown`; then the registration is removed so the others take over its share at once.
    /// Never fails: a database that does not answer yet only delays the registration (the
    /// process enforces whole rates until its first heartbeat lands).
    pub fn join(pool: &PgPool, roles: Roles, shutdown: watch::Receiver<bool>) -> Membership {
        let id = Uuid::now_v7();
        let (tx, shares) = watch::channel(Shares::default());
        tokio::spawn(heartbeat(pool.clone(), id, roles, tx, shutdown));
        tracing::info!(process = %id, "joining the cluster");
        Membership { id, shares }
    }

    /// The current shares; changes when a process joins, leaves or dies.
    pub fn shares(&self) -> watch::Receiver<Shares> {
        self.shares.clone()
    }
}

async fn heartbeat(
    pool: PgPool,
    id: Uuid,
    roles: Roles,
    shares: watch::Sender<Shares>,
    mut shutdown: watch::Receiver<bool>,
) {
    while !*shutdown.borrow() {
        match beat(&pool, id, roles).await {
            Ok(now) => {
                shares.send_if_modified(|current| {
                    let changed = *current != now;
                    if changed {
                        tracing::info!(api_share = now.api, worker_share = now.workers, "cluster membership changed");
                    }
                    *current = now;
                    changed
                });
            }
            // Keep the last shares: a database blip must not hand a tenant the whole rate here.
            Err(e) => tracing::warn!(error = %e, "cluster heartbeat failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(HEARTBEAT) => {}
            _ = shutdown.changed() => {}
        }
    }
    let _ = sqlx::query!("DELETE FROM cluster_processes WHERE id = $1", id).execute(&pool).await;
}

/// Registers or renews this process (again after a pause long enough for the others to have
/// forgotten it), forgets the dead, and counts the living.
async fn beat(pool: &PgPool, id: Uuid, roles: Roles) -> sqlx::Result<Shares> {
    sqlx::query!(
        "INSERT INTO cluster_processes (id, host, pid, serves_api, runs_workers) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()",
        id,
        hostname(),
        std::process::id() as i32,
        roles.api,
        roles.workers,
    )
    .execute(pool)
    .await?;
    sqlx::query!(
        "DELETE FROM cluster_processes WHERE heartbeat_at < now() - make_interval(secs => $1)",
        PRESUMED_DEAD.as_secs_f64(),
    )
    .execute(pool)
    .await?;
    count(pool).await
}

async fn count(pool: &PgPool) -> sqlx::Result<Shares> {
    let live = sqlx::query!(
        r#"SELECT count(*) FILTER (WHERE serves_api) AS "api!", count(*) FILTER (WHERE runs_workers) AS "workers!"
           FROM cluster_processes"#,
    )
    .fetch_one(pool)
    .await?;
    Ok(Shares { api: live.api.max(1) as u32, workers: live.workers.max(1) as u32 })
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default()
}
