//! Writes straight from caller-registered memory: `Sender::register`,
//! `Request::write`, the `WriteHandle` reuse signal, `Sender::deregister`,
//! and every typed error. Bytes are checked at the receiver; every wait has
//! a deadline.
//!
//! Zero sender copies: each sender has ONE staging slot and writes batches
//! of 8 chunks. A staged or copied batch of 8 cannot exist with one slot
//! (`BatchTooLarge`), and the staging gauge stays 0 throughout, so the
//! bytes the receiver verifies can only have come from the registered
//! memory.

#[path = "common_sender/mod.rs"]
mod common_sender;

use std::time::Duration;

use common_sender::*;
use kvferry::sender::{
    MemoryRegion, RegisterError, RequestSpec, RequestStatus, Sender, StoreError,
};
use kvferry::transport::FaultConfig;
use memmap2::MmapMut;

const N: u32 = 8;

/// One chunk of a `Request::write`.
type Chunk<'a> = (&'a MemoryRegion, u64, u32);

/// Page-aligned caller memory of `chunks` chunk-sized parts.
fn memory(chunks: usize) -> MmapMut {
    MmapMut::map_anon(chunks * CHUNK as usize).expect("anonymous mapping")
}

/// Registers `mem` with `s`.
fn register(s: &Sender, mem: &MmapMut) -> MemoryRegion {
    // SAFETY: the mapping outlives every use of the region in these tests
    // (each test deregisters, or drops the sender, before the mapping), and
    // nothing writes a chunk while its write is in flight (tests refill only
    // after the write's handle is done).
    unsafe { s.register(mem.as_ptr(), mem.len()) }.expect("registers")
}

/// Fills part `i` of `mem` with chunk `i` of `request`; returns its length.
fn fill(mem: &mut MmapMut, request: u64, i: u32) -> u32 {
    let c = CHUNK as usize;
    let part = &mut mem[i as usize * c..(i as usize + 1) * c];
    payloads().fill_slice(chunk_id(request, i, N), part) as u32
}

/// Writes all `N` chunks of `request` from `region` in two batches; returns
/// the handles.
fn write_request(
    s: &Sender,
    r: &kvferry::receiver::Receiver,
    mem: &mut MmapMut,
    region: &MemoryRegion,
    req_id: &str,
    request: u64,
) -> kvferry::sender::Request {
    let lens: Vec<u32> = (0..N).map(|i| fill(mem, request, i)).collect();
    let req = s
        .begin(RequestSpec::new(req_id, r.endpoint(), N as usize))
        .unwrap();
    for half in [0..N / 2, N / 2..N] {
        let keys: Vec<String> = half.clone().map(|i| key(req_id, request, i, N)).collect();
        let chunks: Vec<(&MemoryRegion, u64, u32)> = half
            .map(|i| (region, u64::from(i) * CHUNK, lens[i as usize]))
            .collect();
        let h = req.write(&keys, &chunks, deadline()).expect("write posts");
        assert_eq!(s.staging_in_use(), 0, "a registered write takes no staging");
        assert!(
            h.wait(deadline()),
            "write of {req_id} done before the deadline"
        );
        assert_eq!(h.outcome(), Some(Ok(())), "every chunk of {req_id} landed");
    }
    req
}

