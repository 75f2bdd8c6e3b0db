//! A batch's chunk keys in one buffer: the caller's keys are copied once
//! into one `String` with an end offset per key, so a batch of any size
//! costs a constant number of allocations (not one per chunk), and the
//! AllocRequest encoder and the request's CancelNotif list read them from
//! there without cloning.

use smallvec::SmallVec;

/// Chunk keys, in order, packed into one string.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct KeyList {
    text: String,
    /// `ends[i]`: byte offset in `text` just past key `i`.
    ends: SmallVec<[u32; 16]>,
}

impl KeyList {
    /// The keys of `keys`, copied (two allocations at most: the text and,
    /// above 16 keys, the offsets).
    pub fn from_keys(keys: &[impl AsRef<str>]) -> Self {
        let bytes = keys.iter().map(|k| k.as_ref().len()).sum();
        let mut text = String::with_capacity(bytes);
        let mut ends = SmallVec::with_capacity(keys.len());
        for k in keys {
            text.push_str(k.as_ref());
            ends.push(text.len() as u32);
        }
        Self { text, ends }
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Key `i`.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)? as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        self.text.get(start..end)
    }

    /// The keys in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i).unwrap_or_default())
    }

    /// Appends every key of `other` (amortised growth: a request's list of
    /// sent keys reallocates O(log chunks) times, not once per chunk).
    pub fn extend_from(&mut self, other: &KeyList) {
        let base = self.text.len() as u32;
        self.text.push_str(&other.text);
        self.ends.extend(other.ends.iter().map(|&e| base + e));
    }

    /// The keys as owned strings (the cancel path, off the hot path).
    pub fn to_vec(&self) -> Vec<String> {
        self.iter().map(str::to_owned).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_in_order_including_empty_ones() {
        let k = KeyList::from_keys(&["a/0", "", "bb/2"]);
        assert_eq!(k.len(), 3);
        assert_eq!(k.iter().collect::<Vec<_>>(), ["a/0", "", "bb/2"]);
        assert_eq!(k.get(3), None);
        let mut all = KeyList::from_keys(&["x"]);
        all.extend_from(&k);
        assert_eq!(all.to_vec(), ["x", "a/0", "", "bb/2"]);
        assert_eq!(KeyList::default().len(), 0);
    }
}
