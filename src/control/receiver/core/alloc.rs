//! Allocation for a request: its batches (`AllocRequest`), admission or
//! parking of its first, slot allocation and dedup, and the records an
//! LMCache request leaves (a method group of [`ReceiverCore`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tracing::debug;

use crate::peer_warn;
use crate::protocol::{AllocRequest, AllocResponse, ErrorCode, Message};

use super::super::bounds;
use super::{DoneRefs, Held, Outcome, Output, Phase, ReceiverCore, Request};

impl ReceiverCore {
    pub(super) fn on_alloc(
        &mut self,
        peer: &[u8],
        req: AllocRequest,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        if req.req_id.is_empty() {
            return self.on_anonymous(peer, req, now, out);
        }
        if let Some(t) = self.tombstones.get(peer, &req.req_id) {
            let code = t.code;
            let msg = format!(
                "request {} already ended with {}",
                req.req_id,
                code.as_str()
            );
            return self.fail_reply(peer, req.keys.len(), req.seq, code, msg, out);
        }
        let req_id = req.req_id.clone();
        match self.requests.get_mut(peer, &req_id) {
            Some(r) => match &mut r.phase {
                Phase::Parked {
                    backlog, charge, ..
                } => {
                    let cost = bounds::batch_cost(&req);
                    let peer_parked = self.peers.get(peer).map_or(0, |p| p.parked_bytes);
                    let b = &self.cfg.bounds;
                    if self.parked_bytes + cost > b.max_parked_bytes
                        || peer_parked + cost > b.max_peer_parked_bytes
                    {
                        let msg = format!(
                            "receiver overloaded: request {req_id} is parked and its queued batches reached the bound ({} bytes parked in all, {peer_parked} by this peer; bounds {} and {}); the request is rolled back",
                            self.parked_bytes, b.max_parked_bytes, b.max_peer_parked_bytes
                        );
                        self.bump_request("overloaded");
                        return self.fail_request(
                            &req_id,
                            peer,
                            &req,
                            ErrorCode::Overloaded,
                            msg,
                            now,
                            out,
                        );
                    }
                    *charge += cost;
                    backlog.push_back(req);
                    self.charge_parked(peer, cost as isize);
                }
                Phase::Admitted { .. } => self.process_batch(peer, req, now, out),
                Phase::AwaitingDone => {
                    let msg = format!("batch for request {req_id} after its last batch");
                    self.fail_request(
                        &req_id,
                        peer,
                        &req,
                        ErrorCode::ProtocolViolation,
                        msg,
                        now,
                        out,
                    );
                }
            },
            None => self.first_batch(peer, req, now, out),
        }
    }

    fn first_batch(&mut self, peer: &[u8], req: AllocRequest, now: Instant, out: &mut Vec<Output>) {
        let n = req.keys.len();
        if req.total_chunks <= 0 {
            self.bump_request("rejected");
            let msg = format!(
                "request {} has total_chunks = {}: every sender must declare the request's chunk count on each batch",
                req.req_id, req.total_chunks
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::ZeroTotalChunks, msg, out);
        }
        let total = req.total_chunks as usize;
        if total > self.cfg.capacity_chunks {
            self.bump_request("rejected");
            let msg = format!(
                "buffer too small: request {} needs {total} chunks, the receive buffer holds {}",
                req.req_id, self.cfg.capacity_chunks
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::BufferTooSmall, msg, out);
        }
        if let Err((code, msg)) = self.check_batch_shape(&req) {
            self.bump_request("rejected");
            return self.fail_reply(peer, n, req.seq, code, msg, out);
        }
        if n > total {
            self.bump_request("rejected");
            let msg = format!(
                "protocol violation: request {} sends {n} chunks in its first batch but declared total_chunks = {total}",
                req.req_id
            );
            return self.fail_reply(peer, n, req.seq, ErrorCode::ProtocolViolation, msg, out);
        }
        let deadline = now + self.cfg.admission_timeout;
        let extended = match self.peer_state(peer, now) {
            Ok(p) => p.extended(),
            Err(msg) => {
                self.bump_request("overloaded");
                return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
            }
        };
        let req_id = req.req_id.clone();
        let key = (peer.to_vec(), req_id.clone());
        let lease = now + self.cfg.lease;
        match self
            .queue
            .admit_or_park(&self.ledger, key.clone(), total, deadline)
        {
            Ok(Some(reservation)) => {
                self.bump_request("admitted");
                self.admission_waits.push(Duration::ZERO);
                let phase = Phase::Admitted { reservation };
                let r = Request::new(peer, extended, total, lease, phase);
                self.requests.insert(peer, &req_id, r);
                self.note_admitted();
                self.process_batch(peer, req, now, out);
            }
            Ok(None) => {
                let charge = bounds::request_cost(peer, &req_id) + bounds::batch_cost(&req);
                let peer_parked = self.peers.get(peer).map_or(0, |p| p.parked_bytes);
                let b = &self.cfg.bounds;
                if self.parked_bytes + charge > b.max_parked_bytes
                    || peer_parked + charge > b.max_peer_parked_bytes
                {
                    self.queue.remove(&key);
                    let msg = format!(
                        "receiver overloaded: request {req_id} does not fit now and parked requests hold {} bytes ({peer_parked} of this peer; bounds {} and {}); retry later",
                        self.parked_bytes, b.max_parked_bytes, b.max_peer_parked_bytes
                    );
                    self.bump_request("overloaded");
                    return self.fail_reply(peer, n, req.seq, ErrorCode::Overloaded, msg, out);
                }
                debug!(req_id = %req_id, total, "parked: does not fit yet");
                self.bump_request("parked");
                self.charge_parked(peer, charge as isize);
                let mut backlog = VecDeque::new();
                backlog.push_back(req);
                let phase = Phase::Parked {
                    backlog,
                    since: now,
                    charge,
                };
                let r = Request::new(peer, extended, total, lease, phase);
                self.requests.insert(peer, &req_id, r);
            }
            Err(e) => {
                self.bump_request("rejected");
                let msg = format!("request {req_id} refused: {e}");
                self.fail_reply(peer, n, req.seq, ErrorCode::BufferTooSmall, msg, out);
            }
        }
    }

