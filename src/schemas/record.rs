//! Start-up: recording the dataset schemas a process starts with and deciding their versions,
//! once, under an advisory lock (processes starting together see each other's records), in the
//! same transaction as the `schema.changed` events that announce them.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};

use super::history::Recorded;
use super::{ColumnChange, DatasetVersions, SchemaCatalog, SchemaVersion, ServedSchema, classify};
use crate::tenants::{ConfigError, DatasetSchema, Registry};

/// What start-up does with a dataset file's schema.
#[derive(Debug, PartialEq)]
enum Decision {
    /// Recorded before as this version (unchanged, or a process of a rolling deploy that still
    /// has an earlier file of the same major).
    Known(SchemaVersion),
    /// A new version to record and announce.
    New { version: SchemaVersion, change: &'static str, changes: Vec<ColumnChange> },
}

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

async fn recorded(tx: &mut Transaction<'_, Postgres>, dataset: &str) -> anyhow::Result<Vec<Recorded>> {
    let rows = sqlx::query!(
        "SELECT major, minor, sha256, schema FROM dataset_schemas WHERE dataset = $1 ORDER BY major, minor",
        dataset,
    )
    .fetch_all(&mut **tx)
    .await?;
    rows.into_iter().map(|row| Recorded::from_row(row.major, row.minor, row.sha256, row.schema)).collect()
}

/// The version of `schema` given what is recorded (oldest first), or the field of the dataset
/// file to fix and why.
fn decide(recorded: &[Recorded], schema: &DatasetSchema, sha256: &str) -> Result<Decision, (&'static str, String)> {
    let declared = schema.version;
    let Some(latest) = recorded.last() else {
        let version = SchemaVersion { major: declared, minor: 0 };
        return Ok(Decision::New { version, change: "initial", changes: Vec::new() });
    };
    if let Some(known) = recorded.iter().rev().find(|r| r.sha256 == sha256 && r.version.major == latest.version.major) {
        return Ok(Decision::Known(known.version));
    }
    let current = latest.version;
    let next = current.major + 1;
    if declared < current.major {
        let why = format!(
            "declares version {declared}, but dataset `{}` already published version {current}: versions never go \
             back (declare version = {} for a compatible change, {next} for a breaking one)",
            schema.name, current.major
        );
        return Err(("version", why));
    }
    if declared > next {
        let why = format!("declares version {declared}, but the next major after {current} is {next}");
        return Err(("version", why));
    }
    let changes = classify(&latest.schema, schema);
    let breaking: Vec<String> = changes.iter().filter(|c| c.is_breaking()).map(ColumnChange::explain).collect();
    let change = if breaking.is_empty() { "compatible" } else { "breaking" };
    if declared == next {
        return Ok(Decision::New { version: SchemaVersion { major: next, minor: 0 }, change, changes });
    }
    if !breaking.is_empty() {
        let why = format!(
            "dataset `{}` changes incompatibly from schema version {current}: {}. Declare `version = {next}` in \
             the file to publish it as a new major version (a partner that must keep the old shape can be \
             pinned with `schema_pins.{} = {}`)",
            schema.name,
            breaking.join("; "),
            schema.name,
            current.major
        );
        return Err(("version", why));
    }
    Ok(Decision::New { version: SchemaVersion { major: current.major, minor: current.minor + 1 }, change, changes })
}

/// What a dataset serves: `schema` as `version`, and the newest recorded version of each older
/// major for partners pinned to it.
fn versions(recorded: &[Recorded], schema: Arc<DatasetSchema>, version: SchemaVersion) -> DatasetVersions {
    let mut older = BTreeMap::new();
    for r in recorded.iter().filter(|r| r.version.major < version.major) {
        // Oldest first: the last one of each major wins.
        older.insert(r.version.major, ServedSchema::pinned(r.schema.clone(), r.version, &schema));
    }
    let stale_fields =
        recorded.iter().flat_map(|r| &r.schema.columns).any(|c| schema.column(c.name.as_str()).is_none());
    DatasetVersions { current: ServedSchema::current(schema, version), older, stale_fields }
}

/// Every pin names a major the dataset published (an older one, or the current one).
fn check_pins(registry: &Registry, catalog: &SchemaCatalog, tenants_dir: &Path) -> Result<(), ConfigError> {
    for tenant in registry.tenants() {
        for principal in tenant.principals.values() {
            for (dataset, major) in principal.schema_pins() {
                let versions = &catalog[dataset];
                if *major >= versions.current.version.major || versions.older.contains_key(major) {
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
            let seen = super::as_seen(changes, policy);
            let pin = principal.schema_pin(dataset);
            let columns = super::columns_seen(&current.schema, policy);
            let data = json!({
                "principal": principal.id.as_str(),
                "dataset": dataset,
                "version": current.version,
                "sha256": super::sha256_seen(dataset, &current.sha256, &columns, policy),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(version: u32, columns: &str) -> DatasetSchema {
        toml::from_str(&format!("name='t'\nversion={version}\nkey_column='id'\n{columns}")).unwrap()
    }

    const V1: &str = "[[columns]]\nname='a'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'";

    fn recorded(versions: &[(u32, u32, &str)]) -> Vec<Recorded> {
        versions
            .iter()
            .map(|(major, minor, columns)| {
                let schema = schema(*major, columns);
                Recorded { version: SchemaVersion { major: *major, minor: *minor }, sha256: schema.sha256(), schema }
            })
            .collect()
    }

    fn decision(history: &[(u32, u32, &str)], schema: &DatasetSchema) -> Result<Decision, (&'static str, String)> {
        decide(&recorded(history), schema, &schema.sha256())
    }

    #[test]
    fn the_first_schema_is_its_declared_major() {
        let first = decision(&[], &schema(2, V1)).unwrap();
        let version = SchemaVersion { major: 2, minor: 0 };
        assert_eq!(first, Decision::New { version, change: "initial", changes: vec![] });
        assert_eq!(
            decision(&[(1, 0, V1)], &schema(1, V1)).unwrap(),
            Decision::Known(SchemaVersion { major: 1, minor: 0 })
        );
    }

    #[test]
    fn compatible_changes_are_minors_and_breaking_ones_need_the_next_major() {
        let added = format!("{V1}\n[[columns]]\nname='z'\ntype='string'");
        let Decision::New { version, change, .. } = decision(&[(1, 0, V1)], &schema(1, &added)).unwrap() else {
            panic!("not recorded")
        };
        assert_eq!((version.to_string(), change), ("1.1".into(), "compatible"));
        let renamed = "[[columns]]\nname='b'\ntype='string'\n[[columns]]\nname='n'\ntype='integer'";
        let (field, why) = decision(&[(1, 0, V1), (1, 1, &added)], &schema(1, renamed)).unwrap_err();
        assert_eq!(field, "version");
        assert!(why.contains("column `a` is renamed to `b`"), "{why}");
        assert!(why.contains("Declare `version = 2`"), "{why}");
        let Decision::New { version, change, .. } = decision(&[(1, 0, V1)], &schema(2, renamed)).unwrap() else {
            panic!("not recorded")
        };
        assert_eq!((version.to_string(), change), ("2.0".into(), "breaking"));
        assert_eq!(decision(&[(1, 0, V1)], &schema(3, renamed)).unwrap_err().0, "version");
        assert_eq!(decision(&[(1, 0, V1), (2, 0, renamed)], &schema(1, V1)).unwrap_err().0, "version");
    }

    #[test]
    fn an_earlier_file_of_the_current_major_serves_its_recorded_version() {
        let added = format!("{V1}\n[[columns]]\nname='z'\ntype='string'");
        let history = [(1, 0, V1), (1, 1, added.as_str())];
        assert_eq!(decision(&history, &schema(1, V1)).unwrap(), Decision::Known(SchemaVersion { major: 1, minor: 0 }));
    }
}
