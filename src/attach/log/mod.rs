//! Log capture: a host table in any PostgreSQL with `wal_level = logical` followed through a
//! publication and a logical replication slot (`pgoutput`, over the SQL interface), with
//! nothing of exportd's in the host's writes.
//!
//! - [`copy`] reads the rows already there in key order, in batches, each in its own snapshot,
//!   after the slot exists; each batch's snapshot is kept.
//! - [`follow`] peeks the slot's changes, applies each host transaction to the record store in
//!   exportd's own transaction together with the position it reaches, and only then advances the
//!   slot: a kill anywhere applies nothing twice and loses nothing. A logged change to a row a
//!   copy batch read in a snapshot that already saw it is not applied again: copy and log join
//!   with no gap and no overlap.
//! - [`images`] keeps each host row's last image (every column), which an update whose
//!   unchanged TOASTed values pgoutput leaves out, a delete that carries only the key, and a
//!   TRUNCATE that carries nothing are applied against; and evaluates the binding's expressions
//!   over images in exportd's database. A record the dataset refuses is quarantined, not a host
//!   error.

mod copy;
mod follow;
mod images;

use std::str::FromStr;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

pub use copy::copy;
pub use follow::{FollowOptions, follow_all, run};

use super::resolve::{self, Evaluated, Refusal, Resolved, ident};
use super::{Attachment, Spec};
use crate::tenants::Registry;

/// A pool on the host database (few connections: the copy's reads, the slot's peeks).
pub async fn connect(url: &str, connections: u32) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(url)
        .map_err(|_| Refusal("--source: not a PostgreSQL URL (postgres://user@host:port/database)".into()))?
        .application_name("exportd-capture");
    crate::db::pool_options()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(|e| Refusal(format!("--source: cannot connect to the host database: {}", no_url(&e))).into())
}

/// A connection error's text (sqlx's messages never carry the URL's password, but say so
/// explicitly by naming only the kind of failure).
fn no_url(e: &sqlx::Error) -> String {
    match e.as_database_error() {
        Some(d) => d.message().to_owned(),
        None => e.to_string(),
    }
}

/// The URL with its password replaced, for anything shown or logged.
pub fn redacted(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("redacted"));
            parsed.to_string()
        }
        _ => url.to_owned(),
    }
}

/// Registers a log attachment, then creates its publication and slot on the host. The copy
/// ([`copy`]) comes next.
pub(super) async fn attach(
    pool: &PgPool,
    registry: &Registry,
    spec: &Spec,
    source: &str,
) -> anyhow::Result<Attachment> {
    let host = connect(source, 2).await?;
    let result = register(pool, &host, registry, spec, source).await;
    host.close().await;
    result
}

async fn register(
    pool: &PgPool,
    host: &PgPool,
    registry: &Registry,
    spec: &Spec,
    source: &str,
) -> anyhow::Result<Attachment> {
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')").fetch_one(host).await?;
    if wal_level != "logical" {
        return Err(Refusal(format!(
            "--source: the host's wal_level is `{wal_level}`; log capture needs `logical` \
             (ALTER SYSTEM SET wal_level = logical, then restart the host), or attach a table of exportd's \
             own database without --source (trigger capture)"
        ))
        .into());
    }
    let resolved = resolve::resolve(pool, host, registry, spec, Evaluated::OverImages).await?;
    check_identity(host, &resolved).await?;
    let estimate = super::rows_estimate(host, &resolved.table).await?;
    let slot = format!("exportd_{}", &uuid::Uuid::new_v4().simple().to_string()[..20]);
    let id = sqlx::query_scalar!(
        "INSERT INTO attachments (host_table, dataset, spec, tenants, rows_estimate, capture, source, slot)
         VALUES ($1, $2, $3, $4, $5, 'log', $6, $7) RETURNING id",
        resolved.table,
        spec.dataset,
        sqlx::types::Json(spec) as _,
        &resolved.tenants,
        estimate,
        source,
        slot,
    )
    .fetch_one(pool)
    .await?;
    if let Err(e) = ensure_slot(host, &slot, &resolved).await {
        sqlx::query!("DELETE FROM attachments WHERE id = $1", id).execute(pool).await?;
        let _ = drop_slot(host, &slot).await;
        return Err(e);
    }
    super::by_id(pool, id).await?.ok_or_else(|| anyhow::anyhow!("the attachment vanished"))
}

/// The publication, then the slot (a change is decoded with the publications that existed when
/// it was written). Creating the slot waits for the host's running transactions to end.
async fn ensure_slot(host: &PgPool, slot: &str, resolved: &Resolved) -> anyhow::Result<()> {
    let has_publication: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
        .bind(slot)
        .fetch_one(host)
        .await?;
    if !has_publication {
        let mut tx = host.begin().await?;
        sqlx::raw_sql("SET LOCAL lock_timeout = '3s'").execute(&mut *tx).await?;
        let create = format!("CREATE PUBLICATION {} FOR TABLE {}", ident(slot), resolved.qualified_table);
        sqlx::raw_sql(sqlx::AssertSqlSafe(create))
            .execute(&mut *tx)
            .await
            .map_err(|e| host_refusal(e, &resolved.table))?;
        tx.commit().await?;
    }
    let has_slot: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)")
        .bind(slot)
        .fetch_one(host)
        .await?;
    if !has_slot {
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(slot)
            .execute(host)
            .await
            .map_err(|e| host_refusal(e, &resolved.table))?;
    }
    Ok(())
}

