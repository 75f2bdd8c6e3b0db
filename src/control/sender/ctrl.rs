//! The sender's `ctrl` thread: the only thread touching ZMQ sockets. It
//! drains the submission ring, runs the handshake and the AllocRequest /
//! AllocResponse exchange with each receiver, posts writes to the transport,
//! sends CancelNotif after fenced aborts, and ProxyNotif + TransferDone once
//! a request is complete.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use tracing::{debug, debug_span, warn};

use crate::protocol::{
    decode, encode_into, AllocResponse, CancelNotif, ErrorCode, Heartbeat, Hello, Message,
    ProxyFailed, ProxyNotif, TransferDone, PROTOCOL_VERSION,
};
use crate::stats::{Counter, Stage};
use crate::transport::{PeerIndex, Poster, RemoteBuffer, WriteOp};
use crate::zmq_io::{readable, Reactor};

use super::peer::{Mode, Outstanding, Peer};
use super::table::{BatchData, InFlight, ReqState, Table};
use super::wire::AllocRequestRef;
use super::{RequestStatus, Shared};

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
    submissions: kvferry_ring::mpsc::Consumer<u64>,
    peers: Vec<Peer>,
    peer_by_endpoint: HashMap<String, usize>,
    static_peers: HashMap<String, RemoteBuffer>,
    proxy: Option<zmq::Socket>,
    /// Writes built but not yet accepted by the transport (credit).
    backlog: VecDeque<WriteOp>,
    next_seq: u64,
    next_work: u64,
    buf: Vec<u8>,
    dirty: HashSet<String>,
    /// Answered batches whose pending bytes wait in the staging allocator's
    /// FIFO queue, by batch id.
    staging_requests: HashMap<u64, crate::slots::SlotRequest>,
    /// Terminal statuses to announce (callbacks) once the lock is released.
    finished: Vec<(String, RequestStatus)>,
    /// Reused buffers of the write coalescer (one write per chunk in,
    /// merged writes and their run lengths out).
    chunk_ops: Vec<WriteOp>,
    merged: Vec<WriteOp>,
    runs: Vec<usize>,
}

impl Ctrl {
    pub fn new(
        shared: Arc<Shared>,
        poster: Box<dyn Poster>,
        reactor: Reactor,
        submissions: kvferry_ring::mpsc::Consumer<u64>,
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
        Ok(Self {
            shared,
            poster,
            reactor,
            submissions,
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
            chunk_ops: Vec::with_capacity(64),
            merged: Vec::with_capacity(64),
            runs: Vec::with_capacity(64),
        })
    }

