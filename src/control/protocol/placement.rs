//! Reading a successful `AllocResponse` back onto the keys of its batch.
//!
//! The reply lists one receiver slot per key that must be *written*, in key
//! order, skipping the keys named in `already_sent_indexes` (positions in the
//! batch's `keys` the receiver already holds written). This is LMCache's
//! shape: its sender (`PDBackendAsync._async_transfer_task`, LMCache 0.5.6)
//! refuses a reply unless every `already_sent_indexes` entry is in
//! `0..len(keys)` and `len(remote_indexes) == len(keys) - len(set(already_sent_indexes))`,
//! and then pairs the remaining keys, in order, with `remote_indexes`.
//! [`placement`] applies exactly those checks and that pairing; it is pure so
//! the sender, the tests and any embedder share one reading.

use smallvec::SmallVec;

use super::AllocResponse;

/// Where the keys of one batch go, read from a successful reply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placement {
    /// Positions (in the batch's `keys`) the receiver already holds: not
    /// written, complete at once. Ascending, without repeats.
    pub already_sent: SmallVec<[usize; 16]>,
    /// `(position in keys, receiver slot)` of every key to write, in key order.
    pub writes: SmallVec<[(usize, i64); 16]>,
}

impl Placement {
    /// The receiver slot of every key position, `None` for an already-sent key.
    pub fn slot_by_key(&self, n_keys: usize) -> Vec<Option<i64>> {
        let mut by_key = vec![None; n_keys];
        for &(pos, slot) in &self.writes {
            by_key[pos] = Some(slot);
        }
        by_key
    }
}

/// Why a reply cannot be read onto its batch (the checks LMCache's sender applies).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// An `already_sent_indexes` entry is not a position of the batch.
    #[error("invalid already_sent_indexes from receiver: {index}, valid range [0, {n_keys})")]
    AlreadySentOutOfRange {
        /// The offending entry.
        index: i64,
        /// Keys in the batch.
        n_keys: usize,
    },
    /// `remote_indexes` does not list exactly one slot per key to write.
    #[error(
        "AllocResponse inconsistency: total_keys={total_keys}, already_sent={already_sent}, \
         remote_indexes={remote_indexes}, expected={expected}"
    )]
    CountMismatch {
        /// Keys in the batch.
        total_keys: usize,
        /// Distinct already-sent positions.
        already_sent: usize,
        /// Entries in `remote_indexes`.
        remote_indexes: usize,
        /// `total_keys - already_sent`.
        expected: usize,
    },
}