fn zero_copy_round_trip(transport: &str) {
    let r = kvferry::receiver::Receiver::start(kvferry::receiver::ReceiverConfig {
        tcp_data: Some("127.0.0.1:0".parse().unwrap()),
        ..receiver_cfg(32)
    })
    .expect("receiver starts");
    let mut cfg = sender_cfg(1, None);
    cfg.transport = transport.into();
    let s = sender(cfg);
    let mut mem = memory(N as usize);
    let region = register(&s, &mem);
    // A copying batch of N chunks cannot even be staged with one slot.
    let probe = s
        .begin(RequestSpec::new("zc-probe", r.endpoint(), N as usize))
        .unwrap();
    let bytes = [1u8; 16];
    let chunks: Vec<&[u8]> = (0..N).map(|_| &bytes[..]).collect();
    let keys: Vec<String> = (0..N).map(|i| format!("zc-probe-{i}")).collect();
    assert!(matches!(
        probe.store(&keys, &chunks),
        Err(StoreError::BatchTooLarge {
            chunks: 8,
            slots: 1
        })
    ));
    probe.cancel();
    for (n, request) in [(0, 41u64), (1, 42)] {
        // The second request reuses the same memory once the first one's
        // handles said it may: refilled, the receiver sees the new bytes.
        let id = format!("zc-{transport}-{n}");
        let req = write_request(&s, &r, &mut mem, &region, &id, request);
        assert_eq!(req.wait(deadline()), RequestStatus::Completed);
        consume(&r, &id, request, N).unwrap();
    }
    assert_eq!(s.staging_in_use(), 0);
    s.deregister(&region).expect("nothing in flight");
    wait_sender_empty(&s, "after registered writes");
    wait_receiver_empty(&r, "after registered writes");
}

#[test]
fn registered_writes_land_byte_exact_over_shm_without_staging() {
    zero_copy_round_trip("shm");
}

#[test]
fn registered_writes_land_byte_exact_over_tcp_without_staging() {
    zero_copy_round_trip("tcp");
}

#[test]
fn memory_stays_busy_until_the_write_completes() {
    let r = receiver(16);
    let mut cfg = sender_cfg(1, None);
    // Every completion is held 2 s: deregister right after `write` returns
    // finds the write in flight (the test thread only needs to run within
    // those 2 s).
    cfg.transport_config.fault = Some(FaultConfig {
        delay: Duration::from_secs(2),
        ..FaultConfig::default()
    });
    let s = sender(cfg);
    let mut mem = memory(1);
    let region = register(&s, &mem);
    let c = CHUNK as usize;
    let len = payloads().fill_slice(chunk_id(5, 0, 1), &mut mem[..c]) as u32;
    let req = s
        .begin(RequestSpec::new("busy-0", r.endpoint(), 1))
        .unwrap();
    let h = req
        .write(&[key("busy-0", 5, 0, 1)], &[(&region, 0, len)], deadline())
        .unwrap();
    assert!(!h.is_done(), "the completion is held by the fault wrapper");
    assert!(matches!(
        s.deregister(&region),
        Err(RegisterError::Busy { in_flight: 1, .. })
    ));
    assert!(h.wait(deadline()), "done once the completion came");
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    consume(&r, "busy-0", 5, 1).unwrap();
    s.deregister(&region).expect("free after the completion");
    // Deregistered: writes from it are refused, as is a second deregister.
    let late = s
        .begin(RequestSpec::new("busy-1", r.endpoint(), 1))
        .unwrap();
    assert_eq!(
        late.write(&["k"], &[(&region, 0, 8)], deadline())
            .unwrap_err(),
        StoreError::RegionNotRegistered { index: 0 }
    );
    assert_eq!(
        s.deregister(&region),
        Err(RegisterError::NotRegistered { id: region.id() })
    );
    late.cancel();
}

/// A write the transport fails completes its handle with a typed error
/// (here every write fails: the fault wrapper, `Injected`), the request
/// fails, and the region is free again: `deregister_by` (which waits for
/// in-flight writes with a deadline) succeeds, and the memory can be
/// registered and written from again.
#[test]
fn a_failed_write_completes_its_handle_with_a_typed_error_and_frees_the_region() {
    use kvferry::sender::WriteError;
    use kvferry::transport::CompletionStatus;
    let r = receiver(16);
    let mut cfg = sender_cfg(1, None);
    cfg.transport_config.fault = Some(FaultConfig {
        fail_rate: 1.0,
        delay: Duration::from_millis(300),
        ..FaultConfig::default()
    });
    let s = sender(cfg);
    let mut mem = memory(1);
    let region = register(&s, &mem);
    let len = fill(&mut mem, 6, 0);
    let req = s
        .begin(RequestSpec::new("fail-0", r.endpoint(), 1))
        .unwrap();
    let h = req
        .write(&[key("fail-0", 6, 0, 1)], &[(&region, 0, len)], deadline())
        .unwrap();
    assert_eq!(h.outcome(), None, "in flight: the completion is held");
    // Still in flight: a deregister with a deadline that passes first is
    // refused, and changes nothing.
    assert!(matches!(
        s.deregister_by(
            &region,
            std::time::Instant::now() + Duration::from_millis(1)
        ),
        Err(RegisterError::Busy { in_flight: 1, .. })
    ));
    assert!(h.wait(deadline()));
    assert_eq!(
        h.outcome(),
        Some(Err(WriteError::Failed(CompletionStatus::Injected)))
    );
    assert!(matches!(req.wait(deadline()), RequestStatus::Failed { .. }));
    s.deregister_by(&region, deadline())
        .expect("the failed write no longer holds the region");
    let again = register(&s, &mem);
    s.deregister(&again).unwrap();
    wait_sender_empty(&s, "after a failed registered write");
}

