//! The HTTP edge: health, OpenAPI, authentication, ingest — over a real TCP port.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::{TestApp, problem};
use base64::Engine;
use serde_json::{Value, json};
use sqlx::PgPool;

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

async fn stored_versions(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM record_versions").fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn healthz_reports_the_database_and_the_store_and_marks_responses_private(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let response = app.get(None, "/healthz").await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["cache-control"], "private, no-store");
    assert_eq!(response.headers()["x-content-type-options"], "nosniff");
    assert!(response.headers().contains_key("x-request-id"));
    let timeline: i32 = sqlx::query_scalar("SELECT exportd_timeline()").fetch_one(&app.pool).await.unwrap();
    let health = json!({"status": "ok", "database": "ok", "timeline": timeline, "store": "ok"});
    assert_eq!(response.json::<Value>().await.unwrap(), health);
}

#[sqlx::test(migrations = "./migrations")]
async fn openapi_describes_every_route(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let doc: Value = app.get(None, "/openapi.json").await.json().await.unwrap();
    let paths = doc["paths"].as_object().unwrap();
    for path in ["/healthz", "/v1/datasets", "/v1/datasets/{dataset}/records"] {
        assert!(paths.contains_key(path), "{path} missing from openapi.json");
    }
    assert!(doc["paths"]["/v1/datasets/{dataset}/records"]["post"].is_object());
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
    // Every status a client can meet is declared: the limits and outages on every /v1
    // operation, 401 wherever a token is required, 415 and 413 wherever a body is taken.
    assert!(doc["components"]["schemas"]["Problem"].is_object());
    for (path, item) in paths.iter().filter(|(path, _)| path.starts_with("/v1/")) {
        for (method, operation) in item.as_object().unwrap() {
            let responses = operation["responses"].as_object().unwrap();
            let declares = |status: &str| responses.contains_key(status);
            assert!(declares("429") && declares("503"), "{method} {path}: {:?}", responses.keys());
            if operation["security"].as_array().is_some_and(|s| !s.is_empty()) {
                assert!(declares("401"), "{method} {path}");
            }
            if operation.get("requestBody").is_some() {
                assert!(declares("413") && declares("415") && declares("400"), "{method} {path}");
                assert_eq!(
                    responses["415"]["content"]["application/problem+json"]["schema"]["$ref"],
                    "#/components/schemas/Problem"
                );
            }
        }
    }
    let limit = doc["paths"]["/v1/datasets/{dataset}/changes"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "limit")
        .unwrap()
        .clone();
    assert_eq!((&limit["schema"]["minimum"], &limit["schema"]["maximum"]), (&json!(1), &json!(10000)));
}

#[sqlx::test(migrations = "./migrations")]
async fn unknown_routes_and_bad_request_ids_get_clean_answers(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let response = app.get(None, "/v1/nothing-here").await;
    assert_eq!(response.status(), 404);
    assert_eq!(problem(response).await["code"], "not-found");

    let response = app.client.get(app.url("/healthz")).header("x-request-id", "abc-123").send().await.unwrap();
    assert_eq!(response.headers()["x-request-id"], "abc-123");
    let forged = "x".repeat(65);
    let response = app.client.get(app.url("/healthz")).header("x-request-id", &forged).send().await.unwrap();
    assert_ne!(response.headers()["x-request-id"], forged.as_str(), "an overlong id is replaced");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_admin_ingests_a_batch_and_lists_datasets(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let batch = json!([
        {"key": "t1", "data": {"subject": "Printer on fire", "status": "open", "priority": 1, "region": "emea"}},
        {"key": "t2", "data": {"subject": "=cmd|' /C calc'!A0", "status": "new", "amount": -3.5}},
        {"key": "t1", "data": {"subject": "Printer still on fire", "status": "open"}},
        {"key": "t3", "deleted": true}
    ]);
    let response = app.ingest(&token, "tickets", &batch).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["cache-control"], "private, no-store");
    assert_eq!(response.json::<Value>().await.unwrap(), json!({"upserted": 3, "deleted": 1}));
    let rows: Vec<(String, Value)> = sqlx::query_as(
        "SELECT key, data FROM record_versions WHERE closed_xid IS NULL AND data IS NOT NULL ORDER BY key",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].1["subject"], "Printer still on fire");

    let datasets: Value = app.get(Some(&token), "/v1/datasets").await.json().await.unwrap();
    let names: Vec<&str> =
        datasets["datasets"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["contacts", "tickets"]);
    let partner: Value = app.get(Some(&app.token("acme", "zenpartner")), "/v1/datasets").await.json().await.unwrap();
    assert_eq!(partner["datasets"].as_array().unwrap().len(), 1);
    assert_eq!(partner["datasets"][0]["row_filter"], json!({"region": "emea"}));
}