/// Reads `resp` onto a batch of `n_keys` keys: LMCache's consistency check,
/// then the pairing of the keys to write with `remote_indexes`.
///
/// Does not judge the slot values: a `-1` (failure) or a slot beyond the
/// receiver's buffer is the caller's to refuse (check
/// [`AllocResponse::is_failure`] first: a failure reply to an empty batch is
/// `[-1]`, which fails the count check, as it does at LMCache's sender).
pub fn placement(n_keys: usize, resp: &AllocResponse) -> Result<Placement, PlacementError> {
    let mut already_sent: SmallVec<[usize; 16]> = SmallVec::new();
    for &index in &resp.already_sent_indexes {
        match usize::try_from(index) {
            Ok(pos) if pos < n_keys => already_sent.push(pos),
            _ => return Err(PlacementError::AlreadySentOutOfRange { index, n_keys }),
        }
    }
    // LMCache takes `set(already_sent_indexes)`: a repeat counts once.
    already_sent.sort_unstable();
    already_sent.dedup();
    let expected = n_keys - already_sent.len();
    if resp.remote_indexes.len() != expected {
        return Err(PlacementError::CountMismatch {
            total_keys: n_keys,
            already_sent: already_sent.len(),
            remote_indexes: resp.remote_indexes.len(),
            expected,
        });
    }
    let mut skip = already_sent.iter().peekable();
    let mut slots = resp.remote_indexes.iter();
    let mut writes = SmallVec::with_capacity(expected);
    for pos in 0..n_keys {
        if skip.peek() == Some(&&pos) {
            skip.next();
            continue;
        }
        // `expected` slots for `expected` positions: never exhausted.
        if let Some(&slot) = slots.next() {
            writes.push((pos, slot));
        }
    }
    Ok(Placement {
        already_sent,
        writes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resp(remote: &[i64], already: &[i64]) -> AllocResponse {
        AllocResponse::ok(remote.to_vec(), already.to_vec(), None)
    }

    #[test]
    fn no_dedup_pairs_every_key_in_order() {
        let p = placement(3, &resp(&[7, 2, 5], &[])).unwrap();
        assert!(p.already_sent.is_empty());
        assert_eq!(p.writes.as_slice(), &[(0, 7), (1, 2), (2, 5)]);
        assert_eq!(p.slot_by_key(3), vec![Some(7), Some(2), Some(5)]);
    }

    #[test]
    fn dedup_skips_the_already_sent_positions() {
        // The case: key 0 held, key 1 new → remote_indexes = [2].
        let p = placement(2, &resp(&[2], &[0])).unwrap();
        assert_eq!(p.already_sent.as_slice(), &[0]);
        assert_eq!(p.writes.as_slice(), &[(1, 2)]);
        assert_eq!(p.slot_by_key(2), vec![None, Some(2)]);
        // A hole in the middle, listed out of order.
        let p = placement(5, &resp(&[9, 8, 7], &[3, 1])).unwrap();
        assert_eq!(p.already_sent.as_slice(), &[1, 3]);
        assert_eq!(p.writes.as_slice(), &[(0, 9), (2, 8), (4, 7)]);
        // Everything held: nothing to write.
        let p = placement(2, &resp(&[], &[1, 0])).unwrap();
        assert!(p.writes.is_empty());
        // An empty batch with an empty reply.
        assert_eq!(placement(0, &resp(&[], &[])).unwrap(), Placement::default());
    }

    #[test]
    fn a_slot_listed_for_a_dedup_key_is_the_bug_lmcache_refuses() {
        // What kvferry's receiver used to send: one slot per key.
        assert_eq!(
            placement(2, &resp(&[0, 2], &[0])),
            Err(PlacementError::CountMismatch {
                total_keys: 2,
                already_sent: 1,
                remote_indexes: 2,
                expected: 1
            })
        );
        assert_eq!(
            placement(2, &resp(&[0, 2], &[0])).unwrap_err().to_string(),
            "AllocResponse inconsistency: total_keys=2, already_sent=1, remote_indexes=2, expected=1",
            "the message LMCache's sender logs"
        );
    }

    #[test]
    fn repeats_count_once_like_lmcaches_set() {
        let p = placement(3, &resp(&[4, 5], &[1, 1])).unwrap();
        assert_eq!(p.already_sent.as_slice(), &[1]);
        assert_eq!(p.writes.as_slice(), &[(0, 4), (2, 5)]);
        assert!(placement(3, &resp(&[4], &[1, 1])).is_err());
    }

    #[test]
    fn out_of_range_positions_are_refused() {
        for bad in [-1, 2, i64::MAX] {
            assert_eq!(
                placement(2, &resp(&[1], &[bad])),
                Err(PlacementError::AlreadySentOutOfRange {
                    index: bad,
                    n_keys: 2
                })
            );
        }
    }

    #[test]
    fn a_failure_reply_to_an_empty_batch_fails_the_count_check() {
        // `[-1] * max(0, 1)`: LMCache's sender trips the same check and
        // aborts the request, which is what a failure asks for anyway.
        let f = AllocResponse::failure(0, None, crate::protocol::ErrorCode::Cancelled, "x");
        assert!(f.is_failure());
        assert!(matches!(
            placement(0, &f),
            Err(PlacementError::CountMismatch { .. })
        ));
        // With keys, the failure shape passes the check (and holds -1s).
        let f = AllocResponse::failure(3, None, crate::protocol::ErrorCode::Cancelled, "x");
        let p = placement(3, &f).unwrap();
        assert!(p.writes.iter().all(|&(_, s)| s == -1));
    }
}
