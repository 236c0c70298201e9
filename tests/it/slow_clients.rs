//! Slow and stalled clients inside one tenant: each principal holds only its share of the
//! tenant's slots, a stalled reader is cut off, a dripping body holds no slot, and a slow
//! request head is as evictable as a silent connection.

use std::time::Duration;

use serde_json::json;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{TestApp, edited_registry, problem};

/// acme with a second enabled partner, `carol`, and the default 8 slots of each kind.
fn acme_with_carol() -> std::sync::Arc<exportd::tenants::Registry> {
    edited_registry("acme", |t| {
        t.replace("max_concurrent_requests = 1000", "max_concurrent_requests = 8").replace(
            "# Generous: tests fire many requests at once.",
            "[[principals]]\nid = \"carol\"\nrole = \"partner\"\ngrants = [\"tickets\"]\n",
        )
    })
}

/// A one-hour token of `principal` in [`acme_with_carol`].
fn token(principal: &str) -> String {
    let registry = acme_with_carol();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    exportd::auth::mint_at(registry.get("acme").unwrap(), principal, now, now + 3600).unwrap()
}

/// A GET sent on a raw socket that reads only the start of the response, then stops reading:
/// its receive window stays tiny, so the server's writes stall. Returns the status and socket.
pub(crate) async fn stalled_get(address: &str, path: &str, token: &str) -> (u16, TcpStream) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(address.parse().unwrap()).await.unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut first = [0u8; 512];
    let n = stream.read(&mut first).await.unwrap();
    let status = String::from_utf8_lossy(&first[..n]).get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, stream)
}

async fn stalled_download(address: &str, path: &str, token: &str) -> TcpStream {
    let (status, stream) = stalled_get(address, path, token).await;
    assert_eq!(status, 200);
    stream
}

/// A POST whose head promises a body of which only the first byte is sent.
pub(crate) async fn dripping_post(address: &str, path: &str, token: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n["
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// Records of ~100 KB of hexadecimal noise each: an export of about 10 MB compressed, more than
/// the socket buffers between a server and a client that does not read.
pub(crate) async fn seed_incompressible(pool: &PgPool, records: i32) {
    sqlx::query(
        "SELECT exportd_upsert('acme', 'tickets', 'big-' || n,
                jsonb_build_object('subject', (SELECT string_agg(md5(random()::text || n || i), '')
                                               FROM generate_series(1, 3000) i),
                                   'status', 'open', 'region', 'emea'))
         FROM generate_series(1, $1) n",
    )
    .bind(records)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrations = "./migrations")]
async fn a_partners_stalled_downloads_hold_only_its_share_and_are_cut_off(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let partner = app.token("acme", "zenpartner");
    let cursor = app.cursor_now(&partner, "tickets").await;
    seed_incompressible(&app.pool, 100).await;
    let id = app.export(&partner, &json!({"dataset": "tickets", "format": "csv"})).await;
    app.drain().await;
    let limits = exportd::http::ConnectionLimits { send_timeout: Duration::from_secs(1), ..Default::default() };
    let base = app.sibling_limited(acme_with_carol(), |_| {}, limits).await;
    let address = base.trim_start_matches("http://").to_owned();
    let path = format!("/v1/exports/{id}/file");
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stalled_download(&address, &path, &partner).await);
    }
    // Half of the tenant's 8 slots is the partner's share: its fifth download waits its turn...
    let fifth = app.client.get(format!("{base}{path}")).bearer_auth(&partner).send().await.unwrap();
    assert_eq!(fifth.status(), 429);
    assert_eq!(problem(fifth).await["code"], "too-many-downloads");
    // ...while the admin still downloads.
    let admin = app.client.get(format!("{base}{path}")).bearer_auth(app.token("acme", "alice")).send().await;
    assert_eq!(admin.unwrap().status(), 200);
    // A reader that takes nothing for the send timeout is disconnected, and its slot returns.
    for mut stream in stalled {
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "the stalled download's connection is closed by the server");
    }
    // Any response does the same: a feed page of ~8 MiB to a reader that takes nothing.
    app.pass_safety_delay();
    app.tick().await;
    let mut page =
        stalled_download(&address, &format!("/v1/datasets/tickets/changes?limit=10000&cursor={cursor}"), &partner)
            .await;
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), page.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the stalled feed page's connection is closed by the server");
    let again = app.client.get(format!("{base}{path}")).bearer_auth(&partner).send().await.unwrap();
    assert_eq!(again.status(), 200, "the partner's slots came back");
    let body = again.bytes().await.unwrap();
    assert!(body.len() > 5_000_000, "a slow but steady reader gets the whole file: {} bytes", body.len());
}

