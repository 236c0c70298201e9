//! The ground floor: the words every part of exportd speaks about a dataset — identifiers,
//! a dataset's schema and column types, a field's value, an output column, the rules a column
//! policy applies and the keyed hash behind `hash`. It imports nothing of the product, so any
//! module may use it without an import running back up.

mod cell;
mod column;
mod hasher;
mod names;
mod rule;
mod schema;

use sha2::{Digest, Sha256};

pub use cell::Cell;
pub use column::OutputColumn;
pub use hasher::{ColumnHasher, HashPads};
pub use names::{ColumnName, DatasetName, PrincipalId, TenantId};
pub use rule::{ColumnRule, MAX_TRUNCATE};
pub use schema::{Column, ColumnType, DatasetSchema};

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
