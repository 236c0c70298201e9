//! Structured JSON logs, one object per line. Filter with `EXPORTD_LOG` (e.g. `debug,sqlx=warn`).

use tracing_subscriber::EnvFilter;

/// The log filter of long-running processes (`serve`, `worker`) unless EXPORTD_LOG says otherwise.
pub const SERVICE_LOG: &str = "info,sqlx=warn,tower_http=info";
/// One-shot commands (`migrate`, `seed`, `token`, clients) print their own results: only trouble
/// is logged (a seed's long statements are expected, not worth a warning).
pub const COMMAND_LOG: &str = "warn,sqlx=error";

pub fn init(default_filter: &str) {
    let filter = EnvFilter::try_from_env("EXPORTD_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(true)
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// The process's Prometheus recorder, installed on first use (the recorder is global).
pub fn prometheus() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets(&[0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0])
            .expect("static buckets")
            .install_recorder()
            .expect("no other metrics recorder is installed")
    })
}