#[sqlx::test(migrations = "./migrations")]
async fn a_batch_with_one_bad_record_stores_nothing_and_names_it(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    app.ingest(&token, "tickets", &json!([{"key": "before", "data": {"subject": "s", "status": "open"}}])).await;
    let batch = json!([
        {"key": "a", "data": {"subject": "fine", "status": "open"}},
        {"key": "b", "data": {"subject": "fine", "status": "open"}},
        {"key": "c", "data": {"subject": "bad", "status": "open", "priority": "high"}}
    ]);
    let response = app.ingest(&token, "tickets", &batch).await;
    assert_eq!(response.status(), 400);
    let body = problem(response).await;
    assert_eq!(body["code"], "invalid-record");
    assert_eq!(body["index"], 2);
    assert_eq!(body["field"], "[2].data.priority");
    assert!(!body["detail"].as_str().unwrap().contains("high"), "record data is never echoed");
    assert_eq!(stored_versions(&app.pool).await, 1, "nothing from the bad batch was stored");
}

#[sqlx::test(migrations = "./migrations")]
async fn malformed_ingest_bodies_are_refused_with_the_field(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let cases = [
        (json!([{"key": "a"}]), "invalid-record", "[0].data"),
        (json!([{"key": "a", "data": {"subject": "s", "status": "o"}, "deleted": true}]), "invalid-record", "[0].data"),
        (json!([{"data": {}}]), "invalid-body", "[0]"),
        (json!([{"key": "a", "data": {}, "extra": 1}]), "invalid-body", "[0].extra"),
        (json!([{"key": 7, "data": {}}]), "invalid-body", "[0].key"),
        (json!({"key": "a"}), "invalid-body", "body"),
        (json!([]), "invalid-request", "body"),
    ];
    for (body, code, field) in cases {
        let response = app.ingest(&token, "tickets", &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let problem = problem(response).await;
        assert_eq!(problem["code"], code, "{body}: {problem}");
        assert_eq!(problem["field"], field, "{body}: {problem}");
    }
    let response = app
        .client
        .post(app.url("/v1/datasets/tickets/records"))
        .bearer_auth(&token)
        .header("content-type", "text/plain")
        .body("[]")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 415);
    assert_eq!(stored_versions(&app.pool).await, 0);
}

#[sqlx::test(migrations = "./migrations")]
async fn only_admins_of_the_owning_tenant_may_ingest(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let batch = json!([{"key": "x", "data": {"name": "Ann"}}]);
    let partner = app.ingest(&app.token("acme", "zenpartner"), "tickets", &batch).await;
    assert_eq!(partner.status(), 403);
    assert_eq!(problem(partner).await["code"], "forbidden");
    // globex exposes no `contacts`: the same 404 as a dataset nobody has.
    let foreign = app.ingest(&app.token("globex", "hank"), "contacts", &batch).await;
    assert_eq!(foreign.status(), 404);
    let missing = app.ingest(&app.token("globex", "hank"), "nonexistent", &batch).await;
    assert_eq!(missing.status(), 404);
    assert_eq!(problem(foreign).await, problem(missing).await);
    assert_eq!(stored_versions(&app.pool).await, 0);
}

/// A token with arbitrary header and claims, signed with `secret` (HS256).
fn forge(header: Value, claims: Value, secret: &[u8]) -> String {
    use hmac::{KeyInit, Mac};
    let signing_input = format!("{}.{}", b64(header.to_string().as_bytes()), b64(claims.to_string().as_bytes()));
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(signing_input.as_bytes());
    format!("{signing_input}.{}", b64(&mac.finalize().into_bytes()))
}

