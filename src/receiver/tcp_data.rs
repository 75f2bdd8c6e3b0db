//! The receiver's TCP data plane: one thread (`kvf-recv-tcp`) accepts data
//! connections from senders and serves them with mio, landing each framed
//! write in the receive buffer and acking it (wire format in
//! [`crate::transport::tcp::wire`]). Idle, it sleeps in `epoll_wait`.
//!
//! Bounds check: a write must lie inside the slot area, and every slot it
//! touches (`[i * chunk_bytes, (i + 1) * chunk_bytes)`, a run of slots for a
//! coalesced write) must be in use in the receiver's slot allocator right
//! now. Otherwise it is answered with `OutOfBounds` and the connection is
//! closed (the sender's other writes on it fail with `ConnectionLost`).
//!
//! This is weaker than per-request ownership — a buggy sender could still
//! write a slot granted to someone else — but it is what the data thread can
//! check without the receiver's lock, and it is enough for the engine's own
//! guarantees: a slot is in use from its grant until the decoder releases it
//! (or, for a failed request, until the fence: quarantine ends only after
//! the sender's `CancelNotif`, which it sends once every write of the
//! request completed, or after `quarantine_grace`), so a well-behaved
//! sender's writes always pass, and a write to a free slot — a late write
//! after the grace, or garbage — can never land in a slot nobody holds.
//! Payload bytes are read from the socket straight into the slot.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

use crate::slots::SlotAllocator;
use crate::transport::tcp::wire::{
    encode_preamble_ack, Ack, Header, Preamble, HEADER_LEN, PREAMBLE_BAD_GEOMETRY,
    PREAMBLE_BAD_VERSION, PREAMBLE_LEN, PREAMBLE_OK, VERSION,
};
use crate::transport::CompletionStatus;

use super::Shared;

/// Most data connections served at once; more are accepted and closed.
pub const MAX_DATA_CONNECTIONS: usize = 1024;

/// Bytes read from one connection before the others get a turn.
const TURN_BUDGET: u64 = 4 << 20;

/// Acks buffered for a sender that does not read them before reading
/// from it pauses (backpressure).
const OUT_LIMIT: usize = 64 * 1024;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;

/// Requests to the data thread.
#[derive(Debug, Default)]
struct Ctl {
    stop: AtomicBool,
    /// Bumped to ask the thread to close every connection.
    cut: AtomicU64,
    /// Connections open now.
    connections: AtomicUsize,
}

/// The running data listener, owned by the [`super::Receiver`].
pub(super) struct TcpData {
    addr: SocketAddr,
    ctl: Arc<Ctl>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl TcpData {
    /// Binds the data listener (port 0 picks one).
    pub(super) fn bind(at: SocketAddr) -> std::io::Result<StdListener> {
        let l = StdListener::bind(at)?;
        l.set_nonblocking(true)?;
        Ok(l)
    }

    /// Starts the data thread on `listener`, landing writes in `shared`'s
    /// region; `addr` is the address announced to senders.
    pub(super) fn start(
        listener: StdListener,
        addr: SocketAddr,
        shared: Arc<Shared>,
        slots: SlotAllocator,
        name: String,
    ) -> std::io::Result<Self> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let ctl = Arc::new(Ctl::default());
        let thread = {
            let ctl = Arc::clone(&ctl);
            std::thread::Builder::new().name(name).spawn(move || {
                DataThread {
                    poll,
                    listener,
                    shared,
                    slots,
                    ctl,
                    conns: Vec::new(),
                    ready: Vec::new(),
                }
                .run()
            })?
        };
        Ok(Self {
            addr,
            ctl,
            waker,
            thread: Some(thread),
        })
    }

    /// The announced address.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Data connections open now.
    pub(super) fn connections(&self) -> usize {
        // Relaxed: a gauge.
        self.ctl.connections.load(Ordering::Relaxed)
    }

    /// Asks the thread to close every data connection (asynchronous).
    pub(super) fn cut(&self) {
        // Relaxed: the waker's syscall orders it before the thread's wake-up,
        // and the thread only compares values.
        self.ctl.cut.fetch_add(1, Ordering::Relaxed);
        let _ = self.waker.wake();
    }

