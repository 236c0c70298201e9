//! Which history of the database a position belongs to.
//!
//! A promoted standby continues its old primary's history on a new timeline from a switch
//! point. With asynchronous replication the old primary may have committed more past that
//! point; those commits are gone, and the new primary hands their transaction ids out again.
//! A snapshot taken at WAL position `p` on timeline `t` saw only commits whose records end at
//! or before `p`, so it is part of the current history exactly when `t` is the current timeline
//! or the current timeline's history says `t` ended at or after `p`. exportd records that point
//! with every snapshot a partner can come back with (migration 51), and refuses a position the
//! history no longer holds instead of reading other transactions under its old ids.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::records::Snapshot;

/// Where a snapshot was taken: a timeline and the WAL insert position (bytes) at that moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryPoint {
    #[serde(rename = "t")]
    pub timeline: i32,
    #[serde(rename = "p")]
    pub wal_position: i64,
}

/// The database as it is now: its cluster, the timeline it writes on, and where positions from
/// before exportd recorded them stand (the upgrade's own point).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Database {
    pub system_identifier: String,
    pub timeline: i32,
    /// The WAL insert position when it was identified.
    pub wal_position: i64,
    pub origin: HistoryPoint,
}

impl Database {
    /// One statement, on the primary (the timeline is the one WAL is written on).
    pub async fn identify(pool: &PgPool) -> sqlx::Result<Database> {
        let row = sqlx::query!(
            r#"SELECT s.system_identifier::text AS "system_identifier!", exportd_timeline() AS "timeline!",
                      exportd_wal_position() AS "wal_position!", d.origin_timeline, d.origin_wal_position
               FROM pg_control_system() s, deployment d"#
        )
        .fetch_one(pool)
        .await?;
        Ok(Database {
            system_identifier: row.system_identifier,
            timeline: row.timeline,
            wal_position: row.wal_position,
            origin: HistoryPoint { timeline: row.origin_timeline, wal_position: row.origin_wal_position },
        })
    }
}

/// Where the primary's history stands now: every commit visible to it is at or before this
/// point (the WAL insert position is past the end of every commit record written).
pub async fn current_point(pool: &PgPool) -> sqlx::Result<HistoryPoint> {
    let row = sqlx::query!(r#"SELECT exportd_timeline() AS "timeline!", exportd_wal_position() AS "wal_position!""#)
        .fetch_one(pool)
        .await?;
    Ok(HistoryPoint { timeline: row.timeline, wal_position: row.wal_position })
}

/// `pg_current_snapshot()` and where in the history it was taken (one statement, on the primary).
pub async fn current_snapshot(pool: &PgPool) -> sqlx::Result<(Snapshot, HistoryPoint)> {
    let row = sqlx::query!(
        r#"SELECT pg_current_snapshot()::text AS "snapshot!", exportd_timeline() AS "timeline!",
                  exportd_wal_position() AS "wal_position!""#
    )
    .fetch_one(pool)
    .await?;
    let snapshot = Snapshot::parse(&row.snapshot).map_err(sqlx::Error::Protocol)?;
    Ok((snapshot, HistoryPoint { timeline: row.timeline, wal_position: row.wal_position }))
}

/// Counts a refusal of a principal's position in a dataset (a feed cursor, a table version) for
/// history a failover to `timeline` lost; the first raises the tenant's `feed.history_lost`
/// event (same statement: one event per principal, dataset and failover).
pub async fn count_refusal(
    pool: &PgPool,
    (tenant, principal, dataset): (&str, &str, &str),
    timeline: i32,
    now: time::OffsetDateTime,
) -> sqlx::Result<()> {
    sqlx::query!(
        "WITH counted AS (
             INSERT INTO failover_refusals (tenant, principal, dataset, timeline, first_at, last_at)
             VALUES ($1, $2, $3, $4, $5, $5)
             ON CONFLICT ON CONSTRAINT failover_refusals_pkey DO UPDATE
                 SET refusals = failover_refusals.refusals + 1, last_at = EXCLUDED.last_at
             RETURNING refusals)
         INSERT INTO webhook_events (tenant, type, principal, dataset, data)
         SELECT $1, 'feed.history_lost', $2, $3,
                jsonb_build_object('principal', $2::text, 'dataset', $3::text, 'timeline', $4::int)
           FROM counted WHERE refusals = 1",
        tenant,
        principal,
        dataset,
        timeline,
        now,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Whether a point is part of the current history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    Kept,
    /// Its timeline ended before it (`ended_at`), or is not an ancestor of the current one
    /// (`None`): what it saw may no longer exist.
    Lost {
        timeline: i32,
        ended_at: Option<i64>,
    },
    /// The current timeline's history could not be read: nothing can be promised.
    Unknown(String),
}

/// The fate of `point` in `database`'s current history (reads the timeline's history file the
/// first time a point from another timeline is judged; a timeline's history never changes).
pub async fn fate(pool: &PgPool, database: &Database, point: HistoryPoint) -> sqlx::Result<Fate> {
    if point.timeline == database.timeline {
        // Beyond where this history has got to: a restore of a copy that kept its timeline (a
        // file system snapshot) — detectable only until the server writes past the position.
        if point.wal_position > database.wal_position {
            return Ok(Fate::Lost { timeline: point.timeline, ended_at: None });
        }
        return Ok(Fate::Kept);
    }
    if point.timeline > database.timeline {
        return Ok(Fate::Lost { timeline: point.timeline, ended_at: None });
    }
    Ok(match timeline_history(pool, database).await? {
        Ok(history) => judge(point, &history),
        Err(reason) => Fate::Unknown(reason),
    })
}

/// One line of a timeline history file: `timeline` ended where its successor began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Switch {
    timeline: i32,
    ended_at: i64,
}

