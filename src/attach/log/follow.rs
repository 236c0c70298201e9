//! Following a log attachment's slot: peek the host transactions committed since the applied
//! position (`pg_logical_slot_peek_binary_changes`, pgoutput v1: whole transactions, in commit
//! order), apply them to the record store in one exportd transaction with the position they
//! reach, commit, and only then advance the slot. A kill before the commit applies nothing; a
//! kill after it re-reads transactions the applied position skips.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use pg_walstream::{LogicalReplicationMessage, LogicalReplicationParser, TupleData};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;

use super::connect;
use super::images::{self, Evaluated as Row, Image, Kept, Op, Placed};
use crate::attach::resolve::{self, Evaluated, Resolved};
use crate::tenants::Registry;

#[derive(Debug, Clone, Copy)]
pub struct FollowOptions {
    /// How often each slot is peeked when there was nothing to apply.
    pub poll: Duration,
    /// Changes (pgoutput messages) per peek, at least: whole transactions are read.
    pub changes_per_peek: i32,
}

impl Default for FollowOptions {
    fn default() -> Self {
        FollowOptions { poll: Duration::from_millis(200), changes_per_peek: 20_000 }
    }
}

/// Changes applied per statement (and their images' bytes): a large host transaction is applied
/// in pieces of this size, all in its one exportd transaction.
const CHUNK_CHANGES: usize = 2_000;
const CHUNK_BYTES: usize = 8 << 20;

/// Follows every live log attachment until shutdown.
pub async fn run(pool: PgPool, registry: Arc<Registry>, options: FollowOptions, mut shutdown: watch::Receiver<bool>) {
    let mut hosts = Hosts::default();
    loop {
        if *shutdown.borrow() {
            break;
        }
        let applied = match follow_each(&pool, &registry, options, &mut hosts).await {
            Ok(applied) => applied,
            Err(e) => {
                tracing::warn!(error = %e, "following attached host tables");
                0
            }
        };
        if applied == 0 {
            tokio::select! {
                _ = tokio::time::sleep(options.poll) => {}
                _ = shutdown.changed() => {}
            }
        }
    }
    hosts.close().await;
}

/// Follows every live log attachment once (each up to `changes_per_peek` changes); returns the
/// host transactions applied.
pub async fn follow_all(pool: &PgPool, registry: &Registry, options: FollowOptions) -> anyhow::Result<u64> {
    let mut hosts = Hosts::default();
    let applied = follow_each(pool, registry, options, &mut hosts).await;
    hosts.close().await;
    applied
}

/// Host pools and resolved bindings, kept across peeks.
#[derive(Default)]
struct Hosts(HashMap<i64, (PgPool, Arc<Resolved>)>);

impl Hosts {
    async fn get(&mut self, pool: &PgPool, registry: &Registry, id: i64) -> anyhow::Result<(PgPool, Arc<Resolved>)> {
        if let Some(found) = self.0.get(&id) {
            return Ok(found.clone());
        }
        let attachment =
            crate::attach::by_id(pool, id).await?.ok_or_else(|| anyhow::anyhow!("attachment {id} is gone"))?;
        let source =
            attachment.spec.source.as_deref().ok_or_else(|| anyhow::anyhow!("a log attachment has a source"))?;
        let host = connect(source, 2).await?;
        let resolved = resolve::resolve(pool, &host, registry, &attachment.spec, Evaluated::OverImages).await?;
        let entry = (host, Arc::new(resolved));
        self.0.insert(id, entry.clone());
        Ok(entry)
    }

    async fn forget(&mut self, id: i64) {
        if let Some((host, _)) = self.0.remove(&id) {
            host.close().await;
        }
    }

    async fn close(self) {
        for (host, _) in self.0.into_values() {
            host.close().await;
        }
    }
}

