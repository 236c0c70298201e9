//! Downloads over a real TCP port: links, ranges, revoke, retention, the cleaner, audit.

use crate::common::sha256_hex as sha256;
use crate::common::{TestApp, gunzip, problem};
use exportd::jobs::Step;
use serde_json::{Value, json};
use sqlx::PgPool;

/// A published multi-shard CSV export of 230 acme tickets by `principal`: (id, status, manifest).
async fn published(app: &TestApp, principal: &str) -> (String, Value, Value) {
    app.seed("acme", "tickets", 230).await;
    let token = app.token("acme", principal);
    let id = app.export(&token, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 100})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let status: Value = app.get(Some(&token), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    let manifest: Value = app.get(Some(&token), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    (id, status, manifest)
}

async fn fetch(app: &TestApp, path: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = app.client.get(app.url(path));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn the_status_hands_out_fresh_links_and_the_whole_file_is_one_csv(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, status, manifest) = published(&app, "alice").await;
    let links = &status["links"];
    assert_eq!(links["shards"].as_array().unwrap().len(), 3);
    assert!(status["links_expire_at"].is_string());
    assert_eq!(status["file"]["sha256"], manifest["file"]["sha256"]);

    let response = fetch(&app, links["file"].as_str().unwrap(), &[]).await;
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    assert_eq!(headers["content-type"], "application/gzip");
    assert_eq!(headers["accept-ranges"], "bytes");
    assert_eq!(headers["cache-control"], "private, no-store");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert_eq!(headers["content-disposition"], format!("attachment; filename=\"tickets-{id}.csv.gz\""));
    assert_eq!(headers["etag"].to_str().unwrap(), format!("\"{}\"", manifest["file"]["sha256"].as_str().unwrap()));
    let body = response.bytes().await.unwrap();
    assert_eq!(headers["content-length"], body.len().to_string().as_str());
    assert_eq!(sha256(&body), manifest["file"]["sha256"]);
    assert_eq!(body.len() as u64, manifest["file"]["bytes"].as_u64().unwrap());

    // One gzip member (a single-member decoder reads it all), one BOM, one header, every row.
    let mut text = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&body[..]), &mut text).unwrap();
    assert_eq!(text, gunzip(&body));
    assert!(text.starts_with(b"\xEF\xBB\xBF\"id\""));
    let rows = crate::common::csv_rows(&body);
    assert_eq!(rows.len(), 231);
    assert_eq!(rows.iter().filter(|r| r[0] == "id").count(), 1);
    let mut from_shards = Vec::new();
    for shard in app.own_shard_files(&id).await {
        from_shards.extend(crate::common::csv_rows(&shard).into_iter().skip(1));
    }
    assert_eq!(rows[1..], from_shards[..]);

    for (n, link) in links["shards"].as_array().unwrap().iter().enumerate() {
        let shard = fetch(&app, link.as_str().unwrap(), &[]).await.bytes().await.unwrap();
        assert_eq!(sha256(&shard), manifest["shards"][n]["sha256"]);
    }
    // Asking again issues new links; the manifest stays byte-identical.
    app.clock.advance(std::time::Duration::from_secs(1));
    let again: Value =
        app.get(Some(&app.token("acme", "alice")), &format!("/v1/exports/{id}")).await.json().await.unwrap();
    assert_ne!(again["links"]["file"], links["file"]);
}

