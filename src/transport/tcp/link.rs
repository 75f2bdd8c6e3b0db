//! One peer of the TCP engine: its ops waiting to be written, its current
//! data connection (if any) and that connection's state machine
//! (connecting → greeting → ready), with the framing of writes and the
//! matching of acks.
//!
//! Fencing: a connection this side gives up on (no progress for
//! `io_timeout`, or acks that break the protocol) may still hold bytes of
//! its writes that the receiver has not read yet — in the receiver's socket
//! buffer, or in ours, still being sent. Failing those writes at once would
//! let the request's `CancelNotif` free slots that a late read then writes.
//! So such a connection is not dropped: its write side is shut (a FIN after
//! the last byte) and it is read, and the bytes dropped, until the receiver
//! closes it; the receiver closes only after reading that FIN (or on its own
//! reject/cut/exit, after which it lands nothing more from it). Only then
//! do its writes complete with `ConnectionLost` — a true fence. A
//! connection the receiver closed or reset fails its writes at once.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use smallvec::SmallVec;

use crate::staging::StagingBuffer;
use crate::transport::{Completion, CompletionStatus, PeerIndex, WriteOp};

use super::engine::ConnectResult;
use super::wire::{
    decode_preamble_ack, Ack, Header, Preamble, ACK_LEN, HEADER_LEN, PREAMBLE_ACK_LEN,
    PREAMBLE_BAD_GEOMETRY, PREAMBLE_BAD_VERSION, PREAMBLE_LEN, PREAMBLE_OK,
    PREAMBLE_UNAUTHENTICATED,
};

/// Ops gathered into one `writev`.
const GATHER: usize = 16;

/// Bytes of acks read per `read`.
const READ_BUF: usize = ACK_LEN * 256;

/// A connection's token: generation in the high half, peer in the low half.
fn token(peer: PeerIndex, gen: u32) -> Token {
    Token(((gen as usize) << 32) | peer as usize)
}

/// `(peer, generation)` of a token made by [`token`].
pub(super) fn split_token(t: Token) -> (PeerIndex, u32) {
    ((t.0 & 0xffff_ffff) as PeerIndex, (t.0 >> 32) as u32)
}

/// What the engine lends a link for one step.
pub(super) struct Io<'a> {
    pub(super) registry: &'a Registry,
    pub(super) local: &'a StagingBuffer,
    pub(super) done: &'a mut Vec<Completion>,
    pub(super) now: Instant,
    pub(super) next_gen: &'a mut u32,
    pub(super) connect_timeout: Duration,
    pub(super) io_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Non-blocking connect in progress.
    Connecting,
    /// Connected; the preamble is being sent and its answer awaited.
    Greeting,
    /// Writes flow.
    Ready,
}

struct Conn {
    stream: TcpStream,
    gen: u32,
    phase: Phase,
    /// Preamble bytes written so far.
    greeted: usize,
    /// Bytes of the first queued op (header + payload) already written.
    front_done: u64,
    /// Work ids written in full, awaiting their acks, in order.
    sent: VecDeque<u64>,
    rbuf: Box<[u8; READ_BUF]>,
    rhave: usize,
    last_progress: Instant,
}

/// A connection given up on while bytes of its writes may still reach the
/// receiver: write side shut, read until the receiver closes it.
struct Drain {
    stream: TcpStream,
    gen: u32,
    /// Writes with bytes on this connection, completed when it ends.
    works: Vec<u64>,
}

/// Why a connection ends.
struct Broken {
    reason: String,
    /// This side gives up on a connection the receiver still has open, so
    /// bytes already sent may still be read by it.
    abandoned: bool,
}

impl Broken {
    /// The receiver closed or reset the connection: it reads nothing more.
    fn peer(reason: String) -> Self {
        Self {
            reason,
            abandoned: false,
        }
    }

    /// This side gives up on it (timeout, protocol error).
    fn ours(reason: String) -> Self {
        Self {
            reason,
            abandoned: true,
        }
    }
}

/// One peer.
pub(super) struct Link {
    peer: PeerIndex,
    addr: SocketAddr,
    preamble: [u8; PREAMBLE_LEN],
    /// Bytes of the peer's slot area.
    pub(super) data_len: u64,
    /// Disconnected by the poster: no new ops; dropped once idle.
    pub(super) removed: bool,
    conn: Option<Conn>,
    /// Earlier connections waiting for the receiver to close them.
    drains: Vec<Drain>,
    /// Ops taken from the ring and not yet written in full, in order.
    queue: VecDeque<WriteOp>,
    /// The poster waiting in `connect` for the first connection.
    reply: Option<crossbeam_channel::Sender<ConnectResult>>,
}