/// A write whose every chunk the receiver already holds (dedup against a
/// ready copy) posts nothing and still ends `Ok`: nothing was left unwritten.
#[test]
fn a_write_the_receiver_fully_dedups_ends_ok() {
    let r = receiver(16);
    let s = sender(sender_cfg(1, None));
    let mut mem = memory(1);
    let region = register(&s, &mem);
    let len = fill(&mut mem, 7, 0);
    let k = key("dedup-0", 7, 0, 1);
    for id in ["dedup-0", "dedup-1"] {
        let req = s.begin(RequestSpec::new(id, r.endpoint(), 1)).unwrap();
        let h = req.write(&[&k], &[(&region, 0, len)], deadline()).unwrap();
        assert!(h.wait(deadline()));
        assert_eq!(h.outcome(), Some(Ok(())), "{id}");
        assert_eq!(req.wait(deadline()), RequestStatus::Completed, "{id}");
        r.wait_ready(id, deadline()).unwrap();
    }
    s.deregister(&region).unwrap();
}

#[test]
fn bad_registrations_are_typed_errors() {
    let s = sender(sender_cfg(1, None));
    let mem = memory(2);
    // SAFETY (all calls below): the mapping outlives the sender's use of it;
    // nothing is written from any region here.
    unsafe {
        assert_eq!(
            s.register(std::ptr::null(), 4096).unwrap_err(),
            RegisterError::Null
        );
        assert_eq!(
            s.register(mem.as_ptr(), 0).unwrap_err(),
            RegisterError::Empty
        );
        assert!(matches!(
            s.register(mem.as_ptr().add(1), 64).unwrap_err(),
            RegisterError::Unaligned { .. }
        ));
        let mut regions = Vec::new();
        for _ in 0..kvferry::staging::MAX_REGIONS {
            regions.push(s.register(mem.as_ptr(), mem.len()).unwrap());
        }
        assert_eq!(
            s.register(mem.as_ptr(), mem.len()).unwrap_err(),
            RegisterError::TooMany {
                max: kvferry::staging::MAX_REGIONS
            }
        );
        // A freed id is reused.
        s.deregister(&regions[3]).unwrap();
        let again = s.register(mem.as_ptr(), mem.len()).unwrap();
        assert_eq!(again.id(), regions[3].id());
    }
    // Another sender's region.
    let other = sender(sender_cfg(1, None));
    let theirs = register(&other, &mem);
    assert_eq!(
        s.deregister(&theirs),
        Err(RegisterError::ForeignRegion { id: theirs.id() })
    );
    drop(s);
    other.deregister(&theirs).unwrap();
}

