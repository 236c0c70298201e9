//! The `exportd-client` binary: the partner side, without the server's dependencies.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use exportd_client::{DownloadOptions, PullOptions};

#[derive(Parser)]
#[command(
    name = "exportd-client",
    version,
    about = "Download exportd exports and follow their change feeds (partners)",
    after_help = "Set EXPORTD_URL and EXPORTD_TOKEN (or --url and --token)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a published export: resumes partial files, verifies every sha256.
    Download {
        /// The export id.
        export_id: String,
        /// Directory to write into.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        server: ServerArgs,
        /// Fetch the shard files instead of the whole file (Parquet exports: always).
        #[arg(long)]
        shards: bool,
        /// Shards fetched at once (above 1 implies --shards).
        #[arg(long, default_value_t = 1)]
        parallel: usize,
        /// Bytes per second per transfer, like curl's: 500K, 1M, 2MiB, or plain bytes (0 = unlimited).
        #[arg(long, default_value = "0", value_parser = rate)]
        limit_rate: u64,
    },
    /// Follow a dataset's change feed into a JSONL file.
    Pull {
        /// The dataset whose changes to follow (one your token is granted: GET /v1/datasets lists them).
        #[arg(long)]
        dataset: String,
        /// Holds the cursor between runs; when missing, the feed starts from now (or --since-export).
        #[arg(long)]
        cursor_file: PathBuf,
        /// With no cursor file yet: start where this full export ends (its manifest's next_cursor),
        /// so the export plus the feed hold every change exactly once.
        #[arg(long)]
        since_export: Option<String>,
        /// JSONL file the changes are appended to.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        server: ServerArgs,
        /// Changes per request (1 to 10 000).
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Keep polling at the end of the stream.
        #[arg(long)]
        follow: bool,
    },
}

/// Where the server is, and as whom.
#[derive(clap::Args)]
struct ServerArgs {
    /// Server URL, with its scheme (http:// or https://).
    #[arg(long, env = "EXPORTD_URL", default_value = "http://127.0.0.1:8080", value_parser = server_url)]
    url: String,
    /// Bearer token (for downloads: of the export's owner or a tenant admin).
    #[arg(long, env = "EXPORTD_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl ServerArgs {
    /// The URL and the token, or an error saying how to give the token.
    fn resolve(self) -> anyhow::Result<(String, String)> {
        let token = self.token.filter(|t| !t.trim().is_empty());
        let token = token.ok_or_else(|| anyhow::anyhow!("no token: set EXPORTD_TOKEN (or pass --token)"))?;
        Ok((self.url, token))
    }
}

/// A server URL must name its scheme: `localhost:8080` would otherwise be read as a relative URL.
fn server_url(text: &str) -> Result<String, String> {
    let example = "e.g. http://127.0.0.1:8080 or https://exports.example.com";
    if !(text.starts_with("http://") || text.starts_with("https://")) {
        return Err(format!("must start with http:// or https:// ({example})"));
    }
    reqwest::Url::parse(text).map_err(|e| format!("{e} ({example})"))?;
    Ok(text.to_owned())
}

/// A transfer rate in bytes per second: a number with an optional unit (K, M, G, KiB, MiB, …;
/// K = 1024 as in curl).
fn rate(text: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(text.trim_end_matches("/s"))
        .map_err(|e| format!("{e}: give bytes per second, e.g. 500K, 1M or 2MiB"))
}

/// Errors end the process with their causes, one per line, and never a backtrace.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let url = cli.command.server_url().to_owned();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("starting the runtime");
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", report(&error));
            if unreachable(&error) {
                eprintln!(
                    "hint: no server answered at {url}: check EXPORTD_URL (or --url) and that the server is running"
                );
            }
            ExitCode::FAILURE
        }
    }
}

impl Command {
    fn server_url(&self) -> &str {
        match self {
            Command::Download { server, .. } | Command::Pull { server, .. } => &server.url,
        }
    }
}

/// Whether the error is that nothing answered at the server's address.
fn unreachable(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| cause.downcast_ref::<reqwest::Error>().is_some_and(reqwest::Error::is_connect))
}

/// The error and its causes, leaving out a cause its parent's message already includes.
fn report(error: &anyhow::Error) -> String {
    let mut text = error.to_string();
    let mut previous = text.clone();
    for cause in error.chain().skip(1) {
        let cause = cause.to_string();
        if !previous.contains(&cause) {
            text.push_str("\n  because: ");
            text.push_str(&cause);
        }
        previous = cause;
    }
    text
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    match cli.command {
        Command::Download { export_id, out, server, shards, parallel, limit_rate } => {
            let (base_url, token) = server.resolve()?;
            let options = DownloadOptions { base_url, token, export_id, out, shards, parallel, limit_rate, progress };
            for path in exportd_client::download(&options).await? {
                println!("{}", path.display());
            }
        }
        Command::Pull { dataset, cursor_file, since_export, out, server, limit, follow } => {
            let (base_url, token) = server.resolve()?;
            let options =
                PullOptions { base_url, token, dataset, cursor_file, since_export, out, limit, follow, progress };
            let written = exportd_client::pull(&options).await?;
            println!("{written} change{}", if written == 1 { "" } else { "s" });
        }
    }
    Ok(())
}
