//! The daily egress quota: a download is admitted only if today's bytes plus its own stay within
//! `egress_bytes_per_day`. Today's bytes are a counter on the tenant's usage row (reset when the
//! UTC day changes), checked and advanced by one conditional update in the transaction that
//! records the audit event, so concurrent downloads cannot both slip in and the cost does not
//! grow with the number of downloads.

use super::Rejection;
use std::time::Duration;

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::audit::AuditEvent;
use crate::tenants::Tenant;

/// A download admitted with all of its bytes charged: what to give back if fewer are sent.
#[derive(Debug, Clone, Copy)]
pub struct Admitted {
    /// Its audit log entry.
    pub audit_id: i64,
    /// The day its bytes count towards.
    pub day: time::Date,
    pub bytes: u64,
}

/// Records the download, charging every byte it may send, if they fit today's quota; otherwise
/// how long until the day rolls over. What is not sent is given back with [`refund_unsent`].
///
/// One statement (its own transaction, one round trip before the first byte): the tenant's
/// usage row is created or locked by the upsert, whose condition re-reads the latest count under
/// that lock, so concurrent downloads cannot both slip in; the audit entry is written only for
/// an admitted download.
pub async fn admit_download(
    pool: &PgPool,
    tenant: &Tenant,
    event: AuditEvent<'_>,
    now: OffsetDateTime,
) -> sqlx::Result<Result<Admitted, Rejection>> {
    let bytes = event.bytes.unwrap_or(0);
    let audit_id = sqlx::query_scalar!(
        r#"WITH admitted AS (
             INSERT INTO tenant_usage AS u (tenant, egress_day, egress_bytes)
             SELECT $1::text, $2::date, $3::bigint WHERE $3::bigint <= $4::bigint
             ON CONFLICT ON CONSTRAINT tenant_usage_pkey DO UPDATE
                 SET egress_day = $2,
                     egress_bytes = CASE WHEN u.egress_day = $2 THEN u.egress_bytes ELSE 0 END + $3
                 WHERE CASE WHEN u.egress_day = $2 THEN u.egress_bytes ELSE 0 END + $3 <= $4
             RETURNING u.tenant)
         INSERT INTO audit_log (tenant, principal, action, export_id, object, byte_range, status, address, bytes)
         SELECT tenant, $5, $6, $7, $8, $9, $10, $11, $3::bigint FROM admitted
         RETURNING id"#,
        tenant.id.as_str(),
        now.date(),
        i64::try_from(bytes).unwrap_or(i64::MAX),
        i64::try_from(tenant.quota.egress_bytes_per_day).unwrap_or(i64::MAX),
        event.principal,
        event.action,
        event.export_id,
        event.object,
        event.byte_range,
        event.status.map(i32::from),
        event.address,
    )
    .fetch_optional(pool)
    .await?;
    Ok(match audit_id {
        Some(audit_id) => Ok(Admitted { audit_id, day: now.date(), bytes }),
        None => Err(Rejection::Egress { retry_after: until_tomorrow(now) }),
    })
}

/// A download that ended after `sent` of its admitted bytes (its client left, or the store
/// failed mid-body): the rest comes off the day's egress (unless the day has rolled over since)
/// and its audit entry says what was sent, so egress counts the bytes that went out.
pub async fn refund_unsent(pool: &PgPool, tenant: &str, admitted: Admitted, sent: u64) -> sqlx::Result<()> {
    let unsent = admitted.bytes.saturating_sub(sent);
    if unsent == 0 {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    sqlx::query!(
        "UPDATE tenant_usage SET egress_bytes = greatest(egress_bytes - $3, 0) WHERE tenant = $1 AND egress_day = $2",
        tenant,
        admitted.day,
        i64::try_from(unsent).unwrap_or(i64::MAX),
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!("UPDATE audit_log SET bytes = $2 WHERE id = $1", admitted.audit_id, sent as i64)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Adds `bytes` to today's egress inside `tx` if they fit the quota (the tenant's usage row stays
/// locked until `tx` ends); otherwise how long until the day rolls over.
pub async fn admit(
    tx: &mut sqlx::PgConnection,
    tenant: &Tenant,
    bytes: u64,
    now: OffsetDateTime,
) -> sqlx::Result<Result<(), Rejection>> {
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
        return Ok(Err(Rejection::Egress { retry_after: until_tomorrow(now) }));
    }
    Ok(Ok(()))
}

/// How long until the UTC day after `now` begins, rounded up: retrying after it lands there.
fn until_tomorrow(now: OffsetDateTime) -> Duration {
    let tomorrow = now.replace_time(time::Time::MIDNIGHT) + time::Duration::days(1);
    Duration::from_secs((tomorrow - now).whole_seconds().max(0) as u64 + 1)
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
