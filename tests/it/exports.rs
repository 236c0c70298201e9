//! Full exports end to end: create over HTTP, run with real workers, read the shard files.

use crate::common::{TestApp, csv_rows, expire_lease, full_csv, gunzip, problem};
use exportd::jobs::{ClaimedExport, Step};
use exportd::records::RecordWrite;
use serde_json::{Value, json};
use sqlx::{Connection, PgPool};

async fn upsert(conn: &mut sqlx::PgConnection, key: &str, subject: &str) {
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, $2)")
        .bind(key)
        .bind(json!({"subject": subject, "status": "open", "region": "emea"}))
        .execute(conn)
        .await
        .unwrap();
}

/// Key and subject of every data row of the export's CSV shards (headers checked and dropped).
async fn exported(app: &TestApp, id: &str) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    for shard in app.own_shard_files(id).await {
        let mut records = csv_rows(&shard).into_iter();
        let header = records.next().unwrap();
        assert_eq!(header[0], "id");
        rows.extend(records.map(|r| (r[0].clone(), r[1].clone())));
    }
    rows
}

/// A worker claims the job, writes `shards` shards, then its process dies (the run is dropped
/// with its lease still held).
async fn crash_after(app: &TestApp, shards: usize) {
    let deps = app.deps();
    let mut doomed = ClaimedExport::claim(&deps, "doomed").await.unwrap().unwrap();
    for index in 0..shards {
        assert!(matches!(doomed.step().await.unwrap(), Step::ShardWritten { index: i, .. } if i as usize == index));
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn an_export_holds_exactly_what_was_committed_when_it_was_created(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let mut conn = app.pool.acquire().await.unwrap();
    upsert(&mut conn, "a", "a before").await;
    upsert(&mut conn, "b", "b before").await;
    upsert(&mut conn, "c", "c before").await;

    // A writer that is open when the export is created and commits right after it.
    let mut writer = app.pool.acquire().await.unwrap();
    let mut tx = writer.begin().await.unwrap();
    upsert(&mut tx, "late", "late").await;
    upsert(&mut tx, "a", "a changed by the late writer").await;

    let first = app.export(&admin, &full_csv(2)).await;
    tx.commit().await.unwrap();
    let second = app.export(&admin, &full_csv(2)).await;
    // Writes after both creates change neither.
    upsert(&mut conn, "b", "b after").await;
    sqlx::query("SELECT exportd_delete('acme', 'tickets', 'c')").execute(&mut *conn).await.unwrap();
    upsert(&mut conn, "d", "d after").await;

    let steps = app.drain().await;
    assert_eq!(steps, vec![Step::Published, Step::Published]);
    let expected: Vec<(String, String)> = [("a", "a before"), ("b", "b before"), ("c", "c before")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(exported(&app, &first).await, expected);
    let second_rows = exported(&app, &second).await;
    assert_eq!(second_rows.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(), ["a", "b", "c", "late"]);
    assert_eq!(second_rows[0].1, "a changed by the late writer");

    // Two exports of the same data: the same shard bytes.
    let third = app.export(&admin, &full_csv(2)).await;
    let fourth = app.export(&admin, &full_csv(2)).await;
    app.drain().await;
    assert_eq!(app.own_shard_files(&third).await, app.own_shard_files(&fourth).await);
}

#[sqlx::test(migrations = "./migrations")]
async fn status_and_manifest_describe_the_published_export(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 120).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &full_csv(50)).await;

    let queued: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(queued["state"], "QUEUED");
    assert_eq!(queued["next_poll_after_seconds"], 5);
    assert_eq!(queued["manifest_url"], Value::Null);
    let early = app.get(Some(&admin), &format!("/v1/exports/{id}/manifest")).await;
    assert_eq!(early.status(), 409);
    assert_eq!(problem(early).await["code"], "not-ready");

    app.drain().await;
    let done: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(done["state"], "SUCCEEDED");
    assert_eq!(
        done["progress"],
        json!({"shards_done": 3, "rows_done": 120, "bytes_done": done["progress"]["bytes_done"], "shards_total": 3, "rows_total": 120,
            "rows_total_estimate": 120, "eta_seconds": null})
    );
    assert_eq!(done["next_poll_after_seconds"], Value::Null);
    assert_eq!(done["manifest_url"], format!("/v1/exports/{id}/manifest"));

    let response = app.get(Some(&admin), &format!("/v1/exports/{id}/manifest")).await;
    assert_eq!(response.status(), 200);
    let etag = response.headers()["etag"].to_str().unwrap().to_owned();
    let bytes = response.bytes().await.unwrap();
    assert_eq!(etag, format!("\"{}\"", crate::common::sha256_hex(&bytes)));
    let manifest: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(manifest["total_rows"], 120);
    assert_eq!(manifest["format"], "csv");
    assert_eq!(manifest["compression"], "gzip");
    assert_eq!(manifest["columns"][0], json!({"name": "id", "type": "string", "required": true}));
    let shards = manifest["shards"].as_array().unwrap();
    assert_eq!(shards.iter().map(|s| s["rows"].as_u64().unwrap()).collect::<Vec<_>>(), [50, 50, 20]);
    assert_eq!(shards[0]["name"], "shard-00000.csv.gz");
    assert_eq!(shards[0]["first_key"], "tickets-000000000");
    assert_eq!(shards[2]["last_key"], "tickets-000000119");
    let files = app.own_shard_files(&id).await;
    for (shard, file) in shards.iter().zip(&files) {
        assert_eq!(shard["sha256"], crate::common::sha256_hex(file));
        assert_eq!(shard["bytes"], file.len());
    }
    let again = app
        .client
        .get(app.url(&format!("/v1/exports/{id}/manifest")))
        .bearer_auth(&admin)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);
}

