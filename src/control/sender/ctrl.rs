//! The sender's `ctrl` thread: the only thread touching ZMQ sockets. It
//! drains the submission ring and the poll thread's completion ring, runs
//! the handshake and the AllocRequest / AllocResponse exchange with each
//! receiver, posts writes to the transport and applies their completions,
//! sends CancelNotif after fenced aborts, and ProxyNotif + TransferDone once
//! a request is complete.
//!
//! The per-request protocol decisions are the sender core's (`core.rs`);
//! this thread executes them. The handshake with each receiver is in
//! `ctrl/handshake.rs`, the timers in `ctrl/timers.rs`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use tracing::{debug, debug_span, warn};

use kvferry_ring::spsc::Consumer;

use super::reply::RemoteSlots;
use crate::protocol::{
    decode, encode_into, AllocResponse, CancelNotif, ErrorCode, Message, ProxyFailed, ProxyNotif,
    TransferDone,
};
use crate::stats::{Counter, Stage};
use crate::transport::{Completion, CompletionStatus, PeerIndex, Poster, RemoteBuffer, WriteOp};
use crate::zmq_io::{readable, Reactor};

use super::core::{AbortStep, ReplyStep, Rules};
use super::peer::{Limits, Mode, Outstanding, Peer};
use super::submit::Taken;
use super::table::{Batch, BatchData, InFlight, ReqKey, ReqState, Table};
use super::wire::AllocRequestRef;
use super::{RequestStatus, Shared};

mod handshake;
mod local;
mod timers;

/// The engine's sender rules (the model check also runs others).
const RULES: Rules = Rules::KVFERRY;

/// Longest sleep with no timer due (a safety net; real work wakes the thread).
const MAX_SLEEP: Duration = Duration::from_secs(3600);

/// How long a socket replaced for a re-handshake keeps sending what was
/// queued on it (the CancelNotifs of the aborted requests) after it is
/// closed, in milliseconds. Closing does not block on it.
const OLD_SOCKET_LINGER_MS: i32 = 1000;

pub(super) struct Ctrl {
    shared: Arc<Shared>,
    poster: Box<dyn Poster>,
    reactor: Reactor,
    /// The id the next batch taken from the submission ring gets.
    next_batch: u64,
    peers: Vec<Peer>,
    peer_by_endpoint: HashMap<String, usize>,
    static_peers: HashMap<String, RemoteBuffer>,
    proxy: Option<zmq::Socket>,
    /// Writes built but not yet accepted by the transport (credit).
    backlog: VecDeque<WriteOp>,
    next_seq: u64,
    next_work: u64,
    buf: Vec<u8>,
    dirty: HashSet<ReqKey>,
    /// Answered batches whose pending bytes wait in the staging allocator's
    /// FIFO queue, by batch id.
    staging_requests: HashMap<u64, crate::slots::SlotRequest>,
    /// Terminal statuses to announce (callbacks) once the lock is released.
    finished: Vec<(String, RequestStatus)>,
    /// The peer-level time limits (from the config).
    limits: Limits,
    /// The clock reading of the current step (`run` reads it once per
    /// step): what peer-level stamps (`Hello` and send times) use.
    now: Instant,
    /// Requests the table forgot, to forget in the name index once the
    /// table lock is released (`announce`).
    forgotten: Vec<(Arc<str>, ReqKey)>,
    /// Reused buffers of the write coalescer (one write per chunk in,
    /// merged writes and their run lengths out).
    chunk_ops: Vec<WriteOp>,
    merged: Vec<WriteOp>,
    runs: Vec<usize>,
    // Declared after `poster`, so dropped after it (fields drop in order):
    // the leases of writes still in flight let their registered memory go
    // only once the transport, which may still read it, is gone.
    /// Writes built (in `backlog`) or posted and not yet completed, by work
    /// id. Ctrl's own: it inserts an entry before posting its op and
    /// removes it when it applies the op's completion.
    inflight: HashMap<u64, InFlight>,
    /// The poll thread's completions, in transport order (poll.rs).
    from_poll: Consumer<Completion>,
}

impl Drop for Ctrl {
    /// Also on a panic: callers stop waiting for a full submission ring.
    fn drop(&mut self) {
        // Release: pairs with the Acquire load in `Shared::submit_batch`;
        // the flag publishes nothing else.
        self.shared.ctrl_gone.store(true, Ordering::Release);
    }
}

impl Ctrl {
    pub fn new(
        shared: Arc<Shared>,
        poster: Box<dyn Poster>,
        reactor: Reactor,
        from_poll: Consumer<Completion>,
    ) -> Result<Self, super::SenderError> {
        let proxy = match &shared.cfg.proxy {
            Some(ep) => {
                let s = crate::zmq_io::context()
                    .socket(zmq::PUSH)
                    .map_err(super::SenderError::socket)?;
                s.set_linger(1000).map_err(super::SenderError::socket)?;
                s.set_sndhwm(0).map_err(super::SenderError::socket)?;
                s.connect(ep).map_err(super::SenderError::socket)?;
                Some(s)
            }
            None => None,
        };
        let static_peers = shared.cfg.static_peers.iter().cloned().collect();
        let limits = Limits::new(&shared.cfg);
        Ok(Self {
            shared,
            poster,
            reactor,
            next_batch: 1,
            peers: Vec::new(),
            peer_by_endpoint: HashMap::new(),
            static_peers,
            proxy,
            backlog: VecDeque::new(),
            next_seq: 1,
            next_work: 1,
            buf: Vec::with_capacity(512),
            dirty: HashSet::new(),
            staging_requests: HashMap::new(),
            finished: Vec::new(),
            forgotten: Vec::new(),
            limits,
            now: Instant::now(),
            chunk_ops: Vec::with_capacity(64),
            merged: Vec::with_capacity(64),
            runs: Vec::with_capacity(64),
            inflight: HashMap::new(),
            from_poll,
        })
    }

