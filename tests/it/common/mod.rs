//! Shared test harness: the real app on a real port, over a fresh database per test.

pub mod processes;
pub mod proxy;
pub mod receiver;
pub mod replication;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use std::path::Path;

use exportd::clock::Clock;
use exportd::http::{self, AppState};
use exportd::jobs::{Step, WorkerConfig, WorkerDeps};
use exportd::links::LinkKeys;
use exportd::quota::ScanLimits;
use exportd::storage::{ArtifactStore, BucketConfig, BucketUrl, Credentials, ObjectKey, Provider, StorageLocation};
use exportd::tenants::{Registry, Tenant};
use serde_json::Value;
use sqlx::PgPool;

pub fn fixture_tenants_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tenants")
}

pub fn fixture_registry() -> Arc<Registry> {
    Arc::new(Registry::load(&fixture_tenants_dir()).expect("fixture tenants load"))
}

/// Records the fixture schemas' versions and copies the fixture catalogue into the test
/// database, as `serve` does at start-up.
pub async fn prepare_db(pool: &PgPool) -> Arc<Registry> {
    prepare_db_from(pool, &fixture_tenants_dir()).await.expect("fixture tenants start up")
}

/// [`prepare_db`] with the tenant files of `dir`: an error is what start-up would refuse.
pub async fn prepare_db_from(pool: &PgPool, dir: &Path) -> anyhow::Result<Arc<Registry>> {
    let mut registry = Registry::load(dir)?;
    let versions = exportd::tenants::register(pool, &registry, dir).await?;
    exportd::tenants::sync_catalogue(pool, &registry).await?;
    registry.set_schema_versions(versions);
    Ok(Arc::new(registry))
}

/// Which backend a test's artifact store uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Local,
    S3,
}

/// The test S3 store (SeaweedFS, started by scripts/test), under a prefix of its own so tests
/// never see each other's objects.
pub fn s3_config(prefix: &str) -> BucketConfig {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!("{name} is not set: run the tests with scripts/test, which starts SeaweedFS and sets it")
        })
    };
    BucketConfig {
        url: BucketUrl { provider: Provider::S3, bucket: var("EXPORTD_TEST_S3_BUCKET"), prefix: prefix.to_owned() },
        endpoint: Some(var("EXPORTD_TEST_S3_ENDPOINT")),
        region: None,
        credentials: Credentials::S3 {
            access_key_id: var("EXPORTD_TEST_S3_ACCESS_KEY_ID"),
            secret_access_key: var("EXPORTD_TEST_S3_SECRET_ACCESS_KEY").into(),
        },
    }
}

/// A fresh store location of `backend`: under `data_dir`, or under a new prefix in the bucket.
pub fn fresh_location(backend: Backend, data_dir: &Path) -> StorageLocation {
    match backend {
        Backend::Local => StorageLocation::Local(data_dir.to_owned()),
        Backend::S3 => StorageLocation::Bucket(s3_config(&format!("test-{}", uuid::Uuid::new_v4().simple()))),
    }
}

pub async fn fresh_store(backend: Backend, pool: &PgPool, data_dir: &Path) -> ArtifactStore {
    ArtifactStore::connect(&fresh_location(backend, data_dir), pool).await.expect("artifact store")
}

/// A second database on the test server, migrated: another deployment. Dropped by [`drop`].
pub struct SecondDatabase {
    pub pool: PgPool,
    pub url: String,
    name: String,
    admin: PgPool,
}

