//! The artifact store, one set of scenarios run against both backends: the local directory
//! and real S3-compatible object storage (SeaweedFS, started by scripts/test). Writing,
//! verifying, splicing, ranges, deleting, listing, crash-resume — then what only object
//! storage has: abandoned multipart uploads and a store outage in the middle of an export.

use crate::common::proxy::OutageProxy;
use crate::common::sha256_hex as sha256;
use crate::common::{Backend, TestApp, csv_rows, expire_lease, full_csv, problem, put_object, read_object};
use exportd::jobs::{ClaimedExport, Step, WorkerConfig};
use exportd::storage::{ObjectKey, StorageLocation};
use serde_json::{Value, json};
use sqlx::PgPool;

/// Each scenario, once per backend: `local::name` and `s3::name`.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod local {
            $(
                #[sqlx::test(migrations = "./migrations")]
                async fn $name(pool: sqlx::PgPool) {
                    super::$name(super::TestApp::spawn_on(pool, super::Backend::Local).await).await
                }
            )*
        }
        mod s3 {
            $(
                #[sqlx::test(migrations = "./migrations")]
                async fn $name(pool: sqlx::PgPool) {
                    super::$name(super::TestApp::spawn_on(pool, super::Backend::S3).await).await
                }
            )*
        }
    };
}

on_both_backends!(
    shards_are_written_spliced_and_served_in_ranges,
    a_crashed_export_resumes_to_the_same_bytes_without_rewriting_verified_shards,
    truncated_or_extended_shard_files_are_rewritten_on_rerun,
    revoke_expiry_and_the_cleaner_delete_through_the_store,
    a_second_deployment_is_refused_and_deletes_nothing,
);

async fn published(app: &TestApp, rows: u64) -> (String, Value) {
    app.seed("acme", "tickets", rows).await;
    let token = app.token("acme", "alice");
    let id = app.export(&token, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 100})).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let manifest: Value = app.get(Some(&token), &format!("/v1/exports/{id}/manifest")).await.json().await.unwrap();
    (id, manifest)
}

async fn get(app: &TestApp, path: &str, range: Option<&str>) -> reqwest::Response {
    let mut request = app.client.get(app.url(path)).bearer_auth(app.token("acme", "alice"));
    if let Some(range) = range {
        request = request.header("range", range);
    }
    request.send().await.unwrap()
}

async fn shards_are_written_spliced_and_served_in_ranges(app: TestApp) {
    let (id, manifest) = published(&app, 230).await;
    let prefix = ObjectKey::parse(&format!("acme/{id}")).unwrap();
    let listed = app.store.list(Some(&prefix)).await.unwrap();
    assert_eq!(listed.len(), 3, "one object per shard: {listed:?}");
    for (n, shard) in manifest["shards"].as_array().unwrap().iter().enumerate() {
        let key: String =
            sqlx::query_scalar("SELECT object_key FROM export_shards WHERE export_id = $1::uuid AND shard_index = $2")
                .bind(&id)
                .bind(n as i32)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        let (bytes, digest) = app.store.digest(&ObjectKey::parse(&key).unwrap()).await.unwrap().unwrap();
        assert_eq!((bytes, digest.as_str()), (shard["bytes"].as_u64().unwrap(), shard["sha256"].as_str().unwrap()));
        let served = get(&app, &format!("/v1/exports/{id}/shards/{n}"), None).await.bytes().await.unwrap();
        assert_eq!(sha256(&served), shard["sha256"]);
    }

    // The whole file is spliced from byte ranges of the three objects plus a computed trailer.
    let whole = get(&app, &format!("/v1/exports/{id}/file"), None).await;
    assert_eq!(whole.status(), 200);
    let whole = whole.bytes().await.unwrap();
    assert_eq!(sha256(&whole), manifest["file"]["sha256"]);
    assert_eq!(csv_rows(&whole).len(), 231, "one header and every row");

    // Ranges inside one object, across object boundaries, suffixes, and past the end.
    let len = whole.len();
    let shard0 = manifest["shards"][0]["bytes"].as_u64().unwrap() as usize;
    for (range, from, to) in [
        ("bytes=0-99".to_owned(), 0, 99),
        (format!("bytes={}-{}", shard0 - 50, shard0 + 50), shard0 - 50, shard0 + 50),
        ("bytes=-40".to_owned(), len - 40, len - 1),
        (format!("bytes=100-{}", len + 1000), 100, len - 1),
    ] {
        let response = get(&app, &format!("/v1/exports/{id}/file"), Some(&range)).await;
        assert_eq!(response.status(), 206, "{range}");
        assert_eq!(response.headers()["content-range"], format!("bytes {from}-{to}/{len}").as_str());
        assert_eq!(&response.bytes().await.unwrap()[..], &whole[from..=to], "{range}");
    }
    let beyond = get(&app, &format!("/v1/exports/{id}/file"), Some(&format!("bytes={len}-"))).await;
    assert_eq!(beyond.status(), 416);
    assert_eq!(beyond.headers()["content-range"], format!("bytes */{len}").as_str());
    let head = app
        .client
        .head(app.url(&format!("/v1/exports/{id}/file")))
        .bearer_auth(app.token("acme", "alice"))
        .send()
        .await
        .unwrap();
    assert_eq!(head.headers()["content-length"], len.to_string().as_str());
}

