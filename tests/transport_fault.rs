//! Black-box tests of the fault-injection transport wrapper (over shm).

mod common_transport;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common_transport::read_slot;
use kvferry::protocol::Descriptor;
use kvferry::region::{default_region_path, Region};
use kvferry::staging::StagingBuffer;
use kvferry::transport::{
    by_name, Completion, CompletionStatus, Completions, FaultConfig, FaultTransport, PollStatus,
    Poster, RemoteBuffer, Transport, TransportConfig, TransportError, WriteOp,
};

const WAIT: Duration = Duration::from_secs(10);
const CHUNK: u64 = 256;

struct Rig {
    staging: Arc<StagingBuffer>,
    region: Region,
    poster: Box<dyn Poster>,
    comps: Box<dyn Completions>,
    peer: u32,
}

/// A fault-wrapped shm transport with `slots` staging and receiver slots,
/// staging slot `s` filled with `s + 1`.
fn rig(slots: u32, ring_capacity: usize, fault: FaultConfig) -> Rig {
    let mut staging = StagingBuffer::new(slots as usize, CHUNK).unwrap();
    for s in 0..slots {
        staging
            .write_slot(s, &[s as u8 + 1; CHUNK as usize])
            .unwrap();
    }
    let region = Region::create(&default_region_path(), CHUNK, u64::from(slots)).unwrap();
    let cfg = TransportConfig {
        ring_capacity,
        fault: Some(fault),
        ..TransportConfig::default()
    };
    let staging = Arc::new(staging);
    let (mut poster, comps) = by_name("shm", &cfg)
        .unwrap()
        .start(staging.clone())
        .unwrap();
    let peer = poster
        .connect(&RemoteBuffer {
            descriptor: Descriptor::Shm {
                path: region.path().to_string_lossy().into_owned(),
                len: region.data_len(),
            },
            chunk_bytes: CHUNK,
            capacity_chunks: u64::from(slots),
        })
        .unwrap();
    Rig {
        staging,
        region,
        poster,
        comps,
        peer,
    }
}

impl Rig {
    /// Op `work_id = 100 + s`: staging slot `s` → receiver slot `s`.
    fn op(&self, s: u32) -> WriteOp {
        WriteOp {
            work_id: 100 + u64::from(s),
            local_offset: self.staging.slot_offset(s),
            remote_offset: u64::from(s) * CHUNK,
            len: CHUNK,
            peer: self.peer,
            local_region: 0,
        }
    }

    fn ops(&self, n: u32) -> Vec<WriteOp> {
        (0..n).map(|s| self.op(s)).collect()
    }

    /// Posts all ops (polling when out of credit) and returns every completion.
    fn run(&mut self, ops: &[WriteOp]) -> Vec<Completion> {
        let deadline = Instant::now() + WAIT;
        let mut done = Vec::new();
        let mut next = 0;
        while next < ops.len() || done.len() < ops.len() {
            if next < ops.len() {
                next += self.poster.post(&ops[next..]).unwrap();
            }
            if next < ops.len() || done.len() < ops.len() {
                match self.comps.poll(&mut done, usize::MAX, Some(deadline)) {
                    PollStatus::Ready(_) => {}
                    s => panic!(
                        "fault rig: waiting for completions ({} of {}): {s:?}",
                        done.len(),
                        ops.len()
                    ),
                }
            }
        }
        assert_eq!(self.poster.in_flight(), 0);
        done
    }

    fn slot_written(&self, s: u32) -> bool {
        let bytes = read_slot(&self.region, s, CHUNK as usize);
        if bytes == vec![s as u8 + 1; CHUNK as usize] {
            true
        } else {
            assert!(bytes.iter().all(|&b| b == 0), "slot {s} partly written");
            false
        }
    }
}

