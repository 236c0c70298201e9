//! Structured JSON logs, one object per line. Filter with `EXPORTD_LOG` (e.g. `debug,sqlx=warn`).

use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter =
        EnvFilter::try_from_env("EXPORTD_LOG").unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,tower_http=info"));
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(true)
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
