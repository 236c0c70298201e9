//! Incremental feeds: every committed change exactly once, whatever the commit order.

use std::collections::BTreeMap;

use crate::common::{TestApp, problem};
use exportd::jobs::Step;
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};

pub(crate) async fn upsert(conn: &mut PgConnection, key: &str, subject: &str, region: &str) {
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, $2)")
        .bind(key)
        .bind(json!({"subject": subject, "status": "open", "region": region}))
        .execute(conn)
        .await
        .unwrap();
}

pub(crate) async fn delete(conn: &mut PgConnection, key: &str) {
    sqlx::query("SELECT exportd_delete('acme', 'tickets', $1)").bind(key).execute(conn).await.unwrap();
}

/// Seals a window: a tick, then the server clock past the safety delay.
pub(crate) async fn seal(app: &TestApp) {
    app.tick().await;
    app.pass_safety_delay();
}

fn ops(changes: &[Value]) -> Vec<(String, String)> {
    changes.iter().map(|c| (c["op"].as_str().unwrap().to_owned(), c["key"].as_str().unwrap().to_owned())).collect()
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

/// Applies changes in order, as a partner would.
pub(crate) fn apply(state: &mut BTreeMap<String, Value>, changes: &[Value]) {
    for change in changes {
        let key = change["key"].as_str().unwrap().to_owned();
        match change["op"].as_str().unwrap() {
            "upsert" => {
                state.insert(key, change["data"].clone());
            }
            _ => {
                state.remove(&key);
            }
        }
    }
}

pub(crate) async fn committed_state(pool: &PgPool) -> BTreeMap<String, Value> {
    let rows: Vec<(String, Value)> = sqlx::query_as(
        "SELECT key, data FROM record_versions WHERE tenant = 'acme' AND dataset = 'tickets' AND closed_xid IS NULL AND data IS NOT NULL",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter().collect()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_writer_that_commits_after_a_later_one_is_delivered_exactly_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let start = app.cursor_now(&token, "tickets").await;

    let mut a = app.pool.acquire().await.unwrap();
    let mut tx_a = a.begin().await.unwrap();
    upsert(&mut tx_a, "a", "from A", "emea").await;
    upsert(&mut app.pool.acquire().await.unwrap(), "b", "from B", "emea").await;
    seal(&app).await;
    let (first, cursor) = app.pull_all(&token, "tickets", &start, 100).await;
    assert_eq!(ops(&first), pairs(&[("upsert", "b")]), "A is still open: not in this window");

    tx_a.commit().await.unwrap();
    seal(&app).await;
    let (second, cursor) = app.pull_all(&token, "tickets", &cursor, 100).await;
    assert_eq!(ops(&second), pairs(&[("upsert", "a")]));
    assert_eq!(second[0]["data"]["subject"], "from A");
    seal(&app).await;
    let (third, _) = app.pull_all(&token, "tickets", &cursor, 100).await;
    assert!(third.is_empty(), "nothing twice");
}

#[sqlx::test(migrations = "./migrations")]
async fn long_transactions_span_windows_and_aborted_ones_never_appear(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let mut cursor = app.cursor_now(&token, "tickets").await;
    let mut long = app.pool.acquire().await.unwrap();
    let mut tx_long = long.begin().await.unwrap();
    upsert(&mut tx_long, "long", "spans ticks", "emea").await;
    let mut aborted = app.pool.acquire().await.unwrap();
    let mut tx_aborted = aborted.begin().await.unwrap();
    upsert(&mut tx_aborted, "ghost", "never", "emea").await;

    let mut seen = Vec::new();
    for round in 0..4 {
        upsert(&mut app.pool.acquire().await.unwrap(), &format!("k{round}"), "quick", "emea").await;
        seal(&app).await;
        let (changes, next) = app.pull_all(&token, "tickets", &cursor, 100).await;
        seen.extend(ops(&changes));
        cursor = next;
    }
    tx_aborted.rollback().await.unwrap();
    tx_long.commit().await.unwrap();
    seal(&app).await;
    let (changes, _) = app.pull_all(&token, "tickets", &cursor, 100).await;
    seen.extend(ops(&changes));
    assert_eq!(
        seen,
        pairs(&[("upsert", "k0"), ("upsert", "k1"), ("upsert", "k2"), ("upsert", "k3"), ("upsert", "long")])
    );
}

#[sqlx::test(migrations = "./migrations")]
async fn many_concurrent_writers_add_up_to_the_final_state(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let mut cursor = app.cursor_now(&token, "tickets").await;
    let mut partner = BTreeMap::new();
    let mut deliveries = 0usize;
    let mut committed_writes = 0usize;
    // A deterministic pseudo-random schedule (xorshift) of four writers over twelve keys.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for round in 0..25 {
        // Three writers on distinct keys, open at once, ending in a random order (a fifth abort),
        // with ticks falling between their commits.
        let mut keys: Vec<String> = Vec::new();
        while keys.len() < 3 {
            let key = format!("k{:02}", next(12));
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        let mut open = Vec::new();
        for key in &keys {
            let mut tx = app.pool.begin().await.unwrap();
            if next(4) == 0 {
                delete(&mut tx, key).await;
            } else {
                upsert(&mut tx, key, &format!("round {round}"), if next(2) == 0 { "emea" } else { "apac" }).await;
            }
            open.push(tx);
        }
        while !open.is_empty() {
            let tx = open.remove(next(open.len() as u64) as usize);
            if next(5) == 0 {
                tx.rollback().await.unwrap();
            } else {
                tx.commit().await.unwrap();
                committed_writes += 1;
            }
            if next(2) == 0 {
                app.tick().await;
            }
        }
        if next(3) == 0 {
            continue; // sometimes read later, over several windows at once
        }
        seal(&app).await;
        let (changes, next_cursor) = app.pull_all(&token, "tickets", &cursor, 2).await;
        deliveries += changes.len();
        apply(&mut partner, &changes);
        cursor = next_cursor;
    }
    seal(&app).await;
    let (changes, _) = app.pull_all(&token, "tickets", &cursor, 2).await;
    deliveries += changes.len();
    apply(&mut partner, &changes);
    assert_eq!(partner, committed_state(&app.pool).await);
    assert!(deliveries <= committed_writes, "{deliveries} deliveries for {committed_writes} committed writes");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_full_export_and_its_feed_together_are_every_change_exactly_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    app.seed("acme", "tickets", 50).await;
    let mut writer = app.pool.acquire().await.unwrap();
    let mut open = writer.begin().await.unwrap();
    upsert(&mut open, "tickets-000000003", "changed while the export was created", "emea").await;
    let id = app.export(&token, &json!({"dataset": "tickets", "format": "jsonl", "shard_rows": 20})).await;
    open.commit().await.unwrap();
    let mut conn = app.pool.acquire().await.unwrap();
    delete(&mut conn, "tickets-000000004").await;
    upsert(&mut conn, "new-after-export", "new", "emea").await;
    assert_eq!(app.drain().await, vec![Step::Published]);

    let manifest: Value = app.get(Some(&token), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    let mut state = BTreeMap::new();
    for shard in app.own_shard_files(&id).await {
        for line in String::from_utf8(crate::common::gunzip(&shard)).unwrap().lines() {
            let mut row: serde_json::Map<String, Value> = serde_json::from_str(line).unwrap();
            let key = row.remove("id").unwrap().as_str().unwrap().to_owned();
            row.retain(|_, v| !v.is_null());
            state.insert(key, Value::Object(row));
        }
    }
    seal(&app).await;
    let (changes, _) = app.pull_all(&token, "tickets", manifest["next_cursor"].as_str().unwrap(), 7).await;
    assert_eq!(
        ops(&changes),
        pairs(&[("upsert", "new-after-export"), ("upsert", "tickets-000000003"), ("delete", "tickets-000000004")])
    );
    apply(&mut state, &changes);
    let mut expected = committed_state(&app.pool).await;
    for value in expected.values_mut() {
        value.as_object_mut().unwrap().retain(|_, v| !v.is_null());
    }
    for value in state.values_mut() {
        value.as_object_mut().unwrap().retain(|_, v| !v.is_null());
    }
    assert_eq!(state, expected);
}

#[sqlx::test(migrations = "./migrations")]
async fn changes_newer_than_the_safety_delay_wait(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let cursor = app.cursor_now(&token, "tickets").await;
    upsert(&mut app.pool.acquire().await.unwrap(), "fresh", "fresh", "emea").await;
    app.tick().await;
    let page = app.pull(&token, "tickets", &cursor, 100).await;
    assert_eq!(page["changes"], json!([]));
    assert_eq!(page["end_of_stream"], true);
    assert!(page["retry_after_seconds"].as_u64().unwrap() >= 1);
    assert_eq!(page["next_cursor"], cursor.as_str(), "nothing consumed");
    app.pass_safety_delay();
    let page = app.pull(&token, "tickets", &cursor, 100).await;
    assert_eq!(ops(page["changes"].as_array().unwrap()), pairs(&[("upsert", "fresh")]));
}

#[sqlx::test(migrations = "./migrations")]
async fn deletes_are_tombstones_and_row_filters_turn_into_enter_and_leave(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let partner = app.token("acme", "zenpartner"); // row filter: region = emea
    let mut conn = app.pool.acquire().await.unwrap();
    for key in ["gone", "updated-then-gone", "leaves", "enters"] {
        upsert(&mut conn, key, "before", if key == "enters" { "apac" } else { "emea" }).await;
    }
    let (admin_start, partner_start) =
        (app.cursor_now(&admin, "tickets").await, app.cursor_now(&partner, "tickets").await);
    delete(&mut conn, "gone").await;
    upsert(&mut conn, "updated-then-gone", "changed", "emea").await;
    delete(&mut conn, "updated-then-gone").await;
    upsert(&mut conn, "born-and-dead", "brief", "emea").await;
    delete(&mut conn, "born-and-dead").await;
    upsert(&mut conn, "leaves", "moved away", "apac").await;
    upsert(&mut conn, "enters", "moved here", "emea").await;
    upsert(&mut conn, "elsewhere", "never emea", "amer").await;
    seal(&app).await;

    let (changes, _) = app.pull_all(&admin, "tickets", &admin_start, 100).await;
    assert_eq!(
        ops(&changes),
        pairs(&[
            ("upsert", "elsewhere"),
            ("upsert", "enters"),
            ("delete", "gone"),
            ("upsert", "leaves"),
            ("delete", "updated-then-gone")
        ])
    );
    assert!(changes[2].get("data").is_none(), "a tombstone carries no data");
    let (changes, _) = app.pull_all(&partner, "tickets", &partner_start, 100).await;
    assert_eq!(
        ops(&changes),
        pairs(&[("upsert", "enters"), ("delete", "gone"), ("delete", "leaves"), ("delete", "updated-then-gone")])
    );

    // Windows cut before their keys carried the version live at the end read the same.
    let (admin_changes, _) = app.pull_all(&admin, "tickets", &admin_start, 2).await;
    // (Admin and partner may read one window or two: their cursors are taken a moment apart.)
    let (keys, without_version): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE version_id IS NULL) FROM feed_window_keys")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(keys >= 6 && without_version == 0, "{keys} keys, {without_version} without their version");
    sqlx::query("UPDATE feed_window_keys SET version_id = NULL").execute(&app.pool).await.unwrap();
    assert_eq!(app.pull_all(&admin, "tickets", &admin_start, 2).await.0, admin_changes);
    assert_eq!(app.pull_all(&partner, "tickets", &partner_start, 100).await.0, changes);
}

#[sqlx::test(migrations = "./migrations")]
async fn cursors_are_bound_tamper_evident_replayable_and_expire(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let start = app.cursor_now(&admin, "tickets").await;
    let mut conn = app.pool.acquire().await.unwrap();
    for n in 0..5 {
        upsert(&mut conn, &format!("k{n}"), "x", "emea").await;
    }
    seal(&app).await;
    let first = app.pull(&admin, "tickets", &start, 2).await;
    let replay = app.pull(&admin, "tickets", &start, 2).await;
    assert_eq!(first, replay, "the same cursor reads the same page");
    assert_eq!(first["end_of_stream"], false);

    let mut tampered = start.clone().into_bytes();
    let at = tampered.len() - 3;
    tampered[at] ^= 1;
    let tampered = String::from_utf8(tampered).unwrap();
    let partner_cursor = app.cursor_now(&app.token("acme", "zenpartner"), "tickets").await;
    let globex = app.token("globex", "hank");
    for (what, token, cursor) in [
        ("tampered", admin.as_str(), tampered.as_str()),
        ("garbage", admin.as_str(), "not-a-cursor"),
        ("another principal's", admin.as_str(), partner_cursor.as_str()),
        ("another tenant's", globex.as_str(), start.as_str()),
    ] {
        let response = app.get(Some(token), &format!("/v1/datasets/tickets/changes?cursor={cursor}")).await;
        assert_eq!(response.status(), 400, "{what}");
        let body = problem(response).await;
        assert_eq!(body["code"], "invalid-cursor", "{what}");
        assert_eq!(body["field"], "cursor");
    }
    assert_eq!(app.get(Some(&admin), "/v1/datasets/tickets/changes").await.status(), 400, "no cursor");
    assert_eq!(app.get(Some(&admin), "/v1/datasets/contacts/changes?cursor=x").await.status(), 400);
    assert_eq!(app.get(Some(&app.token("acme", "zenpartner")), "/v1/datasets/contacts/cursor").await.status(), 403);

    app.clock.advance(std::time::Duration::from_secs(31 * 86_400)); // acme keeps tombstones 30 days
    let expired = app.get(Some(&admin), &format!("/v1/datasets/tickets/changes?cursor={start}")).await;
    assert_eq!(expired.status(), 410);
    assert_eq!(problem(expired).await["code"], "cursor-expired");
}

/// The data rows of an incremental JSONL export: (op, key, subject).
async fn incremental_rows(app: &TestApp, id: &str) -> Vec<(String, String, Value)> {
    let mut rows = Vec::new();
    for shard in app.own_shard_files(id).await {
        for line in String::from_utf8(crate::common::gunzip(&shard)).unwrap().lines() {
            let row: Value = serde_json::from_str(line).unwrap();
            rows.push((
                row["_op"].as_str().unwrap().to_owned(),
                row["id"].as_str().unwrap().to_owned(),
                row["subject"].clone(),
            ));
        }
    }
    rows
}

#[sqlx::test(migrations = "./migrations")]
async fn consecutive_incremental_exports_leave_no_gap_and_no_overlap(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let body = |since: Option<&str>| {
        let mut body = json!({"dataset": "tickets", "format": "jsonl", "mode": "incremental", "shard_rows": 2});
        if let Some(since) = since {
            body["since"] = json!(since);
        }
        body
    };
    let start = app.cursor_now(&token, "tickets").await;
    let mut conn = app.pool.acquire().await.unwrap();
    for key in ["a", "b", "c"] {
        upsert(&mut conn, key, "first", "emea").await;
    }
    seal(&app).await;
    let first = app.export(&token, &body(Some(&start))).await;
    // Changes after the first export was created belong to the second.
    upsert(&mut conn, "a", "second", "emea").await;
    delete(&mut conn, "b").await;
    upsert(&mut conn, "d", "second", "emea").await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let rows = incremental_rows(&app, &first).await;
    assert_eq!(
        rows,
        vec![
            ("upsert".into(), "a".into(), json!("first")),
            ("upsert".into(), "b".into(), json!("first")),
            ("upsert".into(), "c".into(), json!("first")),
        ]
    );
    let manifest: Value = app.get(Some(&token), &format!("/v1/exports/{first}/manifest")).await.json().await.unwrap();
    assert_eq!(manifest["from_cursor"], start.as_str());
    assert_eq!(manifest["columns"][1]["name"], "_op");

    seal(&app).await;
    let second = app.export(&token, &body(None)).await; // from the stored cursor
    assert_eq!(app.drain().await, vec![Step::Published]);
    let rows = incremental_rows(&app, &second).await;
    assert_eq!(
        rows,
        vec![
            ("upsert".into(), "a".into(), json!("second")),
            ("delete".into(), "b".into(), Value::Null),
            ("upsert".into(), "d".into(), json!("second")),
        ]
    );
    let second_manifest: Value =
        app.get(Some(&token), &format!("/v1/exports/{second}/manifest")).await.json().await.unwrap();
    assert_eq!(second_manifest["from_cursor"], manifest["next_cursor"]);

    // Nothing new: an empty export whose next cursor continues from the same place.
    let third = app.export(&token, &body(None)).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    assert!(incremental_rows(&app, &third).await.is_empty());
    // The feed from the last cursor agrees: nothing pending.
    let third_manifest: Value =
        app.get(Some(&token), &format!("/v1/exports/{third}/manifest")).await.json().await.unwrap();
    let (pending, _) = app.pull_all(&token, "tickets", third_manifest["next_cursor"].as_str().unwrap(), 10).await;
    assert!(pending.is_empty());
}

#[sqlx::test(migrations = "./migrations")]
async fn one_incremental_export_at_a_time_per_principal_and_dataset(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let start = app.cursor_now(&token, "tickets").await;
    let body = json!({"dataset": "tickets", "format": "csv", "mode": "incremental", "since": start});
    app.export(&token, &body).await;
    let again = app.create_export(&token, Some("another-key"), &body).await;
    assert_eq!(again.status(), 409);
    assert_eq!(problem(again).await["code"], "incremental-in-progress");
    let foreign = json!({"dataset": "tickets", "format": "csv", "mode": "incremental", "since": start});
    let response = app.create_export(&app.token("acme", "zenpartner"), Some("k"), &foreign).await;
    assert_eq!(response.status(), 400, "another principal's cursor");
}

async fn versions(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM record_versions").fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn old_history_is_collected_except_what_a_live_export_still_reads(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let mut conn = app.pool.acquire().await.unwrap();
    let before = app.cursor_now(&token, "tickets").await;
    upsert(&mut conn, "kept", "v1", "emea").await;
    upsert(&mut conn, "protected", "as exported", "emea").await;
    upsert(&mut conn, "deleted", "v1", "emea").await;
    // A queued export sealed now still needs "protected" as it is.
    let queued = app.export(&token, &json!({"dataset": "tickets", "format": "jsonl"})).await;
    upsert(&mut conn, "kept", "v2", "emea").await;
    upsert(&mut conn, "protected", "changed later", "emea").await;
    delete(&mut conn, "deleted").await;
    let start = app.cursor_now(&token, "tickets").await;
    seal(&app).await;
    assert_eq!(versions(&app.pool).await, 6);
    // A partner read those changes (kept and protected; deleted came and went): the window is
    // cut and its three keys stored. A later tick follows.
    let read = app.get(Some(&token), &format!("/v1/datasets/tickets/changes?cursor={before}")).await;
    assert_eq!(read.json::<Value>().await.unwrap()["changes"].as_array().unwrap().len(), 2);
    seal(&app).await;
    assert_eq!(stored_window_keys(&app.pool).await, 3);

    app.clock.advance(std::time::Duration::from_secs(31 * 86_400));
    let store = app.store.clone();
    let gc = || exportd::cleaner::run_once(&app.pool, &store, &app.registry, app.clock.now());
    // The queued export, sealed before every change above, still reads all the old versions;
    // the window read before goes, with its keys.
    let collected = gc().await.unwrap();
    assert_eq!(collected.versions_collected, 0);
    assert_eq!(collected.windows_collected, 1);
    assert_eq!(stored_window_keys(&app.pool).await, 0);
    assert_eq!(app.drain().await, vec![Step::Published]);
    let shard = &app.own_shard_files(&queued).await[0];
    let text = String::from_utf8(crate::common::gunzip(shard)).unwrap();
    assert!(text.contains("as exported") && !text.contains("changed later"), "{text}");

    // Now the closed versions of kept, protected and deleted, and deleted's tombstone, go.
    assert_eq!(gc().await.unwrap().versions_collected, 4);
    assert_eq!(versions(&app.pool).await, 2);
    assert_eq!(committed_state(&app.pool).await.len(), 2, "the current state is untouched");
    // Old cursors are refused rather than silently missing history.
    let expired = app.get(Some(&token), &format!("/v1/datasets/tickets/changes?cursor={start}")).await;
    assert_eq!(expired.status(), 410);
    // Writing again after collection works (heads may point at collected tombstones).
    upsert(&mut conn, "deleted", "reborn", "emea").await;
    assert_eq!(committed_state(&app.pool).await.len(), 3);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_cleaner_pass_keeps_every_tick_inside_the_retention(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let cursor = app.cursor_now(&token, "tickets").await;
    let mut conn = app.pool.acquire().await.unwrap();
    upsert(&mut conn, "k", "v1", "emea").await;
    seal(&app).await;
    let ticks =
        async || -> i64 { sqlx::query_scalar("SELECT count(*) FROM feed_ticks").fetch_one(&app.pool).await.unwrap() };
    let before = ticks().await;
    assert!(before > 1, "ticks no window starts or ends at: {before}");
    exportd::cleaner::run_once(&app.pool, &app.store, &app.registry, app.clock.now()).await.unwrap();
    assert_eq!(ticks().await, before, "ticks younger than every tenant's tombstone horizon stay");
    let read = app.get(Some(&token), &format!("/v1/datasets/tickets/changes?cursor={cursor}")).await;
    assert_eq!(read.status(), 200);
    assert_eq!(read.json::<Value>().await.unwrap()["changes"].as_array().unwrap().len(), 1);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_caught_up_partner_polling_keeps_no_empty_windows(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let poll = async |cursor: &str| -> Value {
        let response = app.get(Some(&token), &format!("/v1/datasets/tickets/changes?cursor={cursor}")).await;
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    };
    let windows =
        async || -> i64 { sqlx::query_scalar("SELECT count(*) FROM feed_windows").fetch_one(&app.pool).await.unwrap() };
    let mut cursor = app.cursor_now(&token, "tickets").await;
    for _ in 0..5 {
        // Other work goes on (here: a transaction that writes nothing of acme's), so each tick
        // is a newer snapshot and each poll finds a new, empty window.
        sqlx::query("SELECT pg_current_xact_id()").execute(&app.pool).await.unwrap();
        seal(&app).await;
        let page = poll(&cursor).await;
        assert_eq!((page["changes"].as_array().unwrap().len(), &page["end_of_stream"]), (0, &json!(true)));
        let next = page["next_cursor"].as_str().unwrap().to_owned();
        assert_ne!(next, cursor, "the cursor moves past the empty window");
        cursor = next;
    }
    assert_eq!(windows().await, 0, "a window without changes is not kept");

    let mut conn = app.pool.acquire().await.unwrap();
    upsert(&mut conn, "t-new", "after the quiet", "emea").await;
    seal(&app).await;
    let page = poll(&cursor).await;
    assert_eq!(ops(page["changes"].as_array().unwrap()), pairs(&[("upsert", "t-new")]));
    assert_eq!(windows().await, 1);
    // Re-reading the same cursor reads the same kept window.
    assert_eq!(poll(&cursor).await["changes"], page["changes"]);
}

/// Keys stored for all windows.
async fn stored_window_keys(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM feed_window_keys").fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn readers_at_many_starts_share_windows_so_storage_grows_with_changes_not_readers(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    let mut conn = app.pool.acquire().await.unwrap();
    // Sixty cursors a moment apart, a write after each, a tick after every ten.
    let mut cursors = Vec::new();
    for i in 0..60 {
        cursors.push(app.cursor_now(&token, "tickets").await);
        upsert(&mut conn, &format!("early-{i:02}"), "v1", "emea").await;
        if i % 10 == 9 {
            app.tick().await;
        }
    }
    sqlx::query(
        "SELECT exportd_upsert('acme', 'tickets', 'late-' || lpad(g::text, 4, '0'),
                               jsonb_build_object('subject', 'late', 'status', 'open', 'region', 'emea'))
         FROM generate_series(1, 1000) g",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    seal(&app).await;
    // Newest cursor first: each used to cut a window of its own from its start (60 × ~1000 keys).
    for (i, cursor) in cursors.iter().enumerate().rev() {
        let (changes, _) = app.pull_all(&token, "tickets", cursor, 700).await;
        let mut expected: Vec<String> = (i..60).map(|j| format!("early-{j:02}")).collect();
        expected.extend((1..=1000).map(|j| format!("late-{j:04}")));
        let keys: Vec<String> = changes.iter().map(|c| c["key"].as_str().unwrap().to_owned()).collect();
        assert_eq!(keys.len(), expected.len(), "cursor {i}");
        assert_eq!(keys, expected, "cursor {i}: exactly the changes after it, in window and key order");
    }
    // Each change is stored once, in the one window its transaction falls in.
    assert_eq!(stored_window_keys(&app.pool).await, 1060);
    let (windows, exact): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE from_tick IS NULL) FROM feed_windows")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    // The newest cursor's reader cut from the tick before it to the end; each older reader
    // filled the gap from its own tick up to the next window: six windows, none overlapping.
    assert_eq!((windows, exact), (6, 0));
    // Pulled again in the other order, every reader reads the same changes from the same windows.
    let first = app.pull_all(&token, "tickets", &cursors[0], 1000).await.0;
    assert_eq!(first.len(), 1060);
    assert_eq!(app.pull_all(&token, "tickets", &cursors[30], 7).await.0.len(), 1030);
    assert_eq!(stored_window_keys(&app.pool).await, 1060);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_cursor_older_than_every_tick_reads_a_window_of_its_own_then_shared_ones(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("acme", "alice");
    sqlx::query("DELETE FROM feed_ticks").execute(&app.pool).await.unwrap();
    let mut conn = app.pool.acquire().await.unwrap();
    let cursor = app.cursor_now(&token, "tickets").await;
    upsert(&mut conn, "a", "first", "emea").await;
    seal(&app).await;
    let (changes, next) = app.pull_all(&token, "tickets", &cursor, 10).await;
    assert_eq!(ops(&changes), pairs(&[("upsert", "a")]));
    upsert(&mut conn, "b", "second", "emea").await;
    seal(&app).await;
    let (changes, _) = app.pull_all(&token, "tickets", &next, 10).await;
    assert_eq!(ops(&changes), pairs(&[("upsert", "b")]));
    let starts: Vec<bool> = sqlx::query_scalar("SELECT from_tick IS NULL FROM feed_windows ORDER BY id")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(starts, vec![true, false], "exact start first, then the shared chain");
    assert_eq!(app.pull_all(&token, "tickets", &cursor, 1).await.0.len(), 2, "replayed the same");
}
