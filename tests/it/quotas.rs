//! Per-tenant limits under concurrency.

use crate::common::{TestApp, problem};
use serde_json::json;
use sqlx::PgPool;

#[sqlx::test(migrations = "./migrations")]
async fn fifty_concurrent_creates_leave_exactly_the_queue_limit(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("globex", "hank"); // max_queued_exports = 5
    let body = json!({"dataset": "tickets", "format": "csv"});
    let keys: Vec<String> = (0..50).map(|n| format!("create-{n}")).collect();
    let responses =
        futures_util::future::join_all(keys.iter().map(|k| app.create_export(&token, Some(k), &body))).await;
    let mut accepted = 0;
    for response in responses {
        match response.status().as_u16() {
            202 => accepted += 1,
            429 => {
                assert!(response.headers()["retry-after"].to_str().unwrap().parse::<u64>().unwrap() > 0);
                let body = problem(response).await;
                assert_eq!(body["code"], "quota-exceeded");
                assert_eq!(body["limit"], "max_queued_exports");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(accepted, 5);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM export_jobs WHERE tenant = 'globex'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 5);
    // Another tenant is not affected.
    assert_eq!(app.create_export(&app.token("acme", "alice"), Some("k"), &body).await.status(), 202);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_burst_over_the_api_rate_gets_429_then_recovers(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let token = app.token("initech", "bill"); // 2 requests/s, burst 3
    let responses = futures_util::future::join_all((0..8).map(|_| app.get(Some(&token), "/v1/datasets"))).await;
    let limited: Vec<&reqwest::Response> = responses.iter().filter(|r| r.status() == 429).collect();
    assert!(limited.len() >= 4, "{} of 8 refused", limited.len());
    assert_eq!(responses.iter().filter(|r| r.status() == 200).count() + limited.len(), 8);
    let retry: u64 = limited[0].headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1);
    // Partners have buckets of their own; other tenants are not affected.
    assert_eq!(app.get(Some(&app.token("initech", "milton")), "/v1/datasets").await.status(), 200);
    assert_eq!(app.get(Some(&app.token("acme", "alice")), "/v1/datasets").await.status(), 200);
    // Waiting what the server said is enough.
    tokio::time::sleep(std::time::Duration::from_secs(retry)).await;
    assert_eq!(app.get(Some(&token), "/v1/datasets").await.status(), 200);
    // Counted in memory and flushed about every second.
    let counted = async {
        for _ in 0..500 {
            let n: Option<i64> = sqlx::query_scalar("SELECT rate_limited FROM tenant_usage WHERE tenant = 'initech'")
                .fetch_optional(&app.pool)
                .await
                .unwrap();
            if n.unwrap_or(0) >= limited.len() as i64 {
                return true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        false
    };
    assert!(counted.await, "refusals are counted for the usage API");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_small_export_of_another_tenant_does_not_wait_behind_a_big_queue(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 40).await;
    app.seed("globex", "tickets", 5).await;
    let (acme, globex) = (app.token("acme", "alice"), app.token("globex", "hank"));
    let mut big = Vec::new();
    for _ in 0..20 {
        big.push(app.export(&acme, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 10})).await);
    }
    let small = app.export(&globex, &json!({"dataset": "tickets", "format": "csv"})).await;

    // Two workers at once.
    let (deps_one, deps_two) = (app.deps(), app.deps());
    let (one, two) =
        tokio::join!(exportd::jobs::drain(&deps_one, "worker-1"), exportd::jobs::drain(&deps_two, "worker-2"));
    assert_eq!(one.unwrap().len() + two.unwrap().len(), 21);
    let order: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM export_jobs WHERE state = 'SUCCEEDED' ORDER BY finished_at, id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(order.len(), 21);
    let small_at = order.iter().position(|id| id == &small).unwrap();
    let third_big_at = order.iter().position(|id| id == &big[2]).unwrap();
    assert!(small_at < third_big_at, "the small export finished {small_at}th, the third big one {third_big_at}th");
    assert!(small_at <= 2, "finished {small_at}th");
}

#[sqlx::test(migrations = "./migrations")]
async fn usage_shows_limits_counts_and_released_storage(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 120).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 50})).await;
    app.export(&admin, &json!({"dataset": "contacts", "format": "csv"})).await;
    let usage: serde_json::Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();
    assert_eq!(usage["usage"]["queued_exports"], 2);
    assert!(usage["queue"]["oldest_queued_age_seconds"].as_i64().unwrap() >= 0);
    assert_eq!(usage["limits"]["max_queued_exports"], 50);
    app.drain().await;

    let status: serde_json::Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    let body =
        app.client.get(app.url(status["links"]["file"].as_str().unwrap())).send().await.unwrap().bytes().await.unwrap();
    let usage: serde_json::Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();
    let stored: i64 =
        sqlx::query_scalar("SELECT sum(bytes)::bigint FROM export_shards").fetch_one(&app.pool).await.unwrap();
    assert_eq!(usage["usage"]["stored_bytes"], stored);
    assert_eq!(usage["usage"]["egress_bytes_today"], body.len());
    assert_eq!(usage["usage"]["rows_exported_today"], 120);
    assert_eq!(usage["queue"]["states"]["SUCCEEDED"], 2);

    app.client.delete(app.url(&format!("/v1/exports/{id}"))).bearer_auth(&admin).send().await.unwrap();
    let usage: serde_json::Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT coalesce(sum(s.bytes), 0)::bigint FROM export_shards s JOIN export_jobs j ON j.id = s.export_id WHERE j.state = 'SUCCEEDED'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(usage["usage"]["stored_bytes"], left, "the revoked export's bytes are released");
    assert!(left < stored);
    assert_eq!(app.get(Some(&app.token("acme", "zenpartner")), "/v1/usage").await.status(), 403);
}