/// A worker claims the job, writes `shards` shards, then its process dies (the run is dropped
/// with its lease still held).
/// A job created by an older binary recorded `miniz_oxide/3`: this binary finishes it with that
/// codec, and a checkpointed shard it must rewrite comes out with its recorded bytes.
#[sqlx::test(migrations = "./migrations")]
async fn an_export_keeps_the_codec_it_was_created_with(pool: PgPool) {
    let app = TestApp::spawn_on(pool, Backend::Local).await;
    app.seed("acme", "tickets", 130).await;
    let token = app.token("acme", "alice");
    let older = app.export(&token, &full_csv(50)).await;
    let codec = |id: String| {
        sqlx::query_scalar::<_, String>("SELECT codec FROM export_jobs WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&app.pool)
    };
    assert_eq!(codec(older.clone()).await.unwrap(), exportd::writers::Format::Csv.spec().codec.name());
    sqlx::query("UPDATE export_jobs SET codec = 'miniz_oxide/3' WHERE id = $1::uuid")
        .bind(&older)
        .execute(&app.pool)
        .await
        .unwrap();
    crash_after(&app, 2).await;
    let original = app.own_shard_files(&older).await;
    put_object(&app.store, &format!("acme/{older}/s0-a1/shard-00000.csv.gz"), original[0][..100].to_vec()).await;
    expire_lease(&app.pool, &older).await;
    let mut resumed = ClaimedExport::claim(&app.deps(), "rescuer").await.unwrap().unwrap();
    assert_eq!(resumed.step().await.unwrap(), Step::ShardRewritten { index: 0 });
    assert_eq!(resumed.step().await.unwrap(), Step::ShardVerified { index: 1 });
    assert_eq!(resumed.step().await.unwrap(), Step::ShardWritten { index: 2, rows: 30, last: true });
    assert_eq!(resumed.step().await.unwrap(), Step::Published);
    let older_files = app.own_shard_files(&older).await;
    assert_eq!(older_files[..2], original[..], "the rewritten shard has its checkpointed bytes");

    // The same rows exported now: the same CSV, other gzip bytes.
    let current = app.export(&token, &full_csv(50)).await;
    assert_eq!(app.drain().await, vec![Step::Published]);
    let current_files = app.own_shard_files(&current).await;
    assert_eq!(current_files.len(), older_files.len());
    for (older, current) in older_files.iter().zip(&current_files) {
        assert_ne!(older, current, "the codecs differ");
        assert_eq!(crate::common::gunzip(older), crate::common::gunzip(current));
    }
}

async fn crash_after(app: &TestApp, shards: usize) {
    let mut doomed = ClaimedExport::claim(&app.deps(), "doomed").await.unwrap().unwrap();
    for index in 0..shards {
        assert!(matches!(doomed.step().await.unwrap(), Step::ShardWritten { index: i, .. } if i as usize == index));
    }
}

async fn manifest_of(app: &TestApp, id: &str) -> String {
    let bytes: Vec<u8> = sqlx::query_scalar("SELECT manifest FROM export_jobs WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

async fn a_crashed_export_resumes_to_the_same_bytes_without_rewriting_verified_shards(app: TestApp) {
    app.seed("acme", "tickets", 230).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(50)).await;
    crash_after(&app, 2).await;
    let deps = app.deps();
    assert!(ClaimedExport::claim(&deps, "too-early").await.unwrap().is_none(), "the lease still holds");
    expire_lease(&app.pool, &id).await;
    let mut resumed = ClaimedExport::claim(&deps, "rescuer").await.unwrap().unwrap();
    assert_eq!(resumed.lease().generation, 2);
    let mut steps = Vec::new();
    loop {
        let step = resumed.step().await.unwrap();
        let done = step.is_final();
        steps.push(step);
        if done {
            break;
        }
    }
    assert_eq!(
        steps,
        vec![
            Step::ShardVerified { index: 0 },
            Step::ShardVerified { index: 1 },
            Step::ShardWritten { index: 2, rows: 50, last: false },
            Step::ShardWritten { index: 3, rows: 50, last: false },
            Step::ShardWritten { index: 4, rows: 30, last: true },
            Step::Published,
        ]
    );
    for verified in ["s0-a1", "s1-a1"] {
        let first_attempt = ObjectKey::parse(&format!("acme/{id}/{verified}")).unwrap();
        assert_eq!(app.store.list(Some(&first_attempt)).await.unwrap().len(), 1, "verified shards are kept");
    }
    let resumed_manifest = manifest_of(&app, &id).await;
    let resumed_files = app.own_shard_files(&id).await;

    // The same job, run again without interruption into a second, empty store of the same kind.
    // Rewinding a published job is no transition of the state machine: done with triggers off.
    let mut rewind = app.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *rewind).await.unwrap();
    sqlx::query("UPDATE export_jobs SET state = 'QUEUED', manifest = NULL, manifest_sha256 = NULL, lease_expires_at = NULL,
                 shards_done = 0, rows_done = 0, bytes_done = 0, planned_shards = 0, plan_complete = false WHERE id = $1::uuid").bind(&id).execute(&mut *rewind).await.unwrap();
    rewind.commit().await.unwrap();
    sqlx::query("DELETE FROM export_shards WHERE export_id = $1::uuid").bind(&id).execute(&app.pool).await.unwrap();
    let second_dir = tempfile::tempdir().unwrap();
    let backend = if app.store.describe().starts_with("s3://") { Backend::S3 } else { Backend::Local };
    let second_store = crate::common::fresh_store(backend, &app.pool, second_dir.path()).await;
    let clean = app.deps_with(app.registry.clone(), second_store.clone());
    assert_eq!(exportd::jobs::drain(&clean, "clean").await.unwrap(), vec![Step::Published]);
    assert_eq!(resumed_manifest, manifest_of(&app, &id).await);
    assert_eq!(resumed_files, app.shard_files(&id, &second_store).await);
}

async fn truncated_or_extended_shard_files_are_rewritten_on_rerun(app: TestApp) {
    app.seed("acme", "tickets", 130).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(50)).await;
    crash_after(&app, 2).await;
    let original = app.own_shard_files(&id).await;
    put_object(
        &app.store,
        &format!("acme/{id}/s0-a1/shard-00000.csv.gz"),
        original[0][..original[0].len() / 2].to_vec(),
    )
    .await;
    let mut extended = original[1].clone();
    extended.extend_from_slice(b"garbage");
    put_object(&app.store, &format!("acme/{id}/s1-a1/shard-00001.csv.gz"), extended).await;

    expire_lease(&app.pool, &id).await;
    let mut resumed = ClaimedExport::claim(&app.deps(), "rescuer").await.unwrap().unwrap();
    assert_eq!(resumed.step().await.unwrap(), Step::ShardRewritten { index: 0 });
    assert_eq!(resumed.step().await.unwrap(), Step::ShardRewritten { index: 1 });
    assert_eq!(resumed.step().await.unwrap(), Step::ShardWritten { index: 2, rows: 30, last: true });
    assert_eq!(resumed.step().await.unwrap(), Step::Published);
    assert_eq!(app.own_shard_files(&id).await[..2], original[..]);
    // The corrupt files were of the first attempts: once the cleaner has run, the export's
    // directory holds exactly the files its checkpoints name.
    exportd::cleaner::run_once(&app.pool, &app.store, &app.registry, app.clock.now()).await.unwrap();
    for corrupt in ["s0-a1/shard-00000", "s1-a1/shard-00001"] {
        let key = ObjectKey::parse(&format!("acme/{id}/{corrupt}.csv.gz")).unwrap();
        assert_eq!(read_object(&app.store, &key).await, None, "{corrupt} was removed");
    }
    let mut named: Vec<String> =
        sqlx::query_scalar("SELECT object_key FROM export_shards WHERE export_id = $1::uuid ORDER BY object_key")
            .bind(&id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    named.sort();
    let prefix = ObjectKey::parse(&format!("acme/{id}")).unwrap();
    let mut stored: Vec<String> = app
        .store
        .list(Some(&prefix))
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key.as_str().to_owned())
        .filter(|key| key.ends_with(".csv.gz"))
        .collect();
    stored.sort();
    assert_eq!(stored, named);
}

async fn revoke_expiry_and_the_cleaner_delete_through_the_store(app: TestApp) {
    let (expiring, _) = published(&app, 230).await;
    let admin = app.token("acme", "alice");
    let live = app.export(&admin, &json!({"dataset": "tickets", "format": "jsonl", "shard_rows": 100})).await;
    app.drain().await;
    let live_files = app.own_shard_files(&live).await;
    let revoked = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 100})).await;
    app.drain().await;

    // Revoking deletes the export's files at once.
    let response = app.client.delete(app.url(&format!("/v1/exports/{revoked}"))).bearer_auth(&admin).send().await;
    assert_eq!(response.unwrap().status(), 200);
    let revoked_prefix = ObjectKey::parse(&format!("acme/{revoked}")).unwrap();
    assert_eq!(app.store.list(Some(&revoked_prefix)).await.unwrap(), vec![]);

    // Debris: a stale file of an older attempt of a live export; and a directory of an export
    // this deployment never created, which is not debris of its own.
    let unknown = format!("acme/{}/g1/shard-00000.csv.gz", uuid::Uuid::new_v4());
    put_object(&app.store, &unknown, vec![7u8; 4096]).await;
    let stale = format!("acme/{live}/g0/shard-00000.jsonl.gz");
    put_object(&app.store, &stale, vec![7u8; 1000]).await;

    let store = &app.store;
    let report = exportd::cleaner::run_once(&app.pool, store, &app.registry, app.clock.now()).await.unwrap();
    assert!(report.ran);
    assert_eq!(report.expired, 0);
    assert_eq!(report.bytes("unreferenced"), 1000);
    assert_eq!(read_object(store, &ObjectKey::parse(&stale).unwrap()).await, None, "{stale} remains");
    assert_eq!(report.unknown, (1, 1, 4096), "an unknown export is counted");
    assert!(read_object(store, &ObjectKey::parse(&unknown).unwrap()).await.is_some(), "and left alone");
    assert_eq!(report.missing, vec![]);
    assert_eq!(app.own_shard_files(&live).await, live_files, "a live export is untouched");
    assert_eq!(get(&app, &format!("/v1/exports/{expiring}/file"), None).await.status(), 200);

    // A published export's file deleted behind exportd's back: the cleaner reports it, and
    // downloads say what happened instead of failing with a 500.
    let live_keys: Vec<String> =
        sqlx::query_scalar("SELECT object_key FROM export_shards WHERE export_id = $1::uuid ORDER BY shard_index")
            .bind(&live)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    store.delete(&ObjectKey::parse(&live_keys[0]).unwrap()).await.unwrap();
    let report = exportd::cleaner::run_once(&app.pool, store, &app.registry, app.clock.now()).await.unwrap();
    assert_eq!(report.missing, vec![("acme".to_owned(), live.parse().unwrap(), 1)]);
    for path in [format!("/v1/exports/{live}/file"), format!("/v1/exports/{live}/shards/0")] {
        let response = get(&app, &path, None).await;
        assert_eq!(response.status(), 410, "{path}");
        assert_eq!(problem(response).await["code"], "files-missing", "{path}");
    }
    store.delete(&ObjectKey::parse(&unknown).unwrap()).await.unwrap();

    // acme keeps artifacts 72 hours (fixture default): move the clock past that.
    app.clock.advance(std::time::Duration::from_secs(73 * 3600));
    let report = exportd::cleaner::run_once(&app.pool, store, &app.registry, app.clock.now()).await.unwrap();
    assert_eq!(report.expired, 2);
    assert!(report.bytes("expired") > 0);
    assert_eq!(app.state(&expiring).await, "EXPIRED");
    let left: Vec<_> = app.store.list(None).await.unwrap().into_iter().map(|o| o.key.as_str().to_owned()).collect();
    assert_eq!(left, vec![exportd::storage::ownership::MARKER], "nothing but the owner marker is left");
    assert_eq!(get(&app, &format!("/v1/exports/{expiring}/file"), None).await.status(), 410);
    let reclaimed: i64 = sqlx::query_scalar("SELECT sum(bytes)::bigint FROM storage_reclaims WHERE reason = 'expired'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(reclaimed as u64, report.bytes("expired"));

    // Two cleaners at once: while one holds the cleaner's lock (`cleaner::CLEANER_LOCK`, held
    // here by hand), the other steps aside; once it is free, the next one runs.
    let mut running = app.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(x'6578706f7274636c'::bigint)").execute(&mut *running).await.unwrap();
    let aside = exportd::cleaner::run_once(&app.pool, store, &app.registry, app.clock.now()).await.unwrap();
    assert!(!aside.ran, "a second cleaner steps aside");
    sqlx::query("SELECT pg_advisory_unlock(x'6578706f7274636c'::bigint)").execute(&mut *running).await.unwrap();
    let next = exportd::cleaner::run_once(&app.pool, store, &app.registry, app.clock.now()).await.unwrap();
    assert!(next.ran, "the lock is free again");
}

