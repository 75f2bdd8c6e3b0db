//! The RDMA transport (feature `rdma`): the conformance suite
//! (`conformance::*`, see `tests/common_transport/conformance.rs`) and what
//! only rdma has (queue pair setup, device faults, link flaps). Tests that
//! need an RDMA device (a NIC or soft-RoCE, see docs/rdma.md) print
//! `SKIP <test>: <reason>` to stderr and return when there is none, unless
//! `KVFERRY_RDMA_REQUIRE_DEVICE=1` is set (as in the CI guest,
//! `tests/soft-roce/vm.sh`), where a missing device fails them. The device-free parts (descriptor encoding, QP state
//! attributes, signalling plan, completion mapping, async event actions)
//! are unit tests in `src/transport/rdma`. `cargo test --features rdma
//! --test transport_rdma -- --nocapture` shows the skip reasons.
//!
//! The device is chosen as everywhere else: `KVFERRY_RDMA_DEVICE`,
//! `KVFERRY_RDMA_GID_INDEX`, `KVFERRY_RDMA_PORT`. The link-flap test also
//! needs `KVFERRY_RDMA_FLAP_NETDEV` (the interface under the rxe device,
//! taken down and up with `ip link`; root only, so the guest sets it).
#![cfg(feature = "rdma")]

mod common_transport;
use common_transport::{collect, read_slot};
#[path = "common_transport/conformance.rs"]
#[macro_use]
mod suite;

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::protocol::Descriptor;
use kvferry::region::{default_region_path, Region};
use kvferry::staging::StagingBuffer;
use kvferry::transport::rdma::{probe, RdmaConfig, RdmaPoster, RdmaReceiverSide, RdmaTransport};
use kvferry::transport::{
    by_name, CompletionStatus, Completions, PollStatus, Poster, RemoteBuffer, TransportConfig,
    TransportError, WriteOp,
};

const CHUNK: u64 = 4096;
const SLOTS: u64 = 16;
const DEADLINE: Duration = Duration::from_secs(20);

/// Set to `1` where a device must exist: a missing one fails the tests.
const ENV_REQUIRE_DEVICE: &str = "KVFERRY_RDMA_REQUIRE_DEVICE";
/// The interface under the rxe device, for the link-flap test.
const ENV_FLAP_NETDEV: &str = "KVFERRY_RDMA_FLAP_NETDEV";

/// True if there is a device; otherwise prints why the test is skipped (or
/// fails it, with `KVFERRY_RDMA_REQUIRE_DEVICE=1`).
fn device_or_skip(test: &str) -> bool {
    match probe() {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var(ENV_REQUIRE_DEVICE).as_deref() != Ok("1"),
                "{test}: {ENV_REQUIRE_DEVICE}=1 but there is no RDMA device: {e}"
            );
            eprintln!("SKIP {test}: {e}");
            false
        }
    }
}

/// The device configuration of this host (`KVFERRY_RDMA_*`).
fn env_cfg() -> RdmaConfig {
    RdmaConfig::from_env(&TransportConfig::default()).expect("KVFERRY_RDMA_* are valid")
}

#[test]
fn a_missing_device_is_a_typed_error_that_says_why() {
    // Fails everywhere: no device at all (ENOSYS here) or no such name.
    let cfg = RdmaConfig {
        device: Some("kvferry-no-such-device".into()),
        ..RdmaConfig::default()
    };
    match RdmaTransport::new(cfg) {
        Err(TransportError::NoDevice(m)) => {
            assert!(
                m.contains("ibv_get_device_list") || m.contains("kvferry-no-such-device"),
                "reason missing: {m}"
            )
        }
        other => panic!("expected NoDevice, got {other:?}"),
    }
    // by_name builds the transport (wrapped in nothing) or says why not.
    match (by_name("rdma", &TransportConfig::default()), probe()) {
        (Ok(t), Ok(_)) => assert_eq!(t.kind(), "rdma"),
        (Err(TransportError::NoDevice(m)), Err(_)) => {
            assert!(m.contains("no RDMA device was found"), "{m}")
        }
        (Ok(_), Err(e)) => panic!("by_name found a device probe did not: {e}"),
        (Err(e), Ok(devs)) => panic!("devices {devs:?} but by_name failed: {e}"),
        (Err(e), Err(_)) => panic!("no device, but by_name failed with another error: {e}"),
    }
}

