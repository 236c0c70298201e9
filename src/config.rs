//! Settings shared by every subcommand: environment variables with defaults, overridden by flags.

use std::path::PathBuf;

use clap::Args;
use secrecy::SecretString;

use crate::storage::StorageLocation;

#[derive(Debug, Clone, Args)]
pub struct Settings {
    /// PostgreSQL connection URL; the database is created if it does not exist.
    #[arg(long, env = "DATABASE_URL", default_value = "postgres://postgres@127.0.0.1:5432/exportd")]
    pub database_url: String,

    /// Directory of tenant files (`<id>.toml`) and dataset schemas (`datasets/<name>.toml`).
    #[arg(long, env = "EXPORTD_TENANTS_DIR", default_value = "./tenants")]
    pub tenants_dir: PathBuf,

    /// Directory for export artifacts (unless EXPORTD_STORAGE says otherwise) and other local state.
    #[arg(long, env = "EXPORTD_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,

    /// Where export files are stored: unset = EXPORTD_DATA_DIR, `file:///dir`, or
    /// `s3://bucket[/prefix]` (S3-compatible object storage; every process of a cluster must use
    /// the same). For S3: EXPORTD_S3_ENDPOINT (e.g. http://minio:9000; unset = AWS),
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION (default us-east-1).
    #[arg(long, env = "EXPORTD_STORAGE")]
    pub storage: Option<String>,

    /// Server keys `kid=secret[,kid=secret…]` that sign download links and feed cursors (the first
    /// signs, all verify). Give every process the same keys; keep old keys listed while cursors
    /// signed with them may still be in use.
    #[arg(long, env = "EXPORTD_LINK_KEYS", hide_env_values = true, value_parser = secret)]
    pub link_keys: Option<SecretString>,

    /// Export job lease (`serve` and `worker`): a worker that stops renewing it (killed, cut
    /// off) loses the job to another worker after this long. Shorter means faster takeover and
    /// more heartbeats (one every third of it). At least 1s.
    #[arg(long, env = "EXPORTD_LEASE_TTL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub lease_ttl: std::time::Duration,

    /// An export whose attempts keep ending without a checkpoint (its workers die or fail) fails
    /// with `attempts-exhausted` after more than 5 such attempts in a row that went on at least
    /// this long; a storm of killed workers ends many attempts quickly, an export that kills
    /// every worker keeps doing it.
    #[arg(long, env = "EXPORTD_GIVE_UP_AFTER", default_value = "10m", value_parser = humantime::parse_duration)]
    pub give_up_after: std::time::Duration,

    /// Hot standbys that read rows (`postgres://…[,postgres://…]`, each streaming from the
    /// primary): full exports' shards, feed pages and estimates, each on one that has replayed
    /// past the point the read needs, the same bytes as on the primary; writes, leases,
    /// checkpoints and window cuts stay on the primary.
    #[arg(long, env = "EXPORTD_READ_REPLICAS", hide_env_values = true)]
    pub read_replicas: Option<String>,

    /// How long a read waits for a standby to replay far enough; then the primary reads it.
    #[arg(long, env = "EXPORTD_READ_REPLICA_WAIT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub read_replica_wait: std::time::Duration,

    #[command(flatten)]
    pub webhooks: WebhookSettings,

    #[command(flatten)]
    pub deliveries: DeliverySettings,
}

/// How exports are delivered into partners' buckets (`serve` and `worker`: every process delivers).
#[derive(Debug, Clone, Args)]
pub struct DeliverySettings {
    /// Networks partners' bucket endpoints may resolve to although they are loopback, private,
    /// link-local or otherwise not public (`10.1.0.0/16,127.0.0.1/32`); refused by default.
    #[arg(long, env = "EXPORTD_DELIVERY_ALLOW_NETS", value_delimiter = ',')]
    pub delivery_allow_nets: Vec<ipnet::IpNet>,

    /// The first retry of a delivery that failed for a passing reason (5xx, timeout, throttling)
    /// waits this long; each next one four times longer (at most 2 h), jittered.
    #[arg(long, env = "EXPORTD_DELIVERY_FIRST_RETRY", default_value = "10s", value_parser = humantime::parse_duration)]
    pub delivery_first_retry: std::time::Duration,

