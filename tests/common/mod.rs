//! Shared test harness: the real app on a real port, over a fresh database per test.
#![allow(dead_code)] // each test binary uses a different part of the harness

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use exportd::http::{self, AppState};
use exportd::tenants::{Registry, Tenant};
use serde_json::Value;
use sqlx::PgPool;

pub fn fixture_tenants_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tenants")
}

pub fn fixture_registry() -> Arc<Registry> {
    Arc::new(Registry::load(&fixture_tenants_dir()).expect("fixture tenants load"))
}

/// Copies the fixture catalogue into the test database, as `serve` does at start-up.
pub async fn prepare_db(pool: &PgPool) -> Arc<Registry> {
    let registry = fixture_registry();
    exportd::db::sync_catalogue(pool, &registry)
        .await
        .expect("catalogue sync");
    registry
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub pool: PgPool,
    pub registry: Arc<Registry>,
    pub client: reqwest::Client,
}

impl TestApp {
    pub async fn spawn(pool: PgPool) -> TestApp {
        let registry = prepare_db(&pool).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().unwrap();
        let app = http::app(AppState {
            pool: pool.clone(),
            registry: registry.clone(),
        });
        tokio::spawn(http::serve(
            listener,
            app,
            std::future::pending(),
            Duration::from_secs(1),
        ));
        TestApp {
            addr,
            pool,
            registry,
            client: reqwest::Client::new(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn tenant(&self, id: &str) -> &Tenant {
        self.registry.get(id).expect("fixture tenant")
    }

    /// A valid one-hour token.
    pub fn token(&self, tenant: &str, principal: &str) -> String {
        exportd::auth::mint(self.tenant(tenant), principal, Duration::from_secs(3600)).unwrap()
    }

    pub async fn get(&self, token: Option<&str>, path: &str) -> reqwest::Response {
        let mut request = self.client.get(self.url(path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send().await.expect("request sent")
    }

    pub async fn ingest(&self, token: &str, dataset: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(self.url(&format!("/v1/datasets/{dataset}/records")))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .expect("request sent")
    }
}

/// The body of a problem+json response, after checking its content type.
pub async fn problem(response: reqwest::Response) -> Value {
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(content_type, "application/problem+json");
    response.json().await.unwrap()
}

/// Waits until backend `pid` is blocked by another transaction's lock (read from
/// `pg_blocking_pids`, a real condition, not a guessed sleep).
pub async fn wait_until_blocked(pool: &PgPool, pid: i32) {
    for _ in 0..1000 {
        let blocked: bool = sqlx::query_scalar("SELECT cardinality(pg_blocking_pids($1)) > 0")
            .bind(pid)
            .fetch_one(pool)
            .await
            .unwrap();
        if blocked {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("backend {pid} did not block on a lock within 5 s");
}
