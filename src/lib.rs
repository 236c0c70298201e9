//! exportd: multi-tenant bulk exports and incremental feeds on PostgreSQL.
//!
//! Domain modules (`tenants`, `auth`, `records`) know nothing of HTTP; `http` is a thin edge over them.

pub mod auth;
pub mod config;
pub mod db;
pub mod http;
pub mod records;
pub mod server;
pub mod telemetry;
pub mod tenants;