async fn follow_each(
    pool: &PgPool,
    registry: &Registry,
    options: FollowOptions,
    hosts: &mut Hosts,
) -> anyhow::Result<u64> {
    let ids = sqlx::query_scalar!("SELECT id FROM attachments WHERE capture = 'log' AND state = 'live' ORDER BY id")
        .fetch_all(pool)
        .await?;
    let mut applied = 0;
    for id in ids {
        let result = match hosts.get(pool, registry, id).await {
            Ok((host, resolved)) => follow_one(pool, &host, &resolved, id, options).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(n) => applied += n,
            Err(e) => {
                let said = without_values(&e);
                tracing::warn!(attachment = id, error = %said, "following an attached host table");
                record_error(pool, id, &said).await;
                hosts.forget(id).await;
            }
        }
    }
    Ok(applied)
}

/// A failure as it may be shown and logged: a database's message can quote a host row's value
/// (`invalid input syntax for type integer: "…"`), of any tenant the attachment feeds, so it
/// is named by its SQLSTATE only; exportd's own messages name no value.
fn without_values(e: &anyhow::Error) -> String {
    match e.downcast_ref::<sqlx::Error>().and_then(|e| e.as_database_error()) {
        Some(d) => format!(
            "a statement on the host or in exportd's database failed with SQLSTATE {} (the server's log says which)",
            d.code().unwrap_or_default()
        ),
        None => e.to_string(),
    }
}

async fn record_error(pool: &PgPool, id: i64, said: &str) {
    let _ = sqlx::query!("UPDATE attachments SET last_error = $2, updated_at = now() WHERE id = $1", id, said)
        .execute(pool)
        .await;
}

/// The host's view of the slot.
struct SlotHealth {
    wal_status: Option<String>,
    current: u64,
    confirmed: u64,
    retained: i64,
}

async fn slot_health(host: &PgPool, slot: &str) -> anyhow::Result<Option<SlotHealth>> {
    let row = sqlx::query!(
        r#"SELECT s.wal_status, pg_current_wal_lsn()::text AS "current!", s.confirmed_flush_lsn::text AS confirmed,
                  pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained
           FROM pg_replication_slots s WHERE s.slot_name = $1"#,
        slot
    )
    .fetch_optional(host)
    .await?;
    Ok(row.map(|r| SlotHealth {
        wal_status: r.wal_status,
        current: parse_lsn(&r.current),
        confirmed: r.confirmed.as_deref().map_or(0, parse_lsn),
        retained: r.retained.unwrap_or(0),
    }))
}