#[sqlx::test(migrations = "./migrations")]
async fn an_export_past_the_storage_quota_fails_and_frees_its_shards(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("hooli", "tickets", 600).await; // storage_bytes = 20 000: a few shards only
    let admin = app.token("hooli", "gavin");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 100})).await;
    assert_eq!(app.drain().await, vec![exportd::jobs::Step::Failed { code: "storage-quota-exceeded".into() }]);
    let status: serde_json::Value = app.get(Some(&admin), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_eq!(status["error"]["code"], "storage-quota-exceeded");
    assert!(!app.data_dir.path().join(format!("objects/hooli/{id}")).exists());
    let usage: serde_json::Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();
    assert_eq!(usage["usage"]["stored_bytes"], 0);
}

#[sqlx::test(migrations = "./migrations")]
async fn downloads_past_the_daily_egress_quota_get_429_until_midnight(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("hooli", "tickets", 60).await;
    let admin = app.token("hooli", "gavin");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv"})).await;
    app.drain().await;
    let path = format!("/v1/exports/{id}/file");
    let mut served = 0u64;
    let mut attempts = 0;
    let refused = loop {
        attempts += 1;
        assert!(attempts <= 1000, "never refused");
        let response = app.get(Some(&admin), &path).await;
        if response.status() == 429 {
            break response;
        }
        assert_eq!(response.status(), 200);
        served += response.bytes().await.unwrap().len() as u64;
        assert!(served <= 30_000, "served past the quota");
    };
    assert!(served > 0);
    let wait: u64 = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=86_400).contains(&wait));
    assert_eq!(problem(refused).await["code"], "egress-quota-exceeded");
    // The next day is a new budget.
    let usage: serde_json::Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();
    assert_eq!(usage["usage"]["egress_bytes_today"], served);
    app.clock.advance(std::time::Duration::from_secs(wait));
    assert_eq!(app.get(Some(&admin), &path).await.status(), 200);
}

