//! A webhook receiver on a real port: records every request it gets and answers as scripted
//! (one answer per request in order, then 200).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;

#[derive(Debug, Clone)]
pub enum Answer {
    Status(u16),
    /// Never answers (the sender's timeout must end the attempt).
    Hang,
    /// A redirect elsewhere, which must not be followed.
    Redirect(String),
}

#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: String,
}

#[derive(Default)]
struct Inner {
    script: VecDeque<Answer>,
    received: Vec<Received>,
    /// Added to every answer (overlapping attempts in race tests).
    delay: Duration,
}

#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
    arrived: Arc<tokio::sync::Notify>,
}

impl Receiver {
    pub async fn start(script: Vec<Answer>) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Receiver::serve(listener, script)
    }

    /// A receiver on `addr` (a port chosen earlier, e.g. one that refused connections so far).
    pub async fn start_on(addr: SocketAddr, script: Vec<Answer>) -> Receiver {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        Receiver::serve(listener, script)
    }

    fn serve(listener: tokio::net::TcpListener, script: Vec<Answer>) -> Receiver {
        let addr = listener.local_addr().unwrap();
        let inner = Arc::new(Mutex::new(Inner { script: script.into(), ..Inner::default() }));
        let arrived = Arc::new(tokio::sync::Notify::new());
        let receiver = Receiver { addr, inner, arrived };
        let handler_state = receiver.clone();
        let app = axum::Router::new().fallback(move |uri: axum::http::Uri, headers: HeaderMap, body: String| {
            let state = handler_state.clone();
            async move { state.answer(uri.path().to_owned(), headers, body).await }
        });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        receiver
    }

    async fn answer(&self, path: String, headers: HeaderMap, body: String) -> axum::response::Response {
        let (answer, delay) = {
            let mut inner = self.inner.lock().unwrap();
            inner.received.push(Received { path, headers, body });
            (inner.script.pop_front().unwrap_or(Answer::Status(200)), inner.delay)
        };
        self.arrived.notify_waiters();
        tokio::time::sleep(delay).await;
        match answer {
            Answer::Status(code) => StatusCode::from_u16(code).unwrap().into_response(),
            Answer::Hang => {
                std::future::pending::<()>().await;
                unreachable!()
            }
            Answer::Redirect(to) => (StatusCode::TEMPORARY_REDIRECT, [("location", to)]).into_response(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn set_delay(&self, delay: Duration) {
        self.inner.lock().unwrap().delay = delay;
    }

    pub fn received(&self) -> Vec<Received> {
        self.inner.lock().unwrap().received.clone()
    }

    /// Waits until at least `count` requests arrived (panics after `within`).
    pub async fn wait_for(&self, count: usize, within: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.arrived.notified();
            let received = self.received();
            if received.len() >= count {
                return received;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("{count} webhook requests expected, {} arrived", self.received().len());
            }
        }
    }
}

/// A `[[webhooks]]` section for a tenant file.
pub fn webhook_section(name: &str, url: &str, events: &[&str], secret: &str) -> String {
    let events: Vec<String> = events.iter().map(|e| format!("\"{e}\"")).collect();
    format!(
        "\n[[webhooks]]\nname = \"{name}\"\nurl = \"{url}\"\nevents = [{}]\nsecret = \"{secret}\"\n",
        events.join(", ")
    )
}

/// A Standard Webhooks secret for tests.
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
