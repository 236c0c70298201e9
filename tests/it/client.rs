//! `exportd-client download` and `pull` against a real server: resume after a kill, parallel
//! shards, checksums, cursors.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::common::TestApp;
use exportd::jobs::Step;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::process::Command;

async fn published(app: &TestApp) -> (String, Value) {
    app.seed("acme", "tickets", 600).await;
    let token = app.token("acme", "alice");
    let id = app.export(&token, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 200})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let manifest: Value = app.get(Some(&token), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    (id, manifest)
}

/// The partner client's binary, built with the workspace (`cargo build` builds it; alone:
/// `cargo build -p exportd-client`).
fn client_binary() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_exportd")).with_file_name("exportd-client");
    assert!(path.exists(), "{} is missing: build it with `cargo build -p exportd-client`", path.display());
    path
}

fn client(app: &TestApp, id: &str, out: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(client_binary());
    command
        .args(["download", id, "--out"])
        .arg(out)
        .args(extra)
        .env("EXPORTD_URL", app.url(""))
        .env("EXPORTD_TOKEN", app.token("acme", "alice"))
        .env("EXPORTD_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn sha256_of(path: &Path) -> String {
    exportd::storage::file_digest(path).unwrap().unwrap().1
}

#[sqlx::test(migrations = "./migrations")]
async fn a_killed_download_resumes_where_it_stopped(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, manifest) = published(&app).await;
    let total = manifest["file"]["bytes"].as_u64().unwrap();
    let out = tempfile::tempdir().unwrap();
    let name = manifest["file"]["name"].as_str().unwrap();
    let part = out.path().join(format!("{name}.part"));

    let mut slow = client(&app, &id, out.path(), &["--limit-rate", "8000"]).spawn().unwrap();
    // Wait for real progress on disk, then kill the process mid-transfer.
    let mut have = 0;
    for _ in 0..500 {
        have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        if have >= 8000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    slow.kill().await.unwrap();
    let have = std::fs::metadata(&part).unwrap().len().max(have);
    assert!(have >= 8000 && have < total, "killed mid-transfer ({have} of {total} bytes)");

    let resumed = client(&app, &id, out.path(), &[]).output().await.unwrap();
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    let said = String::from_utf8_lossy(&resumed.stderr);
    assert!(said.contains(&format!("resuming after the {have} bytes already downloaded")), "{said}");
    let file = out.path().join(name);
    assert_eq!(sha256_of(&file), manifest["file"]["sha256"]);
    assert!(!part.exists());
    let (status, range): (i32, String) =
        sqlx::query_as("SELECT status, byte_range FROM audit_log WHERE action = 'downloaded' ORDER BY id DESC LIMIT 1")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(status, 206, "the second run asked for the rest only");
    assert!(range.ends_with(&format!("-{}", total - 1)) && !range.starts_with("0-"), "{range}");

    // Running again finds the file complete and downloads nothing.
    let downloads = || {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM audit_log WHERE action = 'downloaded'").fetch_one(&app.pool)
    };
    let before = downloads().await.unwrap();
    assert!(client(&app, &id, out.path(), &[]).output().await.unwrap().status.success());
    assert_eq!(downloads().await.unwrap(), before);
}

#[sqlx::test(migrations = "./migrations")]
async fn shards_download_in_parallel_and_match_the_manifest(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, manifest) = published(&app).await;
    let out = tempfile::tempdir().unwrap();
    let run = client(&app, &id, out.path(), &["--parallel", "3"]).output().await.unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let shards = manifest["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 3);
    for shard in shards {
        assert_eq!(sha256_of(&out.path().join(shard["name"].as_str().unwrap())), shard["sha256"]);
    }
    // The paths print in the manifest's order, whichever shard finished first.
    let printed: Vec<String> = String::from_utf8_lossy(&run.stdout).lines().map(str::to_owned).collect();
    let expected: Vec<String> =
        shards.iter().map(|s| out.path().join(s["name"].as_str().unwrap()).display().to_string()).collect();
    assert_eq!(printed, expected);
}

/// A Parquet export has no whole file: the client fetches and verifies every shard file.
#[sqlx::test(migrations = "./migrations")]
async fn a_parquet_export_downloads_as_its_shard_files(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    app.seed("acme", "tickets", 300).await;
    let token = app.token("acme", "alice");
    let id = app.export(&token, &json!({"dataset": "tickets", "format": "parquet", "shard_rows": 120})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let manifest: Value = app.get(Some(&token), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    let out = tempfile::tempdir().unwrap();
    let run = client(&app, &id, out.path(), &[]).output().await.unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let names: Vec<&str> = manifest["shards"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]);
    for shard in manifest["shards"].as_array().unwrap() {
        assert_eq!(sha256_of(&out.path().join(shard["name"].as_str().unwrap())), shard["sha256"]);
    }
    assert_eq!(String::from_utf8_lossy(&run.stdout).lines().count(), 3);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_changed_validator_restarts_the_file(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, manifest) = published(&app).await;
    let out = tempfile::tempdir().unwrap();
    let name = manifest["file"]["name"].as_str().unwrap();
    std::fs::write(out.path().join(format!("{name}.part")), vec![b'x'; 500]).unwrap();
    // The server now names the file by another validator: If-Range fails, the whole file comes.
    sqlx::query("UPDATE export_jobs SET file_sha256 = repeat('f', 64) WHERE id = $1::uuid")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();
    let run = client(&app, &id, out.path(), &[]).output().await.unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert_eq!(sha256_of(&out.path().join(name)), manifest["file"]["sha256"]);
    let status: i32 =
        sqlx::query_scalar("SELECT status FROM audit_log WHERE action = 'downloaded' ORDER BY id DESC LIMIT 1")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(status, 200);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_corrupted_download_fails_with_a_clear_message(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, manifest) = published(&app).await;
    let key: String =
        sqlx::query_scalar("SELECT object_key FROM export_shards WHERE export_id = $1::uuid AND shard_index = 1")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let path = app.data_dir.path().join("objects").join(key);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();

    let out = tempfile::tempdir().unwrap();
    let run = client(&app, &id, out.path(), &["--shards"]).output().await.unwrap();
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("checksum mismatch for") && stderr.contains(manifest["shards"][1]["name"].as_str().unwrap()),
        "{stderr}"
    );
    assert!(!out.path().join(manifest["shards"][1]["name"].as_str().unwrap()).exists());
}

#[sqlx::test(migrations = "./migrations")]
async fn pull_appends_each_change_once_and_keeps_its_cursor(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let dir = tempfile::tempdir().unwrap();
    let (cursor_file, out) = (dir.path().join("tickets.cursor"), dir.path().join("changes.jsonl"));
    let pull = || {
        let mut command = Command::new(client_binary());
        command
            .args(["pull", "--dataset", "tickets", "--limit", "1", "--cursor-file"])
            .arg(&cursor_file)
            .arg("--out")
            .arg(&out)
            .env("EXPORTD_URL", app.url(""))
            .env("EXPORTD_TOKEN", app.token("acme", "alice"))
            .env("EXPORTD_LOG", "error");
        command
    };
    let lines = || {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect::<Vec<_>>()
    };

    assert!(pull().output().await.unwrap().status.success());
    assert!(cursor_file.exists(), "a missing cursor file starts the feed from now");
    let mut conn = app.pool.acquire().await.unwrap();
    for key in ["a", "b"] {
        sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, '{\"subject\": \"s\", \"status\": \"open\"}')")
            .bind(key)
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    app.tick().await;
    app.pass_safety_delay();
    let run = pull().output().await.unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "2 changes");
    sqlx::query("SELECT exportd_delete('acme', 'tickets', 'a')").execute(&mut *conn).await.unwrap();
    app.tick().await;
    app.pass_safety_delay();
    assert!(pull().output().await.unwrap().status.success());
    let keys: Vec<(String, String)> =
        lines().iter().map(|c| (c["op"].as_str().unwrap().to_owned(), c["key"].as_str().unwrap().to_owned())).collect();
    assert_eq!(keys, [("upsert".into(), "a".into()), ("upsert".into(), "b".into()), ("delete".into(), "a".into())]);
}