#[test]
fn a_bad_config_is_rejected_before_opening_a_device() {
    let cfg = RdmaConfig {
        credits: 0,
        ..RdmaConfig::default()
    };
    assert!(matches!(
        RdmaTransport::new(cfg),
        Err(TransportError::Config(_))
    ));
}

/// One receiver side of an [`Rdma`] fixture.
struct RdmaRx {
    region: Arc<Region>,
    side: RdmaReceiverSide,
    /// The sender's descriptor of the queue pair last connected to it.
    sender_desc: Descriptor,
}

/// A started rdma sender side (poster and completions over a staging
/// buffer) and the receiver sides it is connected to: the fixture of the
/// conformance suite and of the device fault tests below.
struct Rdma {
    cfg: RdmaConfig,
    poster: Option<RdmaPoster>,
    completions: Option<Box<dyn Completions>>,
    receivers: Vec<RdmaRx>,
    /// Kept alive with the poster (filled before the transport shared it).
    _staging: Arc<StagingBuffer>,
}

impl Rdma {
    fn with_config(cfg: RdmaConfig, staging: Arc<StagingBuffer>) -> Self {
        let (poster, completions) = RdmaTransport::new(cfg.clone())
            .unwrap()
            .start_rdma(staging.clone())
            .unwrap();
        Rdma {
            cfg,
            poster: Some(poster),
            completions: Some(Box::new(completions)),
            receivers: Vec::new(),
            _staging: staging,
        }
    }
    fn rdma_poster(&mut self) -> &mut RdmaPoster {
        self.poster.as_mut().expect("the poster was dropped")
    }
    fn comps(&mut self) -> &mut dyn Completions {
        &mut **self
            .completions
            .as_mut()
            .expect("the completions were dropped")
    }
    /// The receiver side (and the sender's queue pair) of receiver 0.
    fn rx(&mut self) -> &mut RdmaRx {
        &mut self.receivers[0]
    }
}

impl suite::Fixture for Rdma {
    const KIND: &'static str = "rdma";
    const IN_ORDER: bool = false;
    const THREADS: &'static [&'static str] = &[kvferry::transport::rdma::CQ_THREAD_NAME];

    fn available(test: &str) -> bool {
        device_or_skip(test)
    }
    fn start(staging: Arc<StagingBuffer>, credits: usize) -> Self {
        let cfg = RdmaConfig {
            credits,
            signal_every: 4,
            ..env_cfg()
        };
        Rdma::with_config(cfg, staging)
    }
    fn add_receiver(&mut self, capacity: u64) -> (usize, u32) {
        let region = Arc::new(Region::create(&default_region_path(), CHUNK, capacity).unwrap());
        let side = RdmaReceiverSide::new(region.clone(), &self.cfg).unwrap();
        self.receivers.push(RdmaRx {
            region,
            side,
            sender_desc: Descriptor::None,
        });
        let rx = self.receivers.len() - 1;
        (rx, self.reconnect(rx).expect("connect"))
    }
    /// A new queue pair (`prepare`), accepted by the receiver side, then
    /// connected with its answer (as `Hello` / `HelloAck` do).
    fn reconnect(&mut self, rx: usize) -> Result<u32, TransportError> {
        let sender_desc = self.rdma_poster().prepare()?;
        let r = &mut self.receivers[rx];
        let remote = RemoteBuffer {
            descriptor: r.side.accept(&sender_desc)?,
            chunk_bytes: r.region.chunk_bytes(),
            capacity_chunks: r.region.capacity_chunks(),
        };
        r.sender_desc = sender_desc.clone();
        self.rdma_poster().connect_prepared(&sender_desc, &remote)
    }
    fn read_slot(&self, rx: usize, slot: u32) -> Vec<u8> {
        read_slot(&self.receivers[rx].region, slot, CHUNK as usize)
    }
    fn connections(&self, rx: usize) -> Option<usize> {
        Some(self.receivers[rx].side.senders())
    }
    fn foreign() -> Descriptor {
        Descriptor::Shm {
            path: "/dev/shm/x".into(),
            len: CHUNK * SLOTS,
        }
    }
    fn parts(&mut self) -> (Option<&mut dyn Poster>, Option<&mut dyn Completions>) {
        (
            self.poster.as_mut().map(|p| p as _),
            self.completions.as_mut().map(|c| &mut **c as _),
        )
    }
    fn drop_poster(&mut self) {
        self.poster = None;
    }
    fn drop_completions(&mut self) {
        self.completions = None;
    }
}

