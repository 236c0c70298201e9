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
fn sign_in_page(dir: &Path, app: &TestApp, token: &str) -> String {
    let html = format!(
        "<!doctype html><form method=post action='{}'><input name=token value='{token}'></form>\
         <script>document.forms[0].submit()</script>",
        app.url("/dashboard/signin")
    );
    let path = dir.join("signin.html");
    std::fs::write(&path, html).unwrap();
    format!("file://{}", path.display())
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
    app.export(&admin, &json!({"dataset": "contacts", "format": "csv"})).await; // stays queued
    let usage: Value = app.get(Some(&admin), "/v1/usage").await.json().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let url = sign_in_page(dir.path(), &app, &admin);
    let dom = browse(dir.path(), &url, &["--dump-dom"]).await;
    for key in ["running_exports", "queued_exports", "stored_bytes", "egress_bytes_today", "rows_exported_today"] {
        assert_eq!(shown(&dom, "data-metric", key), usage["usage"][key].to_string(), "{key}");
    }
    assert_eq!(shown(&dom, "data-limit", "queued_exports"), usage["limits"]["max_queued_exports"].to_string());
    assert_eq!(shown(&dom, "data-state", "SUCCEEDED"), "1");
    assert_eq!(shown(&dom, "data-state", "QUEUED"), "1");
    assert!(dom.contains(&done), "recent exports are listed");

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
    let partner = app
        .client
        .post(app.url("/dashboard/signin"))
        .form(&[("token", app.token("acme", "zenpartner"))])
        .send()
        .await
        .unwrap();
    assert_eq!(partner.status(), 401);
    let admin = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let signed_in =
        admin.post(app.url("/dashboard/signin")).form(&[("token", app.token("acme", "alice"))]).send().await.unwrap();
    assert_eq!(signed_in.status(), 303);
    let cookie = signed_in.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("Path=/dashboard"));
    let page =
        admin.get(app.url("/dashboard")).header("cookie", cookie.split(';').next().unwrap()).send().await.unwrap();
    assert!(page.text().await.unwrap().contains("Acme (tests)"));
}
