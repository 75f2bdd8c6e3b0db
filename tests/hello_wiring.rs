//! The per-receiver data-plane handshake (how rdma is wired), without an
//! RDMA device: a test transport named "rdma" whose poster records
//! `prepare` / `connect_prepared` / `discard_prepared` and moves the bytes
//! over shm, and a receiver whose `HelloAcceptor` records `accept` and
//! answers with its shm buffer. Proves that the descriptor `prepare` made
//! reaches the receiver's acceptor in the `Hello`, that the `HelloAck`'s
//! descriptor reaches `connect_prepared` together with it, and that every
//! failure on the way is a typed request failure.

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::sync::Arc;

use parking_lot::Mutex;

use common_sender::*;
use kvferry::protocol::{Descriptor, ErrorCode};
use kvferry::receiver::{AcceptorFactory, HelloAcceptor, Receiver, ReceiverError};
use kvferry::sender::{RequestStatus, Sender, SenderError};
use kvferry::staging::StagingBuffer;
use kvferry::transport::shm::ShmTransport;
use kvferry::transport::{
    FaultConfig, FaultTransport, PeerIndex, Poster, RemoteBuffer, Started, Transport,
    TransportConfig, TransportError, WriteOp,
};

/// What the test poster and acceptor saw, in order.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    Prepare(Descriptor),
    Accept(Descriptor),
    ConnectPrepared(Descriptor, Descriptor),
    Discard(Descriptor),
}

type Log = Arc<Mutex<Vec<Event>>>;

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
}

impl Transport for Recording {
    fn kind(&self) -> &'static str {
        "rdma"
    }

    fn local_descriptor(&self) -> Descriptor {
        Descriptor::None
    }

    fn start(self: Box<Self>, local: Arc<StagingBuffer>) -> Result<Started, TransportError> {
        let (inner, completions) = Box::new(self.inner).start(local)?;
        let poster = RecordingPoster {
            inner,
            log: self.log,
            refuse_prepare: self.refuse_prepare,
            next_qp: 0x100,
        };
        Ok((Box::new(poster), completions))
    }
}

struct RecordingPoster {
    inner: Box<dyn Poster>,
    log: Log,
    refuse_prepare: Option<TransportError>,
    next_qp: u32,
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
        self.inner.connect(remote)
    }

    fn discard_prepared(&mut self, prepared: &Descriptor) {
        self.log.lock().push(Event::Discard(prepared.clone()));
    }

    fn disconnect(&mut self, peer: PeerIndex) {
        self.inner.disconnect(peer);
    }

    fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError> {
        self.inner.post(ops)
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
    refuse: Option<String>,
}

impl HelloAcceptor for ShmAcceptor {
    fn kind(&self) -> &'static str {
        "rdma"
    }

    fn accept(&mut self, sender: &Descriptor) -> Result<Descriptor, String> {
        self.log.lock().push(Event::Accept(sender.clone()));
        match &self.refuse {
            Some(e) => Err(e.clone()),
            None => Ok(self.shm.clone()),
        }
    }

    fn forget(&mut self, _sender: &Descriptor) {}
}

fn acceptor(log: &Log, refuse: Option<&str>) -> AcceptorFactory {
    let (log, refuse) = (log.clone(), refuse.map(str::to_owned));
    AcceptorFactory::new(move |region| {
        Ok(Box::new(ShmAcceptor {
            shm: Descriptor::Shm {
                path: region.path().to_string_lossy().into_owned(),
                len: region.data_len(),
            },
            log: log.clone(),
            refuse: refuse.clone(),
        }))
    })
}

fn receiver_with(log: &Log, refuse: Option<&str>) -> Receiver {
    Receiver::start(kvferry::receiver::ReceiverConfig {
        acceptor: Some(acceptor(log, refuse)),
        ..receiver_cfg(16)
    })
    .expect("receiver starts")
}

fn recording(log: &Log, refuse_prepare: Option<TransportError>) -> Recording {
    Recording {
        inner: ShmTransport::new(&TransportConfig::default()).expect("shm transport"),
        log: log.clone(),
        refuse_prepare,
    }
}

fn rdma_sender(transport: Box<dyn Transport>) -> Sender {
    Sender::with_transport(
        kvferry::sender::SenderConfig {
            transport: "rdma".into(),
            ..sender_cfg(8, None)
        },
        transport,
    )
    .expect("sender starts")
}

/// Runs request `req` (3 chunks) and returns its status; consumes it at the
/// receiver when it completes.
fn run_one(s: &Sender, r: &Receiver, req: &str) -> RequestStatus {
    store_batch(s, r.endpoint(), req, 7, 3, 0..3).expect("store");
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
