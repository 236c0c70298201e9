//! `[[webhooks]]` of a tenant file: the endpoints told about export and feed events.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use base64::Engine;
use serde::{Deserialize, Serialize};

use super::file::{error, secret_text};
use super::{ConfigError, DatasetName, PrincipalId, Secret};

/// Standard Webhooks secrets are `whsec_` + base64 of the key.
const SECRET_PREFIX: &str = "whsec_";
const MIN_KEY_BYTES: usize = 24;
const MAX_KEY_BYTES: usize = 64;

/// The events an endpoint can subscribe to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize, utoipa::ToSchema)]
pub enum WebhookEvent {
    #[serde(rename = "export.succeeded")]
    ExportSucceeded,
    #[serde(rename = "export.failed")]
    ExportFailed,
    #[serde(rename = "export.cancelled")]
    ExportCancelled,
    #[serde(rename = "export.expired")]
    ExportExpired,
    #[serde(rename = "export.revoked")]
    ExportRevoked,
    #[serde(rename = "feed.lagging")]
    FeedLagging,
    /// A partner's feed position was refused after a database failover lost history it had
    /// seen (once per principal, dataset and failover): it must re-base on a full export.
    #[serde(rename = "feed.history_lost")]
    FeedHistoryLost,
    /// A dataset's schema has a new version (announced before any export or page uses it).
    #[serde(rename = "schema.changed")]
    SchemaChanged,
    /// An export is in a partner's bucket, verified, `_SUCCESS` written.
    #[serde(rename = "delivery.succeeded")]
    DeliverySucceeded,
    /// A delivery gave up (a refusal, or passing errors for `EXPORTD_DELIVERY_RETRY_FOR`).
    #[serde(rename = "delivery.failed")]
    DeliveryFailed,
    /// Rows of an attached host table the dataset refuses were quarantined (keys, fields and
    /// reasons; never values).
    #[serde(rename = "attachment.quarantined")]
    AttachmentQuarantined,
    /// A log-captured host table's slot is lost: its datasets' exports and feeds wait for a
    /// resync.
    #[serde(rename = "attachment.lost")]
    AttachmentLost,
}

impl WebhookEvent {
    pub const ALL: [WebhookEvent; 12] = [
        WebhookEvent::ExportSucceeded,
        WebhookEvent::ExportFailed,
        WebhookEvent::ExportCancelled,
        WebhookEvent::ExportExpired,
        WebhookEvent::ExportRevoked,
        WebhookEvent::FeedLagging,
        WebhookEvent::FeedHistoryLost,
        WebhookEvent::SchemaChanged,
        WebhookEvent::DeliverySucceeded,
        WebhookEvent::DeliveryFailed,
        WebhookEvent::AttachmentQuarantined,
        WebhookEvent::AttachmentLost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WebhookEvent::ExportSucceeded => "export.succeeded",
            WebhookEvent::ExportFailed => "export.failed",
            WebhookEvent::ExportCancelled => "export.cancelled",
            WebhookEvent::ExportExpired => "export.expired",
            WebhookEvent::ExportRevoked => "export.revoked",
            WebhookEvent::FeedLagging => "feed.lagging",
            WebhookEvent::FeedHistoryLost => "feed.history_lost",
            WebhookEvent::SchemaChanged => "schema.changed",
            WebhookEvent::DeliverySucceeded => "delivery.succeeded",
            WebhookEvent::DeliveryFailed => "delivery.failed",
            WebhookEvent::AttachmentQuarantined => "attachment.quarantined",
            WebhookEvent::AttachmentLost => "attachment.lost",
        }
    }

    pub fn parse(text: &str) -> Option<WebhookEvent> {
        WebhookEvent::ALL.into_iter().find(|e| e.as_str() == text)
    }
}

impl fmt::Display for WebhookEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One endpoint, validated: an http(s) URL with a host, at least one event, a Standard
/// Webhooks signing secret.
#[derive(Debug, Clone)]
pub struct WebhookEndpoint {
    pub name: String,
    pub url: reqwest::Url,
    pub events: BTreeSet<WebhookEvent>,
    /// The key bytes (the base64 after `whsec_`).
    pub secret: Secret,
    /// Only events about these principals (empty: all).
    pub principals: BTreeSet<PrincipalId>,
    /// Only events about these datasets (empty: all).
    pub datasets: BTreeSet<DatasetName>,
}

