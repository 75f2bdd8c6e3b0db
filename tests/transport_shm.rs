//! Black-box tests of the shm transport, the staging buffer and coalescing.

mod common_transport;
use common_transport::{collect, op, pattern, post_all, read_slot, WAIT};

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::protocol::Descriptor;
use kvferry::region::{default_region_path, Region, RegionError};
use kvferry::staging::{StagingBuffer, StagingError};
use kvferry::transport::{
    by_name, coalesce, Completion, CompletionStatus, Completions, FaultConfig, PollStatus, Poster,
    RemoteBuffer, TransportConfig, TransportError, WriteOp, MAX_RING_CAPACITY,
};
use proptest::prelude::*;

fn start(
    staging: &Arc<StagingBuffer>,
    ring_capacity: usize,
) -> (Box<dyn Poster>, Box<dyn Completions>) {
    let cfg = TransportConfig {
        ring_capacity,
        ..TransportConfig::default()
    };
    by_name("shm", &cfg)
        .unwrap()
        .start(staging.clone())
        .unwrap()
}

fn remote(region: &Region) -> RemoteBuffer {
    RemoteBuffer {
        descriptor: Descriptor::Shm {
            path: region.path().to_string_lossy().into_owned(),
            len: region.data_len(),
        },
        chunk_bytes: region.chunk_bytes(),
        capacity_chunks: region.capacity_chunks(),
    }
}

fn region(chunk: u64, cap: u64) -> Region {
    Region::create(&default_region_path(), chunk, cap).unwrap()
}

fn all_region_bytes(r: &Region) -> Vec<u8> {
    (0..r.capacity_chunks() as u32)
        .flat_map(|s| read_slot(r, s, r.chunk_bytes() as usize))
        .collect()
}

#[test]
fn a_write_lands_in_the_receiver_region() {
    let mut staging = StagingBuffer::new(4, 4096).unwrap();
    let data = pattern(1, 4096);
    staging.write_slot(1, &data).unwrap();
    let r = region(4096, 8);
    let staging = Arc::new(staging);
    let (mut poster, mut comps) = start(&staging, 16);
    let peer = poster.connect(&remote(&r)).unwrap();
    let n = poster
        .post(&[op(42, staging.slot_offset(1), 5 * 4096, 4096, peer)])
        .unwrap();
    assert_eq!(n, 1);
    let done = collect(&mut *comps, 1, "single write");
    assert_eq!(done, vec![Completion::new(42, CompletionStatus::Ok)]);
    assert!(done[0].ok());
    assert_eq!(poster.in_flight(), 0);
    assert_eq!(read_slot(&r, 5, 4096), data);
    for s in (0..8).filter(|&s| s != 5) {
        assert!(
            read_slot(&r, s, 4096).iter().all(|&b| b == 0),
            "slot {s} touched"
        );
    }
}

#[test]
fn many_ops_across_two_peers_with_credit_flow() {
    const CHUNK: u64 = 1024;
    let mut staging = StagingBuffer::new(128, CHUNK).unwrap();
    for s in 0..128u32 {
        staging
            .write_slot(s, &pattern(u64::from(s), CHUNK as usize))
            .unwrap();
    }
    let (r0, r1) = (region(CHUNK, 64), region(CHUNK, 64));
    let staging = Arc::new(staging);
    let (mut poster, mut comps) = start(&staging, 16);
    let p0 = poster.connect(&remote(&r0)).unwrap();
    let p1 = poster.connect(&remote(&r1)).unwrap();
    assert_ne!(p0, p1);
    assert_eq!(poster.credits(), 16);
    let ops: Vec<WriteOp> = (0..128u32)
        .map(|s| {
            let peer = if s % 2 == 0 { p0 } else { p1 };
            // Reverse the slot order on the receiver side.
            let remote_slot = 63 - u64::from(s / 2);
            op(
                1000 + u64::from(s),
                staging.slot_offset(s),
                remote_slot * CHUNK,
                CHUNK,
                peer,
            )
        })
        .collect();
    let done = post_all(&mut *poster, &mut *comps, &ops);
    assert!(done.iter().all(Completion::ok), "{done:?}");
    let ids: HashSet<u64> = done.iter().map(|c| c.work_id).collect();
    assert_eq!(ids.len(), 128, "every op completes exactly once");
    assert_eq!(ids, ops.iter().map(|o| o.work_id).collect());
    for s in 0..128u32 {
        let r = if s % 2 == 0 { &r0 } else { &r1 };
        assert_eq!(
            read_slot(r, 63 - s / 2, CHUNK as usize),
            pattern(u64::from(s), CHUNK as usize),
            "staging slot {s}"
        );
    }
}