#[sqlx::test(migrations = "./migrations")]
async fn an_interrupted_download_resumes_with_range_and_if_range(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (_, status, manifest) = published(&app, "alice").await;
    let link = status["links"]["file"].as_str().unwrap();
    let etag = format!("\"{}\"", manifest["file"]["sha256"].as_str().unwrap());
    let len = manifest["file"]["bytes"].as_u64().unwrap();

    // Read 1000 bytes, then drop the connection.
    let mut response = fetch(&app, link, &[]).await;
    let mut first = Vec::new();
    while first.len() < 1000 {
        first.extend_from_slice(&response.chunk().await.unwrap().unwrap());
    }
    first.truncate(1000);
    drop(response);

    let rest = fetch(&app, link, &[("range", "bytes=1000-"), ("if-range", &etag)]).await;
    assert_eq!(rest.status(), 206);
    assert_eq!(rest.headers()["content-range"], format!("bytes 1000-{}/{len}", len - 1).as_str());
    first.extend_from_slice(&rest.bytes().await.unwrap());
    assert_eq!(sha256(&first), manifest["file"]["sha256"]);

    let stale = fetch(&app, link, &[("range", "bytes=1000-"), ("if-range", "\"0000\"")]).await;
    assert_eq!(stale.status(), 200, "a stale validator gets the whole file, never a splice");
    assert_eq!(stale.bytes().await.unwrap().len() as u64, len);

    let past_end = fetch(&app, link, &[("range", &format!("bytes={len}-"))]).await;
    assert_eq!(past_end.status(), 416);
    assert_eq!(past_end.headers()["content-range"], format!("bytes */{len}").as_str());

    let suffix = fetch(&app, link, &[("range", "bytes=-8")]).await;
    assert_eq!(suffix.status(), 206);
    assert_eq!(suffix.headers()["content-range"], format!("bytes {}-{}/{len}", len - 8, len - 1).as_str());
    let trailer = suffix.bytes().await.unwrap();
    assert_eq!(trailer.len(), 8, "the gzip trailer");

    for ignored in ["bytes=9-3", "lines=1-2", "bytes=0-1,5-6"] {
        let response = fetch(&app, link, &[("range", ignored)]).await;
        assert_eq!(response.status(), 200, "{ignored}");
        assert_eq!(response.bytes().await.unwrap().len() as u64, len);
    }

    let head = app.client.head(app.url(link)).send().await.unwrap();
    assert_eq!(head.status(), 200);
    assert_eq!(head.headers()["content-length"], len.to_string().as_str());
    assert_eq!(head.headers()["etag"], etag.as_str());
    assert!(head.bytes().await.unwrap().is_empty());
}

#[sqlx::test(migrations = "./migrations")]
async fn curl_resumes_a_partial_download_to_the_right_checksum(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (_, status, manifest) = published(&app, "alice").await;
    let url = app.url(status["links"]["file"].as_str().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("export.csv.gz");
    // The test runtime has one thread, which also serves: run curl off it.
    let curl = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || std::process::Command::new("curl").args(args).status().unwrap())
    };
    let path = out.to_str().unwrap().to_owned();
    let first =
        curl(vec!["-sS".into(), "-f".into(), "-r".into(), "0-999".into(), "-o".into(), path.clone(), url.clone()])
            .await
            .unwrap();
    assert!(first.success());
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 1000);
    let resumed = curl(vec!["-sS".into(), "-f".into(), "-C".into(), "-".into(), "-o".into(), path, url]).await.unwrap();
    assert!(resumed.success());
    assert_eq!(sha256(&std::fs::read(&out).unwrap()), manifest["file"]["sha256"]);
}

