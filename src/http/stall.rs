//! A send timeout for streamed bodies: a client that stops reading (a tiny receive window, a
//! paused process) would otherwise hold its download slot, its connection and the store's
//! stream for as long as it likes. When for `patience` the socket has taken no bytes and hyper
//! has not asked the body for more — while the body is not itself waiting on the store — the
//! reader has stalled: its connection is closed (like nginx's `send_timeout`), which drops the
//! body and returns the slot. A slow reader that takes a few bytes now and then is not stalled.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::Stream;

use super::listener::ConnectionCloser;

/// When the body was last asked for bytes, and whether it is waiting on its source.
struct Progress {
    started: Instant,
    asked_at_ms: AtomicU64,
    waiting_on_source: AtomicBool,
}

impl Progress {
    fn since_asked(&self) -> Duration {
        let asked = Duration::from_millis(self.asked_at_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(asked)
    }
}

/// `inner`, closing `connection` when its reader stalls for `patience`.
pub struct SendTimeout<S> {
    inner: S,
    progress: Arc<Progress>,
}

impl<S> SendTimeout<S> {
    pub fn new(inner: S, connection: Option<ConnectionCloser>, patience: Duration) -> SendTimeout<S> {
        let progress =
            Arc::new(Progress { started: Instant::now(), asked_at_ms: 0.into(), waiting_on_source: false.into() });
        if let Some(connection) = connection {
            tokio::spawn(watch(Arc::downgrade(&progress), connection, patience));
        }
        SendTimeout { inner, progress }
    }
}

/// Closes the connection once the body has gone unasked for `patience`; ends with the body.
async fn watch(progress: Weak<Progress>, connection: ConnectionCloser, patience: Duration) {
    let tick = (patience / 4).max(Duration::from_millis(50));
    loop {
        tokio::time::sleep(tick).await;
        let Some(progress) = progress.upgrade() else { return };
        let idle = progress.since_asked().min(connection.since_client_took_bytes());
        if !progress.waiting_on_source.load(Ordering::Relaxed) && idle >= patience {
            tracing::warn!(patience_seconds = patience.as_secs_f64(), "a download's reader stalled; closing it");
            metrics::counter!("exportd_downloads_stalled_total").increment(1);
            connection.close();
            return;
        }
    }
}

impl<S: Stream + Unpin> Stream for SendTimeout<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let progress = &self.progress;
        progress.asked_at_ms.store(progress.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        self.progress.waiting_on_source.store(polled.is_pending(), Ordering::Relaxed);
        polled
    }
}
