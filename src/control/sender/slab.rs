//! A slab of values indexed by a small [`Key`]: an index into a `Vec` and
//! the slot's generation, so the key of a removed value can never reach the
//! value a later insert puts into the same slot.
//!
//! The sender keeps its requests here: a [`Request`](super::Request) handle
//! carries its key, and every caller-side step (reserve, publish, cancel)
//! finds its request by index, not by hashing its `req_id`.

/// A slot index and the generation it was handed out with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Key {
    index: u32,
    gen: u32,
}

impl Key {
    /// The key in the low 63 bits of a word, or `None` for a slot index
    /// from 2^31 on (no slab gets there: 2^31 values would not fit in
    /// memory); for a ring entry that needs a tag bit.
    pub fn to_bits63(self) -> Option<u64> {
        (self.index < 1 << 31).then(|| (u64::from(self.index) << 32) | u64::from(self.gen))
    }

    /// The key [`to_bits63`](Self::to_bits63) packed.
    pub fn from_bits63(bits: u64) -> Key {
        Key {
            index: (bits >> 32) as u32,
            gen: bits as u32,
        }
    }

    /// The slot index (tests check that a slot was reused).
    #[cfg(test)]
    pub fn index(self) -> u32 {
        self.index
    }
}

#[derive(Debug)]
struct Entry<T> {
    /// Bumped at every removal; a key matches only the generation it got.
    gen: u32,
    val: Option<T>,
}

/// Values by [`Key`]. Grows to the most values held at once (plus the slots
/// retired after 2^32 reuses, see [`Slab::remove`]); a removed value's slot
/// is reused by a later insert.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    entries: Vec<Entry<T>>,
    /// Free slot indexes (reused last-freed first).
    free: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    /// Stores `val`; its key.
    #[cfg(test)]
    pub fn insert(&mut self, val: T) -> Key {
        self.insert_with(|_| val)
    }

    /// Stores the value `make` builds for its key; that key.
    pub fn insert_with(&mut self, make: impl FnOnce(Key) -> T) -> Key {
        if let Some(index) = self.free.pop() {
            let e = &mut self.entries[index as usize];
            let key = Key { index, gen: e.gen };
            e.val = Some(make(key));
            return key;
        }
        let key = Key {
            index: self.entries.len() as u32,
            gen: 0,
        };
        self.entries.push(Entry {
            gen: 0,
            val: Some(make(key)),
        });
        key
    }

    /// The value of `key` (`None` once it was removed, even if its slot
    /// holds a newer value).
    pub fn get(&self, key: Key) -> Option<&T> {
        self.entries
            .get(key.index as usize)
            .filter(|e| e.gen == key.gen)
            .and_then(|e| e.val.as_ref())
    }

    /// [`get`](Self::get), mutable.
    pub fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        self.entries
            .get_mut(key.index as usize)
            .filter(|e| e.gen == key.gen)
            .and_then(|e| e.val.as_mut())
    }

    /// Takes the value of `key` out and retires the key. A slot whose
    /// generation would wrap is never reused (so no key ever matches twice).
    pub fn remove(&mut self, key: Key) -> Option<T> {
        let e = self
            .entries
            .get_mut(key.index as usize)
            .filter(|e| e.gen == key.gen)?;
        let val = e.val.take()?;
        // On overflow the slot is retired for good: one slot per 2^32 reuses.
        if let Some(g) = e.gen.checked_add(1) {
            e.gen = g;
            self.free.push(key.index);
        }
        Some(val)
    }

    /// Every value with its key, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (Key, &T)> + '_ {
        self.entries.iter().enumerate().filter_map(|(i, e)| {
            let key = Key {
                index: i as u32,
                gen: e.gen,
            };
            e.val.as_ref().map(|v| (key, v))
        })
    }

    /// Every value.
    pub fn values(&self) -> impl Iterator<Item = &T> + '_ {
        self.entries.iter().filter_map(|e| e.val.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_key_never_reaches_the_value_reusing_its_slot() {
        let mut s = Slab::default();
        let a = s.insert("a");
        assert_eq!(s.get(a), Some(&"a"));
        assert_eq!(s.remove(a), Some("a"));
        let b = s.insert("b");
        assert_eq!(a.index, b.index, "the slot is reused");
        assert_eq!(s.get(a), None);
        assert_eq!(s.get_mut(a), None);
        assert_eq!(s.remove(a), None);
        assert_eq!(s.get(b), Some(&"b"));
        assert_eq!(
            s.iter().map(|(k, v)| (k, *v)).collect::<Vec<_>>(),
            [(b, "b")]
        );
    }

    #[test]
    fn a_slot_whose_generation_would_wrap_is_retired() {
        let mut s = Slab::default();
        let k = s.insert(1);
        s.entries[0].gen = u32::MAX;
        let old = Key {
            index: k.index,
            gen: u32::MAX,
        };
        assert_eq!(s.remove(old), Some(1));
        let n = s.insert(2);
        assert_ne!(n.index, old.index, "never reused");
        assert_eq!(s.get(old), None);
        assert_eq!(s.values().count(), 1);
    }

    #[test]
    fn many_inserts_and_removes_keep_every_live_key_exact() {
        let mut s = Slab::default();
        let mut live = Vec::new();
        let mut dead = Vec::new();
        for i in 0..1000u32 {
            live.push((s.insert(i), i));
            if i % 3 == 0 {
                let (k, v) = live.remove((i as usize * 7) % live.len());
                assert_eq!(s.remove(k), Some(v));
                dead.push(k);
            }
        }
        assert_eq!(s.values().count(), live.len());
        for (k, v) in &live {
            assert_eq!(s.get(*k), Some(v));
        }
        for k in dead {
            assert_eq!(s.get(k), None);
        }
        assert!(s.entries.len() <= live.len() + 1);
    }
}
