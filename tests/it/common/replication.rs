//! Private PostgreSQL clusters for failover tests: a primary and a streaming hot standby made
//! with `pg_basebackup -R`, each in a temporary directory on a free port, run by the installed
//! server binaries (as the `postgres` user when the tests run as root: the server refuses root).
//! Stopped (immediately) and removed when dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

/// How the primary waits for its standby at commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// A commit returns once the standby has flushed it (`synchronous_standby_names = '*'`).
    Synchronous,
    /// A commit returns at once; the standby may never receive it.
    Asynchronous,
}

pub struct Node {
    dir: PathBuf,
    pub port: u16,
}

fn bindir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return dir;
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path().join("bin"))).filter(|p| p.join("initdb").exists()).collect())
        .unwrap_or_default();
    versions.sort_by_key(|p| p.parent().and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok()));
    versions.pop().expect("PostgreSQL server binaries (initdb) are installed")
}

fn as_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// A server binary's command (as `postgres` when we are root), run from `/`.
fn server_command(program: &str) -> Command {
    let path = bindir().join(program);
    let mut command = if as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&path);
        c
    } else {
        Command::new(&path)
    };
    command.current_dir("/").stdin(Stdio::null());
    command
}

/// Runs a server binary; panics with its output on failure.
fn run(program: &str, args: &[&str]) {
    let out = server_command(program).args(args).output().expect("server binary runs");
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A directory the server user owns, outside the checkout (which it may not be able to enter).
fn private_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("exportd-ha-{}-{name}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    if as_root() {
        assert!(Command::new("chown").args(["postgres:postgres", dir.to_str().unwrap()]).status().unwrap().success());
    }
    dir
}

impl Node {
    /// A new primary that streams to standbys, waiting for them at commit if `replication` is
    /// synchronous.
    pub fn primary(replication: Replication) -> Node {
        let node = Node { dir: private_dir("primary"), port: free_port() };
        let data = node.data();
        run("initdb", &["-D", &data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale"]);
        let sync = match replication {
            Replication::Synchronous => "synchronous_standby_names = '*'\n",
            Replication::Asynchronous => "",
        };
        let settings = format!(
            "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\nfsync = off\nmax_connections = 60\n{sync}"
        );
        node.append_settings(&settings);
        node.start();
        node
    }

    /// A server whose write-ahead log carries logical decoding (`wal_level = logical`): a host
    /// database that log capture follows.
    pub fn logical() -> Node {
        let node = Node { dir: private_dir("logical"), port: free_port() };
        run("initdb", &["-D", &node.data(), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale"]);
        // A small logical_decoding_work_mem: a modest transaction already spills to disk when the
        // slot is read, as a large one does on a real host.
        node.append_settings(
            "wal_level = logical\nmax_replication_slots = 4\nmax_wal_senders = 4\nlogical_decoding_work_mem = 64kB\n\
             fsync = off\nmax_connections = 60\n",
        );
        node.start();
        node
    }

    /// A hot standby of `primary`, made with `pg_basebackup -R` and streaming from it.
    pub fn standby_of(primary: &Node) -> Node {
        let node = Node { dir: private_dir("standby"), port: free_port() };
        let port = primary.port.to_string();
        run(
            "pg_basebackup",
            &["-D", &node.data(), "-h", "127.0.0.1", "-p", &port, "-U", "postgres", "-R", "-X", "stream", "-c", "fast"],
        );
        node.start();
        node
    }

    fn data(&self) -> String {
        self.dir.join("data").to_str().unwrap().to_owned()
    }

    fn append_settings(&self, text: &str) {
        use std::io::Write;
        let path = Path::new(&self.data()).join("postgresql.conf");
        std::fs::OpenOptions::new().append(true).open(path).unwrap().write_all(text.as_bytes()).unwrap();
    }

    fn start(&self) {
        let options = format!("-p {} -k {} -c listen_addresses=127.0.0.1", self.port, self.dir.display());
        let log = self.dir.join("server.log");
        run("pg_ctl", &["-D", &self.data(), "-l", log.to_str().unwrap(), "-w", "-t", "60", "-o", &options, "start"]);
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The URL of `database` on this server, directly.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub async fn connect(&self, database: &str) -> PgConnection {
        PgConnection::connect(&self.url(database)).await.unwrap()
    }

    /// Crashes the server (`pg_ctl stop -m immediate`): nothing more is sent to standbys.
    pub fn kill(&self) {
        run("pg_ctl", &["-D", &self.data(), "-m", "immediate", "-w", "stop"]);
    }

    /// Stops the server (fast: sessions are ended) and starts it again.
    pub fn restart(&self) {
        run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]);
        self.start();
    }

    /// Promotes this standby and waits until it accepts writes.
    pub async fn promote(&self) {
        run("pg_ctl", &["-D", &self.data(), "-w", "-t", "60", "promote"]);
        let mut conn = self.connect("postgres").await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()").fetch_one(&mut conn).await.unwrap() {
            assert!(Instant::now() < deadline, "the standby was never promoted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Commits stop waiting for a synchronous standby (a promoted standby has none of its own;
    /// Patroni does the same).
    pub async fn stop_waiting_for_standbys(&self) {
        let mut conn = self.connect("postgres").await;
        sqlx::query("ALTER SYSTEM SET synchronous_standby_names = ''").execute(&mut conn).await.unwrap();
        sqlx::query("SELECT pg_reload_conf()").execute(&mut conn).await.unwrap();
    }

    /// Stops this standby's WAL receiver for good: whatever its primary commits from now on
    /// never reaches it.
    pub async fn stop_receiving(&self) {
        let mut conn = self.connect("postgres").await;
        sqlx::query("ALTER SYSTEM SET primary_conninfo = ''").execute(&mut conn).await.unwrap();
        sqlx::query("SELECT pg_reload_conf()").execute(&mut conn).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_wal_receiver")
            .fetch_one(&mut conn)
            .await
            .unwrap()
            > 0
        {
            assert!(Instant::now() < deadline, "the WAL receiver did not stop");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until this standby has replayed everything `primary` has written so far.
    pub async fn catch_up_with(&self, primary: &Node) {
        let mut on_primary = primary.connect("postgres").await;
        let written: String =
            sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text").fetch_one(&mut on_primary).await.unwrap();
        let mut conn = self.connect("postgres").await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let replayed: bool = sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                .bind(&written)
                .fetch_one(&mut conn)
                .await
                .unwrap();
            if replayed {
                return;
            }
            assert!(Instant::now() < deadline, "the standby never replayed up to {written}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = server_command("pg_ctl").args(["-D", &self.data(), "-m", "immediate", "-w", "stop"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
