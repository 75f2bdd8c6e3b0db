//! The receiver's key table: which key lives in which slot, who holds it, and
//! whether its bytes are known to be written.
//!
//! A key is held by *references*: the request that allocated it, every request
//! that was answered "already sent" for it (dedup pins it), and anonymous
//! allocations. Decoders consume references (`Receiver::get` claims one as a
//! borrow, `remove` drops one). The slot is freed when the last reference goes.

use std::collections::HashMap;

/// One key's entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyEntry {
    /// Slot index in the receive buffer.
    pub slot: u32,
    /// References held (requests, anonymous allocation, decoder claims).
    pub refs: u32,
    /// References currently claimed by live `ChunkRef` borrows (`<= refs`).
    pub borrowed: u32,
    /// The key's bytes are known to be in place (its writer finished).
    pub ready: bool,
    /// Token count of this chunk (short last chunk) if known.
    pub tokens: Option<u32>,
    /// Generation: distinguishes this entry from an earlier entry of the same
    /// key that was dropped, so a stale holder cannot unref the new one.
    pub gen: u64,
}

/// Outcome of dropping one reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unref {
    /// Other references remain.
    Held,
    /// That was the last reference: the slot is free to release.
    Freed(u32),
    /// No such key, or every remaining reference is borrowed.
    NotHeld,
}

/// Map from key to entry.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeyTable {
    map: HashMap<String, KeyEntry>,
    next_gen: u64,
}

impl KeyTable {
    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Looks a key up.
    pub fn get(&self, key: &str) -> Option<&KeyEntry> {
        self.map.get(key)
    }

    /// Inserts a freshly allocated key with one reference; returns its
    /// generation.
    pub fn insert_new(&mut self, key: &str, slot: u32, ready: bool, tokens: Option<u32>) -> u64 {
        self.next_gen += 1;
        let gen = self.next_gen;
        self.map.insert(
            key.to_owned(),
            KeyEntry {
                slot,
                refs: 1,
                borrowed: 0,
                ready,
                tokens,
                gen,
            },
        );
        gen
    }

    /// Adds one reference to an existing key (dedup pin). Returns its slot and
    /// generation.
    pub fn pin(&mut self, key: &str) -> Option<(u32, u64)> {
        let e = self.map.get_mut(key)?;
        e.refs = e.refs.saturating_add(1);
        Some((e.slot, e.gen))
    }

    /// Removes the entry of generation `gen` outright (its writer failed, so
    /// its bytes will never be complete), whatever references remain.
    /// Returns its slot.
    pub fn evict(&mut self, key: &str, gen: u64) -> Option<u32> {
        match self.map.get(key) {
            Some(e) if e.gen == gen => self.map.remove(key).map(|e| e.slot),
            _ => None,
        }
    }

    /// Drops one reference of the entry of generation `gen` (a request's own
    /// reference); a different or missing generation is `NotHeld`.
    pub fn unref_gen(&mut self, key: &str, gen: u64) -> Unref {
        match self.map.get(key) {
            Some(e) if e.gen == gen => self.unref(key),
            _ => Unref::NotHeld,
        }
    }

    /// Marks a key's bytes as written.
    pub fn mark_ready(&mut self, key: &str) {
        if let Some(e) = self.map.get_mut(key) {
            e.ready = true;
        }
    }

    /// Drops one unborrowed reference.
    pub fn unref(&mut self, key: &str) -> Unref {
        let Some(e) = self.map.get_mut(key) else {
            return Unref::NotHeld;
        };
        if e.refs <= e.borrowed {
            return Unref::NotHeld;
        }
        e.refs -= 1;
        if e.refs == 0 {
            let slot = e.slot;
            self.map.remove(key);
            Unref::Freed(slot)
        } else {
            Unref::Held
        }
    }

    /// Claims one reference as a borrow if the key is ready and has an
    /// unclaimed reference. Returns `(slot, tokens)`.
    pub fn borrow(&mut self, key: &str) -> Option<(u32, Option<u32>)> {
        let e = self.map.get_mut(key)?;
        if !e.ready || e.borrowed >= e.refs {
            return None;
        }
        e.borrowed += 1;
        Some((e.slot, e.tokens))
    }

    /// Ends a borrow, consuming the reference it claimed.
    pub fn end_borrow(&mut self, key: &str) -> Unref {
        let Some(e) = self.map.get_mut(key) else {
            return Unref::NotHeld;
        };
        if e.borrowed == 0 {
            return Unref::NotHeld;
        }
        e.borrowed -= 1;
        e.refs -= 1;
        if e.refs == 0 {
            let slot = e.slot;
            self.map.remove(key);
            Unref::Freed(slot)
        } else {
            Unref::Held
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refcounts_borrow_and_free() {
        let mut t = KeyTable::default();
        t.insert_new("a", 7, false, None);
        assert_eq!(t.borrow("a"), None, "not ready yet");
        t.mark_ready("a");
        assert_eq!(t.pin("a"), Some((7, 1)));
        assert_eq!(t.borrow("a"), Some((7, None)));
        assert_eq!(t.borrow("a"), Some((7, None)));
        assert_eq!(t.borrow("a"), None, "both references claimed");
        assert_eq!(
            t.unref("a"),
            Unref::NotHeld,
            "borrowed references cannot be removed"
        );
        assert_eq!(t.end_borrow("a"), Unref::Held);
        assert_eq!(t.end_borrow("a"), Unref::Freed(7));
        assert!(t.is_empty());
        assert_eq!(t.end_borrow("a"), Unref::NotHeld);
        assert_eq!(t.unref("zz"), Unref::NotHeld);
    }

    #[test]
    fn generations_keep_stale_holders_off_new_entries() {
        let mut t = KeyTable::default();
        let g1 = t.insert_new("k", 1, true, None);
        assert_eq!(t.evict("k", g1), Some(1));
        let g2 = t.insert_new("k", 2, true, None);
        assert_ne!(g1, g2);
        assert_eq!(t.unref_gen("k", g1), Unref::NotHeld);
        assert_eq!(t.evict("k", g1), None);
        assert_eq!(t.unref_gen("k", g2), Unref::Freed(2));
    }
}