fn judge(point: HistoryPoint, history: &[Switch]) -> Fate {
    match history.iter().find(|s| s.timeline == point.timeline) {
        Some(switch) if point.wal_position <= switch.ended_at => Fate::Kept,
        Some(switch) => Fate::Lost { timeline: point.timeline, ended_at: Some(switch.ended_at) },
        None => Fate::Lost { timeline: point.timeline, ended_at: None },
    }
}

type Histories = Mutex<HashMap<(String, i32), Arc<Vec<Switch>>>>;
static HISTORIES: LazyLock<Histories> = LazyLock::new(Default::default);
/// Timelines whose history could not be read (logged once each).
static UNREADABLE: LazyLock<Mutex<std::collections::HashSet<(String, i32)>>> = LazyLock::new(Default::default);

/// The ancestors of the current timeline and where each ended: `pg_wal/<timeline>.history`
/// (reading it needs `pg_read_server_files`, or EXECUTE on `pg_read_file(text)`; see
/// docs/operations.md). `Err` says why it could not be read.
async fn timeline_history(pool: &PgPool, database: &Database) -> sqlx::Result<Result<Arc<Vec<Switch>>, String>> {
    let key = (database.system_identifier.clone(), database.timeline);
    if let Some(history) = HISTORIES.lock().expect("history cache").get(&key) {
        return Ok(Ok(history.clone()));
    }
    let file = format!("pg_wal/{:08X}.history", database.timeline);
    let text = match sqlx::query_scalar!(r#"SELECT pg_read_file($1) AS "text!""#, file).fetch_one(pool).await {
        Ok(text) => text,
        Err(sqlx::Error::Database(e)) => {
            let reason = format!("reading {file}: {} (SQLSTATE {})", e.message(), e.code().unwrap_or_default());
            // Once per timeline and process: every request with an older cursor meets it.
            if UNREADABLE.lock().expect("history cache").insert(key) {
                tracing::error!(
                    file,
                    error = %e.message(),
                    "cannot read the timeline history after a failover; grant the exportd role pg_read_server_files (or EXECUTE on pg_read_file(text)) so positions from the previous timeline can be checked"
                );
            }
            return Ok(Err(reason));
        }
        Err(e) => return Err(e),
    };
    let history = match parse_history(&text) {
        Ok(history) => Arc::new(history),
        Err(reason) => return Ok(Err(format!("{file}: {reason}"))),
    };
    HISTORIES.lock().expect("history cache").insert(key, history.clone());
    Ok(Ok(history))
}

/// Lines of `<parent timeline>\t<switch point>\t<reason>`; blank lines and `#` comments skipped.
fn parse_history(text: &str) -> Result<Vec<Switch>, String> {
    let mut switches = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let mut fields = line.split_whitespace();
        let (Some(timeline), Some(lsn)) = (fields.next(), fields.next()) else {
            return Err(format!("unreadable line `{line}`"));
        };
        let timeline = timeline.parse().map_err(|_| format!("bad timeline in `{line}`"))?;
        let ended_at = parse_lsn(lsn).ok_or_else(|| format!("bad switch point in `{line}`"))?;
        switches.push(Switch { timeline, ended_at });
    }
    Ok(switches)
}

/// `16/B374D848` → bytes.
fn parse_lsn(text: &str) -> Option<i64> {
    let (high, low) = text.split_once('/')?;
    let value = (u64::from_str_radix(high, 16).ok()? << 32) | u64::from_str_radix(low, 16).ok()?;
    i64::try_from(value).ok()
}

/// `bytes` → `16/B374D848`, as PostgreSQL writes positions.
pub fn format_lsn(bytes: i64) -> String {
    format!("{:X}/{:X}", (bytes as u64) >> 32, (bytes as u64) & 0xFFFF_FFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_survives_exactly_when_its_timeline_ended_at_or_after_it() {
        // Timeline 3's history: 1 ended at 0/3000000, 2 at 0/5000000.
        let history =
            parse_history("1\t0/3000000\tno recovery target specified\n\n2\t0/5000000\tbefore 2026\n").unwrap();
        let at = |timeline, wal_position| judge(HistoryPoint { timeline, wal_position }, &history);
        assert_eq!(at(1, 0x300_0000), Fate::Kept, "on the switch point itself");
        assert_eq!(at(1, 0x300_0001), Fate::Lost { timeline: 1, ended_at: Some(0x300_0000) });
        assert_eq!(at(2, 0x400_0000), Fate::Kept, "timeline 2 ran past 0/3000000");
        assert_eq!(at(2, 0x500_0008), Fate::Lost { timeline: 2, ended_at: Some(0x500_0000) });
        assert_eq!(at(7, 1), Fate::Lost { timeline: 7, ended_at: None }, "not an ancestor");
        assert!(parse_history("1 0/3000000").is_ok(), "the reason is optional");
        assert!(parse_history("one\t0/3\n").is_err());
        assert!(parse_history("1\t03000000\n").is_err());
    }

    #[test]
    fn positions_read_and_write_like_postgresql() {
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(format_lsn(0x16_B374_D848), "16/B374D848");
        assert_eq!(format_lsn(0), "0/0");
        assert_eq!(parse_lsn("FFFFFFFF/FFFFFFFF"), None, "beyond bigint");
    }
}
