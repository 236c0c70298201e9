//! The served view as a property: what a principal receives of a dataset depends on what it is
//! served and on nothing else. Deployments replay one seeded random history (upserts, deletes,
//! re-inserts, rows moving in and out of a row filter, updates of hidden columns only); beside
//! the base one, each partner has a deployment whose history differs from it only in what that
//! partner may not see — columns its policy drops or nulls, the text past a truncation (multi-
//! byte characters at the boundary), rows outside its row filter, whole keys that only ever
//! exist outside it. Every channel must answer the partner alike in both: feed pages and where
//! they end, full CSV and JSONL exports (every shard's bytes, rows, keys and sha256),
//! incremental exports, estimates. The base deployment's answers must also agree with each
//! other and equal a reference computed here from the history with the partner's rules.
//!
//! The seed is printed; `SERVED_VIEW_SEED=<n>` replays one.

use std::collections::BTreeMap;
use std::io::Read;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};
use sqlx::PgPool;

use crate::common::{SecondDatabase, TestApp, sha256_hex};
use crate::feeds::{apply, seal};

/// Keys of each dataset the history writes.
const TICKETS: usize = 24;
const CONTACTS: usize = 30;
/// Keys only `zenpartner`'s blind deployment writes, always outside its row filter.
const HIDDEN_TICKETS: usize = 6;
const STEPS: usize = 150;

/// The deployments: the base one, and one per partner that differs only in what it is not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum World {
    Base = 0,
    /// Other tickets' bodies; other contacts' phones, lifetime values and names past 3 characters.
    LensBlind = 1,
    /// Other tickets outside `emea`, and tickets that only exist outside it.
    ZenBlind = 2,
}

/// One write, as each world makes it (`None`: a delete, or no write at all for keys a world
/// does not have).
struct Write {
    dataset: &'static str,
    key: String,
    values: [Option<Value>; 3],
}

/// The history: per step the writes, and whether a tick follows.
struct History {
    steps: Vec<(Vec<Write>, bool)>,
}

const FIRST_NAMES: [&str; 4] = ["Zoë", "日本語", "Åsa", "José"];

impl History {
    fn random(rng: &mut StdRng) -> History {
        let mut steps = Vec::new();
        let mut tickets: BTreeMap<usize, Value> = BTreeMap::new();
        for step in 0..STEPS {
            let mut writes = Vec::new();
            match rng.random_range(0..10) {
                // A ticket: created, changed, moved between regions.
                0..=3 => {
                    let i = rng.random_range(0..TICKETS);
                    let emea = rng.random_bool(0.7);
                    let status = ["open", "closed", "pending"][rng.random_range(0..3)];
                    let visible = json!({
                        "subject": format!("subject {}", rng.random_range(0..5)),
                        "status": status,
                        "priority": rng.random_range(0..4),
                        "region": if emea { "emea" } else { "amer" },
                        "escalated": rng.random_bool(0.5),
                        "opened_at": "2026-12-01T10:00:00Z",
                    });
                    let values = ticket(rng, &visible, emea);
                    tickets.insert(i, visible);
                    writes.push(Write { dataset: "tickets", key: ticket_key(i), values });
                }
                // A ticket's body alone changes (what `lens` is not served).
                4 => {
                    let Some((&i, visible)) = tickets.iter().nth(rng.random_range(0..tickets.len().max(1))) else {
                        continue;
                    };
                    let emea = visible["region"] == "emea";
                    let values = ticket(rng, visible, emea);
                    writes.push(Write { dataset: "tickets", key: ticket_key(i), values });
                }
                // A ticket deleted (and perhaps written again later).
                5 => {
                    let i = rng.random_range(0..TICKETS);
                    tickets.remove(&i);
                    writes.push(Write { dataset: "tickets", key: ticket_key(i), values: [None, None, None] });
                }
                // A contact: hashed id and email alike, the name alike up to its truncation.
                6..=8 => {
                    let i = rng.random_range(0..CONTACTS);
                    let name = FIRST_NAMES[rng.random_range(0..FIRST_NAMES.len())];
                    let email = format!("c{i}-{}@example.com", rng.random_range(0..3));
                    let region = ["emea", "amer"][rng.random_range(0..2)];
                    let contact = |suffix: u32, phone: u32, value: u32| {
                        json!({"name": format!("{name} {suffix}ö"), "email": email, "region": region,
                               "phone": format!("+44 {phone}"), "lifetime_value": value,
                               "created_at": "2026-11-30T08:00:00Z"})
                    };
                    let base = contact(rng.random_range(0..100), rng.random_range(0..1000), rng.random_range(0..500));
                    let blind =
                        contact(rng.random_range(100..200), rng.random_range(1000..2000), rng.random_range(500..900));
                    let values = [Some(base.clone()), Some(blind), Some(base)];
                    writes.push(Write { dataset: "contacts", key: contact_key(i), values });
                }
                _ => {
                    let i = rng.random_range(0..CONTACTS);
                    writes.push(Write { dataset: "contacts", key: contact_key(i), values: [None, None, None] });
                }
            }
            // Tickets only `zenpartner`'s blind world has, never inside its row filter.
            if rng.random_bool(0.3) {
                let i = rng.random_range(0..HIDDEN_TICKETS);
                let data = if rng.random_bool(0.8) {
                    Some(json!({"subject": format!("hidden {step}"), "status": "open", "region": "apac",
                                "body": "x".repeat(rng.random_range(0..400))}))
                } else {
                    None
                };
                writes.push(Write { dataset: "tickets", key: format!("t-hidden-{i}"), values: [None, None, data] });
            }
            steps.push((writes, rng.random_bool(0.15)));
        }
        History { steps }
    }
}