conformance_suite!(crate::Rdma);

/// An [`Rdma`] fixture with `credits` and one receiver of [`SLOTS`] slots;
/// its peer index.
fn pair(credits: usize) -> (Rdma, u32) {
    pair_with(RdmaConfig {
        credits,
        signal_every: 4,
        ..env_cfg()
    })
}

fn pair_with(cfg: RdmaConfig) -> (Rdma, u32) {
    let staging = Arc::new(StagingBuffer::new(SLOTS as usize, CHUNK).unwrap());
    let mut p = Rdma::with_config(cfg, staging);
    let (_, peer) = suite::Fixture::add_receiver(&mut p, SLOTS);
    (p, peer)
}

fn op(work_id: u64, peer: u32, slot: u64, remote_slot: u64, len: u64) -> WriteOp {
    WriteOp {
        work_id,
        local_offset: slot * CHUNK,
        remote_offset: remote_slot * CHUNK,
        len,
        peer,
        local_region: 0,
    }
}

/// Destroys the receiver's queue pair of `p` and posts 8 writes to it.
fn post_to_a_destroyed_qp(p: &mut Rdma, peer: u32) {
    let qp = match &p.rx().sender_desc {
        Descriptor::Rdma { qp_num, .. } => *qp_num,
        other => panic!("sender descriptor {other:?}"),
    };
    assert!(p.rx().side.forget(qp));
    let ops: Vec<WriteOp> = (0..8).map(|i| op(i, peer, i, i, CHUNK)).collect();
    assert_eq!(p.rdma_poster().post(&ops).unwrap(), 8);
}

#[test]
fn a_dead_receiver_qp_fails_the_in_flight_writes() {
    if !device_or_skip("a_dead_receiver_qp_fails_the_in_flight_writes") {
        return;
    }
    let (mut p, peer) = pair(64);
    post_to_a_destroyed_qp(&mut p, peer);
    // RC retries are finite (about 7 * 67 ms plus RNR), well inside DEADLINE.
    // Before issue 14 the retry count was 7, which rxe retries forever: this
    // timed out, and dropping the poster then hung.
    let done = collect(p.comps(), 8, "writes to a destroyed QP");
    assert!(
        done.iter()
            .all(|c| c.status() == CompletionStatus::ConnectionLost),
        "{done:?}"
    );
    // The queue pair is in error: later writes fail at once.
    assert_eq!(
        p.rdma_poster().post(&[op(9, peer, 0, 0, CHUNK)]).unwrap(),
        1
    );
    let later = collect(p.comps(), 1, "write after the QP failed");
    assert_eq!(later[0].status(), CompletionStatus::ConnectionLost);
}

/// A queue pair whose NIC never gives up (retry count 7: rxe retries it
/// forever, as kvferry's default did before issue 14) is fenced by the
/// stall watchdog: its writes flush with `ConnectionLost`, later ones fail
/// at once.
#[test]
fn a_queue_pair_that_never_gives_up_is_fenced_by_the_stall_watchdog() {
    if !device_or_skip("a_queue_pair_that_never_gives_up_is_fenced_by_the_stall_watchdog") {
        return;
    }
    let (mut p, peer) = pair_with(RdmaConfig {
        credits: 64,
        signal_every: 4,
        retry_count: 7,
        stall_timeout: Duration::from_secs(1),
        ..env_cfg()
    });
    post_to_a_destroyed_qp(&mut p, peer);
    let done = collect(p.comps(), 8, "writes to a QP that retries forever");
    assert!(
        done.iter()
            .all(|c| c.status() == CompletionStatus::ConnectionLost),
        "{done:?}"
    );
    assert_eq!(
        p.rdma_poster().post(&[op(9, peer, 0, 0, CHUNK)]).unwrap(),
        1
    );
    let later = collect(p.comps(), 1, "write after the fence");
    assert_eq!(later[0].status(), CompletionStatus::ConnectionLost);
    assert_eq!(p.rdma_poster().in_flight(), 0);
}

