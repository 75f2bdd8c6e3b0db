//! The TCP transport: the conformance suite (`conformance::*`, see
//! `tests/common_transport/conformance.rs`) against a real receiver's data
//! listener, and what only tcp has: `kvferry run` scenarios over loopback
//! (with aborts and injected write failures), grants and secrets checked by
//! the receiver, raw connections, scripted fake listeners (loss, timeouts,
//! fencing), the receiver's configuration, and a data connection cut
//! mid-transfer.

mod common;

mod common_transport;
use common_transport::{collect, op, pattern, post_all, read_slot, WAIT};
#[path = "common_transport/conformance.rs"]
#[macro_use]
mod suite;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::protocol::{Descriptor, ErrorCode};
use kvferry::receiver::{Receiver, ReceiverConfig, ReceiverError};
use kvferry::runner::{self, ChunkRange, Progress, RunConfig};
use kvferry::sender::{RequestStatus, Sender, SenderConfig, StoreError, TransferSpec};
use kvferry::staging::StagingBuffer;
use kvferry::transport::tcp::wire::{
    self, Ack, Header, Preamble, ACK_LEN, HEADER_LEN, PREAMBLE_ACK_LEN, PREAMBLE_LEN,
};
use kvferry::transport::tcp::TcpTransport;
use kvferry::transport::{
    by_name, Completion, CompletionStatus, Completions, PollStatus, Poster, RemoteBuffer,
    Transport, TransportConfig, TransportError,
};

use common::{alloc, assert_ok, keys, wait_until, Client, CHUNK_BYTES};

// ----- kvferry run over tcp -------------------------------------------------

fn small(requests: usize) -> RunConfig {
    RunConfig {
        prefillers: 2,
        decoders: 2,
        requests,
        chunks: ChunkRange { min: 1, max: 8 },
        batch: 3,
        chunk_bytes: 4096,
        staging_slots: 12,
        capacity_chunks: 16,
        concurrency: 4,
        stall_timeout_s: 20.0,
        transport: "tcp".into(),
        ..RunConfig::default()
    }
}

fn assert_no_leaks(r: &runner::RunReport) {
    assert!(!r.deadlock, "watchdog fired: {:#?}", r.stall_dump);
    assert_eq!(r.checksum_mismatches, 0, "{}", r.render());
    assert_eq!(
        (
            r.leaked_staging_slots,
            r.leaked_receiver_slots,
            r.leaked_reservations
        ),
        (0, 0, 0),
        "{}",
        r.render()
    );
}

#[test]
fn run_over_tcp_succeeds_without_leaks() {
    let r = runner::run(small(1000), Progress::Quiet).expect("run starts");
    assert_no_leaks(&r);
    assert!(r.success(), "{}", r.render());
    assert_eq!(r.completed, 1000, "{}", r.render());
}

#[test]
fn run_over_tcp_with_aborts_and_write_failures_succeeds_without_leaks() {
    let cfg = RunConfig {
        abort_rate: 0.05,
        fail_rate: 0.02,
        seed: 7,
        ..small(2000)
    };
    let r = runner::run(cfg, Progress::Quiet).expect("run starts");
    assert_no_leaks(&r);
    assert!(r.success(), "{}", r.render());
    assert_eq!(r.completed + r.aborted + r.failed, 2000, "{}", r.render());
    assert!(r.aborted > 0 && r.failed > 0, "{}", r.render());
    assert_eq!(r.unexpected_failures, 0, "{}", r.render());
}

#[test]
fn run_over_tcp_with_large_chunks() {
    let cfg = RunConfig {
        chunk_bytes: 256 * 1024,
        staging_slots: 32,
        capacity_chunks: 32,
        ..small(200)
    };
    let r = runner::run(cfg, Progress::Quiet).expect("run starts");
    assert_no_leaks(&r);
    assert!(r.success(), "{}", r.render());
}

// ----- helpers --------------------------------------------------------------

fn tcp_receiver(capacity: usize) -> Receiver {
    common::start(ReceiverConfig {
        tcp_data: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..common::config(capacity)
    })
}

