//! The `exportd` binary: parses the command line and calls into the library.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use exportd::attach::BackfillOptions;
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
    /// Bind a host table to a dataset. With --source, the table (in any PostgreSQL with
    /// wal_level=logical) is followed from its write-ahead log through a publication and a
    /// replication slot: the rows there are copied now, and `exportd serve`/`worker` apply every
    /// change after. Without, the table is in exportd's own database: a trigger records every
    /// change in the writer's transaction, then the rows there are backfilled. Online and
    /// resumable (run it again after an interruption); exports and feeds wait for the copy.
    Attach {
        #[command(flatten)]
        settings: Settings,
        #[command(flatten)]
        binding: AttachArgs,
        /// Copy a log attachment again (after its slot was lost): a new slot, then every row;
        /// rows gone from the host are deleted, unchanged ones write nothing.
        #[arg(long)]
        resync: bool,
        /// Rows per backfill batch (one transaction each).
        #[arg(long, default_value_t = 500)]
        batch_rows: u32,
        /// Backfill rows per second at most.
        #[arg(long, default_value_t = 20_000)]
        rows_per_second: u32,
    },
    /// Remove an attachment's trigger and functions, or its slot and publication on the host
    /// (the records written stay).
    Detach {
        #[command(flatten)]
        settings: Settings,
        /// The host table.
        #[arg(long)]
        table: String,
        /// The host database of a log attachment (as given to `attach --source`).
        #[arg(long)]
        source: Option<String>,
    },
    /// List attachments with their backfill progress.
    Attachments {
        #[command(flatten)]
        settings: Settings,
    },
}

/// `exportd attach`'s binding.
#[derive(clap::Args, Debug)]
struct AttachArgs {
    /// The host table (`tickets`, `app.tickets`).
    #[arg(long)]
    table: String,
    /// The dataset its rows become records of.
    #[arg(long)]
    dataset: String,
    /// Key column(s), comma-separated (default: the primary key).
    #[arg(long, value_delimiter = ',')]
    key: Vec<String>,
    /// Every row belongs to this tenant.
    #[arg(long, conflicts_with_all = ["tenant_column", "tenant_map"], required_unless_present = "tenant_column")]
    tenant: Option<String>,
    /// The column whose value says the row's tenant (with --tenant-map).
    #[arg(long, requires = "tenant_map")]
    tenant_column: Option<String>,
    /// VALUE=TENANT pairs, comma-separated: the tenant of each value of --tenant-column (rows
    /// with other values are no records).
    #[arg(long, value_delimiter = ',', value_parser = pair)]
    tenant_map: Vec<(String, String)>,
    /// COLUMN=SQL: the SQL expression over the host's columns that feeds a dataset column
    /// (default: the host column of the same name). Repeatable.
    #[arg(long = "column", value_parser = pair)]
    columns: Vec<(String, String)>,
    /// The host database (postgres://user@host:port/db, wal_level=logical): follow the table
    /// from its write-ahead log instead of a trigger in exportd's own database.
    #[arg(long)]
    source: Option<String>,
}

impl AttachArgs {
    fn spec(self) -> exportd::attach::Spec {
        use exportd::attach::{Spec, TenantRule};
        let tenant = match (self.tenant, self.tenant_column) {
            (Some(tenant), _) => TenantRule::Fixed(tenant),
            (None, column) => {
                TenantRule::Column { column: column.unwrap_or_default(), map: self.tenant_map.into_iter().collect() }
            }
        };
        Spec {
            table: self.table,
            dataset: self.dataset,
            key: self.key,
            tenant,
            columns: self.columns.into_iter().collect(),
            source: self.source,
        }
    }
}

