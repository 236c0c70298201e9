//! Connecting to PostgreSQL, running migrations and copying the dataset catalogue into the database.

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// Statements slower than this are logged (their SQL text only, never bound values).
const SLOW_STATEMENT: Duration = Duration::from_secs(10);

/// Parses DATABASE_URL, refusing anything but a PostgreSQL URL (a `mysql://` URL would otherwise
/// be read as PostgreSQL's and fail later, or reach a default server).
pub fn parse_url(database_url: &str) -> anyhow::Result<PgConnectOptions> {
    let scheme = database_url.split_once("://").map(|(scheme, _)| scheme.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("postgres" | "postgresql") => {}
        // Only a short, plain scheme is repeated back: the rest of the URL may hold a password.
        Some(other) if other.len() <= 16 && other.chars().all(|c| c.is_ascii_alphanumeric() || c == '+') => {
            anyhow::bail!(
                "DATABASE_URL must be a postgres:// URL (postgres://user@host:5432/database), not {other}://…"
            )
        }
        _ => anyhow::bail!("DATABASE_URL must be a postgres:// URL, like postgres://user@host:5432/database"),
    }
    PgConnectOptions::from_str(database_url).context("DATABASE_URL is not a valid PostgreSQL URL")
}

/// Where a URL points, for messages: host, port, database and user — never the password.
pub fn describe(options: &PgConnectOptions) -> String {
    format!(
        "PostgreSQL at {}:{} (database `{}`, user `{}`)",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("postgres"),
        options.get_username()
    )
}

/// A failure to reach or log in to the database, saying where and what to check. The sqlx
/// error stays in the chain, so transient failures are still recognised as such.
fn unreachable(options: &PgConnectOptions, doing: &str, error: sqlx::Error) -> anyhow::Error {
    let code = error.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
    let hint = match (&error, code.as_deref()) {
        (_, Some("28000" | "28P01")) => "check the user and password in DATABASE_URL",
        (_, Some("3D000")) => "the database does not exist and could not be created",
        (sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut, _) => {
            "is PostgreSQL running there? Check DATABASE_URL (or --database-url)"
        }
        (sqlx::Error::Tls(_), _) => "check the TLS settings (sslmode) in DATABASE_URL",
        _ => "check DATABASE_URL (or --database-url)",
    };
    let refusal = match error.as_database_error() {
        Some(database) => format!(": {}", database.message()),
        None => String::new(),
    };
    anyhow::Error::new(error).context(format!("{doing} {}{refusal} — {hint}", describe(options)))
}

/// A pooled connection idle at least this long is pinged before it is handed out.
const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// The settings every pool of exportd starts from. sqlx pings each connection before handing it
/// out — a round trip in front of every statement's own (on a download, three of its seven). A
/// restart or failover of the server leaves idle connections dead, so only a connection idle for
/// [`PING_AFTER_IDLE`] or more is pinged (a dead one is replaced then); one in steady use is
/// handed out as it is, and if its server went away meanwhile its statement fails as a
/// transient error, like any statement in flight at that moment.
pub fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new().test_before_acquire(false).before_acquire(|conn, meta| {
        Box::pin(async move {
            if meta.idle_for >= PING_AFTER_IDLE {
                sqlx::Connection::ping(conn).await?;
            }
            Ok(true)
        })
    })
}

pub async fn connect(database_url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options = parse_url(database_url)?.log_slow_statements(log::LevelFilter::Warn, SLOW_STATEMENT);
    pool_options()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.clone())
        .await
        .map_err(|e| unreachable(&options, "cannot connect to", e))
}

/// Applies the migrations not yet applied; returns how many that was.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<usize> {
    let before = applied_migrations(pool).await?;
    sqlx::migrate!("./migrations").run(pool).await.context("running database migrations")?;
    Ok(applied_migrations(pool).await?.saturating_sub(before))
}

async fn applied_migrations(pool: &PgPool) -> sqlx::Result<usize> {
    let exists = sqlx::query_scalar!(r#"SELECT to_regclass('_sqlx_migrations') IS NOT NULL AS "exists!""#)
        .fetch_one(pool)
        .await?;
    if !exists {
        return Ok(0);
    }
    let count = sqlx::query_scalar!(r#"SELECT count(*) AS "count!" FROM _sqlx_migrations"#).fetch_one(pool).await?;
    Ok(count as usize)
}

/// `CREATE DATABASE` for the URL's database unless it exists (a fresh machine has only `postgres`).
pub async fn create_database_if_missing(database_url: &str) -> anyhow::Result<()> {
    use sqlx::migrate::MigrateDatabase;
    let options = parse_url(database_url)?;
    let exists = sqlx::Postgres::database_exists(database_url)
        .await
        .map_err(|e| unreachable(&options, "cannot connect to", e))?;
    if !exists {
        sqlx::Postgres::create_database(database_url)
            .await
            .map_err(|e| unreachable(&options, "cannot create the database on", e))?;
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

/// Stores a Rust enum as its text name: decodes through `TryFrom<String>` (an unknown name is a
/// decode error), so `query!` type overrides (`state AS "state: ExportState"`) yield the enum.
/// Bind such a value as its `as_str()`.
macro_rules! text_column {
    ($ty:ty) => {
        impl sqlx::Type<sqlx::Postgres> for $ty {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }
        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $ty {
            fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                let text = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                Ok(<$ty>::try_from(text.to_owned())?)
            }
        }
    };
}
pub(crate) use text_column;

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
