//! The engine thread: the NIC of the TCP transport. It owns every data
//! connection (non-blocking sockets in one mio poll set), takes ops from the
//! submission ring, frames them onto their peer's connection, turns the
//! receiver's acks into completions and posts them to the completion ring.
//! It sleeps in `epoll_wait` when idle: the poster wakes it through a mio
//! [`Waker`](mio::Waker) after each post or command, sockets wake it when
//! they are ready, and the only timer is the no-progress deadline of a busy
//! connection.

use crate::transport::credits::Returned;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_ring::spsc::{Consumer, Producer};
use mio::{Events, Poll, Token};
use parking_lot::Mutex;

use crate::staging::StagingBuffer;
use crate::transport::{Completion, CompletionStatus, PeerIndex, WriteOp};

use super::link::{Io, Link};
use super::wire::Preamble;

/// Token of the poster's waker.
pub(super) const WAKE_TOKEN: Token = Token(usize::MAX);

/// Ops taken from the submission ring per pass.
const BATCH: usize = 256;

/// What the poster asks of the engine (besides posting ops).
pub(super) enum Cmd {
    /// Open a data connection to `addr` as peer `peer` and answer on `reply`
    /// once it is ready (preamble accepted) or failed.
    Connect {
        peer: PeerIndex,
        addr: SocketAddr,
        preamble: Preamble,
        data_len: u64,
        reply: crossbeam_channel::Sender<ConnectResult>,
    },
    /// Forget peer: ops posted later complete with `UnknownPeer`; ops
    /// already taken complete normally; the connection closes once idle.
    Disconnect(PeerIndex),
}

/// The answer to [`Cmd::Connect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ConnectResult {
    /// Connected, preamble accepted.
    Ready,
    /// The receiver refused the preamble (version or geometry).
    Rejected(String),
    /// The connection could not be opened (refused, unreachable, timeout).
    Failed(String),
}

/// State shared by the poster, the engine and the completion half.
pub(super) struct Shared {
    /// Commands from the poster, taken by the engine each pass.
    pub(super) cmds: Mutex<Vec<Cmd>>,
    /// Completions returned (write credits).
    pub(super) returned: Returned,
}

/// Everything the engine thread owns.
pub(super) struct Engine {
    poll: Poll,
    sq: Consumer<WriteOp>,
    cq: Producer<Completion>,
    local: Arc<StagingBuffer>,
    shared: Arc<Shared>,
    /// Peers by index (indices are never reused).
    links: Vec<Option<Link>>,
    /// Completions not yet pushed to the ring.
    done: Vec<Completion>,
    connect_timeout: Duration,
    io_timeout: Duration,
    /// Generation stamped into the next connection's token, so events of a
    /// closed connection never reach its successor.
    next_gen: u32,
}

