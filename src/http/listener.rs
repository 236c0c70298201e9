//! The accept loop: bounded connections, a deadline for every request head, and a graceful drain.
//!
//! `axum::serve` accepts without limit and waits forever for a request head, so a few thousand
//! silent TCP connections exhaust the process's file descriptors (and starve the workers and the
//! database pool of them). Here a connection must send a complete request head within
//! `header_read_timeout` of connecting or of its previous response (which also bounds idle
//! keep-alive), and at most `max_connections` are open: past that, the connection that has
//! waited longest without sending a byte is closed to admit the new one, so silent connections
//! can never lock out real clients.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tower::ServiceExt;

/// Descriptors kept for everything but client connections: database pools, shard and download
/// files, the cleaner.
pub const RESERVED_DESCRIPTORS: u64 = 1024;

#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits { max_connections: 4096, header_read_timeout: Duration::from_secs(15) }
    }
}

impl ConnectionLimits {
    /// Raises the soft `RLIMIT_NOFILE` to the hard limit and keeps `max_connections` below it,
    /// with [`RESERVED_DESCRIPTORS`] to spare.
    pub fn fit_descriptors(self) -> ConnectionLimits {
        let available = match rlimit::increase_nofile_limit(u64::MAX) {
            Ok(limit) => limit,
            Err(e) => {
                tracing::warn!(error = %e, "could not raise RLIMIT_NOFILE");
                rlimit::getrlimit(rlimit::Resource::NOFILE).map(|(soft, _)| soft).unwrap_or(1024)
            }
        };
        let fit = available.saturating_sub(RESERVED_DESCRIPTORS).max(16) as usize;
        if fit < self.max_connections {
            tracing::warn!(
                max_connections = fit,
                open_files = available,
                "fewer connections than configured: RLIMIT_NOFILE is low"
            );
        }
        ConnectionLimits { max_connections: self.max_connections.min(fit), ..self }
    }
}

/// Connections open, and those that have not sent their first byte yet (oldest first), each
/// with the means to close it.
#[derive(Default)]
struct Connections {
    open: AtomicUsize,
    next_id: AtomicU64,
    silent: Mutex<BTreeMap<u64, Silent>>,
}

struct Silent {
    close: oneshot::Sender<()>,
    counted: Arc<AtomicBool>,
}

impl Connections {
    /// Makes room for one more connection: closes the oldest silent one when full (its slot is
    /// freed at once). `false` when every open connection is busy with a request.
    fn make_room(&self, max: usize) -> bool {
        if self.open.load(Ordering::Acquire) < max {
            return true;
        }
        let oldest = self.silent.lock().expect("not poisoned").pop_first();
        match oldest {
            Some((_, silent)) => {
                self.release(&silent.counted);
                let _ = silent.close.send(());
                metrics::counter!("exportd_connections_evicted_total").increment(1);
                true
            }
            None => false,
        }
    }

    /// Frees a connection's slot, once.
    fn release(&self, counted: &AtomicBool) {
        if counted.swap(false, Ordering::AcqRel) {
            self.open.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The connection sent its first byte: no longer evictable. `false` if it was evicted first.
    fn started(&self, id: u64) -> bool {
        self.silent.lock().expect("not poisoned").remove(&id).is_some()
    }
}

/// A connection's slot, freed when dropped (unless an eviction freed it already).
struct Open {
    connections: Arc<Connections>,
    id: u64,
    counted: Arc<AtomicBool>,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.connections.silent.lock().expect("not poisoned").remove(&self.id);
        self.connections.release(&self.counted);
    }
}

/// Serves `app` until `shutdown` resolves, then lets in-flight requests finish for at most
/// `drain`: one slow download must not hold a deploy hostage.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    drain: Duration,
) -> std::io::Result<()> {
    let connections = Arc::new(Connections::default());
    let graceful = GracefulShutdown::new();
    let (stopping_tx, stopping) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors (EMFILE) or a connection reset before accept: pause, go on.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if !connections.make_room(limits.max_connections) {
            metrics::counter!("exportd_connections_refused_total").increment(1);
            continue; // dropping the stream closes it
        }
        let _ = stream.set_nodelay(true);
        let id = connections.next_id.fetch_add(1, Ordering::Relaxed);
        let (close_tx, close) = oneshot::channel();
        let counted = Arc::new(AtomicBool::new(true));
        connections.open.fetch_add(1, Ordering::AcqRel);
        connections
            .silent
            .lock()
            .expect("not poisoned")
            .insert(id, Silent { close: close_tx, counted: counted.clone() });
        let open = Open { connections: connections.clone(), id, counted };
        let watcher = graceful.watcher();
        let (app, mut stopping) = (app.clone(), stopping.clone());
        tokio::spawn(async move {
            // `peek`, not `readable`: readiness may be reported before any byte has arrived.
            let mut byte = [0u8; 1];
            let first_byte = tokio::select! {
                peeked = stream.peek(&mut byte) => matches!(peeked, Ok(n) if n > 0),
                _ = close => false,
                () = tokio::time::sleep(limits.header_read_timeout) => false,
                _ = stopping.wait_for(|stop| *stop) => false,
            };
            if !first_byte || !open.connections.started(open.id) {
                return;
            }
            let service =
                TowerToHyperService::new(app.map_request(move |mut request: axum::http::Request<Incoming>| {
                    request.extensions_mut().insert(ConnectInfo(peer));
                    request
                }));
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), service);
            let _ = watcher.watch(connection).await;
            drop(open);
        });
    }
    let _ = stopping_tx.send(true);
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(drain_seconds = drain.as_secs(), "connections still open after the drain deadline; closing");
        }
    }
    Ok(())
}
