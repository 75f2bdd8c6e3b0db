//! The work-request plan of one `post` call: which writes become RDMA WRITE
//! work requests on which queue pair, which of those are signalled, and
//! which ops complete at once without touching the NIC.
//!
//! Signalling: on an RC queue pair work requests complete in order, so a
//! completion for a signalled request also completes every unsignalled one
//! posted before it on the same queue pair. Within the chain posted to one
//! queue pair by one call, every `signal_every`-th request and the last one
//! are signalled. The last one always is, so no request is ever left
//! waiting for a later post that may not come, and each chain produces at
//! most `ceil(len / signal_every)` CQ entries.

use crate::transport::{CompletionStatus, PeerIndex, WriteOp};

/// Largest length of one RDMA WRITE (the verbs limit for a message is 2 GiB).
pub const MAX_WRITE_LEN: u64 = 1 << 31;

/// Default for how often a request of a chain is signalled.
pub const DEFAULT_SIGNAL_EVERY: u32 = 16;

/// What the poster does with one [`WriteOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Post an RDMA WRITE on the queue pair of `peer`.
    Write {
        /// Target peer.
        peer: PeerIndex,
        /// Request a completion for this work request.
        signalled: bool,
    },
    /// Do not post; complete at once with this status.
    Complete(CompletionStatus),
}

/// What the planner needs to know about a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerState {
    /// Connected; its remote region has `remote_len` bytes.
    Ready {
        /// Bytes of the peer's registered slot area.
        remote_len: u64,
    },
    /// Its queue pair went to the error state: everything fails.
    Failed,
}

/// True if request `i` of a chain of `len` requests is signalled.
pub fn signalled(i: usize, len: usize, every: u32) -> bool {
    let every = every.max(1) as usize;
    (i + 1) % every == 0 || i + 1 == len
}

