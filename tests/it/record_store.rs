//! The versioned record store, exercised through its SQL functions with real transactions.

use exportd::records::{self, AsOf, Snapshot};
use exportd::tenants::{DatasetName, TenantId};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};

fn acme() -> TenantId {
    TenantId::parse("acme").unwrap()
}

fn tickets() -> DatasetName {
    DatasetName::parse("tickets").unwrap()
}

fn ticket(subject: &str) -> Value {
    json!({"subject": subject, "status": "open"})
}

async fn upsert(conn: &mut PgConnection, key: &str, data: Value) {
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, $2)").bind(key).bind(data).execute(conn).await.unwrap();
}

async fn snapshot(pool: &PgPool) -> Snapshot {
    Snapshot::current(pool).await.unwrap()
}

async fn read(pool: &PgPool, snap: &Snapshot) -> Vec<(String, String)> {
    AsOf::new(&acme(), &tickets(), snap)
        .page(pool, None, 1000)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.key.clone(), r.value()["subject"].as_str().unwrap().to_owned()))
        .collect()
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_write_committed_before_a_snapshot_is_visible_as_of_it(pool: PgPool) {
    crate::common::prepare_db(&pool).await;
    upsert(&mut pool.acquire().await.unwrap(), "t1", ticket("first")).await;
    let snap = snapshot(&pool).await;
    assert_eq!(read(&pool, &snap).await, pairs(&[("t1", "first")]));
}

#[sqlx::test(migrations = "./migrations")]
async fn a_writer_open_at_the_snapshot_stays_invisible_after_it_commits(pool: PgPool) {
    crate::common::prepare_db(&pool).await;
    let mut writer = pool.acquire().await.unwrap();
    let mut tx = writer.begin().await.unwrap();
    upsert(&mut tx, "late", ticket("late")).await;
    let snap = snapshot(&pool).await;
    tx.commit().await.unwrap();

    assert_eq!(read(&pool, &snap).await, vec![], "the in-flight write leaked into the snapshot");
    assert_eq!(read(&pool, &snapshot(&pool).await).await, pairs(&[("late", "late")]));
}

