//! Turns on the CPU for work whose cost a request chooses (a Delta Sharing query or change
//! listing: judging predicate hints against every file of a version, signing a link per file):
//! one at a time per tenant, and all tenants' together on at most all cores but one, so requests that cost little — another tenant's, the
//! health check — always find a core. Turns are taken in arrival order, each tenant's one at a
//! time, so a tenant flooding heavy requests waits behind itself, not others behind it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Rejection;
use crate::tenants::{Registry, TenantId};

/// How long a request waits for its tenant's turn before it is refused (429).
const WAIT_FOR_TURN: Duration = Duration::from_secs(10);

pub struct CpuTurns {
    cores: Arc<Semaphore>,
    tenants: HashMap<TenantId, Arc<Semaphore>>,
}

/// A turn: held while the work runs (moved into the blocking task doing it).
pub struct CpuTurn {
    _tenant: OwnedSemaphorePermit,
    _core: OwnedSemaphorePermit,
}

impl CpuTurns {
    pub fn new(registry: &Registry) -> CpuTurns {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        CpuTurns {
            cores: Arc::new(Semaphore::new(cores.saturating_sub(1).max(1))),
            tenants: registry.tenants().map(|t| (t.id.clone(), Arc::new(Semaphore::new(1)))).collect(),
        }
    }

    /// Waits for the tenant's turn, then for a core; refused after [`WAIT_FOR_TURN`].
    pub async fn turn(&self, tenant: &TenantId) -> Result<CpuTurn, Rejection> {
        let Some(own) = self.tenants.get(tenant) else { return Err(Rejection::Concurrency) };
        let waited = tokio::time::timeout(WAIT_FOR_TURN, async {
            let own = own.clone().acquire_owned().await.expect("never closed");
            let core = self.cores.clone().acquire_owned().await.expect("never closed");
            CpuTurn { _tenant: own, _core: core }
        });
        waited.await.map_err(|_| Rejection::Concurrency)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tenant_waits_behind_itself_not_behind_others() {
        let registry = Registry::load(&std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tenants")).unwrap();
        let turns = CpuTurns::new(&registry);
        let (acme, globex) = (TenantId::parse("acme").unwrap(), TenantId::parse("globex").unwrap());
        let held = turns.turn(&acme).await.unwrap();
        // acme's second request waits for its first; globex's goes ahead if a core is free.
        let second = tokio::time::timeout(Duration::from_millis(50), turns.turn(&acme)).await;
        assert!(second.is_err(), "acme's second turn waits for its first");
        if turns.cores.available_permits() > 0 {
            assert!(tokio::time::timeout(Duration::from_millis(50), turns.turn(&globex)).await.is_ok());
        }
        drop(held);
        assert!(tokio::time::timeout(Duration::from_millis(50), turns.turn(&acme)).await.is_ok());
    }
}
