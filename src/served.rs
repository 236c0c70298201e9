//! What one principal is served of one dataset: the one place that decides it. Every channel —
//! export files and their manifests, feed pages, incremental exports, change files, Delta
//! Sharing, estimates, the schema endpoint, deliveries — asks a [`ServedView`] for the schema
//! version, column policy, row filter, output columns, key order and fingerprints it serves,
//! and for nothing else, so a new channel or a new per-partner rule is one change here.

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::dataset::{ColumnHasher, DatasetName, DatasetSchema, OutputColumn};
use crate::masking::ColumnPolicy;
use crate::records::KeyOrder;
use crate::schemas::{DatasetVersions, SchemaStamp, ServedSchema, served_columns, served_sha256};
use crate::tenants::{Principal, Tenant};

/// Why a principal is served nothing of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotServed {
    /// The tenant exposes no such dataset (a foreign dataset looks the same).
    #[error("no such dataset")]
    NoSuchDataset,
    #[error("the dataset is not granted to this principal")]
    NotGranted,
}

/// Why something cut for a principal earlier (an export, a version) is no longer what it is
/// served: its files, keys, totals and checksums would show what it may no longer see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewChanged {
    RowFilter,
    ColumnPolicy,
}

/// One principal's view of one dataset.
#[derive(Debug, Clone, Copy)]
pub struct ServedView<'a> {
    pub dataset: &'a Arc<DatasetSchema>,
    /// The schema version the principal's pin names, else the current one.
    pub schema: &'a ServedSchema,
    versions: &'a DatasetVersions,
    pub policy: Option<&'a ColumnPolicy>,
    principal: &'a Principal,
}

impl<'a> ServedView<'a> {
    /// The view of `dataset` for `principal`, if the tenant exposes it and grants it.
    pub fn of(tenant: &'a Tenant, principal: &'a Principal, dataset: &str) -> Result<ServedView<'a>, NotServed> {
        let view = ServedView::exposed(tenant, principal, dataset)?;
        if !principal.is_granted(&view.dataset.name) {
            return Err(NotServed::NotGranted);
        }
        Ok(view)
    }

    /// The view of an exposed dataset whatever the grant (writes go by the tenant's grant
    /// rules, not the principal's reading ones).
    pub fn exposed(tenant: &'a Tenant, principal: &'a Principal, dataset: &str) -> Result<ServedView<'a>, NotServed> {
        let schema = tenant.dataset(dataset).ok_or(NotServed::NoSuchDataset)?;
        let versions = tenant.versions(dataset).ok_or(NotServed::NoSuchDataset)?;
        let name = schema.name.as_str();
        Ok(ServedView {
            dataset: schema,
            schema: versions.served(principal.schema_pin(name)),
            versions,
            policy: principal.column_policy(name),
            principal,
        })
    }

    pub fn name(&self) -> &'a DatasetName {
        &self.dataset.name
    }

    /// The row filter as exports and cursors freeze it (`{}` for none).
    pub fn row_filter(&self) -> Value {
        Value::Object(self.row_filter_fields())
    }

    /// Its fields: column → the value a record must hold.
    pub fn row_filter_fields(&self) -> Map<String, Value> {
        self.principal.row_filter.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    /// The column policy's fingerprint, as exports and cursors freeze it.
    pub fn policy_fingerprint(&self) -> Option<&'a str> {
        self.policy.map(ColumnPolicy::fingerprint)
    }

    /// The order records come in, and what positions in it are made of.
    pub fn key_order(&self) -> KeyOrder<'a> {
        self.policy.map_or(KeyOrder::Key, ColumnPolicy::key_order)
    }

    /// The partner's key for `hash` columns, if its policy hashes any.
    pub fn hasher(&self) -> Option<&'a ColumnHasher> {
        self.policy.and_then(ColumnPolicy::hasher)
    }

    /// Whether stored records must be projected onto the served schema (a pinned older major,
    /// or fields no served version declares).
    pub fn projects(&self) -> bool {
        self.versions.projects(self.schema)
    }

    /// Every column as the principal receives it: the key first, dropped ones missing, masked
    /// ones marked, columns its pinned version lost retired.
    pub fn columns(&self) -> Vec<OutputColumn> {
        served_columns(self.schema, self.policy)
    }

    /// The served schema's sha256, over only what the principal is served.
    pub fn schema_sha256(&self) -> String {
        served_sha256(self.schema, self.policy)
    }

    /// The dataset's current schema version (what an unpinned principal receives).
    pub fn current_version(&self) -> crate::schemas::SchemaVersion {
        self.versions.current.version
    }

    /// The version and sha256 every page and file names.
    pub fn stamp(&self) -> SchemaStamp {
        self.schema.stamp_for(self.policy)
    }

    /// Whether something cut under `row_filter` and `policy_fingerprint` is still what this
    /// view serves.
    pub fn check_cut(&self, row_filter: &Value, policy_fingerprint: Option<&str>) -> Result<(), ViewChanged> {
        if self.row_filter() != *row_filter {
            return Err(ViewChanged::RowFilter);
        }
        if self.policy_fingerprint() != policy_fingerprint {
            return Err(ViewChanged::ColumnPolicy);
        }
        Ok(())
    }
}