impl Engine {
    pub(super) fn new(
        poll: Poll,
        sq: Consumer<WriteOp>,
        cq: Producer<Completion>,
        local: Arc<StagingBuffer>,
        shared: Arc<Shared>,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Self {
        Self {
            poll,
            sq,
            cq,
            local,
            shared,
            links: Vec::new(),
            done: Vec::with_capacity(BATCH),
            connect_timeout,
            io_timeout,
            next_gen: 0,
        }
    }

    /// Runs until the poster is gone and every op it posted was completed
    /// (or until the completion half is gone: then nobody can observe
    /// completions). Dropping `self` at the end closes the completion ring.
    pub(super) fn run(mut self) {
        let mut events = Events::with_capacity(256);
        let mut ops = vec![WriteOp::default(); BATCH];
        tracing::debug!("tcp engine started");
        loop {
            let now = Instant::now();
            // Closed is read before the pop: every op pushed before the
            // poster went away is then visible to this pop.
            let closed = self.sq.is_closed();
            let n = self.sq.pop_into(&mut ops);
            // Commands after the ops: a `Disconnect` issued before an op was
            // posted is seen before that op is routed.
            self.apply_commands(now);
            for op in &ops[..n] {
                self.route(*op, now);
            }
            self.expire(now);
            if !self.flush() {
                break;
            }
            if closed && n == 0 && self.all_idle() {
                break;
            }
            let timeout = if n == BATCH {
                Some(Duration::ZERO)
            } else {
                self.next_deadline()
                    .map(|d| d.saturating_duration_since(now))
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::debug!(error = %e, "tcp engine poll failed; retrying");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            let now = Instant::now();
            for ev in events.iter() {
                if ev.token() != WAKE_TOKEN {
                    self.on_event(ev.token(), now);
                }
            }
            if !self.flush() {
                break;
            }
        }
        // Anything still held can no longer be delivered (the poster is gone
        // and idle, or nobody listens): close the sockets.
        for link in self.links.iter_mut().flatten() {
            link.close(self.poll.registry(), &mut self.done);
        }
        self.flush();
        tracing::debug!("tcp engine stopped");
    }

    /// The links and the I/O context they work with, borrowed together
    /// (disjoint fields, so a link can be driven while `done` grows).
    fn parts(&mut self, now: Instant) -> (&mut Vec<Option<Link>>, Io<'_>) {
        let io = Io {
            registry: self.poll.registry(),
            local: &self.local,
            done: &mut self.done,
            now,
            next_gen: &mut self.next_gen,
            connect_timeout: self.connect_timeout,
            io_timeout: self.io_timeout,
        };
        (&mut self.links, io)
    }

    fn apply_commands(&mut self, now: Instant) {
        let cmds = std::mem::take(&mut *self.shared.cmds.lock());
        for cmd in cmds {
            match cmd {
                Cmd::Connect {
                    peer,
                    addr,
                    preamble,
                    data_len,
                    reply,
                } => {
                    let i = peer as usize;
                    let (links, mut io) = self.parts(now);
                    if links.len() <= i {
                        links.resize_with(i + 1, || None);
                    }
                    let mut link = Link::new(peer, addr, preamble, data_len);
                    link.open(&mut io, Some(reply));
                    links[i] = Some(link);
                }
                Cmd::Disconnect(peer) => {
                    if let Some(link) = self.links.get_mut(peer as usize).and_then(Option::as_mut) {
                        link.removed = true;
                    }
                    self.reap(peer);
                }
            }
        }
    }

    /// Drops a removed link once nothing of it is in flight.
    fn reap(&mut self, peer: PeerIndex) {
        if let Some(slot) = self.links.get_mut(peer as usize) {
            if slot
                .as_ref()
                .is_some_and(|l| l.removed && l.is_idle() && !l.has_drains())
            {
                if let Some(mut link) = slot.take() {
                    link.close(self.poll.registry(), &mut self.done);
                }
            }
        }
    }

    /// Checks an op and hands it to its link (or completes it at once).
    fn route(&mut self, op: WriteOp, now: Instant) {
        let fits = |offset: u64, limit: u64| {
            offset
                .checked_add(op.len)
                .is_some_and(|end| end <= limit && end <= usize::MAX as u64)
        };
        let local_ok = self
            .local
            .source(op.local_region, op.local_offset, op.len)
            .is_some()
            && op
                .local_offset
                .checked_add(op.len)
                .is_some_and(|e| e <= usize::MAX as u64);
        let (links, mut io) = self.parts(now);
        let Some(link) = links
            .get_mut(op.peer as usize)
            .and_then(Option::as_mut)
            .filter(|l| !l.removed)
        else {
            io.done
                .push(Completion::new(op.work_id, CompletionStatus::UnknownPeer));
            return;
        };
        if !local_ok || !fits(op.remote_offset, link.data_len) {
            io.done
                .push(Completion::new(op.work_id, CompletionStatus::OutOfBounds));
            return;
        }
        link.enqueue(op, &mut io);
    }

    fn on_event(&mut self, token: Token, now: Instant) {
        let (peer, gen) = super::link::split_token(token);
        let (links, mut io) = self.parts(now);
        let Some(link) = links.get_mut(peer as usize).and_then(Option::as_mut) else {
            return;
        };
        link.on_event(gen, &mut io);
        if link.removed {
            self.reap(peer);
        }
    }

    /// Declares busy connections without progress past their deadline lost.
    fn expire(&mut self, now: Instant) {
        for i in 0..self.links.len() {
            let (links, mut io) = self.parts(now);
            let Some(link) = links[i].as_mut() else {
                continue;
            };
            link.expire(&mut io);
            if link.removed {
                self.reap(i as PeerIndex);
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.links
            .iter()
            .flatten()
            .filter_map(|l| l.deadline(self.connect_timeout, self.io_timeout))
            .min()
    }

    fn all_idle(&self) -> bool {
        self.links.iter().flatten().all(Link::is_idle)
    }

    /// Pushes pending completions; false if the completion half is gone.
    fn flush(&mut self) -> bool {
        if self.done.is_empty() {
            return true;
        }
        // Credits guarantee room for every completion; fewer pushed means
        // the completion half was dropped and nobody is listening.
        let pushed = self.cq.push_slice(&self.done);
        let all = pushed == self.done.len();
        self.done.clear();
        if !all {
            tracing::debug!("tcp engine: completion half gone, stopping");
        }
        all
    }
}
