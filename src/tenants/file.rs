//! Reading and validating the TOML files behind the [`Registry`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::destinations::{self, Destination, DestinationFile, Subscription, SubscriptionFile};
use super::webhooks::{self, WebhookEndpoint, WebhookFile};
use crate::masking::{ColumnHasher, ColumnPolicy, ColumnRule};
use crate::schemas::DatasetVersions;

use super::{
    Auth, ColumnName, ConfigError, DatasetName, DatasetSchema, Feeds, Principal, PrincipalId, Quota, Registry,
    Retention, Role, RowFilter, Secret, SigningKey, Tenant, TenantId,
};

/// HS256 keys shorter than this are refused (RFC 7518 §3.2 asks for at least the hash size).
const MIN_SECRET_BYTES: usize = 32;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantFile {
    id: TenantId,
    name: String,
    datasets: Vec<DatasetName>,
    keys: Vec<KeyFile>,
    principals: Vec<PrincipalFile>,
    #[serde(default)]
    quota: Quota,
    #[serde(default)]
    retention: Retention,
    #[serde(default)]
    feeds: Feeds,
    #[serde(default)]
    auth: Auth,
    #[serde(default)]
    webhooks: Vec<WebhookFile>,
    #[serde(default)]
    destinations: Vec<DestinationFile>,
    #[serde(default)]
    subscriptions: Vec<SubscriptionFile>,
    /// The secret partners' hash keys derive from (needed by `hash` column rules).
    masking: Option<MaskingFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MaskingFile {
    secret: Option<String>,
    secret_env: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    kid: String,
    secret: Option<String>,
    secret_env: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalFile {
    id: PrincipalId,
    role: Role,
    #[serde(default)]
    grants: Vec<DatasetName>,
    #[serde(default)]
    row_filter: RowFilter,
    #[serde(default)]
    disabled: bool,
    /// Per granted dataset: column → rule (`drop`, `null`, `truncate(n)`, `hash`).
    #[serde(default)]
    column_policy: BTreeMap<DatasetName, BTreeMap<ColumnName, ColumnRule>>,
    /// Per granted dataset: the major schema version this partner keeps receiving.
    #[serde(default)]
    schema_pins: BTreeMap<DatasetName, u32>,
}

pub(super) fn load_dir(dir: &Path) -> Result<Registry, ConfigError> {
    if !dir.is_dir() {
        let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        return Err(ConfigError {
            file: dir.to_path_buf(),
            field: String::new(),
            message: format!(
                "no tenants directory here (looked in {}); point EXPORTD_TENANTS_DIR or --tenants-dir at \
                 the directory of tenant files (the repository's ./tenants holds two demo tenants)",
                absolute.display()
            ),
        });
    }
    let schemas = load_schemas(&dir.join("datasets"))?;
    let mut registry = Registry::default();
    let mut kid_files: HashMap<String, PathBuf> = HashMap::new();
    for path in toml_files(dir)? {
        let tenant = load_tenant(&path, &schemas)?;
        for (index, key) in tenant.keys.iter().enumerate() {
            if let Some(other) = kid_files.insert(key.kid.clone(), path.clone()) {
                return Err(ConfigError {
                    file: path,
                    field: format!("keys[{index}].kid"),
                    message: format!(
                        "duplicate kid `{}` (also in {}): kids must be unique across tenants",
                        key.kid,
                        other.display()
                    ),
                });
            }
            registry.kids.insert(key.kid.clone(), (tenant.id.clone(), index));
        }
        registry.tenants.insert(tenant.id.clone(), Arc::new(tenant));
    }
    if registry.tenants.is_empty() {
        return Err(error(dir, "", "no tenant files (*.toml) found"));
    }
    Ok(registry)
}

fn load_schemas(dir: &Path) -> Result<BTreeMap<DatasetName, Arc<DatasetSchema>>, ConfigError> {
    let mut schemas = BTreeMap::new();
    for path in toml_files(dir)? {
        let schema: DatasetSchema = parse(&path)?;
        schema.check().map_err(|(field, message)| error(&path, &field, message))?;
        if stem(&path) != schema.name.as_str() {
            return Err(error(&path, "name", "must match the file name"));
        }
        schemas.insert(schema.name.clone(), Arc::new(schema));
    }
    Ok(schemas)
}

fn load_tenant(path: &Path, schemas: &BTreeMap<DatasetName, Arc<DatasetSchema>>) -> Result<Tenant, ConfigError> {
    let raw: TenantFile = parse(path)?;
    if stem(path) != raw.id.as_str() {
        return Err(error(path, "id", "must match the file name"));
    }
    if raw.name.trim().is_empty() {
        return Err(error(path, "name", "must not be empty"));
    }
    raw.quota.check().map_err(|(field, message)| error(path, &field, message))?;
    if raw.auth.max_token_lifetime_hours == 0 {
        return Err(error(path, "auth.max_token_lifetime_hours", "must be at least 1"));
    }

    let mut datasets = BTreeMap::new();
    for (i, name) in raw.datasets.iter().enumerate() {
        let schema =
            schemas.get(name).ok_or_else(|| error(path, &format!("datasets[{i}]"), unknown_dataset(name, schemas)))?;
        if datasets.insert(name.clone(), schema.clone()).is_some() {
            return Err(error(path, &format!("datasets[{i}]"), format!("`{name}` listed twice")));
        }
    }

    if raw.keys.is_empty() {
        return Err(error(path, "keys", "at least one signing key is required"));
    }
    let keys =
        raw.keys.into_iter().enumerate().map(|(i, key)| signing_key(path, i, key)).collect::<Result<Vec<_>, _>>()?;
    for (i, key) in keys.iter().enumerate() {
        if keys[..i].iter().any(|k| k.kid == key.kid) {
            return Err(error(path, &format!("keys[{i}].kid"), format!("duplicate kid `{}`", key.kid)));
        }
    }

    let masking_secret = match raw.masking {
        None => None,
        Some(m) => {
            let (secret, source) = secret_text(path, "masking", m.secret, m.secret_env)?;
            if secret.len() < MIN_SECRET_BYTES {
                let why = format!("the masking secret needs at least {MIN_SECRET_BYTES} bytes");
                return Err(error(path, &format!("masking.{source}"), why));
            }
            Some(secret)
        }
    };
    let hasher = |principal: &PrincipalId| {
        masking_secret.as_ref().map(|s| ColumnHasher::derive(s.as_bytes(), raw.id.as_str(), principal.as_str()))
    };

    let mut principals = BTreeMap::new();
    for (i, p) in raw.principals.into_iter().enumerate() {
        let hasher = hasher(&p.id);
        let principal = principal(path, i, p, &datasets, hasher)?;
        if principals.contains_key(&principal.id) {
            return Err(error(path, &format!("principals[{i}].id"), format!("duplicate principal `{}`", principal.id)));
        }
        principals.insert(principal.id.clone(), principal);
    }

    let mut webhooks: Vec<WebhookEndpoint> = Vec::new();
    for (i, raw_endpoint) in raw.webhooks.into_iter().enumerate() {
        let endpoint =
            webhooks::endpoint(path, i, raw_endpoint, |p| principals.contains_key(p), |d| datasets.contains_key(d))?;
        if webhooks.iter().any(|w| w.name == endpoint.name) {
            return Err(error(path, &format!("webhooks[{i}].name"), format!("duplicate endpoint `{}`", endpoint.name)));
        }
        webhooks.push(endpoint);
    }

    let mut tenant_destinations: Vec<Destination> = Vec::new();
    for (i, raw_destination) in raw.destinations.into_iter().enumerate() {
        let destination = destinations::destination(path, i, raw_destination, |p| principals.get(p).map(|p| p.role))?;
        if tenant_destinations.iter().any(|d| d.name == destination.name) {
            let why = format!("duplicate destination `{}`", destination.name);
            return Err(error(path, &format!("destinations[{i}].name"), why));
        }
        tenant_destinations.push(destination);
    }
    let mut subscriptions: Vec<Subscription> = Vec::new();
    for (i, raw_subscription) in raw.subscriptions.into_iter().enumerate() {
        let granted = |p: &PrincipalId, d: &DatasetName| principals.get(p).is_some_and(|p| p.is_granted(d));
        let subscription = destinations::subscription(path, i, raw_subscription, &tenant_destinations, granted)?;
        if subscriptions.iter().any(|s| s.name == subscription.name) {
            let why = format!("duplicate subscription `{}`", subscription.name);
            return Err(error(path, &format!("subscriptions[{i}].name"), why));
        }
        subscriptions.push(subscription);
    }

    let versions = datasets
        .iter()
        .map(|(name, schema)| (name.clone(), Arc::new(DatasetVersions::provisional(schema.clone()))))
        .collect();
    Ok(Tenant {
        id: raw.id,
        name: raw.name,
        datasets,
        versions,
        keys,
        principals,
        quota: raw.quota,
        retention: raw.retention,
        feeds: raw.feeds,
        auth: raw.auth,
        webhooks,
        destinations: tenant_destinations,
        subscriptions,
    })
}

/// A secret written in the file (`secret`) or named by an environment variable (`secret_env`),
/// and which of the two fields gave it (for messages about its value).
pub(super) fn secret_text(
    path: &Path,
    entry: &str,
    secret: Option<String>,
    secret_env: Option<String>,
) -> Result<(String, &'static str), ConfigError> {
    match (secret, secret_env) {
        (Some(secret), None) => Ok((secret, "secret")),
        (None, Some(var)) => std::env::var(&var).map(|secret| (secret, "secret_env")).map_err(|_| {
            error(path, &format!("{entry}.secret_env"), format!("environment variable `{var}` is not set"))
        }),
        _ => Err(error(path, &format!("{entry}.secret"), "give exactly one of `secret` or `secret_env`")),
    }
}

fn signing_key(path: &Path, i: usize, key: KeyFile) -> Result<SigningKey, ConfigError> {
    let field = |name: &str| format!("keys[{i}].{name}");
    if key.kid.is_empty() || key.kid.len() > 128 || !key.kid.chars().all(|c| c.is_ascii_graphic()) {
        return Err(error(path, &field("kid"), "must be 1-128 visible ASCII characters"));
    }
    let (secret, source) = secret_text(path, &format!("keys[{i}]"), key.secret, key.secret_env)?;
    if secret.len() < MIN_SECRET_BYTES {
        return Err(error(path, &field(source), format!("an HS256 secret needs at least {MIN_SECRET_BYTES} bytes")));
    }
    Ok(SigningKey { kid: key.kid, secret: Secret(secret.into_bytes()) })
}

fn principal(
    path: &Path,
    i: usize,
    p: PrincipalFile,
    datasets: &BTreeMap<DatasetName, Arc<DatasetSchema>>,
    hasher: Option<ColumnHasher>,
) -> Result<Principal, ConfigError> {
    let field = |name: &str| format!("principals[{i}].{name}");
    if p.role == Role::Admin && !p.grants.is_empty() {
        return Err(error(path, &field("grants"), "admins read every dataset; grants are for partners"));
    }
    if p.role == Role::Admin && !p.row_filter.is_empty() {
        return Err(error(path, &field("row_filter"), "row filters apply to partners only"));
    }
    if p.role == Role::Admin && !p.column_policy.is_empty() {
        return Err(error(path, &field("column_policy"), "column policies apply to partners only"));
    }
    if p.role == Role::Admin && !p.schema_pins.is_empty() {
        return Err(error(path, &field("schema_pins"), "admins read the current schema; pins are for partners"));
    }
    for (dataset, major) in &p.schema_pins {
        let field = field(&format!("schema_pins.{dataset}"));
        if !p.grants.contains(dataset) {
            return Err(error(path, &field, format!("`{dataset}` is not granted to this partner")));
        }
        let declared = datasets[dataset].version;
        if !(1..=declared).contains(major) {
            let why = format!("pin a published major version of `{dataset}` (1 to {declared}), not {major}");
            return Err(error(path, &field, why));
        }
    }
    let mut column_policies = BTreeMap::new();
    for (dataset, rules) in p.column_policy {
        let field = field(&format!("column_policy.{dataset}"));
        if !p.grants.contains(&dataset) {
            return Err(error(path, &field, format!("`{dataset}` is not granted to this partner")));
        }
        let policy = ColumnPolicy::new(&datasets[&dataset], rules, hasher.clone())
            .map_err(|(column, why)| error(path, &format!("{field}.{column}"), why))?;
        column_policies.insert(dataset, policy);
    }
    for (g, name) in p.grants.iter().enumerate() {
        if !datasets.contains_key(name) {
            return Err(error(
                path,
                &field(&format!("grants[{g}]")),
                format!("`{name}` is not one of this tenant's datasets"),
            ));
        }
    }
    for (column, value) in &p.row_filter {
        let field = field(&format!("row_filter.{column}"));
        for name in &p.grants {
            let schema = &datasets[name];
            let Some(col) = schema.column(column.as_str()) else {
                return Err(error(path, &field, format!("dataset `{name}` has no column `{column}`")));
            };
            if !col.ty.accepts_filter_value(value) {
                return Err(error(
                    path,
                    &field,
                    format!("value does not fit column `{column}` of `{name}` ({:?})", col.ty),
                ));
            }
        }
    }
    Ok(Principal {
        id: p.id,
        role: p.role,
        grants: p.grants.into_iter().collect(),
        row_filter: p.row_filter,
        disabled: p.disabled,
        column_policies,
        schema_pins: p.schema_pins,
    })
}

fn unknown_dataset(name: &DatasetName, schemas: &BTreeMap<DatasetName, Arc<DatasetSchema>>) -> String {
    let known: Vec<&str> = schemas.keys().map(|n| n.as_str()).collect();
    format!("unknown dataset `{name}` (defined: {})", known.join(", "))
}

fn parse<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| error(path, "", format!("cannot read: {e}")))?;
    // toml's message names the key of an unknown or missing field, not the one holding a value
    // of the wrong type: serde_path_to_error tracks where the deserializer was ("quota.x").
    let located = |e: &toml::de::Error| match e.span() {
        Some(span) => format!("{} (line {})", e.message(), text[..span.start].matches('\n').count() + 1),
        None => e.message().to_owned(),
    };
    let deserializer = toml::Deserializer::parse(&text).map_err(|e| error(path, "", located(&e)))?;
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." { String::new() } else { field };
        ConfigError { file: path.to_owned(), field, message: located(e.inner()) }
    })
}

fn toml_files(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = std::fs::read_dir(dir).map_err(|e| error(dir, "", format!("cannot read directory: {e}")))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    Ok(files)
}

fn stem(path: &Path) -> &str {
    path.file_stem().and_then(|s| s.to_str()).unwrap_or_default()
}

pub(super) fn error(path: &Path, field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError { file: path.to_owned(), field: field.to_owned(), message: message.into() }
}
