//! One store, one deployment. A directory or bucket prefix records the deployment that first
//! used it in `_exportd/owner.json`; a process of another deployment refuses to start against
//! it, because two deployments sharing a store would each take the other's files for junk.
//! The id is the database's own (`deployment` table), so every process of one deployment —
//! API and workers on any host — agrees on it, and a second database (a tour, a test run, a
//! staging copy) is a different owner even on the same PostgreSQL server.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::{ArtifactStore, ObjectKey, StoreError};

/// Where the owner is recorded, inside the store (never a tenant directory: tenant ids are
/// lowercase letters, digits and `-`).
pub const MARKER: &str = "_exportd/owner.json";

/// Who a deployment is, as its database says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployment {
    /// The `deployment` row's id: the identity that is compared.
    pub id: Uuid,
    /// The database's name and its cluster's system identifier, for the people who read the
    /// marker or the refusal.
    pub database: String,
    pub system_identifier: String,
}

impl Deployment {
    /// This database's deployment.
    pub async fn of(pool: &sqlx::PgPool) -> sqlx::Result<Deployment> {
        let row = sqlx::query!(
            r#"SELECT d.id, current_database() AS "database!", s.system_identifier::text AS "system_identifier!"
               FROM deployment d, pg_control_system() s"#
        )
        .fetch_one(pool)
        .await?;
        Ok(Deployment { id: row.id, database: row.database, system_identifier: row.system_identifier })
    }
}

/// The marker's contents.
#[derive(Debug, Serialize, Deserialize)]
struct Marker {
    owner: Deployment,
    #[serde(with = "time::serde::rfc3339")]
    claimed_at: OffsetDateTime,
}

#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    #[error(
        "{store} belongs to another exportd deployment (database `{}` on the PostgreSQL system {}, deployment {}); \
         this process is deployment {} (database `{}`). Two deployments sharing one store would delete each other's \
         files. Give this deployment a store of its own (EXPORTD_DATA_DIR=<another directory>, or EXPORTD_STORAGE=\
         file:///<directory> or s3://<bucket>/<another prefix>). Only if that other deployment is gone for good and \
         this one should take its store over, delete `{MARKER}` in that store: its files stay where they are \
         (exportd never deletes the files of exports it does not know).",
        owner.database, owner.system_identifier, owner.id, ours.id, ours.database
    )]
    Foreign { store: String, owner: Deployment, ours: Deployment },
    #[error("{store}: `{MARKER}` is not an owner record ({reason}); move it away and start again")]
    Unreadable { store: String, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ArtifactStore {
    /// Records `us` as the store's owner if it has none, and checks that it is `us` otherwise;
    /// `true` when this call claimed it (it had no owner). Two deployments claiming a new store at
    /// the same instant: both read the marker back after writing, so the one whose write lost
    /// refuses.
    pub async fn claim(&self, us: &Deployment) -> Result<bool, OwnershipError> {
        let key = ObjectKey::parse(MARKER).expect("a valid key");
        let mut claimed = false;
        let recorded = match self.get_small(&key).await? {
            Some(bytes) => bytes,
            None => {
                let marker = Marker { owner: us.clone(), claimed_at: OffsetDateTime::now_utc() };
                let json = serde_json::to_vec_pretty(&marker).expect("the marker serializes");
                if self.create_small(&key, json).await? {
                    tracing::info!(store = self.describe(), deployment = %us.id, "claimed the artifact store");
                    claimed = true;
                }
                self.get_small(&key).await?.ok_or_else(|| StoreError::Missing(MARKER.into()))?
            }
        };
        let marker: Marker = serde_json::from_slice(&recorded)
            .map_err(|e| OwnershipError::Unreadable { store: self.describe(), reason: e.to_string() })?;
        if marker.owner.id == us.id {
            Ok(claimed)
        } else {
            Err(OwnershipError::Foreign { store: self.describe(), owner: marker.owner, ours: us.clone() })
        }
    }
}
