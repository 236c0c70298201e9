//! Delta Sharing (the open protocol of delta-io/delta-sharing): what a principal's share holds,
//! the versions of its tables, and the protocol's descriptions of them.
//!
//! A principal's **share** is named after the principal; it has one **schema**, named after the
//! tenant, and a **table** per dataset the principal is granted. A table **version** is a
//! published full Parquet export of the whole dataset by that principal (see [`versions`]): its
//! files are the export's shards, already cut with the principal's row filter, column policy and
//! schema pin, sealed at the export's snapshot.

pub mod changes;
pub mod predicate;
mod protocol;
mod versions;

use sha2::{Digest, Sha256};

pub use changes::ChangeFile;
pub use protocol::{FileAction, FileKind, TableMetadata, file_stats, schema_string};
pub use versions::{
    FAILOVER_SKIP, NewVersion, ShareVersion, VersionError, Which, change_range, file_diff, record_version, resolve,
    version_at_or_after,
};

use crate::auth::Caller;
use crate::tenants::DatasetName;

/// The share, schema and tables `caller` may read. Anything else answers like a missing one.
pub struct Share<'a> {
    caller: &'a Caller,
}

impl<'a> Share<'a> {
    pub fn of(caller: &'a Caller) -> Self {
        Share { caller }
    }

    pub fn name(&self) -> &'a str {
        self.caller.principal.id.as_str()
    }

    /// The share's one schema: the tenant's id.
    pub fn schema(&self) -> &'a str {
        self.caller.tenant.id.as_str()
    }

    /// A stable id, the same for every request and process.
    pub fn id(&self) -> String {
        stable_id(&[self.schema(), self.name()])
    }

    /// Whether `share` (and `schema`, when given) is this one.
    pub fn is(&self, share: &str, schema: Option<&str>) -> bool {
        share == self.name() && schema.is_none_or(|s| s == self.schema())
    }

    /// The tables, in name order: the datasets the principal is granted.
    pub fn tables(&self) -> Vec<&'a DatasetName> {
        let (tenant, principal) = (&self.caller.tenant, &self.caller.principal);
        tenant
            .datasets
            .keys()
            .filter(|name| principal.is_granted(name) && tenant.served_schema(name.as_str(), principal).is_some())
            .collect()
    }

    /// The table `share.schema.table`, if the caller may read it.
    pub fn table(&self, share: &str, schema: &str, table: &str) -> Option<&'a DatasetName> {
        if !self.is(share, Some(schema)) {
            return None;
        }
        self.tables().into_iter().find(|name| name.as_str() == table)
    }

    /// A table's stable id.
    pub fn table_id(&self, table: &DatasetName) -> String {
        stable_id(&[self.schema(), self.name(), table.as_str()])
    }
}

/// A UUID-shaped id drawn from the sha256 of `parts` (distinct for distinct parts).
fn stable_id(parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(part.as_bytes());
        hasher.update([0]);
    }
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid().to_string()
}
