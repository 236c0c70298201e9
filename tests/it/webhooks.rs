//! Webhooks against a real receiver on a real port: signed once, retried with the same id,
//! never twice from racing processes, never to internal addresses, and one event per ending.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::receiver::{Answer, Receiver, SECRET, webhook_section};
use crate::common::{TestApp, edited_registry, full_csv};
use exportd::config::WebhookSettings;
use exportd::tenants::Registry;
use exportd::webhooks::Deliverer;
use serde_json::{Value, json};
use sqlx::PgPool;

fn settings(first_retry: Duration, timeout: Duration, retry_for: Duration, allow_loopback: bool) -> WebhookSettings {
    WebhookSettings {
        public_url: Some("https://exports.example.com".parse().unwrap()),
        webhook_allow_http: true,
        webhook_allow_nets: if allow_loopback { vec!["127.0.0.0/8".parse().unwrap()] } else { vec![] },
        webhook_timeout: timeout,
        webhook_first_retry: first_retry,
        webhook_retry_for: retry_for,
    }
}

fn quick() -> WebhookSettings {
    settings(Duration::from_millis(10), Duration::from_secs(1), Duration::from_secs(3600), true)
}

/// The fixture tenants with `sections` appended to acme's file.
fn acme_with(sections: &[String]) -> Arc<Registry> {
    let extra = sections.concat();
    edited_registry("acme", move |text| format!("{text}{extra}"))
}

/// Runs delivery passes until `done` holds (panics after 20 s).
async fn deliver_until<F, Fut>(deliverer: &Deliverer, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < Duration::from_secs(20), "webhook deliveries did not get there");
        deliverer.pass().await.expect("delivery pass");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn deliveries(app: &TestApp, query: &str) -> Vec<Value> {
    let response = app.get(Some(&app.token("acme", "alice")), &format!("/v1/webhooks/deliveries{query}")).await;
    assert_eq!(response.status(), 200);
    response.json::<Value>().await.unwrap()["deliveries"].as_array().unwrap().clone()
}

async fn cancelled_export(app: &TestApp) -> String {
    let id = app.export(&app.token("acme", "alice"), &full_csv(10)).await;
    assert_eq!(app.post(&app.token("acme", "alice"), &format!("/v1/exports/{id}/cancel")).await.status(), 202);
    app.drain().await;
    assert_eq!(app.state(&id).await, "CANCELLED");
    id
}

