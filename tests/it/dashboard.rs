//! The dashboard in a real browser (headless Chromium): the pages show what the usage APIs say,
//! and axe-core finds nothing serious in them.

use std::path::{Path, PathBuf};

use crate::common::TestApp;
use scraper::{Html, Selector};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::process::Command;

fn chromium() -> String {
    std::env::var("EXPORTD_CHROMIUM").unwrap_or_else(|_| "chromium".to_owned())
}

/// A one-minute sign-in link for the admin of `token`, as an API client would ask for it.
async fn sign_in_url(app: &TestApp, token: &str) -> String {
    let ticket: Value = app.post(token, "/v1/dashboard/tickets").await.json().await.unwrap();
    app.url(ticket["url"].as_str().unwrap())
}

/// One page as the browser saw it (tests/browser/pages.cjs).
struct Seen {
    status: u16,
    dom: Html,
    /// axe-core's violations: `{id, impact, help, nodes}`.
    violations: Vec<Value>,
    screenshot: PathBuf,
}

/// Signs a headless Chromium in through `sign_in`, then visits `paths` with its session: each
/// page's DOM, a screenshot (kept under target/) and an axe-core check.
async fn visit(sign_in: &str, paths: &[&str]) -> Vec<Seen> {
    let tools = std::env::var("EXPORTD_BROWSER_TOOLS")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/data/tools/browser").to_owned());
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&out).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/pages.cjs");
    let result = Command::new("node")
        .arg(script)
        .arg(sign_in)
        .arg(&out)
        .args(paths)
        .env("EXPORTD_BROWSER_TOOLS", &tools)
        .env("EXPORTD_CHROMIUM_PATH", which_chromium())
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run node (scripts/test installs it and the browser tools): {e}"));
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let pages: Vec<Value> = serde_json::from_slice(&result.stdout).unwrap();
    pages
        .into_iter()
        .map(|p| Seen {
            status: p["status"].as_u64().unwrap() as u16,
            dom: Html::parse_document(p["dom"].as_str().unwrap()),
            violations: p["violations"].as_array().unwrap().clone(),
            screenshot: out.join(p["screenshot"].as_str().unwrap()),
        })
        .collect()
}

fn which_chromium() -> String {
    let name = chromium();
    if name.contains('/') {
        return name;
    }
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|dir| format!("{dir}/{name}"))
        .find(|candidate| Path::new(candidate).exists())
        .unwrap_or(name)
}

fn select<'a>(dom: &'a Html, css: &str) -> Vec<scraper::ElementRef<'a>> {
    dom.select(&Selector::parse(css).unwrap()).collect()
}

/// The one element matching `css`.
fn one<'a>(dom: &'a Html, css: &str) -> scraper::ElementRef<'a> {
    let found = select(dom, css);
    assert_eq!(found.len(), 1, "{css}: {} elements", found.len());
    found[0]
}

fn text(element: scraper::ElementRef<'_>) -> String {
    element.text().collect::<String>().trim().to_owned()
}

fn attr(element: scraper::ElementRef<'_>, name: &str) -> String {
    element.value().attr(name).unwrap_or_else(|| panic!("no {name} on {}", element.html())).to_owned()
}

/// The bars of one series of one chart: (day label, value).
fn bars(dom: &Html, chart: &str, series: &str) -> Vec<(String, f64)> {
    select(dom, &format!("figure[data-chart={chart}] rect[data-series={series}]"))
        .into_iter()
        .map(|bar| (attr(bar, "data-label"), attr(bar, "data-value").parse().unwrap()))
        .collect()
}

/// No axe-core violation a person would be blocked or seriously hindered by.
fn accessible(page: &Seen) {
    let serious: Vec<&Value> =
        page.violations.iter().filter(|v| matches!(v["impact"].as_str(), Some("serious" | "critical"))).collect();
    assert!(serious.is_empty(), "axe-core: {serious:#?}");
}

