//! Tenant isolation under hostile load: what a refusal costs, and which requests pay the rate.

use std::time::Duration;

use crate::common::{TestApp, full_csv, problem};
use serde_json::Value;
use sqlx::PgPool;

/// Transactions committed in this database so far.
async fn committed(pool: &PgPool) -> i64 {
    crate::common::processes::database_stat(pool, "xact_commit").await
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
    small_server_waiting(app, Duration::from_secs(1)).await
}

/// A sibling server that admits 20 connections and waits `header_timeout` for a request head.
async fn small_server_waiting(app: &TestApp, header_timeout: Duration) -> String {
    let limits = exportd::http::ConnectionLimits {
        max_connections: 20,
        header_read_timeout: header_timeout,
        ..Default::default()
    };
    app.sibling_limited(app.registry.clone(), |_| {}, limits).await
}

#[sqlx::test(migrations = "./migrations")]
async fn silent_connections_past_the_limit_do_not_lock_out_a_real_client(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // Silent connections would be closed after 10 s; the client is answered long before that,
    // while all of them are still open.
    let base = small_server_waiting(&app, Duration::from_secs(10)).await;
    let address = base.trim_start_matches("http://").to_owned();
    let mut silent = Vec::new();
    for _ in 0..200 {
        silent.push(tokio::net::TcpStream::connect(&address).await.unwrap());
    }
    let started = std::time::Instant::now();
    let health = reqwest::Client::new().get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(started.elapsed() < Duration::from_secs(5), "answered in {:?}", started.elapsed());
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
    let keys = exportd::links::LinkKeys::parse(crate::common::LINK_KEYS).unwrap();
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

/// Posts a JSON body given as text (numbers exactly as written, sizes no serializer would make).
async fn ingest_text(app: &TestApp, token: &str, body: String) -> reqwest::Response {
    let url = app.url("/v1/datasets/tickets/records");
    let request = app.client.post(url).bearer_auth(token).header("content-type", "application/json");
    request.body(body).send().await.unwrap()
}

async fn stored(pool: &PgPool, key: &str, column: &str) -> Option<String> {
    sqlx::query_scalar(
        "SELECT data->>$2 FROM record_versions WHERE tenant = 'acme' AND key = $1 AND closed_xid IS NULL",
    )
    .bind(key)
    .bind(column)
    .fetch_optional(pool)
    .await
    .unwrap()
    .flatten()
}

#[sqlx::test(migrations = "./migrations")]
async fn ingested_numbers_keep_every_digit_as_sent(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let amounts = ["12.50", "9007199254740993.5", "123456789012345678901234567890.123", "-0.000000000000000000001"];
    let body: String = format!(
        "[{}]",
        amounts
            .iter()
            .enumerate()
            .map(|(i, a)| format!(r#"{{"key": "n{i}", "data": {{"subject": "s", "status": "open", "amount": {a}}}}}"#))
            .collect::<Vec<_>>()
            .join(",")
    );
    let response = ingest_text(&app, &admin, body).await;
    assert_eq!(response.status(), 200);
    for (i, amount) in amounts.iter().enumerate() {
        assert_eq!(stored(&app.pool, &format!("n{i}"), "amount").await.as_deref(), Some(*amount));
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn records_the_store_cannot_hold_or_export_are_refused_naming_the_field(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let nested = |depth: usize| {
        let mut value = serde_json::json!(1);
        for _ in 0..depth {
            value = serde_json::json!([value]);
        }
        value
    };
    let record = |key: &str, extra: Value| {
        let mut data = serde_json::json!({"subject": "s", "status": "open"});
        data.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::json!([{"key": key, "data": data}])
    };
    let cases = [
        ("nul-in-key\u{0}", serde_json::json!({}), "[0].key"),
        ("nul-in-value", serde_json::json!({"subject": "a\u{0}b"}), "[0].data"),
        ("too-deep", serde_json::json!({"tags": nested(63)}), "[0].data"),
        ("too-big", serde_json::json!({"body": "x".repeat(1 << 20)}), "[0].data"),
    ];
    for (key, extra, field) in cases {
        let response = app.ingest(&admin, "tickets", &record(key, extra)).await;
        assert_eq!(response.status(), 400, "{key}");
        let problem = problem(response).await;
        assert_eq!(
            (problem["code"].as_str(), problem["field"].as_str()),
            (Some("invalid-record"), Some(field)),
            "{key}"
        );
    }
    // One level less deep is fine; the SQL write function applies the same limit.
    assert_eq!(
        app.ingest(&admin, "tickets", &record("deep", serde_json::json!({"tags": nested(62)}))).await.status(),
        200
    );
    let refused = sqlx::query("SELECT exportd_upsert('acme', 'tickets', 'sql-deep', $1)")
        .bind(serde_json::json!({"subject": "s", "status": "open", "tags": nested(63)}))
        .execute(&app.pool)
        .await
        .unwrap_err();
    assert_eq!(refused.as_database_error().unwrap().code().as_deref(), Some("EXD01"));
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM record_versions WHERE closed_xid IS NULL")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(live, 1, "nothing else was stored");
}

#[sqlx::test(migrations = "./migrations")]
async fn bodies_up_to_16_mib_are_read_and_errors_never_repeat_values(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let big: Vec<Value> = (0..10_000)
        .map(|i| serde_json::json!({"key": format!("k{i:05}"), "data": {"subject": "x".repeat(300), "status": "open"}}))
        .collect();
    let response = app.ingest(&admin, "tickets", &Value::Array(big)).await;
    assert_eq!(response.status(), 200, "a 3.4 MB batch of 10 000 records");
    let huge = format!("[{}]", " ".repeat(17 << 20));
    let response = ingest_text(&app, &admin, huge).await;
    assert_eq!(response.status(), 413);
    assert_eq!(problem(response).await["code"], "payload-too-large");
    let response = app
        .ingest(&admin, "tickets", &serde_json::json!([{"key": "k", "data": {"subject": "s", "status": "open", "escalated": "CONFIDENTIAL: patient"}}]))
        .await;
    assert_eq!(response.status(), 400);
    assert!(!response.text().await.unwrap().contains("CONFIDENTIAL"));
    let response = app.ingest(&admin, "tickets", &serde_json::json!([{"key": {"CONFIDENTIAL": 1}}])).await;
    assert_eq!(response.status(), 400);
    assert!(!response.text().await.unwrap().contains("CONFIDENTIAL"));
}

#[sqlx::test(migrations = "./migrations")]
async fn a_partner_cannot_queue_the_tenants_admins_out(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let partner = app.token("acme", "zenpartner");
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let response = app.create_export(&partner, Some(&uuid::Uuid::new_v4().to_string()), &full_csv(100)).await;
        statuses.push(response.status().as_u16());
        if response.status() == 429 {
            let problem = problem(response).await;
            assert_eq!(
                (problem["limit"].as_str(), problem["max"].as_u64()),
                (Some("max_queued_exports_per_partner"), Some(3))
            );
        }
    }
    assert_eq!(statuses, vec![202, 202, 202, 429, 429], "a partner's share is 3 queued exports");
    let admin = app.token("acme", "alice");
    assert_eq!(app.create_export(&admin, Some("admin-1"), &full_csv(100)).await.status(), 202, "admins keep headroom");
}

#[sqlx::test(migrations = "./migrations")]
async fn after_a_partners_row_filter_changes_its_old_files_and_cursors_are_refused(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 20).await;
    let partner = app.token("acme", "zenpartner"); // row filter: region = emea
    let id = app.export(&partner, &full_csv(10)).await;
    app.drain().await;
    let cursor = app.cursor_now(&partner, "tickets").await;
    assert_eq!(app.get(Some(&partner), &format!("/v1/exports/{id}/file")).await.status(), 200);

    let moved = app
        .sibling(crate::common::edited_registry("acme", |t| {
            t.replace(r#"row_filter = { region = "emea" }"#, r#"row_filter = { region = "apac" }"#)
        }))
        .await;
    let file = app.client.get(format!("{moved}/v1/exports/{id}/file")).bearer_auth(&partner).send().await.unwrap();
    assert_eq!(file.status(), 403);
    assert_eq!(problem(file).await["code"], "row-filter-changed");
    let changes = app
        .client
        .get(format!("{moved}/v1/datasets/tickets/changes?cursor={cursor}"))
        .bearer_auth(&partner)
        .send()
        .await
        .unwrap();
    assert_eq!(changes.status(), 410);
    assert_eq!(problem(changes).await["code"], "cursor-expired");
    // The same requests still work where the filter is unchanged.
    assert_eq!(app.get(Some(&partner), &format!("/v1/datasets/tickets/changes?cursor={cursor}")).await.status(), 200);
}

#[sqlx::test(migrations = "./migrations")]
async fn pages_of_big_records_are_bounded_by_bytes_not_rows(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let start = app.cursor_now(&admin, "tickets").await;
    let big = "x".repeat(900_000);
    for chunk in 0..3 {
        let batch: Vec<Value> = (0..10)
            .map(|i| serde_json::json!({"key": format!("big-{chunk}-{i}"), "data": {"subject": "s", "status": "open", "body": big}}))
            .collect();
        assert_eq!(app.ingest(&admin, "tickets", &Value::Array(batch)).await.status(), 200);
    }
    app.tick().await;
    app.pass_safety_delay();
    let first = app.pull(&admin, "tickets", &start, 10_000).await;
    let on_first = first["changes"].as_array().unwrap().len();
    assert!((1..=10).contains(&on_first), "{on_first} changes of ~900 kB on one page");
    assert_eq!(first["end_of_stream"], false);
    let (all, _) = app.pull_all(&admin, "tickets", &start, 10_000).await;
    assert_eq!(all.len(), 30, "every change arrives, over several pages");

    // A full export reading 2 000-row pages gets the same rows in byte-bounded pages.
    let id = app.export(&admin, &full_csv(100)).await;
    let deps = exportd::jobs::WorkerDeps {
        config: exportd::jobs::WorkerConfig { page_rows: 2_000, ..exportd::jobs::WorkerConfig::default() },
        ..app.deps()
    };
    exportd::jobs::drain(&deps, "big").await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT rows_done FROM export_jobs WHERE id = $1::uuid")
        .bind(&id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 30);
    let csv = crate::common::csv_rows(&app.own_shard_files(&id).await[0]);
    assert_eq!(csv.len(), 31);
    assert!(csv[1..].iter().all(|r| r.iter().any(|cell| cell.len() == 900_000)));
}

#[sqlx::test(migrations = "./migrations")]
async fn tiny_shards_are_bounded_in_count_and_their_links_come_in_pages(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 250).await;
    let admin = app.token("acme", "alice");
    // 250 one-row shards: the links of a status response come 100 at a time.
    let id = app.export(&admin, &full_csv(1)).await;
    app.drain().await;
    let status: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(status["state"], "SUCCEEDED");
    assert_eq!(status["links"]["shards"].as_array().unwrap().len(), 100);
    let mut next = status["links"]["shards_next"].as_str().unwrap().to_owned();
    let mut pages = vec![100];
    loop {
        let page: Value = app.get(Some(&admin), &next).await.json().await.unwrap();
        pages.push(page["links"]["shards"].as_array().unwrap().len());
        assert!(
            page["links"]["shards"][0]
                .as_str()
                .unwrap()
                .contains(&format!("/shards/{}?", page["links"]["shards_from"]))
        );
        match page["links"]["shards_next"].as_str() {
            Some(more) => next = more.to_owned(),
            None => break,
        }
    }
    assert_eq!(pages, vec![100, 100, 50]);
    // A worker allowed 40 shards fails such an export before writing the 41st.
    let id = app.export(&admin, &full_csv(1)).await;
    let deps = exportd::jobs::WorkerDeps {
        config: exportd::jobs::WorkerConfig {
            max_shards: 40,
            yield_between_shards: false,
            ..exportd::jobs::WorkerConfig::default()
        },
        ..app.deps()
    };
    let steps = exportd::jobs::drain(&deps, "bounded").await.unwrap();
    assert_eq!(steps, vec![exportd::jobs::Step::Failed { code: "too-many-shards".into() }]);
    let status: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(status["error"]["code"], "too-many-shards");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_tenants_slow_requests_hold_at_most_its_own_slots(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let one_slot = crate::common::edited_registry("acme", |t| {
        t.replace("max_concurrent_requests = 1000", "max_concurrent_requests = 1")
    });
    let base = app.sibling(one_slot).await;
    let admin = app.token("acme", "alice");
    // A host transaction holds key k1, so acme's ingest of k1 waits on it (a slow request).
    let (host, host_pid) = crate::common::hold_record(&app.pool, "k1").await;
    let (client, url, token) = (app.client.clone(), format!("{base}/v1/datasets/tickets/records"), admin.clone());
    let slow = tokio::spawn(async move {
        let body = serde_json::json!([{"key": "k1", "data": {"subject": "batch", "status": "open"}}]);
        client.post(url).bearer_auth(token).json(&body).send().await.unwrap().status()
    });
    let mut blocked = false;
    for _ in 0..1000 {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
                .bind(host_pid)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        if waiting > 0 {
            blocked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(blocked, "the ingest waits on the host transaction");
    // acme's only slot is taken: its next request is refused at once; globex is served.
    let refused = app.client.get(format!("{base}/v1/datasets")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(problem(refused).await["code"], "too-many-concurrent-requests");
    let other = app.client.get(format!("{base}/v1/datasets")).bearer_auth(app.token("globex", "hank")).send().await;
    assert_eq!(other.unwrap().status(), 200);
    host.commit().await.unwrap();
    assert_eq!(slow.await.unwrap(), 200);
    let freed = app.client.get(format!("{base}/v1/datasets")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(freed.status(), 200, "the slot came back");
}
