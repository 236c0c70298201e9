//! The accept loop: bounded connections, a deadline for every request head, and a graceful drain.
//!
//! `axum::serve` accepts without limit and waits forever for a request head, so a few thousand
//! silent TCP connections exhaust the process's file descriptors (and starve the workers and the
//! database pool of them). Here a connection must send a complete request head within
//! `header_read_timeout` of connecting or of its previous response (which also bounds idle
//! keep-alive), and at most `max_connections` are open: past that, the connection idle longest
//! — one with no request in progress: silent, between requests, or still sending a request head
//! however slowly — is closed to admit the new one, so neither silent nor slowloris connections
//! can lock out real clients. A response whose client stops reading is abandoned after
//! `send_timeout` ([`super::stall`]), so a busy connection is never busy forever either.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tower::ServiceExt;

use super::stall::{self, SendProgress, Watched};

/// Descriptors kept for everything but client connections: database pools, shard and download
/// files, the cleaner.
pub const RESERVED_DESCRIPTORS: u64 = 1024;

#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// A response whose client takes nothing for this long is abandoned (see [`super::stall`]).
    pub send_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(15),
            send_timeout: Duration::from_secs(30),
        }
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

/// Connections open, and those idle — waiting for (the rest of) a request head, oldest first —
/// each with the means to close it.
#[derive(Default)]
struct Connections {
    open: AtomicUsize,
    next_turn: AtomicU64,
    idle: Mutex<BTreeMap<u64, Arc<Connection>>>,
}

/// One client connection as the accept loop tracks it.
struct Connection {
    /// Told to drop the connection (evicted to make room).
    close: Notify,
    /// Holds one of `Connections::open` until released.
    counted: AtomicBool,
    /// Its place in `Connections::idle` while idle (changed under that lock only).
    turn: AtomicU64,
    /// What its responses are doing (the send timeout's watch).
    progress: Arc<SendProgress>,
}

const NOT_IDLE: u64 = u64::MAX;

impl Connections {
    /// Makes room for one more connection: closes the one idle longest when full (its slot is
    /// freed at once). `false` when every open connection is busy with a request.
    fn make_room(&self, max: usize) -> bool {
        if self.open.load(Ordering::Acquire) < max {
            return true;
        }
        let oldest = {
            let mut idle = self.idle.lock().expect("not poisoned");
            let oldest = idle.pop_first().map(|(_, connection)| connection);
            if let Some(connection) = &oldest {
                connection.turn.store(NOT_IDLE, Ordering::Relaxed);
            }
            oldest
        };
        match oldest {
            Some(connection) => {
                self.release(&connection);
                connection.close.notify_one();
                metrics::counter!("exportd_connections_evicted_total").increment(1);
                true
            }
            None => false,
        }
    }

    /// Frees a connection's slot, once.
    fn release(&self, connection: &Connection) {
        if connection.counted.swap(false, Ordering::AcqRel) {
            self.open.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The connection waits for a request head (again): it may be evicted, oldest first.
    fn idle(&self, connection: &Arc<Connection>) {
        let mut idle = self.idle.lock().expect("not poisoned");
        if !connection.counted.load(Ordering::Acquire) {
            return; // evicted or closed already
        }
        let previous = connection.turn.load(Ordering::Relaxed);
        if previous != NOT_IDLE {
            idle.remove(&previous);
        }
        let turn = self.next_turn.fetch_add(1, Ordering::Relaxed);
        connection.turn.store(turn, Ordering::Relaxed);
        idle.insert(turn, connection.clone());
    }

    /// A request head arrived: the connection is busy until its response has been sent.
    fn busy(&self, connection: &Connection) {
        let mut idle = self.idle.lock().expect("not poisoned");
        let turn = connection.turn.swap(NOT_IDLE, Ordering::Relaxed);
        if turn != NOT_IDLE {
            idle.remove(&turn);
        }
    }
}

/// A connection's slot, freed when dropped (unless an eviction freed it already).
struct Open {
    connections: Arc<Connections>,
    connection: Arc<Connection>,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.connections.busy(&self.connection);
        self.connections.release(&self.connection);
    }
}

/// The client socket, noting when it accepts bytes.
struct Noting<S> {
    socket: S,
    progress: Arc<SendProgress>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Noting<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.socket).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Noting<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let written = Pin::new(&mut self.socket).poll_write(cx, buf);
        self.noted(&written);
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let written = Pin::new(&mut self.socket).poll_write_vectored(cx, bufs);
        self.noted(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.socket.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.socket).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.socket).poll_shutdown(cx)
    }
}

impl<S> Noting<S> {
    fn noted(&self, written: &Poll<std::io::Result<usize>>) {
        if matches!(written, Poll::Ready(Ok(n)) if *n > 0) {
            self.progress.wrote();
        }
    }
}

/// Marks the connection idle again when dropped: its response body has been sent (or dropped).
struct IdleAgain {
    connections: Arc<Connections>,
    connection: Arc<Connection>,
}

impl Drop for IdleAgain {
    fn drop(&mut self) {
        self.connections.idle(&self.connection);
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
        let connection = Arc::new(Connection {
            close: Notify::new(),
            counted: AtomicBool::new(true),
            turn: AtomicU64::new(NOT_IDLE),
            progress: Arc::new(SendProgress::new()),
        });
        connections.open.fetch_add(1, Ordering::AcqRel);
        connections.idle(&connection);
        let open = Open { connections: connections.clone(), connection };
        let watcher = graceful.watcher();
        let (app, mut stopping) = (app.clone(), stopping.clone());
        tokio::spawn(async move {
            // `peek`, not `readable`: readiness may be reported before any byte has arrived.
            let mut byte = [0u8; 1];
            let first_byte = tokio::select! {
                peeked = stream.peek(&mut byte) => matches!(peeked, Ok(n) if n > 0),
                () = open.connection.close.notified() => false,
                () = tokio::time::sleep(limits.header_read_timeout) => false,
                _ = stopping.wait_for(|stop| *stop) => false,
            };
            if !first_byte {
                return;
            }
            let socket = Noting { socket: stream, progress: open.connection.progress.clone() };
            let (requests, responses) = (open.connections.clone(), open.connections.clone());
            let (busy, idle_again) = (open.connection.clone(), open.connection.clone());
            let app = app
                .map_request(move |mut request: axum::http::Request<Incoming>| {
                    requests.busy(&busy);
                    request.extensions_mut().insert(ConnectInfo(peer));
                    request
                })
                .map_response(move |response: axum::response::Response| {
                    let guard = IdleAgain { connections: responses.clone(), connection: idle_again.clone() };
                    let progress = idle_again.progress.clone();
                    response.map(|body| {
                        let watched = Watched::new(body, progress);
                        axum::body::Body::new(http_body_util::BodyExt::map_frame(watched, move |frame| {
                            let _sent_while = &guard;
                            frame
                        }))
                    })
                });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(socket), TowerToHyperService::new(app));
            tokio::select! {
                _ = watcher.watch(connection) => {}
                () = open.connection.close.notified() => {}
                () = stall::stalled(&open.connection.progress, limits.send_timeout) => {}
            }
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