#[sqlx::test(migrations = "./migrations")]
async fn every_kind_of_bad_token_is_refused_with_401(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let acme = app.tenant("acme");
    let secret = acme.keys[0].secret.bytes().to_vec();
    let claims = |tenant: &str, sub: &str, exp: u64| json!({"tenant": tenant, "sub": sub, "aud": "exportd", "iat": now(), "exp": exp});
    let header = |kid: &str| json!({"alg": "HS256", "typ": "JWT", "kid": kid});
    let good = forge(header("acme-k2"), claims("acme", "alice", now() + 600), &secret);
    let mut flipped = good.clone().into_bytes();
    let last = flipped.len() - 2;
    flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };

    let cases: Vec<(&str, Option<String>)> = vec![
        ("no token", None),
        ("not a jwt", Some("not-a-jwt".into())),
        ("bad signature", Some(String::from_utf8(flipped).unwrap())),
        (
            "alg none",
            Some(format!(
                "{}.{}.",
                b64(br#"{"alg":"none","kid":"acme-k2"}"#),
                b64(claims("acme", "alice", now() + 600).to_string().as_bytes())
            )),
        ),
        (
            "HS512 with the same key",
            Some(forge(json!({"alg": "HS512", "kid": "acme-k2"}), claims("acme", "alice", now() + 600), &secret)),
        ),
        ("expired", Some(exportd::auth::mint_at(acme, "alice", now() - 7200, now() - 3600).unwrap())),
        ("unknown kid", Some(forge(header("acme-k9"), claims("acme", "alice", now() + 600), &secret))),
        ("no kid", Some(forge(json!({"alg": "HS256"}), claims("acme", "alice", now() + 600), &secret))),
        (
            "wrong audience",
            Some(forge(
                header("acme-k2"),
                json!({"tenant": "acme", "sub": "alice", "aud": "other", "exp": now() + 600}),
                &secret,
            )),
        ),
        ("disabled principal", Some(app.token("acme", "mallory"))),
        ("unknown principal", Some(forge(header("acme-k2"), claims("acme", "nobody", now() + 600), &secret))),
        ("acme's key claiming globex", Some(forge(header("acme-k2"), claims("globex", "hank", now() + 600), &secret))),
        (
            "not valid before a future nbf",
            Some(forge(
                header("acme-k2"),
                json!({"tenant": "acme", "sub": "alice", "aud": "exportd", "iat": now(), "nbf": now() + 600, "exp": now() + 900}),
                &secret,
            )),
        ),
        (
            "issued in the future",
            Some(forge(
                header("acme-k2"),
                json!({"tenant": "acme", "sub": "alice", "aud": "exportd", "iat": now() + 600, "exp": now() + 900}),
                &secret,
            )),
        ),
        ("living forever", Some(forge(header("acme-k2"), claims("acme", "alice", u64::MAX / 2), &secret))),
        (
            "longer than max_token_lifetime_hours (720)",
            Some(forge(header("acme-k2"), claims("acme", "alice", now() + 721 * 3600), &secret)),
        ),
    ];
    for (what, token) in cases {
        let response = app.get(token.as_deref(), "/v1/datasets").await;
        assert_eq!(response.status(), 401, "{what}");
        let challenge = response.headers()["www-authenticate"].to_str().unwrap().to_owned();
        assert!(challenge.starts_with("Bearer realm=\"exportd\""), "{what}: {challenge}");
        assert_eq!(token.is_some(), challenge.contains("invalid_token"), "{what}: {challenge}");
        assert_eq!(problem(response).await["code"], "unauthorized", "{what}");
    }
    // The same forging helper, with everything right, is accepted: the cases above fail for their reason.
    assert_eq!(app.get(Some(&good), "/v1/datasets").await.status(), 200);
    // An older key that is still listed is accepted (rotation).
    let old = forge(header("acme-k1"), claims("acme", "alice", now() + 600), acme.keys[1].secret.bytes());
    assert_eq!(app.get(Some(&old), "/v1/datasets").await.status(), 200);
}