/// A control-plane client that said Hello for tcp, and the buffer its
/// HelloAck announced (with the secret that lets it write its grants).
fn tcp_client(r: &Receiver, name: &str) -> (Client, RemoteBuffer) {
    let client = Client::connect(r.endpoint(), name);
    let ack = client.hello_for("tcp");
    assert_eq!(ack.transport, "tcp");
    assert!(
        matches!(
            &ack.descriptor,
            Descriptor::Tcp {
                secret: Some(_),
                ..
            }
        ),
        "{ack:?}"
    );
    let remote = RemoteBuffer {
        descriptor: ack.descriptor,
        chunk_bytes: ack.chunk_bytes,
        capacity_chunks: ack.capacity_chunks,
    };
    (client, remote)
}

fn start(staging: &Arc<StagingBuffer>, ring: usize) -> (Box<dyn Poster>, Box<dyn Completions>) {
    let cfg = TransportConfig {
        ring_capacity: ring,
        ..TransportConfig::default()
    };
    by_name("tcp", &cfg)
        .unwrap()
        .start(staging.clone())
        .unwrap()
}

fn start_with_timeouts(
    staging: &Arc<StagingBuffer>,
    connect: Duration,
    io: Duration,
) -> (Box<dyn Poster>, Box<dyn Completions>) {
    let t = TcpTransport::new(&TransportConfig::default())
        .unwrap()
        .with_timeouts(connect, io)
        .unwrap();
    Box::new(t).start(staging.clone()).unwrap()
}

/// Grants `n` slots of a fresh request at `r` through the control plane.
fn grant(r: &Receiver, client: &Client, req: &str, n: usize) -> Vec<u32> {
    let ks = keys(req, n);
    let resp = client.call(&alloc(req, &ks, n as i64, false, None), "grant");
    let slots = assert_ok(&resp, n);
    assert!(slots
        .iter()
        .all(|&s| (s as u64) < r.region().capacity_chunks()));
    slots
}

// ----- the conformance suite ------------------------------------------------

/// The tcp transport under the conformance suite: each receiver is a real
/// `Receiver` with a tcp data listener; a control-plane client said Hello
/// for tcp (getting the secret) and was granted every slot.
struct Tcp {
    halves: suite::Halves,
    receivers: Vec<(Receiver, Client, RemoteBuffer)>,
}

impl suite::Fixture for Tcp {
    const KIND: &'static str = "tcp";
    const IN_ORDER: bool = false;
    // comm is truncated to 15 bytes: "kvf-tcp-engine", "kvf-recv-tcp-te".
    const THREADS: &'static [&'static str] = &["kvf-tcp-engine", "kvf-recv-tcp"];

    fn start(staging: Arc<StagingBuffer>, credits: usize) -> Self {
        Tcp {
            halves: suite::Halves::new(start(&staging, credits)),
            receivers: Vec::new(),
        }
    }
    fn add_receiver(&mut self, capacity: u64) -> (usize, u32) {
        assert_eq!(suite::CHUNK, CHUNK_BYTES);
        let r = tcp_receiver(capacity as usize);
        let (client, remote) = tcp_client(&r, "granter");
        let slots = grant(&r, &client, "req", capacity as usize);
        assert_eq!(
            slots,
            (0..capacity as u32).collect::<Vec<_>>(),
            "a fresh buffer grants from slot 0"
        );
        self.receivers.push((r, client, remote));
        let rx = self.receivers.len() - 1;
        (rx, self.reconnect(rx).expect("connect"))
    }
    fn reconnect(&mut self, rx: usize) -> Result<u32, TransportError> {
        let remote = self.receivers[rx].2.clone();
        suite::Fixture::poster(self).connect(&remote)
    }
    fn read_slot(&self, rx: usize, slot: u32) -> Vec<u8> {
        read_slot(self.receivers[rx].0.region(), slot, CHUNK_BYTES as usize)
    }
    fn connections(&self, rx: usize) -> Option<usize> {
        Some(self.receivers[rx].0.tcp_data_connections())
    }
    fn await_disconnected(&self, rx: usize) {
        let r = &self.receivers[rx].0;
        wait_until("the disconnected peer's connection closed", || {
            r.tcp_data_connections() == 0
        });
    }
    fn foreign() -> Descriptor {
        Descriptor::Shm {
            path: "/nonexistent".into(),
            len: 4 * CHUNK_BYTES,
        }
    }
    fn parts(&mut self) -> (Option<&mut dyn Poster>, Option<&mut dyn Completions>) {
        self.halves.parts()
    }
    fn drop_poster(&mut self) {
        self.halves.poster = None;
    }
    fn drop_completions(&mut self) {
        self.halves.completions = None;
    }
}

