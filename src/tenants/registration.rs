//! Start-up: recording the dataset schemas a process starts with and deciding their versions,
//! once, under an advisory lock (processes starting together see each other's records), in the
//! same transaction as the `schema.changed` events that announce them.

use std::path::Path;

use anyhow::Context;
use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};

use super::{ConfigError, Registry};
use crate::schemas::versioning::{Decision, decide, recorded, versions};
use crate::schemas::{ColumnChange, DatasetVersions, Recorded, SchemaCatalog, SchemaVersion};

/// Records every served dataset's schema that PostgreSQL does not hold yet, announces the new
/// versions, checks the partners' pins, and returns what each dataset serves. A breaking change
/// without the next major declared, or a pin of a major never published, stops start-up with
/// an error naming the file and field.
pub async fn register(pool: &PgPool, registry: &Registry, tenants_dir: &Path) -> anyhow::Result<SchemaCatalog> {
    let mut tx = pool.begin().await?;
    match record_all(&mut tx, registry, tenants_dir).await {
        Ok(catalog) => {
            tx.commit().await.context("recording dataset schema versions")?;
            Ok(catalog)
        }
        Err(e) => {
            // Rolled back now, not when the pool next uses the connection: until then the
            // advisory lock would stay held and the next process to start would wait on it.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

async fn record_all(
    tx: &mut Transaction<'_, Postgres>,
    registry: &Registry,
    tenants_dir: &Path,
) -> anyhow::Result<SchemaCatalog> {
    sqlx::query!("SELECT pg_advisory_xact_lock(hashtext('exportd.dataset_schemas'))").execute(&mut **tx).await?;
    let mut catalog = SchemaCatalog::new();
    let mut announcements = Vec::new();
    for schema in registry.schemas() {
        let mut recorded = recorded(tx, schema.name.as_str()).await?;
        let sha256 = schema.sha256();
        let file = tenants_dir.join("datasets").join(format!("{}.toml", schema.name));
        let decision = decide(&recorded, &schema, &sha256).map_err(|(field, message)| ConfigError {
            file,
            field: field.to_owned(),
            message,
        })?;
        let version = match decision {
            Decision::Known(version) => version,
            Decision::New { version, change, changes } => {
                sqlx::query!(
                    "INSERT INTO dataset_schemas (dataset, major, minor, sha256, schema, change, changes)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    schema.name.as_str(),
                    version.major as i32,
                    version.minor as i32,
                    &sha256,
                    serde_json::to_value(&*schema)?,
                    change,
                    serde_json::to_value(&changes)?,
                )
                .execute(&mut **tx)
                .await?;
                let previous = recorded.last().map(|r| r.version);
                recorded.push(Recorded { version, sha256, schema: (*schema).clone() });
                if let Some(previous) = previous {
                    announcements.push((schema.name.clone(), previous, change, changes));
                }
                version
            }
        };
        catalog.insert(schema.name.clone(), versions(&recorded, schema, version));
    }
    check_pins(registry, &catalog, tenants_dir)?;
    for (dataset, previous, change, changes) in announcements {
        announce(tx, registry, &catalog[&dataset], previous, change, &changes).await?;
    }
    Ok(catalog)
}

/// Every pin names a major the dataset published (an older one, or the current one).
fn check_pins(registry: &Registry, catalog: &SchemaCatalog, tenants_dir: &Path) -> Result<(), ConfigError> {
    for tenant in registry.tenants() {
        for principal in tenant.principals.values() {
            for (dataset, major) in principal.schema_pins() {
                let versions = &catalog[dataset];
                if *major >= versions.current.version.major || versions.has_major(*major) {
                    continue;
                }
                let published: Vec<String> =
                    versions.older_majors().chain([versions.current.version.major]).map(|m| m.to_string()).collect();
                return Err(ConfigError {
                    file: tenants_dir.join(format!("{}.toml", tenant.id)),
                    field: format!("principals.{}.schema_pins.{dataset}", principal.id),
                    message: format!(
                        "version {major} of `{dataset}` was never published (published majors: {})",
                        published.join(", ")
                    ),
                });
            }
        }
    }
    Ok(())
}

/// One `schema.changed` event per partner granted the dataset, saying what changed as that
/// partner sees it (changes of columns its policy drops are left out) and which version it will
/// receive (a pinned partner keeps its major).
async fn announce(
    tx: &mut Transaction<'_, Postgres>,
    registry: &Registry,
    versions: &DatasetVersions,
    previous: SchemaVersion,
    change: &str,
    changes: &[ColumnChange],
) -> anyhow::Result<()> {
    let current = &versions.current;
    let dataset = current.schema.name.as_str();
    for tenant in registry.tenants().filter(|t| t.dataset(dataset).is_some()) {
        for principal in tenant.principals.values().filter(|p| !p.is_admin() && p.is_granted(&current.schema.name)) {
            let policy = principal.column_policy(dataset);
            let seen = crate::schemas::as_seen(changes, policy);
            let pin = principal.schema_pin(dataset);
            let columns = crate::schemas::columns_seen(&current.schema, policy);
            let data = json!({
                "principal": principal.id.as_str(),
                "dataset": dataset,
                "version": current.version,
                "sha256": crate::schemas::sha256_seen(dataset, &current.sha256, &columns, policy),
                "previous_version": previous,
                "change": change,
                "changes": seen,
                "served_version": versions.served(pin).version,
                "pinned_major": pin,
            });
            sqlx::query!(
                "INSERT INTO webhook_events (tenant, type, principal, dataset, data)
                 VALUES ($1, 'schema.changed', $2, $3, $4)",
                tenant.id.as_str(),
                principal.id.as_str(),
                dataset,
                data,
            )
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}