/// A ticket in each world: the same visible columns; for `lens`'s blind world another body;
/// for `zenpartner`'s, outside its row filter, other visible values.
fn ticket(rng: &mut StdRng, visible: &Value, emea: bool) -> [Option<Value>; 3] {
    let mut base = visible.clone();
    base["body"] = json!("b".repeat(rng.random_range(0..300)));
    let mut lens_blind = visible.clone();
    lens_blind["body"] = json!(format!("other body {}", rng.random_range(0..1_000_000)));
    let mut zen_blind = base.clone();
    let (subject, priority) = (rng.random_range(0..1000), rng.random_range(10..20));
    if !emea {
        zen_blind["subject"] = json!(format!("amer only {subject}"));
        zen_blind["priority"] = json!(priority);
    }
    [Some(base), Some(lens_blind), Some(zen_blind)]
}

fn ticket_key(i: usize) -> String {
    format!("t-{i:03}")
}

fn contact_key(i: usize) -> String {
    format!("c-{i:03}")
}

/// Who is checked, on what, against which world: `lens` (tickets' body dropped; contacts' id and
/// email hashed, phone dropped, name truncated to 3 characters, lifetime value nulled) and
/// `zenpartner` (tickets in `emea` only).
const READERS: [(&str, &str, World); 3] = [
    ("lens", "tickets", World::LensBlind),
    ("lens", "contacts", World::LensBlind),
    ("zenpartner", "tickets", World::ZenBlind),
];

/// Everything a principal received of a dataset, comparable across deployments.
#[derive(Debug, PartialEq)]
struct Received {
    /// Each feed page: its changes and whether it ended the stream.
    pages: Vec<(Vec<Value>, bool)>,
    /// Per format: each shard's rows, bytes, sha256, first and last key; the totals.
    exports: Vec<Value>,
    /// The incremental export's shards from the same start.
    incremental: Value,
    estimate: Value,
}

