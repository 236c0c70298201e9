//! The abuse suite: a hostile partner against a real `exportd serve` process (loopback only,
//! bounded in count and time, stopping by itself). Each scenario prints its figures; the server's
//! peak RSS is read from `/proc` (VmHWM, reset between scenarios). `scripts/abuse` runs it in a
//! release build; it is ignored in the normal test run.

use std::time::{Duration, Instant};

use crate::common::processes::{Server, wait_terminal};
use crate::common::{TestApp, full_csv};
use crate::slow_clients::{dripping_post, seed_incompressible, stalled_get};
use serde_json::{Value, json};
use sqlx::PgPool;

/// Peak resident memory of a process since the last reset, in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024.0
}

fn reset_peak_rss(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

const IDLE_CONNECTIONS: usize = 18_000;

fn p99(latencies: &mut [Duration]) -> Duration {
    latencies.sort();
    latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)]
}

async fn start_server(app: &TestApp) -> Server {
    Server::start(app, "1", None).await
}

/// Sequential requests of a well-behaved tenant for `during`: latencies and errors.
async fn well_behaved(base: &str, token: &str, during: Duration) -> (Vec<Duration>, usize) {
    let request = |client: &reqwest::Client| client.get(format!("{base}/v1/datasets")).bearer_auth(token);
    timed(reqwest::Client::new(), request, during, Duration::from_millis(20)).await
}

/// `request` sent again and again for `during`, `pause` apart: the latencies of its 200s and
/// how many were anything else.
async fn timed(
    client: reqwest::Client,
    request: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    during: Duration,
    pause: Duration,
) -> (Vec<Duration>, usize) {
    let (mut latencies, mut failures) = (Vec::new(), 0);
    let start = Instant::now();
    while start.elapsed() < during {
        let sent = Instant::now();
        match request(&client).send().await {
            Ok(r) if r.status() == 200 => latencies.push(sent.elapsed()),
            _ => failures += 1,
        }
        tokio::time::sleep(pause).await;
    }
    (latencies, failures)
}