    /// Stops the thread and waits for it (connections close).
    pub(super) fn stop(&mut self) {
        // Release: pairs with the Acquire load in the thread's loop.
        self.ctl.stop.store(true, Ordering::Release);
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::debug!("tcp data thread panicked");
            }
        }
    }
}

impl Drop for TcpData {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading the 32-byte preamble.
    Preamble,
    /// Reading a write header.
    Header,
    /// Landing `hdr.len` payload bytes, `done` so far.
    Payload { hdr: Header, done: u64 },
    /// Rejected: flush the answer, shut the write side, then discard what
    /// the sender still sends until it closes (so the answer is not lost to
    /// a reset), at most [`DISCARD_LIMIT`] bytes.
    Closing { discarded: u64 },
}

/// Bytes discarded from a rejected connection before it is reset.
const DISCARD_LIMIT: u64 = 64 << 20;

struct Conn {
    stream: TcpStream,
    phase: Phase,
    buf: [u8; PREAMBLE_LEN],
    got: usize,
    /// Answers not yet sent.
    out: Vec<u8>,
    readable: bool,
    writable: bool,
}

enum Turn {
    /// Nothing more to do until the next event.
    Wait,
    /// Budget used up; more to do.
    More,
    /// Close the connection.
    Close,
}

struct DataThread {
    poll: Poll,
    listener: TcpListener,
    shared: Arc<Shared>,
    slots: SlotAllocator,
    ctl: Arc<Ctl>,
    conns: Vec<Option<Conn>>,
    /// Connections with work left after their last turn.
    ready: Vec<usize>,
}

impl DataThread {
    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        // Relaxed: compared only (see `TcpData::cut`).
        let mut seen_cut = self.ctl.cut.load(Ordering::Relaxed);
        let mut turn: Vec<usize> = Vec::new();
        tracing::debug!("tcp data thread started");
        // Acquire: pairs with the Release store in `TcpData::stop`.
        while !self.ctl.stop.load(Ordering::Acquire) {
            let timeout = (!self.ready.is_empty()).then_some(std::time::Duration::ZERO);
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != ErrorKind::Interrupted {
                    tracing::debug!(error = %e, "tcp data poll failed; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                continue;
            }
            let cut = self.ctl.cut.load(Ordering::Relaxed);
            if cut != seen_cut {
                seen_cut = cut;
                self.close_all();
            }
            turn.clear();
            turn.append(&mut self.ready);
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    WAKER => {}
                    Token(t) => {
                        let i = t - FIRST_CONN;
                        if let Some(Some(c)) = self.conns.get_mut(i) {
                            c.readable |= ev.is_readable() || ev.is_read_closed() || ev.is_error();
                            c.writable |= ev.is_writable() || ev.is_write_closed();
                            turn.push(i);
                        }
                    }
                }
            }
            turn.sort_unstable();
            turn.dedup();
            for &i in &turn {
                let Some(Some(c)) = self.conns.get_mut(i) else {
                    continue;
                };
                match serve(c, &self.shared, &self.slots) {
                    Turn::Wait => {}
                    Turn::More => self.ready.push(i),
                    Turn::Close => self.close(i),
                }
            }
        }
        self.close_all();
        tracing::debug!("tcp data thread stopped");
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, from)) => {
                    let open = self.conns.iter().flatten().count();
                    if open >= MAX_DATA_CONNECTIONS {
                        tracing::debug!(%from, "too many tcp data connections; refused");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let i = match self.conns.iter().position(Option::is_none) {
                        Some(i) => i,
                        None => {
                            self.conns.push(None);
                            self.conns.len() - 1
                        }
                    };
                    if let Err(e) = self.poll.registry().register(
                        &mut stream,
                        Token(i + FIRST_CONN),
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        tracing::debug!(error = %e, "cannot watch a tcp data connection");
                        continue;
                    }
                    tracing::debug!(%from, "tcp data connection accepted");
                    self.conns[i] = Some(Conn {
                        stream,
                        phase: Phase::Preamble,
                        buf: [0; PREAMBLE_LEN],
                        got: 0,
                        out: Vec::new(),
                        readable: false,
                        writable: false,
                    });
                    // Relaxed: a gauge.
                    self.ctl.connections.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // E.g. EMFILE: try again at the next event.
                    tracing::debug!(error = %e, "accept failed");
                    return;
                }
            }
        }
    }

    fn close(&mut self, i: usize) {
        if let Some(mut c) = self.conns.get_mut(i).and_then(Option::take) {
            let _ = self.poll.registry().deregister(&mut c.stream);
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            // Relaxed: a gauge.
            self.ctl.connections.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!(phase = ?c.phase, "tcp data connection closed");
        }
    }

    fn close_all(&mut self) {
        for i in 0..self.conns.len() {
            self.close(i);
        }
        self.ready.clear();
    }
}

