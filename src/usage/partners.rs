//! What each partner of a tenant did lately: exports, egress, last download, and per granted
//! dataset where its feed stands (stored cursor, last pull) — for the dashboard.

use std::collections::HashMap;

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::tenants::Tenant;

/// Days the per-partner totals cover.
pub const WINDOW_DAYS: i64 = 30;

#[derive(Debug, Clone, PartialEq)]
pub struct PartnerActivity {
    pub principal: String,
    pub disabled: bool,
    /// Exports created in the last [`WINDOW_DAYS`].
    pub exports: i64,
    /// Download bytes admitted in the last [`WINDOW_DAYS`].
    pub egress_bytes: i64,
    pub last_download_at: Option<OffsetDateTime>,
    pub feeds: Vec<FeedStanding>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FeedStanding {
    pub dataset: String,
    /// The feed position last presented (changes page or incremental export start).
    pub position_at: Option<OffsetDateTime>,
    pub last_read_at: Option<OffsetDateTime>,
    /// When an incremental export last stored the principal's cursor.
    pub cursor_stored_at: Option<OffsetDateTime>,
    /// The position is older than the tenant's `lagging_after_minutes`.
    pub lagging: bool,
    /// Refused since its last successful read: its position saw history a database failover
    /// lost, and it has not re-based on a full export yet.
    pub history_lost: Option<HistoryLost>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct HistoryLost {
    /// The timeline the database failed over to.
    pub timeline: i32,
    pub refusals: i64,
    pub last_at: OffsetDateTime,
}

/// Every partner principal of the tenant, in id order.
pub async fn activity(pool: &PgPool, tenant: &Tenant, now: OffsetDateTime) -> sqlx::Result<Vec<PartnerActivity>> {
    let id = tenant.id.as_str();
    let since = now - time::Duration::days(WINDOW_DAYS);
    let exports = crate::exports::store::facts::created_per_principal(pool, id, since).await?;
    let downloads: HashMap<String, (i64, Option<OffsetDateTime>)> = sqlx::query!(
        r#"SELECT principal, coalesce(sum(bytes), 0)::bigint AS "bytes!", max(at) AS last FROM audit_log
               WHERE tenant = $1 AND action = 'downloaded' AND at >= $2 GROUP BY principal"#,
        id,
        since,
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| (r.principal, (r.bytes, r.last)))
    .collect();
    let standings = sqlx::query!(
        r#"SELECT coalesce(p.principal, c.principal) AS "principal!", coalesce(p.dataset, c.dataset) AS "dataset!",
                  p.position_at AS "position_at?", p.last_read_at AS "last_read_at?", c.updated_at AS "cursor_stored_at?"
           FROM (SELECT * FROM feed_positions WHERE tenant = $1) p
           FULL JOIN (SELECT * FROM feed_cursors WHERE tenant = $1) c ON (c.principal, c.dataset) = (p.principal, p.dataset)"#,
        id,
    )
    .fetch_all(pool)
    .await?;
    let refused = sqlx::query!(
        "SELECT DISTINCT ON (principal, dataset) principal, dataset, timeline, refusals, last_at
           FROM failover_refusals WHERE tenant = $1 ORDER BY principal, dataset, timeline DESC",
        id,
    )
    .fetch_all(pool)
    .await?;
    let threshold = (tenant.feeds.lagging_after_minutes > 0)
        .then(|| now - time::Duration::minutes(i64::from(tenant.feeds.lagging_after_minutes)));
    let partners = tenant.principals.values().filter(|p| !p.is_admin());
    Ok(partners
        .map(|principal| {
            let name = principal.id.to_string();
            let feeds = tenant
                .datasets
                .keys()
                .filter(|dataset| principal.is_granted(dataset))
                .map(|dataset| {
                    let found = standings.iter().find(|s| s.principal == name && s.dataset == dataset.as_str());
                    let (position_at, last_read_at, cursor_stored_at) =
                        found.map_or((None, None, None), |s| (s.position_at, s.last_read_at, s.cursor_stored_at));
                    let lagging = matches!((position_at, threshold), (Some(at), Some(limit)) if at < limit);
                    let history_lost = refused
                        .iter()
                        .find(|r| r.principal == name && r.dataset == dataset.as_str())
                        .filter(|r| last_read_at.is_none_or(|read| read < r.last_at))
                        .map(|r| HistoryLost { timeline: r.timeline, refusals: r.refusals, last_at: r.last_at });
                    FeedStanding {
                        dataset: dataset.to_string(),
                        position_at,
                        last_read_at,
                        cursor_stored_at,
                        lagging,
                        history_lost,
                    }
                })
                .collect();
            let (egress_bytes, last_download_at) = downloads.get(&name).copied().unwrap_or((0, None));
            PartnerActivity {
                exports: exports.get(&name).copied().unwrap_or(0),
                egress_bytes,
                last_download_at,
                feeds,
                disabled: principal.disabled,
                principal: name,
            }
        })
        .collect())
}