conformance_suite!(crate::Tcp; idle_threads_sleep);

// ----- transport level against a real receiver ------------------------------

#[test]
fn a_write_outside_the_granted_slots_is_rejected_and_closes_the_connection() {
    let r = tcp_receiver(8);
    let (client, remote) = tcp_client(&r, "granter");
    let slots = grant(&r, &client, "req", 2);
    assert_eq!(slots, vec![0, 1]);
    let mut staging = StagingBuffer::new(4, CHUNK_BYTES).unwrap();
    staging.write_slot(0, &pattern(9, 4096)).unwrap();
    let staging = Arc::new(staging);
    let (mut poster, mut comps) = start(&staging, 16);
    let peer = poster.connect(&remote).unwrap();
    wait_until("the data connection is up", || {
        r.tcp_data_connections() == 1
    });
    // Slot 5 is free; the good write behind it is on the same connection.
    let done = post_all(
        &mut *poster,
        &mut *comps,
        &[
            op(1, 0, 5 * CHUNK_BYTES, CHUNK_BYTES, peer),
            op(2, 0, 0, CHUNK_BYTES, peer),
        ],
    );
    assert_eq!(
        done,
        vec![
            Completion::new(1, CompletionStatus::OutOfBounds),
            Completion::new(2, CompletionStatus::ConnectionLost),
        ]
    );
    assert_eq!(read_slot(r.region(), 5, 4096), vec![0; 4096]);
    wait_until("the receiver closed the connection", || {
        r.tcp_data_connections() == 0
    });
    // A write straddling a granted and a free slot is rejected too.
    let done = post_all(
        &mut *poster,
        &mut *comps,
        &[op(3, 0, CHUNK_BYTES + 1, CHUNK_BYTES, peer)],
    );
    assert_eq!(
        done,
        vec![Completion::new(3, CompletionStatus::OutOfBounds)]
    );
    // Past the end of the buffer: refused by the sender, nothing sent.
    let done = post_all(
        &mut *poster,
        &mut *comps,
        &[
            op(4, 0, 8 * CHUNK_BYTES, 1, peer),
            op(5, 4 * CHUNK_BYTES, 0, 1, peer),
        ],
    );
    assert_eq!(
        done,
        vec![
            Completion::new(4, CompletionStatus::OutOfBounds),
            Completion::new(5, CompletionStatus::OutOfBounds),
        ]
    );
    // The next good write reconnects and lands.
    let done = post_all(&mut *poster, &mut *comps, &[op(6, 0, 0, CHUNK_BYTES, peer)]);
    assert_eq!(done, vec![Completion::new(6, CompletionStatus::Ok)]);
    assert_eq!(read_slot(r.region(), 0, 4096), pattern(9, 4096));
}

