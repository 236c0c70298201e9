//! Column policies: canary values seeded into masked columns never reach the partner — not in
//! decompressed shards of any format, manifests, feed pages, estimates, error bodies, webhook
//! events or the server's log — while hashed values are exactly the documented HMAC with the
//! partner's own key (equal across exports and feeds, different for another partner), row counts
//! are unchanged and the admin still exports the real values.

use std::time::Duration;

use crate::common::processes::{Server, wait_terminal};
use crate::common::{TestApp, edited_registry, gunzip, problem};
use arrow_array::Array;
use arrow_array::cast::AsArray;
use exportd::jobs::{ClaimedExport, Step};
use hmac::{Hmac, KeyInit, Mac};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::{Value, json};
use sha2::Sha256;
use sqlx::PgPool;

const ROWS: usize = 30;
/// acme's `[masking]` secret in tests/fixtures/tenants/acme.toml.
const MASKING_SECRET: &str = "acme-test-masking-secret-0123456789abcdef0123";
/// What must never reach a masked partner: parts of keys, names, e-mail addresses, phone
/// numbers and amounts seeded into masked columns.
const CANARIES: [&str; 5] = ["KEYCANARY", "NAMECANARY", "canary.example", "+1-555-01", "98765.4321"];

fn key(i: usize) -> String {
    format!("contact-KEYCANARY-{i:03}")
}

fn email(i: usize) -> String {
    format!("person{i}@canary.example")
}

/// The documented hash: HMAC-SHA256 keyed with HMAC-SHA256(secret, label ‖ 0 ‖ tenant ‖ 0 ‖
/// partner), its first 16 bytes as lowercase hex.
fn hashed(partner: &str, value: &str) -> String {
    let mut derive = <Hmac<Sha256>>::new_from_slice(MASKING_SECRET.as_bytes()).unwrap();
    derive.update(format!("exportd column hash v1\0acme\0{partner}").as_bytes());
    let mut mac = <Hmac<Sha256>>::new_from_slice(&derive.finalize().into_bytes()).unwrap();
    mac.update(value.as_bytes());
    hex::encode(&mac.finalize().into_bytes()[..16])
}

fn assert_no_canary(what: &str, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    for canary in CANARIES {
        assert!(!text.contains(canary), "{what} holds `{canary}`: {}", &text[..text.len().min(2000)]);
    }
}

async fn seed_contacts(app: &TestApp) {
    let records: Vec<Value> = (0..ROWS)
        .map(|i| {
            json!({"key": key(i), "data": {"name": format!("Zed NAMECANARY {i}"), "email": email(i),
                "phone": format!("+1-555-01{i:02}"), "region": "emea", "lifetime_value": 98765.4321,
                "created_at": "2026-12-01T10:00:00Z"}})
        })
        .collect();
    let response = app.ingest(&app.token("acme", "alice"), "contacts", &Value::Array(records)).await;
    assert_eq!(response.status(), 200);
}

/// A client of the `exportd serve` process, as one principal.
struct Partner<'a> {
    client: reqwest::Client,
    base: &'a str,
    token: String,
}

impl Partner<'_> {
    async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(format!("{}{path}", self.base)).bearer_auth(&self.token).send().await.unwrap()
    }

    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        let request = self.client.post(format!("{}{path}", self.base)).bearer_auth(&self.token);
        let key = uuid::Uuid::new_v4().to_string();
        request.header("Idempotency-Key", key).json(body).send().await.unwrap()
    }

    /// Creates an export, waits for it, returns its manifest and its shards' bytes (gzip
    /// shards decompressed); every body on the way is checked for canaries when `masked`.
    async fn export(&self, pool: &PgPool, body: Value, masked: bool) -> (Value, Vec<Vec<u8>>) {
        let created = self.post("/v1/exports", &body).await;
        assert_eq!(created.status(), 202, "{body}");
        let created = created.bytes().await.unwrap();
        let id = serde_json::from_slice::<Value>(&created).unwrap()["id"].as_str().unwrap().to_owned();
        assert_eq!(wait_terminal(pool, &id, Duration::from_secs(60)).await, "SUCCEEDED");
        let status = self.get(&format!("/v1/exports/{id}")).await.bytes().await.unwrap();
        let manifest = self.get(&format!("/v1/exports/{id}/manifest")).await;
        assert_eq!(manifest.status(), 200);
        let manifest_bytes = manifest.bytes().await.unwrap();
        let manifest: Value = serde_json::from_slice(&manifest_bytes).unwrap();
        let mut shards = Vec::new();
        for shard in manifest["shards"].as_array().unwrap() {
            let bytes = self.get(&format!("/v1/exports/{id}/shards/{}", shard["index"])).await.bytes().await.unwrap();
            let bytes = if bytes.starts_with(b"PAR1") { bytes.to_vec() } else { gunzip(&bytes) };
            shards.push(bytes);
        }
        if masked {
            for (what, bytes) in
                [("create answer", &created[..]), ("status", &status[..]), ("manifest", &manifest_bytes[..])]
            {
                assert_no_canary(what, bytes);
            }
            shards.iter().for_each(|s| assert_no_canary("a shard", s));
        }
        (manifest, shards)
    }
}

