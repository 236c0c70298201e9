//! Hot standbys that take reads off the primary (`EXPORTD_READ_REPLICAS`): full exports' rows,
//! feed pages' changes, estimates' census.
//!
//! exportd reads a snapshot's rows by filtering record versions with the snapshot it recorded,
//! not by PostgreSQL's own snapshot, so any server that has every commit the snapshot saw
//! returns the same rows. A snapshot saw only commits whose records end at or before the WAL
//! position recorded with it ([`crate::history`]): a standby that has replayed past that
//! position reads it byte for byte like the primary. Reads wait a bounded time for one to get
//! there, then go to the primary. Writes, leases and checkpoints never come here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::PgPool;

use crate::history::HistoryPoint;

/// How often a lagging standby is asked again while a read waits for it.
const POLL: Duration = Duration::from_millis(20);

/// The standbys of this process, in the order configured.
#[derive(Default)]
pub struct Replicas {
    standbys: Vec<Standby>,
    /// How long a read waits for a standby to replay far enough.
    wait: Duration,
    /// Where the next read starts looking: reads spread over the standbys.
    next: AtomicUsize,
}

struct Standby {
    /// `host:port`, for logs and metrics (never the URL: it may hold a password).
    name: String,
    pool: PgPool,
}

/// Where a read went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    Standby,
    /// No standby had replayed far enough within the wait.
    Lagging,
    /// No standby answered (or none is configured).
    Primary,
}

impl Replicas {
    /// Pools over the standbys of `urls` (comma-separated `postgres://` URLs), each of at most
    /// `max_connections`, opened lazily: a standby that is down at start is only skipped.
    pub fn connect(urls: &str, max_connections: u32, wait: Duration) -> anyhow::Result<Replicas> {
        let mut standbys = Vec::new();
        for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let options = crate::db::parse_url(url).context("EXPORTD_READ_REPLICAS")?;
            let name = format!("{}:{}", options.get_host(), options.get_port());
            let pool = crate::db::pool_options()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(2))
                .connect_lazy_with(options);
            standbys.push(Standby { name, pool });
        }
        Ok(Replicas { standbys, wait, next: AtomicUsize::new(0) })
    }

    pub fn is_empty(&self) -> bool {
        self.standbys.is_empty()
    }

    /// `host:port` of each standby.
    pub fn describe(&self) -> String {
        self.standbys.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// A pool that reads what a snapshot taken at `point` saw: a standby that has replayed past
    /// it (waiting at most the configured time), else `primary`.
    pub async fn reader<'a>(&'a self, primary: &'a PgPool, point: HistoryPoint) -> &'a PgPool {
        let (pool, served) = self.choose(primary, point).await;
        metrics::counter!("exportd_standby_reads_total", "served" => served.label()).increment(1);
        pool
    }

    /// A pool that reads everything committed on `primary` so far (rows written outside any
    /// recorded snapshot, e.g. a feed window just cut): the primary's position now is the point
    /// to have replayed past. Without standbys, `primary` (and no question asked of it).
    pub async fn reader_now<'a>(&'a self, primary: &'a PgPool) -> sqlx::Result<&'a PgPool> {
        if self.standbys.is_empty() {
            return Ok(primary);
        }
        let point = crate::history::current_point(primary).await?;
        Ok(self.reader(primary, point).await)
    }

    async fn choose<'a>(&'a self, primary: &'a PgPool, point: HistoryPoint) -> (&'a PgPool, Served) {
        if self.standbys.is_empty() {
            return (primary, Served::Primary);
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + self.wait;
        loop {
            let mut answered = false;
            for i in 0..self.standbys.len() {
                let standby = &self.standbys[(start + i) % self.standbys.len()];
                match replayed_past(&standby.pool, point).await {
                    Ok(true) => return (&standby.pool, Served::Standby),
                    Ok(false) => answered = true,
                    Err(e) => tracing::debug!(standby = standby.name, error = %e, "standby does not answer"),
                }
            }
            if !answered {
                return (primary, Served::Primary);
            }
            if Instant::now() >= deadline {
                return (primary, Served::Lagging);
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Served {
    fn label(self) -> &'static str {
        match self {
            Served::Standby => "standby",
            Served::Lagging => "primary_standbys_lagging",
            Served::Primary => "primary",
        }
    }
}

/// The standby streams `point`'s timeline and has replayed WAL at least up to `point`. A standby
/// on another timeline — one still holding history a failover lost, or not following the new
/// primary yet — is passed over.
async fn replayed_past(pool: &PgPool, point: HistoryPoint) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT FROM pg_stat_wal_receiver
                          WHERE status = 'streaming' AND received_tli = $2
                            AND pg_last_wal_replay_lsn() - '0/0'::pg_lsn >= $1::bigint) AS "ok!""#,
        point.wal_position,
        point.timeline,
    )
    .fetch_one(pool)
    .await
}