#[sqlx::test(migrations = "./migrations")]
async fn csv_shards_parse_back_to_exactly_the_stored_values(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 300).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 128, "columns": ["subject", "amount", "priority", "escalated", "tags"]})).await;
    app.drain().await;

    let stored: Vec<(String, Value)> =
        sqlx::query_as("SELECT key, data FROM record_versions WHERE closed_xid IS NULL ORDER BY key COLLATE \"C\"")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    let mut parsed = Vec::new();
    for shard in app.own_shard_files(&id).await {
        let mut rows = csv_rows(&shard).into_iter();
        assert_eq!(rows.next().unwrap(), ["id", "subject", "amount", "priority", "escalated", "tags"]);
        parsed.extend(rows);
    }
    assert_eq!(parsed.len(), 300);
    let unescape = |cell: &str, original: &str| {
        if cell.len() == original.len() + 1 { cell[1..].to_owned() } else { cell.to_owned() }
    };
    let mut escaped = 0;
    for (row, (key, data)) in parsed.iter().zip(&stored) {
        assert_eq!(&row[0], key);
        let subject = data["subject"].as_str().unwrap();
        if row[1] != subject {
            assert!(row[1].starts_with('\'') && unescape(&row[1], subject) == subject, "{row:?}");
            escaped += 1;
        }
        let number = |v: &Value| if v.is_null() { String::new() } else { v.to_string() };
        assert_eq!(row[2], number(&data["amount"]), "numbers stay numbers");
        assert_eq!(row[3], number(&data["priority"]));
        assert_eq!(row[4], number(&data["escalated"]));
    }
    assert!(escaped > 0, "the seed has formula-like subjects, and they were escaped");
}

