//! Every connection exportd opens to a place a tenant or partner chose — webhook receivers and
//! partners' buckets of any provider — is made by the one client built here:
//!
//! - names resolve through the [`AddressGuard`], on every connection (a name re-pointed at an
//!   internal address is caught), and the address actually connected to is checked again before
//!   a byte of the request is sent (an address literal never passes a resolver);
//! - redirects are never followed (a 3xx is the answer), and proxy variables of the environment
//!   (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`) are ignored: exportd connects directly;
//! - a refusal is an [`AddressRefused`] in the error chain, which callers report as a reason
//!   code, never with the address a name resolved to.
//!
//! Credentials are the caller's concern: a partner's bucket is reached only with the credentials
//! its destination names (`tenants::destinations`), never with the deployment's own identity.

mod guard;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

pub use guard::AddressGuard;
use hyper_util::client::legacy::connect::{Connection, HttpInfo};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The guard refused an address: the error a resolver or a connection check returns. Its text
/// names the kind of address and the setting that allows it, never the address itself (a
/// partner could otherwise read how our DNS resolves its names).
#[derive(Debug, Clone, thiserror::Error)]
#[error("address-refused: {0}")]
pub struct AddressRefused(pub String);

impl AddressRefused {
    /// The refusal in `error`'s chain, if any.
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a AddressRefused> {
        let mut cause = Some(error);
        while let Some(e) = cause {
            if let Some(found) = e.downcast_ref::<AddressRefused>() {
                return Some(found);
            }
            cause = e.source();
        }
        None
    }
}

/// The settings every outbound client shares: no redirects, no proxy, the guard on names and on
/// the peer of every connection, timeouts. Callers add what is theirs (a user agent, `https_only`).
pub fn client_builder(
    guard: &Arc<AddressGuard>,
    timeout: Duration,
    connect_timeout: Duration,
) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .dns_resolver(GuardedResolver(guard.clone()))
        .connector_layer(PeerCheck(guard.clone()))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(timeout)
        .connect_timeout(connect_timeout)
}

/// Checks `ip` before a request is made to a literal address (the resolver never sees one).
pub fn check_literal(guard: &AddressGuard, host: &str) -> Result<(), AddressRefused> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => guard.check(ip).map_err(AddressRefused),
        Err(_) => Ok(()),
    }
}

/// The system's answer for `host`, with every address `guard` refuses removed; nothing left is
/// a refusal.
async fn resolve_allowed(guard: &AddressGuard, host: &str) -> Result<Vec<SocketAddr>, BoxError> {
    let found: Vec<SocketAddr> =
        tokio::net::lookup_host((host, 0)).await.map_err(|e| format!("{host}: {e}"))?.collect();
    let mut refusal = None;
    let allowed: Vec<SocketAddr> = found
        .into_iter()
        .filter(|addr| match guard.check(addr.ip()) {
            Ok(()) => true,
            Err(reason) => {
                refusal.get_or_insert(reason);
                false
            }
        })
        .collect();
    if allowed.is_empty() {
        let reason = refusal.unwrap_or_else(|| "the name resolves to no address".into());
        tracing::info!(host, reason, "an outbound connection was refused");
        return Err(Box::new(AddressRefused(reason)));
    }
    Ok(allowed)
}

/// The client's resolver (see [`resolve_allowed`]).
struct GuardedResolver(Arc<AddressGuard>);

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.0.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let allowed = resolve_allowed(&guard, &host).await?;
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A connector layer that checks the address each new connection reached, whatever led there
/// (a name, a literal, a redirect a caller followed by hand). A connection whose peer is
/// unknown is refused too.
#[derive(Clone)]
struct PeerCheck(Arc<AddressGuard>);

impl<S> tower::Layer<S> for PeerCheck {
    type Service = PeerChecked<S>;

    fn layer(&self, inner: S) -> PeerChecked<S> {
        PeerChecked { inner, guard: self.0.clone() }
    }
}