/// Replays `history` as `world` makes it; returns each reader's cursor from before it.
async fn replay(app: &TestApp, history: &History, world: World) -> BTreeMap<(&'static str, &'static str), String> {
    let admin = app.token("acme", "alice");
    let mut starts = BTreeMap::new();
    for (principal, dataset, _) in READERS {
        starts.insert((principal, dataset), app.cursor_now(&app.token("acme", principal), dataset).await);
    }
    for (writes, tick) in &history.steps {
        for write in writes {
            if write.key.starts_with("t-hidden") && world != World::ZenBlind {
                continue;
            }
            let record = match &write.values[world as usize] {
                Some(data) => json!({"key": write.key, "data": data}),
                None => json!({"key": write.key, "deleted": true}),
            };
            let response = app.ingest(&admin, write.dataset, &json!([record])).await;
            assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
        }
        if *tick {
            app.tick().await;
        }
    }
    seal(app).await;
    starts
}

async fn received(app: &TestApp, principal: &str, dataset: &str, start: &str) -> Received {
    let token = app.token("acme", principal);
    let mut pages = Vec::new();
    let mut cursor = start.to_owned();
    loop {
        let page = app.pull(&token, dataset, &cursor, 3).await;
        let end = page["end_of_stream"] == true;
        pages.push((page["changes"].as_array().unwrap().clone(), end));
        cursor = page["next_cursor"].as_str().unwrap().to_owned();
        if end {
            break;
        }
    }
    let mut exports = Vec::new();
    for format in ["csv", "jsonl"] {
        let id = app.export(&token, &json!({"dataset": dataset, "format": format, "shard_rows": 3})).await;
        app.drain().await;
        exports.push(shards_of(app, &token, &id).await);
    }
    let since = json!({"dataset": dataset, "format": "jsonl", "mode": "incremental", "since": start, "shard_rows": 3});
    let id = app.export(&token, &since).await;
    app.drain().await;
    let incremental = shards_of(app, &token, &id).await;
    let estimate = app.client.post(app.url("/v1/exports/estimate")).bearer_auth(&token);
    let estimate = estimate.json(&json!({"dataset": dataset, "format": "csv"})).send().await.unwrap();
    assert_eq!(estimate.status(), 200);
    let estimate = estimate.json::<Value>().await.unwrap()["rows"].clone();
    Received { pages, exports, incremental, estimate }
}

/// What a manifest says of its shards and totals that a partner can compare, and each shard
/// file's sha256 as downloaded.
async fn shards_of(app: &TestApp, token: &str, id: &str) -> Value {
    let manifest = app.get(Some(token), &format!("/v1/exports/{id}/manifest")).await;
    assert_eq!(manifest.status(), 200);
    let manifest: Value = manifest.json().await.unwrap();
    let files = app.own_shard_files(id).await;
    let shards: Vec<Value> = manifest["shards"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&files)
        .map(|(shard, file)| {
            assert_eq!(shard["sha256"], sha256_hex(file).as_str());
            json!([shard["rows"], shard["bytes"], shard["sha256"], shard["first_key"], shard["last_key"]])
        })
        .collect();
    json!({"total_rows": manifest["total_rows"], "total_bytes": manifest["total_bytes"], "shards": shards})
}

/// The rows of a full JSONL export (gzip shards), by key.
async fn jsonl_rows(app: &TestApp, token: &str, dataset: &str) -> BTreeMap<String, Value> {
    let id = app.export(token, &json!({"dataset": dataset, "format": "jsonl"})).await;
    app.drain().await;
    let mut rows = BTreeMap::new();
    for file in app.own_shard_files(&id).await {
        let mut text = String::new();
        flate2::read::MultiGzDecoder::new(&file[..]).read_to_string(&mut text).unwrap();
        for line in text.lines() {
            let mut row: Map<String, Value> = serde_json::from_str(line).unwrap();
            let key = row.remove("id").unwrap().as_str().unwrap().to_owned();
            row.retain(|_, v| !v.is_null());
            rows.insert(key, Value::Object(row));
        }
    }
    rows
}

/// The base world's tickets as the history leaves them, through `keep`.
fn reference(history: &History, keep: impl Fn(&Value) -> Option<Value>) -> BTreeMap<String, Value> {
    let mut state = BTreeMap::new();
    for write in history.steps.iter().flat_map(|(writes, _)| writes) {
        if write.dataset != "tickets" || write.key.starts_with("t-hidden") {
            continue;
        }
        match write.values[World::Base as usize].as_ref().and_then(&keep) {
            Some(row) => state.insert(write.key.clone(), row),
            None => state.remove(&write.key),
        };
    }
    state
}