#[test]
fn bad_writes_are_typed_errors_and_send_nothing() {
    let r = receiver(16);
    let s = sender(sender_cfg(1, None));
    let other = sender(sender_cfg(1, None));
    let mem = memory(2);
    let region = register(&s, &mem);
    let theirs = register(&other, &mem);
    let req = s.begin(RequestSpec::new("bad-0", r.endpoint(), 2)).unwrap();
    let two = ["a", "b"];
    let len = 2 * CHUNK as usize;
    let cases: Vec<(Vec<Chunk<'_>>, StoreError)> = vec![
        (
            vec![(&region, 0, 8)],
            StoreError::KeyCountMismatch { keys: 2, chunks: 1 },
        ),
        (
            vec![(&region, 0, CHUNK as u32), (&theirs, 0, 8)],
            StoreError::ForeignRegion { index: 1 },
        ),
        (
            vec![
                (&region, 0, CHUNK as u32),
                (&region, CHUNK, CHUNK as u32 + 1),
            ],
            StoreError::ChunkTooLarge {
                index: 1,
                len: CHUNK as usize + 1,
                max: CHUNK,
            },
        ),
        (
            vec![(&region, 0, 8), (&region, CHUNK, 8)],
            StoreError::ShortChunk {
                index: 0,
                len: 8,
                full: CHUNK,
            },
        ),
        (
            vec![(&region, CHUNK + 1, CHUNK as u32), (&region, 0, 8)],
            StoreError::OutsideRegion {
                index: 0,
                offset: CHUNK + 1,
                len: CHUNK as u32,
                region_len: len,
            },
        ),
        (
            vec![(&region, 0, CHUNK as u32), (&region, u64::MAX, 8)],
            StoreError::OutsideRegion {
                index: 1,
                offset: u64::MAX,
                len: 8,
                region_len: len,
            },
        ),
    ];
    for (chunks, want) in cases {
        assert_eq!(req.write(&two, &chunks, deadline()).unwrap_err(), want);
    }
    assert_eq!(s.staging_in_use(), 0);
    // Nothing was sent: the request still accepts its whole total.
    let h = req
        .write(
            &two,
            &[(&region, 0, CHUNK as u32), (&region, CHUNK, 8)],
            deadline(),
        )
        .unwrap();
    assert!(h.wait(deadline()));
    assert_eq!(req.wait(deadline()), RequestStatus::Completed);
    r.wait_ready("bad-0", deadline()).unwrap();
    drop((r.get("a"), r.get("b")));
    s.deregister(&region).unwrap();
    other.deregister(&theirs).unwrap();
}

#[test]
fn writes_wait_for_admission() {
    let r = receiver(2);
    let s = sender(sender_cfg(1, None));
    let mut mem = memory(2);
    let region = register(&s, &mem);
    // A filler takes the whole receive buffer, so the next request parks.
    let fill_req = write_one(&s, &r, &mut mem, &region, "adm-fill", 2);
    assert_eq!(fill_req.wait(deadline()), RequestStatus::Completed);
    let parked = s
        .begin(RequestSpec::new("adm-parked", r.endpoint(), 1))
        .unwrap();
    wait_for("adm-parked parked", || r.stats().core.parked_requests == 1);
    let soon = std::time::Instant::now() + Duration::from_millis(50);
    assert_eq!(
        parked.write(&["x"], &[(&region, 0, 8)], soon).unwrap_err(),
        StoreError::AdmissionTimeout,
        "no write is posted for a request the receiver has not admitted"
    );
    consume(&r, "adm-fill", 9, 2).unwrap();
    wait_for("adm-parked admitted", || parked.is_admitted());
    parked.cancel();
    assert_eq!(parked.wait(deadline()), RequestStatus::Cancelled);
    s.deregister(&region).unwrap();
}

/// One request of `total` chunks (request number 9) written from `region`.
fn write_one(
    s: &Sender,
    r: &kvferry::receiver::Receiver,
    mem: &mut MmapMut,
    region: &MemoryRegion,
    req_id: &str,
    total: u32,
) -> kvferry::sender::Request {
    let c = CHUNK as usize;
    let mut chunks = Vec::new();
    for i in 0..total {
        let part = &mut mem[i as usize * c..(i as usize + 1) * c];
        let len = payloads().fill_slice(chunk_id(9, i, total), part) as u32;
        chunks.push((region, u64::from(i) * CHUNK, len));
    }
    let keys: Vec<String> = (0..total).map(|i| key(req_id, 9, i, total)).collect();
    let req = s
        .begin(RequestSpec::new(req_id, r.endpoint(), total as usize))
        .unwrap();
    let h = req.write(&keys, &chunks, deadline()).unwrap();
    assert!(h.wait(deadline()));
    req
}