/// `NAME=VALUE`.
fn pair(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, v)| !k.is_empty() && !v.is_empty())
        .ok_or_else(|| format!("expected NAME=VALUE, got `{text}`"))
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
        Command::Attach { settings, binding, resync, batch_rows, rows_per_second } => {
            let rows_per_second =
                std::num::NonZeroU32::new(rows_per_second).context("--rows-per-second must be at least 1")?;
            let options = BackfillOptions { batch_rows: batch_rows.max(1), rows_per_second };
            attach(&settings, binding.spec(), resync, options).await
        }
        Command::Detach { settings, table, source } => {
            let pool = exportd::server::prepare(&settings, 2).await?.0;
            if exportd::attach::detach(&pool, &table, source.as_deref()).await? {
                let removed = if source.is_some() { "slot and publication" } else { "trigger and functions" };
                println!("{table}: detached ({removed} removed; its records stay)");
            } else {
                println!("{table}: not attached; nothing to do");
            }
            Ok(())
        }
        Command::Attachments { settings } => {
            let pool = exportd::server::prepare(&settings, 2).await?.0;
            print_attachments(&exportd::attach::list(&pool).await?);
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

async fn attach(
    settings: &Settings,
    spec: exportd::attach::Spec,
    resync: bool,
    options: BackfillOptions,
) -> anyhow::Result<()> {
    let (pool, registry) = exportd::server::prepare(settings, 4).await?;
    let mut attachment = exportd::attach::attach(&pool, &registry, &spec).await?;
    if resync {
        exportd::attach::log::resync(&pool, &attachment).await?;
        attachment = exportd::attach::attach(&pool, &registry, &spec).await?;
    }
    let capture = match &attachment.slot {
        Some(slot) => format!("following slot {slot} on the host"),
        None => "trigger in place".to_owned(),
    };
    println!(
        "{} → dataset {} of {}: {capture}; copying from row {} of about {}",
        attachment.host_table,
        attachment.dataset,
        attachment.tenants.join(", "),
        attachment.rows_done,
        attachment.rows_estimate
    );
    let started = std::time::Instant::now();
    let first = attachment.rows_done;
    let mut last_print = std::time::Instant::now();
    let done = exportd::attach::backfill(&pool, &registry, &attachment, options, |p| {
        if last_print.elapsed() >= Duration::from_secs(2) || p.finished {
            last_print = std::time::Instant::now();
            let rate = (p.rows_done - first) as f64 / started.elapsed().as_secs_f64().max(0.001);
            let left = (p.rows_estimate - p.rows_done).max(0) as f64;
            println!(
                "backfill: {} / ~{} rows, {rate:.0} rows/s, ETA {:.0} s",
                p.rows_done,
                p.rows_estimate,
                left / rate.max(1.0)
            );
        }
    })
    .await?;
    let next = if attachment.slot.is_some() {
        "exports and feeds are open; `exportd serve` (or `exportd worker`) applies the host's changes from now on"
    } else {
        "exports and feeds are open"
    };
    println!(
        "backfill done: {} rows read, {} written (the rest were newer, or the same); {next}",
        done.rows_done, done.rows_written
    );
    Ok(())
}

fn print_attachments(attachments: &[exportd::attach::Attachment]) {
    if attachments.is_empty() {
        println!("no attachments");
    }
    for a in attachments {
        let eta = match a.eta() {
            Some(left) if a.state != "live" => format!(", ETA {:.0} s", left.as_secs_f64()),
            _ => String::new(),
        };
        let log = match (&a.slot, a.lag_bytes) {
            (Some(slot), lag) => format!(
                ", log capture (slot {slot}): {} bytes behind, {} bytes of WAL retained{}{}",
                lag.unwrap_or(0),
                a.retained_bytes.unwrap_or(0),
                a.lost_reason.as_deref().map(|r| format!("; LOST: {r}")).unwrap_or_default(),
                a.last_error.as_deref().map(|e| format!("; failing: {e}")).unwrap_or_default(),
            ),
            (None, _) => ", trigger capture".to_owned(),
        };
        let quarantined =
            if a.quarantined > 0 { format!(", {} rows quarantined", a.quarantined) } else { String::new() };
        println!(
            "{} → {} ({}): {}, {} / ~{} rows copied, {} written{eta}{log}{quarantined}",
            a.host_table,
            a.dataset,
            a.tenants.join(", "),
            a.state,
            a.rows_done,
            a.rows_estimate,
            a.rows_written
        );
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn binding(args: &[&str]) -> Result<exportd::attach::Spec, clap::Error> {
        let cli = Cli::try_parse_from(["exportd", "attach"].iter().chain(args))?;
        match cli.command {
            Command::Attach { binding, .. } => Ok(binding.spec()),
            _ => unreachable!("parsed as attach"),
        }
    }

    #[test]
    fn an_attach_binding_is_read_as_written() {
        use exportd::attach::TenantRule;
        let spec = binding(&[
            "--table",
            "app.tickets",
            "--dataset",
            "tickets",
            "--tenant-column",
            "org",
            "--tenant-map",
            "org-a=acme, org-b = globex",
            "--column",
            "subject=lower(title)",
            "--column",
            "amount = price * 2",
            "--key",
            "org,num",
            "--source",
            "postgres://capture@db/app",
        ])
        .unwrap();
        assert_eq!(spec.table, "app.tickets");
        assert_eq!(spec.key, ["org", "num"]);
        let map = [("org-a".to_owned(), "acme".to_owned()), ("org-b".to_owned(), "globex".to_owned())].into();
        assert_eq!(spec.tenant, TenantRule::Column { column: "org".into(), map });
        assert_eq!(spec.columns["subject"], "lower(title)", "an expression is kept whole");
        assert_eq!(spec.columns["amount"], "price * 2", "spaces around `=` are not part of either side");
        assert_eq!(spec.source.as_deref(), Some("postgres://capture@db/app"));
        let fixed = binding(&["--table", "t", "--dataset", "d", "--tenant", "acme"]).unwrap();
        assert_eq!((fixed.tenant, fixed.source), (TenantRule::Fixed("acme".into()), None));
    }

    #[test]
    fn a_malformed_binding_is_refused_before_anything_runs() {
        let refused = |args: &[&str]| binding(args).unwrap_err().to_string();
        // No tenant rule at all, or both kinds at once.
        assert!(refused(&["--table", "t", "--dataset", "d"]).contains("--tenant"));
        let both = refused(&[
            "--table",
            "t",
            "--dataset",
            "d",
            "--tenant",
            "a",
            "--tenant-column",
            "org",
            "--tenant-map",
            "x=a",
        ]);
        assert!(both.contains("cannot be used with"), "{both}");
        // A column map without its column.
        assert!(refused(&["--table", "t", "--dataset", "d", "--tenant-column", "org"]).contains("--tenant-map"));
        // NAME=VALUE pairs need both sides.
        for bad in ["subject", "=title", "subject="] {
            let text = refused(&["--table", "t", "--dataset", "d", "--tenant", "a", "--column", bad]);
            assert!(text.contains("expected NAME=VALUE"), "{bad}: {text}");
        }
    }
}
