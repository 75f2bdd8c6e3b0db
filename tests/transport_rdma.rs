//! The RDMA transport (feature `rdma`). Tests that need an RDMA device (a
//! NIC or soft-RoCE, see docs/rdma.md) print `SKIP <test>: <reason>` to
//! stderr and return when there is none; the device-free parts (descriptor
//! encoding, QP state attributes, signalling plan, completion mapping) are
//! unit tests in `src/transport/rdma`. `cargo test --features rdma --test
//! transport_rdma -- --nocapture` shows the skip reasons.
#![cfg(feature = "rdma")]

mod common_transport;
use common_transport::collect;

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

/// True if there is a device; otherwise prints why the test is skipped.
fn device_or_skip(test: &str) -> bool {
    match probe() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP {test}: {e}");
            false
        }
    }
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

/// A receiver side over a fresh region and a started sender connected to it.
struct Pair {
    region: Arc<Region>,
    rx: RdmaReceiverSide,
    /// Kept alive with the pair (filled before the transport shared it).
    _staging: Arc<StagingBuffer>,
    poster: RdmaPoster,
    completions: Box<dyn Completions>,
    peer: u32,
    sender_desc: Descriptor,
}

fn pair(credits: usize) -> Pair {
    let region = Arc::new(Region::create(&default_region_path(), CHUNK, SLOTS).unwrap());
    let cfg = RdmaConfig {
        credits,
        signal_every: 4,
        ..RdmaConfig::default()
    };
    let mut rx = RdmaReceiverSide::new(region.clone(), &cfg).unwrap();
    // Staging slot `i` holds `i + 1` (filled before the transport shares it).
    let mut staging = StagingBuffer::new(SLOTS as usize, CHUNK).unwrap();
    for i in 0..SLOTS {
        staging
            .write_slot(i as u32, &vec![i as u8 + 1; CHUNK as usize])
            .unwrap();
    }
    let staging = Arc::new(staging);
    let (mut poster, completions) = RdmaTransport::new(cfg)
        .unwrap()
        .start_rdma(staging.clone())
        .unwrap();
    let sender_desc = poster.prepare().unwrap();
    let ack = rx.accept(&sender_desc).unwrap();
    let remote = RemoteBuffer {
        descriptor: ack,
        chunk_bytes: CHUNK,
        capacity_chunks: SLOTS,
    };
    let peer = poster.connect_prepared(&sender_desc, &remote).unwrap();
    Pair {
        region,
        rx,
        _staging: staging,
        poster,
        completions: Box::new(completions),
        peer,
        sender_desc,
    }
}

fn op(work_id: u64, peer: u32, slot: u64, remote_slot: u64, len: u64) -> WriteOp {
    WriteOp {
        work_id,
        local_offset: slot * CHUNK,
        remote_offset: remote_slot * CHUNK,
        len,
        peer,
        _pad: 0,
    }
}

#[test]
fn writes_land_in_the_receivers_slots() {
    if !device_or_skip("writes_land_in_the_receivers_slots") {
        return;
    }
    let mut p = pair(64);
    let mut ops = Vec::new();
    for i in 0..SLOTS {
        ops.push(op(100 + i, p.peer, i, SLOTS - 1 - i, CHUNK));
    }
    assert_eq!(p.poster.post(&ops).unwrap(), ops.len());
    let done = collect(p.completions.as_mut(), ops.len(), "16 writes");
    assert!(done.iter().all(|c| c.ok()), "{done:?}");
    for i in 0..SLOTS {
        let got = p
            .region
            .read_slot((SLOTS - 1 - i) as u32, CHUNK as usize)
            .unwrap();
        assert_eq!(got, vec![i as u8 + 1; CHUNK as usize], "slot {i}");
    }
    assert_eq!(p.poster.in_flight(), 0);
    assert_eq!(p.rx.senders(), 1);
}

#[test]
fn bad_ops_complete_at_once_with_their_reason() {
    if !device_or_skip("bad_ops_complete_at_once_with_their_reason") {
        return;
    }
    let mut p = pair(64);
    let ops = [
        op(1, p.peer, 0, SLOTS, CHUNK), // remote range past the end
        op(2, p.peer, SLOTS, 0, CHUNK), // local range past the end
        op(3, 77, 0, 0, CHUNK),         // no such peer
        op(4, p.peer, 0, 0, 0),         // empty write: fine
    ];
    assert_eq!(p.poster.post(&ops).unwrap(), 4);
    let mut done = collect(p.completions.as_mut(), 4, "bad ops");
    done.sort_by_key(|c| c.work_id);
    use CompletionStatus::*;
    let got: Vec<_> = done.iter().map(|c| c.status()).collect();
    assert_eq!(got, vec![OutOfBounds, OutOfBounds, UnknownPeer, Ok]);
    // A disconnected peer's later writes fail as unknown.
    p.poster.disconnect(p.peer);
    assert_eq!(p.poster.post(&[op(5, p.peer, 0, 0, CHUNK)]).unwrap(), 1);
    assert_eq!(
        collect(p.completions.as_mut(), 1, "after disconnect")[0].status(),
        UnknownPeer
    );
}

