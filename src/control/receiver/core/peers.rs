//! Per-peer state: `Hello` and `Heartbeat`, its creation under the bound,
//! pruning and eviction of peers holding nothing, and the record of pruned
//! kvferry peers (a method group of [`ReceiverCore`]).

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use tracing::debug;

use crate::peer_warn;
use crate::protocol::{Descriptor, ErrorCode, Hello, HelloAck, PROTOCOL_VERSION};

use super::super::bounds;
use super::{Output, PeerId, PeerState, ReceiverCore};

/// How long after an eviction scan of per-peer state that freed nothing
/// the next may run ([`ReceiverCore::evict_empty_peers`]).
const EVICT_RETRY: Duration = Duration::from_millis(100);

impl ReceiverCore {
    /// The `HelloAck` for `h`, or the code and reason of a failure reply:
    /// `overloaded` when per-peer state is at its bound, `peer_unavailable`
    /// when the acceptor could not set up the data plane `h` asked for.
    pub(super) fn on_hello(
        &mut self,
        peer: &[u8],
        h: &Hello,
        now: Instant,
    ) -> Result<HelloAck, (ErrorCode, String)> {
        debug!(sender_id = %h.sender_id, version = h.version, transport = %h.transport, "hello");
        let p = self
            .peer_state(peer, now)
            .map_err(|m| (ErrorCode::Overloaded, m))?;
        let charge = bounds::peer_cost(peer, &h.sender_id);
        let old = std::mem::replace(&mut p.charge, charge);
        p.hello = Some(h.sender_id.clone());
        self.peer_bytes = self.peer_bytes - old + charge;
        // Whatever this peer set up before is stale: it says Hello again.
        self.forget_sender(peer);
        // So is what an earlier socket of the same sender to this receiver
        // set up: a kvferry sender that re-handshakes (its data plane was
        // lost) does so on a new socket, whose identity differs only by the
        // generation suffix (`"{sender_id}-to-{endpoint}#{generation}"`).
        let stem = identity_stem(peer);
        let earlier: Vec<PeerId> = self
            .accepted
            .keys()
            .filter(|k| {
                k.as_slice() != peer
                    && identity_stem(k) == stem
                    && self
                        .peers
                        .get(*k)
                        .is_some_and(|p| p.hello.as_deref() == Some(h.sender_id.as_str()))
            })
            .cloned()
            .collect();
        for k in earlier {
            self.forget_sender(&k);
        }
        let (transport, descriptor) = match &mut self.acceptor {
            Some(a) if a.kind() == h.transport => {
                let kind = a.kind();
                let d = a.accept(&h.descriptor).map_err(|e| {
                    debug!(sender_id = %h.sender_id, error = %e, "data plane refused");
                    let msg = format!(
                        "receiver {} cannot set up the {kind} data plane: {e}",
                        self.cfg.receiver_id
                    );
                    (ErrorCode::PeerUnavailable, msg)
                })?;
                self.accepted.insert(peer.to_vec(), h.descriptor.clone());
                (kind.to_owned(), d)
            }
            _ => self
                .cfg
                .other_transports
                .iter()
                .find(|(name, _)| *name == h.transport && *name != self.cfg.transport)
                .map_or(
                    (self.cfg.transport.clone(), self.cfg.descriptor.clone()),
                    |(n, d)| (n.clone(), d.clone()),
                ),
        };
        // A TCP sender gets its own secret for its data connections (a new
        // Hello replaces it); any other transport needs none.
        let descriptor = match descriptor {
            Descriptor::Tcp { addr, .. } => {
                let (_, secret) = self.data_keys.issue(peer);
                Descriptor::Tcp {
                    addr,
                    secret: Some(crate::transport::tcp::wire::encode_secret(&secret)),
                }
            }
            other => {
                self.data_keys.forget(peer);
                other
            }
        };
        // Only with the shm data plane: reaching its file proves the
        // sender is on this host, where the `ipc://` socket is too.
        let control = self.control.clone().filter(|_| transport == "shm");
        Ok(HelloAck {
            receiver_id: self.cfg.receiver_id.clone(),
            version: PROTOCOL_VERSION,
            transport,
            descriptor,
            chunk_bytes: self.cfg.chunk_bytes,
            capacity_chunks: self.cfg.capacity_chunks as u64,
            control,
        })
    }