#[test]
fn fail_work_ids_fail_exactly_those_and_write_nothing() {
    let failing: HashSet<u64> = [103, 107, 111].into();
    let mut rig = rig(
        16,
        8,
        FaultConfig {
            fail_work_ids: failing.iter().copied().collect(),
            ..FaultConfig::default()
        },
    );
    let ops = rig.ops(16);
    let done = rig.run(&ops);
    assert_eq!(done.len(), 16);
    for c in &done {
        let expect = if failing.contains(&c.work_id) {
            CompletionStatus::Injected
        } else {
            CompletionStatus::Ok
        };
        assert_eq!(c.status(), expect, "work {}", c.work_id);
    }
    for s in 0..16 {
        assert_eq!(
            rig.slot_written(s),
            !failing.contains(&(100 + u64::from(s))),
            "slot {s}"
        );
    }
}

#[test]
fn fail_rate_one_fails_everything_and_zero_nothing() {
    let mut all = rig(
        8,
        4,
        FaultConfig {
            fail_rate: 1.0,
            ..FaultConfig::default()
        },
    );
    let ops = all.ops(8);
    let done = all.run(&ops);
    assert!(done
        .iter()
        .all(|c| c.status() == CompletionStatus::Injected));
    assert!((0..8).all(|s| !all.slot_written(s)));

    let mut none = rig(8, 4, FaultConfig::default());
    let ops = none.ops(8);
    assert!(none.run(&ops).iter().all(Completion::ok));
    assert!((0..8).all(|s| none.slot_written(s)));
}

#[test]
fn seeded_fail_rate_fails_the_predicted_ops() {
    let cfg = FaultConfig {
        fail_rate: 0.5,
        seed: 42,
        ..FaultConfig::default()
    };
    let predicted: HashSet<u64> = (100..164).filter(|&id| cfg.fails(id)).collect();
    assert!(
        !predicted.is_empty() && predicted.len() < 64,
        "a 50% rate fails some but not all of 64 ops: {}",
        predicted.len()
    );
    // A small ring so posting happens in several credit-limited rounds: the
    // choice does not depend on batching.
    let mut rig = rig(64, 4, cfg);
    let ops = rig.ops(64);
    let failed: HashSet<u64> = rig
        .run(&ops)
        .iter()
        .filter(|c| c.status() == CompletionStatus::Injected)
        .map(|c| c.work_id)
        .collect();
    assert_eq!(failed, predicted);
    for s in 0..64 {
        assert_eq!(
            rig.slot_written(s),
            !predicted.contains(&(100 + u64::from(s)))
        );
    }
}

#[test]
fn reorder_with_delay_delivers_every_completion_once_out_of_order() {
    let delay = Duration::from_millis(5);
    let mut rig = rig(
        64,
        64,
        FaultConfig {
            delay,
            reorder: true,
            seed: 7,
            ..FaultConfig::default()
        },
    );
    let ops = rig.ops(64);
    let posted_at = Instant::now();
    let done = rig.run(&ops);
    // Lower bound only (never a timing upper bound): nothing came back early.
    assert!(posted_at.elapsed() >= delay);
    let ids: Vec<u64> = done.iter().map(|c| c.work_id).collect();
    let unique: HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(ids.len(), 64, "no duplicates, none lost");
    assert_eq!(unique, ops.iter().map(|o| o.work_id).collect());
    assert!(done.iter().all(Completion::ok));
    let in_order: Vec<u64> = ops.iter().map(|o| o.work_id).collect();
    assert_ne!(ids, in_order, "reorder changed the order");
    assert!((0..64).all(|s| rig.slot_written(s)));
}

#[test]
fn delay_holds_completions_and_they_keep_using_credits() {
    let delay = Duration::from_millis(30);
    let mut rig = rig(
        8,
        4,
        FaultConfig {
            delay,
            ..FaultConfig::default()
        },
    );
    let ops = rig.ops(8);
    let posted_at = Instant::now();
    assert_eq!(rig.poster.post(&ops).unwrap(), 4);
    assert_eq!(rig.poster.credits(), 4);
    // A deadline shorter than the delay: nothing is released yet.
    let mut out = Vec::new();
    let early = posted_at + delay / 3;
    if Instant::now() < early {
        assert_eq!(
            rig.comps.poll(&mut out, 8, Some(early)),
            PollStatus::TimedOut
        );
    }
    // Held completions still count as in flight.
    assert_eq!(rig.poster.in_flight(), 4);
    assert_eq!(rig.poster.post(&ops[4..]).unwrap(), 0);
    let deadline = Instant::now() + WAIT;
    match rig.comps.poll(&mut out, 8, Some(deadline)) {
        PollStatus::Ready(n) => assert!(n >= 1),
        s => panic!("delayed completions never came: {s:?}"),
    }
    assert!(posted_at.elapsed() >= delay, "held at least `delay`");
    let rest = rig.run(&ops[4..]);
    let ids: Vec<u64> = out.iter().chain(&rest).map(|c| c.work_id).collect();
    assert_eq!(ids.len(), 8);
    assert_eq!(
        ids.iter().copied().collect::<HashSet<_>>(),
        (100..108).collect()
    );
}