/// Peeks and applies one attachment's next host transactions; returns how many were applied.
async fn follow_one(
    pool: &PgPool,
    host: &PgPool,
    resolved: &Resolved,
    id: i64,
    options: FollowOptions,
) -> anyhow::Result<u64> {
    let mut tx = pool.begin().await?;
    // One follower per attachment at a time: the others skip it.
    let Some(at) = sqlx::query!(
        r#"SELECT state, applied_lsn::text, copy_round, slot AS "slot!" FROM attachments
           WHERE id = $1 AND capture = 'log' FOR UPDATE SKIP LOCKED"#,
        id
    )
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Ok(0);
    };
    if at.state != "live" {
        return Ok(0);
    }
    let health = slot_health(host, &at.slot).await?;
    let lost = match &health {
        None => Some(format!("the host has no slot `{}` any more (dropped outside exportd)", at.slot)),
        Some(h) if h.wal_status.as_deref() == Some("lost") => Some(format!(
            "the host removed WAL slot `{}` still needed (max_slot_wal_keep_size): changes since are unknown",
            at.slot
        )),
        Some(_) => None,
    };
    if let Some(reason) = lost {
        sqlx::query!(
            "UPDATE attachments SET state = 'lost', lost_reason = $2, updated_at = now() WHERE id = $1",
            id,
            reason
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query!(
            "INSERT INTO webhook_events (tenant, type, dataset, data)
             SELECT t, 'attachment.lost', a.dataset, jsonb_build_object('dataset', a.dataset, 'reason', $2::text)
             FROM attachments a CROSS JOIN unnest(a.tenants) AS t WHERE a.id = $1",
            id,
            reason
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        tracing::warn!(attachment = id, reason, "attachment lost; resync it (`exportd attach --resync`)");
        return Ok(0);
    }
    let health = health.expect("checked above");
    let applied_before = at.applied_lsn.as_deref().map_or(0, parse_lsn);
    let snapshots = copy_snapshots(&mut tx, id, at.copy_round).await?;
    let mut follower =
        Applier { resolved, id, round: at.copy_round, snapshots, chunk: Vec::new(), chunk_bytes: 0, written: 0 };

    let upto = health.current;
    let mut parser = LogicalReplicationParser::with_protocol_version(1);
    let mut relations: HashMap<u32, Vec<(String, u32)>> = HashMap::new();
    let mut messages = 0i64;
    let mut txn: Option<(u32, u64, bool)> = None;
    let mut last_end = applied_before;
    let mut transactions = 0u64;
    {
        let mut rows = sqlx::query_scalar::<_, Vec<u8>>(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, $2::text::pg_lsn, $3,
                 'proto_version', '1', 'publication_names', $4)",
        )
        .bind(&at.slot)
        .bind(format_lsn(upto))
        .bind(options.changes_per_peek)
        .bind(&at.slot)
        .fetch(host);
        while let Some(data) = rows.try_next().await? {
            messages += 1;
            let message = parser.parse_wal_message(&data).map_err(|e| anyhow::anyhow!("pgoutput: {e}"))?.message;
            match message {
                LogicalReplicationMessage::Begin { final_lsn, xid, .. } => {
                    // Already applied: its commit is before the applied position.
                    txn = Some((xid, final_lsn, final_lsn < applied_before));
                }
                LogicalReplicationMessage::Relation { relation_id, columns, .. } => {
                    relations.insert(relation_id, columns.iter().map(|c| (c.name.to_string(), c.type_id)).collect());
                }
                LogicalReplicationMessage::Commit { end_lsn, .. } => {
                    if let Some((_, _, false)) = txn {
                        last_end = end_lsn;
                        transactions += 1;
                    }
                    txn = None;
                }
                change => {
                    let Some((xid, lsn, false)) = txn else { continue };
                    if let Some(change) = Change::of(change, &relations)? {
                        follower.push(&mut tx, Logged { xid, lsn, change }).await?;
                    }
                }
            }
        }
    }
    follower.flush(&mut tx).await?;
    images::announce_quarantined(&mut tx, id, &resolved.dataset).await?;
    // Every transaction committed before `upto` was read, unless the peek stopped at its limit.
    let complete = messages < i64::from(options.changes_per_peek);
    let applied = if complete { applied_before.max(upto) } else { last_end.max(applied_before) };
    let lag = health.current.saturating_sub(applied) as i64;
    sqlx::query!(
        "UPDATE attachments SET applied_lsn = $2::text::pg_lsn, followed_at = now(), retained_bytes = $3, lag_bytes = $4,
                rows_written = rows_written + $5, last_error = NULL,
                updated_at = CASE WHEN $5 > 0 THEN now() ELSE updated_at END
         WHERE id = $1",
        id,
        format_lsn(applied),
        health.retained,
        lag,
        follower.written,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    if applied > health.confirmed {
        sqlx::query("SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)")
            .bind(&at.slot)
            .bind(format_lsn(applied))
            .execute(host)
            .await?;
    }
    Ok(transactions)
}

/// The copy batches' snapshots of the current round, by batch.
async fn copy_snapshots(conn: &mut PgConnection, id: i64, round: i32) -> anyhow::Result<HashMap<i32, Snapshot>> {
    let rows = sqlx::query!(
        r#"SELECT batch, snapshot::text AS "snapshot!" FROM attachment_copy_batches WHERE attachment = $1 AND round = $2"#,
        id,
        round
    )
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter().map(|r| Ok((r.batch, Snapshot::parse(&r.snapshot)?))).collect()
}

/// A `pg_snapshot`: which transactions it sees.
#[derive(Debug, Clone, PartialEq)]
struct Snapshot {
    xmin: u64,
    xmax: u64,
    running: Vec<u64>,
}

impl Snapshot {
    fn parse(text: &str) -> anyhow::Result<Snapshot> {
        let bad = || anyhow::anyhow!("not a pg_snapshot: {text}");
        let mut parts = text.split(':');
        let xmin = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let xmax = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let running = match parts.next() {
            Some("") | None => Vec::new(),
            Some(list) => list.split(',').map(|x| x.parse().map_err(|_| bad())).collect::<Result<_, _>>()?,
        };
        Ok(Snapshot { xmin, xmax, running })
    }

    /// Whether the snapshot sees (the commit of) transaction `xid`, a 32-bit id from the log:
    /// the full id is the one of its three possible epochs nearest the snapshot's.
    fn sees(&self, xid: u32) -> bool {
        let epoch = self.xmax >> 32;
        let full = [epoch.saturating_sub(1), epoch, epoch + 1]
            .into_iter()
            .map(|e| (e << 32) | u64::from(xid))
            .min_by_key(|full| full.abs_diff(self.xmax))
            .expect("three candidates");
        full < self.xmin || (full < self.xmax && !self.running.contains(&full))
    }
}

/// A host row as pgoutput sent it: the columns it carried, and those it marked unchanged.
#[derive(Debug, Clone)]
struct Tuple {
    image: Image,
    unchanged: Vec<String>,
}

impl Tuple {
    fn of(data: &TupleData, columns: &[(String, u32)]) -> anyhow::Result<Tuple> {
        const JSON: u32 = 114;
        const JSONB: u32 = 3802;
        let mut tuple = Tuple { image: Image::new(), unchanged: Vec::new() };
        for (value, (name, ty)) in data.columns.iter().zip(columns) {
            match value.data_type {
                b'n' => {
                    tuple.image.insert(name.clone(), Value::Null);
                }
                b'u' => tuple.unchanged.push(name.clone()),
                b't' => {
                    let text =
                        value.as_str().ok_or_else(|| anyhow::anyhow!("pgoutput: column `{name}` is not text"))?;
                    let json = match *ty {
                        JSON | JSONB => serde_json::from_str(&text).unwrap_or(Value::String(text.into_owned())),
                        _ => Value::String(text.into_owned()),
                    };
                    tuple.image.insert(name.clone(), json);
                }
                other => anyhow::bail!("pgoutput: column `{name}` in format `{}`", other as char),
            }
        }
        Ok(tuple)
    }

    fn bytes(&self) -> usize {
        self.image.values().map(|v| v.as_str().map_or(16, str::len)).sum()
    }
}

#[derive(Debug, Clone)]
enum Change {
    Insert {
        new: Tuple,
    },
    /// `old` is the whole old row when `old_full` (REPLICA IDENTITY FULL), else only its key.
    Update {
        old: Option<Tuple>,
        old_full: bool,
        new: Tuple,
    },
    Delete {
        old: Tuple,
    },
    Truncate,
}

impl Change {
    fn of(
        message: LogicalReplicationMessage,
        relations: &HashMap<u32, Vec<(String, u32)>>,
    ) -> anyhow::Result<Option<Change>> {
        let columns = |id: u32| {
            relations
                .get(&id)
                .ok_or_else(|| anyhow::anyhow!("pgoutput: a change of relation {id} before its description"))
        };
        Ok(Some(match message {
            LogicalReplicationMessage::Insert { relation_id, tuple } => {
                Change::Insert { new: Tuple::of(&tuple, columns(relation_id)?)? }
            }
            LogicalReplicationMessage::Update { relation_id, old_tuple, new_tuple, key_type } => {
                let columns = columns(relation_id)?;
                let old = old_tuple.map(|t| Tuple::of(&t, columns)).transpose()?;
                Change::Update { old, old_full: key_type == Some('O'), new: Tuple::of(&new_tuple, columns)? }
            }
            LogicalReplicationMessage::Delete { relation_id, old_tuple, .. } => {
                Change::Delete { old: Tuple::of(&old_tuple, columns(relation_id)?)? }
            }
            LogicalReplicationMessage::Truncate { .. } => Change::Truncate,
            _ => return Ok(None),
        }))
    }
}

/// A change of a host transaction (`xid`, committed at `lsn`).
#[derive(Debug, Clone)]
struct Logged {
    xid: u32,
    lsn: u64,
    change: Change,
}

/// Whose tenant a kept row has: known, or the tenant the `n`-th image of the chunk evaluates to.
#[derive(Debug, Clone)]
enum TenantOf {
    Known(Option<String>),
    Image(usize),
}

/// A row's last image as the chunk goes.
#[derive(Debug, Clone)]
struct Prior {
    tenant: TenantOf,
    image: Image,
    copied: Option<(i32, i32)>,
}

enum Pending {
    Put { image: usize, old: Option<(TenantOf, String)>, lsn: u64 },
    Remove { tenant: TenantOf, key: String },
    KeepOnly { batches: Vec<i32> },
}

/// Applies logged changes in chunks, in the follower's transaction.
struct Applier<'a> {
    resolved: &'a Resolved,
    id: i64,
    round: i32,
    snapshots: HashMap<i32, Snapshot>,
    chunk: Vec<Logged>,
    chunk_bytes: usize,
    written: i64,
}