    /// Tears down the acceptor's data plane to `peer`, if it has one.
    pub(super) fn forget_sender(&mut self, peer: &[u8]) {
        if let (Some(a), Some(d)) = (&mut self.acceptor, self.accepted.remove(peer)) {
            debug!(kind = a.kind(), "forgetting a sender's data plane");
            a.forget(&d);
        }
    }

    /// Per-peer state of `peer`, created (and charged) if it has none;
    /// `Err` with the reason when per-peer state is at its bound.
    pub(super) fn peer_state(
        &mut self,
        peer: &[u8],
        now: Instant,
    ) -> Result<&mut PeerState, String> {
        if !self.peers.contains_key(peer) {
            let charge = bounds::peer_cost(peer, "");
            if self.peer_bytes + charge > self.cfg.bounds.max_peer_bytes {
                self.evict_empty_peers(charge, now);
            }
            if self.peer_bytes + charge > self.cfg.bounds.max_peer_bytes {
                return Err(format!(
                    "receiver overloaded: per-peer state holds {} bytes (bound {}); retry later",
                    self.peer_bytes, self.cfg.bounds.max_peer_bytes
                ));
            }
            self.peer_bytes += charge;
            let hello = self.pruned_hello.take(peer).then(String::new);
            self.peers.insert(
                peer.to_vec(),
                PeerState {
                    hello,
                    alive_until: now,
                    last_seen: now,
                    parked_bytes: 0,
                    anonymous: 0,
                    charge,
                },
            );
        }
        self.peers
            .get_mut(peer)
            .ok_or_else(|| unreachable!("inserted above"))
    }

    /// O(1): moves the peer's liveness; its requests' leases follow it (see
    /// [`ReceiverCore::tick`]). Only a peer that said Hello heartbeats, and
    /// a heartbeat naming a sender id other than its own renews nothing.
    pub(super) fn on_heartbeat(&mut self, peer: &[u8], sender_id: &str, now: Instant) {
        let lease = self.cfg.lease;
        let Some(p) = self.peers.get_mut(peer) else {
            return debug!("Heartbeat from a peer without state; ignored");
        };
        match p.hello.as_deref() {
            // A pruned-and-revived peer's sender id is not known again.
            Some(id) if id == sender_id || id.is_empty() => p.alive_until = now + lease,
            Some(_) => {
                peer_warn!(
                    self.log,
                    now,
                    sender_id,
                    "Heartbeat naming another sender; ignored"
                );
                self.bump_error(ErrorCode::NotOwner);
            }
            None => debug!("Heartbeat from a peer that did not say Hello; ignored"),
        }
    }

    /// Forgets peers with nothing left in the core (no request, record or
    /// anonymous allocation) that were silent for a lease. A kvferry peer
    /// is remembered (a hash, in a bounded set) so that its next request
    /// keeps kvferry semantics without a new `Hello`.
    pub(super) fn prune_peers(&mut self, now: Instant, out: &mut Vec<Output>) {
        let lease = self.cfg.lease;
        for (_, id) in self.empty_peers(|p| p.last_seen + lease <= now) {
            if self.forget_peer_state(&id) {
                debug!("peer state pruned: nothing left, silent for a lease");
                out.push(Output::ForgetPeer { peer: id });
            }
        }
    }

    /// Peers with nothing left in the core (no request, record or
    /// anonymous allocation) that satisfy `pick`, with when each was last
    /// seen.
    fn empty_peers(&self, pick: impl Fn(&PeerState) -> bool) -> Vec<(Instant, PeerId)> {
        let busy: HashSet<&[u8]> = self
            .requests
            .iter()
            .map(|(p, _, _)| p)
            .chain(self.tombstones.iter().map(|(p, _, _)| p))
            .chain(self.done_refs.iter().map(|(p, _, _)| p))
            .collect();
        self.peers
            .iter()
            .filter(|(id, p)| p.anonymous == 0 && pick(p) && !busy.contains(id.as_slice()))
            .map(|(id, p)| (p.last_seen, id.clone()))
            .collect()
    }

