//! The per-receiver data-plane handshake (how rdma is wired), without an
//! RDMA device: a test transport named "rdma" whose poster records
//! `prepare` / `connect_prepared` / `discard_prepared` and moves the bytes
//! over shm, and a receiver whose `HelloAcceptor` records `accept` and
//! answers with its shm buffer. Proves that the descriptor `prepare` made
//! reaches the receiver's acceptor in the `Hello`, that the `HelloAck`'s
//! descriptor reaches `connect_prepared` together with it, and that every
//! failure on the way is a typed request failure.
//!
//! The poster can also kill a connection (its writes then complete with
//! `ConnectionLost`, as an RDMA QP moved to the error state by the
//! receiver's `forget` does): the sender re-handshakes with a fresh
//! descriptor, at most once per `rehello_backoff`, and only for a data
//! plane negotiated per pair through `Hello`.

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use common_sender::*;
use kvferry::protocol::{Descriptor, ErrorCode};
use kvferry::receiver::{AcceptorFactory, HelloAcceptor, Receiver, ReceiverError};
use kvferry::sender::{RequestStatus, Sender, SenderError, StoreError};
use kvferry::staging::StagingBuffer;
use kvferry::transport::shm::ShmTransport;
use kvferry::transport::{
    Completion, CompletionStatus, Completions, FaultConfig, FaultTransport, PeerIndex, PollStatus,
    Poster, RemoteBuffer, Started, Transport, TransportConfig, TransportError, WriteOp,
};

/// What the test poster and acceptor saw, in order.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    Prepare(Descriptor),
    Accept(Descriptor),
    ConnectPrepared(Descriptor, Descriptor),
    Discard(Descriptor),
    /// The sender disconnected the peer connected with this prepared side.
    Disconnect(Descriptor),
    /// The receiver's acceptor forgot this sender descriptor.
    Forget(Descriptor),
}

type Log = Arc<Mutex<Vec<Event>>>;

/// Which connections are dead: writes to them complete with
/// `ConnectionLost` and land nothing.
#[derive(Debug, Clone, Default)]
struct Kill {
    /// Connections made with these prepared QP numbers (what the receiver
    /// `forget`s is added here too, as the RDMA QP would move to error).
    qps: Arc<Mutex<HashSet<u32>>>,
    /// Every connection.
    all: Arc<AtomicBool>,
}

impl Kill {
    fn qp(&self, qp_num: u32) {
        self.qps.lock().insert(qp_num);
    }

    fn all(&self, on: bool) {
        // SeqCst: test control flag, read by the poster on the ctrl thread.
        self.all.store(on, Ordering::SeqCst);
    }

    fn is_dead(&self, prepared: &Descriptor) -> bool {
        // SeqCst: see `all`.
        self.all.load(Ordering::SeqCst)
            || matches!(prepared, Descriptor::Rdma { qp_num, .. } if self.qps.lock().contains(qp_num))
    }
}

/// Count of `event`s matching `f` in the log.
fn count(log: &Log, f: impl Fn(&Event) -> bool) -> usize {
    log.lock().iter().filter(|e| f(e)).count()
}

/// A fake queue-pair descriptor.
fn qp(qp_num: u32) -> Descriptor {
    Descriptor::Rdma {
        qp_num,
        lid: 0,
        gid: vec![0xfe; 16],
        rkey: 0,
        addr: 0x1000,
        len: 0x1000,
    }
}

/// A transport called "rdma" that needs a per-receiver descriptor like
/// rdma does, and writes over shm.
struct Recording {
    inner: ShmTransport,
    log: Log,
    /// `prepare` fails with this.
    refuse_prepare: Option<TransportError>,
    /// "rdma" (a per-pair descriptor from `prepare`) or "shm" (`prepare`
    /// gives `Descriptor::None`, as shm and tcp do).
    kind: &'static str,
    kill: Kill,
}

impl Transport for Recording {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn local_descriptor(&self) -> Descriptor {
        Descriptor::None
    }

