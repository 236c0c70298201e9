//! Subscriptions in PostgreSQL: mirrored from the tenant files, and their schedules run.
//!
//! A scheduled subscription keeps a chain: a full export first (its `next_cursor` starts the
//! chain), then every `incremental_every` an incremental export from the chain's cursor. Each
//! export of the chain is created as the partner — every quota, fair share, row filter and
//! column policy applies — with the Idempotency-Key `exportd:subscription:<id>:<run>`, so a
//! process dying between creating the export and recording it replays the same export. Only
//! one export of a chain is in flight at a time, and the cursor advances in the transaction
//! that publishes it: the bucket receives every committed change once, in order.

use sqlx::PgPool;
use uuid::Uuid;

use super::Courier;
use crate::auth::Caller;
use crate::exports::{self, ExportError, ExportRequest, FeedContext, IdempotencyKey, Mode};
use crate::tenants::Registry;
use crate::writers::sha256_hex;

/// A refused scheduled export is tried again after at most this long.
const RETRY_REFUSED_AFTER_SECONDS: f64 = 60.0;

/// Records every tenant's subscriptions; those no longer declared stop (their pending
/// deliveries fail saying so). A subscription whose principal, destination, dataset or format
/// changed starts its chain again with a full export.
pub async fn sync(pool: &PgPool, registry: &Registry) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    let mut declared: Vec<(String, String)> = Vec::new();
    for tenant in registry.tenants() {
        for s in &tenant.subscriptions {
            let definition = sha256_hex(
                format!("{}\n{}\n{}\n{}", s.principal, s.destination, s.dataset, s.format.name()).as_bytes(),
            );
            let every = s.incremental_every.map(|d| d.as_secs().clamp(1, i32::MAX as u64) as i32);
            sqlx::query!(
                "INSERT INTO subscriptions (tenant, name, principal, destination, dataset, format, definition,
                                            deliver_full, every_seconds)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                 ON CONFLICT ON CONSTRAINT subscriptions_name DO UPDATE
                    SET principal = EXCLUDED.principal, destination = EXCLUDED.destination,
                        dataset = EXCLUDED.dataset, format = EXCLUDED.format, deliver_full = EXCLUDED.deliver_full,
                        cursor = CASE WHEN subscriptions.definition = EXCLUDED.definition THEN subscriptions.cursor END,
                        definition = EXCLUDED.definition,
                        next_run_at = CASE WHEN subscriptions.every_seconds IS DISTINCT FROM EXCLUDED.every_seconds
                                           THEN now() ELSE subscriptions.next_run_at END,
                        every_seconds = EXCLUDED.every_seconds, active = true",
                tenant.id.as_str(),
                s.name,
                s.principal.as_str(),
                s.destination,
                s.dataset.as_str(),
                s.format.name(),
                definition,
                s.full_exports,
                every,
            )
            .execute(&mut *tx)
            .await?;
            declared.push((tenant.id.as_str().to_owned(), s.name.clone()));
        }
    }
    let (tenants, names): (Vec<String>, Vec<String>) = declared.into_iter().unzip();
    sqlx::query!(
        "UPDATE subscriptions SET active = false
          WHERE active AND (tenant, name) NOT IN (SELECT * FROM unnest($1::text[], $2::text[]))",
        &tenants,
        &names,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Creates the scheduled exports that are due: a subscription whose time has come and whose
/// previous export has ended. Several processes run this at once without doubling an export
/// (the rows are locked, and a replayed key gives the same export).
pub async fn schedule(courier: &Courier) -> anyhow::Result<()> {
    let mut tx = courier.pool.begin().await?;
    // NO KEY UPDATE: the export's insert checks its foreign key to this row (KEY SHARE) meanwhile.
    let due = sqlx::query!(
        "SELECT s.id, s.tenant, s.name, s.principal, s.dataset, s.format, s.cursor, s.runs, s.every_seconds
           FROM subscriptions s LEFT JOIN export_jobs j ON j.id = s.last_export_id
          WHERE s.active AND s.every_seconds IS NOT NULL AND s.next_run_at <= now()
            AND (j.id IS NULL OR j.state IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'EXPIRED', 'REVOKED'))
          ORDER BY s.next_run_at LIMIT 16
          FOR NO KEY UPDATE OF s SKIP LOCKED",
    )
    .fetch_all(&mut *tx)
    .await?;
    if due.is_empty() {
        return Ok(());
    }
    let database = crate::history::Database::identify(&courier.pool).await?;
    for s in due {
        let every = f64::from(s.every_seconds.unwrap_or(60));
        let run = Run { id: s.id, tenant: &s.tenant, principal: &s.principal, dataset: &s.dataset, format: &s.format };
        let created = run.create(courier, &database, s.cursor.as_deref(), s.runs).await;
        match created {
            Ok(export) => {
                sqlx::query!(
                    "UPDATE subscriptions SET runs = runs + 1, last_export_id = $2, last_error = NULL,
                            next_run_at = now() + make_interval(secs => $3)
                      WHERE id = $1",
                    s.id,
                    export,
                    every,
                )
                .execute(&mut *tx)
                .await?;
                tracing::info!(tenant = %s.tenant, subscription = %s.name, export = %export, "scheduled export created");
            }
            Err(Refusal { error, restart_chain }) => {
                tracing::warn!(tenant = %s.tenant, subscription = %s.name, error = %error, "scheduled export refused");
                sqlx::query!(
                    "UPDATE subscriptions SET last_error = $2,
                            cursor = CASE WHEN $3 THEN NULL ELSE cursor END,
                            next_run_at = now() + make_interval(secs => least($4::float8, $5::float8))
                      WHERE id = $1",
                    s.id,
                    error,
                    restart_chain,
                    every,
                    RETRY_REFUSED_AFTER_SECONDS,
                )
                .execute(&mut *tx)
                .await?;
            }
        }
    }
    tx.commit().await?;
    Ok(())
}

