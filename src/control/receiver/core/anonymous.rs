//! Anonymous allocations (`req_id == ""`): their allocation, lifetime,
//! cancel and release (a method group of [`ReceiverCore`]).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::peer_warn;
use crate::protocol::{AllocRequest, AllocResponse, ErrorCode, Message};

use super::super::bounds;
use super::alloc::chunk_len;
use super::{Anonymous, Output, ReceiverCore};

impl ReceiverCore {
    /// Allocation for `req_id == ""`: no admission wait, no tracking, but the
    /// chunks are still counted in the ledger so admitted requests keep their
    /// guarantee.
    ///
    /// Anonymous allocations have no owner request that a lease could
    /// cover, so each gets a lifetime ([`Bounds::anonymous_lifetime`]) and
    /// its record is charged against the record bound; they are refused
    /// (`protocol_violation`) when [`Bounds::allow_anonymous`] is off.
    ///
    /// [`Bounds::anonymous_lifetime`]: bounds::Bounds::anonymous_lifetime
    /// [`Bounds::allow_anonymous`]: bounds::Bounds::allow_anonymous
    pub(super) fn on_anonymous(
        &mut self,
        peer: &[u8],
        req: AllocRequest,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let n = req.keys.len();
        if !self.cfg.bounds.allow_anonymous {
            let msg = "anonymous allocations (req_id \"\") are disabled on this receiver: send a req_id and total_chunks".to_owned();
            return self.fail_reply(peer, n, req.seq, ErrorCode::ProtocolViolation, msg, out);
        }
        if let Err((code, msg)) = self.check_batch_shape(&req) {
            return self.fail_reply(peer, n, req.seq, code, msg, out);
        }
        let charge = bounds::ended_cost(peer, "", req.keys.iter().map(String::as_str));
        if self.record_bytes + charge > self.cfg.bounds.max_ended_bytes {
            let msg = format!(
                "receiver overloaded: anonymous allocations and ended-request records hold {} bytes (bound {}); retry later",
                self.record_bytes, self.cfg.bounds.max_ended_bytes
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
        }
        if let Err(msg) = self.peer_state(peer, now) {
            return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
        }
        let full = req.chunk_bytes().unwrap_or(0);
        let len_of = |i: usize| chunk_len(&req, full, i + 1 == n);
        // The copies to write: a key named twice at one length is written
        // once (the second pins the first), at two lengths twice.
        let fresh: HashSet<(&str, u64)> = req
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), len_of(i)))
            .filter(|&(k, len)| !self.keys.pinnable(k, len))
            .collect();
        let busy = !self.queue.is_empty();
        let reservation = if busy {
            None
        } else {
            self.ledger.try_admit(fresh.len()).ok()
        };
        let Some(mut reservation) = reservation else {
            let msg = format!(
                "no room for {} anonymous chunks ({} of {} committed, {} requests parked)",
                fresh.len(),
                self.ledger.stats().committed,
                self.cfg.capacity_chunks,
                self.queue.len()
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::AllocationFailed, msg, out);
        };
        let mut remote = Vec::with_capacity(n);
        let mut already = Vec::new();
        let mut held = Vec::with_capacity(n);
        for (i, key) in req.keys.iter().enumerate() {
            let len = len_of(i);
            if let Some((_, gen)) = self.keys.pin(key, len) {
                // Written already: no slot to write (see `process_batch`).
                already.push(i as i64);
                held.push((key.clone(), gen, false));
                continue;
            }
            let slot = match (reservation.allocate(1), self.slots.try_alloc(1)) {
                (Ok(()), Some(set)) => set.as_slice()[0],
                (ok, _) => {
                    if ok.is_ok() {
                        self.ledger.free(1);
                    }
                    peer_warn!(
                        self.log,
                        now,
                        "anonymous allocation found no slot although reserved"
                    );
                    remote.push(-1);
                    continue;
                }
            };
            let tokens =
                (i + 1 == n).then(|| req.last_chunk_toks.clamp(0, i64::from(u32::MAX)) as u32);
            let gen = self.keys.insert_new(key, slot, true, tokens, len);
            held.push((key.clone(), gen, true));
            remote.push(i64::from(slot));
        }
        drop(reservation);
        if !held.is_empty() {
            self.record_bytes += charge;
            if let Some(p) = self.peers.get_mut(peer) {
                p.anonymous += 1;
            }
            self.anonymous.push_back(Anonymous {
                peer: peer.to_vec(),
                held,
                until: now + self.anonymous_lifetime(),
                charge,
            });
        }
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::ok(remote, already, req.seq)),
        });
    }

    /// How long an anonymous allocation is kept: its lifetime, or with
    /// `auto_consume` the consume grace if shorter (no TransferDone comes
    /// for it either).
    fn anonymous_lifetime(&self) -> Duration {
        let life = self.cfg.bounds.anonymous_lifetime;
        if self.cfg.auto_consume {
            life.min(self.cfg.consume_grace)
        } else {
            life
        }
    }

    /// A cancel of anonymous allocations: releases the listed keys'
    /// references held by `peer`'s own anonymous allocations (one per
    /// listed key), nobody else's.
    pub(super) fn cancel_anonymous(
        &mut self,
        peer: &[u8],
        keys: &[String],
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        if self.peers.get(peer).is_none_or(|p| p.anonymous == 0) {
            return;
        }
        let mut wanted: HashMap<&str, usize> = HashMap::new();
        for k in keys {
            *wanted.entry(k.as_str()).or_default() += 1;
        }
        let mut released = Vec::new();
        for a in self.anonymous.iter_mut().filter(|a| a.peer == peer) {
            a.held
                .retain(|(key, gen, wrote)| match wanted.get_mut(key.as_str()) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        released.push((key.clone(), *gen, *wrote));
                        false
                    }
                    _ => true,
                });
        }
        let mut freed = false;
        for (key, gen, wrote) in released {
            freed |= self.drop_anonymous_ref(&key, gen, wrote);
        }
        if freed {
            self.grant_parked(now, out);
        }
    }

    /// Drops one reference an anonymous allocation held (`wrote`: its chunk
    /// was written, so the key goes with it, unquarantined); true if a slot
    /// was freed.
    pub(super) fn drop_anonymous_ref(&mut self, key: &str, gen: u64, wrote: bool) -> bool {
        let u = if wrote {
            self.keys.evict(key, gen, false)
        } else {
            self.keys.unref_gen(key, gen)
        };
        self.release(u)
    }
}