fn verify(received: &crate::common::receiver::Received) {
    let webhook = standardwebhooks::Webhook::new(SECRET).unwrap();
    webhook.verify(received.body.as_bytes(), &received.headers).expect("a valid Standard Webhooks signature");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_published_export_is_announced_once_signed_the_standard_webhooks_way(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let receiver = Receiver::start(vec![]).await;
    let url = receiver.url("/hooks/exportd?token=receiver-own-token");
    let registry = acme_with(&[webhook_section("ops", &url, &["export.succeeded"], SECRET)]);
    app.seed("acme", "tickets", 40).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(10)).await;
    app.drain().await;
    let deliverer = Deliverer::new(app.pool.clone(), registry, quick()).unwrap();
    deliver_until(&deliverer, || async { !receiver.received().is_empty() }).await;
    for _ in 0..5 {
        deliverer.pass().await.unwrap();
    }
    let received = receiver.received();
    assert_eq!(received.len(), 1, "delivered exactly once");
    let hook = &received[0];
    verify(hook);
    // An independent check of the same signature, by hand from the specification: base64 of
    // HMAC-SHA256, keyed with the secret after `whsec_` (base64-decoded), over
    // `{webhook-id}.{webhook-timestamp}.{body}`, sent as `v1,<signature>`.
    {
        use base64::Engine;
        use hmac::{Hmac, KeyInit, Mac};
        let b64 = base64::engine::general_purpose::STANDARD;
        let key = b64.decode(SECRET.strip_prefix("whsec_").expect("a whsec_ secret")).unwrap();
        let header = |name: &str| hook.headers[name].to_str().unwrap().to_owned();
        let signed = format!("{}.{}.{}", header("webhook-id"), header("webhook-timestamp"), hook.body);
        let mut mac = <Hmac<sha2::Sha256>>::new_from_slice(&key).unwrap();
        mac.update(signed.as_bytes());
        let expected = format!("v1,{}", b64.encode(mac.finalize().into_bytes()));
        assert!(header("webhook-signature").split(' ').any(|s| s == expected), "{}", header("webhook-signature"));
    }
    let manifest: Value =
        app.get(Some(&app.token("acme", "alice")), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    let body: Value = serde_json::from_str(&hook.body).unwrap();
    assert_eq!(body["type"], "export.succeeded");
    assert_eq!(body["data"]["export_id"], id.as_str());
    assert_eq!(body["data"]["total_rows"], 40);
    assert_eq!(body["data"]["shards"], 4);
    assert_eq!(body["data"]["file_sha256"], manifest["file"]["sha256"]);
    assert_eq!(body["data"]["total_bytes"], manifest["total_bytes"]);
    assert_eq!(body["data"]["manifest_url"], format!("https://exports.example.com/v1/exports/{id}/manifest"));
    assert_eq!(body["data"]["manifest_path"], format!("/v1/exports/{id}/manifest"));
    assert!(!hook.body.contains("/file") && !hook.body.contains("sig="), "never a signed link: {}", hook.body);
    assert_eq!(hook.path, "/hooks/exportd");

    let listed = deliveries(&app, "").await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["state"], "delivered");
    assert_eq!(listed[0]["attempts"], 1);
    assert_eq!(listed[0]["last_status"], 200);
    assert_eq!(listed[0]["event"], "export.succeeded");
    assert_eq!(listed[0]["export_id"], id.as_str());
    assert_eq!(hook.headers["webhook-id"].to_str().unwrap(), listed[0]["event_id"].as_str().unwrap());
    // Partners see none of it.
    let partner = app.get(Some(&app.token("acme", "zenpartner")), "/v1/webhooks/deliveries").await;
    assert_eq!(partner.status(), 403);
    let bad = app.get(Some(&app.token("acme", "alice")), "/v1/webhooks/deliveries?event=export.done").await;
    assert_eq!(crate::common::problem(bad).await["field"], "event");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_receiver_that_is_down_gets_the_same_event_once_it_is_up(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // A port nothing listens on yet: connections are refused.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let url = format!("http://{addr}/hook");
    let registry = acme_with(&[webhook_section("ops", &url, &["export.cancelled"], SECRET)]);
    let deliverer = Deliverer::new(app.pool.clone(), registry, quick()).unwrap();
    cancelled_export(&app).await;
    deliver_until(&deliverer, || async {
        deliveries(&app, "")
            .await
            .first()
            .is_some_and(|d| d["attempts"].as_i64() == Some(1) && d["last_error"].is_string())
    })
    .await;
    let first = &deliveries(&app, "").await[0];
    assert_eq!(first["state"], "pending");
    assert!(first["last_error"].as_str().unwrap().contains("could not connect"), "{first}");

    // Up, but failing: a 500, then a request it never answers (the timeout ends it), then 200.
    let receiver = Receiver::start_on(addr, vec![Answer::Status(500), Answer::Hang]).await;
    deliver_until(&deliverer, || async { deliveries(&app, "").await[0]["state"] == "delivered" }).await;
    let received = receiver.received();
    assert_eq!(received.len(), 3);
    let ids: Vec<&str> = received.iter().map(|r| r.headers["webhook-id"].to_str().unwrap()).collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "one webhook-id on every attempt: {ids:?}");
    assert!(received.iter().all(|r| r.body == received[0].body), "the same body on every attempt");
    received.iter().for_each(verify);
    let done = &deliveries(&app, "").await[0];
    assert_eq!(done["attempts"], 4);
    assert_eq!(done["last_status"], 200);
}