#[sqlx::test(migrations = "./migrations")]
async fn jsonl_exports_apply_filters_and_the_partners_row_filter(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 200).await;
    let partner = app.token("acme", "zenpartner");
    let id = app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl", "columns": ["region", "status"], "filter": {"status": "open"}})).await;
    app.drain().await;
    let lines: Vec<Value> = app
        .own_shard_files(&id)
        .await
        .iter()
        .flat_map(|s| {
            String::from_utf8(gunzip(s))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect::<Vec<Value>>()
        })
        .collect();
    let expected: i64 = sqlx::query_scalar("SELECT count(*) FROM record_versions WHERE closed_xid IS NULL AND data->>'region' = 'emea' AND data->>'status' = 'open'")
        .fetch_one(&app.pool).await.unwrap();
    assert!(expected > 0);
    assert_eq!(lines.len() as i64, expected);
    for line in &lines {
        assert_eq!(line["region"], "emea");
        assert_eq!(line["status"], "open");
        assert_eq!(line.as_object().unwrap().keys().collect::<Vec<_>>(), ["id", "region", "status"]);
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn a_shard_that_comes_out_different_on_rerun_fails_the_export(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 80).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(50)).await;
    crash_after(&app, 1).await;
    // Pretend the first attempt recorded other bytes, and lose the file.
    sqlx::query("UPDATE export_shards SET sha256 = repeat('0', 64) WHERE export_id = $1::uuid")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();
    expire_lease(&app.pool, &id).await;
    assert_eq!(app.drain().await, vec![Step::Failed { code: "non-deterministic-output".into() }]);
    let status: Value =
        app.get(Some(&app.token("acme", "alice")), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(status["state"], "FAILED");
    assert_eq!(status["error"]["code"], "non-deterministic-output");
    assert!(!app.data_dir.path().join(format!("objects/acme/{id}")).exists(), "no files are left");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_stale_worker_cannot_write_after_another_took_over(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 120).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(50)).await;
    let deps = app.deps();
    let mut stale = ClaimedExport::claim(&deps, "slow").await.unwrap().unwrap();
    stale.step().await.unwrap();
    expire_lease(&app.pool, &id).await; // "slow" stalled past its lease

    let mut fresh = ClaimedExport::claim(&deps, "fresh").await.unwrap().unwrap();
    assert_eq!(fresh.step().await.unwrap(), Step::ShardVerified { index: 0 });
    assert_eq!(stale.step().await.unwrap(), Step::LeaseLost, "the stale worker's write is refused");
    let files_after_refusal: usize = std::fs::read_dir(app.data_dir.path().join(format!("objects/acme/{id}")))
        .unwrap()
        .map(|attempt| std::fs::read_dir(attempt.unwrap().path()).unwrap().count())
        .sum();
    assert_eq!(files_after_refusal, 1, "the stale worker left no new file");
    while !fresh.step().await.unwrap().is_final() {}
    let (state, generation, attempts): (String, i64, i32) =
        sqlx::query_as("SELECT state, lease_generation, attempts FROM export_jobs WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), generation, attempts), ("SUCCEEDED", 2, 2));
    assert_eq!(stale.step().await.unwrap(), Step::LeaseLost, "and it can never publish");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_cancel_that_lands_after_the_last_shard_prevents_publishing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 70).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &full_csv(50)).await;
    let deps = app.deps();
    let mut run = ClaimedExport::claim(&deps, "w").await.unwrap().unwrap();
    assert_eq!(run.step().await.unwrap(), Step::ShardWritten { index: 0, rows: 50, last: false });
    assert_eq!(run.step().await.unwrap(), Step::ShardWritten { index: 1, rows: 20, last: true });

    let cancel = app.post(&admin, &format!("/v1/exports/{id}/cancel")).await;
    assert_eq!(cancel.status(), 202);
    assert_eq!(cancel.json::<Value>().await.unwrap()["state"], "CANCEL_REQUESTED");
    assert_eq!(run.step().await.unwrap(), Step::Cancelled, "publish lost the race and cancelled instead");
    assert_eq!(app.state(&id).await, "CANCELLED");
    assert!(!app.data_dir.path().join(format!("objects/acme/{id}")).exists(), "unpublished shards are deleted");
    let again = app.post(&admin, &format!("/v1/exports/{id}/cancel")).await;
    assert_eq!(again.status(), 200);
    assert_eq!(again.json::<Value>().await.unwrap()["state"], "CANCELLED");
    let manifest = app.get(Some(&admin), &format!("/v1/exports/{id}/manifest")).await;
    assert_eq!(manifest.status(), 410);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_cancel_after_publishing_is_refused_and_a_queued_cancel_needs_no_shards(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 30).await;
    let admin = app.token("acme", "alice");
    let done = app.export(&admin, &full_csv(50)).await;
    app.drain().await;
    let late = app.post(&admin, &format!("/v1/exports/{done}/cancel")).await;
    assert_eq!(late.status(), 409);
    let body = problem(late).await;
    assert_eq!((body["code"].as_str(), body["state"].as_str()), (Some("already-terminal"), Some("SUCCEEDED")));

    let queued = app.export(&admin, &full_csv(50)).await;
    assert_eq!(app.post(&admin, &format!("/v1/exports/{queued}/cancel")).await.status(), 202);
    assert_eq!(app.post(&admin, &format!("/v1/exports/{queued}/cancel")).await.status(), 200);
    assert_eq!(app.drain().await, vec![Step::Cancelled]);
    assert_eq!(app.state(&queued).await, "CANCELLED");
}