/// Plans `ops`: fills `steps` (one per op, in order). `peer` looks a peer
/// up (`None` = not connected); `local_len` gives the size of a local
/// memory by [`WriteOp::local_region`] (0: the staging buffer, else a
/// caller's registered region; `None` = no such region, i.e. no memory
/// region the NIC could read it through).
///
/// An op completes at once with `UnknownPeer` (no such peer),
/// `ConnectionLost` (its queue pair failed), `OutOfBounds` (a range outside
/// a buffer, or an unregistered local region) or `TransportError` (longer
/// than [`MAX_WRITE_LEN`]); all other ops become writes, signalled as
/// described in the module docs per peer over the whole of `ops` (the
/// poster posts one chain per peer).
pub fn plan(
    ops: &[WriteOp],
    local_len: impl Fn(u32) -> Option<u64>,
    signal_every: u32,
    peer: impl Fn(PeerIndex) -> Option<PeerState>,
    steps: &mut Vec<Step>,
) {
    steps.clear();
    for op in ops {
        let within =
            |offset: u64, limit: u64| offset.checked_add(op.len).is_some_and(|e| e <= limit);
        let step = match peer(op.peer) {
            None => Step::Complete(CompletionStatus::UnknownPeer),
            Some(PeerState::Failed) => Step::Complete(CompletionStatus::ConnectionLost),
            Some(PeerState::Ready { remote_len }) => {
                if !local_len(op.local_region).is_some_and(|l| within(op.local_offset, l))
                    || !within(op.remote_offset, remote_len)
                {
                    Step::Complete(CompletionStatus::OutOfBounds)
                } else if op.len > MAX_WRITE_LEN {
                    Step::Complete(CompletionStatus::TransportError)
                } else {
                    Step::Write {
                        peer: op.peer,
                        signalled: false,
                    }
                }
            }
        };
        steps.push(step);
    }
    // Number the writes of each peer's chain, then mark the signalled ones.
    let mut per_peer: Vec<(PeerIndex, usize)> = Vec::new();
    for s in steps.iter() {
        if let Step::Write { peer, .. } = s {
            match per_peer.iter_mut().find(|(p, _)| p == peer) {
                Some((_, n)) => *n += 1,
                None => per_peer.push((*peer, 1)),
            }
        }
    }
    let mut seen: Vec<(PeerIndex, usize)> = per_peer.iter().map(|(p, _)| (*p, 0)).collect();
    for s in steps.iter_mut() {
        if let Step::Write {
            peer,
            signalled: sig,
        } = s
        {
            let total = per_peer
                .iter()
                .find(|(p, _)| p == peer)
                .map_or(1, |(_, n)| *n);
            if let Some((_, i)) = seen.iter_mut().find(|(p, _)| p == peer) {
                *sig = signalled(*i, total, signal_every);
                *i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(work_id: u64, peer: u32, local: u64, remote: u64, len: u64) -> WriteOp {
        WriteOp {
            work_id,
            local_offset: local,
            remote_offset: remote,
            len,
            peer,
            local_region: 0,
        }
    }

    /// A local memory table with only the staging buffer, of `len` bytes.
    fn staging_only(len: u64) -> impl Fn(u32) -> Option<u64> {
        move |region| (region == 0).then_some(len)
    }

    #[test]
    fn writes_from_registered_regions_are_checked_against_their_own_length() {
        let from = |work_id, region, local, len| WriteOp {
            local_region: region,
            ..op(work_id, 0, local, 0, len)
        };
        let ops = [
            from(1, 3, 0, 4096),    // region 3 is 8 KiB
            from(2, 3, 4096, 4096), // its end
            from(3, 3, 4097, 4096), // past its end
            from(4, 5, 0, 1),       // not registered
            from(5, 0, 0, 100),     // staging (100 bytes)
            from(6, 0, 0, 4096),    // past the staging buffer, inside region 3's size
        ];
        let local = |region| match region {
            0 => Some(100),
            3 => Some(8192),
            _ => None,
        };
        let mut steps = Vec::new();
        plan(
            &ops,
            local,
            16,
            |_| {
                Some(PeerState::Ready {
                    remote_len: 1 << 20,
                })
            },
            &mut steps,
        );
        let w = |signalled| Step::Write { peer: 0, signalled };
        let oob = Step::Complete(CompletionStatus::OutOfBounds);
        assert_eq!(steps, vec![w(false), w(false), oob, oob, w(true), oob]);
    }

    #[test]
    fn signals_every_nth_and_the_last() {
        let flags: Vec<bool> = (0..10).map(|i| signalled(i, 10, 4)).collect();
        assert_eq!(
            flags,
            [false, false, false, true, false, false, false, true, false, true]
        );
        assert!((0..3).all(|i| signalled(i, 3, 1)), "every=1 signals all");
        assert!(signalled(0, 1, 0), "every=0 is treated as 1");
    }

    #[test]
    fn plans_per_peer_chains_and_immediate_completions() {
        let ops = [
            op(1, 0, 0, 0, 100),
            op(2, 1, 100, 0, 100),
            op(3, 0, 200, 100, 100),
            op(4, 9, 0, 0, 1),        // unknown peer
            op(5, 2, 0, 0, 1),        // failed QP
            op(6, 0, 950, 0, 100),    // local out of bounds
            op(7, 1, 0, 4000, 200),   // remote out of bounds
            op(8, 0, u64::MAX, 0, 2), // overflow
            op(9, 0, 0, 0, 0),        // empty write is a write
        ];
        let peers = |p: PeerIndex| match p {
            0 | 1 => Some(PeerState::Ready { remote_len: 4096 }),
            2 => Some(PeerState::Failed),
            _ => None,
        };
        let mut steps = Vec::new();
        plan(&ops, staging_only(1000), 2, peers, &mut steps);
        use CompletionStatus::*;
        let w = |peer, signalled| Step::Write { peer, signalled };
        assert_eq!(
            steps,
            vec![
                w(0, false),
                w(1, true), // only write to peer 1: last of its chain
                w(0, true), // second of peer 0's three: every=2
                Step::Complete(UnknownPeer),
                Step::Complete(ConnectionLost),
                Step::Complete(OutOfBounds),
                Step::Complete(OutOfBounds),
                Step::Complete(OutOfBounds),
                w(0, true), // last of peer 0's chain
            ]
        );
    }

    #[test]
    fn too_long_writes_fail() {
        let huge = MAX_WRITE_LEN + 1;
        let mut steps = Vec::new();
        plan(
            &[op(1, 0, 0, 0, huge)],
            staging_only(u64::MAX),
            4,
            |_| {
                Some(PeerState::Ready {
                    remote_len: u64::MAX,
                })
            },
            &mut steps,
        );
        assert_eq!(
            steps,
            vec![Step::Complete(CompletionStatus::TransportError)]
        );
    }
}
