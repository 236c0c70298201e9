//! `[[destinations]]` and `[[subscriptions]]` of a tenant file: partners' own buckets, and what
//! is delivered into them.
//!
//! They live in the tenant file, reviewed by the operator, rather than behind an API: a
//! destination names its credentials by reference (an environment variable or a file on the
//! server), and letting a tenant admin name any variable or file of the server through an API
//! would let it send exportd's own secrets (the artifact store's keys, say) to a bucket it
//! controls. References are resolved when a delivery runs, so a rotated file is picked up and a
//! missing secret fails that destination's deliveries with a reason, not the server's start.

use std::path::{Path, PathBuf};
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::file::error;
use super::{ConfigError, DatasetName, PrincipalId, Role};
use crate::storage::{BucketConfig, BucketUrl, Credentials, Provider};
use crate::writers::Format;

/// The shortest schedule accepted: each run is an export.
const MIN_EVERY: Duration = Duration::from_secs(1);

/// A secret named by reference: an environment variable of the server, or a file on it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    env: Option<String>,
    file: Option<PathBuf>,
}

impl SecretRef {
    /// The secret's value now; the error names the reference (never the value).
    pub fn resolve(&self) -> Result<SecretString, String> {
        match (&self.env, &self.file) {
            (Some(var), None) => std::env::var(var)
                .map(SecretString::from)
                .map_err(|_| format!("the environment variable `{var}` is not set")),
            (None, Some(path)) => std::fs::read_to_string(path)
                .map(|text| SecretString::from(text.trim_end_matches(['\r', '\n']).to_owned()))
                .map_err(|e| format!("the secret file {} cannot be read: {e}", path.display())),
            _ => Err("give exactly one of `env` or `file`".into()),
        }
    }

    fn check(&self) -> Result<(), &'static str> {
        match (&self.env, &self.file) {
            (Some(var), None) if !var.is_empty() => Ok(()),
            (None, Some(path)) if path.is_absolute() => Ok(()),
            (None, Some(_)) => Err("`file` must be an absolute path"),
            _ => Err("give exactly one of `env` (a variable name) or `file` (an absolute path)"),
        }
    }
}

/// Who to be at the partner's bucket, by reference.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialRefs {
    /// S3.
    access_key_id: Option<SecretRef>,
    secret_access_key: Option<SecretRef>,
    /// GCS: a service account key (JSON).
    service_account_key: Option<SecretRef>,
    /// Azure: the storage account (not a secret) and its key.
    account: Option<String>,
    access_key: Option<SecretRef>,
}

/// A partner's bucket, validated.
#[derive(Debug, Clone)]
pub struct Destination {
    pub name: String,
    /// The partner it belongs to: only its exports go there, only it (and admins) see them.
    pub principal: PrincipalId,
    pub url: BucketUrl,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    credentials: CredentialRefs,
}

impl Destination {
    /// The bucket's configuration with its credentials resolved now.
    pub fn bucket(&self) -> Result<BucketConfig, String> {
        let c = &self.credentials;
        let field = |name: &str, r: &SecretRef| r.resolve().map_err(|e| format!("credentials.{name}: {e}"));
        let credentials = match self.url.provider {
            Provider::S3 => match (&c.access_key_id, &c.secret_access_key) {
                (Some(id), Some(secret)) => {
                    let access_key_id = field("access_key_id", id)?.expose_secret().to_owned();
                    Credentials::S3 { access_key_id, secret_access_key: field("secret_access_key", secret)? }
                }
                _ => Credentials::Ambient,
            },
            Provider::Gcs => match &c.service_account_key {
                Some(key) => Credentials::Gcs { service_account_key: field("service_account_key", key)? },
                None => Credentials::Ambient,
            },
            Provider::Azure => match (&c.account, &c.access_key) {
                (Some(account), Some(key)) => {
                    Credentials::Azure { account: account.clone(), access_key: field("access_key", key)? }
                }
                _ => Credentials::Ambient,
            },
        };
        Ok(BucketConfig {
            url: self.url.clone(),
            endpoint: self.endpoint.clone(),
            region: self.region.clone(),
            credentials,
        })
    }

    /// Its tag in `pending_uploads`.
    pub fn upload_tag(&self, tenant: &str) -> String {
        format!("destination:{tenant}/{}", self.name)
    }
}