#[sqlx::test(migrations = "./migrations")]
async fn the_dashboard_shows_the_usage_api_its_history_partners_and_an_export(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 50).await;
    let admin = app.token("acme", "alice");
    let done = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 20})).await;
    app.drain().await;
    app.get(Some(&admin), &format!("/v1/exports/{done}/file")).await.bytes().await.unwrap();
    let queued = app.export(&admin, &json!({"dataset": "tickets", "format": "csv"})).await; // stays queued
    // 29 earlier days of history (generated), today's recorded from what just happened.
    sqlx::query(
        "INSERT INTO tenant_usage_hours (tenant, hour, egress_bytes, rows_exported, exports_succeeded, exports_failed,
                                         export_seconds_p50, export_seconds_p95, refusals, stored_bytes_max)
         SELECT 'acme', date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - d * interval '1 day' + interval '3 hours',
                d * 1048576, d * 1000, d % 3, d % 2, d, 2 * d, jsonb_build_object('rate', d, 'queued', d % 4), d * 4194304
         FROM generate_series(1, 29) d",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !exportd::usage::history::record(&app.pool, &["acme"]).await.unwrap() {
        assert!(std::time::Instant::now() < deadline, "the usage history was never recorded");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // zenpartner last read the feed three days ago (over acme's lagging threshold); nobody else pulled.
    sqlx::query(
        "INSERT INTO feed_positions (tenant, principal, dataset, position_at, last_read_at)
         VALUES ('acme', 'zenpartner', 'tickets', now() - interval '3 days', now() - interval '3 days')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let usage: Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();
    let history: Value = app.get(Some(&admin), "/v1/usage/history").await.json().await.unwrap();

    let url = sign_in_url(&app, &admin).await;
    let export_page = format!("/dashboard/exports/{done}");
    let pages = visit(&url, &[&export_page, "/dashboard/exports/00000000-0000-4000-8000-000000000000"]).await;
    let (overview, export, missing) = (&pages[0], &pages[1], &pages[2]);

    // The numbers are the usage API's, shown in readable units.
    let dom = &overview.dom;
    for key in ["running_exports", "queued_exports", "stored_bytes", "egress_bytes_today", "rows_exported_today"] {
        assert_eq!(
            attr(one(dom, &format!("data[data-metric={key}]")), "value"),
            usage["usage"][key].to_string(),
            "{key}"
        );
    }
    let stored = one(dom, "data[data-metric=stored_bytes]");
    assert!(text(stored).ends_with(" KiB"), "readable: {}", text(stored));
    assert_eq!(text(one(dom, "data[data-limit=stored_bytes]")), "5 GiB");
    assert_eq!(
        attr(one(dom, "data[data-limit=queued_exports]"), "value"),
        usage["limits"]["max_queued_exports"].to_string()
    );
    for (kind, n) in usage["usage"]["refusals_today"].as_object().unwrap() {
        assert_eq!(text(one(dom, &format!("td[data-refusals={kind}]"))), n.to_string(), "{kind}");
    }
    assert_eq!(text(one(dom, "td[data-state=SUCCEEDED]")), "1");
    assert_eq!(text(one(dom, "td[data-state=QUEUED]")), "1");
    assert_eq!(text(one(dom, &format!("td[data-expected-rows='{queued}']"))), "50", "the estimate taken at creation");
    assert_eq!(text(one(dom, &format!("td[data-eta='{queued}']"))), "–", "no ETA before it runs");
    assert!(select(dom, "[data-warning]").is_empty(), "no quota near its limit");

    // Charts: the history API's numbers, bar for bar, 30 days.
    let points = history["points"].as_array().unwrap();
    assert_eq!(points.len(), 30);
    for (chart, series) in [
        ("egress", "egress_bytes"),
        ("storage", "stored_bytes_max"),
        ("rows", "rows_exported"),
        ("exports", "exports_succeeded"),
        ("exports", "exports_failed"),
        ("durations", "export_seconds_p95"),
        ("queued", "queued_max"),
    ] {
        let drawn = bars(dom, chart, series);
        assert_eq!(drawn.len(), 30, "{chart}/{series}");
        for (point, (_, value)) in points.iter().zip(&drawn) {
            assert_eq!(point[series].as_f64().unwrap_or(0.0), *value, "{chart}/{series} on {}", point["start"]);
        }
    }
    for kind in ["rate", "queued", "storage"] {
        let drawn: Vec<f64> = bars(dom, "refusals", kind).into_iter().map(|(_, v)| v).collect();
        let api: Vec<f64> = points.iter().map(|p| p["refusals"][kind].as_f64().unwrap()).collect();
        assert_eq!(drawn, api, "refusals/{kind}");
    }
    assert!(bars(dom, "egress", "egress_bytes").iter().any(|(_, v)| *v == 29.0 * 1048576.0), "generated history shows");
    // 29 MiB a day against a 50 GiB limit: the scale fits the data, ending on a round value, and
    // a note says how far below the limit it is instead of a line the bars would not reach.
    assert_eq!(text(one(dom, "figure[data-chart=egress] text[data-axis=top]")), "30 MiB");
    assert_eq!(text(one(dom, "figure[data-chart=egress] text[data-axis=middle]")), "15 MiB");
    assert!(select(dom, "figure[data-chart=egress] line[data-limit]").is_empty());
    let note = one(dom, "figure[data-chart=egress] [data-limit-off-scale]");
    assert_eq!(attr(note, "data-limit-off-scale"), usage["limits"]["egress_bytes_per_day"].to_string());
    let share = 29.0 * 1048576.0 / usage["limits"]["egress_bytes_per_day"].as_f64().unwrap() * 100.0;
    assert!(
        text(note).contains("is off this scale") && text(note).contains(&format!("{share:.2} % of it")),
        "{}",
        text(note)
    );
    // Counts read with thousands separators, axes included.
    assert_eq!(text(one(dom, "figure[data-chart=rows] text[data-axis=top]")), "30,000");
    assert!(select(dom, "figure[data-chart=rows] details td").into_iter().any(|td| text(td) == "29,000"));
    assert!(one(dom, "[data-charts-lag]").text().collect::<String>().contains("the tables above are live"));
    let tooltip = text(one(dom, "figure[data-chart=storage] rect[data-series=stored_bytes_max]:first-of-type title"));
    assert!(tooltip.contains("MiB"), "tooltips in readable units: {tooltip}");
    assert!(!select(dom, "figure[data-chart=egress] details table td").is_empty(), "the numbers as a table");

    // Partners: the lagging one is flagged, the others not.
    let lagging = one(dom, "[data-feed='zenpartner/tickets']");
    assert!(text(lagging).contains("lagging") && text(lagging).contains("3 days ago"), "{}", text(lagging));
    assert!(select(dom, "[data-feed='mallory/tickets'] [data-lagging]").is_empty());
    assert_eq!(text(one(dom, "td[data-partner-exports=zenpartner]")), "0");

    // The export's own page: state, progress, shards, who downloaded it.
    assert_eq!(export.status, 200);
    let dom = &export.dom;
    assert_eq!(text(one(dom, "[data-field=state]")), "SUCCEEDED");
    assert_eq!(text(one(dom, "[data-field=expected-rows]")), "50");
    let shard_rows: Vec<String> = select(dom, "tr[data-shard] td:nth-child(2)").into_iter().map(text).collect();
    assert_eq!(shard_rows, ["20", "20", "10"]);
    let downloads = select(dom, "tr[data-event=downloaded]");
    assert_eq!(downloads.len(), 1);
    assert!(text(downloads[0]).contains("alice"));
    assert_eq!(missing.status, 404, "an unknown export has no page");

    for page in [overview, export] {
        accessible(page);
        let png = std::fs::read(&page.screenshot).expect("a screenshot");
        assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "saved to {}", page.screenshot.display());
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn the_dashboard_asks_for_an_admin_token(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let page = app.get(None, "/dashboard").await;
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-security-policy"].to_str().unwrap().contains("default-src 'none'"));
    assert!(page.text().await.unwrap().contains(r#"<form method="post" action="/dashboard/signin">"#));
    let origin = app.url("");
    let sign_in = |client: &reqwest::Client, token: String, origin: &str| {
        client.post(app.url("/dashboard/signin")).header("origin", origin).form(&[("token", token)]).send()
    };
    let partner = sign_in(&app.client, app.token("acme", "zenpartner"), &origin).await.unwrap();
    assert_eq!(partner.status(), 401);
    let huge = sign_in(&app.client, "x".repeat(1 << 20), &origin).await.unwrap();
    assert_eq!(huge.status(), 413, "a sign-in form is one token, not a megabyte");
    // A bearer token on the page itself: a partner's is 403, an invalid one 401 (as the API).
    let as_partner = app.get(Some(&app.token("acme", "zenpartner")), "/dashboard").await;
    assert_eq!(as_partner.status(), 403);
    assert!(!as_partner.text().await.unwrap().contains("Acme (tests)"), "nothing of the tenant's page");
    let invalid = app.get(Some("not-a-token"), "/dashboard").await;
    assert_eq!(invalid.status(), 401);
    assert_eq!(invalid.headers()["www-authenticate"], "Bearer");
    let admin = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let alice = app.token("acme", "alice");
    // A form on another site (or a sandboxed frame: origin null) cannot sign a browser in.
    for foreign in ["https://evil.example", "null"] {
        assert_eq!(sign_in(&admin, alice.clone(), foreign).await.unwrap().status(), 403, "{foreign}");
    }
    let signed_in = sign_in(&admin, alice.clone(), &origin).await.unwrap();
    assert_eq!(signed_in.status(), 303);
    let cookie = signed_in.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("Path=/dashboard") && !cookie.contains("Secure"));
    assert!(!cookie.contains(&alice), "the cookie holds a session, not the API token");
    let session = cookie.split(';').next().unwrap().to_owned();
    let page = admin.get(app.url("/dashboard")).header("cookie", &session).send().await.unwrap();
    assert!(page.text().await.unwrap().contains("Acme (tests)"));
    // The session is for the dashboard only: the API does not take it.
    let value = session.split_once('=').unwrap().1;
    assert_eq!(app.get(Some(value), "/v1/usage").await.status(), 401);
    // Behind a TLS-terminating proxy the cookie is Secure.
    let proxied = admin
        .post(app.url("/dashboard/signin"))
        .header("origin", &origin)
        .header("x-forwarded-proto", "https")
        .form(&[("token", alice)])
        .send()
        .await
        .unwrap();
    assert!(proxied.headers()["set-cookie"].to_str().unwrap().contains("Secure"));
    // Sign-in links expire.
    let url = sign_in_url(&app, &app.token("acme", "alice")).await;
    app.clock.advance(std::time::Duration::from_secs(61));
    assert_eq!(admin.get(url).send().await.unwrap().status(), 401);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_quota_near_or_at_its_limit_is_called_out(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("hooli", "tickets", 600).await; // hooli: storage_bytes = 20000
    let gavin = app.token("hooli", "gavin");
    let page = |app: &TestApp| {
        let request = app.client.get(app.url("/dashboard")).bearer_auth(&gavin);
        async move { Html::parse_document(&request.send().await.unwrap().text().await.unwrap()) }
    };
    assert!(select(&page(&app).await, "[data-warning]").is_empty());
    // An export of about 17 KiB: over 80 % of the 20 000 stored bytes allowed.
    let id = app.export(&gavin, &json!({"dataset": "tickets", "format": "csv", "columns": ["subject", "body"]})).await;
    app.drain().await;
    let stored: i64 = sqlx::query_scalar("SELECT bytes_done FROM export_jobs WHERE id = $1::uuid")
        .bind(&id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let share = stored as f64 / 20000.0 * 100.0;
    assert!((80.0..100.0).contains(&share), "the fixture export should fill 80-100 % of the quota: {share:.1} %");
    let dom = page(&app).await;
    let warning = one(&dom, "[data-warning=stored_bytes]");
    assert_eq!(attr(warning, "role"), "status");
    assert!(attr(warning, "class").contains("warn"));
    assert!(text(warning).contains(&format!("{share:.0} % of the limit")), "{}", text(warning));
    assert!(text(warning).contains("19.53 KiB"), "readable: {}", text(warning));
    // The meter takes the alert's colour: yellow from 80 %, red at the limit (green below).
    let meter = one(&dom, "meter[data-meter=stored_bytes]");
    assert_eq!(
        (attr(meter, "low"), attr(meter, "high"), attr(meter, "optimum")),
        ("80".into(), "99.95".into(), "0".into())
    );
}

/// Every running slot busy is a tenant at work, not an alert; a full queue is.
#[sqlx::test(migrations = "./migrations")]
async fn running_exports_at_their_limit_are_busy_and_a_full_queue_is_the_alert(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("globex", "tickets", 10).await;
    let hank = app.token("globex", "hank");
    let usage: Value = app.get(Some(&hank), "/v1/usage").await.json().await.unwrap();
    let (slots, queue) = (
        usage["limits"]["max_running_exports"].as_u64().unwrap(),
        usage["limits"]["max_queued_exports"].as_u64().unwrap(),
    );
    let mut running = Vec::new();
    for _ in 0..slots {
        app.export(&hank, &json!({"dataset": "tickets", "format": "csv"})).await;
        running.push(exportd::jobs::ClaimedExport::claim(&app.deps(), "busy").await.unwrap().expect("claimed"));
    }
    for _ in 0..queue {
        app.export(&hank, &json!({"dataset": "tickets", "format": "csv"})).await;
    }
    let request = app.client.get(app.url("/dashboard")).bearer_auth(&hank);
    let dom = Html::parse_document(&request.send().await.unwrap().text().await.unwrap());
    assert!(select(&dom, "[data-warning=running_exports]").is_empty(), "busy slots are not an alert");
    let busy = one(&dom, "[data-busy=running_exports]");
    assert_eq!((attr(busy, "role"), attr(busy, "class")), ("status".into(), "alert info".into()));
    assert!(
        text(busy).contains(&format!("All {slots} export slots are busy; {queue} queued exports wait")),
        "{}",
        text(busy)
    );
    assert!(one(&dom, "meter[data-meter=running_exports]").value().attr("low").is_none(), "no warning colours");
    let full = one(&dom, "[data-warning=queued_exports]");
    assert_eq!((attr(full, "role"), attr(full, "class")), ("alert".into(), "alert full".into()));
    assert_eq!(attr(one(&dom, "meter[data-meter=queued_exports]"), "value"), "100.0");
    drop(running);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_sign_in_ticket_works_once_and_never_from_another_site(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("acme", "alice");
    let browser = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let open = |url: String, site: &'static str| browser.get(url).header("sec-fetch-site", site).send();
    // A foreign page that makes the browser open an admin's ticket signs nobody in.
    let url = sign_in_url(&app, &admin).await;
    let cross_site = open(url.clone(), "cross-site").await.unwrap();
    assert_eq!(cross_site.status(), 403);
    assert!(cross_site.headers().get("set-cookie").is_none());
    let posted_from_elsewhere = browser.get(&url).header("origin", "https://evil.example").send().await.unwrap();
    assert_eq!(posted_from_elsewhere.status(), 403);
    // Opened from the address bar it signs in, once.
    let first = open(url.clone(), "none").await.unwrap();
    assert_eq!(first.status(), 303);
    assert!(first.headers()["set-cookie"].to_str().unwrap().starts_with("exportd_session="));
    let again = open(url, "none").await.unwrap();
    assert_eq!(again.status(), 401, "a ticket is spent at its first use");
    assert!(again.headers().get("set-cookie").is_none());
}