#[sqlx::test(migrations = "./migrations")]
async fn two_delivery_processes_never_deliver_one_attempt_twice(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let receiver = Receiver::start(vec![]).await;
    receiver.set_delay(Duration::from_millis(30));
    let registry = acme_with(&[
        webhook_section("one", &receiver.url("/one"), &["export.cancelled"], SECRET),
        webhook_section("two", &receiver.url("/two"), &["export.cancelled"], SECRET),
    ]);
    for _ in 0..8 {
        cancelled_export(&app).await;
    }
    let a = Deliverer::new(app.pool.clone(), registry.clone(), quick()).unwrap();
    let b = Deliverer::new(app.pool.clone(), registry, quick()).unwrap();
    let all_delivered = || async { receiver.received().len() >= 16 };
    tokio::join!(deliver_until(&a, all_delivered), deliver_until(&b, all_delivered));
    for _ in 0..3 {
        a.pass().await.unwrap();
        b.pass().await.unwrap();
    }
    let received = receiver.received();
    let mut seen: Vec<(String, String)> =
        received.iter().map(|r| (r.path.clone(), r.headers["webhook-id"].to_str().unwrap().to_owned())).collect();
    seen.sort();
    seen.dedup();
    assert_eq!((received.len(), seen.len()), (16, 16), "each event once per endpoint");
    let listed = deliveries(&app, "?state=delivered").await;
    assert_eq!(listed.len(), 16);
    assert!(listed.iter().all(|d| d["attempts"] == 1));
}