/// Dropping the poster while writes are stuck in flight returns: the drop
/// has a deadline (before issue 14 it joined the CQ thread, which waited
/// for writes that rxe retried forever).
#[test]
fn dropping_the_poster_with_writes_stuck_in_flight_returns() {
    if !device_or_skip("dropping_the_poster_with_writes_stuck_in_flight_returns") {
        return;
    }
    let (mut p, peer) = pair_with(RdmaConfig {
        credits: 64,
        signal_every: 4,
        retry_count: 7,
        stall_timeout: Duration::from_secs(1),
        ..env_cfg()
    });
    post_to_a_destroyed_qp(&mut p, peer);
    let poster = p.poster.take();
    let h = std::thread::spawn(move || drop(poster));
    common_sender::join_within("dropping an RdmaPoster with stuck writes", h);
    // The CQ thread delivered what was in flight, then closed the ring.
    let mut out = Vec::new();
    let end = Instant::now() + DEADLINE;
    loop {
        match p.comps().poll(&mut out, 64, Some(end)) {
            PollStatus::Closed => break,
            PollStatus::TimedOut => panic!("completions not closed after the drop: {out:?}"),
            _ => {}
        }
    }
    assert_eq!(out.len(), 8, "{out:?}");
    assert!(out.iter().all(|c| !c.ok()), "{out:?}");
}

/// The generic `connect` of an rdma descriptor, a queue pair never
/// prepared or already connected, and a discarded one are refused; the
/// receiver side refuses a foreign descriptor. (`connect` of a foreign
/// descriptor: `conformance::connect_refuses_foreign_descriptors`.)
#[test]
fn the_generic_connect_and_foreign_descriptors_are_refused() {
    if !device_or_skip("the_generic_connect_and_foreign_descriptors_are_refused") {
        return;
    }
    let (mut p, _) = pair(8);
    let remote = |descriptor| RemoteBuffer {
        descriptor,
        chunk_bytes: CHUNK,
        capacity_chunks: SLOTS,
    };
    let shm = <Rdma as suite::Fixture>::foreign();
    let sender_desc = p.rx().sender_desc.clone();
    assert!(matches!(
        p.rdma_poster().connect(&remote(sender_desc.clone())),
        Err(TransportError::BadDescriptor(_))
    ));
    assert!(matches!(
        p.rx().side.accept(&shm),
        Err(TransportError::Unsupported { .. })
    ));
    // Connecting a QP that was never prepared (or twice) is refused.
    let fresh = p.rdma_poster().prepare().unwrap();
    let ack = p.rx().side.accept(&fresh).unwrap();
    assert!(matches!(
        p.rdma_poster().connect_prepared(&sender_desc, &remote(ack)),
        Err(TransportError::BadDescriptor(_))
    ));
    // A discarded QP (its Hello went unanswered) cannot be connected.
    let discarded = p.rdma_poster().prepare().unwrap();
    let ack = p.rx().side.accept(&discarded).unwrap();
    p.rdma_poster().discard_prepared(&discarded);
    assert!(matches!(
        p.rdma_poster().connect_prepared(&discarded, &remote(ack)),
        Err(TransportError::BadDescriptor(_))
    ));
    p.poster = None;
    let mut out = Vec::new();
    assert_eq!(
        p.comps().poll(&mut out, 1, Some(Instant::now() + DEADLINE)),
        PollStatus::Closed
    );
}

/// Without a device (or, on a host that has one, with a device name that
/// does not exist) `kvferry run --transport rdma` exits 2 and says why.
#[test]
fn kvferry_run_without_a_device_exits_2_and_says_why() {
    let has_device = probe().is_ok();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvferry"));
    cmd.args(["run", "--transport", "rdma", "--requests", "1", "--quiet"]);
    if has_device {
        cmd.env("KVFERRY_RDMA_DEVICE", "kvferry-no-such-device");
    } else {
        cmd.env_remove("KVFERRY_RDMA_DEVICE");
    }
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvferry run --transport rdma did not exit within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("no device for the transport"), "stderr: {err}");
    if has_device {
        assert!(err.contains("kvferry-no-such-device"), "stderr: {err}");
    } else {
        assert!(err.contains("no RDMA device was found"), "stderr: {err}");
        assert!(err.contains("ibv_get_device_list"), "stderr: {err}");
    }
}

// ----- end to end through Hello / HelloAck ----------------------------------

