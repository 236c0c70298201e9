//! The integration tests, one binary (one link for all): real PostgreSQL (a fresh database per
//! test), real TCP ports, real files and S3-compatible storage. Each module is one area.

mod common;

mod abuse;
mod attach;
mod chaos;
mod cli_errors;
mod client;
mod column_policies;
mod dashboard;
mod deliveries;
mod delivery_faults;
mod delivery_leases;
mod delivery_slots;
mod downloads;
mod export_leases;
mod exports;
mod failover;
mod feeds;
mod http_api;
mod isolation;
mod outbound;
mod parallel;
mod parquet_exports;
mod partner_view;
mod quotas;
mod record_store;
mod restarts;
mod schema_versions;
mod served_view;
mod sharing;
mod slow_clients;
mod standbys;
mod storage;
mod tenant_config;
mod webhooks;
mod worker_faults;
