//! The `exportd` binary: parses the command line and calls into the library.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use exportd::config::Settings;
use exportd::http::{ConnectionLimits, MetricsAccess};
use exportd::server::ServeOptions;
use exportd::tenants::Registry;
use secrecy::SecretString;

#[derive(Parser)]
#[command(
    name = "exportd",
    version,
    about = "Multi-tenant exports and incremental feeds on PostgreSQL",
    after_help = "The server settings (DATABASE_URL, EXPORTD_TENANTS_DIR, EXPORTD_STORAGE, …) are listed by \
                  `exportd serve --help`. Partners download and pull with `exportd-client`, a binary of its own."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP API.
    Serve {
        #[command(flatten)]
        settings: Settings,
        /// Address to listen on.
        #[arg(long, env = "EXPORTD_LISTEN", default_value = "127.0.0.1:8080", value_parser = listen_address)]
        listen: SocketAddr,
        /// In-process export workers (0 = API only; run `exportd worker` elsewhere).
        #[arg(long, env = "EXPORTD_WORKERS", default_value_t = 2)]
        workers: usize,
        /// Lifetime of signed download links.
        #[arg(long, env = "EXPORTD_LINK_TTL", default_value = "5m", value_parser = humantime::parse_duration)]
        link_ttl: Duration,
        /// How often the cleaner expires exports and removes unneeded files.
        #[arg(long, env = "EXPORTD_CLEAN_EVERY", default_value = "1m", value_parser = humantime::parse_duration)]
        clean_every: Duration,
        /// `GET /metrics` requires `Authorization: Bearer <token>`. Without it (or
        /// --metrics-public) the page is closed: it names every tenant.
        #[arg(long, env = "EXPORTD_METRICS_TOKEN", hide_env_values = true, value_parser = exportd::config::secret)]
        metrics_token: Option<SecretString>,
        /// Opens `GET /metrics` to anyone who can reach the port (a scraper on a private network).
        #[arg(long, env = "EXPORTD_METRICS_PUBLIC", default_value_t = false, conflicts_with = "metrics_token")]
        metrics_public: bool,
        /// Open client connections at most (kept under RLIMIT_NOFILE minus a reserve); past it the
        /// connection silent the longest is closed.
        #[arg(long, env = "EXPORTD_MAX_CONNECTIONS", default_value_t = 4096)]
        max_connections: usize,
        /// A client must send a whole request head within this long of connecting or of its
        /// previous response (bounds idle keep-alive too).
        #[arg(long, env = "EXPORTD_HEADER_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
        header_timeout: Duration,
        /// A response (a download, a feed page) whose client takes no bytes for this long is
        /// abandoned and its connection closed.
        #[arg(long, env = "EXPORTD_SEND_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
        send_timeout: Duration,
    },
    /// Run export workers only (scale out: any number of processes on any machines).
    Worker {
        #[command(flatten)]
        settings: Settings,
        #[arg(long, env = "EXPORTD_WORKERS", default_value_t = 2)]
        workers: usize,
        /// Run until no job is waiting, then exit (batch runs, benchmarks).
        #[arg(long)]
        exit_when_idle: bool,
    },
    /// Create the database if needed and apply migrations.
    Migrate {
        #[command(flatten)]
        settings: Settings,
    },
    /// Print a bearer token for a principal (local use and demos).
    Token {
        #[command(flatten)]
        settings: Settings,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        principal: String,
        /// Lifetime, e.g. `15m`, `1h`, `7d`.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: Duration,
    },
    /// Load deterministic synthetic records with COPY.
    Seed {
        #[command(flatten)]
        settings: Settings,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        dataset: String,
        #[arg(long)]
        rows: u64,
        /// Index of the first record (keys are `<dataset>-<index>`), to add to an earlier seed.
        #[arg(long, default_value_t = 0)]
        start: u64,
        /// Varies the generated values; the same seed always gives the same records.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

/// Errors end the process with their causes, one per line, and never a backtrace: they are
/// expected failures (a server that is down, a bad setting), not bugs.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("starting the runtime");
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", report(&error));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, leaving out a cause its parent's message already includes (sqlx
/// repeats an I/O error's text in its own).
fn report(error: &anyhow::Error) -> String {
    let mut text = error.to_string();
    let mut previous = text.clone();
    for cause in error.chain().skip(1) {
        // A server's error reads better as its message alone (sqlx adds the C source line).
        let cause = if let Some(database) = cause.downcast_ref::<sqlx::Error>().and_then(|e| e.as_database_error()) {
            database.message().to_owned()
        } else if let Some(database) = cause.downcast_ref::<Box<dyn sqlx::error::DatabaseError>>() {
            database.message().to_owned()
        } else {
            cause.to_string()
        };
        if !previous.contains(&cause) {
            text.push_str("\n  because: ");
            text.push_str(&cause);
        }
        previous = cause;
    }
    text
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let service = matches!(cli.command, Command::Serve { .. } | Command::Worker { .. });
    exportd::telemetry::init(if service { exportd::telemetry::SERVICE_LOG } else { exportd::telemetry::COMMAND_LOG });
    match cli.command {
        Command::Serve {
            settings,
            listen,
            workers,
            link_ttl,
            clean_every,
            metrics_token,
            metrics_public,
            max_connections,
            header_timeout,
            send_timeout,
        } => {
            let connections = ConnectionLimits { max_connections, header_read_timeout: header_timeout, send_timeout };
            let metrics = match (metrics_token, metrics_public) {
                (Some(token), _) => MetricsAccess::Token(token),
                (None, true) => MetricsAccess::Open,
                (None, false) => MetricsAccess::Closed,
            };
            let options = ServeOptions { listen, workers, link_ttl, clean_every, metrics, connections };
            exportd::server::serve(&settings, options).await
        }
        Command::Worker { settings, workers, exit_when_idle } => {
            exportd::server::work(&settings, workers, exit_when_idle).await
        }
        Command::Migrate { settings } => {
            let prepared = exportd::server::prepare_reporting(&settings, 2).await?;
            let target = exportd::db::describe(&exportd::db::parse_url(&settings.database_url)?);
            match prepared.migrations_applied {
                0 => println!("{target}: already up to date"),
                1 => println!("{target}: applied 1 migration; up to date"),
                n => println!("{target}: applied {n} migrations; up to date"),
            }
            Ok(())
        }
        Command::Token { settings, tenant, principal, ttl } => {
            let registry = Registry::load(&settings.tenants_dir)?;
            let tenant = tenant_named(&registry, &tenant, &settings.tenants_dir)?;
            println!("{}", exportd::auth::mint(tenant, &principal, ttl)?);
            Ok(())
        }
        Command::Seed { settings, tenant, dataset, rows, start, seed } => {
            let (pool, registry) = exportd::server::prepare(&settings, 2).await?;
            let tenant = tenant_named(&registry, &tenant, &settings.tenants_dir)?;
            let schema = tenant.dataset(&dataset).with_context(|| {
                let known: Vec<&str> = tenant.datasets.keys().map(|d| d.as_str()).collect();
                format!("tenant `{}` has no dataset `{dataset}`; its datasets: {}", tenant.id, known.join(", "))
            })?;
            let report = exportd::records::seed(&pool, &tenant.id, schema, start, rows, seed).await?;
            let rate = report.rows as f64 / (report.elapsed_ms.max(1) as f64 / 1000.0);
            println!(
                "seeded {} {} records for {} in {} ms ({rate:.0} rows/s)",
                report.rows, dataset, tenant.id, report.elapsed_ms
            );
            Ok(())
        }
    }
}

/// The tenant `name` of the registry, or an error listing those there are.
fn tenant_named<'a>(
    registry: &'a Registry,
    name: &str,
    dir: &std::path::Path,
) -> anyhow::Result<&'a std::sync::Arc<exportd::tenants::Tenant>> {
    registry.get(name).with_context(|| {
        let known: Vec<&str> = registry.tenants().map(|t| t.id.as_str()).collect();
        format!("no tenant `{name}` in {}; the tenants there: {}", dir.display(), known.join(", "))
    })
}

/// `--listen`: an address and port, with an example when it is not one.
fn listen_address(text: &str) -> Result<SocketAddr, String> {
    text.parse().map_err(|_| {
        "expected HOST:PORT, e.g. 127.0.0.1:8080 (this machine only) or 0.0.0.0:8080 (every interface)".to_owned()
    })
}