#[test]
fn a_dead_receiver_qp_fails_the_in_flight_writes() {
    if !device_or_skip("a_dead_receiver_qp_fails_the_in_flight_writes") {
        return;
    }
    let mut p = pair(64);
    let qp = match &p.sender_desc {
        Descriptor::Rdma { qp_num, .. } => *qp_num,
        other => panic!("sender descriptor {other:?}"),
    };
    assert!(p.rx.forget(qp));
    let ops: Vec<WriteOp> = (0..8).map(|i| op(i, p.peer, i, i, CHUNK)).collect();
    assert_eq!(p.poster.post(&ops).unwrap(), 8);
    // RC retries are finite (about 7 * 67 ms plus RNR), well inside DEADLINE.
    let done = collect(p.completions.as_mut(), 8, "writes to a destroyed QP");
    assert!(done.iter().all(|c| !c.ok()), "{done:?}");
    // The queue pair is in error: later writes fail at once.
    assert_eq!(p.poster.post(&[op(9, p.peer, 0, 0, CHUNK)]).unwrap(), 1);
    let later = collect(p.completions.as_mut(), 1, "write after the QP failed");
    assert_eq!(later[0].status(), CompletionStatus::ConnectionLost);
}

#[test]
fn the_generic_connect_and_foreign_descriptors_are_refused() {
    if !device_or_skip("the_generic_connect_and_foreign_descriptors_are_refused") {
        return;
    }
    let mut p = pair(8);
    let remote = |descriptor| RemoteBuffer {
        descriptor,
        chunk_bytes: CHUNK,
        capacity_chunks: SLOTS,
    };
    let shm = Descriptor::Shm {
        path: "/dev/shm/x".into(),
        len: CHUNK * SLOTS,
    };
    assert!(matches!(
        p.poster.connect(&remote(shm.clone())),
        Err(TransportError::Unsupported { .. })
    ));
    assert!(matches!(
        p.poster.connect(&remote(p.sender_desc.clone())),
        Err(TransportError::BadDescriptor(_))
    ));
    assert!(matches!(
        p.rx.accept(&shm),
        Err(TransportError::Unsupported { .. })
    ));
    // Connecting a QP that was never prepared (or twice) is refused.
    let ack = p.rx.accept(&p.poster.prepare().unwrap()).unwrap();
    assert!(matches!(
        p.poster.connect_prepared(&p.sender_desc, &remote(ack)),
        Err(TransportError::BadDescriptor(_))
    ));
    // A discarded QP (its Hello went unanswered) cannot be connected.
    let discarded = p.poster.prepare().unwrap();
    let ack = p.rx.accept(&discarded).unwrap();
    p.poster.discard_prepared(&discarded);
    assert!(matches!(
        p.poster.connect_prepared(&discarded, &remote(ack)),
        Err(TransportError::BadDescriptor(_))
    ));
    drop(p.poster);
    let mut out = Vec::new();
    assert_eq!(
        p.completions
            .poll(&mut out, 1, Some(Instant::now() + DEADLINE)),
        PollStatus::Closed
    );
}

#[test]
fn kvferry_run_without_a_device_exits_2_and_says_why() {
    if probe().is_ok() {
        eprintln!(
            "SKIP kvferry_run_without_a_device_exits_2_and_says_why: this host has an RDMA device"
        );
        return;
    }
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["run", "--transport", "rdma", "--requests", "1", "--quiet"])
        .env_remove("KVFERRY_RDMA_DEVICE")
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
    assert!(err.contains("no RDMA device was found"), "stderr: {err}");
    assert!(err.contains("ibv_get_device_list"), "stderr: {err}");
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
#[test]
fn runner_over_rdma_moves_every_request_without_leaks() {
    if !device_or_skip("runner_over_rdma_moves_every_request_without_leaks") {
        return;
    }
    for cfg in [
        rdma_run(1000),
        kvferry::runner::RunConfig {
            abort_rate: 0.05,
            fail_rate: 0.02,
            seed: 11,
            ..rdma_run(1000)
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
        assert_eq!(r.completed + r.aborted + r.failed, 1000, "{}", r.render());
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
    use kvferry::receiver::{AcceptorFactory, Receiver, ReceiverConfig};
    use kvferry::sender::{RequestStatus, Sender, SenderConfig, TransferSpec};
    let cfg = RdmaConfig::from_env(&TransportConfig::default()).unwrap();
    let receiver = Receiver::start(ReceiverConfig {
        capacity_chunks: SLOTS as usize,
        chunk_bytes: CHUNK,
        acceptor: Some(AcceptorFactory::rdma(cfg.clone())),
        ..ReceiverConfig::default()
    })
    .unwrap();
    let sender = Sender::with_transport(
        SenderConfig {
            staging_slots: 8,
            chunk_bytes: CHUNK,
            transport: "rdma".into(),
            ..SenderConfig::default()
        },
        Box::new(RdmaTransport::new(cfg).unwrap()),
    )
    .unwrap();
    let chunks: Vec<Vec<u8>> = (0..3u8).map(|i| vec![0xA0 + i; CHUNK as usize]).collect();
    let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let keys = ["k0", "k1", "k2"];
    let spec = TransferSpec::new("rdma-hello", receiver.endpoint(), 3, true);
    sender.store(&spec, &keys, &refs).unwrap();
    let deadline = Instant::now() + DEADLINE;
    assert_eq!(
        sender.wait("rdma-hello", deadline),
        Some(RequestStatus::Completed)
    );
    receiver.wait_ready("rdma-hello", deadline).unwrap();
    for (k, want) in keys.iter().zip(&chunks) {
        let got = receiver.get(k).expect("key held");
        assert_eq!(got.bytes(), &want[..], "bytes of {k}");
    }
}