#[sqlx::test(migrations = "./migrations")]
async fn bad_expired_foreign_or_misused_links_are_refused(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, status, _) = published(&app, "zenpartner").await;
    let file = status["links"]["file"].as_str().unwrap().to_owned();
    let shard0 = status["links"]["shards"][0].as_str().unwrap().to_owned();

    let mut flipped = file.clone().into_bytes();
    let at = flipped.len() - 3;
    flipped[at] = if flipped[at] == b'A' { b'B' } else { b'A' };
    let flipped = String::from_utf8(flipped).unwrap();
    let other_object = shard0.replace("/shards/0?", "/shards/1?");
    let other_export = file.replace(&id, &uuid::Uuid::new_v4().to_string());
    for (what, path, code) in [
        ("flipped bit", flipped.as_str(), "invalid-link"),
        ("shard 0's link on shard 1", other_object.as_str(), "invalid-link"),
        ("the link of another export", other_export.as_str(), "invalid-link"),
        ("no token at all", "/v1/exports/x/file?token=", "invalid-link"),
    ] {
        let response = fetch(&app, path, &[]).await;
        assert_eq!(response.status(), 403, "{what}");
        assert_eq!(problem(response).await["code"], code, "{what}");
    }

    // Principal B presenting A's link.
    let as_other = fetch(&app, &file, &[("authorization", &format!("Bearer {}", app.token("acme", "alice")))]).await;
    assert_eq!(as_other.status(), 403);

    // The same link on a server where the partner was disabled, or lost the grant.
    let disabled = app
        .sibling(crate::common::edited_registry("acme", |t| {
            t.replace("grants = [\"tickets\"]\nrow_filter", "disabled = true\ngrants = [\"tickets\"]\nrow_filter")
        }))
        .await;
    let response = app.client.get(format!("{disabled}{file}")).send().await.unwrap();
    assert_eq!(response.status(), 403);
    assert_eq!(problem(response).await["code"], "principal-disabled");
    let ungranted = app
        .sibling(crate::common::edited_registry("acme", |t| {
            t.replace("grants = [\"tickets\"]\nrow_filter", "grants = []\nrow_filter")
        }))
        .await;
    let response = app.client.get(format!("{ungranted}{file}")).send().await.unwrap();
    assert_eq!(response.status(), 403);
    assert_eq!(problem(response).await["code"], "dataset-not-granted");

    assert_eq!(fetch(&app, &file, &[]).await.status(), 200, "the link itself is fine");
    app.clock.advance(std::time::Duration::from_secs(301));
    let expired = fetch(&app, &file, &[]).await;
    assert_eq!(expired.status(), 403);
    assert_eq!(problem(expired).await["code"], "link-expired");
}

#[sqlx::test(migrations = "./migrations")]
async fn bearer_downloads_follow_export_visibility(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, _, manifest) = published(&app, "zenpartner").await;
    let path = format!("/v1/exports/{id}/shards/0");
    let owner = app.get(Some(&app.token("acme", "zenpartner")), &path).await;
    assert_eq!(owner.status(), 200);
    assert_eq!(sha256(&owner.bytes().await.unwrap()), manifest["shards"][0]["sha256"]);
    assert_eq!(app.get(Some(&app.token("acme", "alice")), &path).await.status(), 200, "tenant admins too");
    let foreign = app.get(Some(&app.token("globex", "hank")), &path).await;
    let missing =
        app.get(Some(&app.token("globex", "hank")), &format!("/v1/exports/{}/shards/0", uuid::Uuid::new_v4())).await;
    assert_eq!((foreign.status(), missing.status()), (reqwest::StatusCode::NOT_FOUND, reqwest::StatusCode::NOT_FOUND));
    assert_eq!(problem(foreign).await, problem(missing).await);
    assert_eq!(app.get(Some(&app.token("acme", "alice")), &format!("/v1/exports/{id}/shards/7")).await.status(), 404);
    assert_eq!(app.get(None, &path).await.status(), 401);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_revoked_export_is_gone_and_its_files_deleted(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, status, _) = published(&app, "zenpartner").await;
    let admin = app.token("acme", "alice");
    let delete = |token: String| app.client.delete(app.url(&format!("/v1/exports/{id}"))).bearer_auth(token).send();
    assert_eq!(delete(app.token("acme", "zenpartner")).await.unwrap().status(), 403, "partners cannot revoke");
    let revoked = delete(admin.clone()).await.unwrap();
    assert_eq!(revoked.status(), 200);
    assert_eq!(revoked.json::<Value>().await.unwrap()["state"], "REVOKED");
    assert_eq!(delete(admin.clone()).await.unwrap().status(), 200, "revoking again changes nothing");
    assert!(!app.data_dir.path().join(format!("objects/acme/{id}")).exists());
    let gone = fetch(&app, status["links"]["file"].as_str().unwrap(), &[]).await;
    assert_eq!(gone.status(), 410);
    assert_eq!(problem(gone).await["code"], "export-gone");
    assert_eq!(app.get(Some(&admin), &format!("/v1/exports/{id}/manifest")).await.status(), 410);

    let queued = app.export(&admin, &json!({"dataset": "tickets", "format": "csv"})).await;
    let not_yet = delete_path(&app, &admin, &queued).await;
    assert_eq!(not_yet.status(), 409);
    assert_eq!(problem(not_yet).await["code"], "not-revocable");
}