    /// Allocates one batch of an admitted request and answers it.
    pub(super) fn process_batch(
        &mut self,
        peer: &[u8],
        req: AllocRequest,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let req_id = req.req_id.clone();
        let Some(mut r) = self.requests.remove(peer, &req_id) else {
            return;
        };
        let n = req.keys.len();
        let check = if req.total_chunks < 0 || req.total_chunks as usize != r.total {
            Err((
                ErrorCode::InconsistentRequest,
                format!(
                    "request {req_id} changed total_chunks from {} to {}",
                    r.total, req.total_chunks
                ),
            ))
        } else if r.seen + n > r.total {
            Err((
                ErrorCode::ProtocolViolation,
                format!(
                    "protocol violation: request {req_id} sent {} chunks, more than its declared total_chunks = {}",
                    r.seen + n,
                    r.total
                ),
            ))
        } else {
            self.check_batch_shape(&req)
        };
        if let Err((code, msg)) = check {
            self.requests.insert(peer, &req_id, r);
            return self.fail_request(&req_id, peer, &req, code, msg, now, out);
        }
        let Phase::Admitted { reservation } = &mut r.phase else {
            // Only admitted requests reach here (callers check the phase).
            self.requests.insert(peer, &req_id, r);
            return;
        };
        let mut remote = Vec::with_capacity(n);
        let mut already = Vec::new();
        let first_new = r.held.len();
        let mut failure = None;
        let full = req.chunk_bytes().unwrap_or(0);
        for (i, key) in req.keys.iter().enumerate() {
            let tokens =
                (i + 1 == n).then(|| req.last_chunk_toks.clamp(0, i64::from(u32::MAX)) as u32);
            let len = chunk_len(&req, full, i + 1 == n);
            // Dedup only against a written copy (`pin` skips copies still
            // being written): "already sent" then means the bytes are in
            // place, so the sender may count the chunk complete at once.
            if let Some((_slot, gen)) = self.keys.pin(key, len) {
                // The chunk needs no slot, so its share of the reservation
                // goes back at once (allocate it, then free it).
                if reservation.allocate(1).is_ok() {
                    self.ledger.free(1);
                }
                r.held.push(Held {
                    key: key.clone(),
                    gen,
                    wrote: false,
                    granted: false,
                    len,
                    tokens,
                });
                // LMCache's reply shape: `remote_indexes` lists only the
                // keys to write, so a dedup hit gets no entry there
                // (`len(remote) == len(keys) - len(already)`).
                already.push(i as i64);
                continue;
            }
            if reservation.allocate(1).is_err() {
                failure = Some(format!(
                    "request {req_id}: reservation exhausted (internal accounting error)"
                ));
                break;
            }
            let Some(set) = self.slots.try_alloc(1) else {
                self.ledger.free(1);
                failure = Some(format!(
                    "request {req_id}: no free slot although admitted (internal accounting error)"
                ));
                break;
            };
            let slot = set.as_slice()[0];
            if let Some(token) = self.data_keys.token_of(peer) {
                self.grants.grant(slot, token);
            }
            // A new key, or one whose copies are all still being written:
            // this request writes its own copy (its reservation counts it).
            let gen = self.keys.insert_new(key, slot, !r.extended, tokens, len);
            r.held.push(Held {
                key: key.clone(),
                gen,
                wrote: true,
                granted: false,
                len,
                tokens,
            });
            remote.push(i64::from(slot));
        }
        if let Some(msg) = failure {
            self.requests.insert(peer, &req_id, r);
            return self.fail_request(
                &req_id,
                peer,
                &req,
                ErrorCode::AllocationFailed,
                msg,
                now,
                out,
            );
        }
        for h in &mut r.held[first_new..] {
            h.granted = true;
        }
        r.seen += n;
        r.lease_deadline = now + self.cfg.lease;
        debug!(req_id = %req_id, chunks = n, dedup = already.len(), seen = r.seen, total = r.total, last = req.is_last_batch, "batch allocated");
        out.push(Output::Send {
            peer: peer.to_vec(),
            message: Message::AllocResponse(AllocResponse::ok(remote, already, req.seq)),
        });
        if req.is_last_batch {
            // Whatever was reserved but not sent goes back now.
            if let Phase::Admitted { reservation } =
                std::mem::replace(&mut r.phase, Phase::AwaitingDone)
            {
                drop(reservation);
            }
            if r.extended {
                self.requests.insert(peer, &req_id, r);
            } else {
                // LMCache semantics: tracking ends with the last batch; the
                // keys stay for the decoder, which learns of them from the
                // proxy. What the request holds is remembered for a lease,
                // so the peer's own late CancelNotif releases exactly that.
                self.remember_done_refs(peer, &req_id, r.held, now);
                self.bump_request("completed");
                out.push(Output::Finished {
                    req_id,
                    outcome: Outcome::Ready,
                });
            }
        } else {
            self.requests.insert(peer, &req_id, r);
        }
    }