#[sqlx::test(migrations = "./migrations")]
async fn bodies_that_drip_hold_no_request_slot(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let base = app.sibling(acme_with_carol()).await;
    let address = base.trim_start_matches("http://").to_owned();
    // 8 ingest requests whose bodies never finish, 4 from each of two partners: were a dripping
    // body to hold a request slot, they would hold all 8 of the tenant's (each partner its
    // share, half of them) and every other request would be refused.
    let mut dripping = Vec::new();
    for partner in ["zenpartner", "prism"] {
        for _ in 0..4 {
            dripping.push(dripping_post(&address, "/v1/datasets/tickets/records", &token(partner)).await);
        }
    }
    // Every principal of the tenant, the dripping ones too, is served all along.
    for round in 0..20 {
        for who in ["alice", "carol", "zenpartner", "prism"] {
            let response = app.client.get(format!("{base}/v1/datasets")).bearer_auth(token(who)).send();
            assert_eq!(response.await.unwrap().status(), 200, "{who}, round {round}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(dripping);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_principals_busy_requests_leave_the_others_their_share(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let four_slots =
        edited_registry("acme", |t| t.replace("max_concurrent_requests = 1000", "max_concurrent_requests = 4"));
    let base = app.sibling(four_slots).await;
    let admin = app.token("acme", "alice");
    // A host transaction holds key k1, so each admin ingest of k1 waits on it.
    let (host, host_pid) = crate::common::hold_record(&app.pool, "k1").await;
    let mut busy = Vec::new();
    for _ in 0..2 {
        let (client, url, token) = (app.client.clone(), format!("{base}/v1/datasets/tickets/records"), admin.clone());
        busy.push(tokio::spawn(async move {
            let body = json!([{"key": "k1", "data": {"subject": "batch", "status": "open"}}]);
            client.post(url).bearer_auth(token).json(&body).send().await.unwrap().status()
        }));
    }
    crate::common::wait_until_blocking(&app.pool, host_pid, 2).await;
    let fifth = app.client.get(format!("{base}/v1/datasets")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(fifth.status(), 429, "the admins' share is half of the tenant's slots");
    assert_eq!(problem(fifth).await["code"], "too-many-concurrent-requests");
    let partner = app.client.get(format!("{base}/v1/datasets")).bearer_auth(app.token("acme", "zenpartner")).send();
    assert_eq!(partner.await.unwrap().status(), 200, "a partner's feed is not refused");
    host.commit().await.unwrap();
    for request in busy {
        assert_eq!(request.await.unwrap(), 200);
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn slow_request_heads_are_evicted_like_silent_connections(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let limits = exportd::http::ConnectionLimits {
        max_connections: 20,
        header_read_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let base = app.sibling_limited(app.registry.clone(), |_| {}, limits).await;
    let address = base.trim_start_matches("http://").to_owned();
    // More connections than the server admits, each with part of a request head sent.
    let mut partial = Vec::new();
    for _ in 0..40 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n").await.unwrap();
        partial.push(stream);
    }
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    for probe in 0..10 {
        let health = client.get(format!("{base}/healthz")).send().await;
        assert_eq!(health.map(|r| r.status().as_u16()).ok(), Some(200), "probe {probe}");
    }
    drop(partial);
}