/// One turn of a connection: flush answers, read and land as much as the
/// socket and the turn budget allow.
fn serve(c: &mut Conn, shared: &Shared, slots: &SlotAllocator) -> Turn {
    let mut budget = TURN_BUDGET;
    loop {
        if !c.out.is_empty() && c.writable {
            match c.stream.write(&c.out) {
                Ok(0) => return Turn::Close,
                Ok(n) => {
                    c.out.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => c.writable = false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Turn::Close,
            }
            continue;
        }
        if let Phase::Closing { discarded } = c.phase {
            if !c.out.is_empty() {
                return Turn::Wait; // until writable
            }
            if discarded == 0 {
                let _ = c.stream.shutdown(std::net::Shutdown::Write);
            }
            return discard(c, discarded);
        }
        if c.out.len() >= OUT_LIMIT || !c.readable {
            return Turn::Wait;
        }
        if budget == 0 {
            return Turn::More;
        }
        match step(c, shared, slots, &mut budget) {
            Ok(true) => {}
            Ok(false) => c.readable = false,
            Err(()) => return Turn::Close,
        }
    }
}

/// Reads and drops what a rejected sender still sends, until it closes.
fn discard(c: &mut Conn, mut discarded: u64) -> Turn {
    let mut sink = [0u8; 16 * 1024];
    loop {
        if discarded >= DISCARD_LIMIT {
            return Turn::Close;
        }
        match c.stream.read(&mut sink) {
            Ok(0) => return Turn::Close,
            Ok(n) => {
                // Never 0 again: the first turn shut the write side.
                discarded += n as u64;
                c.phase = Phase::Closing {
                    discarded: discarded.max(1),
                };
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                c.phase = Phase::Closing {
                    discarded: discarded.max(1),
                };
                return Turn::Wait;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Turn::Close,
        }
    }
}

/// Reads once in the current phase. `Ok(false)` = would block; `Err` = the
/// connection is finished (EOF or error).
fn step(
    c: &mut Conn,
    shared: &Shared,
    slots: &SlotAllocator,
    budget: &mut u64,
) -> Result<bool, ()> {
    match c.phase {
        Phase::Preamble | Phase::Header => {
            let want = if c.phase == Phase::Preamble {
                PREAMBLE_LEN
            } else {
                HEADER_LEN
            };
            let n = match c.stream.read(&mut c.buf[c.got..want]) {
                Ok(0) => return Err(()),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => return Ok(true),
                Err(_) => return Err(()),
            };
            c.got += n;
            if c.got < want {
                return Ok(true);
            }
            c.got = 0;
            if c.phase == Phase::Preamble {
                on_preamble(c, shared);
            } else {
                let mut b = [0u8; HEADER_LEN];
                b.copy_from_slice(&c.buf[..HEADER_LEN]);
                on_header(c, Header::decode(&b), shared, slots);
            }
            Ok(true)
        }
        Phase::Payload { hdr, done } => {
            let want = (hdr.len - done).min(*budget).min(isize::MAX as u64) as usize;
            let dst_offset = hdr.remote_offset + done;
            // SAFETY: `on_header` checked remote_offset + len <= data_len
            // without overflow, and done < len, so [dst_offset, dst_offset +
            // want) lies inside the slot area of the region, which `shared`
            // keeps mapped. `read` writes through the raw pointer; no Rust
            // reference to those bytes exists on this side. Every slot of the
            // range was in use when the header arrived, i.e. granted to a
            // request whose sender is writing it (see the module docs for
            // why that is enough).
            let r = unsafe {
                libc::read(
                    c.stream.as_raw_fd(),
                    shared.region.data_ptr().add(dst_offset as usize).cast(),
                    want,
                )
            };
            if r == 0 {
                return Err(());
            }
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    ErrorKind::WouldBlock => Ok(false),
                    ErrorKind::Interrupted => Ok(true),
                    _ => Err(()),
                };
            }
            let n = r as u64;
            *budget = budget.saturating_sub(n);
            let done = done + n;
            if done == hdr.len {
                ack(c, hdr.work_id, CompletionStatus::Ok);
                c.phase = Phase::Header;
            } else {
                c.phase = Phase::Payload { hdr, done };
            }
            Ok(true)
        }
        Phase::Closing { .. } => Ok(false),
    }
}