#[test]
fn out_of_bounds_ops_complete_with_an_error_and_write_nothing() {
    let mut staging = StagingBuffer::new(4, 512).unwrap();
    for s in 0..4 {
        staging.write_slot(s, &pattern(9, 512)).unwrap();
    }
    let r = region(512, 4);
    let staging = Arc::new(staging);
    let (mut poster, mut comps) = start(&staging, 16);
    let p = poster.connect(&remote(&r)).unwrap();
    let bad = [
        op(1, 0, 4 * 512 - 10, 11, p), // remote end one past the area
        op(2, 4 * 512 - 10, 0, 11, p), // local end one past staging
        op(3, 0, u64::MAX - 4, 10, p), // remote end overflows u64
        op(4, u64::MAX, 0, 1, p),      // local end overflows u64
        op(5, 0, 4 * 512, 0, p),       // empty op at the end: fine
        op(6, 0, 4 * 512 + 1, 0, p),   // empty op past the end
        op(7, 0, 0, u64::MAX, p),      // huge length
    ];
    assert_eq!(poster.post(&bad).unwrap(), bad.len());
    let done = collect(&mut *comps, bad.len(), "out-of-bounds ops");
    let status: Vec<(u64, CompletionStatus)> =
        done.iter().map(|c| (c.work_id, c.status())).collect();
    use CompletionStatus::{Ok, OutOfBounds};
    assert_eq!(
        status,
        vec![
            (1, OutOfBounds),
            (2, OutOfBounds),
            (3, OutOfBounds),
            (4, OutOfBounds),
            (5, Ok),
            (6, OutOfBounds),
            (7, OutOfBounds)
        ]
    );
    assert!(
        all_region_bytes(&r).iter().all(|&b| b == 0),
        "nothing written"
    );
    // The engine is still healthy.
    poster.post(&[op(8, 0, 3 * 512, 512, p)]).unwrap();
    assert!(collect(&mut *comps, 1, "write after errors")[0].ok());
    assert_eq!(read_slot(&r, 3, 512), pattern(9, 512));
}

#[test]
fn unknown_and_disconnected_peers_complete_with_unknown_peer() {
    let mut staging = StagingBuffer::new(2, 256).unwrap();
    staging.write_slot(0, &[7; 256]).unwrap();
    let r = region(256, 2);
    let staging = Arc::new(staging);
    let (mut poster, mut comps) = start(&staging, 8);
    let p = poster.connect(&remote(&r)).unwrap();
    poster.post(&[op(1, 0, 0, 256, p + 1)]).unwrap();
    assert_eq!(
        collect(&mut *comps, 1, "unknown peer")[0].status(),
        CompletionStatus::UnknownPeer
    );
    poster.disconnect(p);
    poster.disconnect(p); // twice: no-op
    poster.disconnect(99); // unknown: ignored
    poster.post(&[op(2, 0, 0, 256, p)]).unwrap();
    assert_eq!(
        collect(&mut *comps, 1, "disconnected peer")[0].status(),
        CompletionStatus::UnknownPeer
    );
    assert!(all_region_bytes(&r).iter().all(|&b| b == 0));
    // Reconnecting gets a fresh index that works.
    let p2 = poster.connect(&remote(&r)).unwrap();
    assert_ne!(p2, p);
    poster.post(&[op(3, 0, 0, 256, p2)]).unwrap();
    assert!(collect(&mut *comps, 1, "reconnected peer")[0].ok());
    assert_eq!(read_slot(&r, 0, 256), vec![7; 256]);
}