#[sqlx::test(migrations = "./migrations")]
async fn updates_and_deletes_after_a_snapshot_do_not_change_what_it_reads(pool: PgPool) {
    crate::common::prepare_db(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    for key in ["a", "b", "c"] {
        upsert(&mut conn, key, ticket(&format!("{key} v1"))).await;
    }
    let snap = snapshot(&pool).await;
    upsert(&mut conn, "a", ticket("a v2")).await;
    sqlx::query("SELECT exportd_delete('acme', 'tickets', 'b')").execute(&mut *conn).await.unwrap();
    upsert(&mut conn, "d", ticket("d v1")).await;

    let expected = pairs(&[("a", "a v1"), ("b", "b v1"), ("c", "c v1")]);
    assert_eq!(read(&pool, &snap).await, expected);
    assert_eq!(read(&pool, &snapshot(&pool).await).await, pairs(&[("a", "a v2"), ("c", "c v1"), ("d", "d v1")]));
}

#[sqlx::test(migrations = "./migrations")]
async fn the_sql_functions_join_the_callers_transaction_and_vanish_on_rollback(pool: PgPool) {
    crate::common::prepare_db(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    upsert(&mut conn, "kept", ticket("kept")).await;

    let mut tx = conn.begin().await.unwrap();
    upsert(&mut tx, "rolled-back", ticket("gone")).await;
    upsert(&mut tx, "kept", ticket("overwritten then rolled back")).await;
    let existed: bool =
        sqlx::query_scalar("SELECT exportd_delete('acme', 'tickets', 'kept')").fetch_one(&mut *tx).await.unwrap();
    assert!(existed);
    tx.rollback().await.unwrap();

    assert_eq!(read(&pool, &snapshot(&pool).await).await, pairs(&[("kept", "kept")]));
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM record_versions").fetch_one(&pool).await.unwrap();
    assert_eq!(versions, 1, "the rolled-back versions are gone");
}

#[sqlx::test(migrations = "./migrations")]
async fn rewriting_a_key_in_one_transaction_keeps_one_version(pool: PgPool) {
    crate::common::prepare_db(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let before = snapshot(&pool).await;
    let mut tx = conn.begin().await.unwrap();
    upsert(&mut tx, "k", ticket("one")).await;
    upsert(&mut tx, "k", ticket("two")).await;
    upsert(&mut tx, "gone", ticket("created")).await;
    sqlx::query("SELECT exportd_delete('acme', 'tickets', 'gone')").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(read(&pool, &before).await, vec![]);
    assert_eq!(read(&pool, &snapshot(&pool).await).await, pairs(&[("k", "two")]));
    let versions: Vec<(String, bool)> =
        sqlx::query_as("SELECT key, data IS NULL FROM record_versions ORDER BY key").fetch_all(&pool).await.unwrap();
    assert_eq!(versions, vec![("gone".into(), true), ("k".into(), false)]);
}

/// Two transactions write the same key; the second blocks on the first (seen in pg_locks),
/// both commit, and snapshots between them read each version in commit order.
async fn concurrent_writers_commit_in_order(pool: PgPool, existing: bool) {
    crate::common::prepare_db(&pool).await;
    if existing {
        upsert(&mut pool.acquire().await.unwrap(), "k", ticket("original")).await;
    }
    let s0 = snapshot(&pool).await;

    let mut first = pool.acquire().await.unwrap();
    let mut tx1 = first.begin().await.unwrap();
    upsert(&mut tx1, "k", ticket("first")).await;

    let mut second = pool.acquire().await.unwrap();
    let second_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *second).await.unwrap();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let (written_tx, written_rx) = tokio::sync::oneshot::channel::<()>();
    let writer = tokio::spawn(async move {
        let mut tx2 = second.begin().await.unwrap();
        upsert(&mut tx2, "k", ticket("second")).await;
        written_tx.send(()).unwrap();
        release_rx.await.unwrap();
        tx2.commit().await.unwrap();
    });

    crate::common::wait_until_blocked(&pool, second_pid).await;
    tx1.commit().await.unwrap();
    written_rx.await.unwrap();
    let s1 = snapshot(&pool).await; // first committed, second written but open
    release_tx.send(()).unwrap();
    writer.await.unwrap();
    let s2 = snapshot(&pool).await;

    let original = if existing { pairs(&[("k", "original")]) } else { vec![] };
    assert_eq!(read(&pool, &s0).await, original);
    assert_eq!(read(&pool, &s1).await, pairs(&[("k", "first")]));
    assert_eq!(read(&pool, &s2).await, pairs(&[("k", "second")]));
    let open: i64 = sqlx::query_scalar("SELECT count(*) FROM record_versions WHERE closed_xid IS NULL")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(open, 1, "exactly one open version per key");
}

#[sqlx::test(migrations = "./migrations")]
async fn two_concurrent_writers_of_a_new_key_both_commit_in_order(pool: PgPool) {
    concurrent_writers_commit_in_order(pool, false).await;
}

#[sqlx::test(migrations = "./migrations")]
async fn two_concurrent_writers_of_an_existing_key_both_commit_in_order(pool: PgPool) {
    concurrent_writers_commit_in_order(pool, true).await;
}

#[sqlx::test(migrations = "./migrations")]
async fn the_sql_functions_refuse_records_that_do_not_fit_and_name_the_field(pool: PgPool) {
    crate::common::prepare_db(&pool).await;
    let cases = [
        ("tickets", "k", json!({"subject": "s"}), "data.status"),
        ("tickets", "k", json!({"subject": "s", "status": "open", "priority": 1.5}), "data.priority"),
        ("tickets", "k", json!({"subject": "s", "status": "open", "opened_at": "yesterday"}), "data.opened_at"),
        (
            "tickets",
            "k",
            json!({"subject": "s", "status": "open", "opened_at": "2026-13-01T00:00:00Z"}),
            "data.opened_at",
        ),
        ("tickets", "k", json!({"subject": "s", "status": "open", "colour": "red"}), "data.colour"),
        ("tickets", "k", json!({"subject": 5, "status": "open"}), "data.subject"),
        ("tickets", "", json!({"subject": "s", "status": "open"}), "key"),
        ("nope", "k", json!({"subject": "s", "status": "open"}), "dataset"),
    ];
    for (dataset, key, data, field) in cases {
        let err = sqlx::query("SELECT exportd_upsert('acme', $1, $2, $3)")
            .bind(dataset)
            .bind(key)
            .bind(&data)
            .execute(&pool)
            .await
            .expect_err(&format!("{data} was accepted"));
        let db = err.as_database_error().expect("a database error");
        assert_eq!(db.code().as_deref(), Some("EXD01"), "{data}");
        let pg = db.downcast_ref::<sqlx::postgres::PgDatabaseError>();
        assert_eq!(pg.column(), Some(field), "{data}: {}", pg.message());
        assert!(pg.message().starts_with(&format!("{field}: ")), "the message names the field: {}", pg.message());
    }
    let ok = json!({"subject": "s", "status": "open", "priority": 3, "amount": -3.5,
        "opened_at": "2026-11-30T10:00:00.5+01:00", "tags": {"any": ["json"]}, "region": null});
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', 'ok', $1)").bind(ok).execute(&pool).await.unwrap();
}

#[sqlx::test(migrations = "./migrations")]
async fn seeding_writes_versions_like_the_sql_functions(pool: PgPool) {
    let registry = crate::common::prepare_db(&pool).await;
    let tenant = registry.get("acme").unwrap();
    let schema = tenant.dataset("tickets").unwrap();
    let report = records::seed(&pool, &acme(), schema, 0, 500, 1).await.unwrap();
    assert_eq!(report.rows, 500);
    let first = snapshot(&pool).await;
    // Re-seeding a range closes the old versions instead of duplicating keys.
    records::seed(&pool, &acme(), schema, 400, 200, 2).await.unwrap();
    let second = snapshot(&pool).await;

    let at_first = AsOf::new(&acme(), &tickets(), &first).page(&pool, None, 10_000).await.unwrap();
    let at_second = AsOf::new(&acme(), &tickets(), &second).page(&pool, None, 10_000).await.unwrap();
    assert_eq!(at_first.len(), 500);
    assert_eq!(at_second.len(), 600);
    assert_eq!(at_first[..400], at_second[..400]);
    assert_ne!(at_first[450], at_second[450], "re-seeded keys carry the new seed's values");
    let keys: Vec<&str> = at_second.iter().map(|r| r.key.as_str()).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted, "reads come in byte order of keys");
    // Every seeded record passes the same validation as a host application's write.
    let invalid: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM record_versions v, exportd_record_problem(v.tenant, v.dataset, v.key, v.data) p
         WHERE p.field IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(invalid, 0);
}

#[sqlx::test(migrations = "./migrations")]
async fn keyset_pages_cover_every_record_once(pool: PgPool) {
    let registry = crate::common::prepare_db(&pool).await;
    let schema = registry.get("acme").unwrap().dataset("tickets").unwrap();
    records::seed(&pool, &acme(), schema, 0, 1234, 1).await.unwrap();
    let snap = snapshot(&pool).await;
    let mut after: Option<String> = None;
    let mut seen = Vec::new();
    loop {
        let page = AsOf::new(&acme(), &tickets(), &snap).page(&pool, after.as_deref(), 100).await.unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.key.clone());
        seen.extend(page.into_iter().map(|r| r.key));
    }
    assert_eq!(seen.len(), 1234);
    seen.dedup();
    assert_eq!(seen.len(), 1234);
}

