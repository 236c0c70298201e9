//! A send timeout for every response: a client that stops reading (a tiny receive window, a
//! paused process) would otherwise keep its connection busy — never evicted — and hold whatever
//! the response holds (a download slot, a page in memory, the store's stream) for as long as it
//! likes. While a response is being sent, when for `send_timeout` the socket has taken no bytes
//! and hyper has not asked the body for more — while the body is not itself waiting on its
//! source (a slow store, a query) — the reader has stalled: the connection is closed (like
//! nginx's `send_timeout`), which drops the body and everything it holds. A slow reader that
//! takes a few bytes now and then is not stalled.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use http_body::Frame;

/// What one connection's send side is doing, shared by its socket, its response body and its
/// watchdog.
pub struct SendProgress {
    opened: Instant,
    /// A response body is alive (not yet sent to the end or dropped).
    sending: AtomicBool,
    /// When hyper last asked the body for bytes, and when the socket last took some
    /// (milliseconds after `opened`).
    asked_at_ms: AtomicU64,
    wrote_at_ms: AtomicU64,
    /// The body's last answer was "not yet": it waits on its source, not on the client.
    waiting_on_source: AtomicBool,
}

impl SendProgress {
    pub fn new() -> SendProgress {
        SendProgress {
            opened: Instant::now(),
            sending: false.into(),
            asked_at_ms: 0.into(),
            wrote_at_ms: 0.into(),
            waiting_on_source: false.into(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// The socket accepted bytes.
    pub fn wrote(&self) {
        self.wrote_at_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Whether the client has taken nothing of a response for `patience`.
    fn stalled(&self, patience: Duration) -> bool {
        let last = self.asked_at_ms.load(Ordering::Relaxed).max(self.wrote_at_ms.load(Ordering::Relaxed));
        self.sending.load(Ordering::Relaxed)
            && !self.waiting_on_source.load(Ordering::Relaxed)
            && self.now_ms().saturating_sub(last) >= patience.as_millis() as u64
    }
}

/// Resolves when the connection's reader has stalled for `patience` (never while idle).
pub async fn stalled(progress: &SendProgress, patience: Duration) {
    let tick = (patience / 4).max(Duration::from_millis(50));
    loop {
        tokio::time::sleep(tick).await;
        if progress.stalled(patience) {
            tracing::warn!(patience_seconds = patience.as_secs_f64(), "a client stopped reading its response; closing");
            metrics::counter!("exportd_responses_stalled_total").increment(1);
            return;
        }
    }
}

/// A response body that reports to its connection's [`SendProgress`].
pub struct Watched {
    body: Body,
    progress: Arc<SendProgress>,
}

impl Watched {
    pub fn new(body: Body, progress: Arc<SendProgress>) -> Watched {
        progress.asked_at_ms.store(progress.now_ms(), Ordering::Relaxed);
        progress.waiting_on_source.store(false, Ordering::Relaxed);
        progress.sending.store(true, Ordering::Relaxed);
        Watched { body, progress }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.progress.sending.store(false, Ordering::Relaxed);
    }
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let progress = self.progress.clone();
        progress.asked_at_ms.store(progress.now_ms(), Ordering::Relaxed);
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        progress.waiting_on_source.store(polled.is_pending(), Ordering::Relaxed);
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