#[sqlx::test(migrations = "./migrations")]
async fn pull_since_an_export_starts_where_the_export_ends(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (id, _) = published(&app).await;
    let mut conn = app.pool.acquire().await.unwrap();
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', 'after', '{\"subject\": \"s\", \"status\": \"open\"}')")
        .execute(&mut *conn)
        .await
        .unwrap();
    app.tick().await;
    app.pass_safety_delay();
    let dir = tempfile::tempdir().unwrap();
    let (cursor_file, out) = (dir.path().join("tickets.cursor"), dir.path().join("changes.jsonl"));
    let pull = || {
        Command::new(client_binary())
            .args(["pull", "--dataset", "tickets", "--since-export", &id, "--cursor-file"])
            .arg(&cursor_file)
            .arg("--out")
            .arg(&out)
            .env("EXPORTD_URL", app.url(""))
            .env("EXPORTD_TOKEN", app.token("acme", "alice"))
            .output()
    };
    let run = pull().await.unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    // The 600 exported records are not repeated; the change after the export arrives once.
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "1 change");
    let change: Value = serde_json::from_str(std::fs::read_to_string(&out).unwrap().trim()).unwrap();
    assert_eq!((change["op"].as_str(), change["key"].as_str()), (Some("upsert"), Some("after")));
    // Run again, the cursor file now holds the position: the client says it ignores the export.
    let again = pull().await.unwrap();
    assert!(again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains(&format!("--since-export {id} ignored")) && stderr.contains("cursor file"), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&again.stdout).trim(), "0 changes");
}