/// One scheduled run of a subscription.
struct Run<'a> {
    id: Uuid,
    tenant: &'a str,
    principal: &'a str,
    dataset: &'a str,
    format: &'a str,
}

/// Why a run created no export, and whether the chain must start again from a full export
/// (its cursor expired or no longer fits the partner's row filter or column policy).
struct Refusal {
    error: String,
    restart_chain: bool,
}

impl Run<'_> {
    async fn create(
        &self,
        courier: &Courier,
        database: &crate::history::Database,
        cursor: Option<&str>,
        run: i64,
    ) -> Result<Uuid, Refusal> {
        let refused = |error: String| Refusal { error, restart_chain: false };
        let tenant = courier.registry.get(self.tenant).ok_or_else(|| refused("the tenant is gone".into()))?;
        let principal = tenant
            .principal(self.principal)
            .filter(|p| !p.disabled)
            .ok_or_else(|| refused(format!("the principal `{}` is unknown or disabled", self.principal)))?;
        let caller = Caller { tenant: tenant.clone(), principal: principal.clone() };
        let format = serde_json::from_value(serde_json::Value::String(self.format.to_owned()))
            .map_err(|_| refused(format!("unknown format `{}`", self.format)))?;
        let request = ExportRequest {
            dataset: self.dataset.to_owned(),
            format,
            mode: if cursor.is_some() { Mode::Incremental } else { Mode::Full },
            columns: None,
            filter: None,
            shard_rows: None,
            since: cursor.map(str::to_owned),
        };
        let key = IdempotencyKey::of_subscription_run(self.id, run);
        let feed = FeedContext { keys: &courier.keys, database, now: courier.clock.now() };
        match exports::create_for(&courier.pool, &caller, &key, &request, &feed, Some(self.id)).await {
            Ok(created) => Ok(created.job.id),
            // The run's export exists, made for another request: the process that created it
            // died before recording it and the cursor has moved since. The run is done.
            Err(ExportError::IdempotencyKeyReused) => {
                let existing = exports::store::jobs::find_by_key(&courier.pool, &caller, key.as_str())
                    .await
                    .map_err(|e| refused(e.to_string()))?;
                existing.map(|job| job.id).ok_or_else(|| refused("the run's export vanished".into()))
            }
            Err(
                e @ (ExportError::InvalidCursor { .. }
                | ExportError::CursorExpired(_)
                | ExportError::CursorHistory(crate::feeds::CursorError::LostInFailover { .. })),
            ) => Err(Refusal { error: format!("{e}; the chain starts again with a full export"), restart_chain: true }),
            Err(e) => Err(refused(e.to_string())),
        }
    }
}
