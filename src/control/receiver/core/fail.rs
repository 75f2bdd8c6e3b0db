//! Failure: error replies, a tracked request's rollback, and its tombstone
//! (a method group of [`ReceiverCore`]).

use std::time::Instant;

use tracing::debug;

use crate::peer_warn;
use crate::protocol::{AllocRequest, AllocResponse, ErrorCode, Message};

use super::super::bounds;
use super::{Cause, Outcome, Output, Phase, ReceiverCore, Request, Tombstone};

impl ReceiverCore {
    pub(super) fn fail_reply(
        &mut self,
        peer: &[u8],
        n_keys: usize,
        seq: Option<u64>,
        code: ErrorCode,
        msg: String,
        out: &mut Vec<Output>,
    ) {
        self.bump_error(code);
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::failure(n_keys, seq, code, msg)),
        });
    }

    /// Rolls back a tracked request because of `req`'s batch and answers it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fail_request(
        &mut self,
        req_id: &str,
        peer: &[u8],
        req: &AllocRequest,
        code: ErrorCode,
        msg: String,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        peer_warn!(self.log, now, req_id, code = code.as_str(), "{msg}");
        if let Some(r) = self.requests.remove(peer, req_id) {
            self.bump_request("failed");
            self.finish_failed(req_id, r, code, Cause::Unfenced, now, out);
        }
        self.fail_reply(peer, req.keys.len(), req.seq, code, msg, out);
    }

    /// Ends a request in failure: answers its parked batches, drops its
    /// reservation and references, quarantines slots that may still be
    /// written, and leaves a tombstone.
    pub(super) fn finish_failed(
        &mut self,
        req_id: &str,
        r: Request,
        code: ErrorCode,
        cause: Cause,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        match r.phase {
            Phase::Parked {
                backlog, charge, ..
            } => {
                self.queue.remove(&(r.peer.clone(), req_id.to_owned()));
                self.charge_parked(&r.peer, -(charge as isize));
                for b in backlog {
                    let msg = format!(
                        "request {req_id} ended while waiting for admission: {}",
                        code.as_str()
                    );
                    self.fail_reply(&r.peer, b.keys.len(), b.seq, code, msg, out);
                }
            }
            Phase::Admitted { reservation } => drop(reservation),
            Phase::AwaitingDone => {}
        }
        let fence = !(cause == Cause::SenderCancel && r.extended);
        let mut quarantined = Vec::new();
        for h in &r.held {
            if h.wrote {
                // A tracked request never completed, so the bytes it was
                // writing are not whole: its copy is detached (nobody new
                // pins or reads it). A kvferry peer's copy was never pinned
                // (only ready copies are), but an LMCache peer's keys are
                // pinnable from allocation on, so others may hold it: their
                // references keep the slot until they go, and a granted
                // slot is also kept until the fence.
                let quarantine = h.granted && fence;
                let u = self.keys.evict(&h.key, h.gen, quarantine);
                self.release(u);
                if quarantine && self.keys.get_gen(&h.key, h.gen).is_some() {
                    quarantined.push((h.key.clone(), h.gen));
                }
            } else {
                let u = self.keys.unref_gen(&h.key, h.gen);
                self.release(u);
            }
        }
        if !quarantined.is_empty() {
            debug!(
                req_id,
                slots = quarantined.len(),
                "slots quarantined until the fence"
            );
        }
        let until = now + self.cfg.quarantine_grace;
        let charge =
            bounds::ended_cost(&r.peer, req_id, quarantined.iter().map(|(k, _)| k.as_str()));
        // A tombstone that quarantines nothing only answers late batches;
        // past the record bound it is not kept (a late batch then starts a
        // new request of the same peer, which its lease bounds). One that
        // quarantines is always kept: the slots bound those.
        if quarantined.is_empty() && self.record_bytes + charge > self.cfg.bounds.max_ended_bytes {
            peer_warn!(
                self.log,
                now,
                req_id,
                "ended-request records at their bound: no tombstone kept"
            );
        } else {
            self.record_bytes += charge;
            if let Some(old) = self.tombstones.insert(
                &r.peer,
                req_id,
                Tombstone {
                    code,
                    quarantined,
                    until,
                    charge,
                },
            ) {
                // Cannot happen (a request and its tombstone never coexist),
                // but never leak a quarantine.
                self.record_bytes -= old.charge;
                for (key, gen) in old.quarantined {
                    let u = self.keys.unquarantine(&key, gen);
                    self.release(u);
                }
            }
        }
        out.push(Output::Finished {
            req_id: req_id.to_owned(),
            outcome: Outcome::Failed(code),
        });
    }

    /// Removes `peer`'s tombstone of `req_id` and ends the quarantine of
    /// the copies it kept; each slot is freed unless a reference still
    /// holds it.
    pub(super) fn drop_tombstone(&mut self, peer: &[u8], req_id: &str) {
        if let Some(t) = self.tombstones.remove(peer, req_id) {
            self.record_bytes -= t.charge;
            for (key, gen) in t.quarantined {
                let u = self.keys.unquarantine(&key, gen);
                self.release(u);
            }
        }
    }
}
