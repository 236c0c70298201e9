//! Tenants: one `tenants/<id>.toml` per tenant plus shared dataset schemas in `tenants/datasets/`.
//! Loaded and validated once at start-up; any error names the file and the field.

mod catalogue;
mod destinations;
mod file;
mod registration;
mod settings;
mod webhooks;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use catalogue::sync_catalogue;
pub use destinations::{Destination, SecretRef, Subscription};
pub use registration::register;
pub use settings::{Auth, Feeds, Quota, Retention};
pub use webhooks::{WebhookEndpoint, WebhookEvent};

pub use crate::dataset::{Column, ColumnName, ColumnType, DatasetName, DatasetSchema, PrincipalId, TenantId};
use crate::schemas::{DatasetVersions, SchemaCatalog, ServedSchema};

/// A configuration error: which file, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(f, "{}: {}: {}", self.file.display(), self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Sees and manages everything of its tenant.
    Admin,
    /// Reads only the datasets it is granted, optionally narrowed by a row filter.
    Partner,
}

/// Column = value equalities every exported row of a partner must satisfy.
pub type RowFilter = BTreeMap<ColumnName, serde_json::Value>;

#[derive(Debug, Clone)]
pub struct Principal {
    pub id: PrincipalId,
    pub role: Role,
    grants: BTreeSet<DatasetName>,
    pub row_filter: RowFilter,
    pub disabled: bool,
    /// What this partner receives of each column, per dataset (none: everything).
    column_policies: BTreeMap<DatasetName, crate::masking::ColumnPolicy>,
    /// The major schema version this partner keeps receiving, per dataset (none: the current).
    schema_pins: BTreeMap<DatasetName, u32>,
}

impl Principal {
    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }

    /// The row filter as a JSON object (`{}` for none), as exports freeze it and feeds apply it.
    pub fn row_filter_json(&self) -> serde_json::Value {
        serde_json::Value::Object(self.row_filter.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
    }

    /// This partner's column policy for `dataset`, if it has one.
    pub fn column_policy(&self, dataset: &str) -> Option<&crate::masking::ColumnPolicy> {
        self.column_policies.get(dataset)
    }

    /// The fingerprint of that policy, as frozen into exports and cursors.
    pub fn policy_fingerprint(&self, dataset: &str) -> Option<&str> {
        self.column_policy(dataset).map(|p| p.fingerprint())
    }

    /// The major version of `dataset`'s schema this partner is pinned to, if any.
    pub fn schema_pin(&self, dataset: &str) -> Option<u32> {
        self.schema_pins.get(dataset).copied()
    }

    pub fn schema_pins(&self) -> &BTreeMap<DatasetName, u32> {
        &self.schema_pins
    }

    /// Whether this principal may read `dataset` (which the tenant must also expose).
    pub fn is_granted(&self, dataset: &DatasetName) -> bool {
        self.is_admin() || self.grants.contains(dataset)
    }
}

/// An HS256 secret. Its Debug output never shows the bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

#[derive(Debug, Clone)]
pub struct SigningKey {
    pub kid: String,
    pub secret: Secret,
}

#[derive(Debug)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub datasets: BTreeMap<DatasetName, Arc<DatasetSchema>>,
    /// Each dataset's recorded schema versions (see [`crate::schemas`]).
    versions: BTreeMap<DatasetName, Arc<DatasetVersions>>,
    /// The first key signs new tokens; all are accepted.
    pub keys: Vec<SigningKey>,
    pub principals: BTreeMap<PrincipalId, Principal>,
    pub quota: Quota,
    pub retention: Retention,
    pub feeds: Feeds,
    pub auth: Auth,
    /// `[[webhooks]]`: endpoints told about export and feed events.
    pub webhooks: Vec<WebhookEndpoint>,
    /// `[[destinations]]`: partners' own buckets.
    pub destinations: Vec<Destination>,
    /// `[[subscriptions]]`: what is delivered into them.
    pub subscriptions: Vec<Subscription>,
}

impl Tenant {
    pub fn principal(&self, id: &str) -> Option<&Principal> {
        self.principals.get(id)
    }

    pub fn dataset(&self, name: &str) -> Option<&Arc<DatasetSchema>> {
        self.datasets.get(name)
    }

    /// `dataset`'s schema versions, if the tenant exposes it.
    pub fn versions(&self, dataset: &str) -> Option<&Arc<DatasetVersions>> {
        self.versions.get(dataset)
    }

    /// The schema of `dataset` that `principal` receives: the version its pin names, else the
    /// current one.
    pub fn served_schema(&self, dataset: &str, principal: &Principal) -> Option<&ServedSchema> {
        Some(self.versions(dataset)?.served(principal.schema_pin(dataset)))
    }

    /// The older major `principal` is pinned to and receives (a pin of the current major or a
    /// later one has no effect yet).
    pub fn effective_pin(&self, dataset: &str, principal: &Principal) -> Option<u32> {
        let versions = self.versions(dataset)?;
        let served = versions.served(principal.schema_pin(dataset));
        (served.version.major < versions.current.version.major).then_some(served.version.major)
    }

    pub fn webhook(&self, name: &str) -> Option<&WebhookEndpoint> {
        self.webhooks.iter().find(|w| w.name == name)
    }

    pub fn destination(&self, name: &str) -> Option<&Destination> {
        self.destinations.iter().find(|d| d.name == name)
    }
}

/// Every tenant, found by id or by signing-key id.
#[derive(Debug, Default)]
pub struct Registry {
    tenants: BTreeMap<TenantId, Arc<Tenant>>,
    /// kid → (tenant, index into its keys). Kids are unique across all tenants.
    kids: HashMap<String, (TenantId, usize)>,
}

impl Registry {
    /// Loads `dir/datasets/*.toml` and `dir/*.toml`.
    pub fn load(dir: &Path) -> Result<Registry, ConfigError> {
        file::load_dir(dir)
    }

    /// Every dataset schema some tenant exposes, once each.
    pub fn schemas(&self) -> Vec<Arc<DatasetSchema>> {
        let mut schemas = BTreeMap::new();
        for schema in self.tenants.values().flat_map(|t| t.datasets.values()) {
            schemas.entry(schema.name.clone()).or_insert_with(|| schema.clone());
        }
        schemas.into_values().collect()
    }

    /// Puts the versions start-up recorded in place of the provisional ones. Only while the
    /// registry is not shared yet (start-up).
    pub fn set_schema_versions(&mut self, catalog: SchemaCatalog) {
        let catalog: BTreeMap<DatasetName, Arc<DatasetVersions>> =
            catalog.into_iter().map(|(name, versions)| (name, Arc::new(versions))).collect();
        for tenant in self.tenants.values_mut() {
            let tenant = Arc::get_mut(tenant).expect("the registry is not shared during start-up");
            for (name, versions) in tenant.versions.iter_mut() {
                if let Some(recorded) = catalog.get(name) {
                    *versions = recorded.clone();
                }
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<&Arc<Tenant>> {
        self.tenants.get(id)
    }

    pub fn tenants(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.tenants.values()
    }

    /// The tenant owning signing key `kid`, and that key.
    pub fn key(&self, kid: &str) -> Option<(&Arc<Tenant>, &SigningKey)> {
        let (tenant, index) = self.kids.get(kid)?;
        let tenant = self.tenants.get(tenant)?;
        Some((tenant, &tenant.keys[*index]))
    }
}