#[sqlx::test(migrations = "./migrations")]
#[ignore = "an abuse run of about a minute: scripts/abuse runs it"]
async fn a_hostile_partner_does_not_hurt_another_tenant(pool: PgPool) {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let app = TestApp::spawn(pool).await;
    let server = start_server(&app).await;
    let pid = server.child.id();
    let base = server.base.clone();
    let other = app.token("acme", "alice");
    let hostile = app.token("initech", "milton"); // 2 requests/s

    // 1. A 64-connection flood of refused requests from one partner.
    let (mut quiet, quiet_errors) = well_behaved(&base, &other, Duration::from_secs(5)).await;
    reset_peak_rss(pid);
    let stop = Instant::now() + Duration::from_secs(15);
    let flood: Vec<_> = (0..64)
        .map(|_| {
            let (base, token) = (base.clone(), hostile.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut refused = 0u64;
                while Instant::now() < stop {
                    if let Ok(r) = client.get(format!("{base}/v1/datasets")).bearer_auth(&token).send().await
                        && r.status() == 429
                    {
                        refused += 1;
                    }
                }
                refused
            })
        })
        .collect();
    let (mut loaded, loaded_errors) = well_behaved(&base, &other, Duration::from_secs(12)).await;
    let mut refused = 0;
    for task in flood {
        refused += task.await.unwrap();
    }
    println!(
        "429 flood (64 connections, 15 s): {refused} refused; other tenant p99 {:.1} ms unloaded, {:.1} ms loaded, \
         {} errors; server peak RSS {:.0} MiB",
        p99(&mut quiet).as_secs_f64() * 1000.0,
        p99(&mut loaded).as_secs_f64() * 1000.0,
        quiet_errors + loaded_errors,
        peak_rss_mib(pid)
    );
    assert_eq!(loaded_errors, 0);
    assert!(p99(&mut loaded) <= (p99(&mut quiet) * 3).max(Duration::from_millis(15)));

    // 2. 18 000 idle connections while an export runs (this machine's hard RLIMIT_NOFILE is
    // 20 000 per process, and the connecting side needs descriptors of its own).
    app.seed("acme", "tickets", 20_000).await;
    reset_peak_rss(pid);
    let id = app.export(&other, &full_csv(2_000)).await;
    let health_client = reqwest::Client::new(); // before the descriptors are spent on idle sockets
    let mut idle = Vec::new();
    let mut refused_connects = 0;
    for _ in 0..IDLE_CONNECTIONS {
        match tokio::net::TcpStream::connect(base.trim_start_matches("http://")).await {
            Ok(stream) => idle.push(stream),
            Err(_) => refused_connects += 1,
        }
    }
    let sent = Instant::now();
    let health = health_client.get(format!("{base}/healthz")).send().await.map(|r| r.status().as_u16());
    let health_ms = sent.elapsed().as_secs_f64() * 1000.0;
    let state = wait_terminal(&app.pool, &id, Duration::from_secs(120)).await;
    println!(
        "{IDLE_CONNECTIONS} idle connections ({refused_connects} connects failed): /healthz {:?} in {health_ms:.0} ms, \
         export {state}; server peak RSS {:.0} MiB",
        health,
        peak_rss_mib(pid)
    );
    drop(idle);
    assert_eq!(health.ok(), Some(200));
    assert_eq!(state, "SUCCEEDED");

    // 3. 2 000 concurrent downloads of one export by one partner-sized tenant.
    reset_peak_rss(pid);
    let client = reqwest::Client::new();
    let downloads: Vec<_> = (0..2_000)
        .map(|_| {
            let (url, token, client) = (format!("{base}/v1/exports/{id}/file"), other.clone(), client.clone());
            tokio::spawn(async move {
                match client.get(url).bearer_auth(token).send().await {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        let _ = r.bytes().await;
                        status
                    }
                    Err(_) => 0,
                }
            })
        })
        .collect();
    let mut by_status = std::collections::BTreeMap::new();
    for task in downloads {
        *by_status.entry(task.await.unwrap()).or_insert(0) += 1;
    }
    println!("2 000 concurrent downloads: statuses {by_status:?}; server peak RSS {:.0} MiB", peak_rss_mib(pid));
    assert!(!by_status.contains_key(&500));

    // 4. Feed pages of ~900 kB records, six at once.
    let start = app.cursor_now(&other, "tickets").await;
    let big = "x".repeat(900_000);
    for chunk in 0..20 {
        let batch: Vec<Value> = (0..15)
            .map(
                |i| json!({"key": format!("big-{chunk}-{i}"), "data": {"subject": "s", "status": "open", "body": big}}),
            )
            .collect();
        assert_eq!(app.ingest(&other, "tickets", &Value::Array(batch)).await.status(), 200);
    }
    app.tick().await;
    tokio::time::sleep(Duration::from_secs(6)).await; // the tenant's safety delay, on the server's clock
    reset_peak_rss(pid);
    let pages: Vec<_> = (0..6)
        .map(|_| {
            let url = format!("{base}/v1/datasets/tickets/changes?limit=10000&cursor={start}");
            let (token, client) = (other.clone(), client.clone());
            tokio::spawn(async move {
                let r = client.get(url).bearer_auth(token).send().await.unwrap();
                r.bytes().await.unwrap().len()
            })
        })
        .collect();
    let mut sizes = Vec::new();
    for page in pages {
        sizes.push(page.await.unwrap());
    }
    println!(
        "6 concurrent feed pages over 300 x 900 kB records: {:.1} MB each; server peak RSS {:.0} MiB",
        sizes[0] as f64 / 1e6,
        peak_rss_mib(pid)
    );
    assert!(sizes.iter().all(|s| *s < 12 << 20));
    assert!(peak_rss_mib(pid) < 512.0);

    // 5. Feed-window storage: sixty cursors taken between writes, then 3 000 writes, and every
    // cursor pulled, newest first (before windows were shared: 180 368 keys stored).
    let stored = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM feed_window_keys").fetch_one(&app.pool).await.unwrap()
    };
    let before = stored().await;
    let mut cursors = Vec::new();
    for i in 0..60 {
        let body: Value = client
            .get(format!("{base}/v1/datasets/tickets/cursor"))
            .bearer_auth(&other)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        cursors.push(body["cursor"].as_str().unwrap().to_owned());
        let record = json!([{"key": format!("early-{i:02}"), "data": {"subject": "s", "status": "open"}}]);
        assert_eq!(app.ingest(&other, "tickets", &record).await.status(), 200);
    }
    for chunk in 0..6 {
        let batch: Vec<Value> = (0..500)
            .map(|i| json!({"key": format!("late-{chunk}-{i:03}"), "data": {"subject": "s", "status": "open"}}))
            .collect();
        assert_eq!(app.ingest(&other, "tickets", &Value::Array(batch)).await.status(), 200);
    }
    app.tick().await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut delivered = 0;
    for cursor in cursors.iter().rev() {
        let mut cursor = cursor.clone();
        loop {
            let url = format!("{base}/v1/datasets/tickets/changes?limit=10000&cursor={cursor}");
            let page: Value = client.get(url).bearer_auth(&other).send().await.unwrap().json().await.unwrap();
            delivered += page["changes"].as_array().unwrap().len();
            cursor = page["next_cursor"].as_str().unwrap().to_owned();
            if page["end_of_stream"] == true {
                break;
            }
        }
    }
    let kept = stored().await - before;
    println!(
        "feed windows: 60 cursors between writes, 3 000 writes, every cursor pulled: {delivered} changes delivered, {kept} window keys stored"
    );
    assert_eq!(delivered, (1..=60).sum::<usize>() + 60 * 3000);
    assert!(kept <= 3_060 + 60, "{kept} keys stored for 3 060 changes");
}