#[sqlx::test(migrations = "./migrations")]
async fn idempotency_keys_replay_refuse_and_stay_per_principal(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let body = full_csv(50);
    let first = app.create_export(&admin, Some("key-1"), &body).await;
    assert_eq!(first.status(), 202);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let first: Value = first.json().await.unwrap();
    assert_eq!(location, format!("/v1/exports/{}", first["id"].as_str().unwrap()));
    assert_eq!(first["status_url"], location);
    assert_eq!(first["replayed"], false);

    // Same meaning, other key order and explicit defaults: a replay.
    let same = json!({"shard_rows": 50, "mode": "full", "format": "csv", "dataset": "tickets"});
    let replay = app.create_export(&admin, Some("key-1"), &same).await;
    assert_eq!(replay.status(), 200);
    let replay: Value = replay.json().await.unwrap();
    assert_eq!((replay["id"].clone(), replay["replayed"].clone()), (first["id"].clone(), json!(true)));

    let other = app.create_export(&admin, Some("key-1"), &full_csv(60)).await;
    assert_eq!(other.status(), 422);
    assert_eq!(problem(other).await["code"], "idempotency-key-reused");

    let missing = app.create_export(&admin, None, &body).await;
    assert_eq!(missing.status(), 400);
    let missing = problem(missing).await;
    assert_eq!(
        (missing["code"].as_str(), missing["field"].as_str()),
        (Some("idempotency-key-required"), Some("Idempotency-Key"))
    );
    let bad = app.create_export(&admin, Some(&"k".repeat(256)), &body).await;
    assert_eq!(problem(bad).await["code"], "invalid-idempotency-key");

    let partner = app.create_export(&app.token("acme", "zenpartner"), Some("key-1"), &body).await;
    assert_eq!(partner.status(), 202, "the same key of another principal is another job");
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM export_jobs").fetch_one(&app.pool).await.unwrap();
    assert_eq!(jobs, 2);
}

