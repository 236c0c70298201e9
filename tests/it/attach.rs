//! Attached host tables: a host application writes its own tables with plain SQL; `exportd
//! attach` (a real process, killed with SIGKILL mid-backfill and run again) makes them datasets
//! while eight host writers insert, update keys and tenants, delete and roll back.

use std::collections::BTreeMap;
use std::process::Stdio;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::process::Command;

use crate::common::processes::database_url;
use crate::common::{LINK_KEYS, TestApp, fixture_tenants_dir, gunzip, problem};
use exportd::jobs::Step;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The host application's schema: tickets of two organizations (one per tenant; globex, the
/// second, exports at most 1000 rows), and contacts
/// with a composite key.
const HOST_SCHEMA: &str = "
    CREATE SCHEMA app;
    CREATE TABLE app.tickets (id bigint PRIMARY KEY, org text NOT NULL, title text NOT NULL, status text NOT NULL,
                              priority int, opened timestamptz NOT NULL DEFAULT now());
    CREATE TABLE app.contacts (org text NOT NULL, num int NOT NULL, name text NOT NULL, email text,
                               PRIMARY KEY (org, num));
    INSERT INTO app.tickets (id, org, title, status, priority)
        SELECT i, CASE WHEN i % 20 = 0 THEN 'org-b' ELSE 'org-a' END, 'ticket ' || i, 'open', i % 5
        FROM generate_series(1, 6000) i;
    INSERT INTO app.contacts SELECT 'org-a', i, 'contact ' || i, 'c' || i || '@example.com' FROM generate_series(1, 800) i;";