/// `/healthz` from a fresh connection for `during`: latencies and failures.
async fn probes(base: &str, during: Duration) -> (Vec<Duration>, usize) {
    let fresh_connections = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let request = |client: &reqwest::Client| client.get(format!("{base}/healthz"));
    timed(fresh_connections, request, during, Duration::from_millis(200)).await
}

#[sqlx::test(migrations = "./migrations")]
#[ignore = "an abuse run of about a minute: scripts/abuse runs it"]
async fn slow_clients_cost_nothing_shared(pool: PgPool) {
    use tokio::io::AsyncWriteExt;
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let app = TestApp::spawn(pool).await;
    let partner = app.token("acme", "zenpartner");
    seed_incompressible(&app.pool, 100).await;
    let big = app.export(&partner, &json!({"dataset": "tickets", "format": "csv"})).await;
    let server = Server::start_with(&app, "1", None, |c| {
        c.env("EXPORTD_METRICS_TOKEN", "scrape")
            .env("EXPORTD_MAX_CONNECTIONS", "2000")
            .env("EXPORTD_SEND_TIMEOUT", "5s");
    })
    .await;
    assert_eq!(wait_terminal(&app.pool, &big, Duration::from_secs(120)).await, "SUCCEEDED");
    let (base, pid) = (server.base.clone(), server.child.id());
    let address = base.trim_start_matches("http://").to_owned();
    let other = app.token("globex", "hank");
    let (mut quiet, _) = well_behaved(&base, &other, Duration::from_secs(4)).await;
    let (mut quiet_health, _) = probes(&base, Duration::from_secs(4)).await;

    // 1. Slowloris: 3 000 sockets (more than the 2 000 admitted), each with part of a request
    // head and one more header line every 3 s, reconnecting when closed.
    reset_peak_rss(pid);
    let stop = Instant::now() + Duration::from_secs(15);
    let slow: Vec<_> = (0..3_000)
        .map(|_| {
            let address = address.clone();
            tokio::spawn(async move {
                let mut reconnects = 0u32;
                while Instant::now() < stop {
                    let Ok(mut stream) = tokio::net::TcpStream::connect(&address).await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let mut open = stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.is_ok();
                    while open && Instant::now() < stop {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        open = stream.write_all(b"X-Slow: 1\r\n").await.is_ok();
                    }
                    reconnects += 1;
                }
                reconnects
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ((mut health, health_failures), (mut loaded, errors)) =
        tokio::join!(probes(&base, Duration::from_secs(10)), well_behaved(&base, &other, Duration::from_secs(10)));
    let mut reconnects = 0;
    for task in slow {
        reconnects += task.await.unwrap();
    }
    println!(
        "slowloris (3 000 partial heads, 2 000 admitted): /healthz p99 {:.1} ms loaded vs {:.1} ms, {health_failures} \
         failed; other tenant p99 {:.1} ms vs {:.1} ms, {errors} errors; {reconnects} reconnects; peak RSS {:.0} MiB",
        p99(&mut health).as_secs_f64() * 1000.0,
        p99(&mut quiet_health).as_secs_f64() * 1000.0,
        p99(&mut loaded).as_secs_f64() * 1000.0,
        p99(&mut quiet).as_secs_f64() * 1000.0,
        peak_rss_mib(pid)
    );
    assert_eq!(health_failures, 0);
    assert_eq!(errors, 0);

    // 2. 32 connections scraping /metrics in a loop with a webhook backlog of 200 000 rows.
    sqlx::query(
        "WITH e AS (INSERT INTO webhook_events (tenant, type, data, routed_at)
                    SELECT 'acme', 'export.cancelled', '{}', now() FROM generate_series(1, 200000) RETURNING id)
         INSERT INTO webhook_deliveries (event_id, tenant, endpoint, body, give_up_at)
         SELECT id, 'acme', 'gone', '{}', now() + interval '1 day' FROM e",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (mut quiet, _) = well_behaved(&base, &other, Duration::from_secs(4)).await;
    let stop = Instant::now() + Duration::from_secs(12);
    let scrapers: Vec<_> = (0..32)
        .map(|_| {
            let base = base.clone();
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut scrapes = 0u64;
                while Instant::now() < stop {
                    let r = client.get(format!("{base}/metrics")).bearer_auth("scrape").send().await;
                    if r.is_ok_and(|r| r.status() == 200) {
                        scrapes += 1;
                    }
                }
                scrapes
            })
        })
        .collect();
    let (mut loaded, errors) = well_behaved(&base, &other, Duration::from_secs(10)).await;
    let mut scrapes = 0;
    for task in scrapers {
        scrapes += task.await.unwrap();
    }
    let loaded_p99 = p99(&mut loaded);
    println!(
        "metrics scraping (32 connections, 200 000 pending deliveries): {scrapes} scrapes; other tenant p50 {:.1} ms, \
         p99 {:.1} ms loaded vs {:.1} ms, {errors} errors",
        loaded[loaded.len() / 2].as_secs_f64() * 1000.0,
        loaded_p99.as_secs_f64() * 1000.0,
        p99(&mut quiet).as_secs_f64() * 1000.0,
    );
    assert_eq!(errors, 0);
    assert!(loaded_p99 <= (p99(&mut quiet) * 3).max(Duration::from_millis(15)));

    // 3. One partner: 64 downloads of a 10 MB file that it never reads, and 64 POSTs whose body
    // stops after one byte; meanwhile its tenant's admin downloads and ingests, another tenant
    // reads. The send timeout is 5 s here (default 30 s), the body stall limit 10 s.
    let (mut quiet, _) = well_behaved(&base, &other, Duration::from_secs(4)).await;
    reset_peak_rss(pid);
    let admin = app.token("acme", "alice");
    let mut stalled = Vec::new();
    let mut statuses = std::collections::BTreeMap::new();
    for _ in 0..64 {
        let (status, stream) = stalled_get(&address, &format!("/v1/exports/{big}/file"), &partner).await;
        *statuses.entry(status).or_insert(0) += 1;
        stalled.push(stream);
    }
    let mut dripping = Vec::new();
    for _ in 0..64 {
        dripping.push(dripping_post(&address, "/v1/datasets/tickets/records", &partner).await);
    }
    let admin_work = async {
        let client = reqwest::Client::new();
        let (mut ok, mut refused) = (0, 0);
        for i in 0..20 {
            let file = client.get(format!("{base}/v1/exports/{big}/file")).bearer_auth(&admin).send().await;
            let file_ok = match file {
                Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
                _ => false,
            };
            let body = json!([{"key": format!("admin-{i}"), "data": {"subject": "s", "status": "open"}}]);
            let ingest = client.post(format!("{base}/v1/datasets/tickets/records")).bearer_auth(&admin).json(&body);
            let ingest_ok = ingest.send().await.is_ok_and(|r| r.status() == 200);
            if file_ok && ingest_ok { ok += 1 } else { refused += 1 }
        }
        (ok, refused)
    };
    let ((mut loaded, errors), (mut health, health_failures), (admin_ok, admin_refused)) = tokio::join!(
        well_behaved(&base, &other, Duration::from_secs(12)),
        probes(&base, Duration::from_secs(12)),
        admin_work
    );
    let mut closed = 0;
    for mut stream in stalled.into_iter().chain(dripping) {
        use tokio::io::AsyncReadExt;
        let mut rest = Vec::new();
        if tokio::time::timeout(Duration::from_secs(15), stream.read_to_end(&mut rest)).await.is_ok() {
            closed += 1;
        }
    }
    println!(
        "one partner's 64 stalled downloads (statuses {statuses:?}) and 64 dripping bodies: admin {admin_ok} \
         downloads+ingests ok, {admin_refused} refused; other tenant p99 {:.1} ms vs {:.1} ms, {errors} errors; \
         /healthz p99 {:.1} ms, {health_failures} failed; {closed}/128 closed by the server; peak RSS {:.0} MiB",
        p99(&mut loaded).as_secs_f64() * 1000.0,
        p99(&mut quiet).as_secs_f64() * 1000.0,
        p99(&mut health).as_secs_f64() * 1000.0,
        peak_rss_mib(pid)
    );
    assert_eq!((errors, health_failures, admin_refused), (0, 0, 0));
    assert_eq!(closed, 128, "every stalled download and dripping body ends");
}

/// A valid predicate tree of about 1 000 nodes (`or` of isNull tests), under the 64 KiB bound.
fn widest_hint() -> String {
    let leaf = json!({"op": "isNull", "children": [{"op": "column", "name": "subject"}]});
    json!({"op": "or", "children": vec![leaf; 499]}).to_string()
}

#[sqlx::test(migrations = "./migrations")]
#[ignore = "an abuse run of about a minute: scripts/abuse runs it"]
async fn predicate_hints_and_a_silent_bucket_cost_no_one_else(pool: PgPool) {
    use crate::deliveries::var;
    use crate::delivery_slots::{silent_bucket, subscribed};
    let app = TestApp::spawn(pool).await;
    // acme's partner: a Delta Sharing version of ~650 files, and a subscription into a bucket
    // that never answers. globex's partner: a subscription into a real bucket (SeaweedFS).
    let silent = silent_bucket().await;
    let zen = subscribed("silent", "zenpartner", &silent, "abuse");
    let prefix = format!("abuse-{}", uuid::Uuid::new_v4().simple());
    let partner_endpoint = var("EXPORTD_TEST_PARTNER_S3_ENDPOINT");
    let lake = format!(
        "[[principals]]\nid = \"lake\"\nrole = \"partner\"\ngrants = [\"tickets\"]\n{}",
        subscribed("lake", "lake", &partner_endpoint, &prefix)
    );
    let tenants = crate::common::edited_tenants_dir("acme", |t| format!("{t}\n{zen}"));
    let globex_file = tenants.path().join("globex.toml");
    let globex = std::fs::read_to_string(&globex_file).unwrap();
    std::fs::write(&globex_file, format!("{globex}\n{lake}")).unwrap();
    let registry = exportd::tenants::Registry::load(tenants.path()).unwrap();
    app.seed("acme", "tickets", 20_000).await;
    app.seed("globex", "tickets", 500).await; // globex: max_rows_per_export = 1000
    let server = Server::start_with(&app, "1", None, |c| {
        c.env("EXPORTD_TENANTS_DIR", tenants.path())
            .env("EXPORTD_DELIVERY_ALLOW_NETS", "127.0.0.0/8")
            .env("EXPORTD_DELIVERY_ATTEMPT_TIMEOUT", "60s");
    })
    .await;
    let (base, pid) = (server.base.clone(), server.child.id());
    let partner = app.token("acme", "zenpartner");
    let version = app.export(&partner, &json!({"dataset": "tickets", "format": "parquet", "shard_rows": 20})).await;
    assert_eq!(wait_terminal(&app.pool, &version, Duration::from_secs(300)).await, "SUCCEEDED");
    let files: i64 = sqlx::query_scalar("SELECT count(*) FROM export_shards WHERE export_id = $1::uuid")
        .bind(&version)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let other = app.token("globex", "hank");
    let (mut quiet, _) = well_behaved(&base, &other, Duration::from_secs(4)).await;
    let (mut quiet_health, _) = probes(&base, Duration::from_secs(4)).await;

    // 1. Eight connections sending the widest hint the server takes, against every file.
    reset_peak_rss(pid);
    let stop = Instant::now() + Duration::from_secs(15);
    let table = format!("{base}/delta-sharing/shares/zenpartner/schemas/acme/tables/tickets/query");
    let flood: Vec<_> = (0..8)
        .map(|_| {
            let (table, token) = (table.clone(), partner.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let body = json!({"jsonPredicateHints": widest_hint()});
                let (mut answered, mut refused) = (0u32, 0u32);
                while Instant::now() < stop {
                    match client.post(&table).bearer_auth(&token).json(&body).send().await {
                        Ok(r) if r.status() == 200 => {
                            let _ = r.bytes().await;
                            answered += 1;
                        }
                        _ => refused += 1,
                    }
                }
                (answered, refused)
            })
        })
        .collect();
    let ((mut loaded, loaded_errors), (mut health, health_errors)) =
        tokio::join!(well_behaved(&base, &other, Duration::from_secs(12)), probes(&base, Duration::from_secs(12)));
    let (mut answered, mut refused) = (0, 0);
    for task in flood {
        let (a, r) = task.await.unwrap();
        answered += a;
        refused += r;
    }
    println!(
        "predicate-hint flood (8 connections, ~1 000-node hints over {files} files, 15 s): {answered} answered, \
         {refused} refused; other tenant p99 {:.1} ms unloaded, {:.1} ms loaded, {loaded_errors} errors; \
         /healthz p99 {:.1} ms unloaded, {:.1} ms loaded, {health_errors} failed; server peak RSS {:.0} MiB",
        p99(&mut quiet).as_secs_f64() * 1000.0,
        p99(&mut loaded).as_secs_f64() * 1000.0,
        p99(&mut quiet_health).as_secs_f64() * 1000.0,
        p99(&mut health).as_secs_f64() * 1000.0,
        peak_rss_mib(pid)
    );
    assert_eq!((loaded_errors, health_errors), (0, 0));
    assert!(p99(&mut loaded) <= (p99(&mut quiet) * 5).max(Duration::from_millis(25)));

    // 2. Three deliveries into the silent bucket, then one of globex's into a real one.
    reset_peak_rss(pid);
    for _ in 0..3 {
        let id = app.export(&partner, &json!({"dataset": "tickets", "format": "jsonl"})).await;
        assert_eq!(wait_terminal(&app.pool, &id, Duration::from_secs(120)).await, "SUCCEEDED");
    }
    let lake = crate::common::token_in(&registry, "globex", "lake");
    let id = app.export_at(&base, &lake, &json!({"dataset": "tickets", "format": "jsonl"})).await;
    let published = Instant::now();
    assert_eq!(wait_terminal(&app.pool, &id, Duration::from_secs(120)).await, "SUCCEEDED");
    let delivering = tokio::spawn({
        let pool = app.pool.clone();
        async move {
            loop {
                let state: Option<String> = sqlx::query_scalar(
                    "SELECT state FROM bucket_deliveries WHERE tenant = 'globex' AND export_id = $1::uuid",
                )
                .bind(&id)
                .fetch_optional(&pool)
                .await
                .unwrap();
                if state.as_deref() == Some("delivered") {
                    return published.elapsed();
                }
                assert!(published.elapsed() < Duration::from_secs(60), "globex's delivery waited a minute");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let ((mut loaded, loaded_errors), (mut health, health_errors)) =
        tokio::join!(well_behaved(&base, &other, Duration::from_secs(8)), probes(&base, Duration::from_secs(8)));
    let took = delivering.await.unwrap();
    let silent_held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM bucket_deliveries WHERE tenant = 'acme' AND state = 'pending' AND lease_expires_at > now()",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    println!(
        "silent partner bucket (3 deliveries, attempts of up to 60 s): globex's delivery done {:.2} s after its \
         export (acme holding {silent_held} of 2 slots); other tenant p99 {:.1} ms, {loaded_errors} errors; \
         /healthz p99 {:.1} ms, {health_errors} failed; server peak RSS {:.0} MiB",
        took.as_secs_f64(),
        p99(&mut loaded).as_secs_f64() * 1000.0,
        p99(&mut health).as_secs_f64() * 1000.0,
        peak_rss_mib(pid)
    );
    assert!(took < Duration::from_secs(10), "globex waited behind the silent bucket");
    assert_eq!((loaded_errors, health_errors, silent_held), (0, 0, 1));
}
