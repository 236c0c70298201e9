//! The daily egress quota: a download is admitted only if today's bytes plus its own stay within
//! `egress_bytes_per_day`. The check and the record (the audit event carrying the bytes) share a
//! transaction that holds the tenant's usage row, so concurrent downloads cannot both slip in.

use std::time::Duration;

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::exports::audit::{AuditEvent, insert};
use crate::tenants::Tenant;

/// Records the download if it fits today's quota; otherwise how long until the day rolls over.
pub async fn admit_download(
    pool: &PgPool,
    tenant: &Tenant,
    event: AuditEvent<'_>,
    now: OffsetDateTime,
) -> sqlx::Result<Result<(), Duration>> {
    let midnight = now.replace_time(time::Time::MIDNIGHT);
    let mut tx = pool.begin().await?;
    crate::quota::lock_tenant(&mut tx, tenant.id.as_str()).await?;
    let today: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(bytes), 0)::bigint FROM audit_log WHERE tenant = $1 AND action = 'downloaded' AND at >= $2",
    )
    .bind(tenant.id.as_str())
    .bind(midnight)
    .fetch_one(&mut *tx)
    .await?;
    let wanted = event.bytes.unwrap_or(0);
    if today as u64 + wanted > tenant.quota.egress_bytes_per_day {
        let tomorrow = midnight + time::Duration::days(1);
        // Rounded up: retrying after this many seconds lands in the next day.
        return Ok(Err(Duration::from_secs((tomorrow - now).whole_seconds().max(0) as u64 + 1)));
    }
    insert(&mut *tx, &event).await?;
    tx.commit().await?;
    Ok(Ok(()))
}