#[test]
fn the_receiver_checks_range_and_preamble_on_raw_connections() {
    let r = tcp_receiver(4);
    let addr = r.tcp_data_addr().unwrap();
    let greet = |p: Preamble| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&p.encode()).unwrap();
        let mut ack = [0u8; PREAMBLE_ACK_LEN];
        s.read_exact(&mut ack).unwrap();
        (s, wire::decode_preamble_ack(&ack))
    };
    let (_client, remote) = tcp_client(&r, "raw");
    let Descriptor::Tcp {
        secret: Some(secret),
        ..
    } = &remote.descriptor
    else {
        unreachable!()
    };
    let good = Preamble {
        version: wire::VERSION,
        chunk_bytes: CHUNK_BYTES,
        capacity_chunks: 4,
        secret: wire::decode_secret(secret).unwrap(),
    };
    let expect_eof = |s: &mut TcpStream, what: &str| {
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(_) => assert!(rest.is_empty(), "{what}: trailing bytes {rest:?}"),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{what}"),
        }
    };
    // Geometry other than the buffer's.
    let (mut s, status) = greet(Preamble {
        capacity_chunks: 5,
        ..good
    });
    assert_eq!(status, Some(wire::PREAMBLE_BAD_GEOMETRY));
    expect_eof(&mut s, "bad geometry");
    drop(s);
    // Unknown version.
    let (mut s, status) = greet(Preamble {
        version: 99,
        ..good
    });
    assert_eq!(status, Some(wire::PREAMBLE_BAD_VERSION));
    expect_eof(&mut s, "bad version");
    drop(s);
    // Not a kvferry client at all.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(&[0xAB; PREAMBLE_LEN]).unwrap();
    let mut ack = [0u8; PREAMBLE_ACK_LEN];
    s.read_exact(&mut ack).unwrap();
    assert_eq!(
        wire::decode_preamble_ack(&ack),
        Some(wire::PREAMBLE_BAD_VERSION)
    );
    expect_eof(&mut s, "garbage preamble");
    drop(s);
    // Accepted, then an offset overflowing u64 and one past the end.
    for hdr in [
        Header {
            remote_offset: u64::MAX,
            len: 2,
            work_id: 5,
        },
        Header {
            remote_offset: 4 * CHUNK_BYTES,
            len: 1,
            work_id: 6,
        },
    ] {
        let (mut s, status) = greet(good);
        assert_eq!(status, Some(wire::PREAMBLE_OK));
        s.write_all(&hdr.encode()).unwrap();
        let mut a = [0u8; ACK_LEN];
        s.read_exact(&mut a).unwrap();
        assert_eq!(
            Ack::decode(&a),
            Some(Ack {
                work_id: hdr.work_id,
                status: CompletionStatus::OutOfBounds as u32
            })
        );
        expect_eof(&mut s, "out of range");
    }
    // An empty write is fine anywhere inside; a header cut short is no harm.
    let (mut s, _) = greet(good);
    s.write_all(
        &Header {
            remote_offset: 0,
            len: 0,
            work_id: 8,
        }
        .encode(),
    )
    .unwrap();
    let mut a = [0u8; ACK_LEN];
    s.read_exact(&mut a).unwrap();
    assert_eq!(Ack::decode(&a).map(|a| (a.work_id, a.status)), Some((8, 0)));
    s.write_all(&[1, 2, 3]).unwrap();
    drop(s);
    wait_until("every raw connection closed", || {
        r.tcp_data_connections() == 0
    });
    assert_eq!(r.stats().allocated_chunks, 0);
}

#[test]
fn connect_checks_the_descriptor_and_reports_typed_errors() {
    let r = tcp_receiver(4);
    let staging = Arc::new(StagingBuffer::new(1, CHUNK_BYTES).unwrap());
    let (mut poster, _comps) = start(&staging, 8);
    let (_client, good) = tcp_client(&r, "granter");
    // Foreign descriptors: conformance::connect_refuses_foreign_descriptors.
    let with_addr = |addr: &str| RemoteBuffer {
        descriptor: Descriptor::Tcp {
            addr: addr.into(),
            secret: None,
        },
        ..good.clone()
    };
    assert!(matches!(
        poster.connect(&with_addr("not an address")),
        Err(TransportError::BadDescriptor(_))
    ));
    let zero = RemoteBuffer {
        capacity_chunks: 0,
        ..good.clone()
    };
    assert!(matches!(
        poster.connect(&zero),
        Err(TransportError::BadDescriptor(_))
    ));
    // The listener refuses a geometry other than its buffer's.
    let wrong = RemoteBuffer {
        capacity_chunks: 5,
        ..good.clone()
    };
    match poster.connect(&wrong) {
        Err(TransportError::BadDescriptor(m)) => assert!(m.contains("geometry"), "{m}"),
        other => panic!("expected a geometry refusal, got {other:?}"),
    }
    // Nobody listens there.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    match poster.connect(&with_addr(&closed.to_string())) {
        Err(TransportError::Io(e)) => assert!(e.to_string().contains(&closed.to_string())),
        other => panic!("expected an I/O error, got {other:?}"),
    }
    // No secret, or one this receiver never issued: refused, typed.
    for secret in [None, Some("ab".repeat(wire::SECRET_LEN))] {
        let stranger = RemoteBuffer {
            descriptor: Descriptor::Tcp {
                addr: r.tcp_data_addr().unwrap().to_string(),
                secret,
            },
            ..good.clone()
        };
        match poster.connect(&stranger) {
            Err(TransportError::BadDescriptor(m)) => assert!(m.contains("secret"), "{m}"),
            other => panic!("expected a secret refusal, got {other:?}"),
        }
    }
    // Connecting twice is idempotent; a changed geometry for the same
    // address is refused.
    let a = poster.connect(&good).unwrap();
    assert_eq!(poster.connect(&good).unwrap(), a);
    let changed = RemoteBuffer {
        chunk_bytes: 2 * CHUNK_BYTES,
        capacity_chunks: 2,
        ..good.clone()
    };
    assert!(matches!(
        poster.connect(&changed),
        Err(TransportError::BadDescriptor(_))
    ));
    assert!(matches!(
        TcpTransport::new(&TransportConfig::default())
            .unwrap()
            .with_timeouts(Duration::ZERO, WAIT),
        Err(TransportError::Config(_))
    ));
    assert!(matches!(
        TcpTransport::new(&TransportConfig {
            ring_capacity: 0,
            ..TransportConfig::default()
        }),
        Err(TransportError::Config(_))
    ));
}

