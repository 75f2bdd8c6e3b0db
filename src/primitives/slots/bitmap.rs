//! [`AtomicBitmap`]: the slot bitmap, one bit per slot (1 = in use) in
//! `AtomicU64` words, claimed with `trailing_zeros`-style bit picking + CAS.

use bitvec::vec::BitVec;
use smallvec::SmallVec;

use crate::sync::{yield_now, AtomicU64, Ordering};

/// Bits past the last slot in the last word are set at construction and
/// never cleared, so they are never handed out.
pub(crate) struct AtomicBitmap {
    words: Box<[AtomicU64]>,
    bits: usize,
}

/// Result of clearing a set of bits.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cleared {
    /// Bits that were set and are now clear.
    pub(crate) cleared: usize,
    /// Bits that were already clear or out of range (caller bugs, ignored).
    pub(crate) bad: usize,
}

/// The lowest `k` set bits of `x` (all of them if `x` has fewer).
fn lowest_bits(mut x: u64, k: usize) -> u64 {
    if k >= x.count_ones() as usize {
        return x;
    }
    let mut m = 0;
    for _ in 0..k {
        let low = x & x.wrapping_neg();
        m |= low;
        x ^= low;
    }
    m
}

impl AtomicBitmap {
    pub(crate) fn new(bits: usize) -> Self {
        let nwords = bits.div_ceil(64);
        let words: Box<[AtomicU64]> = (0..nwords)
            .map(|i| {
                let used_here = (bits - i * 64).min(64);
                let pad = if used_here == 64 {
                    0
                } else {
                    !0u64 << used_here
                };
                AtomicU64::new(pad)
            })
            .collect();
        Self { words, bits }
    }

    pub(crate) fn words(&self) -> usize {
        self.words.len()
    }

    /// Claims exactly `n` clear bits, starting the scan at word `start`,
    /// appending their indices to `out` (unsorted). Returns the word where
    /// the scan ended (the caller's next hint).
    ///
    /// The caller must hold `n` permits of the allocator's semaphore: the
    /// number of clear bits is always at least the number of permits granted
    /// but not yet claimed, so the scan always finds its `n` bits (other
    /// claimers may take bits it saw first, but only against their own
    /// permits). A full pass that comes up short backs off with a yield.
    pub(crate) fn claim(&self, n: usize, start: usize, out: &mut SmallVec<[u32; 16]>) -> usize {
        let nwords = self.words.len();
        let mut need = n;
        // `start` is normally in range: avoid a division on the hot path.
        let mut i = if start < nwords {
            start
        } else {
            start % nwords.max(1)
        };
        let mut visited = 0usize;
        while need > 0 {
            let word = &self.words[i];
            // Relaxed: only a first guess; the CAS below validates it.
            let mut cur = word.load(Ordering::Relaxed);
            loop {
                let free = !cur;
                if free == 0 {
                    break;
                }
                let mask = lowest_bits(free, need);
                // Acquire on success: pairs with the Release `fetch_and` in
                // `clear`, so the previous owner's use of the slot
                // happens-before ours.
                match word.compare_exchange_weak(
                    cur,
                    cur | mask,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        let mut m = mask;
                        while m != 0 {
                            let b = m.trailing_zeros() as usize;
                            out.push((i * 64 + b) as u32);
                            m &= m - 1;
                        }
                        need -= mask.count_ones() as usize;
                        break;
                    }
                    Err(actual) => cur = actual,
                }
            }
            if need == 0 {
                break;
            }
            i += 1;
            if i == nwords {
                i = 0;
            }
            visited += 1;
            if visited % nwords == 0 {
                // A whole pass came up short: bits we need are in the hands
                // of claimers that are about to give them back. Bounded
                // by the permit argument above.
                yield_now();
            }
        }
        i
    }

    /// Clears the bits of `sorted` (ascending slot indices).
    pub(crate) fn clear(&self, sorted: impl IntoIterator<Item = u32>) -> Cleared {
        let mut res = Cleared::default();
        let mut cur_word = usize::MAX;
        let mut mask = 0u64;
        for s in sorted {
            let s = s as usize;
            if s >= self.bits {
                res.bad += 1;
                continue;
            }
            let w = s / 64;
            if w != cur_word {
                self.clear_word(cur_word, mask, &mut res);
                cur_word = w;
                mask = 0;
            }
            mask |= 1u64 << (s % 64);
        }
        self.clear_word(cur_word, mask, &mut res);
        res
    }

    fn clear_word(&self, w: usize, mask: u64, res: &mut Cleared) {
        if mask == 0 || w >= self.words.len() {
            return;
        }
        // Release: pairs with the Acquire CAS in `claim` (slot hand-over).
        let prev = self.words[w].fetch_and(!mask, Ordering::Release);
        res.cleared += (prev & mask).count_ones() as usize;
        res.bad += (!prev & mask).count_ones() as usize;
    }

    /// True if bit `bit` is set (in use); false past the end.
    pub(crate) fn is_set(&self, bit: usize) -> bool {
        if bit >= self.bits {
            return false;
        }
        // Acquire: pairs with the Release `fetch_and` in `clear` and the
        // Acquire/Release CAS in `claim`, so a reader that sees the bit set
        // sees the claim that set it. A point-in-time answer only: the bit
        // may change right after.
        self.words[bit / 64].load(Ordering::Acquire) & (1u64 << (bit % 64)) != 0
    }

    /// A copy of the bits (1 = in use), padding excluded.
    pub(crate) fn snapshot(&self) -> BitVec<u64> {
        // Relaxed: a debug view; each word is read atomically, the whole
        // is not a single instant under concurrent use.
        let raw: Vec<u64> = self
            .words
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect();
        let mut bv = BitVec::<u64>::from_vec(raw);
        bv.truncate(self.bits);
        bv
    }
}

#[cfg(all(test, not(feature = "shuttle-model")))]
mod tests {
    use super::*;

    #[test]
    fn lowest_bits_picks_from_the_bottom() {
        assert_eq!(lowest_bits(0b1011_0100, 2), 0b0001_0100);
        assert_eq!(lowest_bits(0b1011_0100, 9), 0b1011_0100);
        assert_eq!(lowest_bits(u64::MAX, 1), 1);
        assert_eq!(lowest_bits(0, 3), 0);
    }

    #[test]
    fn padding_bits_are_never_claimed_and_clear_reports_bad_bits() {
        let b = AtomicBitmap::new(70);
        assert_eq!(b.words(), 2);
        let mut out = SmallVec::new();
        b.claim(70, 1, &mut out);
        out.sort_unstable();
        assert_eq!(out.as_slice(), (0..70).collect::<Vec<u32>>().as_slice());
        assert!(b.snapshot().all());
        assert_eq!(b.snapshot().len(), 70);
        let c = b.clear([3, 64, 69, 70, 200]);
        assert_eq!(c, Cleared { cleared: 3, bad: 2 });
        let c = b.clear([3]);
        assert_eq!(c, Cleared { cleared: 0, bad: 1 });
        assert_eq!(b.snapshot().count_ones(), 67);
    }
}
