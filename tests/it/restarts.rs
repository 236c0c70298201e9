//! What a deployment keeps across restarts with nothing configured: its link key lives in its
//! database, so cursors and download links issued before a restart still work after it; and a
//! token sealed with a key the server does not have is told apart from a tampered one.

use std::time::{Duration, Instant};

use crate::common::TestApp;
use crate::common::processes::Server;
use serde_json::{Value, json};
use sqlx::PgPool;

async fn get(client: &reqwest::Client, url: &str, token: Option<&str>) -> reqwest::Response {
    let request = client.get(url);
    let request = if let Some(token) = token { request.bearer_auth(token) } else { request };
    request.send().await.unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn cursors_and_links_outlive_a_restart_without_configured_keys(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 30).await;
    let token = app.token("acme", "alice");
    let client = reqwest::Client::new();
    let without_keys = |command: &mut std::process::Command| {
        command.env_remove("EXPORTD_LINK_KEYS");
    };

    let first = Server::start_with(&app, "1", None, without_keys).await;
    let cursor: Value =
        get(&client, &format!("{}/v1/datasets/tickets/cursor", first.base), Some(&token)).await.json().await.unwrap();
    let cursor = cursor["cursor"].as_str().unwrap().to_owned();
    let created = client
        .post(format!("{}/v1/exports", first.base))
        .bearer_auth(&token)
        .header("Idempotency-Key", "restart-test")
        .json(&json!({"dataset": "tickets", "format": "csv"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 202);
    let id = created.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let started = Instant::now();
    let status = loop {
        let status: Value =
            get(&client, &format!("{}/v1/exports/{id}", first.base), Some(&token)).await.json().await.unwrap();
        if status["state"] == "SUCCEEDED" {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the export never finished: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let link = status["links"]["file"].as_str().unwrap().to_owned();
    drop(first);

    let second = Server::start_with(&app, "0", None, without_keys).await;
    let changes = |cursor: &str| format!("{}/v1/datasets/tickets/changes?cursor={cursor}", second.base);
    let answer = get(&client, &changes(&cursor), Some(&token)).await;
    assert_eq!(answer.status(), 200, "a cursor from before the restart");
    let file = get(&client, &format!("{}{link}", second.base), None).await;
    assert_eq!(file.status(), 200, "a link from before the restart");
    assert_eq!(file.bytes().await.unwrap().len() as u64, status["file"]["bytes"].as_u64().unwrap());

    // The in-process app seals with the test keys, which this deployment's servers do not have.
    let foreign = app.cursor_now(&token, "tickets").await;
    let problem = crate::common::problem(get(&client, &changes(&foreign), Some(&token)).await).await;
    assert_eq!((&problem["code"], &problem["reason"]), (&json!("invalid-cursor"), &json!("unknown-key")), "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("a key this server does not have"), "{problem}");
    // A cursor altered in transit is not put down to keys.
    let mut tampered = cursor.into_bytes();
    let last = tampered.len() - 3;
    tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).unwrap();
    let problem = crate::common::problem(get(&client, &changes(&tampered), Some(&token)).await).await;
    assert_eq!(problem["code"], "invalid-cursor");
    assert_eq!(problem.get("reason"), None, "{problem}");
}