// ----- scripted fake listeners: loss and timeouts ---------------------------

/// Accepts one connection and answers its preamble.
fn fake_accept(l: &TcpListener) -> TcpStream {
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut p = [0u8; PREAMBLE_LEN];
    s.read_exact(&mut p).unwrap();
    assert!(Preamble::decode(&p).is_some());
    s.write_all(&wire::encode_preamble_ack(wire::PREAMBLE_OK))
        .unwrap();
    s
}

/// Reads one write and returns its header.
fn fake_read_write(s: &mut TcpStream) -> Header {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = Header::decode(&h);
    let mut payload = vec![0u8; h.len as usize];
    s.read_exact(&mut payload).unwrap();
    h
}

fn fake_remote(addr: SocketAddr) -> RemoteBuffer {
    RemoteBuffer {
        descriptor: Descriptor::Tcp {
            addr: addr.to_string(),
            secret: None,
        },
        chunk_bytes: 4096,
        capacity_chunks: 4,
    }
}

#[test]
fn connection_loss_fails_in_flight_writes_and_the_next_post_reconnects() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let staging = Arc::new(StagingBuffer::new(4, 4096).unwrap());
    let (mut poster, mut comps) = start(&staging, 16);
    let fake = std::thread::spawn(move || {
        // First connection: ack one write, read two more, then drop it.
        let mut s = fake_accept(&l);
        let h = fake_read_write(&mut s);
        s.write_all(
            &Ack {
                work_id: h.work_id,
                status: 0,
            }
            .encode(),
        )
        .unwrap();
        fake_read_write(&mut s);
        fake_read_write(&mut s);
        drop(s);
        // Second connection: ack everything.
        let mut s = fake_accept(&l);
        let h = fake_read_write(&mut s);
        s.write_all(
            &Ack {
                work_id: h.work_id,
                status: 0,
            }
            .encode(),
        )
        .unwrap();
        h.work_id
    });
    let p = poster.connect(&fake_remote(addr)).unwrap();
    let done = post_all(
        &mut *poster,
        &mut *comps,
        &[
            op(1, 0, 0, 4096, p),
            op(2, 0, 4096, 4096, p),
            op(3, 0, 8192, 10, p),
        ],
    );
    assert_eq!(
        done,
        vec![
            Completion::new(1, CompletionStatus::Ok),
            Completion::new(2, CompletionStatus::ConnectionLost),
            Completion::new(3, CompletionStatus::ConnectionLost),
        ]
    );
    let done = post_all(&mut *poster, &mut *comps, &[op(4, 0, 0, 100, p)]);
    assert_eq!(done, vec![Completion::new(4, CompletionStatus::Ok)]);
    assert_eq!(fake.join().unwrap(), 4);
}

