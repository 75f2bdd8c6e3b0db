//! The sender's hot path allocates per request and per batch, never per
//! chunk (issue 15): a counting global allocator (this test binary's own)
//! counts every allocation of this process while requests of 4 and of 64
//! chunks (one in-place batch each) go through a real sender; the
//! receiver runs as a `kvferry receiver` child process so that its
//! allocations (key tables, per-chunk receive state) are not counted.
//! libzmq allocates with C++ `new`, outside Rust's allocator, so only
//! kvferry's own threads (caller, ctrl, poll, announcer, copy engine) are
//! counted. The assertion is on a count, never on a time.

#[path = "common/process.rs"]
mod process;

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use process::ChildProc;

use kvferry::sender::{RequestSpec, RequestStatus, Sender, SenderConfig};

/// Counts `alloc`, `alloc_zeroed` and `realloc` calls of every thread.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees hold; the counter has no effect on
// the memory returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // Relaxed: a statistic read after the threads it counts have
        // handed their results over (through the sender's waits).
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // Relaxed: as in `alloc`.
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Relaxed: as in `alloc`.
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");
const CHUNK: u64 = 4096;
/// Requests per measured phase.
const N: usize = 16;
/// Chunks per request in the two phases (one batch each).
const SMALL: usize = 4;
const LARGE: usize = 64;
/// Allocations a request may add for the larger batch: the few per-batch
/// buffers that spill from inline storage above 16 chunks (lengths, slot
/// set, key offsets, reply positions), not one per chunk.
const SLACK_PER_REQUEST: u64 = 16;
const WAIT: Duration = Duration::from_secs(30);

/// The receiver child, killed on drop (also when an assertion fails),
/// and its endpoint.
fn spawn_receiver() -> (ChildProc, String) {
    let mut child = ChildProc::spawn(
        Command::new(BIN)
            .args([
                "receiver",
                "--listen",
                "tcp://127.0.0.1:0",
                "--capacity-chunks",
                "256",
                "--chunk-bytes",
                &CHUNK.to_string(),
                "--consume",
            ])
            .stdin(Stdio::null())
            .stderr(Stdio::null()),
    );
    let endpoint = child
        .after_prefixes(&["kvferry receiver listening on "])
        .remove(0);
    (child, endpoint)
}

/// Runs one request of `keys.len()` chunks as one in-place batch and waits
/// for it (each wait has a deadline and names what hung).
fn one_request(sender: &Sender, endpoint: &str, id: &str, keys: &[String], lens: &[u32]) {
    let deadline = Instant::now() + WAIT;
    let req = sender
        .begin(RequestSpec::new(id, endpoint, keys.len()))
        .unwrap_or_else(|e| panic!("begin {id}: {e}"));
    let mut batch = req
        .stage(keys.len(), deadline)
        .unwrap_or_else(|e| panic!("stage {id}: {e}"));
    for (i, slot) in batch.slots_mut().enumerate() {
        slot.fill(i as u8);
    }
    batch
        .submit(keys, lens)
        .unwrap_or_else(|e| panic!("submit {id}: {e}"));
    let st = req.wait(deadline);
    assert_eq!(
        st,
        RequestStatus::Completed,
        "request {id} not completed within {WAIT:?}; sender: {:?}",
        sender.dump()
    );
}

/// Request ids and keys made before counting starts (the caller's strings
/// are not the sender's allocations).
struct Phase {
    ids: Vec<String>,
    keys: Vec<Vec<String>>,
    lens: Vec<u32>,
}

fn phase(name: &str, requests: usize, chunks: usize) -> Phase {
    let ids: Vec<String> = (0..requests).map(|r| format!("{name}-{r}")).collect();
    let keys = ids
        .iter()
        .map(|id| (0..chunks).map(|c| format!("{id}/{c}")).collect())
        .collect();
    Phase {
        ids,
        keys,
        lens: vec![CHUNK as u32; chunks],
    }
}

/// Allocations of this process while `p`'s requests run, one at a time.
fn count(sender: &Sender, endpoint: &str, p: &Phase) -> u64 {
    let before = ALLOCS.load(Ordering::Relaxed);
    for (id, keys) in p.ids.iter().zip(&p.keys) {
        one_request(sender, endpoint, id, keys, &p.lens);
    }
    ALLOCS.load(Ordering::Relaxed) - before
}

#[test]
fn sender_allocations_grow_with_requests_not_with_chunks() {
    let (_receiver, endpoint) = spawn_receiver();
    let sender = Sender::new(SenderConfig {
        chunk_bytes: CHUNK,
        staging_slots: LARGE,
        ..Default::default()
    })
    .expect("sender");
    // Warm-up: connect and say Hello, grow the tables and buffers that
    // keep their capacity.
    for p in [phase("warm-s", 8, SMALL), phase("warm-l", 8, LARGE)] {
        count(&sender, &endpoint, &p);
    }
    let small = phase("small", N, SMALL);
    let large = phase("large", N, LARGE);
    // Twice each, interleaved, and the least of each kept, so a one-off
    // (a table doubling, a late timer) in one run does not decide it.
    let mut a = u64::MAX;
    let mut b = u64::MAX;
    for round in 0..2 {
        let tag = |p: &Phase| Phase {
            ids: p.ids.iter().map(|i| format!("{i}-{round}")).collect(),
            keys: p
                .keys
                .iter()
                .map(|ks| ks.iter().map(|k| format!("{k}-{round}")).collect())
                .collect(),
            lens: p.lens.clone(),
        };
        let (s, l) = (tag(&small), tag(&large));
        a = a.min(count(&sender, &endpoint, &s));
        b = b.min(count(&sender, &endpoint, &l));
    }
    let extra_chunks = (N * (LARGE - SMALL)) as u64;
    eprintln!(
        "{N} requests: {a} allocations at {SMALL} chunks each, {b} at {LARGE} ({:.2} per request, {:.3} per extra chunk)",
        a as f64 / N as f64,
        b.saturating_sub(a) as f64 / extra_chunks as f64
    );
    assert!(
        b <= a + N as u64 * SLACK_PER_REQUEST,
        "allocations grow with chunks: {N} requests of {SMALL} chunks took {a}, of {LARGE} chunks {b} \
         ({} more for {extra_chunks} more chunks; allowed {} for the whole phase)",
        b.saturating_sub(a),
        N as u64 * SLACK_PER_REQUEST
    );
    sender.close(Instant::now() + WAIT);
}
