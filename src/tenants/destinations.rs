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
    /// The bucket's configuration with its credentials resolved now. There is always one: a
    /// destination without credentials of its own is refused when the tenant file is read.
    pub fn bucket(&self) -> Result<BucketConfig, String> {
        let c = &self.credentials;
        let field = |name: &str, r: &SecretRef| r.resolve().map_err(|e| format!("credentials.{name}: {e}"));
        let credentials = match (self.url.provider, c) {
            (Provider::S3, CredentialRefs { access_key_id: Some(id), secret_access_key: Some(secret), .. }) => {
                let access_key_id = field("access_key_id", id)?.expose_secret().to_owned();
                Credentials::S3 { access_key_id, secret_access_key: field("secret_access_key", secret)? }
            }
            (Provider::Gcs, CredentialRefs { service_account_key: Some(key), .. }) => {
                Credentials::Gcs { service_account_key: field("service_account_key", key)? }
            }
            (Provider::Azure, CredentialRefs { account: Some(account), access_key: Some(key), .. }) => {
                Credentials::Azure { account: account.clone(), access_key: field("access_key", key)? }
            }
            _ => return Err(needs_credentials(self.url.provider)),
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

/// What a destination of `provider` must name. Without it a cloud client would fall back on the
/// deployment's own identity (instance metadata, application default credentials, managed
/// identity) and present it to the partner's endpoint.
fn needs_credentials(provider: Provider) -> String {
    let names = match provider {
        Provider::S3 => "credentials.access_key_id and credentials.secret_access_key",
        Provider::Gcs => "credentials.service_account_key (a service account key, JSON)",
        Provider::Azure => "credentials.account and credentials.access_key",
    };
    format!(
        "a partner's bucket needs credentials of its own: give {names}, each by reference \
         ({{ env = \"VAR\" }} or {{ file = \"/path\" }}); exportd never uses its own identity there"
    )
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
    if url.provider == Provider::Gcs {
        // No emulator speaks the XML API object_store uses for GCS, so deliveries to it cannot be
        // tested here; Google Cloud Storage's own S3-compatible interface can.
        return Err(error(
            path,
            &field("url"),
            "gs:// destinations are not supported: reach Google Cloud Storage through its S3-compatible \
             interface, url = \"s3://<bucket>/<prefix>\" with endpoint = \"https://storage.googleapis.com\" \
             and an HMAC key as credentials.access_key_id and credentials.secret_access_key",
        ));
    }
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
    if given(wanted) != wanted.len() || (url.provider == Provider::Azure && c.account.is_none()) {
        return Err(error(path, &field("credentials"), needs_credentials(url.provider)));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn checked(text: &str) -> Result<Destination, String> {
        let raw: DestinationFile = toml::from_str(&format!("name = \"landing\"\nprincipal = \"zen\"\n{text}")).unwrap();
        destination(Path::new("tenants/acme.toml"), 0, raw, |_| Some(Role::Partner)).map_err(|e| e.to_string())
    }

    #[test]
    fn a_destination_without_credentials_of_its_own_is_refused_for_every_provider() {
        // Each would otherwise reach the bucket as the deployment: instance metadata, application
        // default credentials, a managed identity.
        for (url, names) in [
            ("s3://landing/x", "credentials.access_key_id and credentials.secret_access_key"),
            ("az://landing/x", "credentials.account and credentials.access_key"),
        ] {
            for endpoint in ["", "endpoint = \"https://partner.example\""] {
                let error = checked(&format!("url = \"{url}\"\n{endpoint}")).unwrap_err();
                assert!(error.contains("destinations[0].credentials") && error.contains(names), "{error}");
                assert!(error.contains("never uses its own identity"), "{error}");
            }
        }
        let half = checked("url = \"s3://landing/x\"\ncredentials.access_key_id = { env = \"ID\" }").unwrap_err();
        assert!(half.contains("credentials.secret_access_key"), "{half}");
        let no_account = checked("url = \"az://landing/x\"\ncredentials.access_key = { env = \"KEY\" }").unwrap_err();
        assert!(no_account.contains("credentials.account"), "{no_account}");
        let complete = "url = \"s3://landing/x\"\ncredentials.access_key_id = { env = \"ID\" }\n\
                        credentials.secret_access_key = { env = \"SECRET\" }";
        assert!(checked(complete).is_ok());
    }

    #[test]
    fn gs_destinations_are_refused_with_the_s3_compatible_way_to_reach_gcs() {
        let error = checked(
            "url = \"gs://landing/x\"\nendpoint = \"https://attacker.example\"\n\
             credentials.service_account_key = { env = \"KEY\" }",
        )
        .unwrap_err();
        assert!(error.contains("destinations[0].url") && error.contains("storage.googleapis.com"), "{error}");
        assert!(checked("url = \"gs://landing/x\"").is_err(), "without credentials too");
    }
}