impl WebhookEndpoint {
    /// Whether this endpoint wants an event of `kind` about `principal` and `dataset`.
    pub fn wants(&self, kind: WebhookEvent, principal: Option<&str>, dataset: Option<&str>) -> bool {
        self.events.contains(&kind)
            && (self.principals.is_empty()
                || principal.is_some_and(|p| self.principals.iter().any(|x| x.as_str() == p)))
            && (self.datasets.is_empty() || dataset.is_some_and(|d| self.datasets.iter().any(|x| x.as_str() == d)))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WebhookFile {
    name: String,
    url: String,
    events: Vec<WebhookEvent>,
    secret: Option<String>,
    secret_env: Option<String>,
    #[serde(default)]
    principals: Vec<PrincipalId>,
    #[serde(default)]
    datasets: Vec<DatasetName>,
}

/// Checks one `[[webhooks]]` entry against the tenant's principals and datasets.
pub(super) fn endpoint(
    path: &Path,
    i: usize,
    raw: WebhookFile,
    principal_exists: impl Fn(&PrincipalId) -> bool,
    dataset_exists: impl Fn(&DatasetName) -> bool,
) -> Result<WebhookEndpoint, ConfigError> {
    let field = |name: &str| format!("webhooks[{i}].{name}");
    let name_ok = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    if raw.name.is_empty() || raw.name.len() > 64 || !raw.name.chars().all(name_ok) {
        return Err(error(path, &field("name"), "must be 1-64 characters of letters, digits, `-`, `_` or `.`"));
    }
    let url = reqwest::Url::parse(&raw.url).map_err(|e| error(path, &field("url"), format!("not a URL: {e}")))?;
    if !matches!(url.scheme(), "https" | "http") || url.host_str().is_none() {
        return Err(error(path, &field("url"), "must be an https:// URL with a host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(error(path, &field("url"), "must not carry credentials (the signature authenticates us)"));
    }
    if raw.events.is_empty() {
        let all: Vec<&str> = WebhookEvent::ALL.iter().map(|e| e.as_str()).collect();
        return Err(error(path, &field("events"), format!("name at least one of {}", all.join(", "))));
    }
    let (text, source) = secret_text(path, &format!("webhooks[{i}]"), raw.secret, raw.secret_env)?;
    let secret = signing_secret(&text).map_err(|message| error(path, &field(source), message))?;
    for (p, principal) in raw.principals.iter().enumerate() {
        if !principal_exists(principal) {
            return Err(error(path, &field(&format!("principals[{p}]")), format!("no principal `{principal}`")));
        }
    }
    for (d, dataset) in raw.datasets.iter().enumerate() {
        if !dataset_exists(dataset) {
            return Err(error(
                path,
                &field(&format!("datasets[{d}]")),
                format!("`{dataset}` is not one of this tenant's datasets"),
            ));
        }
    }
    Ok(WebhookEndpoint {
        name: raw.name,
        url,
        events: raw.events.into_iter().collect(),
        secret,
        principals: raw.principals.into_iter().collect(),
        datasets: raw.datasets.into_iter().collect(),
    })
}

fn signing_secret(text: &str) -> Result<Secret, String> {
    let encoded = text.strip_prefix(SECRET_PREFIX).ok_or_else(|| {
        format!("a Standard Webhooks secret: `{SECRET_PREFIX}` followed by base64 of {MIN_KEY_BYTES}-{MAX_KEY_BYTES} random bytes")
    })?;
    let key = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| format!("the part after `{SECRET_PREFIX}` is not base64"))?;
    if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&key.len()) {
        return Err(format!("the key must be {MIN_KEY_BYTES}-{MAX_KEY_BYTES} bytes (it is {})", key.len()));
    }
    Ok(Secret(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_round_trip() {
        for event in WebhookEvent::ALL {
            assert_eq!(WebhookEvent::parse(event.as_str()), Some(event));
            assert_eq!(serde_json::to_value(event).unwrap(), event.as_str());
        }
    }

    #[test]
    fn secrets_are_standard_webhooks_keys() {
        assert!(signing_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_ok());
        assert!(signing_secret("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap_err().contains("whsec_"));
        assert!(signing_secret("whsec_not base64!").unwrap_err().contains("base64"));
        assert!(signing_secret("whsec_c2hvcnQ=").unwrap_err().contains("24-64 bytes"));
    }
}