async fn delete_path(app: &TestApp, token: &str, id: &str) -> reqwest::Response {
    app.client.delete(app.url(&format!("/v1/exports/{id}"))).bearer_auth(token).send().await.unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn the_audit_log_records_who_did_what_without_tokens(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, status, _) = published(&app, "zenpartner").await;
    let link = status["links"]["file"].as_str().unwrap();
    fetch(&app, link, &[("range", "bytes=0-99")]).await.bytes().await.unwrap();
    let admin = app.token("acme", "alice");
    let page: Value = app.get(Some(&admin), "/v1/audit?limit=10").await.json().await.unwrap();
    let events = page["events"].as_array().unwrap();
    assert_eq!(events[0]["action"], "downloaded");
    assert_eq!(events[0]["principal"], "zenpartner");
    assert_eq!(events[0]["object"], "file");
    assert_eq!(events[0]["byte_range"], "0-99");
    assert_eq!(events[0]["status"], 206);
    assert_eq!(events[0]["address"], "127.0.0.1");
    assert_eq!(events[0]["export_id"], id.as_str());
    assert_eq!(events.last().unwrap()["action"], "created");
    let token = link.split("token=").nth(1).unwrap();
    assert!(!page.to_string().contains(token));
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE audit_log::text LIKE '%' || $1 || '%'")
        .bind(&token[..40])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, 0, "no token is stored");
    assert_eq!(app.get(Some(&app.token("acme", "zenpartner")), "/v1/audit").await.status(), 403);
    assert!(
        app.get(Some(&app.token("globex", "hank")), "/v1/audit").await.json::<Value>().await.unwrap()["events"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

/// Egress counts the bytes that went out: a client that closes a download early is charged (and
/// audited) for what it was sent, not for the whole file; one that reads it all, for all of it.
#[sqlx::test(migrations = "./migrations")]
async fn a_download_closed_early_is_charged_only_for_what_was_sent(pool: PgPool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = TestApp::spawn(pool).await;
    // Big enough (≈ 8 MB of gzip) that socket buffers cannot take the whole file at once.
    app.seed("acme", "tickets", 150_000).await;
    let admin = app.token("acme", "alice");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "csv"})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let path = format!("/v1/exports/{id}/file");
    let head = app.client.head(app.url(&path)).bearer_auth(&admin).send().await.unwrap();
    let length: u64 = head.headers()["content-length"].to_str().unwrap().parse().unwrap();
    assert!(length > 6 << 20, "{length} bytes");
    let egress = async || -> i64 {
        sqlx::query_scalar("SELECT coalesce(sum(egress_bytes), 0)::bigint FROM tenant_usage WHERE tenant = 'acme'")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    let audited = async || -> Vec<i64> {
        sqlx::query_scalar(
            "SELECT bytes FROM audit_log WHERE action = 'downloaded' AND export_id = $1::text::uuid ORDER BY id",
        )
        .bind(&id)
        .fetch_all(&app.pool)
        .await
        .unwrap()
    };

    // Read the head and 256 KiB of the body, then hang up.
    let mut socket = tokio::net::TcpStream::connect(app.url("").trim_start_matches("http://")).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: exportd\r\nAuthorization: Bearer {admin}\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut received = vec![0u8; 256 << 10];
    socket.read_exact(&mut received).await.unwrap();
    drop(socket);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let sent = loop {
        let rows = audited().await;
        if rows.len() == 1 && (rows[0] as u64) < length {
            break rows[0] as u64;
        }
        assert!(std::time::Instant::now() < deadline, "the early close was never accounted for: {rows:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(sent >= (256 << 10) - 1024, "at least what the client read was sent: {sent}");
    assert_eq!(egress().await as u64, sent, "the day's egress is what was sent");

    // A whole download is charged whole.
    let whole = app.client.get(app.url(&path)).bearer_auth(&admin).send().await.unwrap().bytes().await.unwrap();
    assert_eq!(whole.len() as u64, length);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while audited().await.len() < 2 {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(audited().await, vec![sent as i64, length as i64]);
    assert_eq!(egress().await as u64, sent + length);
}
