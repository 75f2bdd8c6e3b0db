//! The receiver's key table: which key lives in which slot, who holds it, and
//! whether its bytes are known to be written.
//!
//! A key may have more than one *copy*, each in its own slot with its own
//! generation, references and `ready` flag: a request is only told "already
//! sent" for a copy whose bytes are written (`ready`), so two requests that
//! first-write the same key concurrently each get — and write — their own
//! copy.
//!
//! A copy is held by *references*: the request that allocated it, every
//! request that was answered "already sent" for it (dedup pins it), and
//! anonymous allocations. Decoders consume references (`Receiver::get` claims
//! one as a borrow, `remove` drops one). The slot is freed when the last
//! reference goes and no quarantine holds it.
//!
//! A copy whose writer failed is *detached*: nobody new pins or borrows it,
//! but it keeps its slot until its remaining references go and, if the failed
//! writer's writes may still land, until its quarantine ends.

use std::collections::HashMap;

use smallvec::SmallVec;

/// One copy of a key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyEntry {
    /// Slot index in the receive buffer.
    pub slot: u32,
    /// References held (requests, anonymous allocation, decoder claims).
    pub refs: u32,
    /// References currently claimed by live `ChunkRef` borrows (`<= refs`).
    pub borrowed: u32,
    /// The copy's bytes are known to be in place (its writer finished).
    pub ready: bool,
    /// Token count of this chunk (short last chunk) if known.
    pub tokens: Option<u32>,
    /// Length of the chunk in bytes, as the request that allocated the
    /// copy sized it.
    pub len: u64,
    /// Generation: distinguishes this copy from every other copy of the same
    /// key, earlier or concurrent, so a holder only ever touches its own.
    pub gen: u64,
    /// The writer failed: the copy is no longer found by pins or borrows.
    pub detached: bool,
    /// A failed writer's writes may still land: the slot is kept (even with
    /// no reference left) until [`KeyTable::unquarantine`].
    pub quarantined: bool,
}

impl KeyEntry {
    /// Whether a new request may be answered "already sent" for this copy.
    fn pinnable(&self) -> bool {
        self.ready && !self.detached
    }

    /// Nothing keeps the slot any more.
    fn dead(&self) -> bool {
        self.refs == 0 && !self.quarantined
    }
}

/// A decoder borrow: which copy it claimed a reference of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Borrowed {
    /// Slot index in the receive buffer.
    pub slot: u32,
    /// Token count of the chunk if known.
    pub tokens: Option<u32>,
    /// Length of the chunk in bytes.
    pub len: u64,
    /// Generation of the copy (pass it back to end the borrow).
    pub gen: u64,
}

/// Outcome of dropping one reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unref {
    /// Other references (or a quarantine) remain.
    Held,
    /// That was the last reference: the slot is free to release.
    Freed(u32),
    /// No such key or copy, or every remaining reference is borrowed.
    NotHeld,
}

/// Map from key to its copies (oldest first). Almost every key has exactly
/// one copy, so it is stored inline: no allocation per key beyond the
/// map's own.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeyTable {
    map: HashMap<String, SmallVec<[KeyEntry; 1]>>,
    /// Copies held, detached ones included.
    copies: usize,
    /// Copies held that are not detached.
    live: usize,
    next_gen: u64,
}

impl KeyTable {
    /// Number of copies held that are readable or being written (detached
    /// copies are left out: they only wait for their last holder).
    pub fn len(&self) -> usize {
        self.live
    }

    /// True when no copy is readable or being written ([`KeyTable::len`]).
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Number of copies held (each holds one slot), detached ones included.
    pub fn copies(&self) -> usize {
        self.copies
    }

    /// The copy a decoder would read: the oldest ready copy, else the oldest
    /// copy not detached.
    pub fn get(&self, key: &str) -> Option<&KeyEntry> {
        let v = self.map.get(key)?;
        v.iter()
            .find(|e| e.pinnable())
            .or_else(|| v.iter().find(|e| !e.detached))
    }

    /// The copy of generation `gen`.
    pub fn get_gen(&self, key: &str, gen: u64) -> Option<&KeyEntry> {
        self.map.get(key)?.iter().find(|e| e.gen == gen)
    }

    /// True if a request asking for `key` as a chunk of `len` bytes now
    /// would be answered "already sent" ([`KeyTable::pin`] would succeed).
    pub fn pinnable(&self, key: &str, len: u64) -> bool {
        self.map
            .get(key)
            .is_some_and(|v| v.iter().any(|e| e.pinnable() && e.len == len))
    }

