//! Time-driven work: admission timeouts, leases, records, unconsumed
//! deliveries and tombstones, and when the next of them is due (a method
//! group of [`ReceiverCore`]).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::peer_warn;
use crate::protocol::ErrorCode;

use super::super::bounds;
use super::{Cause, Delivered, Held, Output, PeerId, Phase, ReceiverCore};

impl ReceiverCore {
    /// Time-driven work: parked requests past their admission deadline,
    /// expired leases, quarantines and tombstones. Call when
    /// [`ReceiverCore::next_deadline`] has passed (calling earlier is harmless).
    pub fn tick(&mut self, now: Instant, out: &mut Vec<Output>) {
        for (peer, req_id) in self.queue.expire(now) {
            if let Some(r) = self.requests.remove(&peer, &req_id) {
                peer_warn!(self.log, now, req_id = %req_id, "admission timeout");
                self.bump_request("admission_timeout");
                self.finish_failed(
                    &req_id,
                    r,
                    ErrorCode::AdmissionTimeout,
                    Cause::Unfenced,
                    now,
                    out,
                );
            }
        }
        // Records first: slots an expired anonymous allocation (or, with
        // `auto_consume`, a consumed record) frees go to parked requests
        // before their own leases are checked.
        self.expire_records(now, out);
        self.expire_delivered(now, out);
        if now >= self.next_lease_scan {
            self.next_lease_scan = now + lease_scan_period(self.cfg.lease);
            self.expire_leases(now, out);
            self.prune_peers(now, out);
        }
        let dead: Vec<(PeerId, String)> = self
            .tombstones
            .iter()
            .filter(|(_, _, t)| t.until <= now)
            .map(|(p, id, _)| (p.to_vec(), id.to_owned()))
            .collect();
        for (peer, req_id) in dead {
            self.drop_tombstone(&peer, &req_id);
        }
        self.grant_parked(now, out);
    }

    /// Rolls back requests whose lease passed: no batch, `TransferDone` or
    /// (for kvferry peers) `Heartbeat` for a lease. A peer one of whose
    /// admitted requests lapsed is dead: every other request of it ends at
    /// the same time, parked ones included, so they are not admitted one
    /// after another after it died. (A parked request alone has no lease: a
    /// live sender whose requests all wait may be silent for longer than a
    /// lease; the admission timeout bounds it.)
    fn expire_leases(&mut self, now: Instant, out: &mut Vec<Output>) {
        let dead: HashSet<&[u8]> = self
            .requests
            .iter()
            .filter(|(peer, _, r)| {
                let alive = self.peers.get(*peer).map(|p| p.alive_until);
                let deadline = alive.map_or(r.lease_deadline, |a| a.max(r.lease_deadline));
                !matches!(r.phase, Phase::Parked { .. }) && deadline <= now
            })
            .map(|(p, _, _)| p)
            .collect();
        if dead.is_empty() {
            return;
        }
        let expired: Vec<(PeerId, String)> = self
            .requests
            .iter()
            .filter(|(p, _, _)| dead.contains(p))
            .map(|(p, id, _)| (p.to_vec(), id.to_owned()))
            .collect();
        for (peer, req_id) in expired {
            if let Some(r) = self.requests.remove(&peer, &req_id) {
                peer_warn!(self.log, now, req_id = %req_id, "lease expired: no batch, heartbeat or TransferDone; rolling back");
                self.bump_request("lease_expired");
                // The sender stopped renewing: take down its data plane.
                self.forget_sender(&r.peer);
                self.finish_failed(
                    &req_id,
                    r,
                    ErrorCode::LeaseExpired,
                    Cause::Unfenced,
                    now,
                    out,
                );
            }
        }
    }