fn without_nulls(mut data: Value) -> Value {
    data.as_object_mut().unwrap().retain(|_, v| !v.is_null());
    data
}

#[sqlx::test(migrations = "./migrations")]
async fn what_a_partner_receives_depends_only_on_what_it_is_served(pool: PgPool) {
    let seeds: Vec<u64> = match std::env::var("SERVED_VIEW_SEED") {
        Ok(seed) => vec![seed.parse().expect("SERVED_VIEW_SEED is a number")],
        Err(_) => vec![rand::random(), rand::random()],
    };
    for seed in seeds {
        eprintln!("served view: seed {seed} (SERVED_VIEW_SEED={seed} replays it)");
        let history = History::random(&mut StdRng::seed_from_u64(seed));
        let databases = [
            SecondDatabase::create(&pool).await,
            SecondDatabase::create(&pool).await,
            SecondDatabase::create(&pool).await,
        ];
        let mut apps = Vec::new();
        let mut starts = Vec::new();
        for (database, world) in databases.iter().zip([World::Base, World::LensBlind, World::ZenBlind]) {
            let app = TestApp::spawn(database.pool.clone()).await;
            starts.push(replay(&app, &history, world).await);
            apps.push(app);
        }
        let base = &apps[0];
        for (principal, dataset, blind) in READERS {
            let key = (principal, dataset);
            let a = received(base, principal, dataset, &starts[0][&key]).await;
            let b = received(&apps[blind as usize], principal, dataset, &starts[blind as usize][&key]).await;
            // Enough history to cut several pages and shards, or the comparisons say little.
            let counts: Vec<usize> = a.pages.iter().map(|(c, _)| c.len()).collect();
            assert!(a.pages.len() > 2, "seed {seed}: {principal}'s {dataset}: pages {counts:?}");
            let export = &a.exports[0];
            assert!(export["shards"].as_array().unwrap().len() > 1, "seed {seed}: {principal}'s {dataset}: {export}");
            assert_eq!(a.pages, b.pages, "seed {seed}: {principal}'s {dataset} feed pages");
            assert_eq!(a.exports, b.exports, "seed {seed}: {principal}'s {dataset} full exports");
            assert_eq!(a.incremental, b.incremental, "seed {seed}: {principal}'s {dataset} incremental export");
            assert_eq!(a.estimate, b.estimate, "seed {seed}: {principal}'s {dataset} estimate");

            // The channels agree with each other: the feed from the start applied to nothing is
            // the full export.
            let mut fed = BTreeMap::new();
            for (changes, _) in &a.pages {
                apply(&mut fed, changes);
            }
            let exported = jsonl_rows(base, &base.token("acme", principal), dataset).await;
            let fed: BTreeMap<String, Value> = fed.into_iter().map(|(k, v)| (k, without_nulls(v))).collect();
            assert_eq!(fed, exported, "seed {seed}: {principal}'s {dataset} feed against its full export");
        }

        // And both equal the history through the partner's rules, computed here.
        let lens = jsonl_rows(base, &base.token("acme", "lens"), "tickets").await;
        let dropped_body = |row: &Value| {
            let mut row = row.clone();
            row.as_object_mut().unwrap().remove("body");
            Some(without_nulls(row))
        };
        assert_eq!(lens, reference(&history, dropped_body), "seed {seed}: lens's tickets");
        let zen = jsonl_rows(base, &base.token("acme", "zenpartner"), "tickets").await;
        let in_emea = |row: &Value| (row["region"] == "emea").then(|| without_nulls(row.clone()));
        assert_eq!(zen, reference(&history, in_emea), "seed {seed}: zenpartner's tickets");
        drop(apps);
        for database in databases {
            database.drop().await;
        }
    }
}
