//! The table of receiver buffers the copy engine may write to.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::region::Region;

use super::super::PeerIndex;

/// Peer regions, indexed by [`PeerIndex`]. The poster adds and removes
/// entries (rarely); the engine keeps a private copy and refreshes it only
/// when [`PeerTable::version`] changed, so the per-op path takes no lock.
#[derive(Debug, Default)]
pub(super) struct PeerTable {
    version: AtomicU64,
    regions: RwLock<Vec<Option<Arc<Region>>>>,
}

impl PeerTable {
    /// Appends `region` and returns its index (indices are never reused, so
    /// an op addressed to a disconnected peer can never hit a newer one).
    pub(super) fn add(&self, region: Arc<Region>) -> Option<PeerIndex> {
        let mut regions = self.regions.write();
        let index = PeerIndex::try_from(regions.len()).ok()?;
        regions.push(Some(region));
        self.bump();
        Some(index)
    }

    /// Removes peer `index`; returns whether it was connected.
    pub(super) fn remove(&self, index: PeerIndex) -> bool {
        let mut regions = self.regions.write();
        let removed = regions
            .get_mut(index as usize)
            .and_then(|slot| slot.take())
            .is_some();
        if removed {
            self.bump();
        }
        removed
    }

    fn bump(&self) {
        // Release: pairs with the engine's Acquire load in `refresh`; the
        // poster bumps before it pushes any op that uses the new entry, and
        // the engine loads the version after it acquired that op from the
        // submission ring, so it sees this bump (or a later one).
        self.version.fetch_add(1, Ordering::Release);
    }

    /// Refreshes the engine's private copy `local` if the table changed since
    /// `seen`.
    pub(super) fn refresh(&self, seen: &mut u64, local: &mut Vec<Option<Arc<Region>>>) {
        // Acquire: pairs with the Release in `bump` (see there).
        let now = self.version.load(Ordering::Acquire);
        if now != *seen {
            let regions = self.regions.read();
            local.clone_from(&regions);
            *seen = now;
        }
    }
}