#[test]
fn post_stops_at_the_credit_limit_and_resumes_after_poll() {
    let staging = Arc::new(StagingBuffer::new(16, 64).unwrap());
    let r = region(64, 16);
    let (mut poster, mut comps) = start(&staging, 4);
    let p = poster.connect(&remote(&r)).unwrap();
    let ops: Vec<WriteOp> = (0..10).map(|i| op(i, i * 64, i * 64, 64, p)).collect();
    assert_eq!(poster.credits(), 4);
    assert_eq!(poster.post(&ops).unwrap(), 4);
    assert_eq!(poster.in_flight(), 4);
    assert_eq!(poster.post(&ops[4..]).unwrap(), 0, "no credit left");
    let first = collect(&mut *comps, 3, "first three");
    assert_eq!(poster.in_flight(), 1);
    assert_eq!(
        poster.post(&ops[4..]).unwrap(),
        3,
        "three credits came back"
    );
    let rest = collect(&mut *comps, 4, "rest");
    let ids: Vec<u64> = first.iter().chain(&rest).map(|c| c.work_id).collect();
    assert_eq!(ids, (0..7).collect::<Vec<_>>(), "shm completes in order");
    assert_eq!(poster.in_flight(), 0);
}

#[test]
fn dropping_the_poster_delivers_every_completion_then_closed() {
    let staging = Arc::new(StagingBuffer::new(8, 128).unwrap());
    let r = region(128, 8);
    let (mut poster, mut comps) = start(&staging, 8);
    let p = poster.connect(&remote(&r)).unwrap();
    let ops: Vec<WriteOp> = (0..8).map(|i| op(i, i * 128, i * 128, 128, p)).collect();
    assert_eq!(poster.post(&ops).unwrap(), 8);
    drop(poster);
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    loop {
        match comps.poll(&mut out, 3, Some(deadline)) {
            PollStatus::Ready(n) => assert!((1..=3).contains(&n)),
            PollStatus::Closed => break,
            PollStatus::TimedOut => panic!("close: poll timed out after {} completions", out.len()),
        }
    }
    assert_eq!(
        out.iter().map(|c| c.work_id).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    assert_eq!(
        comps.poll(&mut out, 1, Some(deadline)),
        PollStatus::Closed,
        "stays closed"
    );
}

#[test]
fn poll_times_out_when_idle_and_respects_max() {
    let staging = Arc::new(StagingBuffer::new(4, 64).unwrap());
    let r = region(64, 4);
    let (mut poster, mut comps) = start(&staging, 8);
    let mut out = Vec::new();
    let soon = Instant::now() + Duration::from_millis(20);
    assert_eq!(comps.poll(&mut out, 8, Some(soon)), PollStatus::TimedOut);
    assert_eq!(comps.poll(&mut out, 0, Some(soon)), PollStatus::Ready(0));
    let p = poster.connect(&remote(&r)).unwrap();
    let ops: Vec<WriteOp> = (0..4).map(|i| op(i, i * 64, i * 64, 64, p)).collect();
    poster.post(&ops).unwrap();
    let deadline = Instant::now() + WAIT;
    match comps.poll(&mut out, 2, Some(deadline)) {
        PollStatus::Ready(n) => assert!((1..=2).contains(&n), "max respected, got {n}"),
        s => panic!("poll after post: {s:?}"),
    }
    let got = out.len();
    out.extend(collect(&mut *comps, 4 - got, "remaining"));
    assert_eq!(out.len(), 4);
}

#[test]
fn connect_checks_the_descriptor_and_the_file() {
    let staging = Arc::new(StagingBuffer::new(1, 64).unwrap());
    let r = region(64, 4);
    let (mut poster, _comps) = start(&staging, 8);
    let good = remote(&r);
    let p = poster.connect(&good).unwrap();
    assert_eq!(poster.connect(&good).unwrap(), p, "same path → same peer");

    let wrong_kind = RemoteBuffer {
        descriptor: Descriptor::Tcp {
            addr: "127.0.0.1:1".into(),
            secret: None,
        },
        ..good.clone()
    };
    assert!(matches!(
        poster.connect(&wrong_kind),
        Err(TransportError::Unsupported {
            transport: "shm",
            descriptor: "tcp"
        })
    ));
    let none = RemoteBuffer {
        descriptor: Descriptor::None,
        ..good.clone()
    };
    assert!(matches!(
        poster.connect(&none),
        Err(TransportError::Unsupported { .. })
    ));

    let bad_len = RemoteBuffer {
        descriptor: Descriptor::Shm {
            path: r.path().to_string_lossy().into_owned(),
            len: 1,
        },
        ..good.clone()
    };
    assert!(matches!(
        poster.connect(&bad_len),
        Err(TransportError::BadDescriptor(_))
    ));

    let regrown = RemoteBuffer {
        descriptor: Descriptor::Shm {
            path: r.path().to_string_lossy().into_owned(),
            len: 64 * 8,
        },
        capacity_chunks: 8,
        ..good.clone()
    };
    assert!(
        matches!(
            poster.connect(&regrown),
            Err(TransportError::BadDescriptor(_))
        ),
        "already connected with another geometry"
    );

    let other = region(128, 4);
    let wrong_geometry = RemoteBuffer {
        descriptor: Descriptor::Shm {
            path: other.path().to_string_lossy().into_owned(),
            len: 64 * 8,
        },
        chunk_bytes: 64,
        capacity_chunks: 8,
    };
    let err = poster.connect(&wrong_geometry).unwrap_err();
    assert!(
        matches!(err, TransportError::Region(RegionError::Mismatch { .. })),
        "{err}"
    );

    let missing = RemoteBuffer {
        descriptor: Descriptor::Shm {
            path: "/nonexistent/kvferry-test.buf".into(),
            len: 256,
        },
        chunk_bytes: 64,
        capacity_chunks: 4,
    };
    assert!(matches!(
        poster.connect(&missing),
        Err(TransportError::Region(RegionError::Io { .. }))
    ));
}

#[test]
fn post_fails_with_closed_once_the_engine_stopped() {
    let staging = Arc::new(StagingBuffer::new(1, 64).unwrap());
    let r = region(64, 1);
    let (mut poster, comps) = start(&staging, 8);
    let p = poster.connect(&remote(&r)).unwrap();
    // Nobody listens for completions any more: the engine stops at its next
    // completion, closing the submission ring.
    drop(comps);
    let deadline = Instant::now() + WAIT;
    let mut work_id = 0;
    loop {
        match poster.post(&[op(work_id, 0, 0, 64, p)]) {
            Err(TransportError::Closed) => break,
            Ok(_) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
        work_id += 1;
        assert!(
            Instant::now() < deadline,
            "engine did not stop after its completion half was dropped"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn by_name_builds_shm_and_reports_the_others() {
    let cfg = TransportConfig::default();
    assert_eq!(cfg.ring_capacity, 1024);
    let t = by_name("shm", &cfg).unwrap();
    assert_eq!(t.kind(), "shm");
    assert_eq!(t.local_descriptor(), Descriptor::None);
    assert_eq!(by_name("tcp", &cfg).unwrap().kind(), "tcp");
    // Without the `rdma` feature the verbs transport is not in the build;
    // with it, this machine has no device (tests/transport_rdma.rs).
    #[cfg(not(feature = "rdma"))]
    assert!(matches!(
        by_name("rdma", &cfg),
        Err(TransportError::NotBuilt {
            transport: "rdma",
            ..
        })
    ));
    assert!(
        matches!(by_name("carrier-pigeon", &cfg), Err(TransportError::UnknownTransport(n)) if n == "carrier-pigeon")
    );
    for bad in [0, MAX_RING_CAPACITY + 1] {
        let cfg = TransportConfig {
            ring_capacity: bad,
            ..TransportConfig::default()
        };
        assert!(
            matches!(by_name("shm", &cfg), Err(TransportError::Config(_))),
            "capacity {bad}"
        );
    }
    // A non-power-of-two capacity rounds up.
    let staging = Arc::new(StagingBuffer::new(1, 64).unwrap());
    let (poster, _c) = start(&staging, 5);
    assert_eq!(poster.credits(), 8);
    // The fault wrapper keeps the inner kind.
    let cfg = TransportConfig {
        fault: Some(FaultConfig::default()),
        ..TransportConfig::default()
    };
    assert_eq!(by_name("shm", &cfg).unwrap().kind(), "shm");
    let msg = TransportError::NoDevice("no RDMA device found".into()).to_string();
    assert!(msg.contains("no RDMA device found"), "{msg}");
    let io: TransportError = std::io::Error::other("spawn failed").into();
    assert!(matches!(io, TransportError::Io(_)) && io.to_string().contains("spawn failed"));
}

/// Engine threads of this process: (tid, state letter).
fn engine_threads() -> Vec<(String, String)> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() == kvferry::transport::shm::ENGINE_THREAD_NAME {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // The state letter is the first field after "(comm)".
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().next());
            found.push((
                task.file_name().to_string_lossy().into_owned(),
                state.unwrap_or("gone").to_owned(),
            ));
        }
    }
    found
}

/// The copy engine sleeps (futex) when there is nothing to do.
#[test]
fn idle_engine_thread_sleeps() {
    let before: HashSet<String> = engine_threads().into_iter().map(|(tid, _)| tid).collect();
    let staging = Arc::new(StagingBuffer::new(1, 64).unwrap());
    let (_poster, _comps) = start(&staging, 8);
    // Ours is among the engines that appeared (tests run in parallel; the
    // thread names itself once it runs); all of those must eventually be seen
    // asleep at once.
    let deadline = Instant::now() + WAIT;
    loop {
        let states: Vec<(String, String)> = engine_threads()
            .into_iter()
            .filter(|(tid, _)| !before.contains(tid))
            .collect();
        if !states.is_empty() && states.iter().all(|(_, s)| s == "S") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "copy engine never went to sleep: new engine threads {states:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn staging_buffer_errors_are_typed() {
    assert!(matches!(
        StagingBuffer::new(0, 64),
        Err(StagingError::Empty { .. })
    ));
    assert!(matches!(
        StagingBuffer::new(4, 0),
        Err(StagingError::Empty { .. })
    ));
    assert!(matches!(
        StagingBuffer::new(usize::MAX, 2),
        Err(StagingError::Overflow { .. })
    ));
    assert!(matches!(
        StagingBuffer::new(2, u64::MAX),
        Err(StagingError::Overflow { .. })
    ));
    // 4 EiB: fits the address-space checks but no kernel maps it.
    assert!(matches!(
        StagingBuffer::new(1, 1 << 62),
        Err(StagingError::Map { .. })
    ));
    let mut s = StagingBuffer::new(3, 100).unwrap();
    assert_eq!((s.slots(), s.slot_bytes(), s.len()), (3, 100, 300));
    assert!(!s.is_empty());
    assert_eq!(s.as_ptr() as usize % 4096, 0, "page-aligned");
    assert_eq!(s.slot_offset(2), 200);
    assert!(matches!(
        s.write_slot(3, &[1]),
        Err(StagingError::SlotOutOfRange { slot: 3, slots: 3 })
    ));
    assert!(matches!(
        s.write_slot(0, &[1; 101]),
        Err(StagingError::TooLong { len: 101, .. })
    ));
    s.write_slot(2, &[5; 100]).unwrap();
    assert_eq!(
        s.read_slot(2, 1000).unwrap(),
        vec![5; 100],
        "read clamps to the slot"
    );
    assert_eq!(s.read_slot(1, 4).unwrap(), vec![0; 4]);
    assert_eq!(s.read_slot(3, 4), None);
}

fn arb_ops(staging_len: u64, region_len: u64) -> impl Strategy<Value = Vec<WriteOp>> {
    // (contiguous with previous?, local, remote, len, peer)
    let step = (
        any::<bool>(),
        0..staging_len,
        0..region_len,
        1..=48u64,
        0..2u32,
    );
    prop::collection::vec(step, 1..40).prop_map(move |steps| {
        let mut ops: Vec<WriteOp> = Vec::new();
        for (i, (contig, local, remote, len, peer)) in steps.into_iter().enumerate() {
            let (mut local, mut remote, mut peer) = (local, remote, peer);
            if let (true, Some(prev)) = (contig, ops.last()) {
                local = prev.local_offset + prev.len;
                remote = prev.remote_offset + prev.len;
                peer = prev.peer;
            }
            // Keep the op in bounds.
            let len = len
                .min(staging_len - local.min(staging_len))
                .min(region_len - remote.min(region_len));
            if len == 0 {
                continue;
            }
            ops.push(op(i as u64, local, remote, len, peer));
        }
        ops
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Writing the coalesced ops lands exactly the same bytes as writing the
    /// original ops, and the runs map the merged ops back to the originals.
    #[test]
    fn coalesced_ops_write_the_same_bytes(ops in arb_ops(512, 384)) {
        let mut staging = StagingBuffer::new(8, 64).unwrap();
        for s in 0..8 {
            staging.write_slot(s, &pattern(u64::from(s) + 100, 64)).unwrap();
        }
        let plain = [region(64, 6), region(64, 6)];
        let merged = [region(64, 6), region(64, 6)];
        let staging = Arc::new(staging);
        let (mut poster, mut comps) = start(&staging, 64);
        let plain_peers = [poster.connect(&remote(&plain[0])).unwrap(), poster.connect(&remote(&plain[1])).unwrap()];
        let merged_peers = [poster.connect(&remote(&merged[0])).unwrap(), poster.connect(&remote(&merged[1])).unwrap()];

        let (mut out, mut runs) = (Vec::new(), Vec::new());
        coalesce(&ops, &mut out, &mut runs);
        prop_assert_eq!(out.len(), runs.len());
        prop_assert_eq!(runs.iter().sum::<usize>(), ops.len());
        let mut start_idx = 0;
        for (m, &run) in out.iter().zip(&runs) {
            let covered = &ops[start_idx..start_idx + run];
            prop_assert_eq!(m.work_id, covered[0].work_id);
            prop_assert_eq!(m.len, covered.iter().map(|o| o.len).sum::<u64>());
            prop_assert_eq!(m.local_offset, covered[0].local_offset);
            prop_assert_eq!(m.remote_offset, covered[0].remote_offset);
            prop_assert!(covered.iter().all(|o| o.peer == m.peer));
            start_idx += run;
        }

        let plain_ops: Vec<WriteOp> = ops.iter().map(|o| WriteOp { peer: plain_peers[o.peer as usize], ..*o }).collect();
        let merged_ops: Vec<WriteOp> = out.iter().map(|o| WriteOp { peer: merged_peers[o.peer as usize], ..*o }).collect();
        let done = post_all(&mut *poster, &mut *comps, &plain_ops);
        prop_assert!(done.iter().all(Completion::ok));
        let done = post_all(&mut *poster, &mut *comps, &merged_ops);
        prop_assert!(done.iter().all(Completion::ok));
        for peer in 0..2 {
            prop_assert_eq!(all_region_bytes(&plain[peer]), all_region_bytes(&merged[peer]));
        }
    }
}