#[test]
fn out_of_order_acks_and_a_stalled_receiver_fail_the_connection() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let staging = Arc::new(StagingBuffer::new(1, 4096).unwrap());
    let (mut poster, mut comps) =
        start_with_timeouts(&staging, Duration::from_secs(5), Duration::from_millis(200));
    let fake = std::thread::spawn(move || {
        // An ack for a write that was not next: a protocol error. The
        // sender gives up on the connection: it shuts its write side and
        // waits for this side to close before failing the write.
        let mut s = fake_accept(&l);
        fake_read_write(&mut s);
        s.write_all(
            &Ack {
                work_id: 999,
                status: 0,
            }
            .encode(),
        )
        .unwrap();
        assert_eq!(read_to_eof(&mut s), 0, "nothing after the write");
        drop(s);
        // Then a receiver that reads but never acks: after the I/O
        // timeout the sender shuts its write side the same way.
        let mut s2 = fake_accept(&l);
        fake_read_write(&mut s2);
        assert_eq!(read_to_eof(&mut s2), 0, "nothing after the write");
    });
    let p = poster.connect(&fake_remote(addr)).unwrap();
    let done = post_all(&mut *poster, &mut *comps, &[op(1, 0, 0, 8, p)]);
    assert_eq!(
        done,
        vec![Completion::new(1, CompletionStatus::ConnectionLost)]
    );
    let done = post_all(&mut *poster, &mut *comps, &[op(2, 0, 0, 8, p)]);
    assert_eq!(
        done,
        vec![Completion::new(2, CompletionStatus::ConnectionLost)],
        "the I/O timeout fails a write that is never acked"
    );
    fake.join().unwrap();
}

/// Reads until the peer shuts its write side; the bytes read.
fn read_to_eof(s: &mut TcpStream) -> usize {
    let mut total = 0;
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return total,
            Ok(n) => total += n,
            Err(e) => panic!("hung or failed reading to EOF after {total} bytes: {e}"),
        }
    }
}

/// The fencing window of a connection the sender gives up on (docs:
/// "Fencing (invariant 7) over TCP"): a receiver stalls with a write unread
/// past the sender's I/O timeout, then resumes. The write may complete
/// `ConnectionLost` — the sender's signal that no byte of it can land any
/// more, after which its request's `CancelNotif` frees the slots — only
/// once the receiver has read every byte of it: none may arrive after the
/// completion.
#[test]
fn an_abandoned_write_completes_only_after_the_receiver_read_all_of_it() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let staging = Arc::new(StagingBuffer::new(1, 4096).unwrap());
    let io_timeout = Duration::from_millis(100);
    let (mut poster, mut comps) = start_with_timeouts(&staging, Duration::from_secs(5), io_timeout);
    let completed = Arc::new(AtomicBool::new(false));
    let fake = {
        let completed = completed.clone();
        std::thread::spawn(move || {
            let mut s = fake_accept(&l);
            // Stall well past the sender's I/O timeout (this sleep sets the
            // scene; nothing is asserted about time).
            std::thread::sleep(io_timeout * 10);
            let (mut total, mut late) = (0, 0);
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        total += n;
                        // SeqCst: pairs with the store after the completion.
                        if completed.load(Ordering::SeqCst) {
                            late += n;
                        }
                    }
                    Err(e) => panic!("hung or failed reading the stalled write: {e}"),
                }
            }
            (total, late)
        })
    };
    let p = poster.connect(&fake_remote(addr)).unwrap();
    assert_eq!(poster.post(&[op(1, 0, 0, 4096, p)]).unwrap(), 1);
    let done = collect(&mut *comps, 1, "the abandoned write's completion");
    completed.store(true, Ordering::SeqCst);
    assert_eq!(
        done,
        vec![Completion::new(1, CompletionStatus::ConnectionLost)]
    );
    let (total, late) = fake.join().unwrap();
    assert_eq!(
        total,
        HEADER_LEN + 4096,
        "the whole write reached the receiver"
    );
    assert_eq!(
        late, 0,
        "bytes of the write arrived after its ConnectionLost"
    );
    drop(poster);
}

// ----- the receiver side: offers and configuration ---------------------------