#[sqlx::test(migrations = "./migrations")]
async fn the_token_command_mints_a_working_token(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_exportd"))
        .args(["token", "--tenant", "globex", "--principal", "hank", "--ttl", "5m"])
        .env("EXPORTD_TENANTS_DIR", crate::common::fixture_tenants_dir())
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let token = String::from_utf8(output.stdout).unwrap();
    assert_eq!(app.get(Some(token.trim()), "/v1/datasets").await.status(), 200);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_wrong_method_is_a_problem_naming_the_allowed_ones(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    for (path, allowed) in [("/healthz", "GET"), ("/v1/exports", "POST")] {
        let response = app.client.put(app.url(path)).bearer_auth(&admin).send().await.unwrap();
        assert_eq!(response.status(), 405, "{path}");
        let allow = response.headers()["allow"].to_str().unwrap().to_owned();
        assert!(allow.split(',').any(|m| m.trim() == allowed), "{path}: Allow: {allow}");
        let body = problem(response).await;
        assert_eq!(body["code"], "method-not-allowed", "{path}");
    }
}

/// The JSON log lines of a process.
fn log_lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

#[sqlx::test(migrations = "./migrations")]
async fn one_export_can_be_followed_through_the_api_and_worker_logs_which_hold_no_secrets(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 30).await;
    let (api_log, worker_log) = (app.data_dir.path().join("api.log"), app.data_dir.path().join("worker.log"));
    let server = crate::common::processes::Server::start(&app, "0", Some(&api_log)).await;
    let token = app.token("acme", "alice");
    let client = reqwest::Client::new();
    let created: Value = client
        .post(format!("{}/v1/exports", server.base))
        .bearer_auth(&token)
        .header("Idempotency-Key", "follow-me")
        .json(&json!({"dataset": "tickets", "format": "csv", "shard_rows": 10}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let database_url = crate::common::processes::database_url(&app.pool).await;
    let mut worker =
        crate::common::processes::worker_command(&database_url, app.data_dir.path(), &worker_log, 1, "10s")
            .env("EXPORTD_LOG", "info")
            .spawn()
            .unwrap();
    assert_eq!(crate::common::processes::wait_terminal(&app.pool, &id, Duration::from_secs(30)).await, "SUCCEEDED");
    let status: Value = client
        .get(format!("{}/v1/exports/{id}", server.base))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let link = status["links"]["file"].as_str().unwrap().to_owned();
    assert_eq!(client.get(format!("{}{link}", server.base)).send().await.unwrap().status(), 200);
    worker.kill().unwrap();
    worker.wait().unwrap();
    drop(server);

    // The API's request lines name the export, its tenant and principal, for the create, the
    // status and the download by link.
    let api = log_lines(&api_log);
    let routes: Vec<&str> = api
        .iter()
        .filter(|l| l["span"]["export"] == id.as_str())
        .inspect(|l| {
            assert_eq!((l["span"]["tenant"].as_str(), l["span"]["principal"].as_str()), (Some("acme"), Some("alice")))
        })
        .filter_map(|l| l["span"]["route"].as_str())
        .collect();
    for route in ["/v1/exports", "/v1/exports/{id}", "/v1/exports/{id}/file"] {
        assert!(routes.contains(&route), "{route} not among {routes:?}");
    }
    // The worker's lines of the job carry the same export id (claim, shards, publish).
    let worker_lines: Vec<Value> =
        log_lines(&worker_log).into_iter().filter(|l| l["span"]["export"] == id.as_str()).collect();
    assert!(worker_lines.len() >= 2, "{worker_lines:?}");
    assert!(worker_lines.iter().all(|l| l["span"]["tenant"] == "acme"));
    // Neither log holds the bearer token, the link's token or any record data.
    let link_token = link.split("token=").nth(1).unwrap();
    for path in [&api_log, &worker_log] {
        let text = std::fs::read_to_string(path).unwrap();
        assert!(!text.contains(&token) && !text.contains(link_token), "a secret in {}", path.display());
        assert!(!text.contains("tickets-000000007"), "record keys in {}", path.display());
    }
}