#[test]
fn dropping_the_poster_delivers_held_completions_then_closed() {
    let mut rig = rig(
        8,
        8,
        FaultConfig {
            delay: Duration::from_millis(10),
            reorder: true,
            fail_work_ids: vec![101],
            seed: 3,
            ..FaultConfig::default()
        },
    );
    let ops = rig.ops(8);
    assert_eq!(rig.poster.post(&ops).unwrap(), 8);
    drop(rig.poster);
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    loop {
        match rig.comps.poll(&mut out, 2, Some(deadline)) {
            PollStatus::Ready(n) => assert!((1..=2).contains(&n)),
            PollStatus::Closed => break,
            PollStatus::TimedOut => panic!("close: timed out after {} completions", out.len()),
        }
    }
    assert_eq!(out.len(), 8);
    assert_eq!(
        out.iter().map(|c| c.work_id).collect::<HashSet<_>>(),
        (100..108).collect()
    );
    let injected: Vec<u64> = out
        .iter()
        .filter(|c| c.status() == CompletionStatus::Injected)
        .map(|c| c.work_id)
        .collect();
    assert_eq!(injected, vec![101]);
    assert_eq!(
        rig.comps.poll(&mut out, 1, Some(deadline)),
        PollStatus::Closed
    );
}

#[test]
fn invalid_fault_configs_are_refused() {
    let bad = [
        FaultConfig {
            fail_rate: 1.5,
            ..FaultConfig::default()
        },
        FaultConfig {
            fail_rate: -0.1,
            ..FaultConfig::default()
        },
        FaultConfig {
            fail_rate: f64::NAN,
            ..FaultConfig::default()
        },
        FaultConfig {
            delay: Duration::from_secs(100_000),
            ..FaultConfig::default()
        },
    ];
    for cfg in bad {
        let tcfg = TransportConfig {
            fault: Some(cfg.clone()),
            ..TransportConfig::default()
        };
        assert!(
            matches!(by_name("shm", &tcfg), Err(TransportError::Config(_))),
            "{cfg:?}"
        );
        // Built directly, the check happens at start.
        let inner = by_name("shm", &TransportConfig::default()).unwrap();
        let wrapped: Box<dyn Transport> = Box::new(FaultTransport::new(inner, cfg.clone()));
        assert_eq!(wrapped.kind(), "shm");
        assert_eq!(wrapped.local_descriptor(), Descriptor::None);
        let staging = Arc::new(StagingBuffer::new(1, 64).unwrap());
        assert!(
            matches!(wrapped.start(staging), Err(TransportError::Config(_))),
            "{cfg:?}"
        );
    }
}

#[test]
fn the_wrapper_passes_connect_errors_and_disconnect_through() {
    let mut rig = rig(2, 4, FaultConfig::default());
    let wrong = RemoteBuffer {
        descriptor: Descriptor::Tcp {
            addr: "127.0.0.1:9".into(),
            secret: None,
        },
        chunk_bytes: CHUNK,
        capacity_chunks: 2,
    };
    assert!(matches!(
        rig.poster.connect(&wrong),
        Err(TransportError::Unsupported { .. })
    ));
    rig.poster.disconnect(rig.peer);
    let op = rig.op(0);
    let done = rig.run(&[op]);
    assert_eq!(done[0].status(), CompletionStatus::UnknownPeer);
}
