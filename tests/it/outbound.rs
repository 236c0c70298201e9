//! Outbound connections a partner can aim: a bucket endpoint that redirects to internal
//! addresses, and proxy variables in exportd's environment, reach nothing internal; the partner
//! reads a reason code, never a remote status or body.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use exportd::delivery::subscriptions;
use serde_json::json;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::common::processes::{Fleet, database_url, worker_command};
use crate::common::{TestApp, edited_registry, edited_tenants_dir};
use crate::deliveries::{courier_allowing, var};

/// A listener at `addr` answering every request with `answer`; counts the connections it took.
async fn listener(addr: &str, answer: String) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let socket = TcpListener::bind(addr).await.unwrap();
    let local = socket.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = socket.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut request = vec![0u8; 16 * 1024];
                let _ = stream.read(&mut request).await;
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    (local, accepted)
}

fn destination(endpoint: &str, bucket: &str) -> String {
    format!(
        r#"
[[destinations]]
name = "zen-landing"
principal = "zenpartner"
url = "s3://{bucket}/p-{}"
endpoint = "{endpoint}"
credentials.access_key_id = {{ env = "EXPORTD_TEST_PARTNER_S3_ACCESS_KEY_ID" }}
credentials.secret_access_key = {{ env = "EXPORTD_TEST_PARTNER_S3_SECRET_ACCESS_KEY" }}

[[subscriptions]]
name = "zen-tickets"
destination = "zen-landing"
dataset = "tickets"
format = "jsonl"
"#,
        uuid::Uuid::new_v4().simple()
    )
}

#[sqlx::test(migrations = "./migrations")]
async fn a_bucket_that_redirects_to_internal_addresses_reaches_none_of_them(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // An internal listener (127.0.0.2: loopback, not in the allowed networks) and a "bucket" the
    // operator allowed (127.0.0.1) that redirects every request to it, under several spellings.
    let secret_body = "internal-status-page-7d1c";
    let (internal, reached) = listener(
        "127.0.0.2:0",
        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{secret_body}", secret_body.len()),
    )
    .await;
    let port = internal.port();
    app.seed("acme", "tickets", 5).await;
    for target in [
        format!("http://127.0.0.2:{port}/"),
        format!("http://[::ffff:127.0.0.2]:{port}/"),
        format!("http://2130706434:{port}/"),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
    ] {
        let answer = format!(
            "HTTP/1.1 307 Temporary Redirect\r\nlocation: {target}\r\ncontent-length: {}\r\n\r\n{secret_body}",
            secret_body.len()
        );
        let (bucket, asked) = listener("127.0.0.1:0", answer).await;
        let registry =
            edited_registry("acme", |t| format!("{t}\n{}", destination(&format!("http://{bucket}"), "landing")));
        sqlx::query("DELETE FROM bucket_deliveries").execute(&app.pool).await.unwrap();
        subscriptions::sync(&app.pool, &registry).await.unwrap();
        let partner = app.token("acme", "zenpartner");
        app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl"})).await;
        app.drain().await;
        let courier = courier_allowing(&app, registry, &["127.0.0.1/32"]);
        assert_eq!(courier.pass().await.unwrap(), 1);
        assert!(asked.load(Ordering::SeqCst) > 0, "the bucket endpoint was asked");
        assert_eq!(reached.load(Ordering::SeqCst), 0, "the redirect to {target} was not followed");
        let error: String =
            sqlx::query_scalar("SELECT last_error FROM bucket_deliveries").fetch_one(&app.pool).await.unwrap();
        assert!(error.starts_with("remote-error:") && error.contains("redirects are not followed"), "{error}");
        for remote in ["307", "Temporary Redirect", secret_body, "127.0.0.2", "169.254"] {
            assert!(!error.contains(remote), "the partner reads `{remote}` in {error}");
        }
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn proxy_variables_in_the_environment_are_ignored_by_deliveries(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (proxy, proxied) =
        listener("127.0.0.1:0", "HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n".into()).await;
    let endpoint = var("EXPORTD_TEST_PARTNER_S3_ENDPOINT");
    let text = destination(&endpoint, &var("EXPORTD_TEST_PARTNER_S3_BUCKET"));
    let tenants = edited_tenants_dir("acme", |t| format!("{t}\n{text}"));
    let registry = Arc::new(exportd::tenants::Registry::load(tenants.path()).unwrap());
    subscriptions::sync(&app.pool, &registry).await.unwrap();
    app.seed("acme", "tickets", 20).await;
    let partner = app.token("acme", "zenpartner");
    app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl"})).await;
    app.drain().await;

    let url = database_url(&app.pool).await;
    let log = app.data_dir.path().join("worker.log");
    let proxy = format!("http://{proxy}");
    let mut command = worker_command(&url, app.data_dir.path(), &log, 1, "5s");
    command
        .env("EXPORTD_TENANTS_DIR", tenants.path())
        .env("EXPORTD_DELIVERY_ALLOW_NETS", "127.0.0.0/8")
        .env_remove("NO_PROXY")
        .env_remove("no_proxy");
    for name in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"] {
        command.env(name, &proxy);
    }
    let _worker = Fleet(vec![command.spawn().unwrap()]);
    let start = Instant::now();
    loop {
        let state: Option<(String, Option<String>)> =
            sqlx::query_as("SELECT state, last_error FROM bucket_deliveries").fetch_optional(&app.pool).await.unwrap();
        if let Some((state, _)) = &state
            && state == "delivered"
        {
            break;
        }
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(start.elapsed() < Duration::from_secs(60), "not delivered: {state:?}\n{log}");
        assert_eq!(proxied.load(Ordering::SeqCst), 0, "a delivery went through the proxy: {state:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(proxied.load(Ordering::SeqCst), 0, "nothing went through the proxy");
}