    /// Validates the chunk geometry against the slot size.
    pub(super) fn check_batch_shape(&self, req: &AllocRequest) -> Result<(), (ErrorCode, String)> {
        if req.keys.is_empty() {
            return Ok(());
        }
        match req.chunk_bytes() {
            Ok(b) if b <= self.cfg.chunk_bytes => Ok(()),
            Ok(b) => Err((
                ErrorCode::ChunkTooLarge,
                format!(
                    "chunk of shape {:?} {} is {b} bytes, larger than this receiver's {}-byte slots",
                    req.shape, req.dtype, self.cfg.chunk_bytes
                ),
            )),
            Err(e) => Err((ErrorCode::BadMessage, format!("bad chunk geometry: {e}"))),
        }
    }

    /// Records an LMCache request's references for its late `CancelNotif`
    /// (not kept when the records are at their bound: the cancel then
    /// releases nothing and the decoder consumes the keys as usual).
    fn remember_done_refs(&mut self, peer: &[u8], req_id: &str, held: Vec<Held>, now: Instant) {
        let held: Vec<(String, u64)> = held.into_iter().map(|h| (h.key, h.gen)).collect();
        let charge = bounds::ended_cost(peer, req_id, held.iter().map(|(k, _)| k.as_str()));
        if self.record_bytes + charge > self.cfg.bounds.max_ended_bytes {
            if self.cfg.auto_consume {
                // A counting decoder must still take these, or they leak.
                peer_warn!(self.log, now, req_id, "ended-request records at their bound: consuming this request's chunks without the grace");
                self.consume_refs(held);
            } else {
                peer_warn!(self.log, now, req_id, "ended-request records at their bound: a later cancel of this request will release nothing");
            }
            return;
        }
        self.record_bytes += charge;
        // Kept for the peer's late cancel for a lease; with `auto_consume`,
        // until the grace after which the chunks count as delivered (an
        // LMCache sender's writes cannot be observed; it sends no
        // TransferDone) and are released.
        let until = now
            + if self.cfg.auto_consume {
                self.cfg.consume_grace
            } else {
                self.cfg.lease
            };
        self.done_due
            .push_back((until, peer.to_vec(), req_id.to_owned()));
        if let Some(old) = self.done_refs.insert(
            peer,
            req_id,
            DoneRefs {
                held,
                until,
                charge,
            },
        ) {
            self.record_bytes -= old.charge;
        }
    }
}

/// Bytes of a chunk of `req`'s batch whose full chunk is `full` bytes
/// (`req.chunk_bytes()`): `full`, except the batch's last chunk when the
/// shape is one-dimensional — `[tokens]`, kvferry's byte-shaped default —
/// which is `last_chunk_toks` of them. (For a multi-dimensional shape the
/// token axis depends on `fmt`, which the receiver does not interpret: a
/// short last chunk is reported whole, with its token count.)
pub(super) fn chunk_len(req: &AllocRequest, full: u64, last: bool) -> u64 {
    match req.shape.as_slice() {
        [tokens] if last && *tokens > 0 => {
            let toks = req.last_chunk_toks.clamp(0, *tokens) as u64;
            full / *tokens as u64 * toks
        }
        _ => full,
    }
}