/// A writer that dies mid-upload (no abort, no completion) leaves a multipart upload: nothing
/// is visible, and the cleaner aborts it once it has been idle for an hour.
#[sqlx::test(migrations = "./migrations")]
async fn abandoned_multipart_uploads_are_invisible_and_aborted_by_the_cleaner(pool: PgPool) {
    let app = TestApp::spawn_on(pool, Backend::S3).await;
    let key = ObjectKey::parse("acme/0190c0de-0000-7000-8000-000000000000/g1/shard-00000.csv.gz").unwrap();
    let store = app.store.clone();
    let writer_key = key.clone();
    tokio::task::spawn_blocking(move || {
        let mut writer = store.writer(&writer_key).unwrap();
        // Over one part (8 MiB), so a multipart upload is started and a part sent.
        std::io::Write::write_all(&mut writer, &vec![1u8; 9 * 1024 * 1024]).unwrap();
        std::mem::forget(writer); // the process died: no completion, no abort
    })
    .await
    .unwrap();
    assert_eq!(app.store.digest(&key).await.unwrap(), None, "an unfinished upload is not an object");
    // The part still uploading in the background marks the upload as touched when it lands.
    let touched = "SELECT count(*) FROM pending_uploads WHERE touched_at > started_at";
    for _ in 0..200 {
        if sqlx::query_scalar::<_, i64>(touched).fetch_one(&app.pool).await.unwrap() == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(sqlx::query_scalar::<_, i64>(touched).fetch_one(&app.pool).await.unwrap(), 1, "the part was sent");

    let report = exportd::cleaner::run_once(&app.pool, &app.store, &app.registry, app.clock.now()).await.unwrap();
    assert!(report.reclaimed.iter().all(|r| r.0 != "stale-temp"), "a fresh upload is left alone");
    sqlx::query("UPDATE pending_uploads SET touched_at = now() - interval '2 hours'").execute(&app.pool).await.unwrap();
    let report = exportd::cleaner::run_once(&app.pool, &app.store, &app.registry, app.clock.now()).await.unwrap();
    assert!(report.reclaimed.iter().any(|r| r.0 == "stale-temp" && r.1 == 1), "{report:?}");
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pending_uploads").fetch_one(&app.pool).await.unwrap();
    assert_eq!(pending, 0);
    assert_eq!(app.store.digest(&key).await.unwrap(), None);
}

/// An app whose S3 store is reached through an [`OutageProxy`], for outages on demand.
async fn behind_proxy(pool: PgPool) -> (TestApp, OutageProxy) {
    let endpoint = std::env::var("EXPORTD_TEST_S3_ENDPOINT").expect("EXPORTD_TEST_S3_ENDPOINT (run scripts/test)");
    let target = endpoint.trim_start_matches("http://").trim_end_matches('/').parse().expect("host:port endpoint");
    let proxy = OutageProxy::start(target).await;
    let via_proxy = format!("http://{}", proxy.addr);
    let app = TestApp::spawn_at(pool, |_| {
        let mut config = crate::common::s3_config(&format!("test-{}", uuid::Uuid::new_v4().simple()));
        config.endpoint = Some(via_proxy);
        StorageLocation::Bucket(config)
    })
    .await;
    (app, proxy)
}

/// The store goes away in the middle of an export: the worker retries, gives the job back
/// without counting an attempt against it, and downloads answer 503 with Retry-After. When the
/// store is back, the export finishes with the same bytes, and nothing was lost.
#[sqlx::test(migrations = "./migrations")]
async fn a_store_outage_mid_export_delays_it_and_loses_nothing(pool: PgPool) {
    let (app, proxy) = behind_proxy(pool).await;
    let (before, manifest) = published(&app, 230).await;
    let admin = app.token("acme", "alice");
    let during = app.export(&admin, &json!({"dataset": "tickets", "format": "csv", "shard_rows": 100})).await;
    let mut deps = app.deps();
    deps.config = WorkerConfig { lease_ttl: std::time::Duration::from_secs(3), ..deps.config };
    let mut run = ClaimedExport::claim(&deps, "w").await.unwrap().unwrap();
    assert!(matches!(run.step().await.unwrap(), Step::ShardWritten { index: 0, .. }));

    proxy.cut();
    let error = run.step_with_retries().await.expect_err("the store is down");
    assert!(exportd::db::is_transient_chain(&error), "{error:#}");
    run.give_back(true).await.unwrap();
    let response = get(&app, &format!("/v1/exports/{before}/file"), None).await;
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(problem(response).await["code"], "temporarily-unavailable");
    assert_eq!(app.state(&during).await, "RUNNING", "an outage does not fail the export");

    // Several more runs during the outage do not exhaust the job's attempts.
    for _ in 0..6 {
        let mut run = ClaimedExport::claim(&deps, "w").await.unwrap().unwrap();
        let error = run.step_with_retries().await.expect_err("still down");
        assert!(exportd::db::is_transient_chain(&error));
        run.give_back(true).await.unwrap();
    }

    proxy.heal();
    assert_eq!(exportd::jobs::drain(&deps, "w").await.unwrap(), vec![Step::Published]);
    let after: Value = app.get(Some(&admin), &format!("/v1/exports/{during}/manifest")).await.json().await.unwrap();
    assert_eq!(after["file"]["sha256"], manifest["file"]["sha256"], "the same rows, the same bytes");
    let whole = get(&app, &format!("/v1/exports/{during}/file"), None).await.bytes().await.unwrap();
    assert_eq!(sha256(&whole), manifest["file"]["sha256"]);
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pending_uploads").fetch_one(&app.pool).await.unwrap();
    assert_eq!(pending, 0, "no upload is left behind");
}

/// A second deployment (its own database) pointed at the first one's store: it cannot claim the
/// store, its cleaner deletes nothing, a process of it refuses to start and says what to do, and
/// the first deployment's exports still download.
async fn a_second_deployment_is_refused_and_deletes_nothing(app: TestApp) {
    let (id, manifest) = published(&app, 230).await;
    let before = app.store.list(None).await.unwrap();
    let other = crate::common::SecondDatabase::create(&app.pool).await;
    let them = exportd::storage::Deployment::of(&other.pool).await.unwrap();
    let error = app.store.claim(&them).await.expect_err("the store is the first deployment's").to_string();
    assert!(error.contains("belongs to another exportd deployment"), "{error}");
    assert!(error.contains("EXPORTD_DATA_DIR") && error.contains("EXPORTD_STORAGE"), "says what to do: {error}");

    let registry = crate::common::prepare_db(&other.pool).await;
    let cleaned = exportd::cleaner::run_once(&other.pool, &app.store, &registry, app.clock.now()).await;
    assert!(cleaned.is_err(), "the other deployment's cleaner does not run on this store");
    assert_eq!(app.store.list(None).await.unwrap(), before, "nothing was deleted");
    let whole = get(&app, &format!("/v1/exports/{id}/file"), None).await.bytes().await.unwrap();
    assert_eq!(sha256(&whole), manifest["file"]["sha256"]);

    // A process of the other deployment stops at start-up with the same message.
    let log = app.data_dir.path().join("other.log");
    let mut worker = crate::common::processes::worker_command(&other.url, app.data_dir.path(), &log, 1, "5s");
    worker.arg("--exit-when-idle");
    let described = app.store.describe();
    if !described.starts_with("file://") {
        let var = |name: &str| std::env::var(name).unwrap();
        worker
            .env("EXPORTD_STORAGE", described.split(" at ").next().unwrap())
            .env("EXPORTD_S3_ENDPOINT", var("EXPORTD_TEST_S3_ENDPOINT"))
            .env("AWS_ACCESS_KEY_ID", var("EXPORTD_TEST_S3_ACCESS_KEY_ID"))
            .env("AWS_SECRET_ACCESS_KEY", var("EXPORTD_TEST_S3_SECRET_ACCESS_KEY"));
    }
    let status = worker.status().unwrap();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{log}");
    assert!(log.contains("belongs to another exportd deployment"), "{log}");
    assert_eq!(app.store.list(None).await.unwrap(), before, "nothing was deleted");
    other.drop().await;
}

/// The store hangs (connections accepted, nothing answered) for longer than the response
/// deadline: downloads answer 503 problem+json with Retry-After well before it, `/healthz` says
/// the store is unreachable, and both recover when the store is back.
#[sqlx::test(migrations = "./migrations")]
async fn a_hanging_store_is_answered_with_503_and_shown_by_healthz(pool: PgPool) {
    let (app, proxy) = behind_proxy(pool).await;
    let (id, manifest) = published(&app, 230).await;
    let health = || async { app.get(None, "/healthz").await.json::<Value>().await.unwrap() };
    assert_eq!(health().await["store"], "ok");

    proxy.freeze();
    let asked = std::time::Instant::now();
    let response = get(&app, &format!("/v1/exports/{id}/file"), None).await;
    let waited = asked.elapsed();
    assert_eq!(response.status(), 503);
    assert!(waited < std::time::Duration::from_secs(20), "answered after {waited:?}, before the 30 s deadline");
    assert!(response.headers().contains_key("retry-after"));
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    assert_eq!(problem(response).await["code"], "temporarily-unavailable");
    let unhealthy = health().await;
    assert_eq!((&unhealthy["status"], &unhealthy["store"]), (&json!("degraded"), &json!("unreachable")), "{unhealthy}");

    proxy.heal();
    let healed = std::time::Instant::now();
    while health().await["store"] != "ok" {
        assert!(healed.elapsed() < std::time::Duration::from_secs(30), "healthz never saw the store again");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let whole = get(&app, &format!("/v1/exports/{id}/file"), None).await.bytes().await.unwrap();
    assert_eq!(sha256(&whole), manifest["file"]["sha256"]);
}

/// Credentials the store refuses stop start-up with what to check; no credentials for an
/// S3-compatible endpoint say what to set (instead of asking the cloud's instance metadata).
#[sqlx::test(migrations = "./migrations")]
async fn a_store_that_refuses_the_credentials_stops_start_up_saying_what_to_check(pool: PgPool) {
    use exportd::storage::ArtifactStore;
    let mut wrong = crate::common::s3_config("refused");
    let exportd::storage::Credentials::S3 { secret_access_key, .. } = &mut wrong.credentials else { unreachable!() };
    *secret_access_key = "not-the-secret".to_owned().into();
    let Err(error) = ArtifactStore::connect(&StorageLocation::Bucket(wrong), &pool).await else { panic!("refused") };
    let message = format!("{error:#}");
    assert!(message.contains("denied access") && message.contains("AWS_SECRET_ACCESS_KEY"), "{message}");
    assert!(!message.contains("not-the-secret"), "the secret is never repeated: {message}");
    let none = exportd::storage::BucketConfig {
        credentials: exportd::storage::Credentials::Ambient,
        ..crate::common::s3_config("none")
    };
    let Err(error) = ArtifactStore::connect(&StorageLocation::Bucket(none), &pool).await else { panic!("refused") };
    let message = format!("{error:#}");
    assert!(message.contains("no credentials") && message.contains("AWS_ACCESS_KEY_ID"), "{message}");
    assert!(!message.contains("169.254"), "{message}");
}

/// A process pointed at an empty, unclaimed directory while its database has published exports
/// (the README's follow-up commands run with another EXPORTD_DATA_DIR than the tour's) says it
/// is probably pointed at the wrong directory; one pointed at the right store says nothing.
#[sqlx::test(migrations = "./migrations")]
async fn a_process_on_an_empty_store_of_a_database_with_exports_names_the_likely_mistake(pool: PgPool) {
    let app = TestApp::spawn_on(pool, Backend::Local).await;
    published(&app, 30).await;
    let url = crate::common::processes::database_url(&app.pool).await;
    let run = |dir: &std::path::Path, log: &std::path::Path| {
        let mut worker = crate::common::processes::worker_command(&url, dir, log, 1, "5s");
        assert!(worker.arg("--exit-when-idle").status().unwrap().success());
        std::fs::read_to_string(log).unwrap()
    };
    let (wrong, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let log = run(wrong.path(), &logs.path().join("wrong.log"));
    assert!(log.contains("probably pointed at the wrong directory"), "{log}");
    assert!(log.contains("1 published exports"), "{log}");
    let log = run(app.data_dir.path(), &logs.path().join("right.log"));
    assert!(!log.contains("wrong directory"), "{log}");
}