impl SecondDatabase {
    pub async fn create(admin: &PgPool) -> SecondDatabase {
        let name = format!("exportd_second_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(admin).await.unwrap();
        let url = processes::database_url(admin).await;
        let url = format!("{}/{name}", url.rsplit_once('/').unwrap().0);
        let pool = PgPool::connect(&url).await.unwrap();
        sqlx::migrate!("./migrations").run(&pool).await.unwrap();
        SecondDatabase { pool, url, name, admin: admin.clone() }
    }

    pub async fn drop(self) {
        self.pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {} WITH (FORCE)", self.name)))
            .execute(&self.admin)
            .await
            .unwrap();
    }
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub pool: PgPool,
    pub registry: Arc<Registry>,
    pub client: reqwest::Client,
    pub data_dir: tempfile::TempDir,
    /// Where this app's export files are (local under `data_dir`, or a prefix in the S3 bucket).
    pub store: ArtifactStore,
    /// The server's clock: tests move it instead of sleeping.
    pub clock: Clock,
}

/// The test server's link keys (the first signs).
pub const LINK_KEYS: &str =
    "t2=test-link-key-2-0123456789abcdef0123456789,t1=test-link-key-1-0123456789abcdef0123456789";

impl TestApp {
    pub async fn spawn(pool: PgPool) -> TestApp {
        TestApp::spawn_on(pool, Backend::Local).await
    }

    /// The app with its export files in a fresh store of `backend`.
    pub async fn spawn_on(pool: PgPool, backend: Backend) -> TestApp {
        TestApp::spawn_at(pool, |data_dir| fresh_location(backend, data_dir)).await
    }

    /// The app with its export files where `location` (given the app's data directory) says.
    pub async fn spawn_at(pool: PgPool, location: impl FnOnce(&Path) -> StorageLocation) -> TestApp {
        exportd::telemetry::prometheus();
        let registry = prepare_db(&pool).await;
        // A running deployment's ticker ticks at start: cursors taken from now on lie after a tick.
        exportd::feeds::tick(&pool, Duration::ZERO).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().unwrap();
        let data_dir = tempfile::tempdir().expect("temp dir");
        let store = ArtifactStore::connect(&location(data_dir.path()), &pool).await.expect("artifact store");
        // As a server does at start: the store is this deployment's from now on.
        let us = exportd::storage::Deployment::of(&pool).await.unwrap();
        store.claim(&us).await.expect("a fresh store is claimed");
        let clock = Clock::system();
        let links = Arc::new(LinkKeys::parse(LINK_KEYS).unwrap());
        let state = AppState {
            // The tests' operator opens the metrics on purpose, fresh at every scrape.
            metrics: http::MetricsPage::with_max_age(http::MetricsAccess::Open, Duration::ZERO),
            ..AppState::new(pool.clone(), registry.clone(), store.clone(), links, clock.clone())
        };
        let (keep_running, never) = tokio::sync::watch::channel(false);
        let (limits, housekeeping_pool) = (state.limits.clone(), state.pool.clone());
        tokio::spawn(async move {
            exportd::quota::run_housekeeping(limits, housekeeping_pool, never).await;
            drop(keep_running);
        });
        tokio::spawn(http::serve(
            listener,
            http::app(state),
            http::ConnectionLimits::default(),
            std::future::pending(),
            Duration::from_secs(1),
        ));
        TestApp { addr, pool, registry, client: reqwest::Client::new(), data_dir, store, clock }
    }

    /// Worker dependencies over this app's database and artifact store. Pages of 7 rows
    /// make every shard span several pages.
    pub fn deps(&self) -> WorkerDeps {
        self.deps_with(self.registry.clone(), self.store.clone())
    }

    pub fn deps_with(&self, registry: Arc<Registry>, store: ArtifactStore) -> WorkerDeps {
        WorkerDeps {
            pool: self.pool.clone(),
            store,
            keys: Arc::new(LinkKeys::parse(LINK_KEYS).unwrap()),
            scan: Arc::new(ScanLimits::new(&registry)),
            registry,
            config: WorkerConfig { page_rows: 7, ..WorkerConfig::default() },
            spools: Default::default(),
            replicas: Default::default(),
        }
    }

    /// Runs workers until no job is left; returns how each run ended.
    pub async fn drain(&self) -> Vec<Step> {
        exportd::jobs::drain(&self.deps(), "test-worker").await.expect("worker ran")
    }

    pub async fn create_export(&self, token: &str, key: Option<&str>, body: &Value) -> reqwest::Response {
        let mut request = self.client.post(self.url("/v1/exports")).bearer_auth(token).json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send().await.expect("request sent")
    }