impl Applier<'_> {
    async fn push(&mut self, conn: &mut PgConnection, logged: Logged) -> anyhow::Result<()> {
        self.chunk_bytes += match &logged.change {
            Change::Insert { new } | Change::Update { new, .. } => new.bytes(),
            Change::Delete { old } => old.bytes(),
            Change::Truncate => 0,
        };
        self.chunk.push(logged);
        if self.chunk.len() >= CHUNK_CHANGES || self.chunk_bytes >= CHUNK_BYTES {
            self.flush(conn).await?;
        }
        Ok(())
    }

    /// The row of `key` as the chunk has left it so far: changed earlier in the chunk, else as
    /// kept (unless a TRUNCATE earlier in the chunk removed it: only rows copied in batches
    /// that saw the TRUNCATE are left).
    fn prior_of(
        &self,
        rows: &HashMap<String, Option<Prior>>,
        kept: &HashMap<String, Kept>,
        truncated: Option<&[i32]>,
        key: &str,
    ) -> Option<Prior> {
        if let Some(row) = rows.get(key) {
            return row.clone();
        }
        let k = kept.get(key)?;
        let prior = Prior { tenant: TenantOf::Known(k.tenant.clone()), image: k.image.clone(), copied: k.copied };
        match truncated {
            Some(batches) => prior.copied.filter(|(r, b)| *r == self.round && batches.contains(b)).map(|_| prior),
            None => Some(prior),
        }
    }

    /// Whether the copy batch whose key range holds a row already saw transaction `xid`: then
    /// the row is as that transaction left it (or gone), in the copy.
    fn covered(&self, batch: Option<i32>, xid: u32) -> bool {
        batch.and_then(|b| self.snapshots.get(&b)).is_some_and(|s| s.sees(xid))
    }

    async fn flush(&mut self, conn: &mut PgConnection) -> anyhow::Result<()> {
        let chunk = std::mem::take(&mut self.chunk);
        self.chunk_bytes = 0;
        if chunk.is_empty() {
            return Ok(());
        }
        // The key of every tuple that names a row, in one statement.
        let mut named: Vec<&Image> = Vec::new();
        for logged in &chunk {
            match &logged.change {
                Change::Insert { new } => named.push(&new.image),
                Change::Update { old, new, .. } => {
                    named.push(&old.as_ref().unwrap_or(new).image);
                    named.push(&new.image);
                }
                Change::Delete { old } => named.push(&old.image),
                Change::Truncate => {}
            }
        }
        // Which copy batch holds each row matters only for a transaction some batch's snapshot
        // saw: once the log is past the copy, no lookup.
        let copy_saw_some = chunk.iter().any(|l| self.snapshots.values().any(|s| s.sees(l.xid)));
        let round = if copy_saw_some { Some(self.round) } else { None };
        let keys = images::keys(conn, self.resolved, self.id, round, &named).await?;
        let names: Vec<String> = keys.iter().map(|p| p.key.clone()).collect();
        let kept = images::kept(conn, self.id, &names).await?;
        let mut keys = keys.into_iter();
        let mut next_key = || keys.next().ok_or_else(|| anyhow::anyhow!("a key per tuple"));

        // Each change against the rows as the chunk leaves them, in order.
        let mut rows: HashMap<String, Option<Prior>> = HashMap::new();
        let mut truncated: Option<Vec<i32>> = None;
        let mut puts: Vec<Image> = Vec::new();
        let mut pending: Vec<Pending> = Vec::new();
        for Logged { xid, lsn, change } in chunk {
            match change {
                Change::Insert { new } => {
                    let Placed { key, batch } = next_key()?;
                    if self.covered(batch, xid) {
                        continue;
                    }
                    let prior = self.prior_of(&rows, &kept, truncated.as_deref(), &key);
                    let old = prior.map(|p| (p.tenant, key.clone()));
                    pending.push(Pending::Put { image: puts.len(), old, lsn });
                    rows.insert(
                        key,
                        Some(Prior { tenant: TenantOf::Image(puts.len()), image: new.image.clone(), copied: None }),
                    );
                    puts.push(new.image);
                }
                Change::Update { old, old_full, new } => {
                    let (Placed { key: old_key, batch: old_batch }, Placed { key: new_key, batch: new_batch }) =
                        (next_key()?, next_key()?);
                    let prior_old = self.prior_of(&rows, &kept, truncated.as_deref(), &old_key);
                    if new_key != old_key
                        && !self.covered(old_batch, xid)
                        && let Some(p) = &prior_old
                    {
                        pending.push(Pending::Remove { tenant: p.tenant.clone(), key: old_key.clone() });
                        rows.insert(old_key.clone(), None);
                    }
                    if self.covered(new_batch, xid) {
                        continue;
                    }
                    let prior_new = self.prior_of(&rows, &kept, truncated.as_deref(), &new_key);
                    let image = merged(&new, old.as_ref().filter(|_| old_full), prior_old.as_ref())?;
                    let old = prior_new.map(|p| (p.tenant, new_key.clone()));
                    pending.push(Pending::Put { image: puts.len(), old, lsn });
                    rows.insert(
                        new_key,
                        Some(Prior { tenant: TenantOf::Image(puts.len()), image: image.clone(), copied: None }),
                    );
                    puts.push(image);
                }
                Change::Delete { .. } => {
                    let Placed { key, batch } = next_key()?;
                    if self.covered(batch, xid) {
                        continue;
                    }
                    let Some(prior) = self.prior_of(&rows, &kept, truncated.as_deref(), &key) else { continue };
                    pending.push(Pending::Remove { tenant: prior.tenant, key: key.clone() });
                    rows.insert(key, None);
                }
                Change::Truncate => {
                    let batches: Vec<i32> =
                        self.snapshots.iter().filter(|(_, s)| s.sees(xid)).map(|(batch, _)| *batch).collect();
                    for row in rows.values_mut() {
                        let keep = row
                            .as_ref()
                            .and_then(|p| p.copied)
                            .is_some_and(|(r, b)| r == self.round && batches.contains(&b));
                        if !keep {
                            *row = None;
                        }
                    }
                    truncated = Some(match truncated {
                        // Two in one chunk: only rows both left.
                        Some(earlier) => earlier.into_iter().filter(|b| batches.contains(b)).collect(),
                        None => batches.clone(),
                    });
                    pending.push(Pending::KeepOnly { batches });
                }
            }
        }

        let refs: Vec<&Image> = puts.iter().collect();
        let evaluated: Vec<Row> = images::evaluate(conn, self.resolved, &refs).await?;
        let tenant = |of: TenantOf| match of {
            TenantOf::Known(tenant) => tenant,
            TenantOf::Image(n) => evaluated[n].tenant.clone(),
        };
        let ops: Vec<Op> = pending
            .into_iter()
            .map(|p| match p {
                Pending::Put { image, old, lsn } => Op::Put {
                    row: evaluated[image].clone(),
                    image: puts[image].clone(),
                    old: old.map(|(t, k)| (tenant(t), k)),
                    copied: None,
                    lsn: Some(format_lsn(lsn)),
                },
                Pending::Remove { tenant: of, key } => Op::Remove { tenant: tenant(of), key },
                Pending::KeepOnly { batches } => Op::KeepOnly { round: self.round, batches },
            })
            .collect();
        self.written += images::apply(conn, self.id, &self.resolved.dataset, &ops).await?;
        Ok(())
    }
}

