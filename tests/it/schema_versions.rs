//! Versioned dataset schemas: a compatible change reaches a partner that keeps pulling without a
//! failed page (old shape before, new shape after, announced first); a breaking change without
//! the next major declared stops start-up naming the column; a partner pinned to the old major
//! keeps receiving byte-identical files and the old shape of feed pages.

use std::process::Command;

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::common::processes::database_url;
use crate::common::{TestApp, edited_tenants_dir, gunzip, prepare_db_from};

/// A partner of acme pinned to major 1 of tickets (the fixture's current one at first).
const LEGACY_PARTNER: &str =
    "\n[[principals]]\nid = \"legacy\"\nrole = \"partner\"\ngrants = [\"tickets\"]\nschema_pins.tickets = 1\n";

/// The fixture tenants plus `legacy`, with the tickets schema file's text edited by `tickets`.
fn tenants_with(tickets: impl Fn(&str) -> String) -> tempfile::TempDir {
    let dir = edited_tenants_dir("acme", |text| format!("{text}{LEGACY_PARTNER}"));
    let path = dir.path().join("datasets/tickets.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, tickets(&text)).unwrap();
    dir
}

/// tickets 1.1: an optional column added.
fn with_channel(text: &str) -> String {
    format!("{text}\n[[columns]]\nname = \"channel\"\ntype = \"string\"\n")
}

/// `escalated` renamed to `urgent`, with or without declaring the next major.
fn renamed(version: Option<u32>) -> impl Fn(&str) -> String {
    move |text: &str| {
        let text = text.replace("name = \"escalated\"", "name = \"urgent\"");
        match version {
            Some(v) => format!("version = {v}\n{text}"),
            None => text,
        }
    }
}

/// tickets 2.0 without removing anything: the key column renamed, `priority` required and a
/// required column added.
fn major_two(text: &str) -> String {
    let text = text
        .replace("key_column = \"id\"", "key_column = \"ticket_id\"")
        .replace("name = \"priority\"\ntype = \"integer\"", "name = \"priority\"\ntype = \"integer\"\nrequired = true");
    format!("version = 2\n{text}\n[[columns]]\nname = \"channel\"\ntype = \"string\"\nrequired = true\n")
}

struct Client<'a> {
    app: &'a TestApp,
    base: String,
}

impl Client<'_> {
    async fn get(&self, token: &str, path: &str) -> reqwest::Response {
        self.app.client.get(format!("{}{path}", self.base)).bearer_auth(token).send().await.unwrap()
    }

    async fn page(&self, token: &str, cursor: &str) -> Value {
        let response = self.get(token, &format!("/v1/datasets/tickets/changes?limit=4&cursor={cursor}")).await;
        assert_eq!(response.status(), 200, "no page fails across a schema change");
        response.json().await.unwrap()
    }

    async fn cursor(&self, token: &str) -> String {
        let body: Value = self.get(token, "/v1/datasets/tickets/cursor").await.json().await.unwrap();
        body["cursor"].as_str().unwrap().to_owned()
    }

    async fn ingest(&self, token: &str, records: Value) {
        let url = format!("{}/v1/datasets/tickets/records", self.base);
        let response = self.app.client.post(url).bearer_auth(token).json(&records).send().await.unwrap();
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }

    /// A full CSV export by `token`, run by a worker with this server's tenants; returns its
    /// manifest and its decompressed shards.
    async fn export(&self, token: &str, registry: &std::sync::Arc<exportd::tenants::Registry>) -> (Value, Vec<u8>) {
        let url = format!("{}/v1/exports", self.base);
        let body = json!({"dataset": "tickets", "format": "csv", "shard_rows": 7});
        let request =
            self.app.client.post(url).bearer_auth(token).header("Idempotency-Key", uuid::Uuid::new_v4().to_string());
        let created = request.json(&body).send().await.unwrap();
        assert_eq!(created.status(), 202);
        let id = created.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
        let deps = self.app.deps_with(registry.clone(), self.app.store.clone());
        exportd::jobs::drain(&deps, "schema-test-worker").await.unwrap();
        let manifest: Value = self.get(token, &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
        let shards = self.app.own_shard_files(&id).await;
        (manifest, shards.iter().flat_map(|s| gunzip(s)).collect())
    }
}