/// The rows of decompressed CSV shards, the header once.
fn csv_of(shards: &[Vec<u8>]) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    for (n, shard) in shards.iter().enumerate() {
        let text = shard.strip_prefix(b"\xEF\xBB\xBF").expect("CSV shards start with a BOM");
        let reader = csv::ReaderBuilder::new().has_headers(false).from_reader(text);
        let mut shard_rows: Vec<Vec<String>> =
            reader.into_records().map(|r| r.unwrap().iter().map(str::to_owned).collect()).collect();
        let header = shard_rows.remove(0);
        if n == 0 {
            rows.push(header);
        }
        rows.extend(shard_rows);
    }
    rows
}

#[sqlx::test(migrations = "./migrations")]
async fn masked_partners_never_receive_canaries_and_hash_with_their_own_key(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    seed_contacts(&app).await;
    let log = app.data_dir.path().join("serve.log");
    let server = Server::start(&app, "1", Some(&log)).await;
    let as_ = |principal: &str| Partner {
        client: reqwest::Client::new(),
        base: &server.base,
        token: app.token("acme", principal),
    };
    let (lens, prism, alice) = (as_("lens"), as_("prism"), as_("alice"));

    // What the partner is told of the dataset: no phone column, the policy's rules.
    let datasets = lens.get("/v1/datasets").await.bytes().await.unwrap();
    assert_no_canary("dataset list", &datasets);
    let datasets: Value = serde_json::from_slice(&datasets).unwrap();
    let contacts = datasets["datasets"].as_array().unwrap().iter().find(|d| d["name"] == "contacts").unwrap();
    let names: Vec<&str> =
        contacts["columns"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["name", "email", "region", "lifetime_value", "created_at"]);
    assert_eq!(contacts["column_policy"]["columns"]["email"], "hash");
    assert_eq!(contacts["column_policy"]["columns"]["id"], "hash");

    // CSV: the key and e-mail are the partner's HMACs, names cut, amounts null, no phone.
    let csv = json!({"dataset": "contacts", "format": "csv", "shard_rows": 7});
    let (manifest, shards) = lens.export(&pool, csv.clone(), true).await;
    let rows = csv_of(&shards);
    assert_eq!(rows[0], ["id", "name", "email", "region", "lifetime_value", "created_at"]);
    assert_eq!(rows.len() - 1, ROWS, "row counts unchanged");
    let mut expected: Vec<Vec<String>> = (0..ROWS)
        .map(|i| {
            let (id, mail) = (hashed("lens", &key(i)), hashed("lens", &email(i)));
            vec![id, "Zed".into(), mail, "emea".into(), String::new(), "2026-12-01T10:00:00Z".into()]
        })
        .collect();
    let mut got = rows[1..].to_vec();
    got.sort();
    expected.sort();
    assert_eq!(got, expected);
    let policy = manifest["column_policy"].clone();
    assert_eq!(policy["columns"]["phone"], "drop");
    assert_eq!(policy["fingerprint"].as_str().unwrap().len(), 16);
    let first_keys: Vec<&str> =
        manifest["shards"].as_array().unwrap().iter().map(|s| s["first_key"].as_str().unwrap()).collect();
    assert!(first_keys.iter().all(|k| (0..ROWS).any(|i| hashed("lens", &key(i)) == *k)), "{first_keys:?}");
    let email_column = manifest["columns"].as_array().unwrap().iter().find(|c| c["name"] == "email").unwrap();
    assert_eq!(email_column["masked"], "hash");

    // A second export of the same snapshot state is byte-identical (same hashes), and JSONL
    // carries the same values.
    let (_, again) = lens.export(&pool, csv.clone(), true).await;
    assert_eq!(again, shards);
    let (_, jsonl) = lens.export(&pool, json!({"dataset": "contacts", "format": "jsonl"}), true).await;
    let lines: Vec<Value> = jsonl
        .iter()
        .flat_map(|s| {
            String::from_utf8(s.clone())
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect::<Vec<Value>>()
        })
        .collect();
    assert_eq!(lines.len(), ROWS);
    let three = lines.iter().find(|l| l["id"] == hashed("lens", &key(3))).expect("row 3 under its hashed key");
    assert_eq!(three["email"], hashed("lens", &email(3)));
    assert_eq!(three["lifetime_value"], Value::Null);
    assert!(three.get("phone").is_none());

    // Parquet: hashed columns are text, the (hashed) key is the declared sorting column — rows
    // come in hashed-key order — the null column is nullable and null.
    let (_, parquet) = lens.export(&pool, json!({"dataset": "contacts", "format": "parquet"}), true).await;
    let mut parquet_rows = 0;
    for file in parquet {
        let builder = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(file)).unwrap();
        let row_groups = builder.metadata().row_groups().to_vec();
        assert!(
            row_groups.iter().all(|g| g.sorting_columns().is_some_and(|s| s.len() == 1 && s[0].column_idx == 0)),
            "rows sorted by the hashed key"
        );
        for batch in builder.build().unwrap() {
            let batch = batch.unwrap();
            let schema = batch.schema();
            let columns: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            assert_eq!(columns, ["id", "name", "email", "region", "lifetime_value", "created_at"]);
            let ids = batch.column(0).as_string::<i32>();
            let emails = batch.column(2).as_string::<i32>();
            assert!((1..batch.num_rows()).all(|row| ids.value(row - 1) < ids.value(row)), "sorted by hashed key");
            for row in 0..batch.num_rows() {
                let i = (0..ROWS).find(|i| hashed("lens", &key(*i)) == ids.value(row)).expect("a hashed key");
                assert_eq!(emails.value(row), hashed("lens", &email(i)));
                assert!(batch.column(4).is_null(row));
            }
            parquet_rows += batch.num_rows();
        }
    }
    assert_eq!(parquet_rows, ROWS);

    // Another partner under the same rules gets other hashes; the admin gets the real values.
    let (_, prism_shards) = prism.export(&pool, csv.clone(), true).await;
    let prism_rows = csv_of(&prism_shards);
    assert_eq!(prism_rows.len() - 1, ROWS);
    assert!(prism_rows[1..].iter().all(|r| (0..ROWS).any(|i| r[0] == hashed("prism", &key(i)))));
    assert!(prism_rows[1..].iter().all(|r| rows[1..].iter().all(|l| l[0] != r[0] && l[2] != r[2])), "unlinkable");
    let lens_export = manifest["export_id"].as_str().unwrap();
    let admins_view = alice.get(&format!("/v1/exports/{lens_export}/manifest")).await;
    assert_eq!(admins_view.status(), 200, "the tenant's admin reads a masked partner's export as published");
    let (_, admin_shards) = alice.export(&pool, csv.clone(), false).await;
    let admin_text = String::from_utf8(admin_shards.concat()).unwrap();
    assert!(admin_text.contains(&email(7)) && admin_text.contains(&key(7)) && admin_text.contains("+1-555-0107"));

    // Estimates are sized with the masked writer and say nothing of the values.
    let estimate = lens.post("/v1/exports/estimate", &csv).await;
    assert_eq!(estimate.status(), 200);
    assert_no_canary("estimate", &estimate.bytes().await.unwrap());

    // Naming a dropped column looks like naming a missing one; a masked one cannot filter.
    let refusals = [
        (json!({"dataset": "contacts", "format": "csv", "columns": ["phone"]}), "columns[0]"),
        (json!({"dataset": "contacts", "format": "csv", "filter": {"phone": "+1-555-0101"}}), "filter.phone"),
        (json!({"dataset": "contacts", "format": "csv", "filter": {"email": email(1)}}), "filter.email"),
        (json!({"dataset": "contacts", "format": "csv", "filter": {"name": "Zed NAMECANARY 1"}}), "filter.name"),
    ];
    for (body, field) in refusals {
        let response = lens.post("/v1/exports", &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let problem = problem(response).await;
        assert_eq!(problem["field"], field);
        assert_no_canary("a refusal", problem.to_string().as_bytes());
    }
    let missing = lens.post("/v1/exports", &json!({"dataset": "contacts", "format": "csv", "columns": ["nope"]})).await;
    let (dropped, missing) = (
        problem(lens.post("/v1/exports", &json!({"dataset": "contacts", "format": "csv", "columns": ["phone"]})).await)
            .await,
        problem(missing).await,
    );
    assert_eq!(
        dropped["detail"].as_str().unwrap().replace("phone", "X"),
        missing["detail"].as_str().unwrap().replace("nope", "X")
    );

    // Feed pages: upserts and tombstones under hashed keys, data masked like the files.
    let cursor = app.cursor_now(&lens.token, "contacts").await;
    let changes = json!([
        {"key": key(1), "data": {"name": "Zed NAMECANARY changed", "email": "new1@canary.example", "phone": "+1-555-0199",
            "region": "emea", "lifetime_value": 98765.4321}},
        {"key": key(2), "deleted": true}
    ]);
    assert_eq!(app.ingest(&app.token("acme", "alice"), "contacts", &changes).await.status(), 200);
    app.tick().await;
    app.pass_safety_delay();
    let page = app.get(Some(&lens.token), &format!("/v1/datasets/contacts/changes?cursor={cursor}")).await;
    assert_eq!(page.status(), 200);
    let page = page.bytes().await.unwrap();
    assert_no_canary("a feed page", &page);
    let page: Value = serde_json::from_slice(&page).unwrap();
    let feed = page["changes"].as_array().unwrap();
    assert_eq!(feed.len(), 2);
    let upsert = feed.iter().find(|c| c["op"] == "upsert").unwrap();
    assert_eq!(upsert["key"], hashed("lens", &key(1)));
    assert_eq!(upsert["data"]["email"], hashed("lens", "new1@canary.example"));
    assert_eq!(upsert["data"]["name"], "Zed");
    assert_eq!(upsert["data"]["lifetime_value"], Value::Null);
    assert!(upsert["data"].get("phone").is_none());
    let delete = feed.iter().find(|c| c["op"] == "delete").unwrap();
    assert_eq!(delete["key"], hashed("lens", &key(2)), "a tombstone under the same hashed key");

    // Incremental export from the full export's cursor: the same masked changes (created on
    // the in-process server, whose clock is past the safety delay).
    let app_base = app.url("");
    let lens = Partner { base: &app_base, ..lens };
    let since = manifest["next_cursor"].as_str().unwrap();
    let incremental = json!({"dataset": "contacts", "format": "csv", "mode": "incremental", "since": since});
    let (_, changed) = lens.export(&pool, incremental, true).await;
    let changed = csv_of(&changed);
    assert_eq!(changed[0], ["id", "_op", "name", "email", "region", "lifetime_value", "created_at"]);
    let mut ops: Vec<(String, String)> = changed[1..].iter().map(|r| (r[0].clone(), r[1].clone())).collect();
    ops.sort();
    let mut expected =
        vec![(hashed("lens", &key(1)), "upsert".to_owned()), (hashed("lens", &key(2)), "delete".to_owned())];
    expected.sort();
    assert_eq!(ops, expected);

    // Export events, as webhook bodies carry them, hold no values.
    let events: Vec<String> =
        sqlx::query_scalar("SELECT data::text FROM webhook_events").fetch_all(&pool).await.unwrap();
    assert!(!events.is_empty());
    events.iter().for_each(|e| assert_no_canary("an export event", e.as_bytes()));
    drop(server);
    assert_no_canary("the server's log", &std::fs::read(&log).unwrap());
}

