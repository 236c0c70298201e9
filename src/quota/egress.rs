//! The daily egress quota: a download is admitted only if today's bytes plus its own stay within
//! `egress_bytes_per_day`. Today's bytes are a counter on the tenant's usage row (reset when the
//! UTC day changes), checked and advanced by one conditional update in the transaction that
//! records the audit event, so concurrent downloads cannot both slip in and the cost does not
//! grow with the number of downloads.

use super::Rejection;
use std::time::Duration;

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::audit::{AuditEvent, insert};
use crate::tenants::Tenant;

/// Records the download if it fits today's quota; otherwise how long until the day rolls over.
pub async fn admit_download(
    pool: &PgPool,
    tenant: &Tenant,
    event: AuditEvent<'_>,
    now: OffsetDateTime,
) -> sqlx::Result<Result<(), Rejection>> {
    let mut tx = pool.begin().await?;
    if let Err(rejection) = admit(&mut tx, tenant, event.bytes.unwrap_or(0), now).await? {
        return Ok(Err(rejection));
    }
    insert(&mut *tx, &event).await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// Adds `bytes` to today's egress inside `tx` if they fit the quota (the tenant's usage row stays
/// locked until `tx` ends); otherwise how long until the day rolls over.
pub async fn admit(
    tx: &mut sqlx::PgConnection,
    tenant: &Tenant,
    bytes: u64,
    now: OffsetDateTime,
) -> sqlx::Result<Result<(), Rejection>> {
    let midnight = now.replace_time(time::Time::MIDNIGHT);
    crate::quota::lock_tenant(tx, tenant.id.as_str()).await?;
    let admitted = sqlx::query!(
        "UPDATE tenant_usage SET egress_day = $2,
             egress_bytes = CASE WHEN egress_day = $2 THEN egress_bytes ELSE 0 END + $3
         WHERE tenant = $1 AND CASE WHEN egress_day = $2 THEN egress_bytes ELSE 0 END + $3 <= $4",
        tenant.id.as_str(),
        now.date(),
        i64::try_from(bytes).unwrap_or(i64::MAX),
        i64::try_from(tenant.quota.egress_bytes_per_day).unwrap_or(i64::MAX),
    )
    .execute(&mut *tx)
    .await?;
    if admitted.rows_affected() == 0 {
        let tomorrow = midnight + time::Duration::days(1);
        // Rounded up: retrying after this many seconds lands in the next day.
        let retry_after = Duration::from_secs((tomorrow - now).whole_seconds().max(0) as u64 + 1);
        return Ok(Err(Rejection::Egress { retry_after }));
    }
    Ok(Ok(()))
}

/// Bytes downloaded today (UTC) by the tenant's principals.
pub async fn egress_today(pool: &PgPool, tenant: &str, now: OffsetDateTime) -> sqlx::Result<i64> {
    let bytes: Option<i64> = sqlx::query_scalar!(
        "SELECT egress_bytes FROM tenant_usage WHERE tenant = $1 AND egress_day = $2",
        tenant,
        now.date()
    )
    .fetch_optional(pool)
    .await?;
    Ok(bytes.unwrap_or(0))
}
