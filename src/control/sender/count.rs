//! A request's stored-chunk count ([`Stored`]) in one atomic word: caller
//! threads reserve their batches' chunks in it without the table lock,
//! ctrl's completion check reads it ([`Progress::is_complete`](super::core::Progress::is_complete)).
//! The rules (total, last batch, empty batches) are the core's
//! [`Stored::reserve`]; this is only their atomic shell.

use std::sync::atomic::{AtomicU64, Ordering};

use super::core::{Refusal, Stored};

/// Bit of the last-batch flag; the chunk count is the bits below it. A
/// count cannot reach it: it grows by batches of at most the staging size,
/// each one stored, so 2^63 chunks would take longer than any process runs.
const LAST: u64 = 1 << 63;

fn pack(s: Stored) -> u64 {
    s.chunks as u64 | if s.last { LAST } else { 0 }
}

fn unpack(v: u64) -> Stored {
    Stored {
        chunks: (v & !LAST) as usize,
        last: v & LAST != 0,
    }
}

/// One request's [`Stored`], shared by its handles and its table entry.
#[derive(Debug, Default)]
pub(crate) struct StoredCount(AtomicU64);

impl StoredCount {
    /// The count now.
    pub fn get(&self) -> Stored {
        // Acquire: pairs with the AcqRel updates below. The word carries no
        // other data; what ctrl must see with a reservation (the batch)
        // crosses the submission ring, whose Release push / Acquire pop
        // already orders the reservation before ctrl's read.
        unpack(self.0.load(Ordering::Acquire))
    }

    /// Reserves a batch of `n` chunks of a request of `total` (see
    /// [`Stored::reserve`]); whether it is the last batch.
    pub fn reserve(&self, n: usize, total: usize, is_last: Option<bool>) -> Result<bool, Refusal> {
        let mut outcome = Err(Refusal::AfterLast);
        // AcqRel/Acquire: see `get`; the read-modify-write alone makes
        // concurrent reservations add up (never overshoot the total).
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                outcome = unpack(v)
                    .reserve(n, total, is_last)
                    .map(|(s, last)| (pack(s), last));
                outcome.map(|(v, _)| v).ok()
            });
        outcome.map(|(_, last)| last)
    }

    /// Gives back a reservation whose batch was never handed over; true if
    /// that orphans the request ([`Stored::orphans`]: it must fail).
    #[must_use = "an orphaned request must be failed"]
    pub fn unreserve(&self, n: usize, last: bool) -> bool {
        // AcqRel/Acquire: see `reserve`.
        let prev = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(pack(unpack(v).unreserve(n, last)))
            })
            .unwrap_or_else(|v| v);
        unpack(prev).orphans(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrent_reservations_add_up_to_the_total_exactly_once() {
        let c = std::sync::Arc::new(StoredCount::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = std::sync::Arc::clone(&c);
                std::thread::spawn(move || {
                    let (mut got, mut lasts) = (0, 0);
                    for _ in 0..1000 {
                        match c.reserve(2, 2000, None) {
                            Ok(last) => {
                                got += 2;
                                lasts += usize::from(last);
                            }
                            Err(Refusal::AfterLast) => break,
                            Err(e) => panic!("unexpected {e:?}"),
                        }
                    }
                    (got, lasts)
                })
            })
            .collect();
        let (mut got, mut lasts) = (0, 0);
        for t in threads {
            let (g, l) = t.join().expect("no panic");
            got += g;
            lasts += l;
        }
        assert_eq!((got, lasts), (2000, 1), "the total, one last batch");
        assert_eq!(
            c.get(),
            Stored {
                chunks: 2000,
                last: true
            }
        );
        assert!(!c.unreserve(2, true), "giving the last batch back reopens");
        assert_eq!(
            c.get(),
            Stored {
                chunks: 1998,
                last: false
            }
        );
    }
}
