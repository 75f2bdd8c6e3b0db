//! [`RecentMap`](crate::recent::RecentMap): a map that remembers only its most recently added keys,
//! within a budget in bytes, for per-request bookkeeping that must stay
//! bounded however many requests — and however long their ids — a
//! long-running process sees (finished request ids, notification counts).
//!
//! Each key's bytes are stored once (an `Arc<str>` shared by the map and the
//! insertion order), and each entry is charged its key length plus
//! [`RecentMap::ENTRY_OVERHEAD`](crate::recent::RecentMap::ENTRY_OVERHEAD) against the budget, so 4 KiB ids are
//! forgotten 64 times sooner than 64-byte ones instead of costing 64 times
//! the memory.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;

/// A map of string keys that forgets the oldest keys (in insertion order)
/// once their bytes exceed a budget.
///
/// Keys are hashed once per call (SipHash, seeded per map, so a peer cannot
/// aim at collisions) and the table is keyed by that 64-bit hash; the stored
/// key is compared on every hit. Two keys with the same hash cannot both be
/// remembered: the newer replaces the older (forgotten early — the only
/// effect, and with 64-bit hashes practically never).
#[derive(Debug, Clone)]
pub struct RecentMap<V> {
    seed: RandomState,
    map: HashMap<u64, (Arc<str>, V), BuildHasherDefault<IdentityHasher>>,
    order: VecDeque<(u64, Arc<str>)>,
    bytes: usize,
    max_bytes: usize,
}

/// The table's keys are already hashes.
#[derive(Debug, Default, Clone, Copy)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

impl<V> RecentMap<V> {
    /// Bytes charged per entry besides its key: the hash-map slot, the
    /// order slot, the `Arc` header and the value.
    pub const ENTRY_OVERHEAD: usize =
        64 + 2 * std::mem::size_of::<(u64, Arc<str>)>() + std::mem::size_of::<V>();

    /// An empty map holding at most `max_bytes` of entries (it always keeps
    /// the newest one, whatever its size).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            seed: RandomState::new(),
            map: HashMap::default(),
            order: VecDeque::new(),
            bytes: 0,
            max_bytes,
        }
    }

    fn cost(key: &str) -> usize {
        key.len() + Self::ENTRY_OVERHEAD
    }

    fn hash(&self, key: &str) -> u64 {
        self.seed.hash_one(key)
    }

    /// The value of `key`, if remembered.
    pub fn get(&self, key: &str) -> Option<&V> {
        match self.map.get(&self.hash(key)) {
            Some((k, v)) if &**k == key => Some(v),
            _ => None,
        }
    }

    /// Keys remembered.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes charged for what is remembered, removed keys that have not
    /// aged out included (at most the budget, unless a single newest entry
    /// is larger).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Forgets `key`; returns its value. O(1): the key's place in the
    /// insertion order (and its charge, since it still holds the key's
    /// bytes) stays until it ages out.
    pub fn remove(&mut self, key: &str) -> Option<V> {
        let h = self.hash(key);
        match self.map.get(&h) {
            Some((k, _)) if &**k == key => self.map.remove(&h).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The value of `key`, inserting `make()` if absent (forgetting the
    /// oldest keys while the budget would be exceeded).
    pub fn get_or_insert_with(&mut self, key: &str, make: impl FnOnce() -> V) -> &mut V {
        let h = self.hash(key);
        let present = self.map.get(&h).is_some_and(|(k, _)| &**k == key);
        if !present {
            let cost = Self::cost(key);
            while self.bytes + cost > self.max_bytes {
                let Some((oh, old)) = self.order.pop_front() else {
                    break;
                };
                self.bytes -= Self::cost(&old);
                // The entry is this order slot's only if it is the same
                // allocation: a key removed and added again has a newer slot.
                if self.map.get(&oh).is_some_and(|(k, _)| Arc::ptr_eq(k, &old)) {
                    self.map.remove(&oh);
                }
            }
            let k: Arc<str> = Arc::from(key);
            self.order.push_back((h, Arc::clone(&k)));
            self.bytes += cost;
            // A different key with the same hash is replaced (see the type docs).
            self.map.insert(h, (k, make()));
        }
        match self.map.get_mut(&h) {
            Some((_, v)) => v,
            None => unreachable!("inserted above"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(entries: usize, key_len: usize) -> usize {
        entries * (key_len + RecentMap::<u32>::ENTRY_OVERHEAD)
    }

    #[test]
    fn keeps_values_and_forgets_the_oldest_keys() {
        let mut m = RecentMap::<u32>::new(budget(2, 1));
        *m.get_or_insert_with("a", || 0) += 1;
        *m.get_or_insert_with("a", || 0) += 1;
        assert_eq!(m.get("a"), Some(&2), "an existing key keeps its value");
        m.get_or_insert_with("b", || 7);
        m.get_or_insert_with("c", || 9);
        assert_eq!(m.get("a"), None, "the oldest key was forgotten");
        assert_eq!((m.get("b"), m.get("c"), m.len()), (Some(&7), Some(&9), 2));
    }

    #[test]
    fn the_budget_is_in_bytes_so_long_keys_are_forgotten_sooner() {
        let max = budget(100, 8);
        let mut m = RecentMap::<u32>::new(max);
        for i in 0..10_000 {
            m.get_or_insert_with(&format!("{i:0>4096}"), || i);
            assert!(m.bytes() <= max, "{} > {max}", m.bytes());
        }
        assert!(m.len() < 10, "4 KiB keys: only a few fit, got {}", m.len());
        assert_eq!(m.get(&format!("{:0>4096}", 9_999)), Some(&9_999));
        assert_eq!(m.remove(&format!("{:0>4096}", 9_999)), Some(9_999));
        assert_eq!(m.get(&format!("{:0>4096}", 9_999)), None);
        m.get_or_insert_with("again", || 1);
        m.remove("again");
        m.get_or_insert_with("again", || 2);
        m.get_or_insert_with("again", || 3);
        assert_eq!(m.get("again"), Some(&2), "re-added after a removal");
        for i in 0..1_000 {
            m.get_or_insert_with(&format!("{i:08}"), || i);
        }
        assert_eq!(m.len(), 100, "short keys: the budget holds 100");
        assert!(m.bytes() <= max);
    }
}