impl Link {
    pub(super) fn new(
        peer: PeerIndex,
        addr: SocketAddr,
        preamble: Preamble,
        data_len: u64,
    ) -> Self {
        Self {
            peer,
            addr,
            preamble: preamble.encode(),
            data_len,
            removed: false,
            conn: None,
            drains: Vec::new(),
            queue: VecDeque::new(),
            reply: None,
        }
    }

    /// Nothing queued, nothing awaiting an ack.
    pub(super) fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.conn.as_ref().is_none_or(|c| c.sent.is_empty())
    }

    /// Writes still waiting for an abandoned connection to end.
    pub(super) fn has_drains(&self) -> bool {
        !self.drains.is_empty()
    }

    /// When this link's connection is declared lost if nothing moves.
    pub(super) fn deadline(&self, connect: Duration, io: Duration) -> Option<Instant> {
        let c = self.conn.as_ref()?;
        match c.phase {
            Phase::Connecting | Phase::Greeting => Some(c.last_progress + connect),
            Phase::Ready if !self.is_idle() => Some(c.last_progress + io),
            Phase::Ready => None,
        }
    }

    /// Opens a new connection (the previous one, if any, is gone).
    pub(super) fn open(
        &mut self,
        io: &mut Io<'_>,
        reply: Option<crossbeam_channel::Sender<ConnectResult>>,
    ) {
        if reply.is_some() {
            self.reply = reply;
        }
        let gen = *io.next_gen;
        *io.next_gen = gen.wrapping_add(1);
        let mut stream = match TcpStream::connect(self.addr) {
            Ok(s) => s,
            Err(e) => return self.lost(io, Broken::peer(format!("connect: {e}"))),
        };
        if let Err(e) = io.registry.register(
            &mut stream,
            token(self.peer, gen),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            return self.lost(io, Broken::ours(format!("cannot watch the socket: {e}")));
        }
        tracing::debug!(peer = self.peer, addr = %self.addr, "tcp connecting");
        self.conn = Some(Conn {
            stream,
            gen,
            phase: Phase::Connecting,
            greeted: 0,
            front_done: 0,
            sent: VecDeque::new(),
            rbuf: Box::new([0u8; READ_BUF]),
            rhave: 0,
            last_progress: io.now,
        });
    }

    /// Queues an op; opens a connection if there is none; writes what it can.
    pub(super) fn enqueue(&mut self, op: WriteOp, io: &mut Io<'_>) {
        if self.is_idle() {
            if let Some(c) = self.conn.as_mut() {
                // Idle until now: the no-progress clock starts here.
                c.last_progress = io.now;
            }
        }
        self.queue.push_back(op);
        if self.conn.is_none() {
            self.open(io, None);
        }
        self.drive(io);
    }

    /// A readiness event for connection generation `gen`.
    pub(super) fn on_event(&mut self, gen: u32, io: &mut Io<'_>) {
        if self.conn.as_ref().is_some_and(|c| c.gen == gen) {
            self.drive(io);
        } else if let Some(i) = self.drains.iter().position(|d| d.gen == gen) {
            self.drain(i, io);
        }
    }

    /// Fails the connection if it made no progress in time.
    pub(super) fn expire(&mut self, io: &mut Io<'_>) {
        if let Some(d) = self.deadline(io.connect_timeout, io.io_timeout) {
            if d <= io.now {
                let what = match self.conn.as_ref().map(|c| c.phase) {
                    Some(Phase::Ready) => format!("no progress for {:?}", io.io_timeout),
                    _ => format!("not connected within {:?}", io.connect_timeout),
                };
                self.lost(io, Broken::ours(what));
            }
        }
    }

    /// Closes the connection (engine exit, or a removed idle link). Writes
    /// still waiting on an abandoned connection complete `ConnectionLost`
    /// into `done`: the poster is gone by then, so no `CancelNotif` can
    /// follow them.
    pub(super) fn close(&mut self, registry: &Registry, done: &mut Vec<Completion>) {
        if let Some(mut c) = self.conn.take() {
            let _ = registry.deregister(&mut c.stream);
        }
        for mut d in self.drains.drain(..) {
            let _ = registry.deregister(&mut d.stream);
            for w in d.works {
                done.push(Completion::new(w, CompletionStatus::ConnectionLost));
            }
        }
    }

    /// Reads (and drops) what abandoned connection `i` still receives until
    /// the receiver closes it; then its writes complete `ConnectionLost`.
    fn drain(&mut self, i: usize, io: &mut Io<'_>) {
        let d = &mut self.drains[i];
        let mut sink = [0u8; 4096];
        let ended = loop {
            match d.stream.read(&mut sink) {
                Ok(0) => break "closed by the receiver".to_owned(),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => break format!("receive: {e}"),
            }
        };
        let mut d = self.drains.swap_remove(i);
        let _ = io.registry.deregister(&mut d.stream);
        tracing::debug!(peer = self.peer, writes = d.works.len(), %ended, "abandoned tcp connection ended; its writes are fenced");
        for w in d.works {
            io.done
                .push(Completion::new(w, CompletionStatus::ConnectionLost));
        }
    }

    /// Makes all the progress the socket allows now (edge-triggered: every
    /// step runs until `WouldBlock`).
    fn drive(&mut self, io: &mut Io<'_>) {
        if let Err(broken) = self.try_drive(io) {
            self.lost(io, broken);
        }
    }

    fn try_drive(&mut self, io: &mut Io<'_>) -> Result<(), Broken> {
        let Some(c) = self.conn.as_mut() else {
            return Ok(());
        };
        if c.phase == Phase::Connecting {
            match c.stream.take_error() {
                Ok(Some(e)) | Err(e) => return Err(Broken::peer(format!("connect: {e}"))),
                Ok(None) => {}
            }
            match c.stream.peer_addr() {
                Ok(_) => {
                    let _ = c.stream.set_nodelay(true);
                    c.phase = Phase::Greeting;
                    c.last_progress = io.now;
                }
                Err(e) if e.kind() == ErrorKind::NotConnected => return Ok(()),
                Err(e) => return Err(Broken::peer(format!("connect: {e}"))),
            }
        }
        if c.phase == Phase::Greeting && c.greeted < PREAMBLE_LEN {
            loop {
                match c.stream.write(&self.preamble[c.greeted..]) {
                    Ok(0) => return Err(Broken::peer("connection closed while greeting".into())),
                    Ok(n) => {
                        c.greeted += n;
                        if c.greeted == PREAMBLE_LEN {
                            break;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(Broken::peer(format!("send: {e}"))),
                }
            }
        }
        self.read_acks(io)?;
        self.write_ops(io)
    }

    /// Reads the preamble answer and acks until `WouldBlock`.
    fn read_acks(&mut self, io: &mut Io<'_>) -> Result<(), Broken> {
        loop {
            let Some(c) = self.conn.as_mut() else {
                return Ok(());
            };
            let n = match c.stream.read(&mut c.rbuf[c.rhave..]) {
                Ok(0) => return Err(Broken::peer("connection closed by the receiver".into())),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(Broken::peer(format!("receive: {e}"))),
            };
            c.rhave += n;
            c.last_progress = io.now;
            let mut at = 0;
            if c.phase == Phase::Greeting {
                if c.rhave < PREAMBLE_ACK_LEN {
                    continue;
                }
                let mut b = [0u8; PREAMBLE_ACK_LEN];
                b.copy_from_slice(&c.rbuf[..PREAMBLE_ACK_LEN]);
                at = PREAMBLE_ACK_LEN;
                match decode_preamble_ack(&b) {
                    Some(PREAMBLE_OK) => {
                        c.phase = Phase::Ready;
                        tracing::debug!(peer = self.peer, addr = %self.addr, "tcp connection ready");
                        if let Some(r) = self.reply.take() {
                            let _ = r.send(ConnectResult::Ready);
                        }
                    }
                    status => {
                        let why = match status {
                            None => "not a kvferry data listener".to_owned(),
                            Some(PREAMBLE_BAD_VERSION) => "wire version not supported".to_owned(),
                            Some(PREAMBLE_BAD_GEOMETRY) => {
                                "buffer geometry differs from the HelloAck".to_owned()
                            }
                            Some(PREAMBLE_UNAUTHENTICATED) => {
                                "secret not accepted (no HelloAck secret, or replaced by a later Hello)".to_owned()
                            }
                            Some(s) => format!("status {s}"),
                        };
                        if let Some(r) = self.reply.take() {
                            let _ = r.send(ConnectResult::Rejected(why.clone()));
                        }
                        return Err(Broken::peer(format!("preamble refused: {why}")));
                    }
                }
            }
            while c.rhave - at >= ACK_LEN {
                let ack = Ack::decode(&c.rbuf[at..at + ACK_LEN]).unwrap_or_default();
                at += ACK_LEN;
                match c.sent.front() {
                    Some(&w) if w == ack.work_id => {
                        c.sent.pop_front();
                        let status = CompletionStatus::from_u32(ack.status)
                            .unwrap_or(CompletionStatus::TransportError);
                        io.done.push(Completion::new(w, status));
                        if status != CompletionStatus::Ok {
                            // A reject: the receiver closes the connection
                            // after it and lands nothing more from it, so
                            // it is lost now rather than when its close is
                            // read (a write queued meanwhile would go on it
                            // and be lost too, where the next connection
                            // would land it).
                            return Err(Broken::peer(format!(
                                "the receiver rejected work {w} ({status:?}) and closes the connection"
                            )));
                        }
                    }
                    Some(&w) => {
                        return Err(Broken::ours(format!(
                            "ack for work {} while work {w} was next",
                            ack.work_id
                        )))
                    }
                    None => {
                        return Err(Broken::ours(format!(
                            "ack for work {} never sent",
                            ack.work_id
                        )))
                    }
                }
            }
            c.rbuf.copy_within(at..c.rhave, 0);
            c.rhave -= at;
        }
    }

    /// Writes queued ops (header + payload, gathered) until `WouldBlock`.
    fn write_ops(&mut self, io: &mut Io<'_>) -> Result<(), Broken> {
        let Some(c) = self.conn.as_mut() else {
            return Ok(());
        };
        if c.phase != Phase::Ready {
            return Ok(());
        }
        while !self.queue.is_empty() {
            let mut headers = [[0u8; HEADER_LEN]; GATHER];
            for (h, op) in headers.iter_mut().zip(self.queue.iter()) {
                *h = Header {
                    remote_offset: op.remote_offset,
                    len: op.len,
                    work_id: op.work_id,
                }
                .encode();
            }
            let mut slices: SmallVec<[IoSlice<'_>; 2 * GATHER]> = SmallVec::new();
            let mut skip = c.front_done as usize;
            for (h, op) in headers.iter().zip(self.queue.iter()) {
                // `route` checked the range with `source`; the region cannot
                // go away while the op is in flight (see below), so this
                // lookup finds it again.
                let Some(src) = io.local.source(op.local_region, op.local_offset, op.len) else {
                    return Err(Broken::peer(
                        "local memory of a queued write vanished".into(),
                    ));
                };
                // SAFETY: `source` checked the range lies inside the staging
                // mapping (which `io.local` keeps alive) or a registered
                // region, which the sender keeps registered and its owner
                // keeps valid until the op's completion was polled. The
                // bytes are plain u8 and nobody writes them while the op is
                // in flight: the sender frees (and so reuses) a staging slot
                // only after the op's completion was polled, and a
                // registered range is not written before the write's
                // completion (`Sender::register`'s contract), so a shared
                // slice is sound.
                let payload = unsafe { std::slice::from_raw_parts(src, op.len as usize) };
                for part in [&h[..], payload] {
                    if skip >= part.len() {
                        skip -= part.len();
                    } else {
                        slices.push(IoSlice::new(&part[skip..]));
                        skip = 0;
                    }
                }
            }
            let written = match c.stream.write_vectored(&slices) {
                Ok(0) => return Err(Broken::peer("connection closed while sending".into())),
                Ok(n) => n as u64,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(Broken::peer(format!("send: {e}"))),
            };
            drop(slices);
            c.last_progress = io.now;
            let mut left = written;
            while left > 0 {
                let Some(op) = self.queue.front() else { break };
                let rest = HEADER_LEN as u64 + op.len - c.front_done;
                if left >= rest {
                    left -= rest;
                    c.front_done = 0;
                    c.sent.push_back(op.work_id);
                    self.queue.pop_front();
                } else {
                    c.front_done += left;
                    left = 0;
                }
            }
        }
        Ok(())
    }

    /// The connection broke: every op written or queued on it fails with
    /// `ConnectionLost`; the next op opens a new connection. If this side
    /// abandons it with bytes of writes sent, those writes complete only
    /// once the receiver closed it (see the module docs): they move to a
    /// [`Drain`].
    fn lost(&mut self, io: &mut Io<'_>, broken: Broken) {
        let Broken { reason, abandoned } = broken;
        let mut failed = self.queue.len();
        if let Some(mut c) = self.conn.take() {
            failed += c.sent.len();
            let mut works: Vec<u64> = c.sent.drain(..).collect();
            if c.front_done > 0 {
                // Part of the front op is on the wire.
                if let Some(op) = self.queue.pop_front() {
                    works.push(op.work_id);
                }
            }
            if abandoned && !works.is_empty() {
                // Stays registered under its token: its events reach `drain`.
                let _ = c.stream.shutdown(std::net::Shutdown::Write);
                tracing::debug!(
                    peer = self.peer,
                    writes = works.len(),
                    "tcp connection abandoned; waiting for the receiver to close it"
                );
                self.drains.push(Drain {
                    stream: c.stream,
                    gen: c.gen,
                    works,
                });
                let i = self.drains.len() - 1;
                self.drain(i, io);
            } else {
                let _ = io.registry.deregister(&mut c.stream);
                for w in works {
                    io.done
                        .push(Completion::new(w, CompletionStatus::ConnectionLost));
                }
            }
        }
        for op in self.queue.drain(..) {
            io.done.push(Completion::new(
                op.work_id,
                CompletionStatus::ConnectionLost,
            ));
        }
        if let Some(r) = self.reply.take() {
            let _ = r.send(ConnectResult::Failed(reason.clone()));
        }
        tracing::debug!(peer = self.peer, addr = %self.addr, failed, %reason, "tcp connection lost");
    }
}
