//! ctrl's timers: the hello timeouts, reply timeouts and heartbeats, and
//! when ctrl must wake next (a method group of [`Ctrl`]).

use std::time::{Duration, Instant};

use crate::protocol::{encode_into, AllocResponse, ErrorCode, Heartbeat, Message};

use super::super::peer::{HelloTimeout, Mode, Outstanding};
use super::super::table::ReqState;
use super::Ctrl;

impl Ctrl {
    /// Handshake timeouts, reply timeouts and heartbeats, as of `now` (the
    /// step's clock reading; the decisions are the peer's, `peer.rs`).
    pub(super) fn timers(&mut self, now: Instant) {
        let limits = self.limits;
        for i in 0..self.peers.len() {
            let fallback = self.static_peers.contains_key(&self.peers[i].endpoint);
            // A Hello on a same-host endpoint times out back to the given
            // one (a fresh Hello there, not yet due), never into LMCache
            // mode.
            self.local_control_unanswered(i, now);
            match self.peers[i].hello_timeout(now, &limits, fallback) {
                Some(HelloTimeout::Unanswered) => {
                    self.hello_unanswered(i, now, limits.hello_answer);
                }
                Some(HelloTimeout::Fallback) => {
                    let mut p = self.peers.swap_remove(i);
                    // Kept for a late HelloAck (see `apply_late_hello`).
                    let prepared = p.prepared.take();
                    self.become_legacy(&mut p);
                    self.peers.push(p);
                    let last = self.peers.len() - 1;
                    self.peers.swap(i, last);
                    let old = self.replace_socket(i);
                    self.listen_late(i, old, prepared, now + limits.reply);
                    self.dirty_peer(i);
                }
                None => {}
            }
            if self.peers[i].replies_overdue(now, limits.reply) {
                self.reply_timeout(i, now, limits.reply);
            }
            if self.peers[i].heartbeat_due(now, limits.heartbeat) {
                self.peers[i].last_heartbeat = now;
                let ep = &self.peers[i].endpoint;
                let active = self
                    .shared
                    .table
                    .lock()
                    .reqs
                    .values()
                    .any(|r| &r.c.receiver == ep && !matches!(r.p.state, ReqState::Done(_)));
                if active {
                    self.buf.clear();
                    let hbm = Message::Heartbeat(Heartbeat {
                        sender_id: self.shared.cfg.sender_id.clone(),
                    });
                    encode_into(&hbm, &mut self.buf);
                    let _ = self.peers[i].send_raw(&self.buf);
                }
            }
        }
    }

    /// Fails the requests whose messages went unanswered too long.
    pub(super) fn reply_timeout(&mut self, i: usize, now: Instant, limit: Duration) {
        let late: Vec<Outstanding> = if self.peers[i].mode == Mode::Legacy {
            // Order is lost: start a fresh connection and fail all in it.
            let p = &mut self.peers[i];
            let v: Vec<Outstanding> = p.in_order.drain().collect();
            self.renew_socket(i);
            v
        } else {
            let p = &mut self.peers[i];
            let seqs: Vec<u64> = p
                .by_seq
                .iter()
                .filter(|(_, (_, t))| now.saturating_duration_since(*t) >= limit)
                .map(|(s, _)| *s)
                .collect();
            seqs.into_iter()
                .filter_map(|s| p.by_seq.remove(&s).map(|(o, _)| o))
                .collect()
        };
        for o in late {
            if let Outstanding::Batch(id) = o {
                let resp = AllocResponse::failure(
                    1,
                    None,
                    ErrorCode::ReplyTimeout,
                    format!(
                        "no reply from {} within {:?}",
                        self.peers[i].endpoint, limit
                    ),
                );
                // Reuse the refusal path (aborts the request, frees its data).
                let req = self.shared.table.lock().batches.get(&id).map(|b| b.req);
                self.on_batch_reply(i, id, resp);
                if let Some(req) = req {
                    self.dirty.insert(req);
                }
            }
        }
    }

    /// When ctrl must wake next, as of `now` (the shell's clock reading
    /// before it sleeps).
    pub(super) fn next_timer(&self, now: Instant) -> Option<Instant> {
        let peers = self.peers.iter().filter_map(|p| {
            let fallback = self.static_peers.contains_key(&p.endpoint);
            p.next_deadline(now, &self.limits, fallback)
        });
        // Credit returns with completions, which wake us; this is a safety
        // net only.
        let backlog = (!self.backlog.is_empty()).then(|| now + Duration::from_millis(10));
        peers.chain(backlog).min()
    }
}
