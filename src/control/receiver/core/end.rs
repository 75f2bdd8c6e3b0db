//! The sender's end of a request: `CancelNotif` and `TransferDone` (a
//! method group of [`ReceiverCore`]).

use std::time::Instant;

use tracing::debug;

use crate::peer_warn;
use crate::protocol::{AllocResponse, CancelNotif, ErrorCode, Message};

use super::{Cause, Outcome, Output, PeerState, Phase, ReceiverCore};

impl ReceiverCore {
    pub(super) fn on_cancel(
        &mut self,
        peer: &[u8],
        c: CancelNotif,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        // Only a kvferry sender (it said Hello) promises that its writes for
        // the request completed before it cancels; an LMCache sender's
        // cancel is no fence, so its quarantined slots wait for the grace.
        // Everything below is looked up under (peer, req_id): a cancel only
        // ever touches the canceller's own requests.
        let fenced = self.peers.get(peer).is_some_and(PeerState::extended);
        if let Some(r) = self.requests.remove(peer, &c.req_id) {
            debug!(req_id = %c.req_id, "cancelled by sender");
            self.bump_request("cancelled");
            self.finish_failed(
                &c.req_id,
                r,
                ErrorCode::Cancelled,
                Cause::SenderCancel,
                now,
                out,
            );
            // The sender ended it: nothing later needs the tombstone's error.
            if fenced {
                self.drop_tombstone(peer, &c.req_id);
            }
        } else if self.tombstones.contains(peer, &c.req_id) {
            // The fence for a request the receiver already failed: the
            // sender's in-flight writes are done, quarantined slots are safe.
            if fenced {
                self.drop_tombstone(peer, &c.req_id);
            }
        } else if let Some(d) = self.done_refs.remove(peer, &c.req_id) {
            // An LMCache sender cancelling a request whose tracking already
            // ended: release the references that request held (the keys the
            // message lists are not trusted).
            self.record_bytes -= d.charge;
            let mut freed = false;
            for (key, gen) in d.held {
                let u = self.keys.unref_gen(&key, gen);
                freed |= self.release(u);
            }
            if freed {
                self.grant_parked(now, out);
            }
        } else if c.req_id.is_empty() {
            self.cancel_anonymous(peer, &c.keys, now, out);
        } else if self.requests.owned_by_other(peer, &c.req_id)
            || self.tombstones.owned_by_other(peer, &c.req_id)
            || self.done_refs.owned_by_other(peer, &c.req_id)
        {
            peer_warn!(self.log, now, req_id = %c.req_id, "CancelNotif for another peer's request: ignored");
            let msg = format!(
                "request {} belongs to another peer: this cancel changed nothing",
                c.req_id
            );
            return self.fail_reply(peer, c.keys.len(), c.seq, ErrorCode::NotOwner, msg, out);
        }
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::ok(Vec::new(), Vec::new(), c.seq)),
        });
    }

    pub(super) fn on_transfer_done(
        &mut self,
        peer: &[u8],
        req_id: &str,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        match self.requests.get(peer, req_id).map(|r| &r.phase) {
            Some(Phase::AwaitingDone) => {
                if !self.seal_grants(peer, req_id) {
                    let msg = format!(
                        "TransferDone for request {req_id} while a write into it is still landing"
                    );
                    peer_warn!(self.log, now, req_id, "{msg}");
                    if let Some(r) = self.requests.remove(peer, req_id) {
                        self.bump_request("failed");
                        self.bump_error(ErrorCode::ProtocolViolation);
                        self.finish_failed(
                            req_id,
                            r,
                            ErrorCode::ProtocolViolation,
                            Cause::Unfenced,
                            now,
                            out,
                        );
                    }
                    return;
                }
                if let Some(r) = self.requests.remove(peer, req_id) {
                    // The copies this request wrote are now in place: from
                    // here on, later requests are told "already sent".
                    for h in r.held.iter().filter(|h| h.wrote) {
                        self.keys.mark_ready(&h.key, h.gen);
                    }
                    if !self.cfg.auto_consume {
                        self.remember_delivered(peer, req_id, &r.held, now);
                    }
                    if self.cfg.auto_consume {
                        // A decoder that only counts: drop this request's
                        // references at once.
                        for h in &r.held {
                            let u = self.keys.unref_gen(&h.key, h.gen);
                            if self.release(u) {
                                self.grant_parked(now, out);
                            }
                        }
                    }
                    self.bump_request("completed");
                    out.push(Output::Finished {
                        req_id: req_id.to_owned(),
                        outcome: Outcome::Ready,
                    });
                }
            }
            Some(_) => {
                peer_warn!(
                    self.log,
                    now,
                    req_id,
                    "TransferDone before the request's last batch; ignored"
                );
                self.bump_error(ErrorCode::ProtocolViolation);
            }
            None if self.requests.owned_by_other(peer, req_id) => {
                peer_warn!(
                    self.log,
                    now,
                    req_id,
                    "TransferDone for another peer's request; ignored"
                );
                self.bump_error(ErrorCode::NotOwner);
            }
            None => debug!(req_id, "TransferDone for an unknown request; ignored"),
        }
    }

    /// Ends the TCP write grants of the slots the request `(peer, req_id)`
    /// wrote (it completed); false if a write is landing in one of them
    /// right now.
    fn seal_grants(&self, peer: &[u8], req_id: &str) -> bool {
        let Some(r) = self.requests.get(peer, req_id) else {
            return true;
        };
        let mut all = true;
        for h in r.held.iter().filter(|h| h.wrote) {
            if let Some(e) = self.keys.get_gen(&h.key, h.gen) {
                all &= self.grants.seal(e.slot);
            }
        }
        all
    }
}
