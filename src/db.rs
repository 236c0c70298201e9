//! Connecting to PostgreSQL, running migrations and copying the dataset catalogue into the database.

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use crate::tenants::Registry;

/// Statements slower than this are logged (their SQL text only, never bound values).
const SLOW_STATEMENT: Duration = Duration::from_secs(10);

pub async fn connect(database_url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(database_url)
        .context("parsing DATABASE_URL")?
        .log_slow_statements(log::LevelFilter::Warn, SLOW_STATEMENT);
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .context("connecting to PostgreSQL (DATABASE_URL)")
}

pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::migrate!("./migrations").run(pool).await.context("running database migrations")
}

/// Makes the `datasets` table match the tenant files, so the SQL write functions validate
/// records against the same schemas the HTTP API uses. One transaction: readers never see a
/// half-synced catalogue.
pub async fn sync_catalogue(pool: &PgPool, registry: &Registry) -> anyhow::Result<()> {
    let mut tenants = Vec::new();
    let mut datasets = Vec::new();
    let mut key_columns = Vec::new();
    let mut columns = Vec::new();
    for tenant in registry.tenants() {
        for (name, schema) in &tenant.datasets {
            tenants.push(tenant.id.to_string());
            datasets.push(name.to_string());
            key_columns.push(schema.key_column.to_string());
            columns.push(serde_json::to_value(&schema.columns)?);
        }
    }
    let mut tx = pool.begin().await?;
    sqlx::query(
        "DELETE FROM datasets d WHERE NOT EXISTS (
             SELECT 1 FROM unnest($1::text[], $2::text[]) AS c(tenant, dataset)
             WHERE c.tenant = d.tenant AND c.dataset = d.dataset)",
    )
    .bind(&tenants)
    .bind(&datasets)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO datasets (tenant, dataset, key_column, columns)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[])
         ON CONFLICT ON CONSTRAINT datasets_pkey
         DO UPDATE SET key_column = EXCLUDED.key_column, columns = EXCLUDED.columns",
    )
    .bind(&tenants)
    .bind(&datasets)
    .bind(&key_columns)
    .bind(&columns)
    .execute(&mut *tx)
    .await?;
    tx.commit().await.context("syncing the dataset catalogue")
}

/// `CREATE DATABASE` for the URL's database unless it exists (a fresh machine has only `postgres`).
pub async fn create_database_if_missing(database_url: &str) -> anyhow::Result<()> {
    use sqlx::migrate::MigrateDatabase;
    if !sqlx::Postgres::database_exists(database_url).await.context("checking the database exists")? {
        sqlx::Postgres::create_database(database_url).await.context("creating the database")?;
    }
    Ok(())
}

/// SQLSTATEs worth retrying as they are: the transaction lost a race (serialization failure,
/// deadlock) or the server went away under it (shutdown, crash, not accepting connections yet,
/// too many connections). Class 08 (connection exceptions) is matched separately.
const TRANSIENT_SQLSTATES: [&str; 6] = ["40001", "40P01", "57P01", "57P02", "57P03", "53300"];

/// Whether a database error is transient: the same work, retried on a fresh connection or in a
/// fresh transaction, may well succeed (connection lost, failover, deadlock or serialization
/// victim, pool exhausted for a moment).
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Protocol(_) => true, // a connection cut mid-message
        sqlx::Error::Database(db) => {
            db.code().is_some_and(|code| code.starts_with("08") || TRANSIENT_SQLSTATES.contains(&code.as_ref()))
        }
        _ => false,
    }
}

/// Delays between retries of a transient error: 50 ms doubling to 2 s, jittered so that
/// processes that failed together do not retry together. Callers bound the total themselves.
pub fn retry_delays() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_jitter()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(2))
        .without_max_times()
        .build()
}

/// Whether an error chain is worth retrying later: any cause is a transient database error or
/// an unavailable object store ([`crate::storage::StoreError::is_transient`]).
pub fn is_transient_chain(error: &anyhow::Error) -> bool {
    let store = crate::storage::find_store_error(error.as_ref()).is_some_and(|e| e.is_transient());
    store || error.chain().any(|cause| cause.downcast_ref::<sqlx::Error>().is_some_and(is_transient))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_connections_and_lost_races_are_transient_but_bad_sql_is_not() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
        assert!(is_transient(&io));
        assert!(is_transient(&sqlx::Error::PoolTimedOut));
        assert!(!is_transient(&sqlx::Error::RowNotFound));
        assert!(!is_transient(&sqlx::Error::PoolClosed));
        let wrapped = anyhow::Error::from(io).context("claiming a job").context("worker");
        assert!(is_transient_chain(&wrapped));
        assert!(!is_transient_chain(&anyhow::anyhow!("unknown format xml")));
    }
}