fn rdma_run(requests: usize) -> kvferry::runner::RunConfig {
    kvferry::runner::RunConfig {
        prefillers: 2,
        decoders: 2,
        requests,
        chunks: kvferry::runner::ChunkRange { min: 1, max: 8 },
        batch: 3,
        chunk_bytes: 4096,
        staging_slots: 12,
        capacity_chunks: 16,
        concurrency: 4,
        stall_timeout_s: 20.0,
        transport: "rdma".into(),
        ..kvferry::runner::RunConfig::default()
    }
}

/// `kvferry run --transport rdma` in-process: every receiver offers rdma,
/// every sender's Hello carries a queue pair made for that receiver, the
/// HelloAck connects it, and every byte is checked by the decoders.
/// `KVFERRY_RDMA_RUN_REQUESTS` (default 1000) requests per run; the CI
/// guest, whose CPU is emulated, runs fewer.
#[test]
fn runner_over_rdma_moves_every_request_without_leaks() {
    if !device_or_skip("runner_over_rdma_moves_every_request_without_leaks") {
        return;
    }
    let n: usize = std::env::var("KVFERRY_RDMA_RUN_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    for cfg in [
        rdma_run(n),
        kvferry::runner::RunConfig {
            abort_rate: 0.05,
            fail_rate: 0.02,
            seed: 11,
            ..rdma_run(n)
        },
    ] {
        let r = kvferry::runner::run(cfg, kvferry::runner::Progress::Quiet).expect("run starts");
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
        assert_eq!(r.unexpected_failures, 0, "{}", r.render());
        assert!(r.success(), "{}", r.render());
        assert_eq!(
            r.completed + r.aborted + r.failed,
            n as u64,
            "{}",
            r.render()
        );
    }
}

/// The receiver side of the two tests below: [`SLOTS`] slots of [`CHUNK`]
/// bytes, offering rdma on this host's device.
fn rdma_offering_cfg() -> kvferry::receiver::ReceiverConfig {
    kvferry::receiver::ReceiverConfig {
        capacity_chunks: SLOTS as usize,
        chunk_bytes: CHUNK,
        acceptor: Some(kvferry::receiver::AcceptorFactory::rdma(env_cfg())),
        ..kvferry::receiver::ReceiverConfig::default()
    }
}

/// Stores three full chunks (bytes `fill`, `fill + 1`, `fill + 2`) under
/// `keys` as request `req_id` from a fresh rdma sender (8 staging slots of
/// [`CHUNK`]), waits until `receiver` holds them, and checks each one's
/// bytes; `also` checks more of each held chunk (its key, the chunk, the
/// bytes written).
fn store_three_over_rdma(
    receiver: &kvferry::receiver::Receiver,
    req_id: &str,
    keys: [&str; 3],
    fill: u8,
    mut also: impl FnMut(&str, &kvferry::receiver::ChunkRef, &[u8]),
) {
    use kvferry::sender::{RequestStatus, Sender, SenderConfig, TransferSpec};
    let sender = Sender::with_transport(
        SenderConfig {
            staging_slots: 8,
            chunk_bytes: CHUNK,
            transport: "rdma".into(),
            ..SenderConfig::default()
        },
        Box::new(RdmaTransport::new(env_cfg()).unwrap()),
    )
    .unwrap();
    let chunks: Vec<Vec<u8>> = (0..3u8).map(|i| vec![fill + i; CHUNK as usize]).collect();
    let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let spec = TransferSpec::new(req_id, receiver.endpoint(), 3, true);
    sender.store(&spec, &keys, &refs).unwrap();
    let deadline = Instant::now() + DEADLINE;
    assert_eq!(
        sender.wait(req_id, deadline),
        Some(RequestStatus::Completed)
    );
    receiver.wait_ready(req_id, deadline).unwrap();
    for (k, want) in keys.iter().zip(&chunks) {
        let got = receiver.get(k).expect("key held");
        assert_eq!(got.bytes(), &want[..], "bytes of {k}");
        also(k, &got, want);
    }
}

/// The receiver's RDMA acceptor behind `Receiver::start`: a sender built
/// with an explicit `RdmaConfig` reaches it through Hello, and the bytes it
/// stores arrive in the receiver's slots.
#[test]
fn a_sender_reaches_a_receiver_that_offers_rdma() {
    if !device_or_skip("a_sender_reaches_a_receiver_that_offers_rdma") {
        return;
    }
    let receiver = kvferry::receiver::Receiver::start(rdma_offering_cfg()).unwrap();
    store_three_over_rdma(
        &receiver,
        "rdma-hello",
        ["k0", "k1", "k2"],
        0xA0,
        |_, _, _| {},
    );
}

