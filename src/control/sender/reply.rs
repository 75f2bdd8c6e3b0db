//! Reading an `AllocResponse` to a batch: which chunk goes to which
//! receiver slot, and which chunks the receiver already holds. Pure (no
//! I/O, no sender state), so every rule is unit-tested here.
//!
//! The interop rule (LMCache's, docs/protocol.md), checked by
//! [`crate::protocol::placement`], the one reading of a reply's shape:
//! `remote_indexes` lists one slot per chunk that must be written, in key
//! order, *skipping* the keys in `already_sent_indexes`, so
//! `len(remote_indexes) == len(keys) - len(set(already_sent))`. On top, a
//! slot must lie inside the receiver's buffer.

use smallvec::SmallVec;

use crate::protocol::{placement, AllocResponse, ErrorCode};

/// A reply mapped onto the batch's chunk positions.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Mapped {
    /// Receiver slot per chunk position (`-1` for already-sent chunks).
    pub remote: Vec<i64>,
    /// Chunk positions the receiver already holds, ascending.
    pub already_sent: SmallVec<[usize; 16]>,
}

/// The receive buffer a batch goes to: its slot count and slot size
/// (none of either by default: a receiver whose buffer is not known).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteSlots {
    /// Slots in the buffer.
    pub capacity: u64,
    /// Bytes per slot.
    pub bytes: u64,
}

/// Maps the reply to a batch of chunks of `lens` bytes for a receive
/// buffer of `slots`, or says why it is refused (the receiver's code;
/// `BadMessage` for a reply no correct receiver sends; `ChunkTooLarge` for
/// a chunk longer than its receive slot, whose write would run into the
/// next slot: a buffer configured smaller than the request's chunks).
pub(crate) fn map_reply(
    lens: &[u32],
    slots: RemoteSlots,
    resp: &AllocResponse,
) -> Result<Mapped, (ErrorCode, String)> {
    let (n, capacity) = (lens.len(), slots.capacity);
    let refused = || {
        let code = resp
            .code
            .as_deref()
            .and_then(ErrorCode::parse)
            .unwrap_or(ErrorCode::AllocationFailed);
        let reason = resp
            .error
            .clone()
            .unwrap_or_else(|| "the receiver could not allocate the batch".into());
        (code, reason)
    };
    if resp.is_failure() {
        return Err(refused());
    }
    let bad = |why: String| (ErrorCode::BadMessage, why);
    let p = placement(n, resp).map_err(|e| bad(e.to_string()))?;
    let mut remote = vec![-1i64; n];
    for &(pos, slot) in &p.writes {
        if slot < 0 || slot as u64 >= capacity {
            return Err(bad(format!(
                "reply names slot {slot} outside the receiver's {capacity}"
            )));
        }
        if u64::from(lens[pos]) > slots.bytes {
            return Err((
                ErrorCode::ChunkTooLarge,
                format!(
                    "chunk {pos} is {} bytes, more than the receiver's {}-byte slots",
                    lens[pos], slots.bytes
                ),
            ));
        }
        remote[pos] = slot;
    }
    Ok(Mapped {
        remote,
        already_sent: p.already_sent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(remote: Vec<i64>, already: Vec<i64>) -> AllocResponse {
        AllocResponse::ok(remote, already, None)
    }

    /// `n` chunks of one byte.
    fn lens(n: usize) -> Vec<u32> {
        vec![1; n]
    }

    /// A receive buffer of `capacity` slots of 4096 bytes.
    fn slots(capacity: u64) -> RemoteSlots {
        RemoteSlots {
            capacity,
            bytes: 4096,
        }
    }

    #[test]
    fn lmcache_rule_skips_already_sent_keys() {
        // keys 0..4, chunks 1 and 3 already held: two slots, in key order.
        let m = map_reply(&lens(4), slots(16), &ok(vec![7, 9], vec![3, 1])).unwrap();
        assert_eq!(m.remote, vec![7, -1, 9, -1]);
        assert_eq!(m.already_sent.as_slice(), &[1, 3]);
    }

    #[test]
    fn one_slot_per_key_with_dedup_is_refused() {
        // The shape kvferry receivers sent before the interop rule: it fails
        // LMCache's count check, so it is refused, never misread.
        assert_eq!(
            map_reply(&lens(3), slots(16), &ok(vec![4, 5, 6], vec![1]))
                .unwrap_err()
                .0,
            ErrorCode::BadMessage
        );
        let m = map_reply(&lens(2), slots(16), &ok(vec![0, 1], vec![])).unwrap();
        assert_eq!(m.remote, vec![0, 1]);
        assert!(m.already_sent.is_empty());
    }

    #[test]
    fn empty_batches_take_an_empty_answer() {
        let m = map_reply(&lens(0), slots(16), &ok(vec![], vec![])).unwrap();
        assert!(m.remote.is_empty());
        assert_eq!(
            map_reply(&lens(0), slots(16), &ok(vec![1, 2], vec![]))
                .unwrap_err()
                .0,
            ErrorCode::BadMessage
        );
    }

    #[test]
    fn hostile_replies_are_refused_not_trusted() {
        let bad = |r: AllocResponse, n| map_reply(&lens(n), slots(8), &r).unwrap_err().0;
        assert_eq!(
            bad(ok(vec![8], vec![]), 1),
            ErrorCode::BadMessage,
            "slot past capacity"
        );
        assert_eq!(
            bad(ok(vec![-1], vec![]), 1),
            ErrorCode::AllocationFailed,
            "-1 is a refusal"
        );
        assert_eq!(
            bad(ok(vec![1], vec![2]), 2),
            ErrorCode::BadMessage,
            "already-sent past the batch"
        );
        assert_eq!(
            bad(ok(vec![], vec![0, 0]), 2),
            ErrorCode::BadMessage,
            "counted twice"
        );
        assert_eq!(
            bad(ok(vec![1, 2, 3], vec![]), 2),
            ErrorCode::BadMessage,
            "too many slots"
        );
        assert_eq!(
            bad(ok(vec![1], vec![]), 3),
            ErrorCode::BadMessage,
            "too few slots"
        );
    }

    #[test]
    fn a_chunk_longer_than_its_receive_slot_is_refused_not_written() {
        // Chunk 1 would run 1 byte into the slot after its own.
        let (code, reason) =
            map_reply(&[4096, 4097], slots(8), &ok(vec![2, 3], vec![])).unwrap_err();
        assert_eq!(code, ErrorCode::ChunkTooLarge, "{reason}");
        // A chunk the receiver already holds is not written: no bound.
        let m = map_reply(&[4096, 9999], slots(8), &ok(vec![2], vec![1])).unwrap();
        assert_eq!(m.remote, vec![2, -1]);
    }

    #[test]
    fn failures_keep_the_receivers_code() {
        let r = AllocResponse::failure(2, Some(3), ErrorCode::BufferTooSmall, "too big");
        let (code, reason) = map_reply(&lens(2), slots(8), &r).unwrap_err();
        assert_eq!(
            (code, reason.as_str()),
            (ErrorCode::BufferTooSmall, "too big")
        );
        // The hostile-peer codes of a receiver keyed by (peer, req_id).
        for (wire, code) in [
            ("not_owner", ErrorCode::NotOwner),
            ("overloaded", ErrorCode::Overloaded),
        ] {
            let r = AllocResponse {
                code: Some(wire.into()),
                ..AllocResponse::failure(1, None, ErrorCode::AllocationFailed, "no")
            };
            assert_eq!(
                map_reply(&lens(1), slots(8), &r).unwrap_err().0,
                code,
                "{wire}"
            );
        }
    }
}
