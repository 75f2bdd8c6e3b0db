//! The shm transport: the conformance suite (`conformance::*`, see
//! `tests/common_transport/conformance.rs`) over a shm file, and what only
//! shm has: connecting checks the file and its geometry, `by_name`, the
//! staging buffer's errors, and coalescing.

mod common_transport;
use common_transport::{op, pattern, post_all, read_slot};
#[path = "common_transport/conformance.rs"]
#[macro_use]
mod suite;

use std::sync::Arc;

use kvferry::protocol::Descriptor;
use kvferry::region::{default_region_path, Region, RegionError};
use kvferry::staging::{StagingBuffer, StagingError};
use kvferry::transport::{
    by_name, coalesce, Completion, Completions, FaultConfig, Poster, RemoteBuffer, TransportConfig,
    TransportError, WriteOp, MAX_RING_CAPACITY,
};
use proptest::prelude::*;

/// The shm transport under the conformance suite: each receiver is a
/// region (a `/dev/shm` file) the poster maps.
struct Shm {
    halves: suite::Halves,
    regions: Vec<Region>,
}

impl suite::Fixture for Shm {
    const KIND: &'static str = "shm";
    const IN_ORDER: bool = true;
    const THREADS: &'static [&'static str] = &[kvferry::transport::shm::ENGINE_THREAD_NAME];

    fn start(staging: Arc<StagingBuffer>, credits: usize) -> Self {
        Shm {
            halves: suite::Halves::new(start(&staging, credits)),
            regions: Vec::new(),
        }
    }
    fn add_receiver(&mut self, capacity: u64) -> (usize, u32) {
        self.regions.push(region(suite::CHUNK, capacity));
        let rx = self.regions.len() - 1;
        (rx, self.reconnect(rx).expect("connect"))
    }
    fn reconnect(&mut self, rx: usize) -> Result<u32, TransportError> {
        let remote = remote(&self.regions[rx]);
        suite::Fixture::poster(self).connect(&remote)
    }
    fn read_slot(&self, rx: usize, slot: u32) -> Vec<u8> {
        read_slot(&self.regions[rx], slot, suite::CHUNK as usize)
    }
    fn foreign() -> Descriptor {
        Descriptor::Tcp {
            addr: "127.0.0.1:1".into(),
            secret: None,
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

conformance_suite!(crate::Shm; idle_threads_sleep);

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
fn connect_checks_the_descriptor_and_the_file() {
    let staging = Arc::new(StagingBuffer::new(1, 64).unwrap());
    let r = region(64, 4);
    let (mut poster, _comps) = start(&staging, 8);
    let good = remote(&r);
    let p = poster.connect(&good).unwrap();
    assert_eq!(poster.connect(&good).unwrap(), p, "same path → same peer");

    // Foreign descriptors: conformance::connect_refuses_foreign_descriptors.
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
