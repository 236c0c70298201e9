//! An export's fencing against PostgreSQL, one write at a time: after another worker took the
//! job (and a shard) over, every write the stale holder can make — heartbeats, planning, taking
//! shards, checkpoints, giving back, failing, publishing — is refused and changes nothing, while
//! the same writes under the newer lease go through. The whole-run tests (`exports::`,
//! `parallel::`) stop a stale worker at its first refusal; this one tries each fence on its own.

use std::time::Duration;

use exportd::exports::store::lease::{self, Fence, LeaseLost, Publication, Refused, StallBackoff};
use exportd::exports::store::plan::{self, NewShard, Planner, ShardLease};
use exportd::exports::{ExportState, ShardRecord};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{TestApp, expire_lease, full_csv};

const TTL: Duration = Duration::from_secs(60);
const BACKOFF: StallBackoff = StallBackoff { first: Duration::ZERO, most: Duration::ZERO };

async fn claim(pool: &PgPool, worker: &str) -> lease::Lease {
    let limits = [("acme".to_owned(), 4)];
    let claimed = lease::claim(pool, worker, TTL, BACKOFF, &limits, &[]).await.unwrap().expect("a job to claim");
    lease::Lease { job_id: claimed.job.id, generation: claimed.job.lease_generation }
}

async fn take(pool: &PgPool, holder: lease::Lease, index: i32, worker: &str) -> ShardLease {
    let shard = plan::take(pool, holder, Some(index), worker, TTL).await.unwrap().expect("the shard to take");
    shard.lease(holder.job_id)
}

fn planned(index: i32) -> NewShard<'static> {
    NewShard { index, after_key: None, last_key: None, rows: Some(50) }
}

fn written(index: i32) -> ShardRecord {
    ShardRecord {
        shard_index: index,
        first_key: Some(format!("k{index}a")),
        last_key: Some(format!("k{index}z")),
        rows: 50,
        bytes: 1000,
        sha256: "0".repeat(64),
        object_key: format!("shard-{index}"),
        head_bytes: 10,
        head_crc32: 0,
        head_raw_bytes: 10,
        body_bytes: 990,
        body_crc32: 0,
        body_raw_bytes: 990,
        stats: None,
    }
}

/// What the job's row and plan say: (state, lease owner, yielded, interrupted, planned shards,
/// plan complete, shards done, checkpoints, shard writers by index).
type Seen = (String, Option<String>, bool, bool, i32, bool, i32, i64, Vec<Option<String>>);