#[sqlx::test(migrations = "./migrations")]
async fn pages_walk_the_key_index_on_a_table_postgresql_never_analyzed(pool: PgPool) {
    // A host application's bulk write of 600 000 records, with nothing analyzing the table after.
    sqlx::query("ALTER TABLE record_versions SET (autovacuum_enabled = off)").execute(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO record_versions (tenant, dataset, key, data)
         SELECT 'acme', 'tickets', 'tickets-' || lpad(i::text, 9, '0'),
                jsonb_build_object('subject', 'ticket ' || i, 'status', 'open', 'body', repeat('x', 150))
         FROM generate_series(0, 599999) i",
    )
    .execute(&pool)
    .await
    .unwrap();
    let stats: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stats WHERE tablename = 'record_versions'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stats, 0, "the table was never analyzed");
    // The trap is real on this table: left to its estimates (a handful of matching rows), the
    // planner reads every matching row through a bitmap and sorts them for each page.
    let unguided: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT v.key, v.data::text FROM record_versions v
         WHERE v.tenant = 'acme' AND v.dataset = 'tickets' AND v.key > 'tickets-000000100'
           AND exportd_live_at(v.created_xid, v.closed_xid, pg_current_snapshot()) AND v.data IS NOT NULL
         ORDER BY v.key LIMIT 7",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(unguided.iter().any(|line| line.contains("Sort")), "{unguided:#?}");

    let (snap, tenant, dataset) = (snapshot(&pool).await, acme(), tickets());
    let as_of = AsOf::new(&tenant, &dataset, &snap);
    let plan = as_of.page_plan(&pool, Some("tickets-000000100"), 7).await.unwrap();
    assert!(plan.iter().any(|line| line.contains("Index Scan using record_versions_by_key")), "{plan:#?}");
    assert!(!plan.iter().any(|line| line.contains("Sort") || line.contains("Bitmap")), "{plan:#?}");
    let page = as_of.page(&pool, Some("tickets-000000100"), 7).await.unwrap();
    let keys: Vec<&str> = page.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, (101..108).map(|i| format!("tickets-{i:09}")).collect::<Vec<_>>());
}