    /// Drops expired LMCache reference records, and ends anonymous
    /// allocations past their lifetime: each copy it wrote is detached and
    /// its reference (like each pin's) dropped, so the slot is freed once
    /// no borrow holds it.
    fn expire_records(&mut self, now: Instant, out: &mut Vec<Output>) {
        let mut freed = false;
        while self.done_due.front().is_some_and(|(t, _, _)| *t <= now) {
            let Some((until, peer, req_id)) = self.done_due.pop_front() else {
                break;
            };
            if self
                .done_refs
                .get(&peer, &req_id)
                .is_none_or(|d| d.until != until)
            {
                continue; // cancelled or replaced since
            }
            if let Some(d) = self.done_refs.remove(&peer, &req_id) {
                self.record_bytes -= d.charge;
                if self.cfg.auto_consume {
                    freed |= self.consume_refs(d.held);
                }
            }
        }
        while self.anonymous.front().is_some_and(|a| a.until <= now) {
            let Some(a) = self.anonymous.pop_front() else {
                break;
            };
            self.record_bytes -= a.charge;
            if let Some(p) = self.peers.get_mut(&a.peer) {
                p.anonymous -= 1;
            }
            for (key, gen, wrote) in a.held {
                freed |= self.drop_anonymous_ref(&key, gen, wrote);
            }
        }
        if freed {
            self.grant_parked(now, out);
        }
    }

    /// Releases delivered requests nobody took within their lifetime.
    fn expire_delivered(&mut self, now: Instant, out: &mut Vec<Output>) {
        let mut freed = false;
        while self
            .delivered_due
            .front()
            .is_some_and(|(t, _, _)| *t <= now)
        {
            let Some((until, peer, req_id)) = self.delivered_due.pop_front() else {
                break;
            };
            if self
                .delivered
                .get(&peer, &req_id)
                .is_none_or(|d| d.until != Some(until))
            {
                continue; // taken or replaced since
            }
            let Some(d) = self.delivered.remove(&peer, &req_id) else {
                continue;
            };
            self.delivered_bytes -= d.charge;
            self.bump_request("unconsumed_expired");
            peer_warn!(self.log, now, req_id = %req_id, chunks = d.chunks.len(), "unconsumed chunks expired: released");
            for (key, gen, _, _) in d.chunks {
                let u = self.keys.unref_gen(&key, gen);
                freed |= self.release(u);
            }
        }
        if freed {
            self.grant_parked(now, out);
        }
    }

    /// Records a request completed with `TransferDone` for
    /// [`ReceiverCore::take`] (not kept when the records are at their
    /// bound: its chunks are then readable by key only).
    pub(super) fn remember_delivered(
        &mut self,
        peer: &[u8],
        req_id: &str,
        held: &[Held],
        now: Instant,
    ) {
        if held.is_empty() {
            return;
        }
        let charge = bounds::ended_cost(peer, req_id, held.iter().map(|h| h.key.as_str()));
        if self.delivered_bytes + charge > self.cfg.bounds.max_ended_bytes {
            peer_warn!(self.log, now, req_id, "records of complete requests at their bound: this request's chunks are readable by key only");
            return;
        }
        self.delivered_bytes += charge;
        let until = self.unconsumed_lifetime.map(|l| now + l);
        if let Some(t) = until {
            self.delivered_due
                .push_back((t, peer.to_vec(), req_id.to_owned()));
        }
        let chunks = held
            .iter()
            .map(|h| (h.key.clone(), h.gen, h.len, h.tokens))
            .collect();
        if let Some(old) = self.delivered.insert(
            peer,
            req_id,
            Delivered {
                chunks,
                until,
                charge,
            },
        ) {
            // The peer reused the id of a request nobody took: the older
            // one's chunks stay readable by key.
            self.delivered_bytes -= old.charge;
        }
    }

    /// The earliest instant at which [`ReceiverCore::tick`] has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut next = self.queue.next_deadline();
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        // Leases, records and idle peers are scanned while any exist; with
        // nothing left there is no deadline and the ctrl thread sleeps.
        if !self.requests.is_empty() || !self.peers.is_empty() {
            consider(self.next_lease_scan);
        }
        for t in self.tombstones.values() {
            consider(t.until);
        }
        if let Some((t, _, _)) = self.done_due.front() {
            consider(*t);
        }
        if let Some(a) = self.anonymous.front() {
            consider(a.until);
        }
        if let Some((t, _, _)) = self.delivered_due.front() {
            consider(*t);
        }
        next
    }
}

pub(super) fn lease_scan_period(lease: Duration) -> Duration {
    (lease / 4).max(Duration::from_millis(1))
}