/// The new row of an update whole: each column pgoutput left out as unchanged (TOASTed) taken
/// from the old row it sent (REPLICA IDENTITY FULL), else from the row's kept image.
fn merged(new: &Tuple, old: Option<&Tuple>, prior: Option<&Prior>) -> anyhow::Result<Image> {
    let mut image = new.image.clone();
    for column in &new.unchanged {
        let value = old
            .and_then(|o| o.image.get(column).filter(|_| !o.unchanged.contains(column)))
            .or_else(|| prior.and_then(|p| p.image.get(column)));
        let value = value.ok_or_else(|| {
            anyhow::anyhow!(
                "an update left column `{column}` unchanged (TOASTed) and its value is unknown: \
                 set REPLICA IDENTITY FULL on the host table and resync"
            )
        })?;
        image.insert(column.clone(), value.clone());
    }
    Ok(image)
}

fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

fn parse_lsn(text: &str) -> u64 {
    let (high, low) = text.split_once('/').unwrap_or(("0", "0"));
    (u64::from_str_radix(high, 16).unwrap_or(0) << 32) | u64::from_str_radix(low, 16).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_sees_what_committed_before_it_and_not_what_ran_or_came_after() {
        let s = Snapshot::parse("100:110:102,105").unwrap();
        assert!(s.sees(99) && s.sees(101) && s.sees(109), "ended before the snapshot");
        assert!(!s.sees(102) && !s.sees(105), "running when it was taken");
        assert!(!s.sees(110) && !s.sees(200), "began after it");
        let empty = Snapshot::parse("7:7:").unwrap();
        assert!(empty.sees(6) && !empty.sees(7));
        assert!(Snapshot::parse("x:1:").is_err());
    }

    #[test]
    fn a_32_bit_xid_is_read_in_the_epoch_nearest_the_snapshot() {
        // The snapshot is just past an epoch boundary: xid 4 294 967 290 is of the epoch before.
        let s = Snapshot::parse(&format!("{}:{}:", (1u64 << 32) + 5, (1u64 << 32) + 10)).unwrap();
        assert!(s.sees(u32::MAX - 5), "the previous epoch's last ids are long committed");
        assert!(s.sees(3), "this epoch's first ids before xmin");
        assert!(!s.sees(11), "after xmax");
    }

    fn tuple(values: &[(&str, Value)], unchanged: &[&str]) -> Tuple {
        Tuple {
            image: values.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
            unchanged: unchanged.iter().map(|c| c.to_string()).collect(),
        }
    }

    #[test]
    fn an_unchanged_toasted_value_is_taken_from_the_full_old_row_else_the_kept_image() {
        use serde_json::json;
        let new = tuple(&[("id", json!("7")), ("title", json!("new"))], &["body"]);
        let kept = Prior {
            tenant: TenantOf::Known(Some("acme".into())),
            image: tuple(&[("id", json!("7")), ("title", json!("old")), ("body", json!("kept body"))], &[]).image,
            copied: None,
        };
        let merged_row = merged(&new, None, Some(&kept)).unwrap();
        assert_eq!((merged_row["title"].clone(), merged_row["body"].clone()), (json!("new"), json!("kept body")));
        // REPLICA IDENTITY FULL: the old row pgoutput sent wins over the image.
        let old = tuple(&[("id", json!("7")), ("title", json!("old")), ("body", json!("old row body"))], &[]);
        assert_eq!(merged(&new, Some(&old), Some(&kept)).unwrap()["body"], json!("old row body"));
        // A value that is unchanged in the old row too is not taken from it.
        let old_unchanged = tuple(&[("id", json!("7"))], &["body"]);
        assert_eq!(merged(&new, Some(&old_unchanged), Some(&kept)).unwrap()["body"], json!("kept body"));
        // Nothing to take it from: refused, naming the column — never written as NULL.
        let refused = merged(&new, None, None).unwrap_err().to_string();
        assert!(refused.contains("`body`") && refused.contains("REPLICA IDENTITY FULL"), "{refused}");
    }

    #[test]
    fn lsns_round_trip_as_postgresql_writes_them() {
        assert_eq!(format_lsn(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("16/B374D848"), 0x16_B374_D848);
        assert_eq!(parse_lsn(&format_lsn(0)), 0);
    }
}