/// `exportd attach ARGS` (tokio's: the host writers go on while it runs).
fn attach_command(url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_exportd"));
    command
        .arg("attach")
        .args(args)
        .env("DATABASE_URL", url)
        .env("EXPORTD_TENANTS_DIR", fixture_tenants_dir())
        .env("EXPORTD_LINK_KEYS", LINK_KEYS)
        .env("EXPORTD_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

const TICKETS: &[&str] = &[
    "--table",
    "app.tickets",
    "--dataset",
    "tickets",
    "--tenant-column",
    "org",
    "--tenant-map",
    "org-a=acme,org-b=globex",
    "--column",
    "subject=title",
    "--column",
    "opened_at=opened",
    "--batch-rows",
    "50",
    "--rows-per-second",
    "600",
];

async fn rows_done(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(rows_done), -1) FROM attachments WHERE host_table = 'app.tickets'")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn schema_dump(url: &str) -> String {
    let output = tokio::process::Command::new("pg_dump")
        .args(["--schema-only", "--restrict-key=exportd", url])
        .output()
        .await
        .expect("pg_dump runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn attached_tables_export_exactly_what_the_host_wrote_through_kills_and_concurrent_writers(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (alice, hank) = (app.token("acme", "alice"), app.token("globex", "hank"));
    let url = database_url(&app.pool).await;
    sqlx::raw_sql(HOST_SCHEMA).execute(&app.pool).await.unwrap();
    let before = schema_dump(&url).await;
    let cursor = app.cursor_now(&alice, "tickets").await;

    let host = PgPoolOptions::new().max_connections(8).connect(&url).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..8u64).map(|w| tokio::spawn(host_writer(host.clone(), stop.clone(), w))).collect();

    // The backfill runs as `exportd attach`, SIGKILLed twice, then run again to its end.
    for kill_after in [1500, 3500] {
        let mut attach = attach_command(&url, TICKETS).kill_on_drop(true).spawn().unwrap();
        let started = Instant::now();
        while rows_done(&app.pool).await < kill_after {
            assert!(started.elapsed() < Duration::from_secs(60), "the backfill did not reach {kill_after} rows");
            assert!(attach.try_wait().unwrap().is_none(), "attach ended early: {:?}", attach.wait_with_output().await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        attach.kill().await.unwrap(); // SIGKILL
    }
    // Meanwhile the dataset's exports and feeds wait for it, with a clear problem.
    let refused =
        app.create_export(&alice, Some("during-backfill"), &json!({"dataset": "tickets", "format": "jsonl"})).await;
    assert_eq!(refused.status(), 409);
    assert_eq!(problem(refused).await["code"], "backfill-running");
    let feed = app.get(Some(&alice), &format!("/v1/datasets/tickets/changes?cursor={cursor}")).await;
    assert_eq!(feed.status(), 409);
    // The tenant admin sees the progress.
    let list: Value = app.get(Some(&alice), "/v1/attachments").await.json().await.unwrap();
    let tickets = &list["attachments"][0];
    assert_eq!((tickets["dataset"].as_str(), tickets["state"].as_str()), (Some("tickets"), Some("backfilling")));
    // The estimate is the table's size when attach ran (the writers were already at work).
    let (done, estimate) = (tickets["rows_done"].as_i64().unwrap(), tickets["rows_estimate"].as_i64().unwrap());
    assert!(done >= 3500 && (5500..7000).contains(&estimate), "{tickets}");
    assert!(tickets["eta_seconds"].is_i64(), "{tickets}");
    assert_eq!(app.get(Some(&app.token("acme", "zenpartner")), "/v1/attachments").await.status(), 403);
    // So does the dashboard, beside the deliveries.
    let dashboard = app.get(Some(&alice), "/dashboard").await.text().await.unwrap();
    assert!(dashboard.contains(r#"data-attachment="tickets""#), "the attachment is on the dashboard");
    assert!(dashboard.contains(r#"data-attachment-state="backfilling""#));

    let finish = attach_command(&url, TICKETS).output().await.unwrap();
    assert!(finish.status.success(), "{}", String::from_utf8_lossy(&finish.stderr));
    let stdout = String::from_utf8_lossy(&finish.stdout);
    assert!(stdout.contains("backfill done"), "{stdout}");
    let contacts = attach_command(
        &url,
        &[
            "--table",
            "app.contacts",
            "--dataset",
            "contacts",
            "--tenant-column",
            "org",
            "--tenant-map",
            "org-a=acme",
            "--key",
            "org,num",
        ],
    )
    .output()
    .await
    .unwrap();
    assert!(contacts.status.success(), "{}", String::from_utf8_lossy(&contacts.stderr));
    // Attaching again is the same attachment; a different binding of the table is refused.
    let again = attach_command(&url, TICKETS).output().await.unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    let other = attach_command(&url, &["--table", "app.tickets", "--dataset", "tickets", "--tenant", "acme"])
        .output()
        .await
        .unwrap();
    assert!(!other.status.success());
    assert!(
        String::from_utf8_lossy(&other.stderr).contains("already attached"),
        "{}",
        String::from_utf8_lossy(&other.stderr)
    );

    let list: Value = app.get(Some(&hank), "/v1/attachments").await.json().await.unwrap();
    let states: Vec<(&str, &str)> = list["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["dataset"].as_str().unwrap(), a["state"].as_str().unwrap()))
        .collect();
    assert_eq!(states, [("tickets", "live")], "globex is fed by the tickets table only");
    let dashboard = app.get(Some(&hank), "/dashboard").await.text().await.unwrap();
    assert!(dashboard.contains(r#"data-attachment-state="live""#), "live on globex's dashboard");
    assert!(!dashboard.contains(r#"data-attachment="contacts""#), "acme's attachment is not globex's");

    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let mut committed = 0;
    for writer in writers {
        committed += writer.await.unwrap();
    }
    assert!(committed > 100, "{committed} host transactions committed");

    // Every tenant's export is its rows of the host tables, exactly.
    let expected_tickets = |org: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_as::<_, (String, Value)>(
                "SELECT id::text, jsonb_build_object('subject', title, 'status', status, 'priority', priority)
                 FROM app.tickets WHERE org = $1",
            )
            .bind(org)
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect::<BTreeMap<String, Value>>()
        }
    };
    let columns = ["subject", "status", "priority"];
    for (token, org) in [(&alice, "org-a"), (&hank, "org-b")] {
        let got = export_rows(&app, token, "tickets", &columns).await;
        let want = expected_tickets(org).await;
        assert_eq!(got.len(), want.len(), "{org}: rows");
        assert!(got == want, "{org}: the export differs from the host table");
        assert!(got.values().all(|row| row["subject"] != "ROLLED BACK"), "a rolled-back write was exported");
    }
    let contacts_want: BTreeMap<String, Value> = sqlx::query_as::<_, (String, Value)>(
        "SELECT jsonb_build_array(org, num)::text, jsonb_build_object('name', name, 'email', email)
         FROM app.contacts WHERE org = 'org-a'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert!(export_rows(&app, &alice, "contacts", &["name", "email"]).await == contacts_want, "contacts differ");

    // The feed from before the attachment, applied to nothing, gives the same rows.
    app.tick().await;
    app.pass_safety_delay();
    app.tick().await;
    let (changes, _) = app.pull_all(&alice, "tickets", &cursor, 1000).await;
    let mut applied = BTreeMap::new();
    for change in changes {
        let key = change["key"].as_str().unwrap().to_owned();
        match change["op"].as_str().unwrap() {
            "upsert" => {
                let row: BTreeMap<&str, Value> = columns.iter().map(|c| (*c, change["data"][c].clone())).collect();
                applied.insert(key, json!(row));
            }
            _ => {
                applied.remove(&key);
            }
        }
    }
    assert!(applied == expected_tickets("org-a").await, "the feed differs from the host table");

    // A host change that breaks the binding fails the host's write loudly, naming the column.
    let mut drift = app.pool.begin().await.unwrap();
    sqlx::query("ALTER TABLE app.tickets DROP COLUMN priority").execute(&mut *drift).await.unwrap();
    let refused = sqlx::query("UPDATE app.tickets SET status = 'x' WHERE id = (SELECT min(id) FROM app.tickets)")
        .execute(&mut *drift)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("priority"), "{refused}");
    drift.rollback().await.unwrap();
    // TRUNCATE deletes every record of the table.
    sqlx::query("TRUNCATE app.contacts").execute(&app.pool).await.unwrap();
    assert!(export_rows(&app, &alice, "contacts", &["name"]).await.is_empty(), "truncated contacts were exported");

    // Detach leaves the host's schema as it was before attach.
    for table in ["app.tickets", "app.contacts"] {
        let detach = Command::new(env!("CARGO_BIN_EXE_exportd"))
            .args(["detach", "--table", table])
            .env("DATABASE_URL", &url)
            .env("EXPORTD_TENANTS_DIR", fixture_tenants_dir())
            .output()
            .await
            .unwrap();
        assert!(detach.status.success(), "{}", String::from_utf8_lossy(&detach.stderr));
    }
    assert!(schema_dump(&url).await == before, "pg_dump --schema-only differs after detach");
    host.close().await;
}

/// A JSONL export's rows by key, with `columns` only.
async fn export_rows(app: &TestApp, token: &str, dataset: &str, columns: &[&str]) -> BTreeMap<String, Value> {
    let id = app.export(token, &json!({"dataset": dataset, "format": "jsonl"})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let body = app.get(Some(token), &format!("/v1/exports/{id}/file")).await.bytes().await.unwrap();
    let text = String::from_utf8(gunzip(&body)).unwrap();
    text.lines()
        .map(|line| {
            let row: Value = serde_json::from_str(line).unwrap();
            let picked: BTreeMap<&str, Value> = columns.iter().map(|c| (*c, row[c].clone())).collect();
            (row["id"].as_str().unwrap().to_owned(), json!(picked))
        })
        .collect()
}

/// A host writer: one or two statements a transaction — inserts, updates of fields, keys and
/// organizations, deletes, on tickets and contacts — one in five rolled back, until `stop`.
/// Deadlocks and key collisions between host writers are the host's business: rolled back and
/// counted out. Returns the transactions committed.
async fn host_writer(pool: PgPool, stop: Arc<AtomicBool>, writer: u64) -> u64 {
    let mut state = writer.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(7);
    let mut next = move |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let (mut committed, mut fresh) = (0, 0);
    while !stop.load(Ordering::SeqCst) {
        let mut tx = pool.begin().await.unwrap();
        let rollback = next(5) == 0;
        let title = if rollback { "ROLLED BACK".to_owned() } else { format!("w{writer} {}", next(10_000)) };
        let id = 1 + next(6000) as i64;
        let statement = match next(7) {
            0 => {
                fresh += 1;
                sqlx::query("INSERT INTO app.tickets (id, org, title, status) VALUES ($1, 'org-a', $2, 'new')")
                    .bind(10_000_000 + writer as i64 * 100_000 + fresh)
                    .bind(&title)
            }
            1 => sqlx::query("UPDATE app.tickets SET id = id + 5000000 WHERE id = $1").bind(id),
            // Moves among the first 600 tickets only: globex exports at most 1000 rows.
            2 => sqlx::query("UPDATE app.tickets SET org = CASE org WHEN 'org-a' THEN 'org-b' ELSE 'org-a' END, title = $2 WHERE id = $1")
                .bind(1 + next(600) as i64)
                .bind(&title),
            3 => sqlx::query("DELETE FROM app.tickets WHERE id = $1").bind(id),
            4 => sqlx::query("UPDATE app.contacts SET name = $2 WHERE org = 'org-a' AND num = $1")
                .bind(1 + next(800) as i32)
                .bind(&title),
            5 => sqlx::query("DELETE FROM app.contacts WHERE org = 'org-a' AND num = $1").bind(1 + next(800) as i32),
            _ => sqlx::query("UPDATE app.tickets SET title = $2, status = 'updated', priority = priority + 1 WHERE id = $1")
                .bind(id)
                .bind(&title),
        };
        match statement.execute(&mut *tx).await {
            Ok(_) if rollback => tx.rollback().await.unwrap(),
            Ok(_) => {
                tx.commit().await.unwrap();
                committed += 1;
            }
            Err(e) => {
                let code = e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
                assert!(
                    matches!(code.as_deref(), Some("40P01" | "23505")),
                    "a host write failed for another reason than the host's own conflicts: {e}"
                );
                tx.rollback().await.unwrap();
            }
        }
    }
    committed
}

/// Every mistake in a binding is refused before anything changes, naming the table or column
/// and what is wrong.
#[sqlx::test(migrations = "./migrations")]
async fn a_wrong_binding_is_refused_naming_what_is_wrong(pool: PgPool) {
    use exportd::attach::{Spec, TenantRule};
    let app = TestApp::spawn(pool).await;
    sqlx::raw_sql(
        "CREATE SCHEMA app;
         CREATE TABLE app.t (id bigint PRIMARY KEY, code text, title text NOT NULL, status text NOT NULL, priority text);
         CREATE TABLE app.loose (id bigint, title text, status text);",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let spec = |table: &str, dataset: &str, tenant: &str, key: &[&str], columns: &[(&str, &str)]| Spec {
        table: table.into(),
        dataset: dataset.into(),
        key: key.iter().map(|k| k.to_string()).collect(),
        tenant: TenantRule::Fixed(tenant.into()),
        columns: columns.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        source: None,
    };
    let title = ("subject", "title");
    let text_priority = ("priority", "NULL::int");
    let cases = [
        (spec("app.missing", "tickets", "acme", &[], &[title]), "table `app.missing`: no such table"),
        (spec("app.t\"; DROP TABLE app.t; --", "tickets", "acme", &[], &[title]), "not a table name"),
        (spec("app.loose", "tickets", "acme", &[], &[title]), "has no primary key"),
        (spec("app.t", "tickets", "acme", &["code"], &[title, text_priority]), "column `code` of `app.t` may be NULL"),
        (spec("app.t", "tickets", "acme", &["id", "status"], &[title, text_priority]), "no unique index"),
        (spec("app.t", "tickets", "acme", &[], &[text_priority]), "dataset column `subject` is required"),
        (
            spec("app.t", "tickets", "acme", &[], &[title]),
            "dataset column `priority` (integer) from `\"priority\"` of type text",
        ),
        (
            spec("app.t", "tickets", "acme", &[], &[("subject", "nosuch(title)"), text_priority]),
            "--column expressions over `app.t`",
        ),
        (
            spec("app.t", "tickets", "acme", &[], &[title, text_priority, ("nosuch", "title")]),
            "dataset `tickets` has no column `nosuch`",
        ),
        (spec("app.t", "contacts", "globex", &[], &[]), "tenant `globex` has no dataset `contacts`"),
        (spec("app.t", "tickets", "nobody", &[], &[title, text_priority]), "tenant `nobody`: no such tenant"),
    ];
    for (spec, expected) in cases {
        let refused = exportd::attach::attach(&app.pool, &app.registry, &spec).await.unwrap_err().to_string();
        assert!(refused.contains(expected), "{spec:?}: {refused}");
    }
    let (attachments, triggers): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM attachments),
                (SELECT count(*) FROM pg_trigger WHERE tgrelid IN ('app.t'::regclass, 'app.loose'::regclass))",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((attachments, triggers), (0, 0), "a refused binding changed nothing");
    // The same table with a right binding attaches.
    let good = spec("app.t", "tickets", "acme", &[], &[title, text_priority]);
    let attached = exportd::attach::attach(&app.pool, &app.registry, &good).await.unwrap();
    assert_eq!((attached.dataset.as_str(), attached.state.as_str()), ("tickets", "backfilling"));
}

#[sqlx::test(migrations = "./migrations")]
async fn a_writer_whose_search_path_shadows_exportd_functions_still_reaches_the_record_store(pool: PgPool) {
    use exportd::attach::{Spec, TenantRule};
    let app = TestApp::spawn(pool).await;
    sqlx::raw_sql(
        "CREATE SCHEMA app;
         CREATE TABLE app.t (id bigint PRIMARY KEY, title text NOT NULL, status text NOT NULL);
         CREATE SCHEMA shadow;
         CREATE FUNCTION shadow.exportd_upsert(text, text, text, jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
         CREATE FUNCTION shadow.exportd_capture_delete(text, text, text) RETURNS void LANGUAGE sql AS 'SELECT';",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let spec = Spec {
        table: "app.t".into(),
        dataset: "tickets".into(),
        key: vec![],
        tenant: TenantRule::Fixed("acme".into()),
        columns: [("subject".into(), "title".into()), ("status".into(), "status".into())].into(),
        source: None,
    };
    exportd::attach::attach(&app.pool, &app.registry, &spec).await.unwrap();
    // A writer whose path puts the look-alike functions first.
    let url = database_url(&app.pool).await;
    let writer = PgPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
    sqlx::raw_sql(
        "SET search_path = shadow, public;
         INSERT INTO app.t VALUES (1, 'one', 'open'), (2, 'two', 'open');
         DELETE FROM app.t WHERE id = 2;",
    )
    .execute(&writer)
    .await
    .unwrap();
    let heads: Vec<(String, bool)> = sqlx::query_as(
        "SELECT h.key, v.data IS NULL FROM record_heads h JOIN record_versions v ON v.id = h.version_id
          WHERE h.tenant = 'acme' AND h.dataset = 'tickets' AND h.key IN ('1', '2') ORDER BY h.key",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(heads, vec![("1".to_owned(), false), ("2".to_owned(), true)], "both writes reached the record store");
    // Every PL/pgSQL function exportd ships or generates runs with a fixed search_path.
    let unpinned: Vec<String> = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
          WHERE p.proname LIKE 'exportd\\_%' AND l.lanname = 'plpgsql'
            AND NOT coalesce(p.proconfig::text LIKE '%search_path=%', false)",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(unpinned, Vec::<String>::new(), "functions without a fixed search_path");
}

/// The host of log capture: its own PostgreSQL (`wal_level = logical`), tickets of two
/// organizations, one in ten with a body large enough to be TOASTed (random hex does not
/// compress), and a title that may be NULL (the dataset requires a subject).
const LOG_HOST_SCHEMA: &str = "
    CREATE SCHEMA app;
    CREATE TABLE app.tickets (id bigint PRIMARY KEY, org text NOT NULL, title text, status text NOT NULL,
                              priority int, body text);
    INSERT INTO app.tickets (id, org, title, status, priority, body)
        SELECT i, CASE WHEN i % 20 = 0 THEN 'org-b' ELSE 'org-a' END, 'ticket ' || i, 'open', i % 5,
               CASE WHEN i % 10 = 0 THEN (SELECT string_agg(md5(i::text || g::text), '') FROM generate_series(1, 150) g)
                    ELSE 'short ' || i END
        FROM generate_series(1, 3000) i;";

fn log_binding(source: &str) -> Vec<String> {
    [
        "--source",
        source,
        "--table",
        "app.tickets",
        "--dataset",
        "tickets",
        "--tenant-column",
        "org",
        "--tenant-map",
        "org-a=acme,org-b=globex",
        "--column",
        "subject=title",
        "--batch-rows",
        "50",
        "--rows-per-second",
        "3000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Follows every log attachment until nothing is left to apply and the slot has caught up
/// with the host's WAL.
async fn follow_to_the_end(app: &TestApp, host: &PgPool) {
    let options = exportd::attach::log::FollowOptions::default();
    let started = Instant::now();
    loop {
        let target: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(host).await.unwrap();
        exportd::attach::log::follow_all(&app.pool, &app.registry, options).await.unwrap();
        let (caught_up, state): (Option<bool>, Value) = sqlx::query_as(
            "SELECT bool_and(applied_lsn >= $1::pg_lsn),
                    jsonb_agg(jsonb_build_object('state', state, 'error', last_error, 'lost', lost_reason))
             FROM attachments WHERE capture = 'log'",
        )
        .bind(&target)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if caught_up == Some(true) {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "the follower did not catch up with {target}: {state}");
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn a_table_of_another_postgresql_is_followed_from_its_log_exactly_and_its_writes_never_fail(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (alice, hank) = (app.token("acme", "alice"), app.token("globex", "hank"));
    let url = database_url(&app.pool).await;
    let node = crate::common::replication::Node::logical();
    let mut admin = node.connect("postgres").await;
    sqlx::raw_sql("CREATE DATABASE shop").execute(&mut admin).await.unwrap();
    let source = node.url("shop");
    let host = PgPoolOptions::new().max_connections(10).connect(&source).await.unwrap();
    sqlx::raw_sql(LOG_HOST_SCHEMA).execute(&host).await.unwrap();
    let before = schema_dump(&source).await;
    let cursor = app.cursor_now(&alice, "tickets").await;
    let binding = log_binding(&source);
    let binding: Vec<&str> = binding.iter().map(String::as_str).collect();

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..8u64).map(|w| tokio::spawn(log_host_writer(host.clone(), stop.clone(), w))).collect();
    // The copy runs as `exportd attach`, SIGKILLed once, then run again to its end.
    let mut attach = attach_command(&url, &binding).kill_on_drop(true).spawn().unwrap();
    let started = Instant::now();
    while rows_done(&app.pool).await < 1000 {
        assert!(started.elapsed() < Duration::from_secs(60), "the copy did not reach 1000 rows");
        assert!(attach.try_wait().unwrap().is_none(), "attach ended early: {:?}", attach.wait_with_output().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    attach.kill().await.unwrap();
    let refused =
        app.create_export(&alice, Some("during-copy"), &json!({"dataset": "tickets", "format": "jsonl"})).await;
    assert_eq!(problem(refused).await["code"], "backfill-running");
    let finish = attach_command(&url, &binding).output().await.unwrap();
    assert!(finish.status.success(), "{}", String::from_utf8_lossy(&finish.stderr));
    assert!(String::from_utf8_lossy(&finish.stdout).contains("applies the host's changes"));

    // The stream is applied by `exportd worker` processes, three SIGKILLed mid-stream while the
    // host writes — among its writes one transaction larger than logical_decoding_work_mem.
    let log = app.data_dir.path().join("worker.log");
    for round in 0..3 {
        let mut worker = crate::common::processes::spawn_worker(&url, app.data_dir.path(), &log, 1, "5s");
        let applied_before = applied_lsn(&app.pool).await;
        let started = Instant::now();
        while applied_lsn(&app.pool).await == applied_before {
            assert!(started.elapsed() < Duration::from_secs(60), "the worker applied nothing");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if round == 1 {
            large_transaction(&host).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        worker.kill().unwrap(); // SIGKILL
        worker.wait().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let mut committed = 0;
    for writer in writers {
        committed += writer.await.unwrap();
    }
    assert!(committed > 100, "{committed} host transactions committed");
    // The host restarts; the slot and the applied position carry on.
    node.restart();
    follow_to_the_end(&app, &host).await;

    // Every tenant's export is its rows of the host table, exactly — TOASTed bodies whole.
    let expected = |org: &'static str| {
        let host = host.clone();
        async move {
            sqlx::query_as::<_, (String, Value)>(
                "SELECT id::text, jsonb_build_object('subject', title, 'status', status, 'priority', priority, 'body', body)
                 FROM app.tickets WHERE org = $1",
            )
            .bind(org)
            .fetch_all(&host)
            .await
            .unwrap()
            .into_iter()
            .collect::<BTreeMap<String, Value>>()
        }
    };
    let columns = ["subject", "status", "priority", "body"];
    for (token, org) in [(&alice, "org-a"), (&hank, "org-b")] {
        let got = export_rows(&app, token, "tickets", &columns).await;
        let want = expected(org).await;
        assert_eq!(got.len(), want.len(), "{org}: rows");
        let differ: Vec<&String> = want.keys().filter(|k| got.get(*k) != want.get(*k)).take(5).collect();
        assert!(differ.is_empty(), "{org}: the export differs from the host table at {differ:?}");
        assert!(got.values().all(|row| row["subject"] != "ROLLED BACK"), "a rolled-back write was exported");
        assert!(got.values().any(|row| row["body"].as_str().is_some_and(|b| b.len() > 4000)), "TOASTed bodies");
    }
    // The feed from before the attachment, applied to nothing, gives the same rows.
    app.tick().await;
    app.pass_safety_delay();
    app.tick().await;
    let (changes, _) = app.pull_all(&alice, "tickets", &cursor, 1000).await;
    let mut applied = BTreeMap::new();
    for change in changes {
        let key = change["key"].as_str().unwrap().to_owned();
        match change["op"].as_str().unwrap() {
            "upsert" => {
                let row: BTreeMap<&str, Value> = columns.iter().map(|c| (*c, change["data"][c].clone())).collect();
                applied.insert(key, json!(row));
            }
            _ => {
                applied.remove(&key);
            }
        }
    }
    assert!(applied == expected("org-a").await, "the feed differs from the host table");
    // Each host change was applied once: no record ever went back to an older state (host
    // writers only ever raise a row's priority, so a change applied again after the copy had a
    // newer state would show as a priority going down in the record's history).
    let backwards: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT (data->>'priority')::int AS p, lag((data->>'priority')::int) OVER (PARTITION BY tenant, key ORDER BY id) AS before
             FROM record_versions WHERE dataset = 'tickets' AND data IS NOT NULL) v
         WHERE p < before",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(backwards, 0, "a record went back to an older state: a change was applied twice");

    // A row the dataset refuses (no subject) is the host's to write: it is quarantined, kept out
    // of exports, and said so — never its value.
    sqlx::query("INSERT INTO app.tickets (id, org, title, status, body) VALUES (42000000, 'org-a', NULL, 'open', 'secret body')")
        .execute(&host)
        .await
        .unwrap();
    follow_to_the_end(&app, &host).await;
    assert!(!export_rows(&app, &alice, "tickets", &["subject"]).await.contains_key("42000000"));
    let list: Value = app.get(Some(&alice), "/v1/attachments").await.json().await.unwrap();
    let tickets = &list["attachments"][0];
    assert_eq!((tickets["capture"].as_str(), tickets["state"].as_str()), (Some("log"), Some("live")), "{tickets}");
    assert_eq!(tickets["quarantined"], 1, "{tickets}");
    assert!(tickets["lag_bytes"].is_i64() && tickets["retained_wal_bytes"].is_i64(), "{tickets}");
    assert!(!list.to_string().contains("secret body") && !list.to_string().contains(&source));
    let quarantined: (String, String) =
        sqlx::query_as("SELECT key, field FROM attachment_quarantine").fetch_one(&app.pool).await.unwrap();
    assert_eq!(quarantined, ("42000000".into(), "data.subject".into()));
    let announced: Value =
        sqlx::query_scalar("SELECT data FROM webhook_events WHERE type = 'attachment.quarantined' AND tenant = 'acme'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((announced["new"].as_i64(), announced["rows"][0]["key"].as_str()), (Some(1), Some("42000000")));
    assert!(!announced.to_string().contains("secret body"), "{announced}");
    // Fixed on the host, it is exported and leaves the quarantine.
    sqlx::query("UPDATE app.tickets SET title = 'fixed' WHERE id = 42000000").execute(&host).await.unwrap();
    follow_to_the_end(&app, &host).await;
    assert_eq!(export_rows(&app, &alice, "tickets", &["subject"]).await["42000000"]["subject"], "fixed");
    let list: Value = app.get(Some(&alice), "/v1/attachments").await.json().await.unwrap();
    assert_eq!(list["attachments"][0]["quarantined"], 0);

    // TRUNCATE deletes every record of the table; rows written after it are there.
    sqlx::raw_sql(
        "BEGIN; TRUNCATE app.tickets;
         INSERT INTO app.tickets (id, org, title, status) VALUES (1, 'org-a', 'after', 'open'), (2, 'org-b', 'after', 'open');
         COMMIT;",
    )
    .execute(&host)
    .await
    .unwrap();
    follow_to_the_end(&app, &host).await;
    let left = export_rows(&app, &alice, "tickets", &["subject"]).await;
    assert_eq!(left.keys().collect::<Vec<_>>(), ["1"], "acme's rows after the TRUNCATE");

    // Detach removes the slot and the publication; the host's schema is as before.
    let detach = Command::new(env!("CARGO_BIN_EXE_exportd"))
        .args(["detach", "--table", "app.tickets", "--source", &source])
        .env("DATABASE_URL", &url)
        .env("EXPORTD_TENANTS_DIR", fixture_tenants_dir())
        .output()
        .await
        .unwrap();
    assert!(detach.status.success(), "{}", String::from_utf8_lossy(&detach.stderr));
    let leftovers: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pg_replication_slots) + (SELECT count(*) FROM pg_publication)",
    )
    .fetch_one(&host)
    .await
    .unwrap();
    assert_eq!(leftovers, 0, "a slot or publication left on the host");
    assert!(schema_dump(&source).await == before, "pg_dump --schema-only differs after detach");
    host.close().await;
}

async fn applied_lsn(pool: &PgPool) -> Option<String> {
    sqlx::query_scalar("SELECT applied_lsn::text FROM attachments WHERE capture = 'log'").fetch_one(pool).await.unwrap()
}

/// One host transaction that updates every other ticket (far more than the host's 64 kB of
/// logical_decoding_work_mem), tried again when it deadlocks with the writers.
async fn large_transaction(host: &PgPool) {
    loop {
        match sqlx::query("UPDATE app.tickets SET status = 'bulk' WHERE id % 2 = 0").execute(host).await {
            Ok(done) => {
                assert!(done.rows_affected() > 1000);
                return;
            }
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("40P01") => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

/// A host writer of log capture: inserts, updates of small columns (leaving TOASTed bodies
/// unchanged), of bodies, of keys and organizations, deletes, one in five rolled back, until
/// `stop`. No statement may fail for a reason of exportd's. Returns the transactions committed.
async fn log_host_writer(pool: PgPool, stop: Arc<AtomicBool>, writer: u64) -> u64 {
    let mut state = writer.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(11);
    let mut next = move |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let (mut committed, mut fresh) = (0, 0);
    while !stop.load(Ordering::SeqCst) {
        let mut tx = pool.begin().await.unwrap();
        let rollback = next(5) == 0;
        let title = if rollback { "ROLLED BACK".to_owned() } else { format!("w{writer} {}", next(10_000)) };
        let id = 1 + next(3000) as i64;
        let statement = match next(7) {
            0 => {
                fresh += 1;
                sqlx::query("INSERT INTO app.tickets (id, org, title, status, body) VALUES ($1, 'org-a', $2, 'new', repeat(md5($2), 100))")
                    .bind(10_000_000 + writer as i64 * 100_000 + fresh)
                    .bind(&title)
            }
            1 => sqlx::query("UPDATE app.tickets SET id = id + 5000000, status = 'moved' WHERE id = $1").bind(id),
            2 => sqlx::query("UPDATE app.tickets SET org = CASE org WHEN 'org-a' THEN 'org-b' ELSE 'org-a' END, title = $2 WHERE id = $1")
                .bind(1 + next(600) as i64)
                .bind(&title),
            3 => sqlx::query("DELETE FROM app.tickets WHERE id = $1").bind(id),
            4 => sqlx::query("UPDATE app.tickets SET body = (SELECT string_agg(md5($2 || g::text), '') FROM generate_series(1, 120) g) WHERE id = $1")
                .bind(id)
                .bind(&title),
            _ => sqlx::query("UPDATE app.tickets SET title = $2, status = 'updated', priority = priority + 1 WHERE id = $1")
                .bind(id)
                .bind(&title),
        };
        match statement.execute(&mut *tx).await {
            Ok(_) if rollback => tx.rollback().await.unwrap(),
            Ok(_) => {
                tx.commit().await.unwrap();
                committed += 1;
            }
            Err(e) => {
                let code = e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
                assert!(matches!(code.as_deref(), Some("40P01" | "23505")), "a host write failed: {e}");
                tx.rollback().await.unwrap();
            }
        }
    }
    committed
}

/// A slot the host invalidates (its `max_slot_wal_keep_size` reached while changes went
/// unread) makes the attachment `lost`: exports and feeds of the dataset are refused, never
/// silently missing those changes, until `--resync` copies the table again.
#[sqlx::test(migrations = "./migrations")]
async fn a_slot_the_host_invalidates_makes_the_attachment_lost_until_a_resync_copies_the_table_again(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let alice = app.token("acme", "alice");
    let url = database_url(&app.pool).await;
    let node = crate::common::replication::Node::logical();
    let mut admin = node.connect("postgres").await;
    sqlx::raw_sql("CREATE DATABASE shop").execute(&mut admin).await.unwrap();
    let source = node.url("shop");
    let host = PgPoolOptions::new().max_connections(4).connect(&source).await.unwrap();
    sqlx::raw_sql(LOG_HOST_SCHEMA).execute(&host).await.unwrap();
    let binding = log_binding(&source);
    let mut binding: Vec<&str> = binding.iter().map(String::as_str).collect();
    let attach = attach_command(&url, &binding).output().await.unwrap();
    assert!(attach.status.success(), "{}", String::from_utf8_lossy(&attach.stderr));
    follow_to_the_end(&app, &host).await;
    let host_rows = |org: &'static str| {
        let host = host.clone();
        async move {
            sqlx::query_as::<_, (String, Value)>(
                "SELECT id::text, jsonb_build_object('subject', title) FROM app.tickets WHERE org = $1",
            )
            .bind(org)
            .fetch_all(&host)
            .await
            .unwrap()
            .into_iter()
            .collect::<BTreeMap<String, Value>>()
        }
    };
    assert!(export_rows(&app, &alice, "tickets", &["subject"]).await == host_rows("org-a").await);

    // The host caps the WAL a slot may keep; changes are made that nobody reads, and more WAL
    // than the cap is written and checkpointed away.
    for statement in ["ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'", "SELECT pg_reload_conf()"] {
        sqlx::query(statement).execute(&mut admin).await.unwrap();
    }
    sqlx::query("CREATE TABLE app.noise (n int)").execute(&host).await.unwrap();
    sqlx::raw_sql("DELETE FROM app.tickets WHERE id <= 10; UPDATE app.tickets SET title = 'while lost' WHERE id BETWEEN 11 AND 15")
        .execute(&host)
        .await
        .unwrap();
    let started = Instant::now();
    loop {
        for statement in ["INSERT INTO app.noise VALUES (1)", "SELECT pg_switch_wal()", "CHECKPOINT"] {
            sqlx::query(statement).execute(&host).await.unwrap();
        }
        let status: Option<String> =
            sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots").fetch_one(&host).await.unwrap();
        if status.as_deref() == Some("lost") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the host did not invalidate the slot: {status:?}");
    }
    exportd::attach::log::follow_all(&app.pool, &app.registry, Default::default()).await.unwrap();
    let list: Value = app.get(Some(&alice), "/v1/attachments").await.json().await.unwrap();
    let tickets = &list["attachments"][0];
    assert_eq!(tickets["state"], "lost", "{tickets}");
    assert!(tickets["lost_reason"].as_str().unwrap().contains("max_slot_wal_keep_size"), "{tickets}");
    let lost: Vec<String> =
        sqlx::query_scalar("SELECT tenant FROM webhook_events WHERE type = 'attachment.lost' ORDER BY tenant")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(lost, ["acme", "globex"], "announced to each tenant the table feeds");
    let refused =
        app.create_export(&alice, Some("while-lost"), &json!({"dataset": "tickets", "format": "jsonl"})).await;
    assert_eq!(refused.status(), 409);
    assert_eq!(problem(refused).await["code"], "capture-lost");
    let cursor = app.cursor_now(&alice, "tickets").await;
    let feed = app.get(Some(&alice), &format!("/v1/datasets/tickets/changes?cursor={cursor}")).await;
    assert_eq!(feed.status(), 409);
    assert_eq!(problem(feed).await["code"], "capture-lost");

    // A resync: a new slot, the table copied again; rows gone since are deleted.
    for statement in ["ALTER SYSTEM RESET max_slot_wal_keep_size", "SELECT pg_reload_conf()"] {
        sqlx::query(statement).execute(&mut admin).await.unwrap();
    }
    binding.push("--resync");
    let resync = attach_command(&url, &binding).output().await.unwrap();
    assert!(resync.status.success(), "{}", String::from_utf8_lossy(&resync.stderr));
    let got = export_rows(&app, &alice, "tickets", &["subject"]).await;
    assert!(got == host_rows("org-a").await, "the export after the resync differs from the host");
    assert!(!got.contains_key("3") && got["12"]["subject"] == "while lost");
    // And it is followed again.
    sqlx::query("UPDATE app.tickets SET title = 'after resync' WHERE id = 21").execute(&host).await.unwrap();
    follow_to_the_end(&app, &host).await;
    assert_eq!(export_rows(&app, &alice, "tickets", &["subject"]).await["21"]["subject"], "after resync");
    host.close().await;
}

/// Trigger capture quarantines too: a row the dataset refuses is written by the host (no EXD01),
/// kept out of exports and listed; fixed, it is exported and leaves the quarantine.
#[sqlx::test(migrations = "./migrations")]
async fn with_trigger_capture_a_refused_row_is_quarantined_and_the_host_write_succeeds(pool: PgPool) {
    use exportd::attach::{Spec, TenantRule};
    let app = TestApp::spawn(pool).await;
    let alice = app.token("acme", "alice");
    sqlx::raw_sql(
        "CREATE SCHEMA app;
         CREATE TABLE app.t (id bigint PRIMARY KEY, title text, status text NOT NULL);
         INSERT INTO app.t VALUES (1, 'one', 'open'), (2, 'two', 'open');",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let spec = Spec {
        table: "app.t".into(),
        dataset: "tickets".into(),
        key: vec![],
        tenant: TenantRule::Fixed("acme".into()),
        columns: [("subject".into(), "title".into())].into(),
        source: None,
    };
    let attachment = exportd::attach::attach(&app.pool, &app.registry, &spec).await.unwrap();
    exportd::attach::backfill(&app.pool, &app.registry, &attachment, Default::default(), |_| {}).await.unwrap();
    // The dataset requires a subject: the host writes a row without one, and an update that
    // takes an exported row's away.
    sqlx::query("INSERT INTO app.t VALUES (3, NULL, 'open')").execute(&app.pool).await.unwrap();
    sqlx::query("UPDATE app.t SET title = NULL WHERE id = 1").execute(&app.pool).await.unwrap();
    let rows = export_rows(&app, &alice, "tickets", &["subject"]).await;
    assert_eq!(rows.keys().collect::<Vec<_>>(), ["2"], "refused rows are kept out, the stale version too");
    let list: Value = app.get(Some(&alice), "/v1/attachments").await.json().await.unwrap();
    assert_eq!(list["attachments"][0]["quarantined"], 2, "{list}");
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events WHERE type = 'attachment.quarantined'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(events, 2);
    sqlx::query("UPDATE app.t SET title = 'fixed' WHERE id IN (1, 3)").execute(&app.pool).await.unwrap();
    let rows = export_rows(&app, &alice, "tickets", &["subject"]).await;
    assert_eq!(rows.keys().collect::<Vec<_>>(), ["1", "2", "3"]);
    let list: Value = app.get(Some(&alice), "/v1/attachments").await.json().await.unwrap();
    assert_eq!(list["attachments"][0]["quarantined"], 0);
}