    fn start(self: Box<Self>, local: Arc<StagingBuffer>) -> Result<Started, TransportError> {
        let (inner, completions) = Box::new(self.inner).start(local)?;
        let doomed = Arc::new(Mutex::new(HashSet::new()));
        let poster = RecordingPoster {
            inner,
            log: self.log,
            refuse_prepare: self.refuse_prepare,
            next_qp: 0x100,
            per_pair: self.kind == "rdma",
            kill: self.kill,
            links: HashMap::new(),
            doomed: doomed.clone(),
        };
        let completions = LosingCompletions {
            inner: completions,
            doomed,
        };
        Ok((Box::new(poster), Box::new(completions)))
    }
}

struct RecordingPoster {
    inner: Box<dyn Poster>,
    log: Log,
    refuse_prepare: Option<TransportError>,
    next_qp: u32,
    per_pair: bool,
    kill: Kill,
    /// The prepared side each connected peer was connected with.
    links: HashMap<PeerIndex, Descriptor>,
    /// Work ids posted to a dead connection: their completions become
    /// `ConnectionLost`.
    doomed: Arc<Mutex<HashSet<u64>>>,
}

/// The shm completions, with the writes posted to dead connections turned
/// into `ConnectionLost`.
struct LosingCompletions {
    inner: Box<dyn Completions>,
    doomed: Arc<Mutex<HashSet<u64>>>,
}

impl Completions for LosingCompletions {
    fn poll(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
        deadline: Option<Instant>,
    ) -> PollStatus {
        let start = out.len();
        let st = self.inner.poll(out, max, deadline);
        let mut doomed = self.doomed.lock();
        for c in &mut out[start..] {
            if doomed.remove(&c.work_id) {
                *c = Completion::new(c.work_id, CompletionStatus::ConnectionLost);
            }
        }
        st
    }
}

impl Poster for RecordingPoster {
    fn connect(&mut self, _remote: &RemoteBuffer) -> Result<PeerIndex, TransportError> {
        Err(TransportError::BadDescriptor(
            "this test transport connects with connect_prepared only".into(),
        ))
    }

    fn prepare(&mut self) -> Result<Descriptor, TransportError> {
        if let Some(e) = self.refuse_prepare.take() {
            return Err(e);
        }
        if !self.per_pair {
            self.log.lock().push(Event::Prepare(Descriptor::None));
            return Ok(Descriptor::None);
        }
        self.next_qp += 1;
        let d = qp(self.next_qp);
        self.log.lock().push(Event::Prepare(d.clone()));
        Ok(d)
    }

    fn connect_prepared(
        &mut self,
        prepared: &Descriptor,
        remote: &RemoteBuffer,
    ) -> Result<PeerIndex, TransportError> {
        self.log.lock().push(Event::ConnectPrepared(
            prepared.clone(),
            remote.descriptor.clone(),
        ));
        let index = self.inner.connect(remote)?;
        self.links.insert(index, prepared.clone());
        Ok(index)
    }

    fn discard_prepared(&mut self, prepared: &Descriptor) {
        self.log.lock().push(Event::Discard(prepared.clone()));
    }

    fn disconnect(&mut self, peer: PeerIndex) {
        if let Some(d) = self.links.remove(&peer) {
            self.log.lock().push(Event::Disconnect(d));
        }
        self.inner.disconnect(peer);
    }

    fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError> {
        // Writes to a dead connection land nothing (an empty write) and
        // complete with ConnectionLost.
        let mut doomed = Vec::new();
        let ops: Vec<WriteOp> = ops
            .iter()
            .map(|op| {
                let dead = self
                    .links
                    .get(&op.peer)
                    .is_some_and(|d| self.kill.is_dead(d));
                if dead {
                    doomed.push(op.work_id);
                    WriteOp {
                        local_offset: 0,
                        remote_offset: 0,
                        len: 0,
                        ..*op
                    }
                } else {
                    *op
                }
            })
            .collect();
        // Marked before posting: the completion may come at once.
        self.doomed.lock().extend(doomed.iter().copied());
        let n = self.inner.post(&ops);
        let accepted = *n.as_ref().unwrap_or(&0);
        let mut d = self.doomed.lock();
        for w in ops[accepted..].iter().map(|op| op.work_id) {
            d.remove(&w);
        }
        n
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    fn credits(&self) -> usize {
        self.inner.credits()
    }
}

/// Answers a "rdma" Hello with the receiver's shm buffer, or refuses.
#[derive(Debug)]
struct ShmAcceptor {
    shm: Descriptor,
    log: Log,
    refuse: Arc<Mutex<Option<String>>>,
    kill: Kill,
    /// `accept` takes this long (a receiver slow to set up its side).
    slow: Duration,
}

impl HelloAcceptor for ShmAcceptor {
    fn kind(&self) -> &'static str {
        "rdma"
    }

    fn accept(&mut self, sender: &Descriptor) -> Result<Descriptor, String> {
        self.log.lock().push(Event::Accept(sender.clone()));
        std::thread::sleep(self.slow);
        match &*self.refuse.lock() {
            Some(e) => Err(e.clone()),
            None => Ok(self.shm.clone()),
        }
    }

    fn forget(&mut self, sender: &Descriptor) {
        self.log.lock().push(Event::Forget(sender.clone()));
        // The real acceptor destroys the QP: the sender's side moves to error.
        if let Descriptor::Rdma { qp_num, .. } = sender {
            self.kill.qp(*qp_num);
        }
    }
}

fn acceptor(log: &Log, refuse: Arc<Mutex<Option<String>>>, kill: &Kill) -> AcceptorFactory {
    slow_acceptor(log, refuse, kill, Duration::ZERO)
}

/// An acceptor whose `accept` takes `slow`.
fn slow_acceptor(
    log: &Log,
    refuse: Arc<Mutex<Option<String>>>,
    kill: &Kill,
    slow: Duration,
) -> AcceptorFactory {
    let (log, kill) = (log.clone(), kill.clone());
    AcceptorFactory::new(move |region| {
        Ok(Box::new(ShmAcceptor {
            shm: Descriptor::Shm {
                path: region.path().to_string_lossy().into_owned(),
                len: region.data_len(),
            },
            log: log.clone(),
            refuse: refuse.clone(),
            kill: kill.clone(),
            slow,
        }))
    })
}

fn receiver_with(log: &Log, refuse: Option<&str>) -> Receiver {
    receiver_killing(
        log,
        Arc::new(Mutex::new(refuse.map(str::to_owned))),
        &Kill::default(),
    )
}

/// A receiver whose acceptor refuses while `refuse` holds a reason and
/// kills what it forgets in `kill`.
fn receiver_killing(log: &Log, refuse: Arc<Mutex<Option<String>>>, kill: &Kill) -> Receiver {
    Receiver::start(kvferry::receiver::ReceiverConfig {
        acceptor: Some(acceptor(log, refuse, kill)),
        ..receiver_cfg(16)
    })
    .expect("receiver starts")
}

fn recording(log: &Log, refuse_prepare: Option<TransportError>) -> Recording {
    killable(log, refuse_prepare, "rdma", &Kill::default())
}

fn killable(
    log: &Log,
    refuse_prepare: Option<TransportError>,
    kind: &'static str,
    kill: &Kill,
) -> Recording {
    Recording {
        inner: ShmTransport::new(&TransportConfig::default()).expect("shm transport"),
        log: log.clone(),
        refuse_prepare,
        kind,
        kill: kill.clone(),
    }
}

fn rdma_sender(transport: Box<dyn Transport>) -> Sender {
    sender_with_backoff(transport, Duration::from_secs(1))
}

fn sender_with_backoff(transport: Box<dyn Transport>, rehello_backoff: Duration) -> Sender {
    Sender::with_transport(
        kvferry::sender::SenderConfig {
            transport: transport.kind().into(),
            rehello_backoff,
            ..sender_cfg(8, None)
        },
        transport,
    )
    .expect("sender starts")
}

