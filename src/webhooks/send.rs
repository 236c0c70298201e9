//! One delivery attempt over HTTP: signed, bounded in time, never redirected, never proxied,
//! and only to addresses the [`AddressGuard`] lets through.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::outbox::Outcome;
use super::signing;
use crate::outbound::{self, AddressGuard, AddressRefused};
use crate::tenants::WebhookEndpoint;

pub struct Sender {
    client: reqwest::Client,
    guard: Arc<AddressGuard>,
    allow_http: bool,
}

impl Sender {
    pub fn new(guard: AddressGuard, allow_http: bool, timeout: Duration) -> anyhow::Result<Sender> {
        let guard = Arc::new(guard);
        let client = outbound::client_builder(&guard, timeout, timeout)
            .user_agent(concat!("exportd-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Sender { client, guard, allow_http })
    }

    /// Whether `endpoint`'s URL may be used at all (its scheme; a literal address's kind).
    pub fn admissible(&self, endpoint: &WebhookEndpoint) -> Result<(), String> {
        if endpoint.url.scheme() == "http" && !self.allow_http {
            return Err("refused: http:// endpoints need EXPORTD_WEBHOOK_ALLOW_HTTP (development only)".into());
        }
        // A literal address never reaches the resolver: refuse it before connecting at all.
        outbound::check_literal(&self.guard, endpoint.url.host_str().unwrap_or_default()).map_err(|e| e.to_string())
    }

    /// POSTs `body` signed for this attempt. The error texts name causes, never the URL (its
    /// query may carry the receiver's token).
    pub async fn attempt(&self, endpoint: &WebhookEndpoint, webhook_id: &str, body: &str) -> Outcome {
        if let Err(error) = self.admissible(endpoint) {
            return Outcome::Retry { status: None, error };
        }
        // The receiver checks the timestamp against its own clock: the real one.
        let timestamp = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let signature = signing::signature(endpoint.secret.bytes(), webhook_id, timestamp, body);
        let sent = self
            .client
            .post(endpoint.url.clone())
            .header("content-type", "application/json")
            .header("webhook-id", webhook_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(body.to_owned())
            .send()
            .await;
        match sent {
            Ok(response) if response.status().is_success() => Outcome::Delivered { status: response.status().as_u16() },
            Ok(response) => {
                let status = response.status();
                let error = if status.is_redirection() {
                    format!("answered {status}; redirects are not followed")
                } else {
                    format!("answered {status}")
                };
                Outcome::Retry { status: Some(status.as_u16()), error }
            }
            Err(e) => Outcome::Retry { status: None, error: describe(e) },
        }
    }
}

fn describe(error: reqwest::Error) -> String {
    if let Some(refused) = AddressRefused::find(&error) {
        return refused.to_string();
    }
    let kind = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "could not connect"
    } else {
        "request failed"
    };
    let error = error.without_url();
    let mut causes = Vec::new();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        causes.push(cause.to_string());
        source = cause.source();
    }
    causes.dedup();
    if causes.is_empty() { kind.to_owned() } else { format!("{kind}: {}", causes.join(": ")) }
}