/// A token of a principal that only the edited tenant files have.
fn token(registry: &exportd::tenants::Registry, principal: &str) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    exportd::auth::mint_at(registry.get("acme").unwrap(), principal, now, now + 3600).unwrap()
}

fn dir_registry(dir: &tempfile::TempDir) -> exportd::tenants::Registry {
    exportd::tenants::Registry::load(dir.path()).unwrap()
}

fn tickets(from: usize, to: usize, channel: bool) -> Value {
    let records: Vec<Value> = (from..to)
        .map(|i| {
            let mut data = json!({"subject": format!("ticket {i}"), "status": "open", "priority": i % 4,
                "region": "emea", "amount": 10.5, "escalated": i % 2 == 0, "opened_at": "2026-12-01T10:00:00Z",
                "tags": ["a", i], "body": format!("body {i}")});
            if channel {
                data["channel"] = json!("email");
            }
            json!({"key": format!("t-{i:03}"), "data": data})
        })
        .collect();
    Value::Array(records)
}

async fn schema_events(pool: &PgPool) -> Vec<(String, Value)> {
    sqlx::query_as("SELECT principal, data FROM webhook_events WHERE type = 'schema.changed' ORDER BY principal")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_compatible_change_reaches_a_pulling_partner_without_a_failed_page(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let (admin, partner) = (app.token("acme", "alice"), app.token("acme", "zenpartner"));
    let old = Client { app: &app, base: app.url("") };
    let mut cursor = app.cursor_now(&partner, "tickets").await;
    old.ingest(&admin, tickets(0, 10, false)).await;
    app.tick().await;
    app.pass_safety_delay();
    let mut seen = Vec::new();
    loop {
        let page = old.page(&partner, &cursor).await;
        assert_eq!(page["schema"]["version"], "1.0");
        for change in page["changes"].as_array().unwrap() {
            assert!(change["data"].get("channel").is_none());
            seen.push(change["key"].as_str().unwrap().to_owned());
        }
        cursor = page["next_cursor"].as_str().unwrap().to_owned();
        if page["end_of_stream"] == true {
            break;
        }
    }
    assert_eq!(seen.len(), 10);
    assert!(schema_events(&pool).await.is_empty(), "the first schema is recorded, not announced");

    // The next process starts with the column added: recorded as 1.1 and announced before it
    // serves anything.
    let dir = tenants_with(with_channel);
    let registry = prepare_db_from(&pool, dir.path()).await.unwrap();
    let events = schema_events(&pool).await;
    let zen = events.iter().find(|(p, _)| p == "zenpartner").expect("zenpartner is told");
    assert_eq!(zen.1["principal"], "zenpartner", "the contract's webhook table lists it");
    assert_eq!(zen.1["version"], "1.1");
    assert_eq!(zen.1["previous_version"], "1.0");
    assert_eq!(zen.1["change"], "compatible");
    assert_eq!(zen.1["changes"][0]["change"], "added");
    assert_eq!(zen.1["changes"][0]["column"], "channel");
    assert!(events.iter().all(|(p, _)| p != "alice"), "partners are told, per partner");
    let new = Client { app: &app, base: app.sibling(registry).await };

    new.ingest(&admin, tickets(10, 20, true)).await;
    app.tick().await;
    app.pass_safety_delay();
    loop {
        let page = new.page(&partner, &cursor).await;
        assert_eq!(page["schema"]["version"], "1.1");
        for change in page["changes"].as_array().unwrap() {
            assert_eq!(change["data"]["channel"], "email", "{change}");
            seen.push(change["key"].as_str().unwrap().to_owned());
        }
        cursor = page["next_cursor"].as_str().unwrap().to_owned();
        if page["end_of_stream"] == true {
            break;
        }
    }
    let expected: Vec<String> = (0..20).map(|i| format!("t-{i:03}")).collect();
    assert_eq!(seen, expected, "every change once, in order, across the change");

    let schema: Value = new.get(&partner, "/v1/datasets/tickets/schema").await.json().await.unwrap();
    assert_eq!(schema["current_version"], "1.1");
    assert_eq!(schema["served"]["version"], "1.1");
    let history = schema["history"].as_array().unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(history[0]["change"], "initial");
    assert!(history[1]["changes"][0]["explanation"].as_str().unwrap().contains("`channel`"));
}

#[sqlx::test(migrations = "./migrations")]
async fn a_rename_without_the_next_major_stops_start_up_and_names_the_column(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let dir = tenants_with(renamed(None));
    let error = format!("{:#}", prepare_db_from(&pool, dir.path()).await.unwrap_err());
    for part in
        ["datasets/tickets.toml", "version", "column `escalated` is renamed to `urgent`", "would lose", "version = 2"]
    {
        assert!(error.contains(part), "`{part}` is not in: {error}");
    }
    // The real binary refuses to start likewise, and changes nothing.
    let output = Command::new(env!("CARGO_BIN_EXE_exportd"))
        .arg("migrate")
        .env("DATABASE_URL", database_url(&pool).await)
        .env("EXPORTD_TENANTS_DIR", dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("column `escalated` is renamed to `urgent`"), "{stderr}");
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM dataset_schemas WHERE dataset = 'tickets'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(recorded, 1);
    let catalogue: Value =
        sqlx::query_scalar("SELECT columns FROM datasets WHERE tenant = 'acme' AND dataset = 'tickets'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(catalogue.to_string().contains("\"escalated\""), "the write functions still validate version 1");

    // Declared, it is version 2.0; a partner pinned to 1 receives `escalated` as a retired column.
    let dir = tenants_with(renamed(Some(2)));
    let registry = prepare_db_from(&pool, dir.path()).await.unwrap();
    let new = Client { app: &app, base: app.sibling(registry).await };
    let legacy = token(&dir_registry(&dir), "legacy");
    let schema: Value = new.get(&legacy, "/v1/datasets/tickets/schema").await.json().await.unwrap();
    assert_eq!((&schema["current_version"], &schema["served"]["version"]), (&json!("2.0"), &json!("1.0")));
    assert_eq!(schema["pinned_major"], 1);
    let old = schema["served"]["columns"].as_array().unwrap().iter().find(|c| c["name"] == "escalated").unwrap();
    assert_eq!(old["retired"], true);
    assert_eq!(schema["history"][1]["change"], "breaking");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_pinned_partner_keeps_byte_identical_files_of_its_major(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let v1 = tenants_with(|text| text.to_owned());
    let v1_registry = prepare_db_from(&pool, v1.path()).await.unwrap();
    let before = Client { app: &app, base: app.sibling(v1_registry.clone()).await };
    let (admin, legacy) = (app.token("acme", "alice"), token(&v1_registry, "legacy"));
    before.ingest(&admin, tickets(0, 20, false)).await;
    let (manifest_before, bytes_before) = before.export(&legacy, &v1_registry).await;
    assert_eq!(manifest_before["schema"]["version"], "1.0");

    let v2 = tenants_with(major_two);
    let v2_registry = prepare_db_from(&pool, v2.path()).await.unwrap();
    let after = Client { app: &app, base: app.sibling(v2_registry.clone()).await };
    let (manifest_after, bytes_after) = after.export(&legacy, &v2_registry).await;
    assert_eq!(manifest_after["schema"], manifest_before["schema"], "the pinned version, named");
    assert_eq!(manifest_after["columns"], manifest_before["columns"]);
    assert!(bytes_before.len() > 500);
    assert!(bytes_after == bytes_before, "the pinned partner's CSV changed across the new major");

    // Everyone else receives 2.0.
    let (manifest, bytes) = after.export(&admin, &v2_registry).await;
    assert_eq!(manifest["schema"]["version"], "2.0");
    let text = String::from_utf8(bytes).unwrap();
    let header = text.trim_start_matches('\u{feff}').lines().next().unwrap().to_owned();
    assert!(header.starts_with("\"ticket_id\",") && header.ends_with(",\"channel\""), "{header}");

    // Feed pages: the pinned partner sees the old shape, the admin the new one.
    let (legacy_cursor, admin_cursor) = (after.cursor(&legacy).await, after.cursor(&admin).await);
    let mut records = tickets(20, 21, true);
    records[0]["data"]["priority"] = json!(1);
    after.ingest(&admin, records).await;
    app.tick().await;
    app.pass_safety_delay();
    let page = after.page(&legacy, &legacy_cursor).await;
    assert_eq!(page["schema"]["version"], "1.0");
    assert!(page["changes"][0]["data"].get("channel").is_none(), "{page}");
    assert_eq!(page["changes"][0]["data"]["region"], "emea");
    let page = after.page(&admin, &admin_cursor).await;
    assert_eq!(page["schema"]["version"], "2.0");
    assert_eq!(page["changes"][0]["data"]["channel"], "email");
}
