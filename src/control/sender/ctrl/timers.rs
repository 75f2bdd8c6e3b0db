//! ctrl's timers: the hello timeouts, reply timeouts and heartbeats, and
//! when ctrl must wake next (a method group of [`Ctrl`]).

use std::time::{Duration, Instant};

use crate::protocol::{encode_into, AllocResponse, ErrorCode, Heartbeat, Message};

use super::super::peer::{Mode, Outstanding};
use super::super::table::ReqState;
use super::Ctrl;

impl Ctrl {
    /// Handshake timeouts, reply timeouts and heartbeats.
    pub(super) fn timers(&mut self, now: Instant) {
        let cfg = &self.shared.cfg;
        let (hello_timeout, hello_answer_timeout, reply_timeout, hb) = (
            cfg.hello_timeout,
            cfg.hello_answer_timeout,
            cfg.reply_timeout,
            cfg.heartbeat_interval,
        );
        for i in 0..self.peers.len() {
            if let Mode::Handshaking(since) = self.peers[i].mode {
                let waited = now.saturating_duration_since(since);
                let lmcache_fallback = self.static_peers.contains_key(&self.peers[i].endpoint);
                if !lmcache_fallback && waited >= hello_answer_timeout {
                    self.hello_unanswered(i, now, hello_answer_timeout);
                } else if lmcache_fallback && waited >= hello_timeout {
                    let mut p = self.peers.swap_remove(i);
                    // Kept for a late HelloAck (see `apply_late_hello`).
                    let prepared = p.prepared.take();
                    self.become_legacy(&mut p);
                    self.peers.push(p);
                    let last = self.peers.len() - 1;
                    self.peers.swap(i, last);
                    let old = self.replace_socket(i);
                    self.listen_late(i, old, prepared, now + reply_timeout);
                    self.dirty_peer(i);
                }
            }
            if self.peers[i]
                .oldest()
                .is_some_and(|t| now.saturating_duration_since(t) >= reply_timeout)
            {
                self.reply_timeout(i, now, reply_timeout);
            }
            if self.peers[i].mode == Mode::Extended
                && now.saturating_duration_since(self.peers[i].last_heartbeat) >= hb
            {
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

    pub(super) fn next_timer(&self) -> Option<Instant> {
        let cfg = &self.shared.cfg;
        let mut next: Option<Instant> = None;
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        for p in &self.peers {
            if let Mode::Handshaking(since) = p.mode {
                // The LMCache fallback, or (none configured) giving up.
                consider(if self.static_peers.contains_key(&p.endpoint) {
                    since + cfg.hello_timeout
                } else {
                    since + cfg.hello_answer_timeout
                });
            }
            if let Some(t) = p.oldest() {
                consider(t + cfg.reply_timeout);
            }
            if p.mode == Mode::Extended {
                consider(p.last_heartbeat + cfg.heartbeat_interval);
            }
            if let Some(late) = p.late.as_ref().filter(|l| l.ack.is_none()) {
                consider(late.until);
            }
            if p.mode == Mode::Reconnecting {
                // The backoff's end (only if still ahead: once it passed, the
                // re-handshake waits for the aborts, whose completions wake us).
                if let Some(due) = p.last_hello.map(|t| t + cfg.rehello_backoff) {
                    if due > Instant::now() {
                        consider(due);
                    }
                }
            }
        }
        if !self.backlog.is_empty() {
            // Credit returns with completions, which wake us; this is a
            // safety net only.
            consider(Instant::now() + Duration::from_millis(10));
        }
        next
    }
}