    /// Creates an export through the API at `base` (a sibling serving other tenant files) that
    /// must be accepted; returns its id.
    pub async fn export_at(&self, base: &str, token: &str, body: &Value) -> String {
        let request = self.client.post(format!("{base}/v1/exports")).bearer_auth(token);
        let response = request.header("Idempotency-Key", uuid::Uuid::new_v4().to_string()).json(body).send().await;
        let response = response.expect("request sent");
        assert_eq!(response.status(), 202);
        response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned()
    }

    /// Creates an export that must be accepted; returns its id.
    pub async fn export(&self, token: &str, body: &Value) -> String {
        let response = self.create_export(token, Some(&uuid::Uuid::new_v4().to_string()), body).await;
        assert_eq!(response.status(), 202);
        response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned()
    }

    /// Records a feed tick now.
    pub async fn tick(&self) {
        exportd::feeds::tick(&self.pool, Duration::ZERO).await.unwrap().expect("ticked");
    }

    /// Moves the server clock past the tenant's safety delay (acme: 5 s by default).
    pub fn pass_safety_delay(&self) {
        self.clock.advance(Duration::from_secs(6));
    }

    /// Pulls pages from `cursor` until the end of the stream; returns the changes and the last cursor.
    pub async fn pull_all(&self, token: &str, dataset: &str, cursor: &str, limit: usize) -> (Vec<Value>, String) {
        let mut cursor = cursor.to_owned();
        let mut changes = Vec::new();
        loop {
            let page = self.pull(token, dataset, &cursor, limit).await;
            changes.extend(page["changes"].as_array().unwrap().iter().cloned());
            cursor = page["next_cursor"].as_str().unwrap().to_owned();
            if page["end_of_stream"] == true {
                return (changes, cursor);
            }
        }
    }

    pub async fn pull(&self, token: &str, dataset: &str, cursor: &str, limit: usize) -> Value {
        let path = format!("/v1/datasets/{dataset}/changes?limit={limit}&cursor={cursor}");
        let response = self.get(Some(token), &path).await;
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    }

    pub async fn cursor_now(&self, token: &str, dataset: &str) -> String {
        let body: Value = self.get(Some(token), &format!("/v1/datasets/{dataset}/cursor")).await.json().await.unwrap();
        body["cursor"].as_str().unwrap().to_owned()
    }

    pub async fn post(&self, token: &str, path: &str) -> reqwest::Response {
        self.client.post(self.url(path)).bearer_auth(token).send().await.expect("request sent")
    }

    /// Seeds `rows` synthetic records of `dataset` for `tenant`.
    pub async fn seed(&self, tenant: &str, dataset: &str, rows: u64) {
        let t = self.tenant(tenant);
        exportd::records::seed(&self.pool, &t.id, t.dataset(dataset).unwrap(), 0, rows, 1).await.unwrap();
    }

    /// The shard files of an export, in order, read from `store`.
    pub async fn shard_files(&self, export_id: &str, store: &ArtifactStore) -> Vec<Vec<u8>> {
        let keys: Vec<String> =
            sqlx::query_scalar("SELECT object_key FROM export_shards WHERE export_id = $1::uuid ORDER BY shard_index")
                .bind(export_id)
                .fetch_all(&self.pool)
                .await
                .unwrap();
        let mut files = Vec::new();
        for key in keys {
            files.push(read_object(store, &ObjectKey::parse(&key).unwrap()).await.expect("shard file"));
        }
        files
    }

    /// The shard files of an export in this app's store.
    pub async fn own_shard_files(&self, export_id: &str) -> Vec<Vec<u8>> {
        self.shard_files(export_id, &self.store).await
    }

