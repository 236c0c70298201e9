//! What a partner with a row filter learns: its estimates count only what its feed delivers and
//! say nothing that depends on records, tenants or principals it cannot see; its artefacts cut
//! under an old filter are all refused alike.

use serde_json::json;
use sqlx::PgPool;

use crate::common::{TestApp, full_csv, problem};

async fn upsert(pool: &PgPool, key: &str, region: &str) {
    let data = json!({"subject": "s", "status": "open", "region": region});
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, $2)").bind(key).bind(data).execute(pool).await.unwrap();
}

async fn delete(pool: &PgPool, key: &str) {
    sqlx::query("SELECT exportd_delete('acme', 'tickets', $1)").bind(key).execute(pool).await.unwrap();
}

#[sqlx::test(migrations = "./migrations")]
async fn an_incremental_estimate_counts_what_the_partners_feed_delivers(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for i in 0..37 {
        upsert(&app.pool, &format!("apac-{i}"), "apac").await;
    }
    upsert(&app.pool, "emea-1", "emea").await;
    upsert(&app.pool, "moves-out", "emea").await;
    upsert(&app.pool, "moves-out-big", "emea").await;
    let partner = app.token("acme", "zenpartner"); // row filter: region = emea
    let cursor = app.cursor_now(&partner, "tickets").await;
    // Hidden records deleted, one created and deleted since, one visible record deleted and one
    // moved out of the filter (both deletes for the partner), and one new visible record.
    for i in 0..37 {
        delete(&app.pool, &format!("apac-{i}")).await;
    }
    upsert(&app.pool, "short-lived", "emea").await;
    delete(&app.pool, "short-lived").await;
    delete(&app.pool, "emea-1").await;
    upsert(&app.pool, "moves-out", "apac").await;
    // Leaving the filter with 200 kB of data it will never receive.
    let hidden = json!({"subject": "x".repeat(200_000), "status": "open", "region": "apac"});
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', 'moves-out-big', $1)")
        .bind(hidden)
        .execute(&app.pool)
        .await
        .unwrap();
    upsert(&app.pool, "emea-2", "emea").await;
    let body = json!({"dataset": "tickets", "format": "jsonl", "mode": "incremental", "since": cursor});
    let guess = app.estimated(&partner, &body).await;
    app.pass_safety_delay();
    app.tick().await;
    let (changes, _) = app.pull_all(&partner, "tickets", &cursor, 100).await;
    assert_eq!(changes.len(), 4, "{changes:?}");
    assert_eq!(guess["rows"]["value"], 4, "the estimate counts what the feed delivers: {guess}");
    let bytes = guess["bytes"]["uncompressed"].as_u64().unwrap();
    assert!(bytes < 10_000, "a record that left the filter lends no bytes: {guess}");
    assert_eq!(guess["rows"]["method"], "changes_estimated");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_partners_estimate_does_not_depend_on_what_it_cannot_see(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 5).await;
    let partner = app.token("acme", "zenpartner");
    let nothing = json!({"dataset": "tickets", "format": "csv", "filter": {"status": "no-such-status"}});
    let small = app.estimated(&partner, &nothing).await;
    // The admin's big exports, and many hidden records, make no difference to the partner.
    app.seed("acme", "tickets", 60_000).await;
    app.seed("globex", "tickets", 20_000).await;
    let admin = app.token("acme", "alice");
    app.export(&admin, &json!({"dataset": "tickets", "format": "csv"})).await;
    app.drain().await;
    let admin_view = app.estimated(&admin, &json!({"dataset": "tickets", "format": "csv"})).await;
    assert_eq!(admin_view["duration"]["method"], "recent_exports_of_dataset");
    let big = app.estimated(&partner, &nothing).await;
    assert_eq!(big["rows"], small["rows"], "same answer with 60 000 more hidden records: {small} {big}");
    assert_eq!(big["rows"]["method"], "estimated");
    assert_eq!(big["duration"]["method"], "default_rate", "other principals' exports are not the partner's rate");
    assert_eq!(big["duration"]["rows_per_second"], small["duration"]["rows_per_second"]);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_partners_estimates_never_take_the_admins_turn(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 20).await;
    let (admin, partner) = (app.token("acme", "alice"), app.token("acme", "zenpartner"));
    let body = json!({"dataset": "tickets", "format": "csv"});
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE record_versions IN ACCESS EXCLUSIVE MODE").execute(&mut *blocker).await.unwrap();
    let (client, url, token, held) =
        (app.client.clone(), app.url("/v1/exports/estimate"), partner.clone(), body.clone());
    let partners = tokio::spawn(async move { client.post(url).bearer_auth(token).json(&held).send().await.unwrap() });
    crate::common::wait_for_lock_waiters(&app.pool, "record_versions", 1).await;
    let partners_second = app.client.post(app.url("/v1/exports/estimate")).bearer_auth(&partner).json(&body);
    let refused = partners_second.send().await.unwrap();
    assert_eq!(refused.status(), 429, "one census at a time per principal");
    assert_eq!(problem(refused).await["code"], "estimate-in-progress");
    let (client, url, held) = (app.client.clone(), app.url("/v1/exports/estimate"), body.clone());
    let admins = tokio::spawn(async move { client.post(url).bearer_auth(admin).json(&held).send().await.unwrap() });
    // The admin's census is admitted and waits on the table too (refused, it would never get
    // there) before the lock is released.
    crate::common::wait_for_lock_waiters(&app.pool, "record_versions", 2).await;
    blocker.rollback().await.unwrap();
    assert_eq!(admins.await.unwrap().status(), 200, "the admin's estimate was admitted while the partner's ran");
    assert_eq!(partners.await.unwrap().status(), 200);
}

#[sqlx::test(migrations = "./migrations")]
async fn after_a_row_filter_change_the_old_manifest_is_refused_like_its_files(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 20).await;
    let partner = app.token("acme", "zenpartner");
    let id = app.export(&partner, &full_csv(10)).await;
    app.drain().await;
    assert_eq!(app.get(Some(&partner), &format!("/v1/exports/{id}/manifest")).await.status(), 200);
    let moved = app
        .sibling(crate::common::edited_registry("acme", |t| {
            t.replace(r#"row_filter = { region = "emea" }"#, r#"row_filter = { region = "apac" }"#)
        }))
        .await;
    let manifest = app.client.get(format!("{moved}/v1/exports/{id}/manifest")).bearer_auth(&partner).send().await;
    let manifest = manifest.unwrap();
    assert_eq!(manifest.status(), 403);
    assert_eq!(problem(manifest).await["code"], "row-filter-changed");
}