    pub fn run(mut self) {
        let span = debug_span!("sender_ctrl", sender = %self.shared.cfg.sender_id);
        let _g = span.enter();
        // Acquire: pairs with the Release store in `Sender::close`.
        while !self.shared.stop.load(Ordering::Acquire) {
            self.step();
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

    /// One pass over every input.
    fn step(&mut self) {
        while let Some(id) = self.submissions.pop() {
            self.enqueue(id);
        }
        let lost = {
            let mut t = self.shared.table.lock();
            self.dirty.extend(t.attention.drain(..));
            let lost = std::mem::take(&mut t.lost_peers);
            for (id, r) in &self.staging_requests {
                if r.is_ready() {
                    if let Some(b) = t.batches.get(id) {
                        self.dirty.insert(b.req_id.clone());
                    }
                }
            }
            lost
        };
        // Resolved before any reply is read, so a loss reported for an old
        // connection can never be taken for one a HelloAck just made.
        let lost = self.mark_lost(&lost);
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
        self.timers(Instant::now());
        self.drain_dirty();
        if !lost.is_empty() {
            // After one round, so requests whose writes all landed before
            // the loss complete instead of failing.
            self.abort_lost(&lost);
            self.drain_dirty();
        }
        if self.rehello_due(Instant::now()) {
            self.drain_dirty();
        }
        if self.apply_late_hellos(Instant::now()) {
            self.drain_dirty();
        }
        self.flush_backlog();
        self.announce();
    }

    /// Progresses every request marked dirty until none is.
    fn drain_dirty(&mut self) {
        loop {
            if self.dirty.is_empty() {
                break;
            }
            let mut dirty: Vec<String> = self.dirty.drain().collect();
            // Oldest request first (not hash order): first batches go out in
            // store order, so receivers admit requests FIFO as stored, and
            // in LMCache mode the next request is the oldest waiting one.
            {
                let t = self.shared.table.lock();
                dirty.sort_by_cached_key(|id| t.reqs.get(id).map_or(u64::MAX, |r| r.order));
            }
            for req in dirty {
                self.progress(&req);
            }
        }
    }

    /// The peers whose data plane was lost (the poll thread saw
    /// `ConnectionLost` completions on `indices`) and that re-handshake:
    /// connected through a `Hello`-negotiated data plane (`rehandshake`)
    /// and still `Extended` on that index. They become `Reconnecting`.
    /// Losses on shm and tcp peers, and stale ones, are ignored.
    fn mark_lost(&mut self, indices: &[PeerIndex]) -> Vec<usize> {
        let mut lost = Vec::new();
        for (i, p) in self.peers.iter_mut().enumerate() {
            let hit = p.index.is_some_and(|x| indices.contains(&x));
            if hit && p.rehandshake && p.mode == Mode::Extended {
                debug!(endpoint = %p.endpoint, peer = ?p.index, "data plane lost; will re-handshake");
                p.mode = Mode::Reconnecting;
                lost.push(i);
            }
        }
        lost
    }

    /// Fails every live request of the peers that lost their data plane:
    /// their writes cannot land any more, and their replies would come on
    /// the socket the re-handshake replaces. The usual fenced abort path
    /// runs (in-flight writes end first, then CancelNotif on the old
    /// socket).
    fn abort_lost(&mut self, lost: &[usize]) {
        for &i in lost {
            if self.peers[i].mode != Mode::Reconnecting {
                continue;
            }
            let endpoint = self.peers[i].endpoint.clone();
            let live: Vec<String> = {
                let t = self.shared.table.lock();
                t.reqs
                    .values()
                    .filter(|r| {
                        r.receiver == endpoint
                            && matches!(r.state, ReqState::Pending | ReqState::Admitted)
                    })
                    .map(|r| r.req_id.clone())
                    .collect()
            };
            for req in live {
                self.abort(
                    &req,
                    ErrorCode::WriteFailed,
                    format!(
                        "the data plane to {endpoint} was lost (connection_lost); the sender re-handshakes with it"
                    ),
                );
            }
        }
    }

    /// May peer `i` say `Hello` again now (its data plane was negotiated
    /// through `Hello`, or its last data-plane connect failed, and the last
    /// `Hello` is at least `rehello_backoff` ago)?
    fn rehello_allowed(&self, i: usize, now: Instant) -> bool {
        let p = &self.peers[i];
        (p.rehandshake || p.retry_hello)
            && p.last_hello
                .is_none_or(|t| now.saturating_duration_since(t) >= self.shared.cfg.rehello_backoff)
    }

    /// Re-handshakes every `Reconnecting` peer whose aborted requests have
    /// all ended (fenced) and whose backoff has passed. True if any did.
    fn rehello_due(&mut self, now: Instant) -> bool {
        let mut any = false;
        for i in 0..self.peers.len() {
            if self.peers[i].mode != Mode::Reconnecting || !self.rehello_allowed(i, now) {
                continue;
            }
            let aborting = {
                let t = self.shared.table.lock();
                let ep = &self.peers[i].endpoint;
                t.reqs
                    .values()
                    .any(|r| &r.receiver == ep && matches!(r.state, ReqState::Aborting(_)))
            };
            if !aborting {
                self.rehello(i);
                any = true;
            }
        }
        any
    }

    /// Starts a new handshake with peer `i` (after a lost data plane, or
    /// to retry after a refused re-handshake): forgets the old data plane
    /// (`Poster::disconnect`), replaces the socket so late replies to the old
    /// one are shed, prepares a fresh descriptor and says `Hello`. Requests
    /// for the peer wait for the `HelloAck` as for a new receiver.
    fn rehello(&mut self, i: usize) {
        debug!(endpoint = %self.peers[i].endpoint, "re-handshaking");
        // Batches still waiting for a reply belong to aborted requests: the
        // replies will not be read, so release their data now.
        let outstanding: Vec<Outstanding> =
            self.peers[i].by_seq.drain().map(|(_, (o, _))| o).collect();
        for o in outstanding {
            if let Outstanding::Batch(id) = o {
                let resp = AllocResponse::failure(
                    1,
                    None,
                    ErrorCode::PeerUnavailable,
                    "the data plane to the receiver was lost",
                );
                self.on_batch_reply(i, id, resp);
            }
        }
        if let Some(index) = self.peers[i].index.take() {
            self.poster.disconnect(index);
        }
        self.peers[i].remote = None;
        // What is queued on the old socket (CancelNotifs) still goes out.
        let _ = self.peers[i].sock.set_linger(OLD_SOCKET_LINGER_MS);
        if !self.renew_socket(i) {
            let ep = &self.peers[i].endpoint;
            self.peers[i].mode = Mode::Failed(format!("cannot open a new socket to receiver {ep}"));
            self.peers[i].last_hello = Some(Instant::now());
            self.dirty_peer(i);
            return;
        }
        let mut p = self.peers.swap_remove(i);
        p.mode = Mode::Handshaking(Instant::now());
        self.say_hello(&mut p);
        self.peers.push(p);
        let last = self.peers.len() - 1;
        self.peers.swap(i, last);
        // Waiting requests fail at once if the Hello could not go out.
        self.dirty_peer(i);
    }

    /// Sleeps until a socket, the waker or the next timer.
    fn sleep(&mut self) {
        // SeqCst: the ctrl side of the Dekker handshake in `Shared::wake_ctrl`:
        // publish "parked", then re-check every input; a producer that
        // published before our check is seen, one after it sees the flag.
        self.shared.ctrl_parked.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let busy = !self.submissions.is_empty()
            || {
                let t = self.shared.table.lock();
                !t.attention.is_empty() || !t.lost_peers.is_empty()
            }
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
            let timeout = self
                .next_timer()
                .map_or(MAX_SLEEP, |d| d.saturating_duration_since(Instant::now()));
            if let Err(e) = self.reactor.wait(Some(timeout)) {
                warn!(error = %e, "poll failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.shared.ctrl_parked.store(false, Ordering::SeqCst);
    }

    /// Moves a submitted batch into its request's send queue.
    fn enqueue(&mut self, id: u64) {
        let mut t = self.shared.table.lock();
        let Some(req_id) = t.batches.get(&id).map(|b| b.req_id.clone()) else {
            return;
        };
        let live = t
            .reqs
            .get(&req_id)
            .is_some_and(|r| matches!(r.state, ReqState::Pending | ReqState::Admitted));
        if live {
            if let Some(r) = t.reqs.get_mut(&req_id) {
                r.queued.push_back(id);
            }
        } else if let Some(b) = t.batches.remove(&id) {
            self.release_data(b.data, b.bytes);
        }
        drop(t);
        self.dirty.insert(req_id);
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

    /// The peer for `endpoint`, connecting (and saying Hello) on first use.
    fn peer_for(&mut self, endpoint: &str) -> Result<usize, String> {
        if let Some(&i) = self.peer_by_endpoint.get(endpoint) {
            return Ok(i);
        }
        let token = self.peers.len();
        let mut peer = Peer::connect(&self.shared.cfg.sender_id, endpoint, 0)
            .map_err(|e| format!("cannot connect to receiver {endpoint}: {e}"))?;
        if let Err(e) = self.reactor.register(&peer.sock, token) {
            return Err(format!(
                "cannot watch the socket of receiver {endpoint}: {e}"
            ));
        }
        if self.shared.cfg.use_extensions {
            self.say_hello(&mut peer);
        } else {
            self.become_legacy(&mut peer);
        }
        self.peers.push(peer);
        self.peer_by_endpoint.insert(endpoint.to_owned(), token);
        Ok(token)
    }

    /// Sends `Hello` carrying the descriptor the data plane prepared for
    /// this receiver (shm, tcp: none; rdma: a queue pair made for it), which
    /// the peer keeps for the `HelloAck`.
    fn say_hello(&mut self, peer: &mut Peer) {
        peer.last_hello = Some(Instant::now());
        let descriptor = match self.poster.prepare() {
            Ok(d) => d,
            Err(e) => {
                peer.mode = Mode::Failed(format!(
                    "data plane to {}: cannot prepare the {} transport for it: {e}",
                    peer.endpoint, self.shared.cfg.transport
                ));
                return;
            }
        };
        let hello = Message::Hello(Hello {
            sender_id: self.shared.cfg.sender_id.clone(),
            version: PROTOCOL_VERSION,
            transport: self.shared.cfg.transport.clone(),
            descriptor: descriptor.clone(),
        });
        self.buf.clear();
        encode_into(&hello, &mut self.buf);
        peer.prepared = Some(descriptor);
        if let Err(e) = peer.send_raw(&self.buf) {
            peer.mode = Mode::Failed(format!("cannot send Hello to {}: {e}", peer.endpoint));
            self.discard_prepared(peer);
        }
    }

    /// Releases what was prepared for a receiver whose `Hello` will not be
    /// answered with a usable `HelloAck`.
    fn discard_prepared(&mut self, peer: &mut Peer) {
        if let Some(d) = peer.prepared.take() {
            self.poster.discard_prepared(&d);
        }
    }

    /// Switches a peer to LMCache mode with its statically configured buffer.
    fn become_legacy(&mut self, peer: &mut Peer) {
        self.discard_prepared(peer);
        let Some(remote) = self.static_peers.get(&peer.endpoint).cloned() else {
            peer.mode = Mode::Failed(no_static_buffer(&peer.endpoint, ""));
            return;
        };
        match self.poster.connect(&remote) {
            Ok(index) => {
                peer.index = Some(index);
                peer.remote = Some(remote);
                peer.mode = Mode::Legacy;
                debug!(endpoint = %peer.endpoint, "receiver in LMCache mode (no Hello)");
            }
            Err(e) => peer.mode = Mode::Failed(format!("data plane to {}: {e}", peer.endpoint)),
        }
    }

    /// Replaces a peer's socket so late replies to the old one are shed.
    /// False if no new socket could be made (the old one stays).
    fn renew_socket(&mut self, i: usize) -> bool {
        self.replace_socket(i).is_some()
    }

    /// [`renew_socket`](Self::renew_socket), handing back the old socket
    /// (no longer watched) instead of closing it.
    fn replace_socket(&mut self, i: usize) -> Option<zmq::Socket> {
        let gen = self.peers[i].generation + 1;
        match Peer::socket(
            &self.shared.cfg.sender_id,
            &self.peers[i].endpoint.clone(),
            gen,
        ) {
            Ok(sock) => {
                let _ = self.reactor.deregister(&self.peers[i].sock);
                let _ = self.reactor.register(&sock, i);
                let old = std::mem::replace(&mut self.peers[i].sock, sock);
                self.peers[i].generation = gen;
                Some(old)
            }
            Err(e) => {
                warn!(error = %e, "cannot renew the receiver socket");
                None
            }
        }
    }

    /// After a `Hello` timed out: keeps its socket listening until `until`
    /// for a late `HelloAck`, with what was prepared for it.
    fn listen_late(
        &mut self,
        i: usize,
        old: Option<zmq::Socket>,
        prepared: Option<crate::protocol::Descriptor>,
        until: Instant,
    ) {
        match (old, prepared) {
            (Some(sock), Some(prepared)) => {
                // Watched so a late answer wakes this thread.
                let _ = self.reactor.register(&sock, i);
                self.peers[i].late = Some(super::peer::LateHello {
                    sock,
                    prepared,
                    until,
                    ack: None,
                });
            }
            (_, Some(prepared)) => self.poster.discard_prepared(&prepared),
            _ => {}
        }
    }

    /// Reads what arrived on the sockets of timed-out `Hello`s: a
    /// `HelloAck` offering our transport is kept; anything else (an LMCache
    /// receiver's late answer to a message it does not know) is shed.
    fn read_late_hellos(&mut self) {
        let transport = self.shared.cfg.transport.clone();
        for p in &mut self.peers {
            let Some(late) = p.late.as_mut() else {
                continue;
            };
            let mut n = 0;
            while n < 16 && readable(&late.sock) {
                let Ok(frames) = late.sock.recv_multipart(zmq::DONTWAIT) else {
                    break;
                };
                n += 1;
                match frames.last().map(|f| decode(f)) {
                    Some(Ok(Message::HelloAck(ack))) if ack.transport == transport => {
                        debug!(endpoint = %p.endpoint, "HelloAck after the hello timeout");
                        late.ack = Some(ack);
                    }
                    other => debug!(?other, "late answer to a timed-out Hello shed"),
                }
            }
        }
    }

    /// Upgrades peers whose `HelloAck` came after the hello timeout to
    /// kvferry mode, once they are idle (LMCache mode: no message
    /// outstanding, no request being transferred; or failed for want of a
    /// static descriptor). Stops listening once the window passed or a
    /// newer handshake took over. True if any peer was upgraded.
    fn apply_late_hellos(&mut self, now: Instant) -> bool {
        let mut any = false;
        for i in 0..self.peers.len() {
            let Some(late) = self.peers[i].late.as_ref() else {
                continue;
            };
            let p = &self.peers[i];
            let superseded = matches!(
                p.mode,
                Mode::Handshaking(_) | Mode::Extended | Mode::Reconnecting
            );
            let expired = late.ack.is_none() && now >= late.until;
            if superseded || expired {
                if let Some(late) = self.peers[i].late.take() {
                    let _ = self.reactor.deregister(&late.sock);
                    self.poster.discard_prepared(&late.prepared);
                }
                continue;
            }
            let idle = match p.mode {
                Mode::Legacy => {
                    p.fifo.is_empty() && p.waiting.is_empty() && p.legacy_active.is_none()
                }
                _ => true, // Failed
            };
            if late.ack.is_none() || !idle {
                continue;
            }
            let Some(late) = self.peers[i].late.take() else {
                continue;
            };
            let _ = self.reactor.deregister(&late.sock);
            let Some(ack) = late.ack else { continue };
            let remote = RemoteBuffer {
                descriptor: ack.descriptor.clone(),
                chunk_bytes: ack.chunk_bytes,
                capacity_chunks: ack.capacity_chunks,
            };
            match self.poster.connect_prepared(&late.prepared, &remote) {
                Ok(index) => {
                    let per_pair = late.prepared != crate::protocol::Descriptor::None;
                    let old = {
                        let p = &mut self.peers[i];
                        p.rehandshake |= per_pair;
                        p.retry_hello = false;
                        p.remote = Some(remote);
                        p.mode = Mode::Extended;
                        p.index.replace(index)
                    };
                    if let Some(old) = old {
                        // The static (LMCache-mode) connection: idle, so no
                        // write of it is in flight.
                        self.poster.disconnect(old);
                    }
                    debug!(endpoint = %self.peers[i].endpoint, receiver = %ack.receiver_id, "late HelloAck: the receiver speaks kvferry");
                    self.dirty_peer(i);
                    any = true;
                }
                Err(e) => {
                    self.poster.discard_prepared(&late.prepared);
                    warn!(endpoint = %self.peers[i].endpoint, error = %e, "late HelloAck, but its data plane cannot be connected");
                }
            }
        }
        any
    }

    fn on_reply(&mut self, i: usize, payload: &[u8]) {
        let msg = match decode(payload) {
            Ok(m) => m,
            Err(e) => {
                warn!(endpoint = %self.peers[i].endpoint, error = %e, "undecodable reply");
                // In LMCache mode the reply slot is still consumed in order.
                if self.peers[i].mode == Mode::Legacy {
                    if let Some((o, _)) = self.peers[i].fifo.pop_front() {
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
                        self.send_waiting(i);
                    }
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
                if let Some((o, _)) = self.peers[i].fifo.pop_front() {
                    self.answer(i, o, resp);
                }
                self.send_waiting(i);
            }
            (_, other) => debug!(?other, "unexpected message from a receiver ignored"),
        }
    }

    fn send_waiting(&mut self, i: usize) {
        let p = &mut self.peers[i];
        if p.fifo.is_empty() {
            if let Some((o, bytes)) = p.waiting.pop_front() {
                if let Err(e) = p.send_raw(&bytes) {
                    warn!(error = %e, "send failed");
                }
                p.fifo.push_back((o, Instant::now()));
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
        let req_id = b.req_id.clone();
        self.dirty.insert(req_id.clone());
        let Some(r) = t.reqs.get_mut(&req_id) else {
            drop(t);
            return self.release_data(b.data, b.bytes);
        };
        r.awaiting_reply = r.awaiting_reply.saturating_sub(1);
        let n = b.keys.len();
        let capacity = self.peers[i]
            .remote
            .as_ref()
            .map_or(0, |rb| rb.capacity_chunks);
        let super::reply::Mapped {
            remote: remote_pos,
            already_sent: dedup,
        } = match super::reply::map_reply(n, capacity, &resp) {
            Ok(m) => m,
            Err((code, reason)) => {
                debug!(req_id = %req_id, code = code.as_str(), %reason, "batch refused; aborting the request");
                r.abort_with(RequestStatus::Failed { code, reason });
                drop(t);
                return self.release_data(b.data, b.bytes);
            }
        };
        if !matches!(r.state, ReqState::Pending | ReqState::Admitted) {
            // Aborting: the receiver's slots go back with the CancelNotif.
            drop(t);
            return self.release_data(b.data, b.bytes);
        }
        if r.state == ReqState::Pending {
            r.admit();
            if let Some(sent) = r.first_sent_at {
                self.shared
                    .stats
                    .record(Stage::AdmissionWait, now.saturating_duration_since(sent));
            }
            self.shared.stats.inc(Counter::Admitted);
        }
        r.completed_chunks += dedup.len();
        if b.is_last {
            r.last_replied = true;
        }
        let writes: SmallVec<[u32; 16]> = (0..n as u32)
            .filter(|j| !dedup.contains(&(*j as usize)))
            .collect();
        if writes.is_empty() {
            drop(t);
            if let BatchData::Registered { lease, .. } = &b.data {
                lease.posted(0); // the receiver holds every chunk: nothing to write
            }
            return self.release_data(b.data, b.bytes);
        }
        // Dedup'd chunks release their staging at once.
        if let BatchData::Staged(set) = &mut b.data {
            if !dedup.is_empty() {
                let slots = set.as_slice();
                let freed = crate::slots::SlotSet::from_slots(dedup.iter().map(|&j| slots[j]));
                let kept =
                    crate::slots::SlotSet::from_slots(writes.iter().map(|&j| slots[j as usize]));
                self.free_staging(freed);
                *set = kept;
                let lens: SmallVec<[u32; 16]> =
                    writes.iter().map(|&j| b.lens[j as usize]).collect();
                let remote: Vec<i64> = writes.iter().map(|&j| remote_pos[j as usize]).collect();
                b.lens = lens;
                b.remote = remote;
                b.writes = (0..writes.len() as u32).collect();
            } else {
                b.remote = remote_pos;
                b.writes = writes;
            }
        } else {
            b.remote = remote_pos;
            b.writes = writes;
        }
        r.unstaged.push_back(id);
        t.batches.insert(id, b);
    }

    /// Advances one request as far as it can go now.
    fn progress(&mut self, req_id: &str) {
        // The receiver's endpoint is copied only to connect a new peer: a
        // known one is looked up under the lock (no allocation per step).
        let Some((state, peer)) = ({
            let t = self.shared.table.lock();
            t.reqs.get(req_id).map(|r| {
                let peer = match self.peer_by_endpoint.get(&r.receiver) {
                    Some(&i) => Ok(i),
                    None => Err(r.receiver.clone()),
                };
                (r.state.clone(), peer)
            })
        }) else {
            return;
        };
        match state {
            ReqState::Done(_) => {}
            ReqState::Aborting(status) => self.progress_abort(req_id, status),
            ReqState::Pending | ReqState::Admitted => {
                let i = match peer.or_else(|receiver| self.peer_for(&receiver)) {
                    Ok(i) => i,
                    Err(reason) => return self.abort(req_id, ErrorCode::PeerUnavailable, reason),
                };
                match self.peers[i].mode.clone() {
                    Mode::Handshaking(_) => {}
                    Mode::Reconnecting => {
                        // Wait for the new handshake; a request whose writes
                        // all landed before the loss still completes.
                        let complete = {
                            let t = self.shared.table.lock();
                            t.reqs.get(req_id).is_some_and(|r| r.is_complete())
                        };
                        if complete {
                            self.progress_live(req_id, i);
                        }
                    }
                    Mode::Failed(_) if self.rehello_allowed(i, Instant::now()) => {
                        // A refused (or failed) re-handshake: try again once
                        // the backoff has passed; this request waits for it.
                        self.rehello(i);
                        if let Mode::Failed(reason) = self.peers[i].mode.clone() {
                            self.abort(req_id, ErrorCode::PeerUnavailable, reason);
                        }
                    }
                    Mode::Failed(reason) => self.abort(req_id, ErrorCode::PeerUnavailable, reason),
                    Mode::Extended | Mode::Legacy => self.progress_live(req_id, i),
                }
            }
        }
    }

    fn abort(&mut self, req_id: &str, code: ErrorCode, reason: String) {
        {
            let mut t = self.shared.table.lock();
            let Some(r) = t.reqs.get_mut(req_id) else {
                return;
            };
            if !r.abort_with(RequestStatus::Failed { code, reason }) {
                return;
            }
        }
        self.dirty.insert(req_id.to_owned());
    }

    fn progress_live(&mut self, req_id: &str, i: usize) {
        let legacy = self.peers[i].mode == Mode::Legacy;
        let shared = Arc::clone(&self.shared);
        let mut t = shared.table.lock();
        let Some(r) = t.reqs.get(req_id) else { return };
        let admitted = r.state == ReqState::Admitted;
        // 1. Send what may be sent.
        let sendable = if admitted {
            r.queued.len()
        } else if !r.first_sent && !r.queued.is_empty() {
            if legacy
                && self.peers[i]
                    .legacy_active
                    .as_deref()
                    .is_some_and(|a| a != req_id)
            {
                0
            } else {
                1
            }
        } else {
            0
        };
        for _ in 0..sendable {
            let Some(id) = t.reqs.get_mut(req_id).and_then(|r| r.queued.pop_front()) else {
                break;
            };
            self.send_batch(&mut t, i, id);
        }
        if legacy && sendable > 0 {
            self.peers[i].legacy_active = Some(req_id.to_owned());
        }
        // 2. Stage and post answered batches. Not strictly in order: a batch
        // whose bytes wait in the pending area for staging must not hold back
        // an already-staged batch behind it, which may hold the very staging
        // slots it waits for (deadlock found by tests/model_check.rs).
        let ids: SmallVec<[u64; 8]> = t
            .reqs
            .get(req_id)
            .map(|r| r.unstaged.iter().copied().collect())
            .unwrap_or_default();
        for id in ids {
            if self.stage_and_post(&mut t, i, req_id, id) {
                if let Some(r) = t.reqs.get_mut(req_id) {
                    r.unstaged.retain(|&x| x != id);
                }
            }
        }
        // 3. Complete.
        if t.reqs.get(req_id).is_some_and(|r| r.is_complete()) {
            let now = Instant::now();
            let (last, bytes) = t
                .reqs
                .get(req_id)
                .map_or((None, 0), |r| (r.last_completion_at, r.bytes));
            self.notify_complete(i, req_id);
            if let Some(last) = last {
                self.shared
                    .stats
                    .record(Stage::Notify, now.saturating_duration_since(last));
            }
            debug!(req_id, bytes, "complete");
            self.shared.stats.inc(Counter::Completed);
            self.finish(&mut t, req_id, RequestStatus::Completed);
        }
    }

    /// Sends one batch's AllocRequest.
    fn send_batch(&mut self, t: &mut Table, i: usize, id: u64) {
        let now = Instant::now();
        let Some(b) = t.batches.get(&id) else { return };
        let Some(r) = t.reqs.get_mut(&b.req_id) else {
            return;
        };
        let extended = self.peers[i].mode == Mode::Extended;
        let seq = extended.then(|| {
            self.next_seq += 1;
            self.next_seq
        });
        r.keys_sent.extend_from(&b.keys);
        r.awaiting_reply += 1;
        if !r.first_sent {
            r.first_sent = true;
            r.first_sent_at = Some(now);
        }
        self.shared
            .stats
            .record(Stage::Pending, now.saturating_duration_since(b.stored_at));
        let span =
            tracing::trace_span!("batch", req_id = %b.req_id, batch = id, chunks = b.keys.len());
        let _g = span.enter();
        self.buf.clear();
        AllocRequestRef {
            keys: &b.keys,
            fmt: b.fmt,
            shape: &b.shape,
            dtype: &b.dtype,
            last_chunk_toks: b.last_chunk_toks,
            req_id: &b.req_id,
            is_last_batch: b.is_last,
            total_chunks: r.total as i64,
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
                if p.fifo.is_empty() {
                    if let Err(e) = p.send_raw(&self.buf) {
                        warn!(error = %e, "AllocRequest send failed");
                    }
                    p.fifo.push_back((Outstanding::Batch(id), now));
                } else {
                    p.waiting
                        .push_back((Outstanding::Batch(id), self.buf.clone()));
                }
            }
        }
    }

    /// Moves an answered batch into staging if needed and queues its writes.
    /// Returns false if staging is full (retried when slots free up).
    fn stage_and_post(&mut self, t: &mut Table, i: usize, req_id: &str, id: u64) -> bool {
        let Some(b) = t.batches.get_mut(&id) else {
            return true;
        };
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
                            return false;
                        }
                    }
                }
            };
            let Some(set) = request.take() else {
                return false;
            };
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
            return true;
        };
        let (Some(peer), Some(remote)) = (self.peers[i].index, self.peers[i].remote.as_ref())
        else {
            self.release_data(b.data, b.bytes);
            return true;
        };
        let rbytes = remote.chunk_bytes;
        let set = match b.data {
            BatchData::Staged(set) => set,
            BatchData::Registered { src, lease } => {
                self.post_registered(
                    t, req_id, peer, rbytes, &b.writes, &b.remote, &b.lens, &src, lease,
                );
                return true;
            }
            BatchData::Pending(_) | BatchData::Empty => return true,
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
        let rid = t
            .reqs
            .get(req_id)
            .map_or_else(|| Arc::from(req_id), |r| Arc::clone(&r.id));
        let mut set = set;
        for (k, mut op) in self.merged.drain(..).enumerate() {
            let run = self.runs[k];
            let rest = set.split_off(run);
            let slots = std::mem::replace(&mut set, rest);
            op.work_id = self.next_work;
            self.next_work += 1;
            t.inflight.insert(
                op.work_id,
                InFlight {
                    req_id: Arc::clone(&rid),
                    chunks: run as u32,
                    bytes: op.len,
                    slots,
                    lease: None,
                    posted_at: now,
                    peer,
                },
            );
            if let Some(r) = t.reqs.get_mut(req_id) {
                r.in_flight_ops += 1;
            }
            self.backlog.push_back(op);
        }
        // Cannot hold anything: the runs cover every chunk.
        self.free_staging(set);
        true
    }

    /// Queues the writes of a batch from registered memory (chunk `j` of the
    /// batch at `src[j]`, to receiver slot `remote[j]`), coalesced like
    /// staged ones; each op holds the batch's lease until it completes.
    #[allow(clippy::too_many_arguments)]
    fn post_registered(
        &mut self,
        t: &mut Table,
        req_id: &str,
        peer: PeerIndex,
        rbytes: u64,
        writes: &[u32],
        remote: &[i64],
        lens: &[u32],
        src: &[(u32, u64)],
        lease: Arc<super::registered::WriteLease>,
    ) {
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
        let rid = t
            .reqs
            .get(req_id)
            .map_or_else(|| Arc::from(req_id), |r| Arc::clone(&r.id));
        for (k, mut op) in self.merged.drain(..).enumerate() {
            op.work_id = self.next_work;
            self.next_work += 1;
            t.inflight.insert(
                op.work_id,
                InFlight {
                    req_id: Arc::clone(&rid),
                    chunks: self.runs[k] as u32,
                    bytes: op.len,
                    slots: crate::slots::SlotSet::default(),
                    lease: Some(Arc::clone(&lease)),
                    posted_at: now,
                    peer,
                },
            );
            if let Some(r) = t.reqs.get_mut(req_id) {
                r.in_flight_ops += 1;
            }
            self.backlog.push_back(op);
        }
    }

    /// Posts queued writes as far as transport credit allows.
    fn flush_backlog(&mut self) {
        while !self.backlog.is_empty() {
            let ops = self.backlog.make_contiguous();
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
                        if let Some(w) = t.inflight.remove(&op.work_id) {
                            self.free_staging(w.slots);
                            if let Some(r) = t.reqs.get_mut(&*w.req_id) {
                                r.in_flight_ops = r.in_flight_ops.saturating_sub(1);
                                r.abort_with(RequestStatus::Failed {
                                    code: ErrorCode::WriteFailed,
                                    reason: format!("transport error: {e}"),
                                });
                            }
                            self.dirty.insert(w.req_id.to_string());
                        }
                    }
                    return;
                }
            }
        }
    }