/// A receiver whose acceptor takes `accept_delay` to accept, and a sender
/// over a recording "rdma" transport that waits `hello_timeout` for a
/// `HelloAck` (the late-HelloAck tests of issue 14).
fn late_ack_pair(log: &Log, accept_delay: Duration, hello_timeout: Duration) -> (Receiver, Sender) {
    let receiver = Receiver::start(kvferry::receiver::ReceiverConfig {
        acceptor: Some(slow_acceptor(
            log,
            Arc::default(),
            &Kill::default(),
            accept_delay,
        )),
        ..receiver_cfg(16)
    })
    .expect("receiver starts");
    let sender = Sender::with_transport(
        kvferry::sender::SenderConfig {
            transport: "rdma".into(),
            hello_timeout,
            ..sender_cfg(8, None)
        },
        Box::new(recording(log, None)),
    )
    .expect("sender starts");
    (receiver, sender)
}

/// Runs request `req` (3 chunks) and returns its status; consumes it at the
/// receiver when it completes.
fn run_one(s: &Sender, r: &Receiver, req: &str) -> RequestStatus {
    // The request begins (and may fail) before its first batch is stored:
    // a failure can already be the store's answer.
    match store_batch(s, r.endpoint(), req, 7, 3, 0..3) {
        Ok(()) => {}
        Err(StoreError::RequestEnded(st)) => return st,
        Err(e) => panic!("store {req}: {e:?}"),
    }
    let st = terminal(s, req);
    if st == RequestStatus::Completed {
        consume(r, req, 7, 3).unwrap_or_else(|e| panic!("{e}"));
    }
    st
}

