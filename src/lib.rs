//! exportd: multi-tenant bulk exports and incremental feeds on PostgreSQL.
//!
//! Domain modules (`tenants`, `auth`, `records`, `exports`, `jobs`, `storage`, `writers`) know
//! nothing of HTTP; `http` is a thin edge over them.

pub mod attach;
pub mod audit;
pub mod auth;
pub mod cleaner;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod dataset;
pub mod db;
pub mod delivery;
pub mod exports;
pub mod feeds;
pub mod history;
pub mod http;
pub mod jobs;
pub mod links;
pub mod masking;
pub mod outbound;
pub mod quota;
pub mod records;
pub mod replicas;
pub mod schemas;
pub mod served;
pub mod server;
pub mod sharing;
pub mod storage;
pub mod telemetry;
pub mod tenants;
pub mod usage;
pub mod webhooks;
pub mod writers;

/// This build's version, as recorded on the exports it creates.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
