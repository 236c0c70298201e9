//! Parquet exports, read by tools nobody here wrote: DuckDB and pyarrow (tests/parquet/check.py,
//! installed by scripts/test into data/tools/parquet) compare every row with a CSV export of the
//! same snapshot and every footer statistic with the manifest. Then what the format changes for
//! downloads, estimates, incremental exports with tombstones, values that do not fit, and a
//! worker killed mid-export.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::processes::{self, spawn_worker, wait_terminal};
use crate::common::sha256_hex as sha256;
use crate::common::{Backend, TestApp, gunzip, problem};
use arrow_array::Array;
use arrow_array::cast::AsArray;
use exportd::jobs::Step;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::{Value, json};
use sqlx::PgPool;

/// Every column type at its edges: NULLs, empty and non-BMP strings, formula-like text, the
/// extreme integers, exact decimals, timestamps at both ends of the range and with offsets,
/// nested JSON and JSON scalars. Keys sort by bytes (`Z` < `a` < `é`).
fn ledger() -> Value {
    let text = r#"[
      {"key": "r01", "data": {"memo": "", "quantity": -9223372036854775808, "amount": -0.5, "ratio": 0.1,
        "settled": true, "booked_at": "0001-01-01T00:00:00Z", "details": {"z": [1, {"b": null}], "a": "x"}}},
      {"key": "r02", "data": {"memo": "=SUM(A1:A2)", "quantity": 9223372036854775807,
        "amount": 1234567890.1234567890123, "ratio": 3.14159265358979323846264338327950288,
        "settled": false, "booked_at": "9999-12-31T23:59:59.999999Z", "details": []}},
      {"key": "r03", "data": {"memo": "😀 𝄞 non-BMP", "quantity": 0, "amount": 0, "booked_at": "2026-11-30T10:00:00.5+05:30",
        "details": {}}},
      {"key": "r04", "data": {"memo": "line\nbreak, \"quoted\"", "quantity": -1,
        "amount": 9999999999999999999999999.9999999999999, "booked_at": "1969-12-31T23:59:59.999999Z", "details": "scalar"}},
      {"key": "r05", "data": {"memo": "Zürich 東京", "quantity": null, "amount": null, "ratio": null, "settled": null,
        "booked_at": null, "details": null}},
      {"key": "r06", "data": {"memo": "+1 555 0100", "details": 42}},
      {"key": "r07", "data": {"memo": "a long memo that runs past the sixty-four bytes statistics keep of text columns", "details": true}},
      {"key": "Z-upper", "data": {"memo": "upper", "amount": -12.5}},
      {"key": "a-lower", "data": {"memo": "lower", "amount": 12.50}},
      {"key": "é-accent", "data": {"memo": "accent", "quantity": 7}}
    ]"#;
    let mut records: Vec<Value> = serde_json::from_str(text).unwrap();
    for i in 8..40 {
        let amount: Value = serde_json::from_str(&format!("{i}.{i:013}")).unwrap();
        records.push(json!({"key": format!("r{i:02}"), "data": {"memo": format!("row {i}"), "quantity": i * 1000,
            "amount": amount, "settled": i % 3 == 0, "booked_at": format!("2026-12-{:02}T00:00:00Z", i % 28 + 1)}}));
    }
    Value::Array(records)
}

fn python() -> PathBuf {
    let tools = std::env::var("EXPORTD_PARQUET_TOOLS")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/data/tools/parquet").to_owned());
    PathBuf::from(tools).join("bin/python")
}

/// GET with the admin token, asserting 200.
async fn fetch(app: &TestApp, token: &str, path: &str) -> reqwest::Response {
    let response = app.get(Some(token), path).await;
    assert_eq!(response.status(), 200, "{path}");
    response
}

