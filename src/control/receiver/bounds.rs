//! The bounds, in bytes, on what peers can make the receiver's control
//! plane hold (DESIGN invariant 9), and what each kept item is charged.
//!
//! Charges are estimates of the heap an item really costs (strings plus a
//! fixed overhead per allocation), erring high; what matters is that every
//! byte a peer sends and the receiver keeps is counted against one budget,
//! and that past the budget the peer is refused at once (`overloaded`)
//! instead of growing memory. `docs/security.md` lists every bound with its
//! default and flag.

use std::time::Duration;

use crate::protocol::AllocRequest;

/// Per-receiver bounds on control-plane state (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds {
    /// Bytes all parked requests and the batches queued behind them may
    /// hold (default 64 MiB). Past it a new parked request, or a further
    /// batch of a parked request, is answered `overloaded` at once (the
    /// parked request is then rolled back).
    pub max_parked_bytes: usize,
    /// Bytes one peer's parked requests may hold (default 16 MiB), so one
    /// peer cannot take the whole parked budget.
    pub max_peer_parked_bytes: usize,
    /// Bytes of records of ended requests (failure tombstones that answer
    /// late batches, LMCache requests' references a later `CancelNotif` may
    /// release; default 16 MiB). Past it, new records are not kept (the
    /// quarantine part of a tombstone always is: it is bounded by the slots).
    /// Complete requests waiting for the decoder's `take` get a budget of
    /// the same size of their own; past it, a complete request's chunks are
    /// readable by key only.
    pub max_ended_bytes: usize,
    /// Bytes of per-peer state (identity, sender id; default 16 MiB). Past
    /// it a `Hello` or a new peer's first request is answered `overloaded`.
    pub max_peer_bytes: usize,
    /// Accept anonymous allocations (`req_id == ""`, LMCache's untracked
    /// path; default `true`). `false` answers them `protocol_violation`.
    pub allow_anonymous: bool,
    /// How long an anonymous allocation's copies stay if no decoder
    /// consumes them (default 120 s): then its copies are detached and
    /// their slots freed once no borrow holds them.
    pub anonymous_lifetime: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            max_parked_bytes: 64 << 20,
            max_peer_parked_bytes: 16 << 20,
            max_ended_bytes: 16 << 20,
            max_peer_bytes: 16 << 20,
            allow_anonymous: true,
            anonymous_lifetime: Duration::from_secs(120),
        }
    }
}

/// Fixed charge per kept allocation (map slot, struct, allocator slack).
const OVERHEAD: usize = 64;

/// Charge of one key string kept in a list.
pub(crate) fn key_cost(key: &str) -> usize {
    key.len() + 32
}

/// Charge of a batch kept behind a parked request.
pub(crate) fn batch_cost(req: &AllocRequest) -> usize {
    2 * OVERHEAD
        + req.req_id.len()
        + req.dtype.len()
        + 8 * req.shape.len()
        + req.keys.iter().map(|k| key_cost(k)).sum::<usize>()
}

/// Charge of a tracked request besides its batches (map entry, queue entry,
/// the id and the peer identity stored with it).
pub(crate) fn request_cost(peer: &[u8], req_id: &str) -> usize {
    4 * OVERHEAD + 2 * (peer.len() + req_id.len())
}

/// Charge of an ended-request record listing `keys` copies.
pub(crate) fn ended_cost<'a>(
    peer: &[u8],
    req_id: &str,
    keys: impl Iterator<Item = &'a str>,
) -> usize {
    2 * OVERHEAD + peer.len() + req_id.len() + keys.map(key_cost).sum::<usize>()
}

/// Charge of a peer's state.
pub(crate) fn peer_cost(peer: &[u8], sender_id: &str) -> usize {
    3 * OVERHEAD + 2 * peer.len() + sender_id.len()
}