#[sqlx::test(migrations = "./migrations")]
async fn concurrent_creates_with_one_key_make_one_job(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let body = full_csv(50);
    let responses =
        futures_util::future::join_all((0..10).map(|_| app.create_export(&admin, Some("race"), &body))).await;
    let mut ids = Vec::new();
    for response in responses {
        assert!(matches!(response.status().as_u16(), 200 | 202));
        ids.push(response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM export_jobs").fetch_one(&app.pool).await.unwrap();
    assert_eq!(jobs, 1);
}

#[sqlx::test(migrations = "./migrations")]
async fn invalid_requests_name_the_field(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let cases = [
        (json!({"dataset": "tickets", "format": "xml"}), 400, "invalid-body", Some("format")),
        (json!({"dataset": "tickets", "format": "csv", "colour": 1}), 400, "invalid-body", Some("colour")),
        (
            json!({"dataset": "tickets", "format": "csv", "columns": ["subject", "nope"]}),
            400,
            "invalid-request",
            Some("columns[1]"),
        ),
        (
            json!({"dataset": "tickets", "format": "csv", "columns": ["subject", "subject"]}),
            400,
            "invalid-request",
            Some("columns[1]"),
        ),
        (
            json!({"dataset": "tickets", "format": "csv", "filter": {"nope": 1}}),
            400,
            "invalid-request",
            Some("filter.nope"),
        ),
        (
            json!({"dataset": "tickets", "format": "csv", "filter": {"priority": "high"}}),
            400,
            "invalid-request",
            Some("filter.priority"),
        ),
        (json!({"dataset": "tickets", "format": "csv", "shard_rows": 0}), 400, "invalid-request", Some("shard_rows")),
        (
            json!({"dataset": "tickets", "format": "csv", "shard_rows": 2_000_000}),
            400,
            "invalid-request",
            Some("shard_rows"),
        ),
        (json!({"dataset": "tickets", "format": "csv", "mode": "incremental"}), 400, "invalid-cursor", Some("since")),
        (
            json!({"dataset": "tickets", "format": "csv", "mode": "incremental", "since": "x"}),
            400,
            "invalid-cursor",
            Some("since"),
        ),
        (json!({"dataset": "tickets", "format": "csv", "since": "x"}), 400, "invalid-request", Some("since")),
        (json!({"dataset": "orders", "format": "csv"}), 400, "invalid-request", Some("dataset")),
    ];
    for (body, status, code, field) in cases {
        let response = app.create_export(&admin, Some(&uuid::Uuid::new_v4().to_string()), &body).await;
        assert_eq!(response.status(), status, "{body}");
        let problem = problem(response).await;
        assert_eq!(problem["code"], code, "{body}");
        assert_eq!(problem["field"].as_str(), field, "{body}: {problem}");
    }
    // A dataset another tenant has looks exactly like one nobody has.
    let elsewhere = app
        .create_export(&app.token("globex", "hank"), Some("k"), &json!({"dataset": "contacts", "format": "csv"}))
        .await;
    assert_eq!(elsewhere.status(), 400);
    let elsewhere = problem(elsewhere).await;
    let nowhere = app
        .create_export(&app.token("globex", "hank"), Some("k2"), &json!({"dataset": "orders", "format": "csv"}))
        .await;
    let nowhere = problem(nowhere).await;
    assert_eq!(
        (&elsewhere["code"], &elsewhere["field"], &elsewhere["detail"]),
        (&nowhere["code"], &nowhere["field"], &nowhere["detail"])
    );
    let ungranted = app
        .create_export(&app.token("acme", "zenpartner"), Some("k"), &json!({"dataset": "contacts", "format": "csv"}))
        .await;
    assert_eq!(ungranted.status(), 403);
    assert_eq!(problem(ungranted).await["code"], "dataset-not-granted");
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM export_jobs").fetch_one(&app.pool).await.unwrap();
    assert_eq!(jobs, 0);
}

#[sqlx::test(migrations = "./migrations")]
async fn exports_are_visible_only_to_their_owner_and_tenant_admins(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let partner = app.token("acme", "zenpartner");
    let mine = app.export(&partner, &full_csv(50)).await;
    let admins = app.export(&admin, &full_csv(50)).await;

    let foreign = app.get(Some(&app.token("globex", "hank")), &format!("/v1/exports/{mine}")).await;
    let random = app.get(Some(&app.token("globex", "hank")), &format!("/v1/exports/{}", uuid::Uuid::new_v4())).await;
    let malformed = app.get(Some(&admin), "/v1/exports/not-a-uuid").await;
    assert_eq!(
        (foreign.status(), random.status(), malformed.status()),
        (404.try_into().unwrap(), 404.try_into().unwrap(), 404.try_into().unwrap())
    );
    assert_eq!(problem(foreign).await, problem(random).await, "indistinguishable from a missing export");
    assert_eq!(app.get(Some(&partner), &format!("/v1/exports/{admins}")).await.status(), 404);
    assert_eq!(app.post(&partner, &format!("/v1/exports/{admins}/cancel")).await.status(), 404);
    assert_eq!(app.get(Some(&admin), &format!("/v1/exports/{mine}")).await.status(), 200);

    let listed = |token: String| {
        let app = &app;
        async move {
            let page: Value = app.get(Some(&token), "/v1/exports").await.json().await.unwrap();
            page["exports"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect::<Vec<_>>()
        }
    };
    assert_eq!(listed(admin.clone()).await, vec![admins.clone(), mine.clone()], "newest first");
    assert_eq!(listed(partner.clone()).await, vec![mine.clone()]);
    assert!(listed(app.token("globex", "hank")).await.is_empty());
}

#[sqlx::test(migrations = "./migrations")]
async fn listing_pages_with_a_cursor_and_filters_by_state(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let mut created = Vec::new();
    for _ in 0..5 {
        created.push(app.export(&admin, &full_csv(50)).await);
    }
    app.post(&admin, &format!("/v1/exports/{}/cancel", created[0])).await;
    let mut seen = Vec::new();
    let mut path = "/v1/exports?limit=2".to_owned();
    loop {
        let page: Value = app.get(Some(&admin), &path).await.json().await.unwrap();
        seen.extend(page["exports"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/v1/exports?limit=2&cursor={cursor}"),
            None => break,
        }
    }
    created.reverse();
    assert_eq!(seen, created);
    let cancelling: Value = app.get(Some(&admin), "/v1/exports?state=CANCEL_REQUESTED").await.json().await.unwrap();
    assert_eq!(cancelling["exports"].as_array().unwrap().len(), 1);
    assert_eq!(problem(app.get(Some(&admin), "/v1/exports?state=DONE").await).await["field"], "state");
    assert_eq!(problem(app.get(Some(&admin), "/v1/exports?cursor=bogus").await).await["field"], "cursor");
    assert_eq!(problem(app.get(Some(&admin), "/v1/exports?limit=0").await).await["field"], "limit");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_revoked_grant_fails_the_export_without_publishing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 20).await;
    let id = app.export(&app.token("acme", "zenpartner"), &full_csv(50)).await;
    let revoked = crate::common::edited_registry("acme", |t| {
        t.replace("grants = [\"tickets\"]\nrow_filter", "grants = []\nrow_filter")
    });
    let deps = app.deps_with(revoked, app.store.clone());
    assert_eq!(
        exportd::jobs::drain(&deps, "w").await.unwrap(),
        vec![Step::Failed { code: "permission-revoked".into() }]
    );
    let status: Value =
        app.get(Some(&app.token("acme", "alice")), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(status["error"]["code"], "permission-revoked");
    assert_eq!(status["manifest_url"], Value::Null);
}

#[sqlx::test(migrations = "./migrations")]
async fn an_export_over_the_row_limit_fails_instead_of_truncating(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("globex", "tickets", 1001).await;
    let id = app.export(&app.token("globex", "hank"), &full_csv(400)).await;
    assert_eq!(app.drain().await, vec![Step::Failed { code: "too-many-rows".into() }]);
    assert!(!app.data_dir.path().join(format!("objects/globex/{id}")).exists());
    let tmp = std::fs::read_dir(app.data_dir.path().join("tmp")).unwrap().count();
    assert_eq!(tmp, 0, "no temp file is left behind");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_empty_dataset_exports_one_header_only_shard(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let id = app.export(&app.token("acme", "alice"), &json!({"dataset": "contacts", "format": "csv"})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let shards = app.own_shard_files(&id).await;
    assert_eq!(shards.len(), 1);
    assert_eq!(
        csv_rows(&shards[0]),
        vec![vec!["id", "name", "email", "region", "phone", "lifetime_value", "created_at"]]
    );
}

async fn live_count(pool: &PgPool, condition: &str) -> u64 {
    let sql =
        format!("SELECT count(*) FROM record_versions WHERE closed_xid IS NULL AND data IS NOT NULL AND {condition}");
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap() as u64
}

#[sqlx::test(migrations = "./migrations")]
async fn an_estimate_counts_a_small_dataset_exactly_and_creates_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 300).await;
    let (admin, partner) = (app.token("acme", "alice"), app.token("acme", "zenpartner"));
    let body = json!({"dataset": "tickets", "format": "csv", "shard_rows": 100});
    let guess = app.estimated(&admin, &body).await;
    assert_eq!(guess["estimate"], true);
    assert_eq!(guess["rows"], json!({"value": 300, "low": 300, "high": 300, "method": "counted"}));
    assert_eq!(guess["shards"], 3);
    assert_eq!(guess["bytes"]["method"], "sample_encoded");
    assert_eq!(guess["bytes"]["sample_rows"], 300);
    assert_eq!(guess["duration"]["method"], "default_rate");
    assert_eq!(guess["duration"]["exports_ahead"], 0);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM export_jobs").fetch_one(&app.pool).await.unwrap();
    assert_eq!(jobs, 0, "an estimate queues nothing");

    // The file it estimated: every byte of the sample was the real data, so the sizes are close.
    let id = app.export(&admin, &body).await;
    let queued: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(queued["progress"]["rows_total_estimate"], 300, "counted at creation");
    assert_eq!(queued["progress"]["eta_seconds"], Value::Null, "no ETA before it runs");
    let ahead = app.estimated(&admin, &body).await;
    assert_eq!(ahead["duration"]["exports_ahead"], 1);
    let partner_view = app.estimated(&partner, &json!({"dataset": "tickets", "format": "csv"})).await;
    assert_eq!(partner_view["duration"]["exports_ahead"], 0, "a partner counts only its own exports");
    app.drain().await;
    let done: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    let file_bytes = done["file"]["bytes"].as_f64().unwrap();
    let gzip = guess["bytes"]["gzip"].as_f64().unwrap();
    assert!((gzip / file_bytes - 1.0).abs() < 0.1, "estimated {gzip} gzip bytes, the file has {file_bytes}");
    let files = app.own_shard_files(&id).await;
    let first = gunzip(&files[0]);
    let head = first.windows(2).position(|w| w == b"\r\n").unwrap() + 2; // BOM and header row
    let text = files.iter().map(|f| gunzip(f).len()).sum::<usize>() - (files.len() - 1) * head;
    let uncompressed = guess["bytes"]["uncompressed"].as_f64().unwrap();
    assert!(
        (uncompressed / text as f64 - 1.0).abs() < 0.05,
        "estimated {uncompressed} bytes of CSV, the file has {text}"
    );

    // Filters and a partner's row filter are counted as the export would apply them.
    let open =
        app.estimated(&admin, &json!({"dataset": "tickets", "format": "jsonl", "filter": {"status": "open"}})).await;
    assert_eq!(open["rows"]["value"], live_count(&app.pool, "data->>'status' = 'open'").await);
    let emea = partner_view["rows"]["value"].as_u64().unwrap();
    assert_eq!(emea, live_count(&app.pool, "data->>'region' = 'emea'").await);
    assert!(emea > 0 && emea < 300);

    // Refused like a create, naming the field.
    let unknown = app.estimate(&admin, &json!({"dataset": "nope", "format": "csv"})).await;
    assert_eq!(unknown.status(), 400);
    assert_eq!(problem(unknown).await["field"], "dataset");
    let column = app.estimate(&admin, &json!({"dataset": "tickets", "format": "csv", "columns": ["nope"]})).await;
    assert_eq!(problem(column).await["field"], "columns[0]");
    let not_granted = app.estimate(&partner, &json!({"dataset": "contacts", "format": "csv"})).await;
    assert_eq!(not_granted.status(), 403);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_large_dataset_is_sampled_and_the_truth_lies_in_the_interval(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("globex", "tickets", 20_000).await; // another tenant's rows share the table's pages
    app.seed("acme", "tickets", 80_000).await;
    let admin = app.token("acme", "alice");
    let acme = app.tenant("acme");
    let tickets = acme.dataset("tickets").unwrap();
    for stage in ["seeded", "every record rewritten", "a quarter deleted, vacuumed"] {
        match stage {
            // The old versions are closed (an update each): pages of dead tuples the sample
            // takes and sees nothing on.
            "every record rewritten" => {
                exportd::records::seed(&app.pool, &acme.id, tickets, 0, 80_000, 2).await.unwrap();
            }
            "a quarter deleted, vacuumed" => {
                let keys: Vec<String> = sqlx::query_scalar(
                    "SELECT key FROM record_heads WHERE tenant = 'acme' AND dataset = 'tickets' ORDER BY key LIMIT 20000",
                )
                .fetch_all(&app.pool)
                .await
                .unwrap();
                let deletes: Vec<_> = keys.into_iter().map(|key| RecordWrite::Delete { key }).collect();
                exportd::records::write_batch(&app.pool, &acme.id, &tickets.name, &deletes).await.unwrap();
                sqlx::query("VACUUM record_versions").execute(&app.pool).await.unwrap();
            }
            _ => {}
        }
        for (body, condition) in [
            (json!({"dataset": "tickets", "format": "csv"}), "tenant = 'acme'"),
            (
                json!({"dataset": "tickets", "format": "csv", "filter": {"status": "open"}}),
                "tenant = 'acme' AND data->>'status' = 'open'",
            ),
        ] {
            let guess = app.estimated(&admin, &body).await;
            let truth = live_count(&app.pool, condition).await;
            let rows = &guess["rows"];
            assert_eq!(rows["method"], "sampled", "{stage}: {guess}");
            let (value, low, high) =
                (rows["value"].as_u64().unwrap(), rows["low"].as_u64().unwrap(), rows["high"].as_u64().unwrap());
            assert!(low <= truth && truth <= high, "{stage}: {truth} rows, estimated {rows}");
            assert!((value as f64 / truth as f64 - 1.0).abs() < 0.15, "{stage}: {truth} rows, estimated {rows}");
            assert_eq!(guess["bytes"]["sample_rows"], 1000);
        }
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn a_running_export_reports_its_total_and_eta_and_estimates_learn_from_finished_exports(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 12_000).await;
    let admin = app.token("acme", "alice");
    let body = json!({"dataset": "tickets", "format": "csv", "shard_rows": 4000});
    let id = app.export(&admin, &body).await;
    let mut deps = app.deps();
    deps.config.page_rows = 1000;
    let mut run = ClaimedExport::claim(&deps, "w1").await.unwrap().unwrap();
    assert!(matches!(run.step().await.unwrap(), Step::ShardWritten { index: 0, .. }));
    // As if the first 4000 rows had taken 100 s: 8000 rows left at 40 rows/s, so 200 s — plus
    // twice the time that passes until the status is read (however slow this machine is).
    let moved = std::time::Instant::now();
    sqlx::query("UPDATE export_jobs SET started_at = now() - interval '100 seconds' WHERE id = $1::uuid")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();
    let running: Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(running["state"], "RUNNING");
    assert_eq!(running["progress"]["rows_done"], 4000);
    assert_eq!(running["progress"]["rows_total_estimate"], 12_000, "counted at creation, not below the rows done");
    let later = moved.elapsed().as_secs_f64();
    let eta = running["progress"]["eta_seconds"].as_u64().unwrap() as f64;
    assert!((199.0..=200.0 + 2.0 * later + 1.0).contains(&eta), "eta {eta}, read {later:.2} s after");
    let mut steps = 0;
    while !matches!(run.step().await.unwrap(), Step::Published) {
        steps += 1;
        assert!(steps < 10, "two shards and a publish");
    }

    let guess = app.estimated(&admin, &body).await;
    assert_eq!(guess["duration"]["method"], "recent_exports_of_dataset");
    let rate = guess["duration"]["rows_per_second"].as_u64().unwrap();
    assert!(rate < 200, "measured on the export that ran at about 12 000 rows in 100 s: {rate}");
    let contacts = app.estimated(&admin, &json!({"dataset": "contacts", "format": "csv"})).await;
    assert_eq!(contacts["duration"]["method"], "recent_exports_of_tenant");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_incremental_estimate_counts_the_keys_changed_since_the_cursor(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 50).await;
    let admin = app.token("acme", "alice");
    let cursor = app.cursor_now(&admin, "tickets").await;
    let mut conn = app.pool.acquire().await.unwrap();
    for i in 0..20 {
        upsert(&mut conn, &format!("tickets-{i:09}"), "changed").await;
        upsert(&mut conn, &format!("tickets-{i:09}"), "changed twice").await;
    }
    for i in 20..25 {
        sqlx::query("SELECT exportd_delete('acme', 'tickets', $1)")
            .bind(format!("tickets-{i:09}"))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    let guess = app
        .estimated(&admin, &json!({"dataset": "tickets", "format": "jsonl", "mode": "incremental", "since": cursor}))
        .await;
    assert_eq!(guess["rows"], json!({"value": 25, "low": 25, "high": 25, "method": "changes_counted"}));
    let bad = app
        .estimate(&admin, &json!({"dataset": "tickets", "format": "jsonl", "mode": "incremental", "since": "nope"}))
        .await;
    assert_eq!(bad.status(), 400);
    assert_eq!(problem(bad).await["field"], "since");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_tenant_runs_one_estimate_at_a_time_and_the_next_is_refused_at_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 20).await;
    let (acme, globex) = (app.token("acme", "alice"), app.token("globex", "hank"));
    let body = json!({"dataset": "tickets", "format": "csv"});
    // Hold the record store so estimates' censuses wait inside PostgreSQL.
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE record_versions IN ACCESS EXCLUSIVE MODE").execute(&mut *blocker).await.unwrap();
    let spawn_estimate = |token: &str| {
        let (client, url, token, body) =
            (app.client.clone(), app.url("/v1/exports/estimate"), token.to_owned(), body.clone());
        tokio::spawn(async move { client.post(url).bearer_auth(token).json(&body).send().await.unwrap() })
    };
    let waiting_for_the_store = |n: i64| crate::common::wait_for_lock_waiters(&app.pool, "record_versions", n);
    let first = spawn_estimate(&acme);
    waiting_for_the_store(1).await;
    let second = app.estimate(&acme, &body).await;
    assert_eq!(second.status(), 429);
    assert_eq!(second.headers()["retry-after"], "1");
    assert_eq!(problem(second).await["code"], "estimate-in-progress");
    let other_tenant = spawn_estimate(&globex);
    waiting_for_the_store(2).await; // another tenant has a slot of its own
    blocker.rollback().await.unwrap();
    assert_eq!(other_tenant.await.unwrap().status(), 200);
    assert_eq!(first.await.unwrap().status(), 200);
    assert_eq!(app.estimate(&acme, &body).await.status(), 200, "the slot came back");
}

#[sqlx::test(migrations = "./migrations")]
async fn the_database_refuses_every_transition_the_state_machine_does_not_have(pool: PgPool) {
    use exportd::exports::ExportState;
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 5).await;
    // A published job has every column any state needs (manifest, file, finish time).
    let id = app.export(&app.token("acme", "alice"), &full_csv(10)).await;
    app.drain().await;
    for from in ExportState::ALL {
        for to in ExportState::ALL {
            let mut tx = app.pool.begin().await.unwrap();
            // Put the job in `from` without asking the machine (triggers off for this statement).
            sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *tx).await.unwrap();
            sqlx::query("UPDATE export_jobs SET state = $2 WHERE id = $1::uuid")
                .bind(&id)
                .bind(from.as_str())
                .execute(&mut *tx)
                .await
                .unwrap();
            sqlx::query("SET LOCAL session_replication_role = origin").execute(&mut *tx).await.unwrap();
            let moved = sqlx::query("UPDATE export_jobs SET state = $2 WHERE id = $1::uuid")
                .bind(&id)
                .bind(to.as_str())
                .execute(&mut *tx)
                .await;
            // Another constraint may still refuse the row (SUCCEEDED needs a manifest): only
            // EXD02 is the state machine saying no.
            let refused = moved.as_ref().err().and_then(|e| e.as_database_error()).and_then(|d| d.code());
            let machine_said_no = refused.as_deref() == Some("EXD02");
            assert_eq!(machine_said_no, !from.may_become(to), "{from:?} → {to:?}: {moved:?}");
            tx.rollback().await.unwrap();
        }
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn the_state_sets_statements_ask_about_are_the_state_predicates(pool: PgPool) {
    use exportd::exports::ExportState;
    for state in ExportState::ALL {
        let (unfinished, published, ended_without_files): (bool, bool, bool) = sqlx::query_as(
            "SELECT exportd_export_unfinished($1), exportd_export_published($1), exportd_export_ended_without_files($1)",
        )
        .bind(state.as_str())
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(unfinished, !state.is_terminal(), "{state:?} unfinished");
        assert_eq!(published, state.was_published(), "{state:?} published");
        let ends_without_files = state.is_terminal() && state != ExportState::Succeeded;
        assert_eq!(ended_without_files, ends_without_files, "{state:?} ended without files");
    }
}