fn ack(c: &mut Conn, work_id: u64, status: CompletionStatus) {
    c.out.extend_from_slice(
        &Ack {
            work_id,
            status: status as u32,
        }
        .encode(),
    );
}

fn on_preamble(c: &mut Conn, shared: &Shared) {
    let region = &shared.region;
    let status = match Preamble::decode(&c.buf) {
        Some(p) if p.version != VERSION => PREAMBLE_BAD_VERSION,
        Some(p)
            if (p.chunk_bytes, p.capacity_chunks)
                != (region.chunk_bytes(), region.capacity_chunks()) =>
        {
            PREAMBLE_BAD_GEOMETRY
        }
        Some(_) => PREAMBLE_OK,
        None => PREAMBLE_BAD_VERSION,
    };
    c.out.extend_from_slice(&encode_preamble_ack(status));
    c.phase = if status == PREAMBLE_OK {
        Phase::Header
    } else {
        tracing::debug!(status, "tcp data preamble refused");
        Phase::Closing { discarded: 0 }
    };
}

fn on_header(c: &mut Conn, hdr: Header, shared: &Shared, slots: &SlotAllocator) {
    if !write_allowed(
        &hdr,
        shared.region.chunk_bytes(),
        shared.region.data_len(),
        slots,
    ) {
        tracing::debug!(
            offset = hdr.remote_offset,
            len = hdr.len,
            work_id = hdr.work_id,
            "tcp write outside the slots in use; rejected, closing"
        );
        ack(c, hdr.work_id, CompletionStatus::OutOfBounds);
        c.phase = Phase::Closing { discarded: 0 };
        return;
    }
    if hdr.len == 0 {
        ack(c, hdr.work_id, CompletionStatus::Ok);
        c.phase = Phase::Header;
    } else {
        c.phase = Phase::Payload { hdr, done: 0 };
    }
}

/// The bounds rule of the module docs.
fn write_allowed(hdr: &Header, chunk_bytes: u64, data_len: u64, slots: &SlotAllocator) -> bool {
    let Some(end) = hdr.remote_offset.checked_add(hdr.len) else {
        return false;
    };
    if end > data_len {
        return false;
    }
    if hdr.len == 0 {
        return true;
    }
    let first = hdr.remote_offset / chunk_bytes;
    let last = (end - 1) / chunk_bytes;
    (first..=last).all(|s| u32::try_from(s).is_ok_and(|s| slots.is_in_use(s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_rule_checks_range_and_every_slot() {
        let slots = SlotAllocator::new(4);
        let held = slots.try_alloc(2).unwrap(); // slots 0 and 1
        assert_eq!(held.as_slice(), &[0, 1]);
        let h = |off: u64, len: u64| Header {
            remote_offset: off,
            len,
            work_id: 1,
        };
        let ok = |hdr: Header| write_allowed(&hdr, 100, 400, &slots);
        assert!(ok(h(0, 100)));
        assert!(ok(h(50, 150))); // a coalesced run over slots 0 and 1
        assert!(!ok(h(150, 100))); // reaches into free slot 2
        assert!(!ok(h(200, 1))); // free slot
        assert!(!ok(h(390, 20))); // past the end
        assert!(!ok(h(u64::MAX, 2))); // overflow
        assert!(ok(h(400, 0))); // empty write at the end
        assert!(!ok(h(401, 0)));
    }
}