/// What is delivered to a destination, validated.
#[derive(Debug, Clone)]
pub struct Subscription {
    pub name: String,
    pub destination: String,
    pub principal: PrincipalId,
    pub dataset: DatasetName,
    pub format: Format,
    /// Deliver every full export the principal creates of the dataset in the format.
    pub full_exports: bool,
    /// An incremental export this often, chained by the subscription's cursor.
    pub incremental_every: Option<Duration>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DestinationFile {
    name: String,
    principal: PrincipalId,
    url: String,
    endpoint: Option<String>,
    region: Option<String>,
    #[serde(default)]
    credentials: CredentialRefs,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SubscriptionFile {
    name: String,
    destination: String,
    dataset: DatasetName,
    format: Format,
    #[serde(default = "yes")]
    full_exports: bool,
    #[serde(default, with = "humantime_serde_opt")]
    incremental_every: Option<Duration>,
}

fn yes() -> bool {
    true
}

/// `"15m"`-style durations (humantime).
mod humantime_serde_opt {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
        let text: Option<String> = Option::deserialize(deserializer)?;
        text.map(|t| humantime::parse_duration(&t).map_err(|e| serde::de::Error::custom(format!("`{t}`: {e}"))))
            .transpose()
    }
}

fn valid_name(name: &str) -> bool {
    let ok = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    !name.is_empty() && name.len() <= 64 && name.chars().all(ok)
}

/// Checks one `[[destinations]]` entry against the tenant's principals.
pub(super) fn destination(
    path: &Path,
    i: usize,
    raw: DestinationFile,
    role_of: impl Fn(&PrincipalId) -> Option<Role>,
) -> Result<Destination, ConfigError> {
    let field = |name: &str| format!("destinations[{i}].{name}");
    if !valid_name(&raw.name) {
        return Err(error(path, &field("name"), "must be 1-64 characters of letters, digits, `-`, `_` or `.`"));
    }
    match role_of(&raw.principal) {
        None => return Err(error(path, &field("principal"), format!("no principal `{}`", raw.principal))),
        Some(Role::Admin) => {
            return Err(error(
                path,
                &field("principal"),
                "a destination belongs to a partner (admins read everything)",
            ));
        }
        Some(Role::Partner) => {}
    }
    let url = BucketUrl::parse(&raw.url).map_err(|e| error(path, &field("url"), e))?;
    if let Some(endpoint) = &raw.endpoint {
        let parsed =
            reqwest::Url::parse(endpoint).map_err(|e| error(path, &field("endpoint"), format!("not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "https" | "http") || parsed.host_str().is_none() {
            return Err(error(path, &field("endpoint"), "must be an https:// URL with a host"));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(error(path, &field("endpoint"), "must not carry credentials (name them under `credentials`)"));
        }
    }
    let c = &raw.credentials;
    let refs = [
        ("access_key_id", &c.access_key_id),
        ("secret_access_key", &c.secret_access_key),
        ("service_account_key", &c.service_account_key),
        ("access_key", &c.access_key),
    ];
    for (name, reference) in refs {
        if let Some(reference) = reference {
            reference.check().map_err(|why| error(path, &field(&format!("credentials.{name}")), why))?;
        }
    }
    let given = |names: &[&str]| refs.iter().filter(|(n, r)| names.contains(n) && r.is_some()).count();
    let (wanted, others): (&[&str], &[&str]) = match url.provider {
        Provider::S3 => (&["access_key_id", "secret_access_key"], &["service_account_key", "access_key"]),
        Provider::Gcs => (&["service_account_key"], &["access_key_id", "secret_access_key", "access_key"]),
        Provider::Azure => (&["access_key"], &["access_key_id", "secret_access_key", "service_account_key"]),
    };
    if given(others) > 0 || (url.provider != Provider::Azure && c.account.is_some()) {
        let why = format!("{}:// takes {}", url.provider.scheme(), wanted.join(" and "));
        return Err(error(path, &field("credentials"), why));
    }
    if given(wanted) != 0 && given(wanted) != wanted.len() {
        return Err(error(path, &field("credentials"), format!("give {} together", wanted.join(" and "))));
    }
    if url.provider == Provider::Azure && c.access_key.is_some() != c.account.is_some() {
        return Err(error(path, &field("credentials"), "give `account` and `access_key` together"));
    }
    Ok(Destination {
        name: raw.name,
        principal: raw.principal,
        url,
        endpoint: raw.endpoint,
        region: raw.region,
        credentials: raw.credentials,
    })
}

/// Checks one `[[subscriptions]]` entry against the tenant's destinations and grants.
pub(super) fn subscription(
    path: &Path,
    i: usize,
    raw: SubscriptionFile,
    destinations: &[Destination],
    granted: impl Fn(&PrincipalId, &DatasetName) -> bool,
) -> Result<Subscription, ConfigError> {
    let field = |name: &str| format!("subscriptions[{i}].{name}");
    if !valid_name(&raw.name) {
        return Err(error(path, &field("name"), "must be 1-64 characters of letters, digits, `-`, `_` or `.`"));
    }
    let destination = destinations
        .iter()
        .find(|d| d.name == raw.destination)
        .ok_or_else(|| error(path, &field("destination"), format!("no destination `{}`", raw.destination)))?;
    if !granted(&destination.principal, &raw.dataset) {
        let why = format!("`{}` is not granted to `{}`, whose destination this is", raw.dataset, destination.principal);
        return Err(error(path, &field("dataset"), why));
    }
    if let Some(every) = raw.incremental_every
        && every < MIN_EVERY
    {
        return Err(error(path, &field("incremental_every"), "must be at least 1s (minutes are usual)"));
    }
    if !raw.full_exports && raw.incremental_every.is_none() {
        return Err(error(
            path,
            &field("incremental_every"),
            "deliver something: full_exports, incremental_every or both",
        ));
    }
    Ok(Subscription {
        name: raw.name,
        destination: raw.destination,
        principal: destination.principal.clone(),
        dataset: raw.dataset,
        format: raw.format,
        full_exports: raw.full_exports,
        incremental_every: raw.incremental_every,
    })
}
