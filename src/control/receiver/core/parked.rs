//! Parked requests: their byte charge, and their admission once they fit
//! (a method group of [`ReceiverCore`]).

use std::time::Instant;

use tracing::debug;

use crate::protocol::ErrorCode;

use super::{Output, Phase, ReceiverCore};

impl ReceiverCore {
    /// Grants parked requests that now fit, in FIFO order, and processes
    /// their backlog.
    pub(super) fn grant_parked(&mut self, now: Instant, out: &mut Vec<Output>) {
        loop {
            let granted = self.queue.grant_ready(&self.ledger);
            if granted.is_empty() {
                return;
            }
            for ((peer, req_id), reservation) in granted {
                let Some(r) = self.requests.get_mut(&peer, &req_id) else {
                    continue;
                };
                let phase = std::mem::replace(&mut r.phase, Phase::Admitted { reservation });
                let Phase::Parked {
                    backlog,
                    since,
                    charge,
                } = phase
                else {
                    continue;
                };
                r.lease_deadline = now + self.cfg.lease;
                self.charge_parked(&peer, -(charge as isize));
                self.admission_waits
                    .push(now.saturating_duration_since(since));
                self.bump_request("admitted");
                debug!(req_id = %req_id, waited_us = now.saturating_duration_since(since).as_micros() as u64, "admitted after parking");
                for b in backlog {
                    match self.requests.get(&peer, &req_id).map(|r| &r.phase) {
                        Some(Phase::Admitted { .. }) => self.process_batch(&peer, b, now, out),
                        Some(Phase::AwaitingDone) => {
                            let msg = format!("batch for request {req_id} after its last batch");
                            self.fail_request(
                                &req_id,
                                &peer,
                                &b,
                                ErrorCode::ProtocolViolation,
                                msg,
                                now,
                                out,
                            );
                        }
                        _ => {
                            // Rolled back by an earlier batch of the backlog.
                            let code = self
                                .tombstones
                                .get(&peer, &req_id)
                                .map_or(ErrorCode::Cancelled, |t| t.code);
                            let msg =
                                format!("request {req_id} already ended with {}", code.as_str());
                            self.fail_reply(&peer, b.keys.len(), b.seq, code, msg, out);
                        }
                    }
                }
            }
        }
    }

    /// Adds `delta` bytes to what `peer`'s parked requests are charged.
    pub(super) fn charge_parked(&mut self, peer: &[u8], delta: isize) {
        self.parked_bytes = self.parked_bytes.saturating_add_signed(delta);
        if let Some(p) = self.peers.get_mut(peer) {
            p.parked_bytes = p.parked_bytes.saturating_add_signed(delta);
        }
    }
}