#[test]
fn a_sender_asking_for_tcp_fails_cleanly_at_a_receiver_without_it() {
    let r = common::start(common::config(4));
    assert_eq!(r.tcp_data_addr(), None);
    assert_eq!(r.tcp_data_connections(), 0);
    r.cut_tcp_data_connections(); // no-op without tcp
    let s = Sender::new(SenderConfig {
        sender_id: "tcp-asker".into(),
        chunk_bytes: CHUNK_BYTES,
        staging_slots: 4,
        transport: "tcp".into(),
        ..SenderConfig::default()
    })
    .unwrap();
    let spec = TransferSpec::new("r1", r.endpoint(), 1, true);
    // The refusal can end the request before `store` hands its batch over
    // (admission starts at `begin`): then `store` reports it.
    let status = match s.store(&spec, &["k"], &[&[1u8; 64][..]]) {
        Ok(()) => s.wait("r1", Instant::now() + WAIT),
        Err(StoreError::RequestEnded(status)) => Some(status),
        Err(e) => panic!("store: {e}"),
    };
    match status {
        Some(RequestStatus::Failed { code, reason }) => {
            assert_eq!(code, ErrorCode::PeerUnavailable);
            assert!(
                reason.contains("does not offer the tcp data plane"),
                "{reason}"
            );
        }
        other => panic!("expected PeerUnavailable, got {other:?}"),
    }
    assert_eq!(s.staging_in_use(), 0);
}

#[test]
fn receiver_tcp_configuration_errors_are_typed() {
    let wildcard = ReceiverConfig {
        tcp_data: Some(SocketAddr::from(([0, 0, 0, 0], 0))),
        ..common::config(2)
    };
    assert!(matches!(
        Receiver::start(wildcard.clone()),
        Err(ReceiverError::Config(m)) if m.contains("tcp_data_advertise")
    ));
    let r = Receiver::start(ReceiverConfig {
        tcp_data_advertise: Some([127, 0, 0, 1].into()),
        ..wildcard
    })
    .unwrap();
    let addr = r.tcp_data_addr().unwrap();
    assert_eq!(addr.ip(), std::net::IpAddr::from([127, 0, 0, 1]));
    assert_ne!(addr.port(), 0);
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = ReceiverConfig {
        tcp_data: Some(taken.local_addr().unwrap()),
        ..common::config(2)
    };
    assert!(matches!(
        Receiver::start(busy),
        Err(ReceiverError::TcpData { .. })
    ));
}

// ----- a cut mid-transfer ----------------------------------------------------

/// How a request hit by a cut ends: its writes failed with the connection,
/// or (a cut while the data connection was being set up) the receiver was
/// unreachable; the sender then retries the handshake after its backoff.
fn cut_outcome(st: &RequestStatus) -> bool {
    match st {
        RequestStatus::Failed { code, reason } => match code {
            ErrorCode::WriteFailed => reason.contains("connection_lost"),
            ErrorCode::PeerUnavailable => reason.contains("tcp data connection"),
            _ => false,
        },
        _ => false,
    }
}

