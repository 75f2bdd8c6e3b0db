//! [`SlotSet`]: a sorted set of slot indices handed out by the allocator.

use smallvec::SmallVec;

/// Slot indices, sorted ascending and distinct.
///
/// A plain value, not an RAII guard: the slots stay in use until the set is
/// given back with [`SlotAllocator::free`](super::SlotAllocator::free) (or
/// each slot with [`free_one`](super::SlotAllocator::free_one)), typically
/// by the completion thread once the write from those slots has finished.
#[must_use = "slots stay in use until given back with SlotAllocator::free"]
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlotSet {
    slots: SmallVec<[u32; 16]>,
}

impl SlotSet {
    /// Built from already sorted, distinct indices.
    pub(crate) fn from_sorted(slots: SmallVec<[u32; 16]>) -> Self {
        debug_assert!(slots.windows(2).all(|w| w[0] < w[1]));
        Self { slots }
    }

    /// A set of the given indices (sorted and de-duplicated here).
    pub fn from_slots(v: impl IntoIterator<Item = u32>) -> Self {
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

    /// The indices, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots.iter().copied()
    }

    /// Contiguous runs as `(first_slot, count)`, ascending (for coalescing
    /// descriptors: one write per run).
    pub fn runs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            let first = *self.slots.get(i)?;
            let mut count = 1u32;
            while self
                .slots
                .get(i + count as usize)
                .is_some_and(|&s| Some(s) == first.checked_add(count))
            {
                count += 1;
            }
            i += count as usize;
            Some((first, count))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_coalesce_contiguous_slots() {
        let s = SlotSet::from_slots([7, 1, 2, 3, 9, 10, 2]);
        assert_eq!(s.as_slice(), &[1, 2, 3, 7, 9, 10]);
        assert_eq!(s.runs().collect::<Vec<_>>(), vec![(1, 3), (7, 1), (9, 2)]);
        assert_eq!(SlotSet::default().runs().count(), 0);
        let top = SlotSet::from_slots([u32::MAX - 1, u32::MAX]);
        assert_eq!(top.runs().collect::<Vec<_>>(), vec![(u32::MAX - 1, 2)]);
    }
}
