//! [`SlotSet`]: a sorted set of slot indices handed out by the allocator.

use smallvec::SmallVec;

/// Slot indices, sorted ascending and distinct.
///
/// A plain value, not an RAII guard: the slots stay in use until the set is
/// given back with [`SlotAllocator::free`](super::SlotAllocator::free) (or
/// each slot with [`free_one`](super::SlotAllocator::free_one)), typically
/// by the completion thread once the write from those slots has finished.
///
/// Unforgeable outside the crate: only the allocator makes sets (and
/// [`split_off`](Self::split_off) / [`remove`](Self::remove) break one up),
/// and a set is not `Clone`, so holding one means owning its slots.
#[must_use = "slots stay in use until given back with SlotAllocator::free"]
#[derive(Debug, PartialEq, Eq, Default)]
pub struct SlotSet {
    slots: SmallVec<[u32; 16]>,
}

impl SlotSet {
    /// Built from already sorted, distinct indices.
    pub(crate) fn from_sorted(slots: SmallVec<[u32; 16]>) -> Self {
        debug_assert!(slots.windows(2).all(|w| w[0] < w[1]));
        Self { slots }
    }

    /// A set of the given indices (sorted and de-duplicated here). Crate
    /// internal: a set names slots its holder owns.
    pub(crate) fn from_slots(v: impl IntoIterator<Item = u32>) -> Self {
        let mut slots: SmallVec<[u32; 16]> = v.into_iter().collect();
        slots.sort_unstable();
        slots.dedup();
        Self { slots }
    }

    /// The indices, ascending.
    pub fn as_slice(&self) -> &[u32] {
        &self.slots
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Splits the set at position `at`: `self` keeps the first `at` slots
    /// (all if `at >= len`), the returned set holds the rest.
    pub fn split_off(&mut self, at: usize) -> SlotSet {
        let at = at.min(self.slots.len());
        let rest: SmallVec<[u32; 16]> = self.slots.drain(at..).collect();
        Self { slots: rest }
    }

    /// Takes `slot` out of the set as a set of its own (`None` if the set
    /// does not hold it).
    pub fn remove(&mut self, slot: u32) -> Option<SlotSet> {
        let i = self.slots.binary_search(&slot).ok()?;
        self.slots.remove(i);
        let mut one = SmallVec::new();
        one.push(slot);
        Some(Self { slots: one })
    }

    /// The indices, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_remove_keep_sets_sorted_and_disjoint() {
        let mut s = SlotSet::from_slots([7, 1, 2, 3, 9, 2]);
        assert_eq!(s.as_slice(), &[1, 2, 3, 7, 9]);
        let mut rest = s.split_off(2);
        assert_eq!(
            (s.as_slice(), rest.as_slice()),
            (&[1, 2][..], &[3, 7, 9][..])
        );
        assert_eq!(rest.remove(7).map(|o| o.as_slice().to_vec()), Some(vec![7]));
        assert_eq!(rest.as_slice(), &[3, 9]);
        assert!(rest.remove(7).is_none(), "no longer held");
        assert!(s.split_off(10).is_empty());
        assert_eq!(s.len(), 2);
    }
}