#[sqlx::test(migrations = "./migrations")]
async fn internal_addresses_are_refused_after_resolution_and_redirects_are_not_followed(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let receiver = Receiver::start(vec![]).await;
    let elsewhere = Receiver::start(vec![]).await;
    let redirecting = Receiver::start(vec![Answer::Redirect(elsewhere.url("/stolen"))]).await;
    let port = receiver.addr.port();
    let registry = acme_with(&[
        webhook_section("literal", &receiver.url("/a"), &["export.cancelled"], SECRET),
        webhook_section("named", &format!("http://localhost:{port}/b"), &["export.cancelled"], SECRET),
        webhook_section("metadata", "http://169.254.169.254/latest/meta-data/", &["export.cancelled"], SECRET),
    ]);
    // No retries: the first refusal fails the delivery.
    let strict = settings(Duration::from_millis(10), Duration::from_secs(1), Duration::ZERO, false);
    let deliverer = Deliverer::new(app.pool.clone(), registry, strict).unwrap();
    cancelled_export(&app).await;
    deliver_until(&deliverer, || async { deliveries(&app, "?state=failed").await.len() == 3 }).await;
    for delivery in deliveries(&app, "").await {
        let error = delivery["last_error"].as_str().unwrap();
        let expected = if delivery["endpoint"] == "metadata" { "link-local" } else { "loopback" };
        assert!(error.contains(expected) && error.contains("EXPORTD_WEBHOOK_ALLOW_NETS"), "{delivery}");
    }
    assert!(receiver.received().is_empty(), "nothing reached the internal receiver");

    // Allowed explicitly, a redirect is still not followed.
    let registry = acme_with(&[webhook_section("moved", &redirecting.url("/c"), &["export.cancelled"], SECRET)]);
    let allowed = settings(Duration::from_millis(10), Duration::from_secs(1), Duration::ZERO, true);
    let deliverer = Deliverer::new(app.pool.clone(), registry.clone(), allowed).unwrap();
    cancelled_export(&app).await;
    deliver_until(&deliverer, || async { deliveries(&app, "?endpoint=moved&state=failed").await.len() == 1 }).await;
    let moved = &deliveries(&app, "?endpoint=moved").await[0];
    assert_eq!(moved["last_status"], 307);
    assert!(moved["last_error"].as_str().unwrap().contains("redirects are not followed"));
    assert_eq!(redirecting.received().len(), 1);
    assert!(elsewhere.received().is_empty());

    // A failed delivery can be retried by hand: pending again, same event.
    let id = moved["id"].as_str().unwrap();
    let retried = app.post(&app.token("acme", "alice"), &format!("/v1/webhooks/deliveries/{id}/retry")).await;
    assert_eq!(retried.status(), 202);
    let retried: Value = retried.json().await.unwrap();
    assert_eq!(
        (retried["state"].as_str(), retried["event_id"].as_str()),
        (Some("pending"), moved["event_id"].as_str())
    );
    let foreign = app.post(&app.token("globex", "hank"), &format!("/v1/webhooks/deliveries/{id}/retry")).await;
    assert_eq!(foreign.status(), 404, "another tenant's delivery looks missing");

    // http:// without EXPORTD_WEBHOOK_ALLOW_HTTP is reported at start-up, naming the file and
    // field — a warning, not a stop: one tenant's endpoint never takes the others down.
    let no_http = WebhookSettings { webhook_allow_http: false, ..quick() };
    let problems =
        Deliverer::new(app.pool.clone(), registry, no_http).unwrap().endpoint_problems(std::path::Path::new("tenants"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("acme.toml: webhooks[0].url") && problems[0].contains("EXPORTD_WEBHOOK_ALLOW_HTTP"));
}

/// A tenant file whose webhook URL is a loopback literal: the process starts all the same (and
/// says why that endpoint's deliveries will fail), serves and stops cleanly.
#[sqlx::test(migrations = "./migrations")]
async fn an_unusable_webhook_url_does_not_stop_the_process(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let section = webhook_section("local", "https://127.0.0.1:9/hook", &["export.succeeded"], SECRET);
    let tenants = crate::common::edited_tenants_dir("acme", move |text| format!("{text}{section}"));
    let url = crate::common::processes::database_url(&app.pool).await;
    let log = app.data_dir.path().join("worker.log");
    let mut worker = crate::common::processes::worker_command(&url, app.data_dir.path(), &log, 1, "5s");
    let mut worker = worker.env("EXPORTD_TENANTS_DIR", tenants.path()).spawn().unwrap();
    // Up once it has registered with the cluster.
    let registered = "SELECT count(*) FROM cluster_processes WHERE runs_workers";
    let start = Instant::now();
    while sqlx::query_scalar::<_, i64>(registered).fetch_one(&app.pool).await.unwrap() == 0 {
        let exited = worker.try_wait().unwrap();
        assert!(exited.is_none(), "the worker stopped: {}", std::fs::read_to_string(&log).unwrap());
        assert!(start.elapsed() < Duration::from_secs(20), "the worker never registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    crate::common::processes::terminate(&worker);
    let status = crate::common::processes::wait_exit(&mut worker, Duration::from_secs(20)).await;
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(status.is_some_and(|s| s.success()), "{log}");
    assert!(log.contains("webhooks[0].url") && log.contains("loopback"), "the reason is logged: {log}");
}

#[sqlx::test(migrations = "./migrations")]
async fn every_ending_of_an_export_raises_its_event_in_the_same_transaction(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let receiver = Receiver::start(vec![]).await;
    let events = ["export.succeeded", "export.failed", "export.cancelled", "export.expired", "export.revoked"];
    let registry = acme_with(&[webhook_section("all", &receiver.url("/all"), &events, SECRET)]);
    app.seed("acme", "tickets", 20).await;
    let admin = app.token("acme", "alice");
    let revoked = app.export(&admin, &full_csv(10)).await;
    let expired = app.export(&admin, &full_csv(10)).await;
    app.drain().await;
    assert_eq!(
        app.client
            .delete(app.url(&format!("/v1/exports/{revoked}")))
            .bearer_auth(&admin)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    app.clock.advance(Duration::from_secs(73 * 3600));
    exportd::cleaner::run_once(&app.pool, &app.store, &app.registry, app.clock.now()).await.unwrap();
    assert_eq!(app.state(&expired).await, "EXPIRED");
    let cancelled = cancelled_export(&app).await;
    // A partner disabled while its export waits: the worker fails it.
    let failed = app.export(&app.token("acme", "zenpartner"), &full_csv(10)).await;
    let disabled = edited_registry("acme", |t| {
        t.replace("id = \"zenpartner\"\nrole = \"partner\"", "id = \"zenpartner\"\nrole = \"partner\"\ndisabled = true")
    });
    exportd::jobs::drain(&app.deps_with(disabled, app.store.clone()), "w").await.unwrap();
    assert_eq!(app.state(&failed).await, "FAILED");

    let deliverer = Deliverer::new(app.pool.clone(), registry, quick()).unwrap();
    deliver_until(&deliverer, || async { receiver.received().len() >= 6 }).await;
    let mut got: Vec<(String, String)> = receiver
        .received()
        .iter()
        .map(|r| {
            let body: Value = serde_json::from_str(&r.body).unwrap();
            (body["data"]["export_id"].as_str().unwrap().to_owned(), body["type"].as_str().unwrap().to_owned())
        })
        .collect();
    got.sort();
    let mut expected = vec![
        (revoked.clone(), "export.succeeded".to_owned()),
        (revoked, "export.revoked".to_owned()),
        (expired.clone(), "export.succeeded".to_owned()),
        (expired, "export.expired".to_owned()),
        (cancelled, "export.cancelled".to_owned()),
        (failed.clone(), "export.failed".to_owned()),
    ];
    expected.sort();
    assert_eq!(got, expected);
    let failure = deliveries(&app, &format!("?event=export.failed&export_id={failed}")).await;
    assert_eq!(failure.len(), 1);
    let body: Value =
        serde_json::from_str(&receiver.received().iter().find(|r| r.body.contains("export.failed")).unwrap().body)
            .unwrap();
    assert_eq!(body["data"]["error_code"], "permission-revoked");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_partner_that_stops_pulling_raises_feed_lagging_once_per_episode(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let receiver = Receiver::start(vec![]).await;
    let mut section = webhook_section("lag", &receiver.url("/lag"), &["feed.lagging"], SECRET);
    section.push_str("principals = [\"zenpartner\"]\n");
    let registry = acme_with(&[section, "\n[feeds]\nlagging_after_minutes = 60\n".to_owned()]);
    let deliverer = Deliverer::new(app.pool.clone(), registry, quick()).unwrap();
    let zen = app.token("acme", "zenpartner");
    let alice = app.token("acme", "alice");
    for token in [&zen, &alice] {
        let cursor = app.cursor_now(token, "tickets").await;
        app.pull(token, "tickets", &cursor, 10).await;
    }
    assert_eq!(deliverer.check_lag(app.clock.now()).await.unwrap(), 0, "both caught up");
    app.clock.advance(Duration::from_secs(2 * 3600));
    assert_eq!(deliverer.check_lag(app.clock.now()).await.unwrap(), 2);
    assert_eq!(deliverer.check_lag(app.clock.now()).await.unwrap(), 0, "once per episode");
    deliver_until(&deliverer, || async { !receiver.received().is_empty() }).await;
    for _ in 0..3 {
        deliverer.pass().await.unwrap();
    }
    let received = receiver.received();
    assert_eq!(received.len(), 1, "the endpoint is scoped to zenpartner");
    let body: Value = serde_json::from_str(&received[0].body).unwrap();
    assert_eq!(body["type"], "feed.lagging");
    assert_eq!(body["data"]["principal"], "zenpartner");
    assert_eq!(body["data"]["dataset"], "tickets");
    assert!(body["data"]["lag_seconds"].as_i64().unwrap() >= 7200);

    // Catching up ends the episode; falling behind again raises a new one.
    let cursor = app.cursor_now(&zen, "tickets").await;
    app.pull(&zen, "tickets", &cursor, 10).await;
    app.clock.advance(Duration::from_secs(2 * 3600));
    assert_eq!(deliverer.check_lag(app.clock.now()).await.unwrap(), 1);

    // An incremental export reads the feed too: creating one from a recent cursor catches up.
    let cursor = app.cursor_now(&zen, "tickets").await;
    app.export(&zen, &json!({"dataset": "tickets", "format": "jsonl", "mode": "incremental", "since": cursor})).await;
    app.clock.advance(Duration::from_secs(2 * 3600));
    assert_eq!(deliverer.check_lag(app.clock.now()).await.unwrap(), 1, "a new episode after catching up");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_delivery_process_killed_mid_attempt_is_replaced_and_the_event_arrives_with_the_same_id(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // The first attempt never gets an answer: the process is killed while it waits.
    let receiver = Receiver::start(vec![Answer::Hang]).await;
    let section = webhook_section("ops", &receiver.url("/k"), &["export.cancelled"], SECRET);
    let tenants = crate::common::edited_tenants_dir("acme", |text| format!("{text}{section}"));
    // The state change is committed; no delivery process runs yet.
    cancelled_export(&app).await;
    let database_url = crate::common::processes::database_url(&app.pool).await;
    let log = app.data_dir.path().join("worker.log");
    let spawn = || {
        crate::common::processes::worker_command(&database_url, app.data_dir.path(), &log, 1, "2s")
            .env("EXPORTD_TENANTS_DIR", tenants.path())
            .env("EXPORTD_WEBHOOK_ALLOW_HTTP", "true")
            .env("EXPORTD_WEBHOOK_ALLOW_NETS", "127.0.0.0/8")
            .env("EXPORTD_WEBHOOK_TIMEOUT", "2s")
            .env("EXPORTD_WEBHOOK_FIRST_RETRY", "100ms")
            .spawn()
            .expect("exportd worker starts")
    };
    let mut first = spawn();
    receiver.wait_for(1, Duration::from_secs(30)).await;
    first.kill().unwrap(); // SIGKILL, mid-attempt
    first.wait().unwrap();
    let mut second = spawn();
    // Its lease (timeout + 5 s) runs out; the new process attempts again.
    let received = receiver.wait_for(2, Duration::from_secs(40)).await;
    let start = Instant::now();
    while deliveries(&app, "").await[0]["state"] != "delivered" {
        assert!(start.elapsed() < Duration::from_secs(20), "not recorded as delivered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Stopped as a supervisor stops it, so its connections close before the test's database is
    // dropped (a SIGKILLed process's backend can outlive it by seconds and keep the drop from
    // happening: this test was the one whose database a green run left behind).
    crate::common::processes::terminate(&second);
    let stopped = crate::common::processes::wait_exit(&mut second, Duration::from_secs(30)).await;
    assert!(stopped.is_some_and(|status| status.success()), "the worker stops on SIGTERM");
    assert_eq!(received[0].headers["webhook-id"], received[1].headers["webhook-id"]);
    assert_eq!(received[0].body, received[1].body);
    received.iter().for_each(verify);
    assert_eq!(deliveries(&app, "").await[0]["attempts"], 2);
}

#[sqlx::test(migrations = "./migrations")]
async fn an_endpoint_that_always_fails_has_a_bounded_backlog_and_the_others_still_get_theirs(pool: PgPool) {
    use exportd::webhooks::outbox::MAX_PENDING_PER_ENDPOINT;
    let app = TestApp::spawn(pool).await;
    let dead = format!("http://{}/hook", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap());
    let receiver = Receiver::start(vec![]).await;
    let registry = acme_with(&[
        webhook_section("dead", &dead, &["export.cancelled"], SECRET),
        webhook_section("ops", &receiver.url("/hook"), &["export.cancelled"], SECRET),
    ]);
    // Days of failures: the dead endpoint already has its whole backlog pending.
    sqlx::query(
        "WITH e AS (INSERT INTO webhook_events (tenant, type, data, routed_at)
                    SELECT 'acme', 'export.cancelled', '{}', now() FROM generate_series(1, $1) RETURNING id)
         INSERT INTO webhook_deliveries (event_id, tenant, endpoint, body, give_up_at)
         SELECT id, 'acme', 'dead', '{}', now() + interval '1 day' FROM e",
    )
    .bind(MAX_PENDING_PER_ENDPOINT)
    .execute(&app.pool)
    .await
    .unwrap();
    let deliverer = Deliverer::new(app.pool.clone(), registry, quick()).unwrap();
    cancelled_export(&app).await;
    deliver_until(&deliverer, || async { receiver.received().len() == 1 }).await;
    let refused: (String, String) = sqlx::query_as(
        "SELECT d.state, d.last_error FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id
         WHERE d.endpoint = 'dead' AND e.export_id IS NOT NULL",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(refused.0, "failed", "past the cap a delivery is recorded as failed at once");
    assert!(refused.1.contains("10000 deliveries pending"), "{}", refused.1);
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND endpoint = 'dead'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(pending, MAX_PENDING_PER_ENDPOINT, "the backlog did not grow");
}