/// A receiver over caller memory at a pointer (`RecvBuffer::from_raw`):
/// the rdma acceptor registers its memory region over that memory, the
/// sender's RDMA WRITEs land in it, and the caller reads them through its
/// own pointer.
#[test]
fn rdma_writes_land_in_caller_memory() {
    if !device_or_skip("rdma_writes_land_in_caller_memory") {
        return;
    }
    use kvferry::receiver::{Receiver, RecvBuffer};
    let len = (SLOTS * CHUNK) as usize;
    let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
    // SAFETY: non-zero size; freed at the end of the test, after the
    // receiver and every borrow of its chunks.
    let mem = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!mem.is_null());
    // SAFETY: `mem` stays allocated until after the receiver is dropped
    // below, and only the receiver writes it meanwhile.
    let buffer = unsafe { RecvBuffer::from_raw(mem, len) };
    let receiver = Receiver::start_with_buffer(rdma_offering_cfg(), buffer).unwrap();
    assert_eq!(receiver.region().data_ptr(), mem);
    store_three_over_rdma(
        &receiver,
        "rdma-caller-mem",
        ["m0", "m1", "m2"],
        0xC0,
        |k, got, want| {
            // SAFETY: the slot is inside `mem` (slot < SLOTS) and borrowed
            // by `got`, so nothing writes it while we read.
            let mine = unsafe {
                std::slice::from_raw_parts(
                    mem.add(got.slot() as usize * CHUNK as usize),
                    CHUNK as usize,
                )
            };
            assert_eq!(mine, want, "bytes of {k} in the caller's memory");
        },
    );
    drop(receiver);
    // SAFETY: allocated above with `layout`; the receiver (and its memory
    // region) is gone.
    unsafe { std::alloc::dealloc(mem, layout) };
}

// ----- faults under a Sender and Receiver ------------------------------------

/// A receiver that offers rdma on this host's device.
fn rdma_receiver() -> kvferry::receiver::Receiver {
    use kvferry::receiver::{AcceptorFactory, Receiver, ReceiverConfig};
    Receiver::start(ReceiverConfig {
        acceptor: Some(AcceptorFactory::rdma(env_cfg())),
        ..common_sender::receiver_cfg(64)
    })
    .expect("rdma receiver starts")
}

/// A sender over rdma that re-handshakes quickly and gives up on an
/// unanswered message after 10 s (a destroyed receiver never answers).
fn rdma_sender() -> kvferry::sender::Sender {
    kvferry::sender::Sender::with_transport(
        kvferry::sender::SenderConfig {
            transport: "rdma".into(),
            rehello_backoff: Duration::from_millis(200),
            reply_timeout: Duration::from_secs(10),
            ..common_sender::sender_cfg(16, None)
        },
        Box::new(RdmaTransport::new(env_cfg()).expect("rdma sender transport")),
    )
    .expect("rdma sender starts")
}

/// Runs one 4-chunk request to `r` and returns its terminal status; a
/// completed one is read, checked byte for byte and released.
fn run_request(
    s: &kvferry::sender::Sender,
    r: &kvferry::receiver::Receiver,
    n: u64,
) -> kvferry::sender::RequestStatus {
    let req = common_sender::unique("rdma-fault");
    match common_sender::store_request(s, r.endpoint(), &req, n, 4, 2) {
        // A request that already failed (e.g. its first batch met a link
        // that is down) refuses its later batches at once: its terminal
        // status below says why.
        Ok(()) | Err(kvferry::sender::StoreError::RequestEnded(_)) => {}
        Err(e) => panic!("store {req}: {e}"),
    }
    let st = common_sender::terminal(s, &req);
    if st == kvferry::sender::RequestStatus::Completed {
        common_sender::consume(r, &req, n, 4).unwrap_or_else(|e| panic!("{e}"));
    }
    st
}

/// Runs requests to `r` until one completes (bounded), then `n` more that
/// must all complete.
fn later_requests_succeed(s: &kvferry::sender::Sender, r: &kvferry::receiver::Receiver, n: u64) {
    use kvferry::sender::RequestStatus;
    let end = Instant::now() + DEADLINE * 3;
    let mut last = None;
    let mut i = 1000;
    loop {
        let st = run_request(s, r, i);
        i += 1;
        if st == RequestStatus::Completed {
            break;
        }
        assert!(
            Instant::now() < end,
            "no request completed within {:?} after the fault; last status {last:?}",
            DEADLINE * 3
        );
        last = Some(st);
        std::thread::sleep(Duration::from_millis(100));
    }
    for k in 0..n {
        assert_eq!(run_request(s, r, i + k), RequestStatus::Completed);
    }
}