#[sqlx::test(migrations = "./migrations")]
async fn a_policy_change_refuses_old_files_and_expires_old_cursors(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    seed_contacts(&app).await;
    let lens = app.token("acme", "lens");
    let id = app.export(&lens, &json!({"dataset": "contacts", "format": "csv"})).await;
    app.drain().await;
    let cursor = app.cursor_now(&lens, "contacts").await;
    assert_eq!(app.get(Some(&lens), &format!("/v1/exports/{id}/manifest")).await.status(), 200);
    let changed = app
        .sibling(edited_registry("acme", |t| t.replacen(r#"name = "truncate(3)""#, r#"name = "truncate(2)""#, 1)))
        .await;
    let get = |path: String| app.client.get(format!("{changed}{path}")).bearer_auth(&lens).send();
    let manifest = get(format!("/v1/exports/{id}/manifest")).await.unwrap();
    assert_eq!(manifest.status(), 403);
    assert_eq!(problem(manifest).await["code"], "column-policy-changed");
    let shard = get(format!("/v1/exports/{id}/shards/0")).await.unwrap();
    assert_eq!(shard.status(), 403);
    let page = get(format!("/v1/datasets/contacts/changes?cursor={cursor}")).await.unwrap();
    assert_eq!(page.status(), 410);
    assert_eq!(problem(page).await["code"], "cursor-expired");
    // prism's policy did not change: its view stands.
    let prism = app.token("acme", "prism");
    let prism_cursor = app.cursor_now(&prism, "contacts").await;
    let page =
        app.client.get(format!("{changed}/v1/datasets/contacts/changes?cursor={prism_cursor}")).bearer_auth(&prism);
    assert_eq!(page.send().await.unwrap().status(), 200);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_masked_partners_schema_hashes_cover_only_what_it_is_served(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    seed_contacts(&app).await;
    let server = Server::start(&app, "1", None).await;
    let as_ = |principal: &str| Partner {
        client: reqwest::Client::new(),
        base: &server.base,
        token: app.token("acme", principal),
    };
    let (lens, alice) = (as_("lens"), as_("alice"));
    // What a partner can recompute from the document alone: compact JSON, keys sorted.
    let seen_hash = |columns: &Value| {
        crate::common::sha256_hex(&serde_json::to_vec(&json!({"dataset": "contacts", "columns": columns})).unwrap())
    };
    let schema: Value = lens.get("/v1/datasets/contacts/schema").await.json().await.unwrap();
    let admins: Value = alice.get("/v1/datasets/contacts/schema").await.json().await.unwrap();
    let served = &schema["served"];
    assert!(served["columns"].as_array().unwrap().iter().all(|c| c["name"] != "phone"), "phone is dropped");
    assert_eq!(served["sha256"], seen_hash(&served["columns"]).as_str(), "the hash of what lens is served");
    assert_ne!(served["sha256"], admins["served"]["sha256"], "not the declared schema's hash");
    for entry in schema["history"].as_array().unwrap() {
        assert_eq!(entry["sha256"], seen_hash(&entry["columns"]).as_str(), "{entry}");
    }
    // The feed page and the export's manifest say the same hash.
    let cursor: Value = lens.get("/v1/datasets/contacts/cursor").await.json().await.unwrap();
    let cursor = cursor["cursor"].as_str().unwrap();
    let page: Value = lens.get(&format!("/v1/datasets/contacts/changes?cursor={cursor}")).await.json().await.unwrap();
    assert_eq!(page["schema"]["sha256"], served["sha256"]);
    let (manifest, _) = lens.export(&pool, json!({"dataset": "contacts", "format": "jsonl"}), true).await;
    assert_eq!(manifest["schema"]["sha256"], served["sha256"]);
    // The admin (served the whole schema) keeps the declared schema's hash.
    let (admin_manifest, _) = alice.export(&pool, json!({"dataset": "contacts", "format": "jsonl"}), false).await;
    assert_eq!(admin_manifest["schema"]["sha256"], admins["served"]["sha256"]);
    // The cluster's transaction ids (the snapshot) are shown to admins only, footers included.
    assert!(manifest.get("snapshot_watermark").is_none(), "{manifest}");
    assert!(admin_manifest["snapshot_watermark"].is_string());
    let footer_keys = |shards: &[Vec<u8>]| -> Vec<String> {
        let file = parquet::file::reader::SerializedFileReader::new(bytes::Bytes::from(shards[0].clone())).unwrap();
        use parquet::file::reader::FileReader;
        let metadata = file.metadata().file_metadata().key_value_metadata().cloned().unwrap_or_default();
        metadata.into_iter().map(|kv| kv.key).collect()
    };
    let parquet = json!({"dataset": "contacts", "format": "parquet"});
    let (_, lens_files) = lens.export(&pool, parquet.clone(), true).await;
    let (_, admin_files) = alice.export(&pool, parquet, false).await;
    assert!(!footer_keys(&lens_files).contains(&"exportd.snapshot_watermark".to_owned()));
    assert!(footer_keys(&admin_files).contains(&"exportd.snapshot_watermark".to_owned()));
}

#[sqlx::test(migrations = "./migrations")]
async fn a_feed_page_ends_by_the_bytes_the_partner_receives_not_by_dropped_ones(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (admin, lens) = (app.token("acme", "alice"), app.token("acme", "lens")); // lens: tickets' body dropped
    let cursor = app.cursor_now(&lens, "tickets").await;
    // 20 records, each with a 900 kB body lens never receives: 18 MB raw, a few kB served.
    for batch in 0..2 {
        let records: Vec<Value> = (0..10)
            .map(|i| {
                let body = "b".repeat(900_000);
                json!({"key": format!("t-{batch}{i}"), "data": {"subject": "s", "status": "open", "body": body}})
            })
            .collect();
        assert_eq!(app.ingest(&admin, "tickets", &Value::Array(records)).await.status(), 200);
    }
    app.tick().await;
    app.pass_safety_delay();
    let page: Value = app
        .get(Some(&lens), &format!("/v1/datasets/tickets/changes?cursor={cursor}&limit=100"))
        .await
        .json()
        .await
        .unwrap();
    let changes = page["changes"].as_array().unwrap();
    assert!(changes.iter().all(|c| c["data"].get("body").is_none()));
    assert_eq!(changes.len(), 20, "one page: where it ends must not reveal the dropped bodies' size");
    assert_eq!(page["end_of_stream"], true);
}

/// Spearman's rank correlation of two orderings of the same n items: `ranks[i]` is the position
/// item i holds in the second ordering.
fn rank_correlation(ranks: &[usize]) -> f64 {
    let n = ranks.len() as f64;
    let d2: f64 = ranks.iter().enumerate().map(|(i, r)| (i as f64 - *r as f64).powi(2)).sum();
    1.0 - 6.0 * d2 / (n * (n * n - 1.0))
}

/// Where each real key (by its index) stands among `hashes`, given in the order received.
fn received_ranks(partner: &str, hashes: &[String], rows: usize) -> Vec<usize> {
    (0..rows).map(|i| hashes.iter().position(|h| *h == hashed(partner, &key(i))).expect("every key received")).collect()
}

/// A partner whose keys are hashed receives rows ordered and cut by the hashed key it sees:
/// across shards (with their first and last keys), feed pages and incremental exports. Real keys
/// are sequential here; in real-key order every hash would be undone from its position alone.
#[sqlx::test(migrations = "./migrations")]
async fn hashed_keys_come_in_hashed_order_so_positions_reveal_no_real_key(pool: PgPool) {
    const MANY: usize = 300;
    let app = TestApp::spawn(pool).await;
    let alice = app.token("acme", "alice");
    let lens = app.token("acme", "lens");
    let write = |range: std::ops::Range<usize>, region: &'static str| {
        let records: Vec<Value> = range
            .map(|i| json!({"key": key(i), "data": {"name": "Zed", "email": email(i), "region": region}}))
            .collect();
        Value::Array(records)
    };
    assert_eq!(app.ingest(&alice, "contacts", &write(0..MANY, "emea")).await.status(), 200);

    // A full export in shards of 40 rows.
    let id = app.export(&lens, &json!({"dataset": "contacts", "format": "csv", "shard_rows": 40})).await;
    app.drain().await;
    let manifest: Value = app.get(Some(&lens), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    let mut ids = Vec::new();
    for shard in manifest["shards"].as_array().unwrap() {
        let body = app.get(Some(&lens), &format!("/v1/exports/{id}/shards/{}", shard["index"])).await;
        let rows = csv_of(&[gunzip(&body.bytes().await.unwrap())]);
        let shard_ids: Vec<String> = rows[1..].iter().map(|r| r[0].clone()).collect();
        assert_eq!(shard["first_key"], shard_ids[0], "a shard's first key is its first row's hashed key");
        assert_eq!(shard["last_key"], *shard_ids.last().unwrap());
        ids.extend(shard_ids);
    }
    assert_eq!(ids.len(), MANY);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "rows and shards in hashed-key order");
    let rho = rank_correlation(&received_ranks("lens", &ids, MANY));
    assert!(rho.abs() < 0.2, "row positions follow the real keys (rank correlation {rho})");

    // Feed pages of one window, 40 changes a page: the same order, cut by the hashed key.
    let mut cursor = app.cursor_now(&lens, "contacts").await;
    assert_eq!(app.ingest(&alice, "contacts", &write(0..MANY, "apac")).await.status(), 200);
    app.tick().await;
    app.pass_safety_delay();
    let mut keys = Vec::new();
    loop {
        let path = format!("/v1/datasets/contacts/changes?cursor={cursor}&limit=40");
        let page: Value = app.get(Some(&lens), &path).await.json().await.unwrap();
        let changes = page["changes"].as_array().unwrap();
        assert!(changes.len() <= 40);
        keys.extend(changes.iter().map(|c| c["key"].as_str().unwrap().to_owned()));
        cursor = page["next_cursor"].as_str().unwrap().to_owned();
        if page["end_of_stream"] == true {
            break;
        }
    }
    assert_eq!(keys, ids, "each change once, in hashed-key order across pages");

    // An incremental export from the full export's cursor: the same changes, the same order.
    let since = manifest["next_cursor"].as_str().unwrap();
    let body = json!({"dataset": "contacts", "format": "csv", "mode": "incremental", "since": since, "shard_rows": 70});
    let incremental = app.export(&lens, &body).await;
    app.drain().await;
    let manifest: Value =
        app.get(Some(&lens), &format!("/v1/exports/{incremental}/manifest")).await.json().await.unwrap();
    let mut changed = Vec::new();
    for shard in manifest["shards"].as_array().unwrap() {
        let body = app.get(Some(&lens), &format!("/v1/exports/{incremental}/shards/{}", shard["index"])).await;
        changed.extend(csv_of(&[gunzip(&body.bytes().await.unwrap())])[1..].iter().map(|r| r[0].clone()));
    }
    assert_eq!(changed, ids, "incremental rows in hashed-key order");
}

/// Workers that each spool the rows themselves, taking turns on one hashed-key export (each
/// writes a step, then gives the job back to the next), write the bytes of a single worker's run.
#[sqlx::test(migrations = "./migrations")]
async fn a_hashed_key_export_has_the_same_bytes_whichever_workers_write_its_shards(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let records: Vec<Value> =
        (0..200).map(|i| json!({"key": key(i), "data": {"name": "Zed", "email": email(i)}})).collect();
    assert_eq!(app.ingest(&app.token("acme", "alice"), "contacts", &Value::Array(records)).await.status(), 200);
    let lens = app.token("acme", "lens");
    let body = json!({"dataset": "contacts", "format": "csv", "shard_rows": 30});
    let shards = async |id: &str| {
        let manifest: Value = app.get(Some(&lens), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
        let shards = manifest["shards"].as_array().unwrap().clone();
        shards.iter().map(|s| (s["sha256"].clone(), s["first_key"].clone(), s["rows"].clone())).collect::<Vec<_>>()
    };
    let alone = app.export(&lens, &body).await;
    exportd::jobs::drain(&app.deps(), "alone").await.unwrap();
    let taking_turns = app.export(&lens, &body).await;
    // Three workers, each with spools of its own, claim the job in turn: each writes one shard
    // (after checking the ones before it), then gives the job back to the next.
    let workers = [("a", app.deps()), ("b", app.deps()), ("c", app.deps())];
    let mut published = false;
    for turn in 0..20 {
        let (name, deps) = &workers[turn % workers.len()];
        let mut run = ClaimedExport::claim(deps, name).await.unwrap().expect("the job is claimable at once");
        let mut steps = 0;
        let step = loop {
            steps += 1;
            assert!(steps < 20, "a shard within 20 steps");
            let step = run.step().await.unwrap();
            if matches!(step, Step::Published | Step::ShardWritten { .. }) {
                break step;
            }
        };
        if step == Step::Published {
            published = true;
            break;
        }
        run.give_back(false).await.unwrap();
    }
    assert!(published, "published within 20 turns");
    let writers: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT written_by FROM export_shards WHERE export_id = $1::text::uuid")
            .bind(&taking_turns)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(writers.len(), 3, "every worker wrote shards: {writers:?}");
    let (alone, taking_turns) = (shards(&alone).await, shards(&taking_turns).await);
    assert_eq!(alone.len(), 7);
    assert_eq!(alone, taking_turns);
}
