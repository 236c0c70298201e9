//! The audit log: who created, cancelled, revoked or downloaded what, when, from where.
//! Never a token or a link. Written by exports (create, cancel, revoke) and downloads (in the
//! egress admission's transaction); read by `GET /v1/audit`.

use serde::Serialize;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

#[derive(Debug, Clone, Default)]
pub struct AuditEvent<'a> {
    pub tenant: &'a str,
    pub principal: &'a str,
    /// `created`, `cancelled`, `revoked` or `downloaded`.
    pub action: &'a str,
    pub export_id: Option<Uuid>,
    pub object: Option<String>,
    pub byte_range: Option<String>,
    pub status: Option<u16>,
    pub address: Option<String>,
    /// Bytes sent (downloads).
    pub bytes: Option<u64>,
}

/// Appends an event. A failure is logged, not raised: the audited action already happened.
pub async fn record(pool: &PgPool, event: AuditEvent<'_>) {
    if let Err(e) = insert(pool, &event).await {
        tracing::error!(error = %e, action = event.action, "could not write the audit log");
    }
}

/// Inserts an event with `executor` (e.g. inside the transaction that decided it); its id.
pub async fn insert<'e>(executor: impl sqlx::PgExecutor<'e>, event: &AuditEvent<'_>) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        "INSERT INTO audit_log (tenant, principal, action, export_id, object, byte_range, status, address, bytes)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING id",
        event.tenant,
        event.principal,
        event.action,
        event.export_id,
        event.object,
        event.byte_range,
        event.status.map(i32::from),
        event.address,
        event.bytes.map(|b| b as i64),
    )
    .fetch_one(executor)
    .await
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct AuditEntry {
    pub id: i64,
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    pub principal: String,
    pub action: String,
    pub export_id: Option<Uuid>,
    pub object: Option<String>,
    pub byte_range: Option<String>,
    pub status: Option<i32>,
    pub address: Option<String>,
}

/// A page of the tenant's audit log, newest first, of events before id `before`; the next
/// page's cursor is the last id returned.
pub async fn page(
    pool: &PgPool,
    tenant: &str,
    before: Option<i64>,
    limit: u32,
) -> sqlx::Result<(Vec<AuditEntry>, Option<String>)> {
    let mut entries = sqlx::query_as!(
        AuditEntry,
        "SELECT id, at, principal, action, export_id, object, byte_range, status, address FROM audit_log
         WHERE tenant = $1 AND ($2::bigint IS NULL OR id < $2) ORDER BY id DESC LIMIT $3",
        tenant,
        before,
        i64::from(limit) + 1,
    )
    .fetch_all(pool)
    .await?;
    let next = if entries.len() > limit as usize {
        entries.truncate(limit as usize);
        entries.last().map(|e| e.id.to_string())
    } else {
        None
    };
    Ok((entries, next))
}

/// The latest `limit` events of one of the tenant's exports, newest first.
pub async fn of_export(pool: &PgPool, tenant: &str, export_id: Uuid, limit: u32) -> sqlx::Result<Vec<AuditEntry>> {
    sqlx::query_as!(
        AuditEntry,
        "SELECT id, at, principal, action, export_id, object, byte_range, status, address FROM audit_log
         WHERE export_id = $2 AND tenant = $1 ORDER BY id DESC LIMIT $3",
        tenant,
        export_id,
        i64::from(limit),
    )
    .fetch_all(pool)
    .await
}
