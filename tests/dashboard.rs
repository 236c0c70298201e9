//! The dashboard in a real browser (headless Chromium): the page shows what the usage API says.

mod common;

use std::path::{Path, PathBuf};

use common::TestApp;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::process::Command;

fn chromium() -> String {
    std::env::var("EXPORTD_CHROMIUM").unwrap_or_else(|_| "chromium".to_owned())
}

/// A local page that signs in with `token` by posting the dashboard's form, as a person would.
/// A one-minute sign-in link for the admin of `token`, as an API client would ask for it.
async fn sign_in_url(app: &TestApp, token: &str) -> String {
    let ticket: Value = app.post(token, "/v1/dashboard/tickets").await.json().await.unwrap();
    app.url(ticket["url"].as_str().unwrap())
}

async fn browse(dir: &Path, url: &str, output: &[&str]) -> String {
    let profile = dir.join(format!("profile-{}", uuid::Uuid::new_v4()));
    let result = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"])
        .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
        .args(["--virtual-time-budget=5000", "--window-size=1200,900"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(output)
        .arg(url)
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {} (scripts/test installs Debian's chromium): {e}", chromium()));
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    String::from_utf8(result.stdout).unwrap()
}

/// The text of the element carrying `attribute="name"` in the dumped DOM.
fn shown(dom: &str, attribute: &str, name: &str) -> String {
    let marker = format!("{attribute}=\"{name}\">");
    let start = dom.find(&marker).unwrap_or_else(|| panic!("{marker} not on the page")) + marker.len();
    dom[start..start + dom[start..].find('<').unwrap()].to_owned()
}

#[sqlx::test(migrations = "./migrations")]
async fn the_dashboard_shows_the_numbers_of_the_usage_api(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 50).await;
    let admin = app.token("acme", "alice");
    let done = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 20})).await;
    app.drain().await;
    app.get(Some(&admin), &format!("/v1/exports/{done}/file")).await.bytes().await.unwrap();
    let queued = app.export(&admin, &json!({"dataset": "tickets", "format": "csv"})).await; // stays queued
    let usage: Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let url = sign_in_url(&app, &admin).await;
    let dom = browse(dir.path(), &url, &["--dump-dom"]).await;
    for key in ["running_exports", "queued_exports", "stored_bytes", "egress_bytes_today", "rows_exported_today"] {
        assert_eq!(shown(&dom, "data-metric", key), usage["usage"][key].to_string(), "{key}");
    }
    assert_eq!(shown(&dom, "data-limit", "queued_exports"), usage["limits"]["max_queued_exports"].to_string());
    for (kind, n) in usage["usage"]["refusals_today"].as_object().unwrap() {
        assert_eq!(shown(&dom, "data-refusals", kind), n.to_string(), "{kind}");
    }
    assert_eq!(usage["usage"]["refusals_today"].as_object().unwrap().len(), 6, "every kind, also when 0");
    assert_eq!(shown(&dom, "data-state", "SUCCEEDED"), "1");
    assert_eq!(shown(&dom, "data-state", "QUEUED"), "1");
    assert!(dom.contains(&done), "recent exports are listed");
    assert_eq!(shown(&dom, "data-expected-rows", &queued), "50", "the estimate taken at creation");
    assert_eq!(shown(&dom, "data-expected-rows", &done), "50");
    assert_eq!(shown(&dom, "data-eta", &queued), "–", "no ETA before it runs");

    let screenshot: PathBuf = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&screenshot);
    browse(dir.path(), &url, &[&format!("--screenshot={}", screenshot.display())]).await;
    let png = std::fs::read(&screenshot).expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "saved to {}", screenshot.display());
}

#[sqlx::test(migrations = "./migrations")]
async fn the_dashboard_asks_for_an_admin_token(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let page = app.get(None, "/dashboard").await;
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-security-policy"].to_str().unwrap().contains("default-src 'none'"));
    assert!(page.text().await.unwrap().contains("<form method=post action=/dashboard/signin>"));
    let origin = app.url("");
    let sign_in = |client: &reqwest::Client, token: String, origin: &str| {
        client.post(app.url("/dashboard/signin")).header("origin", origin).form(&[("token", token)]).send()
    };
    let partner = sign_in(&app.client, app.token("acme", "zenpartner"), &origin).await.unwrap();
    assert_eq!(partner.status(), 401);
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