async fn seen(pool: &PgPool, job: Uuid) -> Seen {
    let (state, owner, yielded, interrupted, planned_shards, complete, shards_done): (
        String,
        Option<String>,
        bool,
        bool,
        i32,
        bool,
        i32,
    ) = sqlx::query_as(
        "SELECT state, lease_owner, yielded, interrupted, planned_shards, plan_complete, shards_done
         FROM export_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    let checkpoints: i64 = sqlx::query_scalar("SELECT count(*) FROM export_shards WHERE export_id = $1")
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
    let writers: Vec<Option<String>> =
        sqlx::query_scalar("SELECT writer FROM export_shard_plan WHERE export_id = $1 ORDER BY shard_index")
            .bind(job)
            .fetch_all(pool)
            .await
            .unwrap();
    (state, owner, yielded, interrupted, planned_shards, complete, shards_done, checkpoints, writers)
}

#[sqlx::test(migrations = "./migrations")]
async fn a_stale_holder_is_refused_at_every_fence_and_the_newer_one_publishes_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let id = app.export(&app.token("acme", "alice"), &full_csv(50)).await;
    let pool = &app.pool;

    // "old" plans two shards and takes the first, then stalls past both leases.
    let old = claim(pool, "old").await;
    for index in [0, 1] {
        plan::extend(pool, Planner::Holder(old), None, Some(&planned(index)), false).await.unwrap().unwrap();
    }
    let old_shard = take(pool, old, 0, "old").await;
    expire_lease(pool, &id).await;

    // "new" takes the job over, and the first shard with it.
    let new = claim(pool, "new").await;
    assert_eq!(new.generation, old.generation + 1);
    let new_shard = take(pool, new, 0, "new").await;
    assert_eq!(new_shard.attempt, old_shard.attempt + 1);
    let before = seen(pool, old.job_id).await;
    assert_eq!(
        before,
        ("RUNNING".into(), Some("new".into()), false, false, 2, false, 0, 0, vec![Some("new".into()), None])
    );

    // Every write under the stale leases is refused…
    assert_eq!(lease::heartbeat(pool, old, TTL).await.unwrap(), Err(LeaseLost));
    assert_eq!(plan::heartbeat(pool, old_shard, TTL).await.unwrap(), Err(LeaseLost));
    let more = plan::extend(pool, Planner::Holder(old), None, Some(&planned(2)), true).await.unwrap();
    assert_eq!(more, Err(LeaseLost), "planning");
    assert_eq!(plan::drop_empty(pool, old, 1).await.unwrap(), Err(LeaseLost));
    assert!(plan::take(pool, old, Some(1), "old", TTL).await.unwrap().is_none(), "taking a named shard");
    assert!(plan::take(pool, old, None, "old", TTL).await.unwrap().is_none(), "taking a free shard");
    let checkpoint = lease::record_shard(pool, old_shard, "old", "acme", u64::MAX, &written(0)).await.unwrap();
    assert!(matches!(checkpoint, Err(Refused::LeaseLost)), "{checkpoint:?}");
    plan::release(pool, old_shard).await.unwrap();
    let failing = Some(("stale", "a stale worker's failure"));
    for fence in [Fence::Shard(old_shard), Fence::Job(old)] {
        let failed = lease::finish(pool, fence, ExportState::Running, ExportState::Failed, failing).await.unwrap();
        assert_eq!(failed, Err(LeaseLost), "{fence:?}");
    }
    lease::release(pool, old).await.unwrap();
    lease::give_back(pool, old, true).await.unwrap();
    // …and changed nothing.
    assert_eq!(seen(pool, old.job_id).await, before);

    // The same writes under the newer leases go through.
    assert_eq!(lease::heartbeat(pool, new, TTL).await.unwrap(), Ok(ExportState::Running));
    assert_eq!(plan::heartbeat(pool, new_shard, TTL).await.unwrap(), Ok(ExportState::Running));
    lease::record_shard(pool, new_shard, "new", "acme", u64::MAX, &written(0)).await.unwrap().unwrap();
    let second = take(pool, new, 1, "new").await;
    lease::record_shard(pool, second, "new", "acme", u64::MAX, &written(1)).await.unwrap().unwrap();
    plan::extend(pool, Planner::Holder(new), None, None, true).await.unwrap().unwrap();
    assert_eq!(
        seen(pool, old.job_id).await,
        ("RUNNING".into(), Some("new".into()), false, false, 2, true, 2, 2, vec![None, None])
    );

    // With every shard recorded, only the newer holder publishes.
    let manifest = br#"{"shards": 2}"#;
    let publication = Publication {
        manifest,
        manifest_sha256: &"1".repeat(64),
        shards: 2,
        rows: 100,
        bytes: 2000,
        file_bytes: None,
        file_sha256: None,
        artifact_hours: 24,
    };
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(lease::publish(&mut tx, old, &publication).await.unwrap(), Err(LeaseLost)));
    drop(tx);
    assert_eq!(seen(pool, old.job_id).await.0, "RUNNING");
    let mut tx = pool.begin().await.unwrap();
    let published = lease::publish(&mut tx, new, &publication).await.unwrap().unwrap();
    tx.commit().await.unwrap();
    assert_eq!((published.tenant.as_str(), published.dataset.as_str()), ("acme", "tickets"));
    assert_eq!(seen(pool, old.job_id).await.0, "SUCCEEDED");
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(lease::publish(&mut tx, new, &publication).await.unwrap(), Err(LeaseLost)), "published once");
}