/// The value of a metric line `name{labels} value` in Prometheus text.
fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(name_and_labels)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[sqlx::test(migrations = "./migrations")]
async fn metrics_report_jobs_shards_downloads_and_rejections(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 30).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 10})).await;
    app.export(&admin, &json!({"dataset": "contacts", "format": "csv"})).await;
    let before = app.get(None, "/metrics").await.text().await.unwrap();
    assert_eq!(metric(&before, r#"exportd_exports{tenant="acme",state="QUEUED"}"#), Some(2.0), "{before}");
    assert!(metric(&before, r#"exportd_export_oldest_age_seconds{tenant="acme",state="QUEUED"}"#).is_some());
    let written_before = metric(&before, "exportd_shards_written_total").unwrap_or(0.0);
    // How much of each quota is used: two of acme's 50 queued exports.
    let queued = metric(&before, r#"exportd_quota_used_ratio{tenant="acme",quota="queued_exports"}"#);
    assert_eq!(queued, Some(2.0 / 50.0), "{before}");
    assert!(metric(&before, r#"exportd_quota_used_ratio{tenant="acme",quota="egress_bytes_per_day"}"#).is_some());
    assert_eq!(metric(&before, "exportd_store_reachable"), Some(1.0), "{before}");

    app.drain().await;
    app.get(Some(&admin), &format!("/v1/exports/{id}/file")).await.bytes().await.unwrap();
    let response = app.get(None, "/metrics").await;
    assert_eq!(response.headers()["content-type"], "text/plain; version=0.0.4");
    let after = response.text().await.unwrap();
    assert_eq!(metric(&after, r#"exportd_exports{tenant="acme",state="SUCCEEDED"}"#), Some(2.0));
    assert_eq!(metric(&after, r#"exportd_exports{tenant="acme",state="QUEUED"}"#), Some(0.0));
    assert!(metric(&after, "exportd_shards_written_total").unwrap() >= written_before + 4.0);
    assert!(after.contains("exportd_export_duration_seconds_bucket"), "{after}");
    assert!(metric(&after, r#"exportd_downloads_total{status="200"}"#).unwrap() >= 1.0);
    assert!(after.contains(r#"exportd_egress_bytes_total{tenant="acme"}"#));
    assert!(!after.contains("tickets-0000"), "no record data in metrics");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_tenant_cannot_scan_faster_than_its_rate(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("initech", "tickets", 600).await; // scan_rows_per_second = 200, one second of burst
    let id = app.export(&app.token("initech", "bill"), &json!({"dataset": "tickets", "format": "csv"})).await;
    let started = std::time::Instant::now();
    assert_eq!(app.drain().await, vec![exportd::jobs::Step::Published]);
    let elapsed = started.elapsed().as_secs_f64();
    // 200 rows of burst, then 400 rows at 200 rows/s.
    assert!(elapsed >= 1.9, "600 rows scanned in {elapsed:.2} s at 200 rows/s");
    assert_eq!(app.state(&id).await, "SUCCEEDED");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_throttled_export_is_claimed_once_per_budget_not_over_and_over(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("initech", "tickets", 800).await; // 200 rows/s, one second of burst
    let id = app
        .export(&app.token("initech", "bill"), &json!({"dataset": "tickets", "format": "csv", "shard_rows": 200}))
        .await;
    assert_eq!(app.drain().await, vec![exportd::jobs::Step::Published]);
    // Four shards of one second's budget each: the worker rests between them instead of
    // claiming the job and giving it back while the budget refills (it used to take ~3 claims
    // a shard).
    let (claims, shards): (i64, i32) =
        sqlx::query_as("SELECT lease_generation, shards_done FROM export_jobs WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(shards, 4);
    assert!(claims <= 5, "{claims} claims for {shards} throttled shards");
}

#[sqlx::test(migrations = "./migrations")]
async fn while_a_tenant_waits_for_its_scan_rate_the_worker_serves_another(pool: PgPool) {
    use exportd::jobs::{ClaimedExport, Step};
    let app = TestApp::spawn(pool).await;
    app.seed("initech", "tickets", 600).await; // 200 rows/s, one second of burst
    app.seed("acme", "tickets", 30).await;
    let slow = app
        .export(&app.token("initech", "bill"), &json!({"dataset": "tickets", "format": "csv", "shard_rows": 200}))
        .await;
    let quick = app
        .export(&app.token("acme", "alice"), &json!({"dataset": "tickets", "format": "csv", "shard_rows": 100}))
        .await;
    let deps = app.deps();
    let mut run = ClaimedExport::claim(&deps, "w").await.unwrap().unwrap();
    assert_eq!(run.lease().job_id.to_string(), slow);
    assert!(matches!(run.step().await.unwrap(), Step::ShardWritten { index: 0, .. }));
    // Shard 0 took the whole second of burst: shard 1 is not started, and nothing is read.
    let third = run.step().await.unwrap();
    let Step::Throttled { wait } = third else { panic!("expected throttling, got {third:?}") };
    assert!(wait > std::time::Duration::ZERO);
    let shards: i64 = sqlx::query_scalar("SELECT count(*) FROM export_shards").fetch_one(&app.pool).await.unwrap();
    assert_eq!(shards, 1);
    run.release().await.unwrap();
    // Meanwhile the worker serves the other tenant.
    let next = ClaimedExport::claim(&deps, "w").await.unwrap().unwrap();
    assert_eq!(next.lease().job_id.to_string(), quick);
    drop(next);
    sqlx::query("UPDATE export_jobs SET lease_expires_at = NULL").execute(&app.pool).await.unwrap();
    assert_eq!(app.drain().await.len(), 2, "both finish");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_worker_replaced_mid_job_does_not_double_count(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 50).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 10})).await;
    let deps = app.deps();
    let mut doomed = exportd::jobs::ClaimedExport::claim(&deps, "doomed").await.unwrap().unwrap();
    doomed.step().await.unwrap();
    doomed.step().await.unwrap();
    drop(doomed); // the worker process dies holding its lease
    let usage = || async { app.get(Some(&admin), "/v1/usage").await.json::<serde_json::Value>().await.unwrap() };
    let during = usage().await;
    assert_eq!(during["usage"]["running_exports"], 1);
    let two_shards: i64 =
        sqlx::query_scalar("SELECT sum(bytes)::bigint FROM export_shards").fetch_one(&app.pool).await.unwrap();
    assert_eq!(during["usage"]["stored_bytes"], two_shards);

    sqlx::query("UPDATE export_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1::uuid")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(app.drain().await, vec![exportd::jobs::Step::Published]);
    let after = usage().await;
    let manifest: serde_json::Value =
        app.get(Some(&admin), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    assert_eq!(after["usage"]["running_exports"], 0);
    assert_eq!(after["usage"]["stored_bytes"], manifest["total_bytes"], "each shard counted once");
    assert_eq!(after["usage"]["rows_exported_today"], 50);
}

#[sqlx::test(migrations = "./migrations")]
async fn metrics_are_closed_unless_opened_and_a_token_guards_them(pool: PgPool) {
    use exportd::http::{MetricsAccess, MetricsPage};
    let app = TestApp::spawn(pool).await;
    let closed = app.sibling(app.registry.clone()).await;
    let refused = app.client.get(format!("{closed}/metrics")).send().await.unwrap();
    assert_eq!(refused.status(), 403, "closed by default: the page names every tenant");
    assert_eq!(problem(refused).await["code"], "metrics-closed");
    let guarded = MetricsAccess::Token("scrape-secret".into());
    let base = app.sibling_with(app.registry.clone(), |s| s.metrics = MetricsPage::new(guarded)).await;
    let url = format!("{base}/metrics");
    assert_eq!(app.client.get(&url).send().await.unwrap().status(), 401);
    assert_eq!(app.client.get(&url).bearer_auth("wrong").send().await.unwrap().status(), 401);
    let ok = app.client.get(&url).bearer_auth("scrape-secret").send().await.unwrap();
    assert_eq!(ok.status(), 200);
    assert!(ok.text().await.unwrap().contains("exportd_exports"));
}

/// Two API processes (each its own governor buckets) sharing one tenant: registered in
/// PostgreSQL, each enforces half the rate, so the tenant gets its configured rate in total —
/// not twice it. When one leaves, the other takes the whole rate again.
#[sqlx::test(migrations = "./migrations")]
async fn two_api_processes_admit_the_configured_rate_in_total(pool: PgPool) {
    use exportd::cluster::{Membership, Roles};
    use exportd::quota::{RateLimits, ScanLimits};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let app = TestApp::spawn(pool).await;
    let roles = Roles { api: true, workers: false };
    let mut processes = Vec::new();
    for _ in 0..2 {
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        let limits = Arc::new(RateLimits::new(&app.registry));
        let membership = Membership::join(&app.pool, roles, shutdown);
        let scan = Arc::new(ScanLimits::new(&app.registry));
        tokio::spawn(exportd::server::follow_shares(membership, Some(limits.clone()), scan));
        let with_limits = limits.clone();
        let url = app.sibling_with(app.registry.clone(), move |state| state.limits = with_limits).await;
        processes.push((url, limits, stop));
    }
    // The first process learns of the second at its next heartbeat.
    let deadline = Instant::now() + Duration::from_secs(10);
    while processes.iter().any(|(_, limits, _)| limits.share() != 2) {
        assert!(Instant::now() < deadline, "the processes never saw each other");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // globex: 100 requests/s, burst 200. Offer 5× the rate, half to each process, for 4 s.
    let token = app.token("globex", "hank");
    let (seconds, per_process_rate) = (4u64, 250u64);
    let offered = Instant::now();
    let mut load = tokio::task::JoinSet::new();
    for (url, _, _) in &processes {
        let (client, url, token) = (app.client.clone(), format!("{url}/v1/datasets"), token.clone());
        load.spawn(async move {
            let mut ticks = tokio::time::interval(Duration::from_micros(1_000_000 / per_process_rate));
            let mut requests = tokio::task::JoinSet::new();
            for _ in 0..seconds * per_process_rate {
                ticks.tick().await;
                let request = client.get(&url).bearer_auth(&token);
                requests.spawn(async move { request.send().await.map(|r| r.status().as_u16()).unwrap_or(0) });
            }
            requests.join_all().await
        });
    }
    let statuses: Vec<u16> = load.join_all().await.into_iter().flatten().collect();
    // However slowly this machine offered the load: at most the burst plus the rate over the
    // time it took (two processes each enforcing the whole rate would admit about twice that),
    // and at least most of what 4 s allow (the load is 5× the rate).
    let took = offered.elapsed().as_secs_f64();
    let admitted = statuses.iter().filter(|s| **s == 200).count() as f64;
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(admitted as usize + refused, statuses.len(), "only 200s and 429s");
    let (at_least, at_most) = (0.75 * (200.0 + 100.0 * seconds as f64), 1.1 * (200.0 + 100.0 * took));
    eprintln!("admitted {admitted} of {} offered over {took:.2} s; allowed {at_least}..={at_most}", statuses.len());
    assert!(
        (at_least..=at_most).contains(&admitted),
        "admitted {admitted} of {} offered over {took:.2} s; the configured rate allows {at_least}..={at_most}",
        statuses.len()
    );

    // One process leaves: the other enforces the whole rate again.
    let (_, remaining, _) = &processes[0];
    processes[1].2.send_replace(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    while remaining.share() != 1 {
        assert!(Instant::now() < deadline, "the departure was never noticed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Workers of several processes claiming at the same moment: a tenant gets exactly its
/// max_running_exports claimed, however many claims race (each claim locks only the job it takes,
/// so without serializing the claims several saw the tenant idle and took one each).
#[sqlx::test(migrations = "./migrations")]
async fn racing_claims_never_exceed_max_running_exports(pool: PgPool) {
    use exportd::jobs::ClaimedExport;
    let app = TestApp::spawn(pool).await;
    let token = app.token("globex", "hank");
    let max_running = app.tenant("globex").quota.max_running_exports as usize;
    for n in 0..5 {
        let body = json!({"dataset": "tickets", "format": "csv"});
        assert_eq!(app.create_export(&token, Some(&format!("race-{n}")), &body).await.status(), 202);
    }
    let deps = app.deps();
    for round in 0..5 {
        let claims = futures_util::future::join_all(
            (0..8).map(|n| ClaimedExport::claim(&deps, Box::leak(format!("w{round}-{n}").into_boxed_str()))),
        )
        .await;
        let claimed: Vec<_> = claims.into_iter().filter_map(|c| c.unwrap()).collect();
        assert_eq!(claimed.len(), max_running, "round {round}: {} globex exports claimed at once", claimed.len());
        for run in claimed {
            run.release().await.unwrap();
        }
    }
}

/// Today's refusals of `tenant` per kind, as stored (flushed about every second).
async fn stored_refusals(pool: &PgPool, tenant: &str) -> std::collections::BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT kind, count FROM tenant_refusals WHERE tenant = $1")
        .bind(tenant)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Waits (up to 10 s) until `tenant`'s stored refusals are `expected`.
async fn wait_for_refusals(pool: &PgPool, tenant: &str, expected: &[(&str, i64)]) {
    let expected: std::collections::BTreeMap<String, i64> = expected.iter().map(|(k, n)| (k.to_string(), *n)).collect();
    for _ in 0..200 {
        if stored_refusals(pool, tenant).await == expected {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(stored_refusals(pool, tenant).await, expected, "{tenant}'s refusals were not flushed");
}

#[sqlx::test(migrations = "./migrations")]
async fn every_kind_of_refusal_is_counted_durably_and_shown_by_kind(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // Egress: hooli downloads one small export until its daily egress is used up.
    app.seed("hooli", "tickets", 60).await;
    let gavin = app.token("hooli", "gavin");
    let small = app.export(&gavin, &json!({"dataset": "tickets", "format": "csv"})).await;
    app.drain().await;
    while app.get(Some(&gavin), &format!("/v1/exports/{small}/file")).await.status() == 200 {}
    // Storage: a bigger export does not fit hooli's storage_bytes.
    app.seed("hooli", "tickets", 600).await;
    app.export(&gavin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 100})).await;
    assert_eq!(app.drain().await, vec![exportd::jobs::Step::Failed { code: "storage-quota-exceeded".into() }]);
    // Queued: globex queues at most 5.
    let hank = app.token("globex", "hank");
    for n in 0..7 {
        app.create_export(&hank, Some(&format!("q-{n}")), &json!({"dataset": "tickets", "format": "csv"})).await;
    }
    // Rate: initech admits 2 requests a second (burst 3).
    let bill = app.token("initech", "bill");
    let mut refused = 0;
    for _ in 0..10 {
        if app.get(Some(&bill), "/v1/datasets").await.status() == 429 {
            refused += 1;
        }
    }
    assert!(refused >= 5, "{refused}");

    let usage: serde_json::Value = app.get(Some(&gavin), "/v1/usage").await.json().await.unwrap();
    let today = &usage["usage"]["refusals_today"];
    assert_eq!((&today["egress"], &today["storage"], &today["rate"]), (&json!(1), &json!(1), &json!(0)));
    assert_eq!(usage["usage"]["quota_rejections"], 2, "storage and egress refusals count too");
    let usage: serde_json::Value = app.get(Some(&hank), "/v1/usage").await.json().await.unwrap();
    assert_eq!(usage["usage"]["refusals_today"]["queued"], 2);
    assert_eq!(usage["usage"]["quota_rejections"], 2);
    // Durable: each process's counts reach the database (and survive it).
    wait_for_refusals(&app.pool, "hooli", &[("egress", 1), ("storage", 1)]).await;
    wait_for_refusals(&app.pool, "globex", &[("queued", 2)]).await;
    wait_for_refusals(&app.pool, "initech", &[("rate", refused)]).await;
    let totals: (i64, i64) =
        sqlx::query_as("SELECT rate_limited, quota_rejections FROM tenant_usage WHERE tenant = 'initech'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(totals, (refused, 0));
}

async fn history(app: &TestApp, token: &str, query: &str) -> reqwest::Response {
    app.get(Some(token), &format!("/v1/usage/history?{query}")).await
}

#[sqlx::test(migrations = "./migrations")]
async fn the_usage_history_records_what_the_usage_api_shows(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 60).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 25})).await;
    app.drain().await;
    let file = app.get(Some(&admin), &format!("/v1/exports/{id}/file")).await.bytes().await.unwrap();
    app.export(&admin, &json!({"dataset": "tickets", "format": "jsonl"})).await; // stays queued
    let acme = exportd::tenants::TenantId::parse("acme").unwrap();
    exportd::quota::refusals::count_now(&app.pool, &acme, exportd::quota::RefusalKind::Storage).await.unwrap();
    let usage: serde_json::Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();

    // Recording twice (two processes, or one a minute later) changes nothing.
    for _ in 0..2 {
        // Another process may hold the lock for a moment (the test server's own housekeeping).
        while !exportd::usage::history::record(&app.pool, &["acme", "globex"]).await.unwrap() {}
    }
    let today: serde_json::Value = history(&app, &admin, "granularity=day").await.json().await.unwrap();
    assert_eq!(today["granularity"], "day");
    assert_eq!(today["points"].as_array().unwrap().len(), 30, "the last 30 days by default");
    let day = today["points"].as_array().unwrap().last().unwrap();
    let u = &usage["usage"];
    assert_eq!(day["rows_exported"], u["rows_exported_today"]);
    assert_eq!(day["rows_exported"], 60);
    assert_eq!(day["egress_bytes"], u["egress_bytes_today"]);
    assert_eq!(day["egress_bytes"], file.len());
    assert_eq!(day["exports_succeeded"], 1);
    assert_eq!(day["refusals"], u["refusals_today"], "every kind, per kind");
    assert_eq!(day["refusals"]["storage"], 1);
    assert_eq!(day["stored_bytes_max"], u["stored_bytes"]);
    assert_eq!(day["queued_max"], 1);
    assert!(day["export_seconds_p95"].as_f64().unwrap() >= day["export_seconds_p50"].as_f64().unwrap());
    assert_eq!(today["limits"]["storage_bytes"], usage["limits"]["storage_bytes"]);

    let hours: serde_json::Value = history(&app, &admin, "granularity=hour").await.json().await.unwrap();
    let points = hours["points"].as_array().unwrap();
    assert_eq!(points.len(), 24);
    let sum = |field: &str| points.iter().map(|p| p[field].as_i64().unwrap()).sum::<i64>();
    assert_eq!(sum("rows_exported"), 60, "the hours add up to the day");
    assert_eq!(sum("egress_bytes"), file.len() as i64);

    let globex: serde_json::Value =
        history(&app, &app.token("globex", "hank"), "granularity=day").await.json().await.unwrap();
    let last = globex["points"].as_array().unwrap().last().unwrap().clone();
    assert_eq!((last["rows_exported"].clone(), last["egress_bytes"].clone()), (json!(0), json!(0)), "per tenant");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_month_of_history_reads_per_day_and_per_hour_with_every_bucket_present(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // 30 days of generated hours for acme (hour 5 of each day missing), and noise for globex.
    sqlx::query(
        "INSERT INTO tenant_usage_hours (tenant, hour, egress_bytes, rows_exported, exports_succeeded, refusals,
                                         stored_bytes_max, export_seconds_p95)
         SELECT t, h, 1000 * d + hr, 10, 1, jsonb_build_object('rate', 2, 'queued', hr % 2), hr * 100, hr
         FROM unnest(ARRAY['acme', 'globex']) t,
              generate_series('2026-11-01T00:00:00Z'::timestamptz, '2026-11-30T23:00:00Z', interval '1 hour') h,
              LATERAL (SELECT extract(day FROM h AT TIME ZONE 'UTC')::int AS d,
                              extract(hour FROM h AT TIME ZONE 'UTC')::int AS hr) utc
         WHERE t = 'globex' OR hr <> 5",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let admin = app.token("acme", "alice");
    let month: serde_json::Value =
        history(&app, &admin, "granularity=day&from=2026-11-01T00:00:00Z&to=2026-12-01T00:00:00Z")
            .await
            .json()
            .await
            .unwrap();
    let days = month["points"].as_array().unwrap();
    assert_eq!(days.len(), 30);
    for (i, day) in days.iter().enumerate() {
        let n = i as i64 + 1;
        assert_eq!(day["start"], format!("2026-11-{n:02}T00:00:00Z"));
        let hours: i64 = (0..24).filter(|&h| h != 5).sum();
        assert_eq!(day["egress_bytes"], 23 * 1000 * n + hours, "day {n}");
        assert_eq!(day["rows_exported"], 230);
        assert_eq!(day["exports_succeeded"], 23);
        assert_eq!(day["refusals"]["rate"], 46);
        assert_eq!(day["refusals"]["queued"], 11, "the odd hours but 5");
        assert_eq!(day["refusals"]["egress"], 0, "every kind present");
        assert_eq!(day["stored_bytes_max"], 2300, "gauges: the day's highest");
        assert_eq!(day["export_seconds_p95"], 23.0);
    }
    let one_day: serde_json::Value =
        history(&app, &admin, "granularity=hour&from=2026-11-07T00:30:00Z&to=2026-11-07T23:10:00Z")
            .await
            .json()
            .await
            .unwrap();
    let hours = one_day["points"].as_array().unwrap();
    assert_eq!(one_day["from"], "2026-11-07T00:00:00Z", "rounded out to whole hours");
    assert_eq!(one_day["to"], "2026-11-08T00:00:00Z");
    assert_eq!(hours.len(), 24);
    assert_eq!(hours[4]["egress_bytes"], 7004);
    assert_eq!(hours[5]["egress_bytes"], 0, "an hour without a row is present, as zeros");
    assert_eq!(hours[5]["export_seconds_p95"], serde_json::Value::Null);

    for (query, field) in [
        ("granularity=week", "granularity"),
        ("from=yesterday", "from"),
        ("to=2026-13-01T00:00:00Z", "to"),
        ("from=2026-11-02T00:00:00Z&to=2026-11-01T00:00:00Z", "from"),
        ("granularity=hour&from=2026-10-01T00:00:00Z&to=2026-11-15T00:00:00Z", "from"),
    ] {
        let refused = history(&app, &admin, query).await;
        assert_eq!(refused.status(), 400, "{query}");
        assert_eq!(problem(refused).await["field"], field, "{query}");
    }
    let partner = history(&app, &app.token("acme", "zenpartner"), "").await;
    assert_eq!(partner.status(), 403);
}

#[sqlx::test(migrations = "./migrations")]
async fn usage_history_is_kept_ninety_days(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    sqlx::query(
        "INSERT INTO tenant_usage_hours (tenant, hour, egress_bytes)
         SELECT 'acme', date_trunc('hour', now()) - d * interval '1 day', d FROM unnest(ARRAY[10, 89, 91, 200]) d",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let collected = exportd::usage::history::collect(&app.pool, time::OffsetDateTime::now_utc()).await.unwrap();
    assert_eq!(collected, 2);
    let kept: Vec<i64> = sqlx::query_scalar("SELECT egress_bytes FROM tenant_usage_hours ORDER BY egress_bytes")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(kept, [10, 89]);
}

/// Egress counts what was sent: a download charged in full when admitted gives back what it did
/// not send — on its own day only (after midnight the new day's budget is left alone), never more
/// than it was charged — and its audit entry then says what went out.
#[sqlx::test(migrations = "./migrations")]
async fn egress_gives_back_unsent_bytes_on_their_own_day_only(pool: PgPool) {
    use exportd::audit::AuditEvent;
    use exportd::quota::{admit_download, egress_today, refund_unsent};
    let app = TestApp::spawn(pool).await;
    let tenant = app.registry.get("hooli").unwrap().clone(); // 30 000 bytes a day
    let event = |bytes| AuditEvent {
        tenant: "hooli",
        principal: "gavin",
        action: "downloaded",
        export_id: None,
        object: Some("file".into()),
        byte_range: None,
        status: Some(200),
        address: None,
        bytes: Some(bytes),
    };
    let late = time::macros::datetime!(2026-12-07 23:59:00 UTC);
    let today = |at| {
        let pool = app.pool.clone();
        async move { egress_today(&pool, "hooli", at).await.unwrap() }
    };
    let first = admit_download(&app.pool, &tenant, event(10_000), late).await.unwrap().unwrap();
    let second = admit_download(&app.pool, &tenant, event(20_000), late).await.unwrap().unwrap();
    assert_eq!(today(late).await, 30_000);
    assert!(admit_download(&app.pool, &tenant, event(1), late).await.unwrap().is_err(), "the day is used up");
    // The first download's client left after 4 000 bytes: 6 000 come back and can be used again.
    refund_unsent(&app.pool, "hooli", first, 4_000).await.unwrap();
    assert_eq!(today(late).await, 24_000);
    let audited: Option<i64> = sqlx::query_scalar("SELECT bytes FROM audit_log WHERE id = $1")
        .bind(first.audit_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(audited, Some(4_000), "the audit log says what was sent");
    // Sending everything (or more than charged) gives nothing back.
    refund_unsent(&app.pool, "hooli", second, 25_000).await.unwrap();
    assert_eq!(today(late).await, 24_000);
    // After midnight a new budget; a refund of yesterday's download does not touch it.
    let next_day = late + time::Duration::minutes(2);
    admit_download(&app.pool, &tenant, event(5_000), next_day).await.unwrap().unwrap();
    refund_unsent(&app.pool, "hooli", second, 0).await.unwrap();
    assert_eq!(today(next_day).await, 5_000, "yesterday's refund left today's count alone");
}