    /// Inserts a freshly allocated copy of `key`, a chunk of `len` bytes,
    /// with one reference, next to any copies already held; returns its
    /// generation.
    pub fn insert_new(
        &mut self,
        key: &str,
        slot: u32,
        ready: bool,
        tokens: Option<u32>,
        len: u64,
    ) -> u64 {
        self.next_gen += 1;
        let gen = self.next_gen;
        self.map.entry(key.to_owned()).or_default().push(KeyEntry {
            slot,
            refs: 1,
            borrowed: 0,
            ready,
            tokens,
            len,
            gen,
            detached: false,
            quarantined: false,
        });
        self.copies += 1;
        self.live += 1;
        gen
    }

    /// Adds one reference to the oldest *ready* copy of `key` that is a
    /// chunk of `len` bytes (dedup pin). A copy still being written is never
    /// pinned: its bytes are not known to be in place. Nor is a copy of
    /// another length: the asking request's decoder reads the chunk as
    /// `len` bytes, so it would read past the copy's bytes or fall short of
    /// them (the asking request then writes its own copy). Returns the
    /// copy's slot and generation.
    pub fn pin(&mut self, key: &str, len: u64) -> Option<(u32, u64)> {
        let e = self
            .map
            .get_mut(key)?
            .iter_mut()
            .find(|e| e.pinnable() && e.len == len)?;
        e.refs = e.refs.saturating_add(1);
        Some((e.slot, e.gen))
    }

    /// Detaches the copy of generation `gen` (its writer failed, so its
    /// bytes will never be complete): nobody new pins or borrows it, and
    /// the references others hold keep its slot until they go. With
    /// `quarantine`, the slot is kept even after the last reference, until
    /// [`KeyTable::unquarantine`]. Then drops the writer's own reference.
    pub fn evict(&mut self, key: &str, gen: u64, quarantine: bool) -> Unref {
        let Some(e) = self
            .map
            .get_mut(key)
            .and_then(|v| v.iter_mut().find(|e| e.gen == gen))
        else {
            return Unref::NotHeld;
        };
        if !e.detached {
            self.live -= 1;
        }
        e.detached = true;
        e.ready = false;
        e.quarantined = quarantine;
        self.unref_gen(key, gen)
    }

    /// Ends the quarantine of the copy of generation `gen`: its slot is freed
    /// now if no reference remains.
    pub fn unquarantine(&mut self, key: &str, gen: u64) -> Unref {
        let Some(e) = self.entry_mut(key, gen) else {
            return Unref::NotHeld;
        };
        e.quarantined = false;
        if e.dead() {
            self.remove_gen(key, gen)
        } else {
            Unref::Held
        }
    }

    /// Drops one unborrowed reference of the copy of generation `gen` (a
    /// request's own reference); a missing generation is `NotHeld`.
    pub fn unref_gen(&mut self, key: &str, gen: u64) -> Unref {
        let Some(e) = self.entry_mut(key, gen) else {
            return Unref::NotHeld;
        };
        if e.refs <= e.borrowed {
            return Unref::NotHeld;
        }
        e.refs -= 1;
        if e.dead() {
            self.remove_gen(key, gen)
        } else {
            Unref::Held
        }
    }

    /// Marks the copy of generation `gen` as written (its writer finished).
    /// A detached copy stays unready.
    pub fn mark_ready(&mut self, key: &str, gen: u64) {
        if let Some(e) = self.entry_mut(key, gen) {
            e.ready = !e.detached;
        }
    }

    /// Drops one unborrowed reference of `key` (decoder `remove`, or an
    /// LMCache sender's cancel after its request's tracking ended): from the
    /// copy a decoder would read ([`KeyTable::get`]) if it has one, else
    /// from any copy that has one.
    pub fn unref(&mut self, key: &str) -> Unref {
        let Some(v) = self.map.get(key) else {
            return Unref::NotHeld;
        };
        let free = |e: &&KeyEntry| e.refs > e.borrowed;
        let pick = v
            .iter()
            .filter(free)
            .find(|e| e.pinnable())
            .or_else(|| v.iter().filter(free).find(|e| !e.detached))
            .or_else(|| v.iter().find(free))
            .map(|e| e.gen);
        match pick {
            Some(gen) => self.unref_gen(key, gen),
            None => Unref::NotHeld,
        }
    }

