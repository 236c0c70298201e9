//! A tenant's usage next to its limits, read from the durable records (`GET /v1/usage`).

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::exports::store::facts;
use crate::quota::refusals::{self, RefusalKind, Refusals};
use crate::tenants::{Quota, Tenant};

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Usage {
    pub tenant: String,
    #[schema(value_type = Object)]
    pub limits: Quota,
    pub usage: Counters,
    pub queue: Queue,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Counters {
    pub running_exports: i64,
    pub queued_exports: i64,
    /// Bytes of export files currently stored (published exports and shards being written).
    pub stored_bytes: i64,
    /// Bytes sent by downloads since midnight UTC.
    pub egress_bytes_today: i64,
    /// Rows of exports that succeeded since midnight UTC.
    pub rows_exported_today: i64,
    /// Requests refused by the API rate, since the tenant's first request.
    pub rate_limited_requests: i64,
    /// Refusals of every other kind (concurrency, downloads, egress, queued, storage), since the
    /// tenant's first request.
    pub quota_rejections: i64,
    /// Refusals since midnight UTC, per kind: rate, concurrency, downloads, egress, queued, storage.
    pub refusals_today: BTreeMap<String, i64>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Queue {
    pub oldest_queued_age_seconds: Option<i64>,
    pub oldest_running_age_seconds: Option<i64>,
    /// Exports per state.
    pub states: BTreeMap<String, i64>,
}

/// The tenant's usage; refusals include those `unflushed` still holds in this process.
pub async fn usage(pool: &PgPool, tenant: &Tenant, unflushed: &Refusals, now: OffsetDateTime) -> sqlx::Result<Usage> {
    let _steady = unflushed.steady().await;
    let id = tenant.id.as_str();
    let midnight = now.replace_time(time::Time::MIDNIGHT);
    let states = facts::states(pool, id).await?;
    let (oldest_queued, oldest_running) = facts::oldest_waiting(pool, id).await?;
    let stored_bytes = facts::stored_bytes(pool, id).await?;
    let egress = crate::quota::egress_today(pool, id, now).await?;
    let rows_today = facts::rows_published_since(pool, id, midnight).await?;
    let counted = sqlx::query!(
        r#"SELECT coalesce(max(rate_limited), 0) AS "rate_limited!", coalesce(max(quota_rejections), 0) AS "rejections!"
           FROM tenant_usage WHERE tenant = $1"#,
        id,
    )
    .fetch_one(pool)
    .await?;
    let mut refusals_today = BTreeMap::new();
    let (mut rate_limited, mut quota_rejections) = (counted.rate_limited, counted.rejections);
    for (kind, durable) in refusals::of_day(pool, &tenant.id, now.date()).await? {
        let pending = unflushed.unflushed(&tenant.id, kind) as i64;
        refusals_today.insert(kind.as_str().to_owned(), durable + pending);
        if kind == RefusalKind::Rate { rate_limited += pending } else { quota_rejections += pending }
    }
    let age = |at: Option<OffsetDateTime>| at.map(|at| (now - at).whole_seconds().max(0));
    Ok(Usage {
        tenant: id.to_owned(),
        limits: tenant.quota.clone(),
        usage: Counters {
            running_exports: states.get("RUNNING").copied().unwrap_or(0),
            queued_exports: states.get("QUEUED").copied().unwrap_or(0),
            stored_bytes,
            egress_bytes_today: egress,
            rows_exported_today: rows_today,
            rate_limited_requests: rate_limited,
            quota_rejections,
            refusals_today,
        },
        queue: Queue {
            oldest_queued_age_seconds: age(oldest_queued),
            oldest_running_age_seconds: age(oldest_running),
            states,
        },
    })
}