/// A receiver destroyed in the middle of a request (its queue pairs and
/// memory region go with it): the request fails with a typed error, writes
/// in flight to it end (fenced), the other receiver is unaffected, a new
/// receiver is reached, and nothing leaks.
#[test]
fn a_receiver_destroyed_mid_request_fails_its_requests_and_others_go_on() {
    if !device_or_skip("a_receiver_destroyed_mid_request_fails_its_requests_and_others_go_on") {
        return;
    }
    use kvferry::sender::RequestStatus;
    let (a, b) = (rdma_receiver(), rdma_receiver());
    let s = rdma_sender();
    assert_eq!(run_request(&s, &a, 1), RequestStatus::Completed);
    assert_eq!(run_request(&s, &b, 2), RequestStatus::Completed);
    // Half a request stored, then the receiver goes away.
    let req = common_sender::unique("rdma-half");
    let a_ep = a.endpoint().to_owned();
    common_sender::store_batch(&s, &a_ep, &req, 3, 4, 0..2).expect("first batch");
    drop(a);
    // The rest is refused or fails later; either way the request ends failed.
    let _ = common_sender::store_batch(&s, &a_ep, &req, 3, 4, 2..4);
    let st = common_sender::terminal(&s, &req);
    assert!(
        matches!(st, RequestStatus::Failed { .. }),
        "a request to a destroyed receiver: {st:?}"
    );
    // Writes in flight when it went: a whole request stored to a receiver
    // that is destroyed right after.
    let c = rdma_receiver();
    let req = common_sender::unique("rdma-gone");
    common_sender::store_request(&s, c.endpoint(), &req, 4, 4, 4).expect("store");
    drop(c);
    let st = common_sender::terminal(&s, &req);
    assert!(st.is_terminal(), "{st:?}");
    // The other receiver never noticed; a new one is reached.
    for n in 5..8 {
        assert_eq!(run_request(&s, &b, n), RequestStatus::Completed);
    }
    let d = rdma_receiver();
    later_requests_succeed(&s, &d, 2);
    common_sender::wait_sender_empty(&s, "after the destroyed receivers");
    common_sender::wait_receiver_empty(&b, "the receiver that stayed");
    common_sender::wait_receiver_empty(&d, "the new receiver");
}

/// Runs `ip link set <netdev> <state>`.
fn ip_link(netdev: &str, state: &str) {
    let out = std::process::Command::new("ip")
        .args(["link", "set", netdev, state])
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip link set {netdev} {state}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The link under the rxe device goes down and comes back while requests
/// run (as UCX's port-flap tests do): the port-down event fences the queue
/// pairs, the hit requests fail with typed errors or complete, none hangs,
/// the sender re-handshakes, later requests succeed and nothing leaks.
#[test]
fn a_link_flap_fails_the_hit_requests_and_later_ones_succeed() {
    let test = "a_link_flap_fails_the_hit_requests_and_later_ones_succeed";
    if !device_or_skip(test) {
        return;
    }
    let Some(netdev) = std::env::var(ENV_FLAP_NETDEV)
        .ok()
        .filter(|v| !v.is_empty())
    else {
        eprintln!(
            "SKIP {test}: {ENV_FLAP_NETDEV} is not set (needs root and the rxe device's interface)"
        );
        return;
    };
    use kvferry::sender::RequestStatus;
    let r = rdma_receiver();
    let s = rdma_sender();
    for n in 0..3 {
        assert_eq!(run_request(&s, &r, n), RequestStatus::Completed);
    }
    ip_link(&netdev, "down");
    let mut during = Vec::new();
    for n in 10..13 {
        during.push(run_request(&s, &r, n));
    }
    ip_link(&netdev, "up");
    eprintln!("{test}: requests while {netdev} was down: {during:?}");
    later_requests_succeed(&s, &r, 5);
    common_sender::wait_sender_empty(&s, "after the link flap");
    common_sender::wait_receiver_empty(&r, "after the link flap");
}
