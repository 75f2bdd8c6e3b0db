//! Dropping references: the slot a last reference frees, and a consuming
//! decoder's release (a method group of [`ReceiverCore`]).

use super::super::grants::Revoked;
use super::super::keys::Unref;
use super::ReceiverCore;

impl ReceiverCore {
    /// Frees the slot of a dropped last reference. Returns true if a slot
    /// was freed.
    pub(super) fn release(&mut self, u: Unref) -> bool {
        match u {
            Unref::Freed(slot) => {
                self.free_slot(slot);
                true
            }
            Unref::Held | Unref::NotHeld => false,
        }
    }

    fn free_slot(&mut self, slot: u32) {
        if self.grants.revoke(slot) == Revoked::Deferred {
            // A TCP read is landing in it: the data thread hands it back
            // (`free_deferred`) once that read returned.
            return;
        }
        self.slots.free_one(slot);
        self.ledger.free(1);
    }

    /// Drops one reference of each copy in `held` (a consuming decoder's
    /// release); true if capacity was freed.
    pub(super) fn consume_refs(&mut self, held: Vec<(String, u64)>) -> bool {
        let mut freed = false;
        for (key, gen) in held {
            let u = self.keys.unref_gen(&key, gen);
            freed |= self.release(u);
        }
        freed
    }
}