    /// Drops the state of a peer with nothing left (see
    /// [`ReceiverCore::prune_peers`]); false if it had none.
    fn forget_peer_state(&mut self, id: &[u8]) -> bool {
        let Some(p) = self.peers.remove(id) else {
            return false;
        };
        self.peer_bytes -= p.charge;
        if p.extended() {
            self.pruned_hello.insert(id);
        }
        true
    }

    /// Per-peer state is at its bound and a new peer needs `need` bytes:
    /// forgets peers holding nothing, least recently seen first, until the
    /// new one fits with an eighth of the bound to spare (so a stream of
    /// new peers pays this scan once per many of them). Forgetting an
    /// empty peer is what pruning does a lease later: a kvferry peer keeps
    /// its semantics (and its data-plane secret) without a new `Hello`. So
    /// idle peers, heartbeating or not, cannot lock new peers out; only
    /// peers holding requests or records fill the bound, and those are
    /// bounded by the capacity and the record bound. A scan that frees
    /// nothing is not repeated for [`EVICT_RETRY`], so peers refused one
    /// after another cost O(1) each.
    fn evict_empty_peers(&mut self, need: usize, now: Instant) {
        if now < self.next_evict_scan {
            return;
        }
        let bound = self.cfg.bounds.max_peer_bytes;
        let target = bound.saturating_sub(need).saturating_sub(bound / 8);
        let mut idle = self.empty_peers(|_| true);
        idle.sort_unstable();
        for (_, id) in idle {
            if self.peer_bytes <= target {
                break;
            }
            if self.forget_peer_state(&id) {
                self.evicted_peers.push(id);
            }
        }
        if self.evicted_peers.is_empty() {
            self.next_evict_scan = now + EVICT_RETRY;
        } else {
            peer_warn!(
                self.log,
                now,
                forgotten = self.evicted_peers.len(),
                "per-peer state at its bound: forgot the least recently seen peers holding nothing"
            );
        }
    }
}

/// A sender socket's identity without its generation suffix: kvferry's
/// sender names its sockets `"{sender_id}-to-{endpoint}"` and, when it
/// replaces one, appends `#{generation}`. Identities without a numeric
/// `#` suffix are their own stem.
pub(crate) fn identity_stem(identity: &[u8]) -> &[u8] {
    match identity.iter().rposition(|&b| b == b'#') {
        Some(at)
            if at + 1 < identity.len() && identity[at + 1..].iter().all(u8::is_ascii_digit) =>
        {
            &identity[..at]
        }
        _ => identity,
    }
}

/// Hashes of kvferry peers (they said Hello) whose state was pruned, so a
/// peer that was only idle keeps kvferry semantics (TransferDone, fenced
/// cancel) on its next request without a new `Hello`. Bounded: the oldest
/// of [`PrunedPeers::CAPACITY`] hashes (8 bytes each) is forgotten first.
/// The hasher is seeded per process, so a peer cannot aim at a collision.
#[derive(Debug, Default)]
pub(super) struct PrunedPeers {
    hasher: std::collections::hash_map::RandomState,
    set: HashSet<u64>,
    order: VecDeque<u64>,
}

impl PrunedPeers {
    const CAPACITY: usize = 1 << 16;

    fn hash(&self, peer: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(peer)
    }

    fn insert(&mut self, peer: &[u8]) {
        let h = self.hash(peer);
        if self.set.insert(h) {
            self.order.push_back(h);
            while self.order.len() > Self::CAPACITY {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }

    /// True (and forgotten) if `peer` was a pruned kvferry peer.
    fn take(&mut self, peer: &[u8]) -> bool {
        let h = self.hash(peer);
        // The order entry stays until it ages out; `set` is the truth.
        self.set.remove(&h)
    }
}
