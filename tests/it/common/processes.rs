//! `exportd` as real processes over a test's database, and the database conditions fault tests
//! wait on.

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use super::{LINK_KEYS, TestApp, fixture_tenants_dir};

/// The URL of the test's own database (`DATABASE_URL` names the server).
pub async fn database_url(pool: &PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(pool).await.unwrap();
    let server = std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server");
    let base = server.split('?').next().unwrap();
    format!("{}/{name}", base.rsplit_once('/').map_or(base, |(server, _)| server))
}

/// An `exportd worker` process; its log goes to `log`.
pub fn spawn_worker(database_url: &str, data_dir: &Path, log: &Path, workers: usize, lease_ttl: &str) -> Child {
    worker_command(database_url, data_dir, log, workers, lease_ttl).spawn().expect("exportd worker starts")
}

/// The command of [`spawn_worker`], for a test to add settings to.
pub fn worker_command(database_url: &str, data_dir: &Path, log: &Path, workers: usize, lease_ttl: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_exportd"));
    command
        .args(["worker", "--workers", &workers.to_string()])
        .env("DATABASE_URL", database_url)
        .env("EXPORTD_TENANTS_DIR", fixture_tenants_dir())
        .env("EXPORTD_DATA_DIR", data_dir)
        .env("EXPORTD_LINK_KEYS", LINK_KEYS)
        .env("EXPORTD_LEASE_TTL", lease_ttl)
        .env("EXPORTD_LOG", "warn")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap());
    command
}

/// Processes SIGKILLed when dropped, so a failing test leaves none behind holding its database.
pub struct Fleet(pub Vec<Child>);

impl Drop for Fleet {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An `exportd serve` process over the app's database and data directory, killed when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
}

impl Drop for Server {
    /// Stops the server as a supervisor would (SIGTERM), so it closes its database connections
    /// before the test's database is dropped (a SIGKILLed process's backends can outlive it and
    /// keep the drop from happening); SIGKILL after a few seconds.
    fn drop(&mut self) {
        if self.child.try_wait().is_ok_and(|status| status.is_none()) {
            let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline && self.child.try_wait().is_ok_and(|status| status.is_none()) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `exportd serve --workers <workers>` on a free port, its log (EXPORTD_LOG=info)
    /// appended to `log`, or none; returns once `/healthz` answers.
    pub async fn start(app: &TestApp, workers: &str, log: Option<&Path>) -> Server {
        Server::start_with(app, workers, log, |_| {}).await
    }

    /// [`Server::start`] with settings changed by `configure` (e.g. no `EXPORTD_LINK_KEYS`).
    pub async fn start_with(
        app: &TestApp,
        workers: &str,
        log: Option<&Path>,
        configure: impl FnOnce(&mut Command),
    ) -> Server {
        Server::start_on(&database_url(&app.pool).await, app.data_dir.path(), workers, log, configure).await
    }

    /// [`Server::start_with`] over any database and data directory.
    pub async fn start_on(
        database_url: &str,
        data_dir: &Path,
        workers: &str,
        log: Option<&Path>,
        configure: impl FnOnce(&mut Command),
    ) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (level, log) = match log {
            Some(path) => {
                ("info", Stdio::from(std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap()))
            }
            None => ("error", Stdio::null()),
        };
        let mut command = Command::new(env!("CARGO_BIN_EXE_exportd"));
        command
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--workers", workers])
            .env("DATABASE_URL", database_url)
            .env("EXPORTD_TENANTS_DIR", fixture_tenants_dir())
            .env("EXPORTD_DATA_DIR", data_dir)
            .env("EXPORTD_LINK_KEYS", LINK_KEYS)
            .env("EXPORTD_LOG", level)
            .stdout(Stdio::null())
            .stderr(log);
        configure(&mut command);
        #[allow(clippy::zombie_processes)] // waited for in `Server::drop`
        let child = command.spawn().unwrap();
        let base = format!("http://127.0.0.1:{port}");
        for _ in 0..200 {
            if reqwest::get(format!("{base}/healthz")).await.is_ok_and(|r| r.status() == 200) {
                return Server { child, base };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("exportd serve did not come up");
    }
}

/// Sends SIGTERM (what a supervisor sends to stop a service).
pub fn terminate(child: &Child) {
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
}

/// Waits for the process to exit, at most `within`.
pub async fn wait_exit(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < within {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Polls the job until it reaches a terminal state; returns that state (panics after `within`).
pub async fn wait_terminal(pool: &PgPool, export_id: &str, within: Duration) -> String {
    let start = Instant::now();
    loop {
        let state: String = sqlx::query_scalar("SELECT state FROM export_jobs WHERE id = $1::uuid")
            .bind(export_id)
            .fetch_one(pool)
            .await
            .unwrap();
        if !matches!(state.as_str(), "QUEUED" | "RUNNING" | "CANCEL_REQUESTED") {
            return state;
        }
        assert!(start.elapsed() < within, "export {export_id} still {state} after {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Terminates every other connection to this database (a failover, a network blip); returns
/// how many.
pub async fn terminate_backends(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `deadlock detected` errors PostgreSQL raised in this database so far.
pub async fn deadlocks(pool: &PgPool) -> i64 {
    database_stat(pool, "deadlocks").await
}

/// A counter of `pg_stat_database` for this database (`deadlocks`, `xact_commit`…). Every other
/// backend is ended first, and waited for: a backend flushes its statistics when it exits.
pub async fn database_stat(pool: &PgPool, column: &str) -> i64 {
    assert!(column.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
    let mut conn = pool.acquire().await.unwrap();
    terminate_backends_on(&mut conn).await;
    for _ in 0..200 {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        if others == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        terminate_backends_on(&mut conn).await;
    }
    let sql = format!("SELECT {column} FROM pg_stat_database WHERE datname = current_database()");
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&mut *conn).await.unwrap()
}

async fn terminate_backends_on(conn: &mut sqlx::PgConnection) {
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(conn)
    .await
    .unwrap();
}