    pub fn run(mut self) {
        let span = debug_span!("sender_ctrl", sender = %self.shared.cfg.sender_id);
        let _g = span.enter();
        // Acquire: pairs with the Release store in `Sender::close`.
        while !self.shared.stop.load(Ordering::Acquire) {
            // The clock is read here, once per step: the peer-level
            // decisions (timeouts, backoffs) and stamps take it from here.
            self.step(Instant::now());
            self.sleep();
        }
        for p in &self.peers {
            let _ = self.reactor.deregister(&p.sock);
            if let Some(late) = &p.late {
                let _ = self.reactor.deregister(&late.sock);
            }
        }
        // Dropping the poster closes the data plane; the poll thread then
        // sees the completion stream end.
    }

    /// One pass over every input, at `now`.
    fn step(&mut self, now: Instant) {
        self.now = now;
        while let Some(taken) = self.shared.inbox.pop() {
            match taken {
                Taken::Batch(b) => self.enqueue(*b),
                // A caller stopped it: `progress` acts on its life word.
                Taken::Attention(key) => {
                    self.dirty.insert(key);
                }
            }
        }
        let lost = self.apply_completions();
        {
            let t = self.shared.table.lock();
            // Acquire: pairs with the Release store of a caller that found
            // the ring full after its CAS, so the words read below include
            // its stop.
            if self.shared.attention_overflow.swap(false, Ordering::AcqRel) {
                self.dirty.extend(
                    t.reqs
                        .iter()
                        .filter(|(_, r)| {
                            r.p.state.live() && r.c.signal.life.stopped_by_caller().is_some()
                        })
                        .map(|(k, _)| k),
                );
            }
            for (id, r) in &self.staging_requests {
                if r.is_ready() {
                    if let Some(b) = t.batches.get(id) {
                        self.dirty.insert(b.req);
                    }
                }
            }
        }
        // Resolved before any reply is read, so a loss reported for an old
        // connection can never be taken for one a HelloAck just made.
        let lost = self.mark_lost(&lost);
        let victims = self.lost_victims(&lost);
        for i in 0..self.peers.len() {
            let mut n = 0;
            while n < 256 && readable(&self.peers[i].sock) {
                match self.peers[i].sock.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => {
                        n += 1;
                        if let Some(payload) = frames.last() {
                            self.on_reply(i, payload);
                        }
                    }
                    Err(zmq::Error::EAGAIN) => break,
                    Err(e) => {
                        warn!(error = %e, endpoint = %self.peers[i].endpoint, "receive failed");
                        break;
                    }
                }
            }
        }
        self.read_late_hellos();
        self.timers(now);
        self.drain_dirty();
        if !victims.is_empty() {
            // After one round, so requests whose writes all landed before
            // the loss complete instead of failing.
            self.abort_lost(victims);
            self.drain_dirty();
        }
        if self.rehello_due(now) {
            self.drain_dirty();
        }
        if self.apply_late_hellos(now) {
            self.drain_dirty();
        }
        self.flush_backlog();
        self.announce();
    }

    /// Applies the completions the poll thread handed over: each ends its
    /// write in flight (staging freed, lease recorded, chunk counts, the
    /// request marked dirty when the core wants a look). Returns the
    /// transport peers whose writes completed with `ConnectionLost` (no
    /// duplicates), for `mark_lost`.
    ///
    /// Why the ordering is enough: an op's `inflight` entry is inserted by
    /// this thread before it posts the op, and its completion exists only
    /// after the post, so the lookup here (same thread, later) finds it
    /// without any cross-thread ordering; the completion record itself
    /// crosses through the ring (the poll thread's Release publish, our
    /// Acquire read), in the transport's order. A completion the poll thread
    /// pushes while we sleep is seen by the Dekker check in `sleep` (it
    /// pushes, then `wake_ctrl`). So the state that poll used to write
    /// under the table lock is now written by its one owner, at the start
    /// of a step, before replies are read, as the poll thread's writes were
    /// seen then.
    fn apply_completions(&mut self) -> Vec<PeerIndex> {
        let mut lost = Vec::new();
        if self.from_poll.is_empty() {
            return lost;
        }
        let mut buf = [Completion::default(); 256];
        loop {
            let n = self.from_poll.pop_into(&mut buf);
            if n == 0 {
                return lost;
            }
            let now = Instant::now();
            let shared = Arc::clone(&self.shared);
            let mut t = shared.table.lock();
            for c in &buf[..n] {
                let Some(w) = self.inflight.remove(&c.work_id) else {
                    warn!(work_id = c.work_id, "completion for an unknown write");
                    continue;
                };
                self.free_staging(w.slots);
                // The transport is done with this op's memory: a registered
                // write's regions may go once its last op gets here.
                if let Some(lease) = w.lease {
                    lease.record(c.status(), w.chunks);
                }
                if c.status() == CompletionStatus::ConnectionLost && !lost.contains(&w.peer) {
                    lost.push(w.peer);
                }
                shared
                    .stats
                    .record(Stage::Transfer, now.saturating_duration_since(w.posted_at));
                let Some(r) = t.reqs.get_mut(w.req) else {
                    continue;
                };
                let done =
                    r.p.write_done(w.chunks as usize, c.ok(), || RequestStatus::Failed {
                        code: ErrorCode::WriteFailed,
                        reason: format!("write failed: {}", c.status()),
                    });
                if c.ok() {
                    r.bytes += w.bytes;
                    r.last_completion_at = Some(now);
                    shared.stats.add(Counter::Chunks, u64::from(w.chunks));
                    shared.stats.add(Counter::Bytes, w.bytes);
                } else if done.aborted {
                    r.aborted();
                    debug!(req_id = %r.c.req_id, status = %c.status(), "write failed; aborting the request");
                }
                if done.attention {
                    self.dirty.insert(w.req);
                }
            }
        }
    }

    /// Progresses every request marked dirty until none is.
    fn drain_dirty(&mut self) {
        loop {
            if self.dirty.is_empty() {
                break;
            }
            let mut dirty: Vec<ReqKey> = self.dirty.drain().collect();
            // Oldest request first (not hash order): first batches go out in
            // store order, so receivers admit requests FIFO as stored, and
            // in LMCache mode the next request is the oldest waiting one.
            {
                let t = self.shared.table.lock();
                dirty.sort_by_cached_key(|&k| t.reqs.get(k).map_or(u64::MAX, |r| r.order));
            }
            for req in dirty {
                self.progress(req);
            }
        }
    }

    /// Sleeps until a socket, the waker or the next timer.
    fn sleep(&mut self) {
        // SeqCst: the ctrl side of the Dekker handshake in `Shared::wake_ctrl`:
        // publish "parked", then re-check every input; a producer that
        // published before our check is seen, one after it sees the flag.
        self.shared.ctrl_parked.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let busy = !self.shared.inbox.is_empty()
            || !self.from_poll.is_empty()
            // Acquire: see the swap in `step`.
            || self.shared.attention_overflow.load(Ordering::Acquire)
            || !self.dirty.is_empty()
            || self.staging_requests.values().any(crate::slots::SlotRequest::is_ready)
            || self.peers.iter().any(|p| readable(&p.sock))
            || self
                .peers
                .iter()
                .any(|p| p.late.as_ref().is_some_and(|l| readable(&l.sock)))
            // Acquire: pairs with the Release store in `Sender::close`.
            || self.shared.stop.load(Ordering::Acquire);
        if !busy {
            let now = Instant::now();
            let timeout = self
                .next_timer(now)
                .map_or(MAX_SLEEP, |d| d.saturating_duration_since(now));
            if let Err(e) = self.reactor.wait(Some(timeout)) {
                warn!(error = %e, "poll failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.shared.ctrl_parked.store(false, Ordering::SeqCst);
    }

    /// Moves a submitted batch into its request's send queue (or releases
    /// it if the request stopped meanwhile).
    fn enqueue(&mut self, b: Batch) {
        if b.fills {
            return self.fill_declared(b);
        }
        let key = b.req;
        let id = self.next_batch;
        self.next_batch += 1;
        let mut t = self.shared.table.lock();
        match t.reqs.get_mut(key).filter(|r| r.p.state.live()) {
            Some(r) => {
                r.p.queued.push_back(id);
                if matches!(b.data, BatchData::Declared) {
                    r.declared = Some(id);
                }
                t.batches.insert(id, b);
            }
            None => {
                drop(t);
                self.release_data(b.data, b.bytes);
            }
        }
        self.dirty.insert(key);
    }

    /// Moves the bytes `f` brings (staged, one slot per declared chunk)
    /// into its request's declared batch, which then posts like any
    /// answered batch; gives them back if that batch is gone (the request
    /// stopped, or the receiver held every chunk of it already).
    fn fill_declared(&mut self, f: Batch) {
        let key = f.req;
        let mut t = self.shared.table.lock();
        let id = t
            .reqs
            .get_mut(key)
            .filter(|r| r.p.state.live())
            .and_then(|r| r.declared.take());
        let target = id
            .and_then(|id| t.batches.get_mut(&id))
            .filter(|b| matches!(b.data, BatchData::Declared));
        match (target, f.data) {
            (Some(b), BatchData::Staged(set)) => {
                // Answered already (the usual order: staging comes after
                // admission): chunks the receiver held need no slot. Before
                // the reply, `on_batch_reply` trims them as for any batch.
                let answered = !b.remote.is_empty();
                let set = if answered {
                    self.keep_written(set, &b.writes)
                } else {
                    set
                };
                b.data = BatchData::Staged(set);
            }
            (_, data) => {
                drop(t);
                self.release_data(data, 0);
            }
        }
        self.dirty.insert(key);
    }

    /// The slots of `set` at chunk positions `writes` (ascending), in
    /// order; the others (chunks the receiver already holds) go back to
    /// staging. One pass, no allocation when every chunk is written.
    fn keep_written(&self, set: crate::slots::SlotSet, writes: &[u32]) -> crate::slots::SlotSet {
        if writes.len() == set.len() {
            return set;
        }
        let slots = set.as_slice();
        let kept = crate::slots::SlotSet::from_slots(writes.iter().map(|&j| slots[j as usize]));
        let mut next = writes.iter().peekable();
        let freed = crate::slots::SlotSet::from_slots(
            slots
                .iter()
                .enumerate()
                .filter(|&(j, _)| next.next_if_eq(&&(j as u32)).is_none())
                .map(|(_, &slot)| slot),
        );
        self.free_staging(freed);
        kept
    }

    /// Gives staging slots back from this thread. Batches waiting for
    /// staging hold a place in the allocator's queue (`staging_requests`), so
    /// the free grants them and wakes this thread: no retry bookkeeping.
    fn free_staging(&self, set: crate::slots::SlotSet) {
        self.shared.slots.free(set);
    }

    fn release_data(&self, data: BatchData, bytes: usize) {
        self.shared.release_data(data, bytes);
    }

    fn on_reply(&mut self, i: usize, payload: &[u8]) {
        let msg = match decode(payload) {
            Ok(m) => m,
            Err(e) => {
                warn!(endpoint = %self.peers[i].endpoint, error = %e, "undecodable reply");
                // In LMCache mode the reply slot is still consumed in order.
                if self.peers[i].mode == Mode::Legacy {
                    let (o, next) = self.peers[i].in_order.answered(self.now);
                    if let Some(o) = o {
                        self.answer(
                            i,
                            o,
                            AllocResponse::failure(
                                1,
                                None,
                                ErrorCode::BadMessage,
                                "undecodable reply",
                            ),
                        );
                    }
                    self.send_next(i, next);
                }
                return;
            }
        };
        match (&self.peers[i].mode, msg) {
            (Mode::Handshaking(_), Message::HelloAck(ack))
                if ack.transport != self.shared.cfg.transport =>
            {
                // The receiver does not offer our data plane (it answers
                // with its default offer instead).
                if let Some(d) = self.peers[i].prepared.take() {
                    self.poster.discard_prepared(&d);
                }
                let p = &mut self.peers[i];
                p.mode = Mode::Failed(format!(
                    "receiver at {} does not offer the {} data plane (it offers {})",
                    p.endpoint, self.shared.cfg.transport, ack.transport
                ));
                self.dirty_peer(i);
            }
            (Mode::Handshaking(_), Message::AllocResponse(resp))
                if resp.code.as_deref() == Some(ErrorCode::PeerUnavailable.as_str()) =>
            {
                // A kvferry receiver that offers our data plane but could not
                // set it up for us (LMCache receivers send no codes).
                if let Some(d) = self.peers[i].prepared.take() {
                    self.poster.discard_prepared(&d);
                }
                let p = &mut self.peers[i];
                p.mode = Mode::Failed(format!(
                    "receiver at {} refused the {} data plane: {}",
                    p.endpoint,
                    self.shared.cfg.transport,
                    resp.error.as_deref().unwrap_or("no reason given")
                ));
                self.dirty_peer(i);
            }
            (Mode::Handshaking(_), Message::HelloAck(ack)) => {
                if self.local_control_mismatch(i, &ack) || self.move_to_local_control(i, &ack) {
                    return;
                }
                let remote = RemoteBuffer {
                    descriptor: ack.descriptor.clone(),
                    chunk_bytes: ack.chunk_bytes,
                    capacity_chunks: ack.capacity_chunks,
                };
                let prepared = self.peers[i]
                    .prepared
                    .take()
                    .unwrap_or(crate::protocol::Descriptor::None);
                match self.poster.connect_prepared(&prepared, &remote) {
                    Ok(index) => {
                        let p = &mut self.peers[i];
                        // A per-pair data plane (rdma): re-handshake if lost.
                        p.rehandshake |= prepared != crate::protocol::Descriptor::None;
                        p.retry_hello = false;
                        p.index = Some(index);
                        p.remote = Some(remote);
                        p.mode = Mode::Extended;
                        if p.route.is_some() {
                            // Relaxed: a statistic, read on its own.
                            self.shared.local_control.fetch_add(1, Ordering::Relaxed);
                        }
                        debug!(endpoint = %p.endpoint, receiver = %ack.receiver_id, "receiver speaks kvferry");
                    }
                    Err(e) => {
                        // Often transient (the receiver cut the connection
                        // while it was being set up): retried after the
                        // backoff by the next request for this receiver.
                        self.poster.discard_prepared(&prepared);
                        self.peers[i].retry_hello = true;
                        self.peers[i].mode =
                            Mode::Failed(format!("data plane to {}: {e}", self.peers[i].endpoint))
                    }
                }
                self.dirty_peer(i);
            }
            (Mode::Handshaking(_), other) => {
                debug!(?other, "non-HelloAck answer to Hello: LMCache receiver");
                let mut p = self.peers.swap_remove(i);
                self.become_legacy(&mut p);
                self.peers.push(p);
                let last = self.peers.len() - 1;
                self.peers.swap(i, last);
                self.renew_socket(i);
                self.dirty_peer(i);
            }
            (Mode::Extended | Mode::Reconnecting, Message::AllocResponse(resp)) => {
                let Some(seq) = resp.seq else {
                    debug!("reply without seq from a kvferry receiver ignored");
                    return;
                };
                if let Some((o, _)) = self.peers[i].by_seq.remove(&seq) {
                    self.answer(i, o, resp);
                }
            }
            (Mode::Legacy, Message::AllocResponse(resp)) => {
                let (o, next) = self.peers[i].in_order.answered(self.now);
                if let Some(o) = o {
                    self.answer(i, o, resp);
                }
                self.send_next(i, next);
            }
            (_, other) => debug!(?other, "unexpected message from a receiver ignored"),
        }
    }

    /// Sends the message an LMCache-mode peer's queue let go next.
    fn send_next(&mut self, i: usize, next: Option<Vec<u8>>) {
        if let Some(bytes) = next {
            if let Err(e) = self.peers[i].send_raw(&bytes) {
                warn!(error = %e, "send failed");
            }
        }
    }

    /// Handles the reply to what `o` sent.
    fn answer(&mut self, i: usize, o: Outstanding, resp: AllocResponse) {
        match o {
            Outstanding::Batch(id) => self.on_batch_reply(i, id, resp),
            Outstanding::Cancel(req_id) => {
                debug!(req_id = %req_id, "cancel acknowledged");
            }
        }
    }

    fn on_batch_reply(&mut self, i: usize, id: u64, resp: AllocResponse) {
        let now = Instant::now();
        let mut t = self.shared.table.lock();
        let Some(mut b) = t.batches.remove(&id) else {
            return;
        };
        self.dirty.insert(b.req);
        let Some(r) = t.reqs.get_mut(b.req) else {
            drop(t);
            return self.release_data(b.data, b.bytes);
        };
        let slots = self.peers[i]
            .remote
            .as_ref()
            .map_or(RemoteSlots::default(), |rb| RemoteSlots {
                capacity: rb.capacity_chunks,
                bytes: rb.chunk_bytes,
            });
        let n = b.keys.len();
        let reply = r.p.on_reply(id, &b.lens, b.is_last, slots, &resp);
        if reply.admitted {
            r.c.signal.set_admitted();
            if let Some(sent) = r.first_sent_at {
                self.shared
                    .stats
                    .record(Stage::AdmissionWait, now.saturating_duration_since(sent));
            }
            self.shared.stats.inc(Counter::Admitted);
        }
        let (remote, dedup) = match reply.step {
            ReplyStep::Abort => {
                r.aborted();
                drop(t);
                return self.release_data(b.data, b.bytes);
            }
            ReplyStep::Release => {
                drop(t);
                return self.release_data(b.data, b.bytes);
            }
            ReplyStep::AllHeld => {
                drop(t);
                if let BatchData::Registered { lease, .. } = &b.data {
                    lease.posted(0); // delivered: its handle ends Ok
                }
                return self.release_data(b.data, b.bytes);
            }
            ReplyStep::Write { remote, dedup } => (remote, dedup),
        };
        let writes: SmallVec<[u32; 16]> = (0..n as u32)
            .filter(|j| !dedup.contains(&(*j as usize)))
            .collect();
        match &mut b.data {
            // Dedup'd chunks release their staging at once.
            BatchData::Staged(set) if !dedup.is_empty() => {
                *set = self.keep_written(std::mem::take(set), &writes);
                b.lens = writes.iter().map(|&j| b.lens[j as usize]).collect();
                b.remote = writes.iter().map(|&j| remote[j as usize]).collect();
                b.writes = (0..writes.len() as u32).collect();
            }
            _ => {
                b.remote = remote;
                b.writes = writes;
            }
        }
        t.batches.insert(id, b);
    }

    /// Advances one request as far as it can go now.
    fn progress(&mut self, key: ReqKey) {
        // The receiver's endpoint is copied only to connect a new peer: a
        // known one is looked up under the lock (no allocation per step).
        let Some((state, peer)) = ({
            let mut t = self.shared.table.lock();
            t.reqs.get_mut(key).map(|r| {
                // A caller's stop first (a cancel ctrl has not acted on):
                // nothing more is sent for it.
                r.take_caller_stop();
                let peer = match self.peer_by_endpoint.get(&r.c.receiver) {
                    Some(&i) => Ok(i),
                    None => Err(r.c.receiver.clone()),
                };
                (r.p.state.clone(), peer)
            })
        }) else {
            return;
        };
        match state {
            ReqState::Done(_) => {}
            ReqState::Aborting(_) => self.progress_abort(key),
            ReqState::Pending | ReqState::Admitted => {
                let i = match peer.or_else(|receiver| self.peer_for(&receiver)) {
                    Ok(i) => i,
                    Err(reason) => return self.abort(key, ErrorCode::PeerUnavailable, reason),
                };
                match self.peers[i].mode.clone() {
                    Mode::Handshaking(_) => {}
                    Mode::Reconnecting => {
                        // Wait for the new handshake; a request whose writes
                        // all landed before the loss still completes.
                        let complete = {
                            let t = self.shared.table.lock();
                            t.reqs
                                .get(key)
                                .is_some_and(|r| r.p.is_complete(r.c.stored.get()))
                        };
                        if complete {
                            self.progress_live(key, i);
                        }
                    }
                    Mode::Failed(_) if self.rehello_allowed(i, self.now) => {
                        // A refused (or failed) re-handshake: try again once
                        // the backoff has passed; this request waits for it.
                        self.rehello(i);
                        if let Mode::Failed(reason) = self.peers[i].mode.clone() {
                            self.abort(key, ErrorCode::PeerUnavailable, reason);
                        }
                    }
                    Mode::Failed(reason) => self.abort(key, ErrorCode::PeerUnavailable, reason),
                    Mode::Extended | Mode::Legacy => self.progress_live(key, i),
                }
            }
        }
    }

    fn abort(&mut self, key: ReqKey, code: ErrorCode, reason: String) {
        {
            let mut t = self.shared.table.lock();
            let Some(r) = t.reqs.get_mut(key) else {
                return;
            };
            if !r.abort_with(RequestStatus::Failed { code, reason }) {
                return;
            }
        }
        self.dirty.insert(key);
    }

    fn progress_live(&mut self, key: ReqKey, i: usize) {
        let legacy = self.peers[i].mode == Mode::Legacy;
        let shared = Arc::clone(&self.shared);
        let mut t = shared.table.lock();
        // 1. Send what may be sent.
        let Some(r) = t.reqs.get_mut(key) else {
            return;
        };
        let turn = legacy.then_some(&mut self.peers[i].turn);
        for _ in 0..r.p.sendable(RULES, turn, &key) {
            let Some(r) = t.reqs.get_mut(key) else {
                break;
            };
            let Some((id, first)) = r.p.next_to_send() else {
                break;
            };
            if first {
                r.first_sent_at = Some(Instant::now());
            }
            self.send_batch(&mut t, i, id);
        }
        // 2. Stage and post answered batches (the core decides the order).
        // The request's progress is taken out of the table while the shell
        // stages and posts (it needs the table's batches and writes).
        let Some(r) = t.reqs.get_mut(key) else {
            return;
        };
        let mut p = std::mem::take(&mut r.p);
        p.post_answered(RULES, |id| self.stage_and_post(&mut t, i, key, id));
        let Some(r) = t.reqs.get_mut(key) else {
            return;
        };
        r.p = p;
        // 3. Complete, unless a caller stopped the request first: the life
        // word's CAS decides (a cancel that returned true always wins over
        // this, one that returned false lost to it).
        if r.p.is_complete(r.c.stored.get()) {
            if let Err(stop) = r.c.signal.life.complete() {
                if stop.is_some() && r.take_caller_stop() {
                    // Fenced like any abort (CancelNotif, then `Cancelled`).
                    self.dirty.insert(key);
                }
                return;
            }
            let now = Instant::now();
            let (last, bytes, req_id) = (r.last_completion_at, r.bytes, Arc::clone(&r.c.req_id));
            self.notify_complete(i, &req_id);
            if let Some(last) = last {
                self.shared
                    .stats
                    .record(Stage::Notify, now.saturating_duration_since(last));
            }
            debug!(req_id = %req_id, bytes, "complete");
            self.shared.stats.inc(Counter::Completed);
            self.finish(&mut t, key, RequestStatus::Completed);
        }
    }

    /// Sends one batch's AllocRequest.
    fn send_batch(&mut self, t: &mut Table, i: usize, id: u64) {
        // The step's clock: the reply timeout counts from it.
        let now = self.now;
        let Some(b) = t.batches.get(&id) else { return };
        let Some(r) = t.reqs.get_mut(b.req) else {
            return;
        };
        let extended = self.peers[i].mode == Mode::Extended;
        let seq = extended.then(|| {
            self.next_seq += 1;
            self.next_seq
        });
        r.keys_sent.extend_from(&b.keys);
        self.shared
            .stats
            .record(Stage::Pending, now.saturating_duration_since(b.stored_at));
        let span =
            tracing::trace_span!("batch", req_id = %r.c.req_id, batch = id, chunks = b.keys.len());
        let _g = span.enter();
        self.buf.clear();
        AllocRequestRef {
            keys: &b.keys,
            fmt: r.c.format.fmt,
            shape: &r.c.format.shape,
            dtype: &r.c.format.dtype,
            last_chunk_toks: b.last_chunk_toks,
            req_id: &r.c.req_id,
            is_last_batch: b.is_last,
            // Saturating: a count past i64 reads as one, not as a negative.
            total_chunks: i64::try_from(r.c.total).unwrap_or(i64::MAX),
            seq,
        }
        .encode_into(&mut self.buf);
        let p = &mut self.peers[i];
        match seq {
            Some(seq) => {
                if let Err(e) = p.send_raw(&self.buf) {
                    warn!(error = %e, "AllocRequest send failed");
                }
                p.by_seq.insert(seq, (Outstanding::Batch(id), now));
            }
            None => {
                if p.in_order
                    .send(Outstanding::Batch(id), now, || self.buf.clone())
                {
                    if let Err(e) = p.send_raw(&self.buf) {
                        warn!(error = %e, "AllocRequest send failed");
                    }
                }
            }
        }
    }

    /// Moves an answered batch into staging if needed and queues its writes.
    /// Returns how many writes it queued, or `None` if staging is full
    /// (retried when slots free up).
    fn stage_and_post(&mut self, t: &mut Table, i: usize, key: ReqKey, id: u64) -> Option<usize> {
        let Some(b) = t.batches.get_mut(&id) else {
            return Some(0);
        };
        if matches!(b.data, BatchData::Declared) {
            // Its bytes are still with the caller: `fill_declared` marks
            // the request dirty when they come.
            return None;
        }
        if let BatchData::Pending(bytes) = &b.data {
            let t0 = Instant::now();
            // Queue for staging in FIFO order with the caller threads (never
            // blocking this thread): the freeing thread hands the slots over
            // and wakes us.
            let request = match self.staging_requests.entry(id) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let waker = Arc::clone(&self.shared.waker);
                    match self.shared.slots.request(b.writes.len(), move || {
                        let _ = waker.wake();
                    }) {
                        Ok(r) => e.insert(r),
                        // Cannot happen: store() refuses batches larger than staging.
                        Err(err) => {
                            warn!(error = %err, "batch larger than staging");
                            return None;
                        }
                    }
                }
            };
            let set = request.take()?;
            self.staging_requests.remove(&id);
            let mut offsets: SmallVec<[usize; 16]> = SmallVec::with_capacity(b.lens.len());
            let mut off = 0usize;
            for &l in &b.lens {
                offsets.push(off);
                off += l as usize;
            }
            let chunks = b.writes.iter().map(|&j| {
                let (o, l) = (offsets[j as usize], b.lens[j as usize] as usize);
                &bytes[o..o + l]
            });
            self.shared.copy_into(&set, chunks);
            let lens: SmallVec<[u32; 16]> = b.writes.iter().map(|&j| b.lens[j as usize]).collect();
            let remote: Vec<i64> = b.writes.iter().map(|&j| b.remote[j as usize]).collect();
            let pending = b.bytes;
            b.lens = lens;
            b.remote = remote;
            b.writes = (0..set.len() as u32).collect();
            b.data = BatchData::Staged(set);
            // AcqRel: pending-area accounting only (see `Sender::store`).
            self.shared
                .pending_bytes
                .fetch_sub(pending, Ordering::AcqRel);
            self.shared.stats.record_since(Stage::StagingWait, t0);
        }
        let Some(b) = t.batches.remove(&id) else {
            return Some(0);
        };
        let (Some(peer), Some(remote)) = (self.peers[i].index, self.peers[i].remote.as_ref())
        else {
            self.release_data(b.data, b.bytes);
            return Some(0);
        };
        let rbytes = remote.chunk_bytes;
        let set = match b.data {
            BatchData::Staged(set) => set,
            BatchData::Registered { src, lease } => {
                return Some(self.post_registered(
                    key, peer, rbytes, &b.writes, &b.remote, &b.lens, &src, lease,
                ));
            }
            BatchData::Pending(_) | BatchData::Empty | BatchData::Declared => return Some(0),
        };
        let now = Instant::now();
        // One write per chunk, then the transport's coalescer merges runs
        // contiguous on both sides (the set is sorted, chunk k in its k-th
        // slot, so each merged write covers the next `run` slots).
        self.chunk_ops.clear();
        for (k, (&j, slot)) in b.writes.iter().zip(set.iter()).enumerate() {
            self.chunk_ops.push(WriteOp {
                work_id: k as u64,
                local_offset: self.shared.staging.slot_offset(slot),
                remote_offset: b.remote[j as usize] as u64 * rbytes,
                len: u64::from(b.lens[j as usize]),
                peer,
                local_region: 0,
            });
        }
        crate::transport::coalesce(&self.chunk_ops, &mut self.merged, &mut self.runs);
        let mut set = set;
        for (k, mut op) in self.merged.drain(..).enumerate() {
            let run = self.runs[k];
            let rest = set.split_off(run);
            let slots = std::mem::replace(&mut set, rest);
            op.work_id = self.next_work;
            self.next_work += 1;
            self.inflight.insert(
                op.work_id,
                InFlight {
                    req: key,
                    chunks: run as u32,
                    bytes: op.len,
                    slots,
                    lease: None,
                    posted_at: now,
                    peer,
                },
            );
            self.backlog.push_back(op);
        }
        // Cannot hold anything: the runs cover every chunk.
        self.free_staging(set);
        Some(self.runs.len())
    }

    /// Queues the writes of a batch from registered memory (chunk `j` of the
    /// batch at `src[j]`, to receiver slot `remote[j]`), coalesced like
    /// staged ones; each op holds the batch's lease until it completes.
    /// Returns how many writes it queued.
    #[allow(clippy::too_many_arguments)]
    fn post_registered(
        &mut self,
        key: ReqKey,
        peer: PeerIndex,
        rbytes: u64,
        writes: &[u32],
        remote: &[i64],
        lens: &[u32],
        src: &[(u32, u64)],
        lease: Arc<super::registered::WriteLease>,
    ) -> usize {
        let now = Instant::now();
        lease.posted(writes.len());
        self.chunk_ops.clear();
        for (k, &j) in writes.iter().enumerate() {
            let (region, offset) = src[j as usize];
            self.chunk_ops.push(WriteOp {
                work_id: k as u64,
                local_offset: offset,
                remote_offset: remote[j as usize] as u64 * rbytes,
                len: u64::from(lens[j as usize]),
                peer,
                local_region: region,
            });
        }
        crate::transport::coalesce(&self.chunk_ops, &mut self.merged, &mut self.runs);
        for (k, mut op) in self.merged.drain(..).enumerate() {
            op.work_id = self.next_work;
            self.next_work += 1;
            self.inflight.insert(
                op.work_id,
                InFlight {
                    req: key,
                    chunks: self.runs[k] as u32,
                    bytes: op.len,
                    slots: crate::slots::SlotSet::default(),
                    lease: Some(Arc::clone(&lease)),
                    posted_at: now,
                    peer,
                },
            );
            self.backlog.push_back(op);
        }
        self.runs.len()
    }

    /// Posts queued writes as far as transport credit allows, and never
    /// more posted and not yet applied than the poll thread's ring has room:
    /// it then always has room for their completions (poll.rs).
    fn flush_backlog(&mut self) {
        while !self.backlog.is_empty() {
            // Every backlog op has its `inflight` entry; the other entries
            // are posted ops whose completion was not applied yet.
            // (Saturating: a transport that completed an op still in the
            // backlog, a bug, must not panic ctrl.)
            let posted = self.inflight.len().saturating_sub(self.backlog.len());
            let room = self.from_poll.capacity().saturating_sub(posted);
            if room == 0 {
                return;
            }
            let ops = self.backlog.make_contiguous();
            let ops = &ops[..room.min(ops.len())];
            match self.poster.post(ops) {
                Ok(0) => return,
                Ok(n) => {
                    self.backlog.drain(..n);
                }
                Err(e) => {
                    warn!(error = %e, "transport refused writes; failing their requests");
                    let failed: Vec<WriteOp> = self.backlog.drain(..).collect();
                    let mut t = self.shared.table.lock();
                    for op in failed {
                        if let Some(w) = self.inflight.remove(&op.work_id) {
                            self.free_staging(w.slots);
                            if let Some(r) = t.reqs.get_mut(w.req) {
                                r.p.write_withdrawn();
                                r.abort_with(RequestStatus::Failed {
                                    code: ErrorCode::WriteFailed,
                                    reason: format!("transport error: {e}"),
                                });
                            }
                            self.dirty.insert(w.req);
                        }
                    }
                    return;
                }
            }
        }
    }

    /// Abort path: drop unsent work, wait for in-flight writes, then fence
    /// with CancelNotif (invariant 7).
    fn progress_abort(&mut self, key: ReqKey) {
        // Writes not yet handed to the transport are simply not posted.
        let shared = Arc::clone(&self.shared);
        let mut t = shared.table.lock();
        let mine: Vec<u64> = self
            .backlog
            .iter()
            .filter(|op| self.inflight.get(&op.work_id).is_some_and(|w| w.req == key))
            .map(|op| op.work_id)
            .collect();
        if !mine.is_empty() {
            self.backlog.retain(|op| !mine.contains(&op.work_id));
            for w in mine {
                if let Some(f) = self.inflight.remove(&w) {
                    self.free_staging(f.slots);
                    if let Some(r) = t.reqs.get_mut(key) {
                        r.p.write_withdrawn();
                    }
                }
            }
        }
        let Some(r) = t.reqs.get_mut(key) else {
            return;
        };
        let mut p = std::mem::take(&mut r.p);
        let step = p.abort_step(|id| {
            // Withdraws its place in the staging queue (or gives back slots
            // granted but not taken).
            self.staging_requests.remove(&id);
            if let Some(b) = t.batches.remove(&id) {
                self.shared.release_data(b.data, b.bytes);
            }
        });
        let Some(r) = t.reqs.get_mut(key) else {
            return;
        };
        r.p = p;
        // Wait: `apply_completions` marks us dirty when the writes are done.
        let AbortStep::Finish { cancel, status } = step else {
            return;
        };
        if cancel {
            let keys = std::mem::take(&mut r.keys_sent).to_vec();
            if let Some(&i) = self.peer_by_endpoint.get(&r.c.receiver) {
                let req_id = Arc::clone(&r.c.req_id);
                self.send_cancel(i, &req_id, keys);
            }
        }
        match &status {
            RequestStatus::Cancelled => self.shared.stats.inc(Counter::Cancelled),
            _ => self.shared.stats.inc(Counter::Failed),
        }
        self.finish(&mut t, key, status);
    }

    fn send_cancel(&mut self, i: usize, req_id: &str, keys: Vec<String>) {
        let p = &self.peers[i];
        if matches!(p.mode, Mode::Failed(_) | Mode::Handshaking(_)) {
            return;
        }
        let extended = matches!(p.mode, Mode::Extended | Mode::Reconnecting);
        let seq = extended.then(|| {
            self.next_seq += 1;
            self.next_seq
        });
        let msg = Message::CancelNotif(CancelNotif {
            req_id: req_id.to_owned(),
            keys,
            seq,
        });
        self.buf.clear();
        encode_into(&msg, &mut self.buf);
        let now = self.now;
        let p = &mut self.peers[i];
        let o = Outstanding::Cancel(req_id.to_owned());
        match seq {
            Some(seq) => {
                if let Err(e) = p.send_raw(&self.buf) {
                    warn!(error = %e, "CancelNotif send failed");
                }
                p.by_seq.insert(seq, (o, now));
            }
            None => {
                if p.in_order.send(o, now, || self.buf.clone()) {
                    if let Err(e) = p.send_raw(&self.buf) {
                        warn!(error = %e, "CancelNotif send failed");
                    }
                }
            }
        }
    }

    /// ProxyNotif to the proxy and TransferDone to a kvferry receiver.
    fn notify_complete(&mut self, i: usize, req_id: &str) {
        if let Some(proxy) = &self.proxy {
            self.buf.clear();
            encode_into(
                &Message::ProxyNotif(ProxyNotif {
                    req_id: req_id.to_owned(),
                }),
                &mut self.buf,
            );
            if let Err(e) = proxy.send(&self.buf, 0) {
                warn!(error = %e, "ProxyNotif send failed");
            }
        }
        if matches!(self.peers[i].mode, Mode::Extended | Mode::Reconnecting) {
            self.buf.clear();
            encode_into(
                &Message::TransferDone(TransferDone {
                    req_id: req_id.to_owned(),
                    seq: None,
                }),
                &mut self.buf,
            );
            if let Err(e) = self.peers[i].send_raw(&self.buf) {
                warn!(error = %e, "TransferDone send failed");
            }
        }
    }

    /// ProxyFailed to the proxy: `req_id` ended without its data, so the
    /// router need not wait for a ProxyNotif that will never come.
    fn notify_failed(&mut self, req_id: &str, code: ErrorCode, reason: &str) {
        if !self.shared.cfg.proxy_failures {
            return;
        }
        if let Some(proxy) = &self.proxy {
            self.buf.clear();
            encode_into(
                &Message::ProxyFailed(ProxyFailed {
                    req_id: req_id.to_owned(),
                    code: code.as_str().to_owned(),
                    error: Some(reason.to_owned()),
                }),
                &mut self.buf,
            );
            if let Err(e) = proxy.send(&self.buf, 0) {
                warn!(error = %e, "ProxyFailed send failed");
            }
        }
    }

    /// Records a terminal status; callbacks run after the lock is released.
    /// A request to a kvferry receiver that ends failed or cancelled tells
    /// the proxy (once).
    fn finish(&mut self, t: &mut Table, key: ReqKey, status: RequestStatus) {
        let Some(r) = t.reqs.get(key) else {
            return;
        };
        let (receiver, req_id) = (r.c.receiver.clone(), Arc::clone(&r.c.req_id));
        let live = !matches!(r.p.state, ReqState::Done(_));
        // ProxyFailed is a kvferry extension: only a receiver that answered
        // Hello proves a kvferry deployment. A sender talking to an LMCache
        // receiver serves an LMCache proxy, whose strict decoders would
        // refuse the unknown tag (tests/lmcache: kvferry_sender_vs_lmcache_receiver).
        let kvferry_peer = self
            .peer_by_endpoint
            .get(&receiver)
            .is_some_and(|&i| matches!(self.peers[i].mode, Mode::Extended | Mode::Reconnecting));
        if live && kvferry_peer {
            match &status {
                RequestStatus::Failed { code, reason } => {
                    self.notify_failed(&req_id, *code, reason)
                }
                RequestStatus::Cancelled => {
                    self.notify_failed(&req_id, ErrorCode::Cancelled, "cancelled by the sender")
                }
                RequestStatus::InProgress | RequestStatus::Completed => {}
            }
        }
        t.finish(key, status.clone(), &mut self.forgotten);
        self.finished.push((req_id.to_string(), status));
        // LMCache mode: the receiver is free for the next request.
        if let Some(&i) = self.peer_by_endpoint.get(&receiver) {
            if self.peers[i].turn.release(&key) {
                let next: Vec<ReqKey> = t
                    .reqs
                    .iter()
                    .filter(|(_, r)| {
                        r.c.receiver == self.peers[i].endpoint && r.p.state == ReqState::Pending
                    })
                    .map(|(k, _)| k)
                    .collect();
                self.dirty.extend(next);
            }
        }
    }

    /// Hands terminal statuses to the announcer thread (callbacks never run
    /// here; waiters were woken by their `Signal`), and forgets the names of
    /// the requests the table forgot this step (no table lock held: the
    /// name index is locked before the table, by `begin`, never after).
    fn announce(&mut self) {
        if !self.forgotten.is_empty() {
            self.shared.names.forget(self.forgotten.drain(..));
        }
        if self.finished.is_empty() {
            return;
        }
        self.shared.announcer.announce(&mut self.finished);
    }

    /// Marks every live request of peer `i` for progress.
    fn dirty_peer(&mut self, i: usize) {
        let t = self.shared.table.lock();
        let endpoint = &self.peers[i].endpoint;
        let ids: Vec<ReqKey> = t
            .reqs
            .iter()
            .filter(|(_, r)| &r.c.receiver == endpoint && !matches!(r.p.state, ReqState::Done(_)))
            .map(|(k, _)| k)
            .collect();
        drop(t);
        self.dirty.extend(ids);
    }
}