    /// Abort path: drop unsent work, wait for in-flight writes, then fence
    /// with CancelNotif (invariant 7).
    fn progress_abort(&mut self, req_id: &str, status: RequestStatus) {
        // Writes not yet handed to the transport are simply not posted.
        let shared = Arc::clone(&self.shared);
        let mut t = shared.table.lock();
        let mine: Vec<u64> = self
            .backlog
            .iter()
            .filter(|op| {
                t.inflight
                    .get(&op.work_id)
                    .is_some_and(|w| &*w.req_id == req_id)
            })
            .map(|op| op.work_id)
            .collect();
        if !mine.is_empty() {
            self.backlog.retain(|op| !mine.contains(&op.work_id));
            for w in mine {
                if let Some(f) = t.inflight.remove(&w) {
                    self.free_staging(f.slots);
                    if let Some(r) = t.reqs.get_mut(req_id) {
                        r.in_flight_ops = r.in_flight_ops.saturating_sub(1);
                    }
                }
            }
        }
        let Some(r) = t.reqs.get_mut(req_id) else {
            return;
        };
        let drop_ids: Vec<u64> = r.queued.drain(..).chain(r.unstaged.drain(..)).collect();
        let (in_flight, first_sent, cancel_sent) = (r.in_flight_ops, r.first_sent, r.cancel_sent);
        for id in drop_ids {
            // Withdraws its place in the staging queue (or gives back slots
            // granted but not taken).
            self.staging_requests.remove(&id);
            if let Some(b) = t.batches.remove(&id) {
                self.release_data(b.data, b.bytes);
            }
        }
        if in_flight > 0 || cancel_sent {
            return; // the poll thread calls us again when the writes are done
        }
        let receiver = t
            .reqs
            .get(req_id)
            .map(|r| r.receiver.clone())
            .unwrap_or_default();
        if first_sent {
            let keys = t
                .reqs
                .get_mut(req_id)
                .map(|r| std::mem::take(&mut r.keys_sent).to_vec())
                .unwrap_or_default();
            if let Some(r) = t.reqs.get_mut(req_id) {
                r.cancel_sent = true;
            }
            if let Some(&i) = self.peer_by_endpoint.get(&receiver) {
                self.send_cancel(i, req_id, keys);
            }
        }
        match &status {
            RequestStatus::Cancelled => self.shared.stats.inc(Counter::Cancelled),
            _ => self.shared.stats.inc(Counter::Failed),
        }
        self.finish(&mut t, req_id, status);
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
        let now = Instant::now();
        let p = &mut self.peers[i];
        let o = Outstanding::Cancel(req_id.to_owned());
        match seq {
            Some(seq) => {
                if let Err(e) = p.send_raw(&self.buf) {
                    warn!(error = %e, "CancelNotif send failed");
                }
                p.by_seq.insert(seq, (o, now));
            }
            None if p.fifo.is_empty() => {
                if let Err(e) = p.send_raw(&self.buf) {
                    warn!(error = %e, "CancelNotif send failed");
                }
                p.fifo.push_back((o, now));
            }
            None => p.waiting.push_back((o, self.buf.clone())),
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
    fn finish(&mut self, t: &mut Table, req_id: &str, status: RequestStatus) {
        let receiver = t.reqs.get(req_id).map(|r| r.receiver.clone());
        let live = t
            .reqs
            .get(req_id)
            .is_some_and(|r| !matches!(r.state, ReqState::Done(_)));
        // ProxyFailed is a kvferry extension: only a receiver that answered
        // Hello proves a kvferry deployment. A sender talking to an LMCache
        // receiver serves an LMCache proxy, whose strict decoders would
        // refuse the unknown tag (tests/lmcache: kvferry_sender_vs_lmcache_receiver).
        let kvferry_peer = receiver
            .as_ref()
            .and_then(|e| self.peer_by_endpoint.get(e))
            .is_some_and(|&i| matches!(self.peers[i].mode, Mode::Extended | Mode::Reconnecting));
        if live && kvferry_peer {
            match &status {
                RequestStatus::Failed { code, reason } => self.notify_failed(req_id, *code, reason),
                RequestStatus::Cancelled => {
                    self.notify_failed(req_id, ErrorCode::Cancelled, "cancelled by the sender")
                }
                RequestStatus::InProgress | RequestStatus::Completed => {}
            }
        }
        t.finish(req_id, status.clone());
        self.finished.push((req_id.to_owned(), status));
        // LMCache mode: the receiver is free for the next request.
        if let Some(&i) = receiver.as_ref().and_then(|e| self.peer_by_endpoint.get(e)) {
            if self.peers[i].legacy_active.as_deref() == Some(req_id) {
                self.peers[i].legacy_active = None;
                let next: Vec<String> = t
                    .reqs
                    .values()
                    .filter(|r| {
                        r.receiver == self.peers[i].endpoint && r.state == ReqState::Pending
                    })
                    .map(|r| r.req_id.clone())
                    .collect();
                self.dirty.extend(next);
            }
        }
    }

    /// Wakes `Sender::wait`ers and hands terminal statuses to the
    /// announcer thread (callbacks never run here).
    fn announce(&mut self) {
        if self.finished.is_empty() {
            return;
        }
        self.shared.status_cv.notify_all();
        self.shared.announcer.announce(&mut self.finished);
    }

    /// Marks every live request of peer `i` for progress.
    fn dirty_peer(&mut self, i: usize) {
        let t = self.shared.table.lock();
        let endpoint = &self.peers[i].endpoint;
        let ids: Vec<String> = t
            .reqs
            .values()
            .filter(|r| &r.receiver == endpoint && !matches!(r.state, ReqState::Done(_)))
            .map(|r| r.req_id.clone())
            .collect();
        drop(t);
        self.dirty.extend(ids);
    }

    /// Handshake timeouts, reply timeouts and heartbeats.
    fn timers(&mut self, now: Instant) {
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
                let active = {
                    let t = self.shared.table.lock();
                    let ep = &self.peers[i].endpoint;
                    t.reqs
                        .values()
                        .any(|r| &r.receiver == ep && !matches!(r.state, ReqState::Done(_)))
                };
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

    /// A receiver with no LMCache fallback (no static descriptor) left its
    /// `Hello` unanswered for `limit` (`hello_answer_timeout`;
    /// `hello_timeout` only decides when a receiver that *has* a
    /// fallback is taken for an LMCache one, so a slow kvferry receiver,
    /// e.g. one still registering memory, is waited for and its late
    /// `HelloAck` connects it). Its waiting requests fail; a request after
    /// `rehello_backoff` tries a new `Hello`.
    fn hello_unanswered(&mut self, i: usize, now: Instant, limit: Duration) {
        let mut p = self.peers.swap_remove(i);
        self.discard_prepared(&mut p);
        p.mode = Mode::Failed(no_static_buffer(&p.endpoint, &format!(" within {limit:?}")));
        p.retry_hello = true;
        p.last_hello = Some(now);
        self.peers.push(p);
        let last = self.peers.len() - 1;
        self.peers.swap(i, last);
        self.renew_socket(i);
        self.dirty_peer(i);
    }

    /// Fails the requests whose messages went unanswered too long.
    fn reply_timeout(&mut self, i: usize, now: Instant, limit: Duration) {
        let late: Vec<Outstanding> = if self.peers[i].mode == Mode::Legacy {
            // Order is lost: start a fresh connection and fail all in it.
            let p = &mut self.peers[i];
            let mut v: Vec<Outstanding> = p.fifo.drain(..).map(|(o, _)| o).collect();
            v.extend(p.waiting.drain(..).map(|(o, _)| o));
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
                let req = self
                    .shared
                    .table
                    .lock()
                    .batches
                    .get(&id)
                    .map(|b| b.req_id.clone());
                self.on_batch_reply(i, id, resp);
                if let Some(req) = req {
                    self.dirty.insert(req);
                }
            }
        }
    }

    fn next_timer(&self) -> Option<Instant> {
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

/// Why requests to a receiver that did not answer `Hello` (`waited`: e.g.
/// `" within 5s"`) fail when no static buffer is configured for it, and
/// what would address it.
fn no_static_buffer(endpoint: &str, waited: &str) -> String {
    format!(
        "receiver at {endpoint} did not answer Hello{waited} (an LMCache receiver?) and no static buffer \
         descriptor is configured for it: give it a kvferry shm buffer file (`kvferry sender \
         --static-buffer {endpoint}=PATH`, TOML static_buffers, or SenderConfig::static_peers); \
         kvferry cannot write into an LMCache receiver's own buffer (NIXL)"
    )
}