#[test]
fn cutting_the_data_connections_fails_the_affected_requests_and_others_proceed() {
    const CHUNK: u64 = 128 * 1024;
    const CHUNKS: usize = 8;
    let r = Arc::new(
        Receiver::start(ReceiverConfig {
            chunk_bytes: CHUNK,
            capacity_chunks: 32,
            auto_consume: true,
            tcp_data: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..common::config(32)
        })
        .unwrap(),
    );
    let s = Arc::new(
        Sender::new(SenderConfig {
            sender_id: "cut-victim".into(),
            chunk_bytes: CHUNK,
            staging_slots: 2 * CHUNKS,
            transport: "tcp".into(),
            ..SenderConfig::default()
        })
        .unwrap(),
    );
    let hit = Arc::new(AtomicBool::new(false));
    let payload = vec![7u8; CHUNK as usize];
    // The worker moves requests one after another and records how each
    // ended. Once a cut hit one, the cuts stop; the requests that run
    // while the sender re-establishes its data connection (its reconnect
    // backoff) may still fail with a cut's outcome, but then 20 in a row
    // must complete.
    let worker = {
        let (r, s, hit) = (r.clone(), s.clone(), hit.clone());
        std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            let mut in_a_row = 0;
            let end = Instant::now() + Duration::from_secs(60);
            let mut i = 0;
            while in_a_row < 20 {
                if Instant::now() >= end {
                    let mut tally: std::collections::BTreeMap<String, usize> = Default::default();
                    for (_, st) in &outcomes {
                        *tally.entry(format!("{st:?}")).or_default() += 1;
                    }
                    panic!(
                        "no 20 requests in a row completed after a cut within 60 s (hit: {}); outcomes: {tally:?}",
                        hit.load(Ordering::Relaxed)
                    );
                }
                let req = format!("req-{i}");
                i += 1;
                let keys: Vec<String> = (0..CHUNKS).map(|k| format!("{req}-{k}")).collect();
                let chunks: Vec<&[u8]> = (0..CHUNKS).map(|_| &payload[..]).collect();
                let spec = TransferSpec::new(req.clone(), r.endpoint(), CHUNKS, true);
                let status = match s.store(&spec, &keys, &chunks) {
                    Ok(()) => {
                        let status = s.wait(&req, Instant::now() + WAIT).expect("request known");
                        assert!(status.is_terminal(), "{req} hung: {status:?}");
                        status
                    }
                    // Admission starts at `begin`: a cut can end the request
                    // before `store` hands its batch over.
                    Err(StoreError::RequestEnded(status)) if cut_outcome(&status) => status,
                    Err(e) => panic!("{req}: store failed: {e:?}"),
                };
                if status == RequestStatus::Completed {
                    if hit.load(Ordering::Relaxed) {
                        in_a_row += 1;
                    }
                } else {
                    in_a_row = 0;
                    if cut_outcome(&status) {
                        hit.store(true, Ordering::Relaxed);
                    }
                }
                outcomes.push((req, status));
            }
            outcomes
        })
    };
    // Cut every few milliseconds until a request was hit.
    let end = Instant::now() + Duration::from_secs(60);
    while !hit.load(Ordering::Relaxed) && !worker.is_finished() && Instant::now() < end {
        r.cut_tcp_data_connections();
        std::thread::sleep(Duration::from_millis(3));
    }
    let outcomes = worker.join().expect("worker");
    let failed: Vec<_> = outcomes
        .iter()
        .filter(|(_, st)| *st != RequestStatus::Completed)
        .collect();
    assert!(!failed.is_empty(), "no request was hit");
    for (req, st) in &failed {
        assert!(cut_outcome(st), "{req} ended {st:?}");
    }
    // The last 20 requests (after the cuts stopped) all completed.
    assert!(outcomes[outcomes.len() - 20..]
        .iter()
        .all(|(_, st)| *st == RequestStatus::Completed));
    // Nothing leaked on either side once the fenced cancels arrived.
    wait_until("receiver and sender released everything", || {
        let st = r.stats();
        st.allocated_chunks == 0 && st.reserved_chunks == 0 && s.staging_in_use() == 0
    });
}

/// A drain waiting on a receiver that never closes does not hold up the
/// poster's drop: the engine exits, the write completes `ConnectionLost`
/// (nobody can send a `CancelNotif` after the poster is gone), then the
/// stream ends.
#[test]
fn dropping_the_poster_ends_a_pending_drain() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let staging = Arc::new(StagingBuffer::new(1, 4096).unwrap());
    let (mut poster, mut comps) =
        start_with_timeouts(&staging, Duration::from_secs(5), Duration::from_millis(50));
    let (release, released) = std::sync::mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let s = fake_accept(&l);
        // Hold the connection open, unread, until the test is done.
        let held = released.recv_timeout(WAIT).is_ok();
        drop(s);
        held
    });
    let p = poster.connect(&fake_remote(addr)).unwrap();
    assert_eq!(poster.post(&[op(1, 0, 0, 4096, p)]).unwrap(), 1);
    drop(poster);
    let done = collect(&mut *comps, 1, "the drained write at engine exit");
    assert_eq!(
        done,
        vec![Completion::new(1, CompletionStatus::ConnectionLost)]
    );
    let mut more = Vec::new();
    assert_eq!(
        comps.poll(&mut more, 1, Some(Instant::now() + WAIT)),
        PollStatus::Closed
    );
    release.send(()).unwrap();
    assert!(
        fake.join().unwrap(),
        "the poster's drop waited for the receiver to close the connection"
    );
}