    /// Claims one reference of the oldest ready copy of `key` that has an
    /// unclaimed reference, as a borrow.
    pub fn borrow(&mut self, key: &str) -> Option<Borrowed> {
        let e = self
            .map
            .get_mut(key)?
            .iter_mut()
            .find(|e| e.pinnable() && e.borrowed < e.refs)?;
        e.borrowed += 1;
        Some(Borrowed {
            slot: e.slot,
            tokens: e.tokens,
            len: e.len,
            gen: e.gen,
        })
    }

    /// Claims one unclaimed reference of the copy of generation `gen` as a
    /// borrow, if that copy is ready (its bytes are in place) and not
    /// detached. `None` otherwise: the caller gets no bytes of it.
    pub fn borrow_gen(&mut self, key: &str, gen: u64) -> Option<Borrowed> {
        let e = self.entry_mut(key, gen)?;
        if !e.pinnable() || e.borrowed >= e.refs {
            return None;
        }
        e.borrowed += 1;
        Some(Borrowed {
            slot: e.slot,
            tokens: e.tokens,
            len: e.len,
            gen: e.gen,
        })
    }

    /// Gives back a borrow of the copy of generation `gen` without
    /// consuming its reference (a [`KeyTable::borrow_gen`] rolled back).
    pub fn unborrow(&mut self, key: &str, gen: u64) {
        if let Some(e) = self.entry_mut(key, gen) {
            e.borrowed = e.borrowed.saturating_sub(1);
        }
    }

    /// Ends a borrow of the copy of generation `gen`, consuming the
    /// reference it claimed.
    pub fn end_borrow(&mut self, key: &str, gen: u64) -> Unref {
        let Some(e) = self.entry_mut(key, gen) else {
            return Unref::NotHeld;
        };
        if e.borrowed == 0 {
            return Unref::NotHeld;
        }
        e.borrowed -= 1;
        e.refs -= 1;
        if e.dead() {
            self.remove_gen(key, gen)
        } else {
            Unref::Held
        }
    }

    fn entry_mut(&mut self, key: &str, gen: u64) -> Option<&mut KeyEntry> {
        self.map.get_mut(key)?.iter_mut().find(|e| e.gen == gen)
    }

