//! Delta Sharing: a partner reads its share with the official Python connector (delta-sharing +
//! pandas, tests/sharing/client.py, installed by scripts/test into data/tools/sharing), and the
//! protocol's listings, versions, file URLs, hints and errors seen from plain HTTP.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::processes::{self, spawn_worker, wait_terminal};
use crate::common::{Backend, TestApp};
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

/// Runs tests/sharing/client.py on `plan` (written into `dir`); fails with its output.
async fn run_client(dir: &Path, plan: &Value) {
    let plan_path = dir.join("plan.json");
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

/// The caller's profile file, written into `dir`.
async fn profile_file(app: &TestApp, token: &str, dir: &Path, name: &str) -> PathBuf {
    let profile: Value = app.get(Some(token), "/v1/sharing/profile").await.json().await.unwrap();
    let path = dir.join(name);
    std::fs::write(&path, profile.to_string()).unwrap();
    path
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

/// A valid predicate tree: `or` of `leaves` isNull tests (2 nodes each).
fn wide_hint(leaves: usize) -> String {
    let leaf = json!({"op": "isNull", "children": [{"op": "column", "name": "subject"}]});
    json!({"op": "or", "children": vec![leaf; leaves]}).to_string()
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
    // Then an update, a delete, an insert, and rows moving out of and into the partner's region.
    let changes = json!([
        {"key": "t-0001", "data": {"subject": "changed", "status": "closed", "region": "emea"}},
        {"key": "t-0002", "deleted": true},
        {"key": "t-0100", "data": {"subject": "new", "status": "open", "region": "emea"}},
        {"key": "t-0004", "data": {"subject": "moved", "status": "open", "region": "amer"}},
        {"key": "t-0003", "data": {"subject": "moved in", "status": "open", "region": "emea"}}
    ]);
    assert_eq!(app.ingest(&admin, "tickets", &changes).await.status(), 200);
    let second = publish_version(&app, &zen).await;
    let admins = publish_version(&app, &admin).await;

    let dir = tempfile::tempdir().unwrap();
    let (v0, v1) =
        (download_shards(&app, &zen, &first, dir.path()).await, download_shards(&app, &zen, &second, dir.path()).await);
    let all_rows = download_shards(&app, &admin, &admins, dir.path()).await;
    // DuckDB reads the file URLs of the latest version as they are.
    let urls: Vec<String> = ndjson(query(&app, &zen, &json!({})).await).await[2..]
        .iter()
        .map(|line| line["file"]["url"].as_str().unwrap().to_owned())
        .collect();
    let profile = app.get(Some(&zen), "/v1/sharing/profile").await;
    assert_eq!(profile.status(), 200);
    let profile: Value = profile.json().await.unwrap();
    assert_eq!(profile["endpoint"], format!("http://{}/delta-sharing", app.addr));
    assert_eq!(profile["bearerToken"], zen.as_str(), "the request's own token: no new credential");
    // Without EXPORTD_PUBLIC_URL a Host naming another machine decides nothing: refused, and so
    // are file URLs built from it.
    for host in ["evil.example", "evil.example:80", "127.0.0.1.evil.example", "10.0.0.1"] {
        let forged = app.client.get(app.url("/v1/sharing/profile")).bearer_auth(&zen).header("host", host);
        let forged = forged.send().await.unwrap();
        assert_eq!(forged.status(), 400, "Host: {host}");
        let body = forged.text().await.unwrap();
        assert!(body.contains("EXPORTD_PUBLIC_URL") && !body.contains("evil"), "{body}");
        let query = app.client.post(app.url(&format!("{TABLE}/query"))).bearer_auth(&zen).header("host", host);
        assert_eq!(query.json(&json!({})).send().await.unwrap().status(), 400, "query, Host: {host}");
    }
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
            // Version 1's change file: the region moves are a delete and an insert for this partner.
            "changes": [{"table": "zenpartner.acme.tickets", "start": 1, "end": 1, "key": "id", "base": v0, "expected": v1,
                         "kinds": {"insert": 2, "delete": 2, "update_preimage": 1, "update_postimage": 1}},
                        {"table": "zenpartner.acme.tickets", "start": 0, "end": 1, "key": "id", "base": [], "expected": v1,
                         "kinds": {"insert": 42, "delete": 2, "update_preimage": 1, "update_postimage": 1}}],
            "missing": ["zenpartner.acme.contacts", "alice.acme.tickets", "zenpartner.globex.tickets"],
            "duckdb": [{"urls": urls, "expected": v1}]}),
        // The admin's share holds every dataset, all rows; contacts has no version yet.
        json!({"profile": admin_path, "tables": ["alice.acme.contacts", "alice.acme.tickets"],
            "loads": [{"table": "alice.acme.tickets", "version": null, "key": "id", "expected": all_rows}],
            "missing": ["alice.acme.contacts", "zenpartner.acme.tickets", "alice.globex.ledger"]}),
    ];
    for plan in plans {
        run_client(dir.path(), &plan).await;
    }
    // What the partner received never held another region's row.
    let rows: i64 = sqlx::query_scalar("SELECT rows_done FROM export_jobs WHERE id = $1::uuid")
        .bind(&second)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 40, "emea tickets of 0..60 (40), one deleted, one new, one moved away, one moved in");
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
        // A hint is bounded in text and in nodes (a valid tree of 100 000 nodes is refused), and
        // a query body in size: a 16 MiB hint once froze the server.
        (query(&app, &zen, &json!({"jsonPredicateHints": wide_hint(100_000)})).await, "INVALID_PARAMETER_VALUE"),
        (query(&app, &zen, &json!({"jsonPredicateHints": wide_hint(600)})).await, "INVALID_PARAMETER_VALUE"),
        (query(&app, &zen, &json!({"pad": "x".repeat(2 << 20)})).await, "INVALID_PARAMETER_VALUE"),
        // An array of the fields in order is not a query object (serde alone would take it).
        (query(&app, &zen, &json!([null, null, null, null, null, null, null])).await, "MALFORMED_REQUEST"),
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

    // A version that changed one row: its changes are one change file holding that row before
    // and after, readable through its link (by range too), whose id is its sha256.
    let update = json!([{"key": "t-0059", "data": {"subject": "updated", "status": "closed", "region": "emea"}}]);
    assert_eq!(app.ingest(&admin, "tickets", &update).await.status(), 200);
    publish_version(&app, &zen).await;
    let changes = ndjson(app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=1")).await).await;
    assert_eq!(changes.len(), 3, "protocol, metaData and one cdf line: {changes:?}");
    let cdf = &changes[2]["cdf"];
    assert_eq!((cdf["version"].as_i64(), cdf.get("stats")), (Some(1), None));
    let body = reqwest::get(cdf["url"].as_str().unwrap()).await.unwrap().bytes().await.unwrap();
    assert_eq!(hex::encode(Sha256::digest(&body)), cdf["id"].as_str().unwrap());
    assert_eq!(body.len() as u64, cdf["size"].as_u64().unwrap());
    assert_eq!(&body[..4], b"PAR1");
    let ranged = app.client.get(cdf["url"].as_str().unwrap()).header("range", "bytes=-8").send().await.unwrap();
    assert_eq!(ranged.status(), 206);
    assert_eq!(&ranged.bytes().await.unwrap()[4..], b"PAR1");
    // Version 0's changes add its files (it has no version before it).
    let changes =
        ndjson(app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=0&endingVersion=0")).await).await;
    let added: Vec<&str> = changes[2..].iter().map(|line| line["add"]["id"].as_str().unwrap()).collect();
    assert_eq!(added, files.iter().map(|f| f["id"].as_str().unwrap()).collect::<Vec<_>>());

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
        protocol_error(app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=0")).await).await;
    assert_eq!(status, 400, "version 0's changes are its files: {message}");
    // Version 1's change file is its own export's: still there.
    let changes = ndjson(app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=1")).await).await;
    assert_eq!(changes[2]["cdf"]["version"], 1);

    // File URLs expire with the link lifetime; a client refreshes them by querying again (as
    // Spark's connector does): the same files, by id, behind new URLs.
    let files = |lines: &[Value]| -> Vec<(String, String, i64)> {
        lines[2..]
            .iter()
            .map(|l| &l["file"])
            .map(|f| {
                (
                    f["id"].as_str().unwrap().into(),
                    f["url"].as_str().unwrap().into(),
                    f["expirationTimestamp"].as_i64().unwrap(),
                )
            })
            .collect()
    };
    let first = files(&ndjson(query(&app, &zen, &json!({})).await).await);
    app.clock.advance(Duration::from_secs(301));
    let expired = reqwest::get(&first[0].1).await.unwrap();
    assert_eq!(expired.status(), 403);
    assert_eq!(expired.json::<Value>().await.unwrap()["code"], "link-expired");
    let refreshed = files(&ndjson(query(&app, &zen, &json!({})).await).await);
    assert_eq!(refreshed.iter().map(|f| &f.0).collect::<Vec<_>>(), first.iter().map(|f| &f.0).collect::<Vec<_>>());
    assert!(refreshed[0].1 != first[0].1 && refreshed[0].2 >= first[0].2 + 301_000);
    assert_eq!(reqwest::get(&refreshed[0].1).await.unwrap().status(), 200);
}

/// Versions cut while eight writers upsert, move, delete and roll back: every version's change
/// file, read by the official client, takes the version before it exactly to it (deletes and
/// region moves included), and so does a run of them.
#[sqlx::test(migrations = "./migrations")]
async fn change_files_are_exact_under_concurrent_writers(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (admin, zen) = (app.token("acme", "alice"), app.token("acme", "zenpartner"));
    assert_eq!(app.ingest(&admin, "tickets", &tickets(0..200)).await.status(), 200);
    // The writers have connections of their own (the test's pool has five, for the server).
    let url = processes::database_url(&app.pool).await;
    let host = sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(&url).await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..8u64).map(|w| tokio::spawn(write_until(host.clone(), stop.clone(), w))).collect();
    let mut versions = Vec::new();
    for _ in 0..4 {
        // Each export's snapshot is taken while the writers are busy.
        let before = written(&app.pool).await;
        while written(&app.pool).await < before + 40 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        versions.push(publish_version(&app, &zen).await);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let writes: u64 = futures_util::future::join_all(writers).await.into_iter().map(|w| w.unwrap()).sum();
    assert!(writes >= 160, "{writes} writes");
    host.close().await;

    // Versions 1.. answer with their change files (cut from the version before, not rewritten).
    let changes = ndjson(app.get(Some(&zen), &format!("{TABLE}/changes?startingVersion=1")).await).await;
    let kinds: Vec<&str> =
        changes[2..].iter().map(|l| l.as_object().unwrap().keys().next().unwrap().as_str()).collect();
    assert_eq!(kinds, ["cdf", "cdf", "cdf"]);

    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for id in &versions {
        files.push(download_shards(&app, &zen, id, dir.path()).await);
    }
    let profile = profile_file(&app, &zen, dir.path(), "zen.share").await;
    let table = "zenpartner.acme.tickets";
    let check = |start: usize, end: usize| json!({"table": table, "start": start, "end": end, "key": "id", "base": files[start - 1], "expected": files[end]});
    let plan = json!({"profile": profile, "tables": [table], "loads": [],
        "changes": [check(1, 1), check(2, 2), check(3, 3), check(1, 3), check(2, 3)]});
    run_client(dir.path(), &plan).await;
}

/// How many writes the writers committed (versions of acme's tickets).
async fn written(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM record_versions WHERE tenant = 'acme' AND dataset = 'tickets'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// One writer: transactions of one to three writes to tickets t-0000..t-0249 (new subjects,
/// region moves, deletes, re-creations), one in five rolled back, until `stop`. Returns how many
/// transactions committed.
async fn write_until(pool: PgPool, stop: std::sync::Arc<std::sync::atomic::AtomicBool>, writer: u64) -> u64 {
    let mut state = writer.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let mut committed = 0;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        // Keys in order within a transaction, as a host avoids deadlocks between its writers.
        let mut keys: Vec<String> = (0..=next(3)).map(|_| format!("t-{:04}", next(250))).collect();
        keys.sort();
        keys.dedup();
        let mut tx = pool.begin().await.unwrap();
        for key in keys {
            if next(6) == 0 {
                sqlx::query("SELECT exportd_delete('acme', 'tickets', $1)").bind(&key).execute(&mut *tx).await.unwrap();
            } else {
                let region = if next(3) == 0 { "amer" } else { "emea" };
                let data = json!({"subject": format!("w{writer} {}", next(1000)), "status": "open",
                    "priority": next(5), "region": region, "escalated": next(2) == 0});
                sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, $2)")
                    .bind(&key)
                    .bind(&data)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
        }
        if next(5) == 0 {
            tx.rollback().await.unwrap();
        } else {
            tx.commit().await.unwrap();
            committed += 1;
        }
    }
    committed
}

/// A worker killed (SIGKILL) while it writes a version's change file, after every shard: another
/// publishes the version, and its change file and shards have the bytes of an uninterrupted run.
#[sqlx::test(migrations = "./migrations")]
async fn a_version_published_after_a_worker_crash_has_the_bytes_of_an_uninterrupted_run(pool: PgPool) {
    let app = TestApp::spawn_on(pool, Backend::Local).await;
    app.seed("initech", "tickets", 300).await;
    let admin = app.token("initech", "bill");
    let body = json!({"dataset": "tickets", "format": "parquet", "shard_rows": 100});
    app.export(&admin, &body).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    // 60 deletes and 240 updates: 540 rows of change file, which take initech's scan budget
    // (200 rows a second) nearly 3 s.
    let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM record_heads WHERE tenant = 'initech' ORDER BY key")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    let mut tx = app.pool.begin().await.unwrap();
    for (i, key) in keys.iter().enumerate() {
        let statement = if i % 5 == 0 {
            sqlx::query("SELECT exportd_delete('initech', 'tickets', $1)").bind(key)
        } else {
            let data = json!({"subject": format!("changed {i}"), "status": "open"});
            sqlx::query("SELECT exportd_upsert('initech', 'tickets', $1, $2)").bind(key).bind(data)
        };
        statement.execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    let id = app.export(&admin, &body).await;
    let url = processes::database_url(&app.pool).await;
    let log = app.data_dir.path().join("workers.log");
    let mut victim = spawn_worker(&url, app.data_dir.path(), &log, 1, "2s");
    let publishing = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT plan_complete AND shards_done >= planned_shards FROM export_jobs WHERE id = $1::uuid",
        )
        .bind(&id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    let started = std::time::Instant::now();
    while !publishing().await {
        assert!(started.elapsed() < Duration::from_secs(60), "the shards were not written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    victim.kill().unwrap();
    victim.wait().unwrap();
    assert_eq!(app.state(&id).await, "RUNNING", "killed while writing the change file");
    let mut rescuer = spawn_worker(&url, app.data_dir.path(), &log, 1, "2s");
    assert_eq!(wait_terminal(&app.pool, &id, Duration::from_secs(60)).await, "SUCCEEDED");
    rescuer.kill().unwrap();
    rescuer.wait().unwrap();
    let resumed = version_hashes(&app.pool, &id).await;
    assert_eq!(resumed.0.len(), 3);
    let changes = app.get(Some(&admin), &format!("/v1/exports/{id}/changes-file")).await.bytes().await.unwrap();
    assert_eq!(hex::encode(Sha256::digest(&changes)), resumed.1, "the stored change file is the recorded one");

    // The same job again, uninterrupted, into an empty store (rewound with triggers off).
    let mut rewind = app.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *rewind).await.unwrap();
    sqlx::query("UPDATE export_jobs SET state = 'QUEUED', manifest = NULL, manifest_sha256 = NULL, lease_expires_at = NULL,
                 shards_done = 0, rows_done = 0, bytes_done = 0, planned_shards = 0, plan_complete = false WHERE id = $1::uuid")
        .bind(&id).execute(&mut *rewind).await.unwrap();
    for statement in [
        "DELETE FROM export_shards WHERE export_id = $1::uuid",
        "DELETE FROM export_shard_plan WHERE export_id = $1::uuid",
        "DELETE FROM share_versions WHERE export_id = $1::uuid",
    ] {
        sqlx::query(statement).bind(&id).execute(&mut *rewind).await.unwrap();
    }
    rewind.commit().await.unwrap();
    let second_dir = tempfile::tempdir().unwrap();
    let second_store = crate::common::fresh_store(Backend::Local, &app.pool, second_dir.path()).await;
    let clean = app.deps_with(app.registry.clone(), second_store);
    assert_eq!(exportd::jobs::drain(&clean, "clean").await.unwrap(), vec![Step::Published]);
    assert_eq!(version_hashes(&app.pool, &id).await, resumed, "the same bytes with or without a crash");
}

/// A version's shard hashes and its change file's.
async fn version_hashes(pool: &PgPool, id: &str) -> (Vec<String>, String) {
    let shards = sqlx::query_scalar("SELECT sha256 FROM export_shards WHERE export_id = $1::uuid ORDER BY shard_index")
        .bind(id)
        .fetch_all(pool)
        .await
        .unwrap();
    let changes = sqlx::query_scalar("SELECT changes_sha256 FROM share_versions WHERE export_id = $1::uuid")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    (shards, changes)
}

/// The keys and `_change_type`s of a change file (Parquet) behind a `cdf` line's link.
pub async fn change_rows(cdf: &Value) -> Vec<(String, String)> {
    use arrow_array::cast::AsArray;
    let body = reqwest::get(cdf["url"].as_str().unwrap()).await.unwrap().bytes().await.unwrap();
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(body).unwrap().build().unwrap();
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        let (keys, kinds) = (batch.column_by_name("id").unwrap(), batch.column_by_name("_change_type").unwrap());
        let (keys, kinds) = (keys.as_string::<i32>(), kinds.as_string::<i32>());
        for i in 0..batch.num_rows() {
            rows.push((keys.value(i).to_owned(), kinds.value(i).to_owned()));
        }
    }
    rows
}

#[sqlx::test(migrations = "./migrations")]
async fn a_change_only_to_a_column_the_partner_is_not_served_is_no_change(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (admin, lens) = (app.token("acme", "alice"), app.token("acme", "lens")); // lens: tickets' body dropped
    let row = |key: &str, subject: &str, body: &str| json!({"key": key, "data": {"subject": subject, "status": "open", "region": "emea", "body": body}});
    let first =
        json!([row("t-1", "one", "secret body 1"), row("t-2", "two", "secret body 2"), row("t-3", "three", "b3")]);
    assert_eq!(app.ingest(&admin, "tickets", &first).await.status(), 200);
    publish_version(&app, &lens).await;
    // t-1: only its dropped body changes; t-2: its subject changes; t-3 is rewritten as it was.
    let second =
        json!([row("t-1", "one", "another secret"), row("t-2", "TWO", "secret body 2"), row("t-3", "three", "b3")]);
    assert_eq!(app.ingest(&admin, "tickets", &second).await.status(), 200);
    publish_version(&app, &lens).await;
    let table = "/delta-sharing/shares/lens/schemas/acme/tables/tickets";
    let changes = ndjson(app.get(Some(&lens), &format!("{table}/changes?startingVersion=1")).await).await;
    assert_eq!(changes.len(), 3, "one cdf line: {changes:?}");
    let rows = change_rows(&changes[2]["cdf"]).await;
    let expected = [("t-2", "update_preimage"), ("t-2", "update_postimage")];
    assert_eq!(rows, expected.map(|(k, t)| (k.to_owned(), t.to_owned())), "nothing of t-1's hidden change");
}

/// A partner whose keys are hashed (lens, contacts) finds a version's changes in the order of
/// its hashed keys, each key's pre- and post-image together — never in the real keys' order.
#[sqlx::test(migrations = "./migrations")]
async fn change_files_of_hashed_keys_come_in_hashed_order(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (admin, lens) = (app.token("acme", "alice"), app.token("acme", "lens"));
    let contacts = |name: &str| {
        let rows: Vec<Value> = (0..60)
            .map(|i| json!({"key": format!("c-{i:03}"), "data": {"name": name, "email": format!("p{i}@example.com")}}))
            .collect();
        Value::Array(rows)
    };
    let publish = async || {
        let id = app.export(&lens, &json!({"dataset": "contacts", "format": "parquet", "shard_rows": 25})).await;
        assert_eq!(app.drain().await, vec![Step::Published]);
        id
    };
    assert_eq!(app.ingest(&admin, "contacts", &contacts("Ann")).await.status(), 200);
    publish().await;
    assert_eq!(app.ingest(&admin, "contacts", &contacts("Bob")).await.status(), 200);
    publish().await;
    let table = "/delta-sharing/shares/lens/schemas/acme/tables/contacts";
    let changes = ndjson(app.get(Some(&lens), &format!("{table}/changes?startingVersion=1")).await).await;
    let rows = change_rows(&changes.last().unwrap()["cdf"]).await;
    assert_eq!(rows.len(), 120, "a pre- and a post-image per contact");
    let keys: Vec<&str> = rows.iter().step_by(2).map(|(k, _)| k.as_str()).collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "changes in hashed-key order: {keys:?}");
    for pair in rows.chunks(2) {
        assert_eq!(pair[0].0, pair[1].0);
        assert_eq!([pair[0].1.as_str(), pair[1].1.as_str()], ["update_preimage", "update_postimage"]);
    }
}
