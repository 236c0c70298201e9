//! Per-tenant limits and policies (`[quota]`, `[retention]`, `[feeds]`), with documented defaults.

use serde::{Deserialize, Serialize};

/// `[quota]`: every limit has a default so a tenant file may omit the section.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quota {
    pub max_running_exports: u32,
    pub max_queued_exports: u32,
    /// Queued exports of one partner principal (admins are bound by `max_queued_exports` only).
    pub max_queued_exports_per_partner: u32,
    pub max_rows_per_export: u64,
    pub storage_bytes: u64,
    pub egress_bytes_per_day: u64,
    pub api_requests_per_second: u32,
    pub api_burst: u32,
    pub scan_rows_per_second: u32,
    /// Downloads of the tenant's principals streaming at once, per server process.
    pub max_concurrent_downloads: u32,
    /// Requests of the tenant's principals in progress at once, per server process (the API has
    /// 16 database connections: a tenant keeps to half of them).
    pub max_concurrent_requests: u32,
}

impl Default for Quota {
    fn default() -> Self {
        Quota {
            max_running_exports: 2,
            max_queued_exports: 10,
            max_queued_exports_per_partner: 3,
            max_rows_per_export: 10_000_000,
            storage_bytes: 5 << 30,
            egress_bytes_per_day: 20 << 30,
            api_requests_per_second: 20,
            api_burst: 40,
            scan_rows_per_second: 1_000_000,
            max_concurrent_downloads: 8,
            max_concurrent_requests: 8,
        }
    }
}

impl Quota {
    /// Rate limiters cannot be built from a zero rate; say which field is zero.
    pub fn check(&self) -> Result<(), (String, String)> {
        let positive = [
            ("max_running_exports", u64::from(self.max_running_exports)),
            ("max_rows_per_export", self.max_rows_per_export),
            ("api_requests_per_second", u64::from(self.api_requests_per_second)),
            ("max_concurrent_downloads", u64::from(self.max_concurrent_downloads)),
            ("max_concurrent_requests", u64::from(self.max_concurrent_requests)),
            ("api_burst", u64::from(self.api_burst)),
            ("scan_rows_per_second", u64::from(self.scan_rows_per_second)),
        ];
        match positive.iter().find(|(_, v)| *v == 0) {
            Some((field, _)) => Err((format!("quota.{field}"), "must be greater than 0".into())),
            None => Ok(()),
        }
    }
}

/// `[retention]`: how long artifacts and tombstones are kept.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Retention {
    /// A SUCCEEDED export's files are deleted (state EXPIRED) this many hours after publishing.
    pub artifact_hours: u32,
    /// Closed record versions and tombstones older than this are garbage-collected; feed cursors
    /// older than this get `410 cursor-expired`.
    pub tombstone_days: u32,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { artifact_hours: 72, tombstone_days: 30 }
    }
}

/// `[feeds]`: the newest window a feed may seal is `now - safety_delay_seconds`; a partner whose
/// position is older than `lagging_after_minutes` is lagging (the `feed.lagging` webhook event).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Feeds {
    pub safety_delay_seconds: u32,
    pub lagging_after_minutes: u32,
}

impl Default for Feeds {
    fn default() -> Self {
        Feeds { safety_delay_seconds: 5, lagging_after_minutes: 1440 }
    }
}

/// `[auth]`: what bearer tokens of this tenant may claim.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Auth {
    /// Longest lifetime (`exp - iat`, and `exp` from now) a token may have.
    pub max_token_lifetime_hours: u32,
}

impl Default for Auth {
    fn default() -> Self {
        Auth { max_token_lifetime_hours: 720 }
    }
}