    /// Removes the copy of generation `gen`; returns its slot as `Freed`.
    fn remove_gen(&mut self, key: &str, gen: u64) -> Unref {
        let Some(v) = self.map.get_mut(key) else {
            return Unref::NotHeld;
        };
        let Some(i) = v.iter().position(|e| e.gen == gen) else {
            return Unref::NotHeld;
        };
        let e = v.remove(i);
        if v.is_empty() {
            self.map.remove(key);
        }
        self.copies -= 1;
        if !e.detached {
            self.live -= 1;
        }
        Unref::Freed(e.slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The length of every chunk of these tests.
    const LEN: u64 = 100;

    fn b(slot: u32, gen: u64) -> Option<Borrowed> {
        Some(Borrowed {
            slot,
            tokens: None,
            len: LEN,
            gen,
        })
    }

    #[test]
    fn refcounts_borrow_and_free() {
        let mut t = KeyTable::default();
        let g = t.insert_new("a", 7, false, None, LEN);
        assert_eq!(t.borrow("a"), None, "not ready yet");
        t.mark_ready("a", g);
        assert_eq!(t.pin("a", LEN), Some((7, g)));
        assert_eq!(t.borrow("a"), b(7, g));
        assert_eq!(t.borrow("a"), b(7, g));
        assert_eq!(t.borrow("a"), None, "both references claimed");
        assert_eq!(
            t.unref("a"),
            Unref::NotHeld,
            "borrowed references cannot be removed"
        );
        assert_eq!(t.end_borrow("a", g), Unref::Held);
        assert_eq!(t.end_borrow("a", g), Unref::Freed(7));
        assert!(t.is_empty());
        assert_eq!(t.end_borrow("a", g), Unref::NotHeld);
        assert_eq!(t.unref("zz"), Unref::NotHeld);
    }

    #[test]
    fn generations_keep_stale_holders_off_new_entries() {
        let mut t = KeyTable::default();
        let g1 = t.insert_new("k", 1, true, None, LEN);
        assert_eq!(t.evict("k", g1, false), Unref::Freed(1));
        let g2 = t.insert_new("k", 2, true, None, LEN);
        assert_ne!(g1, g2);
        assert_eq!(t.unref_gen("k", g1), Unref::NotHeld);
        assert_eq!(t.evict("k", g1, false), Unref::NotHeld);
        assert_eq!(t.unref_gen("k", g2), Unref::Freed(2));
    }

    #[test]
    fn a_copy_being_written_is_never_pinned() {
        let mut t = KeyTable::default();
        let g1 = t.insert_new("k", 1, false, None, LEN);
        assert!(!t.pinnable("k", LEN));
        assert_eq!(t.pin("k", LEN), None, "unready: no dedup");
        // The second writer gets its own copy, in its own slot.
        let g2 = t.insert_new("k", 2, false, None, LEN);
        assert_ne!(g1, g2);
        assert_eq!(t.len(), 2);
        t.mark_ready("k", g2);
        assert_eq!(t.pin("k", LEN), Some((2, g2)), "the written copy is pinned");
        assert_eq!(t.get("k").map(|e| e.gen), Some(g2), "readers see it");
        assert_eq!(t.get_gen("k", g1).map(|e| e.ready), Some(false));
        // Each copy is released on its own.
        assert_eq!(t.unref_gen("k", g1), Unref::Freed(1));
        assert_eq!(t.unref_gen("k", g2), Unref::Held);
        assert_eq!(t.unref_gen("k", g2), Unref::Freed(2));
        assert!(t.is_empty());
    }

    #[test]
    fn borrows_end_on_the_copy_they_claimed() {
        let mut t = KeyTable::default();
        let g1 = t.insert_new("k", 1, true, None, LEN);
        let g2 = t.insert_new("k", 2, true, None, LEN);
        assert_eq!(t.borrow("k"), b(1, g1), "oldest ready copy first");
        assert_eq!(t.borrow("k"), b(2, g2), "then the next with a reference");
        assert_eq!(t.borrow("k"), None);
        assert_eq!(t.end_borrow("k", g2), Unref::Freed(2));
        assert_eq!(t.get_gen("k", g1).map(|e| e.borrowed), Some(1));
        assert_eq!(t.end_borrow("k", g1), Unref::Freed(1));
    }

    #[test]
    fn an_evicted_copy_keeps_its_slot_while_others_hold_it() {
        let mut t = KeyTable::default();
        // Ready at allocation (LMCache semantics), pinned by another request.
        let g = t.insert_new("k", 3, true, None, LEN);
        assert_eq!(t.pin("k", LEN), Some((3, g)));
        assert_eq!(t.evict("k", g, false), Unref::Held, "the pin holds it");
        assert!(
            !t.pinnable("k", LEN) && t.pin("k", LEN).is_none(),
            "detached"
        );
        assert_eq!(t.borrow("k"), None, "its bytes are not whole");
        assert!(t.get("k").is_none());
        assert_eq!((t.len(), t.copies()), (0, 1), "the slot is still held");
        assert_eq!(t.unref_gen("k", g), Unref::Freed(3), "last reference");
        assert_eq!(t.copies(), 0);
    }

    #[test]
    fn quarantine_outlives_references_and_decoders_cannot_end_it() {
        let mut t = KeyTable::default();
        let g = t.insert_new("k", 4, true, None, LEN);
        t.pin("k", LEN);
        assert_eq!(t.evict("k", g, true), Unref::Held);
        assert_eq!(t.unref_gen("k", g), Unref::Held, "quarantined");
        assert_eq!(t.unref("k"), Unref::NotHeld, "no reference left to drop");
        assert_eq!(t.copies(), 1);
        assert_eq!(t.unquarantine("k", g), Unref::Freed(4));
        assert_eq!(t.unquarantine("k", g), Unref::NotHeld);
        // Quarantine ends first, the pin last.
        let g = t.insert_new("k", 5, true, None, LEN);
        t.pin("k", LEN);
        assert_eq!(t.evict("k", g, true), Unref::Held);
        assert_eq!(t.unquarantine("k", g), Unref::Held, "still pinned");
        assert_eq!(t.unref_gen("k", g), Unref::Freed(5));
        assert_eq!(t.copies(), 0);
    }

    #[test]
    fn decoder_remove_prefers_the_readable_copy() {
        let mut t = KeyTable::default();
        let g1 = t.insert_new("k", 1, false, None, LEN);
        let g2 = t.insert_new("k", 2, true, None, LEN);
        assert_eq!(t.unref("k"), Unref::Freed(2));
        assert!(t.get_gen("k", g2).is_none());
        assert_eq!(t.get("k").map(|e| e.gen), Some(g1), "unready copy left");
        assert_eq!(t.unref("k"), Unref::Freed(1));
        assert!(t.is_empty());
    }
}