fn failure(st: RequestStatus) -> (ErrorCode, String) {
    match st {
        RequestStatus::Failed { code, reason } => (code, reason),
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[test]
fn prepare_reaches_the_acceptor_and_the_ack_reaches_connect_prepared() {
    for wrap in [false, true] {
        let log = Log::default();
        let receiver = receiver_with(&log, None);
        let mut transport: Box<dyn Transport> = Box::new(recording(&log, None));
        if wrap {
            // The fault wrapper forwards the handshake untouched.
            transport = Box::new(FaultTransport::new(transport, FaultConfig::default()));
        }
        let sender = rdma_sender(transport);
        assert_eq!(
            run_one(&sender, &receiver, &unique("wired")),
            RequestStatus::Completed,
            "wrapped in FaultTransport: {wrap}"
        );
        // A second request reuses the connection: no second handshake.
        assert_eq!(
            run_one(&sender, &receiver, &unique("wired")),
            RequestStatus::Completed
        );
        let shm = remote_buffer(&receiver).descriptor;
        assert_eq!(
            *log.lock(),
            vec![
                Event::Prepare(qp(0x101)),
                Event::Accept(qp(0x101)),
                Event::ConnectPrepared(qp(0x101), shm),
            ],
            "wrapped in FaultTransport: {wrap}"
        );
        assert_eq!(sender.close(deadline()), 0);
        wait_receiver_empty(&receiver, "after the wired requests");
    }
}

#[test]
fn a_refused_accept_fails_the_request_with_the_receivers_reason() {
    let log = Log::default();
    let receiver = receiver_with(&log, Some("ibv_create_qp: Cannot allocate memory"));
    let sender = rdma_sender(Box::new(recording(&log, None)));
    let (code, reason) = failure(run_one(&sender, &receiver, &unique("refused")));
    assert_eq!(code, ErrorCode::PeerUnavailable);
    assert!(
        reason.contains("refused the rdma data plane")
            && reason.contains("ibv_create_qp: Cannot allocate memory"),
        "{reason}"
    );
    assert_eq!(
        *log.lock(),
        vec![
            Event::Prepare(qp(0x101)),
            Event::Accept(qp(0x101)),
            Event::Discard(qp(0x101)),
        ]
    );
    let _ = sender.close(deadline());
    wait_receiver_empty(&receiver, "after the refused Hello");
}

/// Bug 2 of issue 14: a `HelloAck` later than `hello_timeout` (a receiver
/// slow to set up its data plane, as when registering memory under load)
/// made the sender take the kvferry receiver for an LMCache one for good;
/// with no static descriptor configured, every request to it failed ("did
/// not answer Hello"). Only a receiver with a static descriptor falls back;
/// this one is waited for and connected by its late `HelloAck`.
#[test]
fn a_hello_ack_later_than_hello_timeout_still_connects_the_receiver() {
    let log = Log::default();
    let (receiver, sender) =
        late_ack_pair(&log, Duration::from_millis(600), Duration::from_millis(100));
    for _ in 0..3 {
        assert_eq!(
            run_one(&sender, &receiver, &unique("late-ack")),
            RequestStatus::Completed
        );
    }
    let shm = remote_buffer(&receiver).descriptor;
    assert_eq!(
        *log.lock(),
        vec![
            Event::Prepare(qp(0x101)),
            Event::Accept(qp(0x101)),
            Event::ConnectPrepared(qp(0x101), shm),
        ],
        "one handshake, nothing discarded"
    );
    assert_eq!(sender.close(deadline()), 0);
    wait_receiver_empty(&receiver, "after the late-HelloAck requests");
}

#[test]
fn a_failed_prepare_fails_the_request_without_a_hello() {
    let log = Log::default();
    let receiver = receiver_with(&log, None);
    let sender = rdma_sender(Box::new(recording(
        &log,
        Some(TransportError::NoDevice(
            "the queue pair cannot be made".into(),
        )),
    )));
    let (code, reason) = failure(run_one(&sender, &receiver, &unique("unprepared")));
    assert_eq!(code, ErrorCode::PeerUnavailable);
    assert!(
        reason.contains("cannot prepare the rdma transport")
            && reason.contains("the queue pair cannot be made"),
        "{reason}"
    );
    assert!(
        log.lock().is_empty(),
        "no Hello, no accept: {:?}",
        log.lock()
    );
    let _ = sender.close(deadline());
}

#[test]
fn a_receiver_that_does_not_offer_the_transport_gets_the_prepared_side_discarded() {
    let log = Log::default();
    let receiver = common_sender::receiver(16); // shm only
    let sender = rdma_sender(Box::new(recording(&log, None)));
    let (code, reason) = failure(run_one(&sender, &receiver, &unique("unoffered")));
    assert_eq!(code, ErrorCode::PeerUnavailable);
    assert!(
        reason.contains("does not offer the rdma data plane (it offers shm)"),
        "{reason}"
    );
    assert_eq!(
        *log.lock(),
        vec![Event::Prepare(qp(0x101)), Event::Discard(qp(0x101))]
    );
    let _ = sender.close(deadline());
}

#[test]
fn an_acceptor_that_cannot_start_fails_the_receiver_with_a_transport_error() {
    let failing = AcceptorFactory::new(|_| {
        Err(TransportError::NoDevice(
            "no RDMA device was found (test)".into(),
        ))
    });
    let e = Receiver::start(kvferry::receiver::ReceiverConfig {
        acceptor: Some(failing),
        ..receiver_cfg(4)
    })
    .expect_err("no acceptor, no receiver");
    assert!(
        matches!(&e, ReceiverError::Transport(TransportError::NoDevice(_))),
        "{e:?}"
    );
    assert!(e.to_string().contains("no RDMA device was found"), "{e}");
}

#[test]
fn a_transport_whose_kind_is_not_the_configured_one_is_refused() {
    let log = Log::default();
    let e = Sender::with_transport(
        sender_cfg(8, None), // says "shm"
        Box::new(recording(&log, None)),
    )
    .expect_err("kind mismatch");
    assert!(
        matches!(&e, SenderError::Config(m) if m.contains("rdma")),
        "{e:?}"
    );
}

/// `kvferry receiver --rdma` where rdma cannot be offered (a build without
/// the `rdma` feature, or no device) exits 2 and says why.
#[test]
fn kvferry_receiver_rdma_exits_2_when_rdma_cannot_be_offered() {
    #[cfg(feature = "rdma")]
    if kvferry::transport::rdma::probe().is_ok() {
        eprintln!("SKIP kvferry_receiver_rdma_exits_2_when_rdma_cannot_be_offered: this host has an RDMA device");
        return;
    }
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["receiver", "--rdma", "--listen", "tcp://127.0.0.1:0"])
        .env_remove("KVFERRY_RDMA_DEVICE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvferry starts");
    let end = deadline();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvferry receiver --rdma did not exit within {WAIT:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
        .expect("read stderr");
    assert_eq!(status.code(), Some(2), "stderr: {err}");
    let why = if cfg!(feature = "rdma") {
        "no RDMA device was found"
    } else {
        "needs the `rdma` cargo feature"
    };
    assert!(err.contains("--rdma") && err.contains(why), "stderr: {err}");
}

/// Waits until the log holds `event`.
fn wait_event(log: &Log, event: &Event, what: &str) {
    wait_for(what, || log.lock().contains(event));
}

fn write_failed(st: RequestStatus) -> String {
    let (code, reason) = failure(st);
    assert_eq!(code, ErrorCode::WriteFailed, "{reason}");
    reason
}

#[test]
fn a_lost_data_plane_is_re_handshaken_with_a_new_queue_pair() {
    let log = Log::default();
    let kill = Kill::default();
    let receiver = receiver_killing(&log, Arc::default(), &kill);
    let sender = sender_with_backoff(
        Box::new(killable(&log, None, "rdma", &kill)),
        Duration::from_millis(100),
    );
    assert_eq!(
        run_one(&sender, &receiver, &unique("before")),
        RequestStatus::Completed
    );
    // The receiver destroyed its QP (as after a lease expiry): the sender's
    // QP 0x101 is in error, its writes complete with ConnectionLost.
    kill.qp(0x101);
    let reason = write_failed(run_one(&sender, &receiver, &unique("lost")));
    assert!(reason.contains("connection_lost"), "{reason}");
    // (a) nothing leaks on either side; the CancelNotif went out on the old
    // socket before it was replaced.
    wait_sender_empty(&sender, "after the lost request");
    wait_receiver_empty(&receiver, "after the lost request was cancelled");
    // (b) a second Hello with a new queue pair; the receiver forgets the old
    // one although the new Hello comes from a new socket identity.
    wait_event(
        &log,
        &Event::ConnectPrepared(qp(0x102), remote_buffer(&receiver).descriptor),
        "the re-handshake with QP 0x102 to connect",
    );
    // (c) later requests go over the new connection, bytes verified.
    for _ in 0..3 {
        assert_eq!(
            run_one(&sender, &receiver, &unique("after")),
            RequestStatus::Completed
        );
    }
    let shm = remote_buffer(&receiver).descriptor;
    assert_eq!(
        *log.lock(),
        vec![
            Event::Prepare(qp(0x101)),
            Event::Accept(qp(0x101)),
            Event::ConnectPrepared(qp(0x101), shm.clone()),
            Event::Disconnect(qp(0x101)),
            Event::Prepare(qp(0x102)),
            Event::Forget(qp(0x101)),
            Event::Accept(qp(0x102)),
            Event::ConnectPrepared(qp(0x102), shm),
        ]
    );
    assert_eq!(sender.close(deadline()), 0);
    wait_receiver_empty(&receiver, "after the re-handshaken requests");
}

#[test]
fn requests_arriving_during_the_re_handshake_wait_for_it() {
    let log = Log::default();
    let kill = Kill::default();
    let receiver = receiver_killing(&log, Arc::default(), &kill);
    // A backoff far longer than the test: the re-Hello cannot happen, so
    // a request stored after the loss must wait, not fail and not Hello.
    let sender = sender_with_backoff(
        Box::new(killable(&log, None, "rdma", &kill)),
        Duration::from_secs(3600),
    );
    assert_eq!(
        run_one(&sender, &receiver, &unique("before")),
        RequestStatus::Completed
    );
    kill.qp(0x101);
    write_failed(run_one(&sender, &receiver, &unique("lost")));
    let waiting = unique("waiting");
    store_batch(&sender, receiver.endpoint(), &waiting, 7, 3, 0..3).expect("store");
    // Give a wrong implementation time to re-Hello or fail the request.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(sender.status(&waiting), Some(RequestStatus::InProgress));
    assert_eq!(
        count(&log, |e| matches!(e, Event::Prepare(_))),
        1,
        "no second Hello within the backoff: {:?}",
        log.lock()
    );
    assert!(sender.cancel_request(&waiting));
    assert_eq!(terminal(&sender, &waiting), RequestStatus::Cancelled);
    wait_sender_empty(&sender, "after cancelling the waiting request");
    wait_receiver_empty(&receiver, "after cancelling the waiting request");
    assert_eq!(sender.close(deadline()), 0);
}

#[test]
fn repeated_losses_re_hello_at_most_once_per_backoff_period() {
    let log = Log::default();
    let kill = Kill::default();
    let receiver = receiver_killing(&log, Arc::default(), &kill);
    let backoff = Duration::from_millis(250);
    let start = Instant::now();
    let sender = sender_with_backoff(Box::new(killable(&log, None, "rdma", &kill)), backoff);
    // Every connection dies at once: each request loses it again.
    kill.all(true);
    for _ in 0..5 {
        write_failed(run_one(&sender, &receiver, &unique("doomed")));
    }
    let hellos = count(&log, |e| matches!(e, Event::Accept(_)));
    let elapsed = start.elapsed();
    // The first Hello is free; every later one needs a full backoff after
    // the previous one.
    let bound = 1 + (elapsed.as_nanos() / backoff.as_nanos()) as usize;
    assert!(
        (2..=bound).contains(&hellos),
        "{hellos} Hellos in {elapsed:?} with a {backoff:?} backoff (at most {bound}): {:?}",
        log.lock()
    );
    // Each Hello prepared a new queue pair and each lost one was disconnected
    // before the next Hello.
    assert_eq!(count(&log, |e| matches!(e, Event::Prepare(_))), hellos);
    assert!(count(&log, |e| matches!(e, Event::Disconnect(_))) >= hellos - 1);
    kill.all(false);
    wait_for("a request over a live connection again", || {
        run_one(&sender, &receiver, &unique("alive")) == RequestStatus::Completed
    });
    wait_sender_empty(&sender, "after the doomed requests");
    assert_eq!(sender.close(deadline()), 0);
    wait_receiver_empty(&receiver, "after the doomed requests");
}

#[test]
fn a_refused_re_hello_fails_requests_until_a_retry_after_the_backoff_succeeds() {
    let log = Log::default();
    let kill = Kill::default();
    let refuse: Arc<Mutex<Option<String>>> = Arc::default();
    let receiver = receiver_killing(&log, refuse.clone(), &kill);
    let sender = sender_with_backoff(
        Box::new(killable(&log, None, "rdma", &kill)),
        Duration::from_millis(200),
    );
    assert_eq!(
        run_one(&sender, &receiver, &unique("before")),
        RequestStatus::Completed
    );
    *refuse.lock() = Some("ibv_create_qp: Cannot allocate memory".into());
    kill.qp(0x101);
    write_failed(run_one(&sender, &receiver, &unique("lost")));
    wait_event(&log, &Event::Discard(qp(0x102)), "the refused re-Hello");
    // The peer is failed: requests fail with the receiver's reason (a retry
    // after the backoff is refused again).
    let (code, reason) = failure(run_one(&sender, &receiver, &unique("refused")));
    assert_eq!(code, ErrorCode::PeerUnavailable);
    assert!(
        reason.contains("refused the rdma data plane") && reason.contains("Cannot allocate"),
        "{reason}"
    );
    *refuse.lock() = None;
    wait_for(
        "a request after the backoff to re-handshake and complete",
        || match run_one(&sender, &receiver, &unique("retry")) {
            RequestStatus::Completed => true,
            st => {
                assert_eq!(failure(st).0, ErrorCode::PeerUnavailable);
                std::thread::sleep(Duration::from_millis(20));
                false
            }
        },
    );
    wait_sender_empty(&sender, "after the retried handshake");
    assert_eq!(sender.close(deadline()), 0);
    wait_receiver_empty(&receiver, "after the retried handshake");
}

#[test]
fn a_lost_connection_without_a_per_pair_handshake_is_not_re_handshaken() {
    // shm and tcp prepare nothing (`Descriptor::None`): a ConnectionLost
    // (tcp reconnects inside its engine) never makes the sender say Hello
    // again, even with no backoff at all.
    let log = Log::default();
    let kill = Kill::default();
    let receiver = common_sender::receiver(16);
    let sender = sender_with_backoff(Box::new(killable(&log, None, "shm", &kill)), Duration::ZERO);
    assert_eq!(
        run_one(&sender, &receiver, &unique("before")),
        RequestStatus::Completed
    );
    kill.all(true);
    for _ in 0..3 {
        let reason = write_failed(run_one(&sender, &receiver, &unique("lost")));
        assert!(reason.contains("connection_lost"), "{reason}");
    }
    kill.all(false);
    // The same connection carries the next request.
    assert_eq!(
        run_one(&sender, &receiver, &unique("after")),
        RequestStatus::Completed
    );
    let shm = remote_buffer(&receiver).descriptor;
    assert_eq!(
        *log.lock(),
        vec![
            Event::Prepare(Descriptor::None),
            Event::ConnectPrepared(Descriptor::None, shm),
        ],
        "one Hello, no disconnect"
    );
    wait_sender_empty(&sender, "after the lost writes");
    assert_eq!(sender.close(deadline()), 0);
    wait_receiver_empty(&receiver, "after the lost writes");
}

#[test]
fn a_hello_ack_after_the_hello_timeout_upgrades_the_receiver_to_kvferry_mode() {
    // The receiver takes 300 ms to accept, the sender waits 50 ms for the
    // HelloAck: it takes the receiver for an LMCache one (and, with no static
    // descriptor, fails its requests) until the HelloAck arrives, then
    // upgrades it to kvferry mode instead of staying in LMCache mode for good.
    let log = Log::default();
    let (receiver, sender) =
        late_ack_pair(&log, Duration::from_millis(300), Duration::from_millis(50));
    let end = deadline();
    let mut failed = 0;
    loop {
        match run_one(&sender, &receiver, &unique("late")) {
            RequestStatus::Completed => break,
            st => {
                // Before the upgrade: an unreachable "LMCache receiver".
                assert_eq!(failure(st).0, ErrorCode::PeerUnavailable);
                failed += 1;
            }
        }
        assert!(
            Instant::now() < end,
            "still no request completed after {WAIT:?} ({failed} failed): the late HelloAck never upgraded the receiver"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let shm = remote_buffer(&receiver).descriptor;
    assert_eq!(
        count(&log, |e| *e
            == Event::ConnectPrepared(qp(0x101), shm.clone())),
        1,
        "the late HelloAck connected what the first Hello prepared: {:?}",
        log.lock()
    );
    // Later requests stay in kvferry mode (no new handshake).
    assert_eq!(
        run_one(&sender, &receiver, &unique("late")),
        RequestStatus::Completed
    );
    assert_eq!(count(&log, |e| matches!(e, Event::Prepare(_))), 1);
    assert_eq!(sender.close(deadline()), 0);
    wait_receiver_empty(&receiver, "after the late HelloAck");
}
