//! Tenant isolation under hostile load: what a refusal costs, and which requests pay the rate.

mod common;

use std::time::Duration;

use common::{TestApp, full_csv, problem};
use serde_json::Value;
use sqlx::PgPool;

/// Transactions committed in this database so far.
async fn committed(pool: &PgPool) -> i64 {
    common::processes::database_stat(pool, "xact_commit").await
}

#[sqlx::test(migrations = "./migrations")]
async fn a_flood_of_refused_requests_costs_no_database_work_and_is_still_counted(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let partner = app.token("initech", "milton"); // 2 requests/s, burst 3
    let before = committed(&app.pool).await;
    let statuses = futures_util::future::join_all((0..400).map(|_| app.get(Some(&partner), "/v1/datasets"))).await;
    let refused = statuses.iter().filter(|r| r.status() == 429).count();
    assert!(refused >= 390, "{refused} of 400 refused");
    let during = committed(&app.pool).await - before;
    // The only database work in that time: the statistics reads here and a flush a second.
    assert!(during < 40, "{during} transactions for {refused} refusals");
    let mut counted = 0;
    for _ in 0..300 {
        counted = sqlx::query_scalar::<_, i64>("SELECT rate_limited FROM tenant_usage WHERE tenant = 'initech'")
            .fetch_optional(&app.pool)
            .await
            .unwrap()
            .unwrap_or(0);
        if counted >= refused as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(counted, refused as i64, "every refusal is counted, in batches");
}

#[sqlx::test(migrations = "./migrations")]
async fn downloads_pay_the_api_rate_like_every_other_request(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("initech", "tickets", 20).await;
    let admin = app.token("initech", "bill"); // 2 requests/s, burst 3
    let id = app.export(&admin, &full_csv(10)).await;
    app.drain().await;
    tokio::time::sleep(Duration::from_secs(2)).await; // the bucket refills
    let status: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    let link = status["links"]["file"].as_str().unwrap().to_owned();
    let responses = futures_util::future::join_all((0..8).map(|_| app.get(None, &link))).await;
    let ok = responses.iter().filter(|r| r.status() == 200).count();
    assert!((1..=3).contains(&ok), "{ok} of 8 link downloads admitted");
    let refused = responses.into_iter().find(|r| r.status() == 429).expect("some were refused");
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(problem(refused).await["code"], "rate-limited");
}

/// A sibling server that admits 20 connections and waits 1 s for a request head.
async fn small_server(app: &TestApp) -> String {
    let limits = exportd::http::ConnectionLimits { max_connections: 20, header_read_timeout: Duration::from_secs(1) };
    app.sibling_limited(app.registry.clone(), |_| {}, limits).await
}

#[sqlx::test(migrations = "./migrations")]
async fn silent_connections_past_the_limit_do_not_lock_out_a_real_client(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let base = small_server(&app).await;
    let address = base.trim_start_matches("http://").to_owned();
    let mut silent = Vec::new();
    for _ in 0..200 {
        silent.push(tokio::net::TcpStream::connect(&address).await.unwrap());
    }
    let started = std::time::Instant::now();
    let health = reqwest::Client::new().get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(started.elapsed() < Duration::from_millis(900), "answered in {:?}", started.elapsed());
    drop(silent);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_connection_that_never_finishes_its_request_head_is_closed(pool: PgPool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = TestApp::spawn(pool).await;
    let base = small_server(&app).await;
    let address = base.trim_start_matches("http://").to_owned();
    for opening in [&b""[..], b"GET /healthz HTTP/1.1\r\nHost: x\r\n"] {
        let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
        stream.write_all(opening).await.unwrap();
        let started = std::time::Instant::now();
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "closed by the server, not left open");
        assert!(started.elapsed() >= Duration::from_millis(900), "after the header timeout");
        assert!(!String::from_utf8_lossy(&buf).contains("200 OK"), "no request was served");
    }
    // An idle keep-alive connection is closed the same way after its response.
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "an idle keep-alive connection is closed");
    assert!(String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200 OK"));
}

/// The JSON inside a sealed feed cursor (the test knows the server keys).
fn opened_cursor(cursor: &str) -> Value {
    let keys = exportd::links::LinkKeys::parse(common::LINK_KEYS).unwrap();
    serde_json::from_slice(&keys.open("exportd-cursor", cursor).expect("a sealed cursor")).unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_partner_never_receives_keys_of_records_outside_its_row_filter(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let partner = app.token("acme", "zenpartner"); // row filter: region = emea
    let start = app.cursor_now(&partner, "tickets").await;
    let mut conn = app.pool.acquire().await.unwrap();
    for (key, region) in [
        ("a-1", "emea"),
        ("b-SECRET-amer-merger", "amer"),
        ("c-1", "emea"),
        ("e-1", "emea"),
        ("zzz-SECRET-apac", "apac"),
    ] {
        sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, $2)")
            .bind(key)
            .bind(serde_json::json!({"subject": "s", "status": "open", "region": region}))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    app.tick().await;
    app.pass_safety_delay();

    // One change per page: every cursor stops at a key the partner was given.
    let mut cursor = start.clone();
    let mut delivered = Vec::new();
    loop {
        let page = app.pull(&partner, "tickets", &cursor, 1).await;
        for change in page["changes"].as_array().unwrap() {
            delivered.push(change["key"].as_str().unwrap().to_owned());
        }
        cursor = page["next_cursor"].as_str().unwrap().to_owned();
        assert!(!cursor.contains("SECRET") && !page.to_string().contains("SECRET"));
        let inside = opened_cursor(&cursor);
        match inside["after"].as_str() {
            Some(after) => assert!(delivered.iter().any(|k| k == after), "cursor at {after}, not a delivered key"),
            None => assert_eq!(inside.get("after"), None),
        }
        if page["end_of_stream"] == true {
            break;
        }
    }
    assert_eq!(delivered, vec!["a-1", "c-1", "e-1"]);

    // An incremental export of the same changes: no manifest field names a hidden key.
    let body = serde_json::json!({"dataset": "tickets", "format": "jsonl", "mode": "incremental", "shard_rows": 1, "since": start});
    let id = app.export(&partner, &body).await;
    app.drain().await;
    let manifest = app.get(Some(&partner), &format!("/v1/exports/{id}/manifest")).await.text().await.unwrap();
    assert!(!manifest.contains("SECRET"), "{manifest}");
    let manifest: Value = serde_json::from_str(&manifest).unwrap();
    assert_eq!(manifest["total_rows"], 3);
    assert!(!opened_cursor(manifest["next_cursor"].as_str().unwrap()).to_string().contains("SECRET"));
}