/// The Parquet export's manifest and shards, downloaded as a partner would, into `dir`.
async fn download_parquet(app: &TestApp, token: &str, id: &str, dir: &Path) -> Value {
    let bytes = fetch(app, token, &format!("/v1/exports/{id}/manifest")).await.bytes().await.unwrap();
    std::fs::write(dir.join("manifest.json"), &bytes).unwrap();
    let manifest: Value = serde_json::from_slice(&bytes).unwrap();
    for shard in manifest["shards"].as_array().unwrap() {
        let path = format!("/v1/exports/{id}/shards/{}", shard["index"]);
        let response = fetch(app, token, &path).await;
        assert_eq!(response.headers()["content-type"], "application/vnd.apache.parquet");
        let body = response.bytes().await.unwrap();
        assert_eq!(sha256(&body), shard["sha256"].as_str().unwrap());
        assert_eq!(&body[..4], b"PAR1");
        std::fs::write(dir.join(shard["name"].as_str().unwrap()), &body).unwrap();
    }
    manifest
}

#[sqlx::test(migrations = "./migrations")]
async fn duckdb_and_pyarrow_read_exactly_the_rows_of_a_csv_export(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("globex", "hank");
    assert_eq!(app.ingest(&admin, "ledger", &ledger()).await.status(), 200);
    let csv = app.export(&admin, &json!({"dataset": "ledger", "format": "csv"})).await;
    let parquet = app.export(&admin, &json!({"dataset": "ledger", "format": "parquet", "shard_rows": 7})).await;
    assert_eq!(app.drain().await, vec![Step::Published, Step::Published]);

    let dir = tempfile::tempdir().unwrap();
    let manifest = download_parquet(&app, &admin, &parquet, dir.path()).await;
    let whole_csv = fetch(&app, &admin, &format!("/v1/exports/{csv}/file")).await.bytes().await.unwrap();
    std::fs::write(dir.path().join("export.csv"), gunzip(&whole_csv)).unwrap();

    assert_eq!((manifest["format"].as_str(), manifest["compression"].as_str()), (Some("parquet"), Some("zstd")));
    assert_eq!(manifest["total_rows"], 42);
    assert_eq!(manifest["shards"].as_array().unwrap().len(), 6);
    assert_eq!(manifest["file"], Value::Null, "Parquet files do not concatenate");
    assert_eq!(
        manifest["file_schema"][3],
        json!({"name": "amount", "type": "FIXED_LEN_BYTE_ARRAY (DECIMAL(38,13))", "nullable": true})
    );
    assert_eq!(manifest["file_schema"][1], json!({"name": "memo", "type": "BYTE_ARRAY (STRING)", "nullable": false}));
    let status: Value = fetch(&app, &admin, &format!("/v1/exports/{parquet}")).await.json().await.unwrap();
    assert_eq!(status["links"]["file"], Value::Null);
    assert_eq!(status["links"]["shards"].as_array().unwrap().len(), 6);
    assert_eq!(status["file"], Value::Null);
    let whole = app.get(Some(&admin), &format!("/v1/exports/{parquet}/file")).await;
    assert_eq!(whole.status(), 404);
    let body = problem(whole).await;
    assert_eq!((body["code"].as_str(), body["format"].as_str()), (Some("no-whole-file"), Some("parquet")));
    assert!(body["detail"].as_str().unwrap().contains("download the shards"), "{body}");

    // A range of a shard resumes like any other download.
    let shard = std::fs::read(dir.path().join("shard-00000.parquet")).unwrap();
    let ranged = app
        .client
        .get(app.url(&format!("/v1/exports/{parquet}/shards/0")))
        .bearer_auth(&admin)
        .header("range", "bytes=100-")
        .send()
        .await
        .unwrap();
    assert_eq!(ranged.status(), 206);
    assert_eq!(ranged.bytes().await.unwrap(), shard[100..]);

    let output = tokio::process::Command::new(python())
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/parquet/check.py"))
        .arg(dir.path())
        .output()
        .await
        .unwrap_or_else(|e| {
            panic!("cannot run {} (scripts/test installs duckdb and pyarrow): {e}", python().display())
        });
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    println!("{stdout}");
    assert_eq!(stdout.lines().count(), 4, "every check ran: {stdout}");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_estimate_measures_parquet_with_its_own_writer(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("globex", "hank");
    assert_eq!(app.ingest(&admin, "ledger", &ledger()).await.status(), 200);
    let request = json!({"dataset": "ledger", "format": "parquet", "shard_rows": 7});
    let response = app.client.post(app.url("/v1/exports/estimate")).bearer_auth(&admin).json(&request).send().await;
    let estimate: Value = response.unwrap().json().await.unwrap();
    assert_eq!(estimate["shards"], 6);
    assert_eq!(estimate["bytes"]["gzip"], Value::Null, "no gzip file: {estimate}");
    let id = app.export(&admin, &request).await;
    app.drain().await;
    let manifest: Value = fetch(&app, &admin, &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    let (estimated, actual) =
        (estimate["bytes"]["download"].as_f64().unwrap(), manifest["total_bytes"].as_f64().unwrap());
    assert!((0.8..1.25).contains(&(estimated / actual)), "estimated {estimated} bytes, exported {actual}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_value_that_does_not_fit_fails_the_export_and_names_column_and_key(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("globex", "hank");
    let records: Value = serde_json::from_str(
        r#"[{"key": "fine", "data": {"memo": "ok", "amount": 1.5}},
            {"key": "too-precise", "data": {"memo": "secret-memo", "amount": 0.12345678901234}}]"#,
    )
    .unwrap();
    assert_eq!(app.ingest(&admin, "ledger", &records).await.status(), 200);
    let parquet = app.export(&admin, &json!({"dataset": "ledger", "format": "parquet"})).await;
    let csv = app.export(&admin, &json!({"dataset": "ledger", "format": "csv"})).await;
    app.drain().await;
    let status: Value = fetch(&app, &admin, &format!("/v1/exports/{parquet}")).await.json().await.unwrap();
    assert_eq!(status["state"], "FAILED");
    assert_eq!(status["error"]["code"], "value-does-not-fit");
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(detail.contains("column `amount`") && detail.contains("DECIMAL(38,13)"), "{detail}");
    assert!(detail.contains("scale") && detail.contains("\"too-precise\""), "{detail}");
    assert!(!detail.contains("0.1234") && !detail.contains("secret-memo"), "no value in the detail: {detail}");
    assert_eq!(app.state(&csv).await, "SUCCEEDED", "CSV keeps the digits as text");
}

#[sqlx::test(migrations = "./migrations")]
async fn an_incremental_parquet_export_carries_upserts_and_tombstones(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let admin = app.token("globex", "hank");
    assert_eq!(app.ingest(&admin, "ledger", &ledger()).await.status(), 200);
    let full = app.export(&admin, &json!({"dataset": "ledger", "format": "parquet"})).await;
    app.drain().await;
    let manifest: Value = fetch(&app, &admin, &format!("/v1/exports/{full}/manifest")).await.json().await.unwrap();
    let changes = json!([
        {"key": "r02", "data": {"memo": "changed", "quantity": 2}},
        {"key": "r03", "deleted": true}
    ]);
    assert_eq!(app.ingest(&admin, "ledger", &changes).await.status(), 200);
    app.tick().await;
    app.pass_safety_delay();
    let since = manifest["next_cursor"].as_str().unwrap();
    let request = json!({"dataset": "ledger", "format": "parquet", "mode": "incremental", "since": since});
    let incremental = app.export(&admin, &request).await;
    assert_eq!(app.drain().await, vec![Step::Published]);

    let manifest: Value =
        fetch(&app, &admin, &format!("/v1/exports/{incremental}/manifest")).await.json().await.unwrap();
    assert_eq!(manifest["file_schema"][1], json!({"name": "_op", "type": "BYTE_ARRAY (STRING)", "nullable": false}));
    assert_eq!(manifest["file_schema"][2]["nullable"], true, "a tombstone has no memo, required or not");
    let shard = fetch(&app, &admin, &format!("/v1/exports/{incremental}/shards/0")).await.bytes().await.unwrap();
    let reader = ParquetRecordBatchReaderBuilder::try_new(shard).unwrap();
    assert!(reader.metadata().row_group(0).sorting_columns().is_none(), "changes are in window order, not key order");
    let batch = reader.build().unwrap().next().unwrap().unwrap();
    let text = |i: usize| {
        let column = batch.column(i).as_string::<i32>();
        (0..column.len()).map(|r| column.is_valid(r).then(|| column.value(r).to_owned())).collect::<Vec<_>>()
    };
    assert_eq!(text(0), [Some("r02".to_owned()), Some("r03".to_owned())]);
    assert_eq!(text(1), [Some("upsert".to_owned()), Some("delete".to_owned())]);
    assert_eq!(text(2), [Some("changed".to_owned()), None]);
}

/// A worker killed (SIGKILL) after it wrote a shard: another finishes the export, and every shard
/// has the bytes an uninterrupted run of the same job writes.
#[sqlx::test(migrations = "./migrations")]
async fn a_worker_killed_mid_export_leaves_the_bytes_of_an_uninterrupted_run(pool: PgPool) {
    let app = TestApp::spawn_on(pool, Backend::Local).await;
    app.seed("initech", "tickets", 600).await; // initech scans 200 rows a second: 3 s of work
    let admin = app.token("initech", "bill");
    let id = app.export(&admin, &json!({"dataset": "tickets", "format": "parquet", "shard_rows": 100})).await;
    let url = processes::database_url(&app.pool).await;
    let log = app.data_dir.path().join("workers.log");
    let mut victim = spawn_worker(&url, app.data_dir.path(), &log, 1, "2s");
    let written = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM export_shards WHERE export_id = $1::uuid")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    let started = std::time::Instant::now();
    while written().await < 1 {
        assert!(started.elapsed() < Duration::from_secs(60), "no shard written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    victim.kill().unwrap(); // SIGKILL, between shards or in the middle of one
    victim.wait().unwrap();
    assert_eq!(app.state(&id).await, "RUNNING", "killed mid-export");
    let mut rescuer = spawn_worker(&url, app.data_dir.path(), &log, 1, "2s");
    assert_eq!(wait_terminal(&app.pool, &id, Duration::from_secs(60)).await, "SUCCEEDED");
    rescuer.kill().unwrap();
    rescuer.wait().unwrap();
    let resumed: Vec<String> = shard_hashes(&app.pool, &id).await;
    assert_eq!(resumed.len(), 6);
    for (file, sha) in app.own_shard_files(&id).await.iter().zip(&resumed) {
        assert_eq!(&sha256(file), sha, "each file has its checkpointed sha256");
    }

    // The same job again, uninterrupted, into an empty store (rewound with triggers off: it is
    // no transition of the state machine).
    let mut rewind = app.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *rewind).await.unwrap();
    sqlx::query("UPDATE export_jobs SET state = 'QUEUED', manifest = NULL, manifest_sha256 = NULL, lease_expires_at = NULL,
                 shards_done = 0, rows_done = 0, bytes_done = 0, planned_shards = 0, plan_complete = false WHERE id = $1::uuid")
        .bind(&id).execute(&mut *rewind).await.unwrap();
    sqlx::query("DELETE FROM export_shards WHERE export_id = $1::uuid").bind(&id).execute(&mut *rewind).await.unwrap();
    sqlx::query("DELETE FROM export_shard_plan WHERE export_id = $1::uuid")
        .bind(&id)
        .execute(&mut *rewind)
        .await
        .unwrap();
    rewind.commit().await.unwrap();
    let second_dir = tempfile::tempdir().unwrap();
    let second_store = crate::common::fresh_store(Backend::Local, &app.pool, second_dir.path()).await;
    let clean = app.deps_with(app.registry.clone(), second_store);
    assert_eq!(exportd::jobs::drain(&clean, "clean").await.unwrap(), vec![Step::Published]);
    assert_eq!(shard_hashes(&app.pool, &id).await, resumed, "the same bytes with or without a crash");
}

async fn shard_hashes(pool: &PgPool, id: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT sha256 FROM export_shards WHERE export_id = $1::uuid ORDER BY shard_index")
        .bind(id)
        .fetch_all(pool)
        .await
        .unwrap()
}
