//! Delta Sharing: a partner reads its share with the official Python connector (delta-sharing +
//! pandas, tests/sharing/client.py, installed by scripts/test into data/tools/sharing), and the
//! protocol's listings, versions, file URLs, hints and errors seen from plain HTTP.

use std::path::{Path, PathBuf};

use crate::common::TestApp;
use exportd::jobs::Step;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

const TABLE: &str = "/delta-sharing/shares/zenpartner/schemas/acme/tables/tickets";

fn python() -> PathBuf {
    let tools = std::env::var("EXPORTD_SHARING_TOOLS")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/data/tools/sharing").to_owned());
    PathBuf::from(tools).join("bin/python")
}

/// Tickets in two regions: the row-filtered partner `zenpartner` sees only `emea`.
fn tickets(range: std::ops::Range<u32>) -> Value {
    let records: Vec<Value> = range
        .map(|i| {
            let region = if i % 3 == 0 { "amer" } else { "emea" };
            json!({"key": format!("t-{i:04}"), "data": {"subject": format!("ticket {i}"), "status": "open",
                "priority": i % 5, "region": region, "escalated": i % 2 == 0, "opened_at": "2026-12-01T10:00:00Z"}})
        })
        .collect();
    Value::Array(records)
}

/// A full Parquet export of the whole dataset by `token`'s principal: the next table version.
async fn publish_version(app: &TestApp, token: &str) -> String {
    let id = app.export(token, &json!({"dataset": "tickets", "format": "parquet", "shard_rows": 10})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    id
}

/// The export's shard files, downloaded with the bearer token into `dir`.
async fn download_shards(app: &TestApp, token: &str, id: &str, dir: &Path) -> Vec<String> {
    let manifest: Value = app.get(Some(token), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    let mut paths = Vec::new();
    for shard in manifest["shards"].as_array().unwrap() {
        let body =
            app.get(Some(token), &format!("/v1/exports/{id}/shards/{}", shard["index"])).await.bytes().await.unwrap();
        let path = dir.join(format!("{id}-{}", shard["name"].as_str().unwrap()));
        std::fs::write(&path, &body).unwrap();
        paths.push(path.display().to_string());
    }
    paths
}

async fn ndjson(response: reqwest::Response) -> Vec<Value> {
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/x-ndjson; charset=utf-8");
    let text = response.text().await.unwrap();
    text.lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

async fn query(app: &TestApp, token: &str, body: &Value) -> reqwest::Response {
    app.client.post(app.url(&format!("{TABLE}/query"))).bearer_auth(token).json(body).send().await.unwrap()
}

/// The protocol's error body: status, `errorCode`.
async fn protocol_error(response: reqwest::Response) -> (u16, String, String) {
    let status = response.status().as_u16();
    assert_eq!(response.headers()["content-type"], "application/json; charset=utf-8");
    let body: Value = response.json().await.unwrap();
    (status, body["errorCode"].as_str().unwrap().to_owned(), body["message"].as_str().unwrap().to_owned())
}

#[sqlx::test(migrations = "./migrations")]
async fn the_official_client_reads_exactly_the_partners_versions(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (admin, zen) = (app.token("acme", "alice"), app.token("acme", "zenpartner"));
    assert_eq!(app.ingest(&admin, "tickets", &tickets(0..60)).await.status(), 200);
    let first = publish_version(&app, &zen).await;
    // Then an update, a delete, an insert and a row moving out of the partner's region.
    let changes = json!([
        {"key": "t-0001", "data": {"subject": "changed", "status": "closed", "region": "emea"}},
        {"key": "t-0002", "deleted": true},
        {"key": "t-0100", "data": {"subject": "new", "status": "open", "region": "emea"}},
        {"key": "t-0004", "data": {"subject": "moved", "status": "open", "region": "amer"}}
    ]);
    assert_eq!(app.ingest(&admin, "tickets", &changes).await.status(), 200);
    let second = publish_version(&app, &zen).await;
    let admins = publish_version(&app, &admin).await;

    let dir = tempfile::tempdir().unwrap();
    let (v0, v1) =
        (download_shards(&app, &zen, &first, dir.path()).await, download_shards(&app, &zen, &second, dir.path()).await);
    let all_rows = download_shards(&app, &admin, &admins, dir.path()).await;
    let profile = app.get(Some(&zen), "/v1/sharing/profile").await;
    assert_eq!(profile.status(), 200);
    let profile: Value = profile.json().await.unwrap();
    assert_eq!(profile["endpoint"], format!("http://{}/delta-sharing", app.addr));
    assert_eq!(profile["bearerToken"], zen.as_str(), "the request's own token: no new credential");
    let profile_path = dir.path().join("zen.share");
    std::fs::write(&profile_path, profile.to_string()).unwrap();
    let admin_profile = app.get(Some(&admin), "/v1/sharing/profile").await.json::<Value>().await.unwrap();
    let admin_path = dir.path().join("alice.share");
    std::fs::write(&admin_path, admin_profile.to_string()).unwrap();

    let plans = [
        json!({"profile": profile_path, "tables": ["zenpartner.acme.tickets"],
            "loads": [{"table": "zenpartner.acme.tickets", "version": null, "key": "id", "expected": v1},
                      {"table": "zenpartner.acme.tickets", "version": 1, "key": "id", "expected": v1},
                      {"table": "zenpartner.acme.tickets", "version": 0, "key": "id", "expected": v0}],
            "changes": [{"table": "zenpartner.acme.tickets", "start": 1, "end": 1, "key": "id", "base": v0, "expected": v1},
                        {"table": "zenpartner.acme.tickets", "start": 0, "end": 1, "key": "id", "base": [], "expected": v1}],
            "missing": ["zenpartner.acme.contacts", "alice.acme.tickets", "zenpartner.globex.tickets"]}),
        // The admin's share holds every dataset, all rows; contacts has no version yet.
        json!({"profile": admin_path, "tables": ["alice.acme.contacts", "alice.acme.tickets"],
            "loads": [{"table": "alice.acme.tickets", "version": null, "key": "id", "expected": all_rows}],
            "missing": ["alice.acme.contacts", "zenpartner.acme.tickets", "alice.globex.ledger"]}),
    ];
    for plan in plans {
        let plan_path = dir.path().join("plan.json");
        std::fs::write(&plan_path, plan.to_string()).unwrap();
        let output = tokio::process::Command::new(python())
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sharing/client.py"))
            .arg(&plan_path)
            .output()
            .await
            .unwrap_or_else(|e| panic!("cannot run {} (scripts/test installs delta-sharing): {e}", python().display()));
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
        println!("{stdout}");
    }
    // What the partner received never held another region's row.
    let rows: i64 = sqlx::query_scalar("SELECT rows_done FROM export_jobs WHERE id = $1::uuid")
        .bind(&second)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 39, "emea tickets of 0..60 (40), one deleted, one new, one moved away");
}

#[sqlx::test(migrations = "./migrations")]
async fn listings_versions_files_and_errors_follow_the_protocol(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (admin, zen) = (app.token("acme", "alice"), app.token("acme", "zenpartner"));
    assert_eq!(app.ingest(&admin, "tickets", &tickets(0..60)).await.status(), 200);

    // Before any version: the table is listed, its version is not there yet.
    let tables: Value = app.get(Some(&zen), "/delta-sharing/shares/zenpartner/all-tables").await.json().await.unwrap();
    assert_eq!(tables["items"].as_array().unwrap().len(), 1);
    assert_eq!(tables["items"][0]["name"], "tickets");
    assert_eq!(tables["items"][0]["schema"], "acme");
    let (status, code, message) = protocol_error(app.get(Some(&zen), &format!("{TABLE}/version")).await).await;
    assert_eq!((status, code.as_str()), (404, "RESOURCE_DOES_NOT_EXIST"));
    assert!(message.contains("no version"), "{message}");

    let id = publish_version(&app, &zen).await;
    // A CSV export, or one with a filter, is not a version.
    app.export(&zen, &json!({"dataset": "tickets", "format": "csv"})).await;
    app.export(&zen, &json!({"dataset": "tickets", "format": "parquet", "filter": {"status": "open"}})).await;
    assert_eq!(app.drain().await, vec![Step::Published, Step::Published]);
    let version = app.get(Some(&zen), &format!("{TABLE}/version")).await;
    assert_eq!(version.status(), 200);
    assert_eq!(version.headers()["delta-table-version"], "0");
    let head = app.client.head(app.url(&format!("{TABLE}/version"))).bearer_auth(&zen).send().await.unwrap();
    assert_eq!((head.status().as_u16(), &head.headers()["delta-table-version"]), (200, &"0".parse().unwrap()));

    let lines = ndjson(query(&app, &zen, &json!({})).await).await;
    assert_eq!(lines[0], json!({"protocol": {"minReaderVersion": 1}}));
    let metadata = &lines[1]["metaData"];
    assert_eq!(metadata["format"], json!({"provider": "parquet"}));
    let schema: Value = serde_json::from_str(metadata["schemaString"].as_str().unwrap()).unwrap();
    assert_eq!(schema["fields"][0], json!({"name": "id", "type": "string", "nullable": false, "metadata": {}}));
    assert_eq!(schema["fields"][3]["type"], "long", "priority");
    let files: Vec<&Value> = lines[2..].iter().map(|l| &l["file"]).collect();
    assert_eq!(files.len(), 4, "40 emea rows in shards of 10");
    // A file URL works without the bearer token, by range too, and is the file the id names.
    let url = files[0]["url"].as_str().unwrap();
    let body = reqwest::get(url).await.unwrap().bytes().await.unwrap();
    assert_eq!(hex::encode(Sha256::digest(&body)), files[0]["id"].as_str().unwrap());
    assert_eq!(body.len() as u64, files[0]["size"].as_u64().unwrap());
    let ranged = app.client.get(url).header("range", "bytes=4-").send().await.unwrap();
    assert_eq!(ranged.status(), 206);
    let stats: Value = serde_json::from_str(files[1]["stats"].as_str().unwrap()).unwrap();
    assert_eq!(stats["numRecords"], 10);
    assert_eq!(stats["nullCount"]["amount"], 10);
    let first_key = stats["minValues"]["id"].as_str().unwrap().to_owned();

    // jsonPredicateHints leave out files whose statistics prove no match; limitHint stops early.
    let hint = json!({"op": "equal", "children": [{"op": "column", "name": "id", "valueType": "string"},
        {"op": "literal", "value": first_key, "valueType": "string"}]});
    let lines = ndjson(query(&app, &zen, &json!({"jsonPredicateHints": hint.to_string()})).await).await;
    assert_eq!(lines.len(), 3, "only the second file can hold {first_key}");
    assert_eq!(lines[2]["file"]["id"], files[1]["id"]);
    let lines = ndjson(query(&app, &zen, &json!({"limitHint": 15})).await).await;
    assert_eq!(lines.len(), 4, "two files hold 15 rows");

    // Another principal's, another tenant's and a missing share, schema or table: one answer.
    let missing = [
        "/delta-sharing/shares/alice",
        "/delta-sharing/shares/nobody",
        "/delta-sharing/shares/zenpartner/schemas/globex/tables",
        "/delta-sharing/shares/zenpartner/schemas/acme/tables/contacts/version",
        "/delta-sharing/shares/zenpartner/schemas/acme/tables/nothing/version",
        "/delta-sharing/shares/alice/schemas/acme/tables/tickets/metadata",
    ];
    for path in missing {
        let (status, code, message) = protocol_error(app.get(Some(&zen), path).await).await;
        assert_eq!((status, code.as_str()), (404, "RESOURCE_DOES_NOT_EXIST"), "{path}");
        assert!(message.contains("no such share"), "{path}: {message}");
    }
    // The admin's listing pages with maxResults and pageToken.
    let page: Value =
        app.get(Some(&admin), "/delta-sharing/shares/alice/all-tables?maxResults=1").await.json().await.unwrap();
    assert_eq!(page["items"][0]["name"], "contacts");
    let token = page["nextPageToken"].as_str().unwrap();
    let next: Value = app
        .get(Some(&admin), &format!("/delta-sharing/shares/alice/all-tables?maxResults=1&pageToken={token}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(next["items"][0]["name"], "tickets");
    assert_eq!(next.get("nextPageToken"), None);

    // Bad input: the protocol's 400s, naming what is wrong; nothing stored changes.
    let bad = [
        (app.get(Some(&zen), "/delta-sharing/shares?maxResults=0").await, "INVALID_PARAMETER_VALUE"),
        (app.get(Some(&zen), "/delta-sharing/shares?pageToken=bm90LW91cnM").await, "INVALID_PARAMETER_VALUE"),
        (app.get(Some(&zen), &format!("{TABLE}/metadata?version=-1")).await, "INVALID_PARAMETER_VALUE"),
        (app.get(Some(&zen), &format!("{TABLE}/metadata?version=7")).await, "INVALID_PARAMETER_VALUE"),
        (app.get(Some(&zen), &format!("{TABLE}/version?startingTimestamp=yesterday")).await, "INVALID_PARAMETER_VALUE"),
        (
            query(&app, &zen, &json!({"version": 0, "timestamp": "2026-12-05T00:00:00Z"})).await,
            "INVALID_PARAMETER_VALUE",
        ),
        (query(&app, &zen, &json!({"jsonPredicateHints": "{\"op\": \"equal\"}"})).await, "INVALID_PARAMETER_VALUE"),
        (query(&app, &zen, &json!({"limitHint": "ten"})).await, "MALFORMED_REQUEST"),
        (query(&app, &zen, &json!({"startingVersion": 0})).await, "UNSUPPORTED_OPERATION"),
        (app.get(Some(&zen), &format!("{TABLE}/changes")).await, "INVALID_PARAMETER_VALUE"),
        (app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=1")).await, "INVALID_PARAMETER_VALUE"),
        (
            app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=0&endingVersion=3")).await,
            "INVALID_PARAMETER_VALUE",
        ),
        (app.get(None, "/delta-sharing/shares").await, "UNAUTHENTICATED"),
    ];
    for (response, expected) in bad {
        let (status, code, message) = protocol_error(response).await;
        assert!((400..500).contains(&status), "{code}: {message}");
        assert_eq!(code, expected, "{message}");
    }
    let version = app.get(Some(&zen), &format!("{TABLE}/version")).await;
    assert_eq!(version.headers()["delta-table-version"], "0");

    // A version that changed one row: its changes remove every file of the version before and
    // add all of its own (each file names its export in its footer, so none is shared yet).
    let update = json!([{"key": "t-0059", "data": {"subject": "updated", "status": "closed", "region": "emea"}}]);
    assert_eq!(app.ingest(&admin, "tickets", &update).await.status(), 200);
    publish_version(&app, &zen).await;
    let changes = ndjson(app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=1")).await).await;
    let actions: Vec<(&str, i64, &str)> = changes[2..]
        .iter()
        .map(|line| {
            let (kind, action) = line.as_object().unwrap().iter().next().unwrap();
            (kind.as_str(), action["version"].as_i64().unwrap(), action["id"].as_str().unwrap())
        })
        .collect();
    let removed: Vec<&str> = actions.iter().filter(|a| a.0 == "remove").map(|a| a.2).collect();
    let version_0: Vec<&str> = files.iter().map(|f| f["id"].as_str().unwrap()).collect();
    assert_eq!(removed, version_0);
    assert_eq!(actions.iter().filter(|a| a.0 == "add" && a.1 == 1).count(), 4);
    assert!(actions.iter().all(|a| a.1 == 1));

    // A revoked version's files are gone; the number stays taken.
    let revoke = app.client.delete(app.url(&format!("/v1/exports/{id}"))).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(revoke.status(), 200);
    let (status, _, message) = protocol_error(query(&app, &zen, &json!({"version": 0})).await).await;
    assert_eq!(status, 400);
    assert!(message.contains("no longer retained"), "{message}");
    publish_version(&app, &zen).await;
    let version = app.get(Some(&zen), &format!("{TABLE}/version")).await;
    assert_eq!(version.headers()["delta-table-version"], "2");
    let (status, _, message) =
        protocol_error(app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=1")).await).await;
    assert_eq!(status, 400, "version 1's changes need version 0's files: {message}");
}