#[derive(Clone)]
struct PeerChecked<S> {
    inner: S,
    guard: Arc<AddressGuard>,
}

impl<S, R> tower::Service<R> for PeerChecked<S>
where
    S: tower::Service<R, Error = BoxError>,
    S::Response: Connection + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let (connecting, guard) = (self.inner.call(request), self.guard.clone());
        Box::pin(async move {
            let connection = connecting.await?;
            let mut extras = http::Extensions::new();
            connection.connected().get_extras(&mut extras);
            let peer = extras.get::<HttpInfo>().map(|info| info.remote_addr().ip());
            let Some(peer) = peer else {
                return Err(Box::new(AddressRefused("the connection's peer address is unknown".into())) as BoxError);
            };
            guard.check(peer).map_err(|reason| {
                tracing::info!(%peer, reason, "an outbound connection was refused after connecting");
                Box::new(AddressRefused(reason)) as BoxError
            })?;
            Ok(connection)
        })
    }
}

/// `object_store`'s HTTP client for partners' buckets: the one client above, for every request
/// a store makes (its credential requests included).
#[derive(Debug, Clone)]
pub struct GuardedConnector {
    guard: Arc<AddressGuard>,
    timeout: Duration,
    connect_timeout: Duration,
}

impl GuardedConnector {
    pub fn new(guard: Arc<AddressGuard>, timeout: Duration, connect_timeout: Duration) -> GuardedConnector {
        GuardedConnector { guard, timeout, connect_timeout }
    }

    pub fn guard(&self) -> &AddressGuard {
        &self.guard
    }
}

impl object_store::client::HttpConnector for GuardedConnector {
    fn connect(&self, options: &object_store::ClientOptions) -> object_store::Result<object_store::client::HttpClient> {
        let allow_http = options.get_config_value(&object_store::ClientConfigKey::AllowHttp).as_deref() == Some("true");
        let client = client_builder(&self.guard, self.timeout, self.connect_timeout)
            .user_agent(concat!("exportd/", env!("CARGO_PKG_VERSION")))
            .https_only(!allow_http)
            .build()
            .map_err(|e| object_store::Error::Generic { store: "bucket", source: Box::new(e) })?;
        Ok(object_store::client::HttpClient::new(client))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener on loopback that counts the connections it accepted.
    async fn listener() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let socket = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = socket.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request).await;
                let _ = stream.write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
        (addr, accepted)
    }

    fn client(allowed: &[&str]) -> reqwest::Client {
        let guard = Arc::new(AddressGuard::new(allowed.iter().map(|n| n.parse().unwrap()).collect()));
        client_builder(&guard, Duration::from_secs(5), Duration::from_secs(5)).build().unwrap()
    }

    #[tokio::test]
    async fn a_literal_internal_address_is_refused_after_connecting_before_any_request() {
        let (addr, _) = listener().await;
        // The literal never reaches the resolver: the peer check refuses it.
        let error = client(&[]).get(format!("http://{addr}/")).send().await.unwrap_err();
        let refused = AddressRefused::find(&error).expect("an address refusal in the chain");
        assert!(refused.0.contains("loopback") && !refused.to_string().contains("127.0.0.1"), "{refused}");
        let mapped = format!("http://[::ffff:127.0.0.1]:{}/", addr.port());
        let error = client(&[]).get(mapped).send().await.unwrap_err();
        assert!(AddressRefused::find(&error).is_some(), "an IPv4-mapped literal too: {error}");
        // Allowed by the operator, the same request goes through.
        let response = client(&["127.0.0.1/32"]).get(format!("http://{addr}/")).send().await.unwrap();
        assert_eq!(response.status(), 204);
    }

    #[tokio::test]
    async fn names_resolving_to_internal_addresses_are_refused_before_connecting() {
        let (addr, accepted) = listener().await;
        let error = client(&[]).get(format!("http://localhost:{}/", addr.port())).send().await.unwrap_err();
        assert!(AddressRefused::find(&error).is_some(), "{error}");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 0, "no connection was made");
    }
}