    /// A delivery still failing this long after its first attempt is marked failed (retry it by
    /// hand: `POST /v1/deliveries/{id}/retry`). Refusals (credentials, missing bucket) fail at once.
    #[arg(long, env = "EXPORTD_DELIVERY_RETRY_FOR", default_value = "24h", value_parser = humantime::parse_duration)]
    pub delivery_retry_for: std::time::Duration,

    /// Deliveries one process runs at once. A tenant holds at most half of them (rounded up),
    /// one principal at most half of its tenant's; a slot that frees takes the next due delivery.
    #[arg(long, env = "EXPORTD_DELIVERY_PARALLEL", default_value = "2")]
    pub delivery_parallel: usize,

    /// One delivery attempt may take this long; then it stops and is retried, resuming after the
    /// last file it completed.
    #[arg(long, env = "EXPORTD_DELIVERY_ATTEMPT_TIMEOUT", default_value = "15m", value_parser = humantime::parse_duration)]
    pub delivery_attempt_timeout: std::time::Duration,
}

impl Default for DeliverySettings {
    fn default() -> Self {
        DeliverySettings {
            delivery_allow_nets: Vec::new(),
            delivery_first_retry: std::time::Duration::from_secs(10),
            delivery_retry_for: std::time::Duration::from_secs(86_400),
            delivery_parallel: 2,
            delivery_attempt_timeout: std::time::Duration::from_secs(900),
        }
    }
}

/// How webhooks are delivered (`serve` and `worker`: every process delivers).
#[derive(Debug, Clone, Args)]
pub struct WebhookSettings {
    /// The API's public base URL (`https://exports.example.com`): webhook events then carry an
    /// absolute `manifest_url` (they always carry `manifest_path`).
    #[arg(long, env = "EXPORTD_PUBLIC_URL")]
    pub public_url: Option<reqwest::Url>,

    /// Allow `http://` webhook endpoints (development only; production endpoints must be https).
    #[arg(long, env = "EXPORTD_WEBHOOK_ALLOW_HTTP")]
    pub webhook_allow_http: bool,

    /// Networks webhook endpoints may resolve to although they are loopback, private,
    /// link-local or otherwise not public (`10.1.0.0/16,127.0.0.1/32`); refused by default.
    #[arg(long, env = "EXPORTD_WEBHOOK_ALLOW_NETS", value_delimiter = ',')]
    pub webhook_allow_nets: Vec<ipnet::IpNet>,

    /// One delivery attempt may take this long (connect, send, response head).
    #[arg(long, env = "EXPORTD_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub webhook_timeout: std::time::Duration,

    /// The first retry of a failed delivery waits this long; each next one four times longer
    /// (at most 2 h), jittered.
    #[arg(long, env = "EXPORTD_WEBHOOK_FIRST_RETRY", default_value = "5s", value_parser = humantime::parse_duration)]
    pub webhook_first_retry: std::time::Duration,

    /// A delivery still failing this long after its event is marked failed (it can be retried
    /// by hand: `POST /v1/webhooks/deliveries/{id}/retry`).
    #[arg(long, env = "EXPORTD_WEBHOOK_RETRY_FOR", default_value = "24h", value_parser = humantime::parse_duration)]
    pub webhook_retry_for: std::time::Duration,
}

/// A secret from a flag or the environment: never shown by `Debug` (or in logs).
pub fn secret(text: &str) -> Result<SecretString, std::convert::Infallible> {
    Ok(SecretString::from(text.to_owned()))
}

impl Settings {
    /// Where export files are stored (see `storage`).
    pub fn storage_location(&self) -> anyhow::Result<StorageLocation> {
        StorageLocation::parse(self.storage.as_deref(), &self.data_dir, |name| std::env::var(name).ok())
            .map_err(|e| anyhow::anyhow!("EXPORTD_STORAGE: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        settings: super::Settings,
    }

    #[test]
    fn settings_never_show_the_server_keys() {
        let command = Command::parse_from(["exportd", "--link-keys", "k1=very-secret-server-key-material"]);
        let shown = format!("{:?}", command.settings);
        assert!(!shown.contains("very-secret"), "{shown}");
        use secrecy::ExposeSecret;
        let keys = command.settings.link_keys.as_ref().map(|k| k.expose_secret().to_owned());
        assert_eq!(keys.as_deref(), Some("k1=very-secret-server-key-material"));
    }
}