/// What the host refused, said with what to grant.
fn host_refusal(e: sqlx::Error, table: &str) -> anyhow::Error {
    match e.as_database_error().and_then(|d| d.code()).as_deref() {
        Some("42501") => Refusal(format!(
            "--source: the host role may not create a publication of `{table}` or a replication slot: \
             it needs to own the table and have the REPLICATION attribute"
        ))
        .into(),
        Some("53400") => Refusal(
            "--source: the host has no free replication slot (raise max_replication_slots and restart it)".into(),
        )
        .into(),
        Some("55P03") => Refusal(format!(
            "table `{table}`: a long-running transaction holds it; nothing was changed — try again when it ends"
        ))
        .into(),
        _ => e.into(),
    }
}

async fn drop_slot(host: &PgPool, slot: &str) -> anyhow::Result<()> {
    sqlx::query("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1")
        .bind(slot)
        .execute(host)
        .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP PUBLICATION IF EXISTS {}", ident(slot)))).execute(host).await?;
    Ok(())
}

/// Updates and deletes carry the row's old key only when the table's replica identity covers
/// the binding's key: the primary key (the default) when the key is it, an identity index on
/// exactly the key columns, or FULL.
async fn check_identity(host: &PgPool, resolved: &Resolved) -> anyhow::Result<()> {
    let identity = sqlx::query!(
        r#"SELECT c.relreplident::text AS "mode!",
                  (SELECT array_agg('"' || replace(a.attname::text, '"', '""') || '"') FROM pg_index i
                     JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
                    WHERE i.indrelid = c.oid
                      AND CASE c.relreplident WHEN 'd' THEN i.indisprimary ELSE i.indisreplident END) AS columns
           FROM pg_class c WHERE c.oid = $1::text::regclass"#,
        resolved.table
    )
    .fetch_one(host)
    .await?;
    if identity.mode == "f" {
        return Ok(());
    }
    let mut key: Vec<String> = resolved.key.iter().map(|(name, _)| name.clone()).collect();
    key.sort();
    let mut identity_columns = identity.columns.unwrap_or_default();
    identity_columns.sort();
    if identity.mode != "n" && identity_columns == key {
        return Ok(());
    }
    Err(Refusal(format!(
        "table `{}`: its REPLICA IDENTITY does not carry the key ({}) in updates and deletes: \
         ALTER TABLE {} REPLICA IDENTITY FULL (or USING INDEX on a unique index of exactly the key)",
        resolved.table,
        key.join(", "),
        resolved.table
    ))
    .into())
}

/// Drops the slot and publication on the host, then the attachment (its records stay). The
/// host must be reachable: a slot left behind would keep the host's WAL forever.
pub(super) async fn detach(pool: &PgPool, attachment: &Attachment) -> anyhow::Result<()> {
    let source = attachment.spec.source.as_deref().ok_or_else(|| anyhow::anyhow!("a log attachment has a source"))?;
    let slot = attachment.slot.as_deref().ok_or_else(|| anyhow::anyhow!("a log attachment has a slot"))?;
    let host = connect(source, 1).await?;
    let mut tx = pool.begin().await?;
    // The follower applies under this row's lock: once held, no peek is running on the slot.
    sqlx::query!("SELECT id FROM attachments WHERE id = $1 FOR UPDATE", attachment.id).fetch_optional(&mut *tx).await?;
    drop_slot(&host, slot).await?;
    host.close().await;
    sqlx::query!("DELETE FROM attachments WHERE id = $1", attachment.id).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// Starts a new copy of a log attachment (after its slot was lost, or whenever an operator
/// wants the record store checked against the host): a new slot, then a copy of every row; rows
/// gone from the host since are deleted at the copy's end, rows unchanged write nothing.
pub async fn resync(pool: &PgPool, attachment: &Attachment) -> anyhow::Result<()> {
    let source = attachment.spec.source.as_deref().ok_or_else(|| Refusal("only a log attachment resyncs".into()))?;
    let slot = attachment.slot.as_deref().ok_or_else(|| anyhow::anyhow!("a log attachment has a slot"))?;
    let host = connect(source, 1).await?;
    let mut tx = pool.begin().await?;
    sqlx::query!("SELECT id FROM attachments WHERE id = $1 FOR UPDATE", attachment.id).fetch_optional(&mut *tx).await?;
    sqlx::query("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1")
        .bind(slot)
        .execute(&host)
        .await?;
    host.close().await;
    sqlx::query!(
        "UPDATE attachments SET copy_round = copy_round + 1, state = 'backfilling', backfill_after = NULL,
                applied_lsn = NULL, lost_reason = NULL, rows_done = 0, rows_written = 0, created_at = now(),
                updated_at = now(), finished_at = NULL
         WHERE id = $1",
        attachment.id
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}