    pub async fn state(&self, export_id: &str) -> String {
        sqlx::query_scalar("SELECT state FROM export_jobs WHERE id = $1::uuid")
            .bind(export_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Another server over the same database, files, link keys and clock, with other tenant
    /// configuration (e.g. a principal disabled since). Returns its base URL.
    pub async fn sibling(&self, registry: Arc<Registry>) -> String {
        self.sibling_with(registry, |_| {}).await
    }

    /// A sibling server whose state `edit` adjusts (e.g. a metrics token).
    pub async fn sibling_with(&self, registry: Arc<Registry>, edit: impl FnOnce(&mut AppState)) -> String {
        self.sibling_limited(registry, edit, http::ConnectionLimits::default()).await
    }

    /// A sibling server with other connection limits.
    pub async fn sibling_limited(
        &self,
        registry: Arc<Registry>,
        edit: impl FnOnce(&mut AppState),
        limits: http::ConnectionLimits,
    ) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().unwrap();
        let links = Arc::new(LinkKeys::parse(LINK_KEYS).unwrap());
        let mut state = AppState::new(self.pool.clone(), registry, self.store.clone(), links, self.clock.clone());
        edit(&mut state);
        tokio::spawn(http::serve(listener, http::app(state), limits, std::future::pending(), Duration::from_secs(1)));
        format!("http://{addr}")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn tenant(&self, id: &str) -> &Tenant {
        self.registry.get(id).expect("fixture tenant")
    }

    /// A valid one-hour token (signed directly: `mint` refuses disabled principals, which tests
    /// need tokens of).
    pub fn token(&self, tenant: &str, principal: &str) -> String {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        exportd::auth::mint_at(self.tenant(tenant), principal, now, now + 3600).unwrap()
    }

    pub async fn get(&self, token: Option<&str>, path: &str) -> reqwest::Response {
        let mut request = self.client.get(self.url(path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send().await.expect("request sent")
    }

    /// `POST /v1/exports/estimate`.
    pub async fn estimate(&self, token: &str, body: &Value) -> reqwest::Response {
        self.client.post(self.url("/v1/exports/estimate")).bearer_auth(token).json(body).send().await.unwrap()
    }

    /// An estimate that must be answered; its body.
    pub async fn estimated(&self, token: &str, body: &Value) -> Value {
        let response = self.estimate(token, body).await;
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    }

    pub async fn ingest(&self, token: &str, dataset: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(self.url(&format!("/v1/datasets/{dataset}/records")))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .expect("request sent")
    }
}

/// A full CSV export request of `tickets` in shards of `shard_rows`.
pub fn full_csv(shard_rows: u32) -> Value {
    serde_json::json!({"dataset": "tickets", "format": "csv", "shard_rows": shard_rows})
}

/// Ends the job's lease, and its shard writers' leases, now, as if its workers had stalled past them.
pub async fn expire_lease(pool: &PgPool, id: &str) {
    expire_lease_by(pool, id, "1 hour").await;
}

/// The job's lease (and its shards' writer leases) ran out `ago` (an SQL interval): long ago
/// with [`expire_lease`], past any wait before a claim after stalled attempts.
pub async fn expire_lease_by(pool: &PgPool, id: &str, ago: &str) {
    sqlx::query("UPDATE export_jobs SET lease_expires_at = now() - $2::interval WHERE id = $1::uuid")
        .bind(id)
        .bind(ago)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE export_shard_plan SET writer_expires_at = now() - $2::interval
         WHERE export_id = $1::uuid AND writer_expires_at IS NOT NULL",
    )
    .bind(id)
    .bind(ago)
    .execute(pool)
    .await
    .unwrap();
}

/// The body of a problem+json response, after checking its content type.
pub async fn problem(response: reqwest::Response) -> Value {
    let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
    assert_eq!(content_type, "application/problem+json");
    response.json().await.unwrap()
}

/// Waits until backend `pid` is blocked by another transaction's lock (read from
/// `pg_blocking_pids`, a real condition, not a guessed sleep).
pub async fn wait_until_blocked(pool: &PgPool, pid: i32) {
    for _ in 0..1000 {
        let blocked: bool =
            sqlx::query_scalar("SELECT cardinality(pg_blocking_pids($1)) > 0").bind(pid).fetch_one(pool).await.unwrap();
        if blocked {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("backend {pid} did not block on a lock within 5 s");
}

/// A host transaction that has written acme's tickets record `key` and holds it (every other
/// write of the key waits on it), with its backend's pid.
pub async fn hold_record(pool: &PgPool, key: &str) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut host = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *host).await.unwrap();
    sqlx::query("SELECT exportd_upsert('acme', 'tickets', $1, '{\"subject\": \"host\", \"status\": \"open\"}')")
        .bind(key)
        .execute(&mut *host)
        .await
        .unwrap();
    (host, pid)
}

/// Waits until `count` lock requests on table `relation` wait (`pg_locks`, not a guessed sleep).
pub async fn wait_for_lock_waiters(pool: &PgPool, relation: &str, count: i64) {
    for _ in 0..1000 {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND NOT granted")
                .bind(relation)
                .fetch_one(pool)
                .await
                .unwrap();
        if waiting >= count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{count} lock requests on {relation} did not wait within 5 s");
}

/// Waits until `count` backends wait on a lock that backend `holder` holds.
pub async fn wait_until_blocking(pool: &PgPool, holder: i32, count: i64) {
    for _ in 0..1000 {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
                .bind(holder)
                .fetch_one(pool)
                .await
                .unwrap();
        if waiting >= count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{count} backends did not block on backend {holder} within 5 s");
}

/// gunzip (all members).
/// The sha256 of `bytes` in hex, computed here (not with exportd's own helper) so that a check
/// against the server's digests is independent of the code that made them.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

pub fn gunzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes).read_to_end(&mut out).unwrap();
    out
}

/// The records of a CSV shard: header row and data rows, parsed with the `csv` crate.
pub fn csv_rows(shard: &[u8]) -> Vec<Vec<String>> {
    let text = gunzip(shard);
    let text = text.strip_prefix(b"\xEF\xBB\xBF").expect("CSV shards start with a BOM");
    csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(text)
        .records()
        .map(|r| r.unwrap().iter().map(str::to_owned).collect())
        .collect()
}

/// A copy of the fixture tenants with `edit` applied to one tenant file's text.
/// A one-hour token of `principal` of `tenant` as `registry` has them (a principal only edited
/// tenant files have).
pub fn token_in(registry: &Registry, tenant: &str, principal: &str) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    exportd::auth::mint_at(registry.get(tenant).unwrap(), principal, now, now + 3600).unwrap()
}

pub fn edited_registry(tenant: &str, edit: impl Fn(&str) -> String) -> Arc<Registry> {
    let dir = edited_tenants_dir(tenant, edit);
    Arc::new(Registry::load(dir.path()).unwrap())
}

/// The fixture tenants copied into a temporary directory, with `edit` applied to one tenant
/// file's text (for a real process's EXPORTD_TENANTS_DIR).
pub fn edited_tenants_dir(tenant: &str, edit: impl Fn(&str) -> String) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("datasets")).unwrap();
    for entry in std::fs::read_dir(fixture_tenants_dir().join("datasets")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join("datasets").join(entry.file_name())).unwrap();
    }
    for entry in std::fs::read_dir(fixture_tenants_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            let text = std::fs::read_to_string(&path).unwrap();
            let name = path.file_name().unwrap();
            let text = if name == format!("{tenant}.toml").as_str() { edit(&text) } else { text };
            std::fs::write(dir.path().join(name), text).unwrap();
        }
    }
    dir
}

/// Every byte of an object, or `None` when it does not exist.
pub async fn read_object(store: &ArtifactStore, key: &ObjectKey) -> Option<Vec<u8>> {
    use futures_util::TryStreamExt;
    let (len, _) = store.digest(key).await.expect("store answers")?;
    let chunks: Vec<_> = store.read(key, 0, len).await.expect("readable").try_collect().await.expect("read");
    Some(chunks.concat())
}

/// Stores `bytes` as the object `key` (debris, corruption) through the store's own writer.
pub async fn put_object(store: &ArtifactStore, key: &str, bytes: Vec<u8>) {
    let (store, key) = (store.clone(), ObjectKey::parse(key).unwrap());
    tokio::task::spawn_blocking(move || {
        let mut writer = store.writer(&key).unwrap();
        std::io::Write::write_all(&mut writer, &bytes).unwrap();
        writer.finish().unwrap();
    })
    .await
    .unwrap();
}
