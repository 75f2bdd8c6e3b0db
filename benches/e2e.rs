//! Sender and receiver end to end, each bench against a baseline in the same
//! run (ratios are what to read; the machine is a shared, noisy 2-vCPU VM).
//!
//! `cargo bench --bench e2e -- --warm-up-time 1 --measurement-time 3`
//!
//! 1. `e2e_shm/{4,64,256}KiB`: payload throughput of the whole engine
//!    (`Sender::store` → AllocRequest/AllocResponse over ZMQ → shm copy engine
//!    → receiver buffer → TransferDone; the receiver runs with `auto_consume`)
//!    for requests of 16 chunks stored in batches of 4, 4 requests in flight,
//!    vs a plain single-thread memcpy of the same bytes (and, for context,
//!    two memcpys: the fewest copies the shm design makes). Two store patterns:
//!    `store_all` (the 4 batches of a request back to back) and
//!    `first_batch_ahead` (the first batch of request i+1 is stored before
//!    the remaining batches of request i, so those find their request
//!    already admitted). Then `in_place` / `in_place_copied` (staging
//!    filled in place) and `registered` (`Request::write` straight from
//!    memory registered with `Sender::register`: one copy, the engine's).
//! 2. `alloc_rtt`: one AllocRequest (1 key, anonymous `req_id = ""`) through a
//!    real `Receiver` from a raw ZMQ DEALER, reply decoded, key released with
//!    `Receiver::remove` (the receiver's state stays flat) vs a raw ZMQ
//!    DEALER/ROUTER ping-pong of the same request and reply bytes, both over
//!    tcp loopback.
//! 3. `alloc_pipelined`: 256 AllocRequests per iteration against the same
//!    receiver, 32 in flight matched by `seq`, vs one at a time (LMCache's
//!    per-receiver lock).
//! 4. After criterion's groups (only under `cargo bench`; skip both with
//!    `KVFERRY_E2E_SKIP_EXTRA=1`): benches 2 and 3 again with the two sides
//!    interleaved sample by sample (medians; robust to the VM's load
//!    spikes), then CPU seconds per GiB moved for bench 1's
//!    `first_batch_ahead` pattern over 2 GiB per chunk size, from
//!    `getrusage(RUSAGE_SELF)` (every thread of the process: caller, sender
//!    ctrl/poll, copy engine, receiver ctrl, ZMQ I/O), next to a memcpy of the
//!    same 2 GiB, with a per-thread breakdown from `/proc/self/task`.

mod common;

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{memcpy_chunks, page_aligned};
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use kvferry::protocol::{decode, encode, AllocRequest, AllocResponse, Message};
use kvferry::receiver::bounds::Bounds;
use kvferry::receiver::{Receiver, ReceiverConfig};
use kvferry::sender::{
    MemoryRegion, Request, RequestSpec, RequestStatus, Sender, SenderConfig, TransferSpec,
};

/// Payload bytes moved per criterion iteration of bench 1.
const BYTES_PER_ITER: usize = 32 << 20;
/// Chunks per request.
const CHUNKS_PER_REQ: usize = 16;
/// Chunks per `store` call.
const BATCH: usize = 4;
/// Requests in flight (stored, not yet waited for).
const WINDOW: usize = 4;
/// Deadline of every wait in the benches.
const WAIT: Duration = Duration::from_secs(20);
/// Chunk sizes of bench 1.
const CHUNK_SIZES: [usize; 3] = [4 << 10, 64 << 10, 256 << 10];
/// Bytes moved per chunk size in the CPU-per-GiB section.
const CPU_BYTES: usize = 2 << 30;
/// Slices the CPU-per-GiB transfer is timed in.
const CPU_SLICES: usize = 8;

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn unique(prefix: &str) -> String {
    // Relaxed: only distinct numbers are needed.
    format!("{prefix}-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed))
}

// ----- bench 1: shm end to end ------------------------------------------------

/// How the caller hands a request's batches over.
#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// The 4 batches of a request back to back.
    StoreAll,
    /// The first batch of request i+1 before batches 2..4 of request i.
    FirstBatchAhead,
    /// `Sender::begin` (request i+1 begun while request i is filled), then
    /// each batch staged in place (`Request::stage` → `submit`). The caller
    /// writes only a 16-byte header per slot, standing for a device DMA
    /// into the slot: the only CPU copy of the bulk bytes is the copy
    /// engine's, as a GPU → staging transfer would leave it.
    InPlace,
    /// As `InPlace`, but the caller fills each slot with a memcpy from its
    /// own buffer (a CPU producer: the same two copies as `store` of an
    /// admitted request, without the pending area).
    InPlaceCopied,
    /// `Sender::begin` as in `InPlace`, then each batch written straight
    /// from the caller's source bytes, registered once with
    /// `Sender::register` (`Request::write`): no staging, the copy engine's
    /// copy is the only one.
    Registered,
}

/// One sender and one receiver (auto_consume) on this host, plus the
/// caller's source bytes.
struct E2e {
    sender: Sender,
    receiver: Receiver,
    chunk: usize,
    /// Page-aligned (an anonymous mapping), registered as `region`.
    src: memmap2::MmapMut,
    region: MemoryRegion,
}

impl E2e {
    fn new(chunk: usize) -> Self {
        let receiver = Receiver::start(ReceiverConfig {
            receiver_id: unique("bench-recv"),
            capacity_chunks: 256,
            chunk_bytes: chunk as u64,
            auto_consume: true,
            ..ReceiverConfig::default()
        })
        .expect("bench: receiver starts");
        let sender = Sender::new(SenderConfig {
            sender_id: unique("bench-send"),
            staging_slots: 64,
            chunk_bytes: chunk as u64,
            staging_timeout: WAIT,
            reply_timeout: WAIT,
            ..SenderConfig::default()
        })
        .expect("bench: sender starts");
        let src = patterned(BYTES_PER_ITER);
        // SAFETY: `src` lives in the same struct as `sender` and is declared
        // after it, so it is dropped after the sender (which stops every
        // transport read); it is never written after this point.
        let region = unsafe { sender.register(src.as_ptr(), src.len()) }
            .expect("bench: registers the source bytes");
        let e = Self {
            sender,
            receiver,
            chunk,
            src,
            region,
        };
        // Handshake (Hello/HelloAck, shm mapping) outside any measurement.
        e.run(CHUNKS_PER_REQ * chunk, Pattern::StoreAll);
        e
    }

    fn store_batch(&self, req: &str, part: usize, r: usize) {
        let base = r * CHUNKS_PER_REQ * self.chunk;
        let spec = TransferSpec::new(
            req,
            self.receiver.endpoint(),
            CHUNKS_PER_REQ,
            (part + 1) * BATCH == CHUNKS_PER_REQ,
        );
        let first = part * BATCH;
        let keys: Vec<String> = (first..first + BATCH)
            .map(|i| format!("{req}/{i}"))
            .collect();
        let chunks: Vec<&[u8]> = (first..first + BATCH)
            .map(|i| &self.src[base + i * self.chunk..base + (i + 1) * self.chunk])
            .collect();
        if let Err(e) = self.sender.store(&spec, &keys, &chunks) {
            panic!("bench: store of {req} batch {part} failed: {e}");
        }
    }

    /// Stages batch `part` of request `r` in place and submits it.
    fn stage_batch(&self, req: &Request, part: usize, r: usize, copy: bool) {
        let base = r * CHUNKS_PER_REQ * self.chunk;
        let first = part * BATCH;
        let mut batch = req
            .stage(BATCH, Instant::now() + WAIT)
            .unwrap_or_else(|e| panic!("bench: stage of {} batch {part} failed: {e}", req.id()));
        for (k, slot) in batch.slots_mut().enumerate() {
            let i = first + k;
            if copy {
                slot[..self.chunk]
                    .copy_from_slice(&self.src[base + i * self.chunk..base + (i + 1) * self.chunk]);
            } else {
                slot[..8].copy_from_slice(&(r as u64).to_le_bytes());
                slot[8..16].copy_from_slice(&(i as u64).to_le_bytes());
            }
        }
        let keys: Vec<String> = (first..first + BATCH)
            .map(|i| format!("{}/{i}", req.id()))
            .collect();
        let lens = [self.chunk as u32; BATCH];
        if let Err(e) = batch.submit(&keys, &lens) {
            panic!("bench: submit of {} batch {part} failed: {e}", req.id());
        }
    }

    /// Writes batch `part` of request `r` straight from the registered
    /// source bytes.
    fn write_batch(&self, req: &Request, part: usize, r: usize) {
        let base = r * CHUNKS_PER_REQ * self.chunk;
        let first = part * BATCH;
        let keys: Vec<String> = (first..first + BATCH)
            .map(|i| format!("{}/{i}", req.id()))
            .collect();
        let chunks: Vec<(&MemoryRegion, u64, u32)> = (first..first + BATCH)
            .map(|i| {
                (
                    &self.region,
                    (base + i * self.chunk) as u64,
                    self.chunk as u32,
                )
            })
            .collect();
        // The source is never rewritten, so its handle need not be awaited.
        if let Err(e) = req.write(&keys, &chunks, Instant::now() + WAIT) {
            panic!("bench: write of {} batch {part} failed: {e}", req.id());
        }
    }

    fn begin(&self, req: &str) -> Request {
        self.sender
            .begin(RequestSpec::new(
                req,
                self.receiver.endpoint(),
                CHUNKS_PER_REQ,
            ))
            .unwrap_or_else(|e| panic!("bench: begin {req}: {e}"))
    }

    /// The in-place patterns: `WINDOW` requests in flight, the next one
    /// begun while the current one is filled.
    fn run_in_place(&self, bytes: usize, pattern: Pattern) {
        let per_req = CHUNKS_PER_REQ * self.chunk;
        let in_src = self.src.len() / per_req;
        let n = bytes / per_req;
        let batches = CHUNKS_PER_REQ / BATCH;
        let mut begun: VecDeque<Request> = VecDeque::with_capacity(2);
        let mut inflight: VecDeque<Request> = VecDeque::with_capacity(WINDOW + 1);
        for r in 0..n {
            while begun.len() < 2 && r + begun.len() < n {
                begun.push_back(self.begin(&unique("e2e-ip")));
            }
            let Some(req) = begun.pop_front() else { break };
            for part in 0..batches {
                match pattern {
                    Pattern::Registered => self.write_batch(&req, part, r % in_src),
                    p => self.stage_batch(
                        &req,
                        part,
                        r % in_src,
                        matches!(p, Pattern::InPlaceCopied),
                    ),
                }
            }
            inflight.push_back(req);
            if inflight.len() >= WINDOW {
                if let Some(done) = inflight.pop_front() {
                    self.wait_req(&done);
                }
            }
        }
        for req in inflight {
            self.wait_req(&req);
        }
    }

    fn wait_req(&self, req: &Request) {
        match req.wait(Instant::now() + WAIT) {
            RequestStatus::Completed => {}
            other => panic!(
                "bench: request {} not completed within {WAIT:?}: {other:?}; sender state: {:?}",
                req.id(),
                self.sender.dump()
            ),
        }
    }

    fn wait(&self, req: &str) {
        match self.sender.wait(req, Instant::now() + WAIT) {
            Some(RequestStatus::Completed) => {}
            other => panic!(
                "bench: request {req} not completed within {WAIT:?}: {other:?}; sender state: {:?}; receiver: {:?}",
                self.sender.dump(),
                self.receiver.stats()
            ),
        }
    }

    /// Waits (with a deadline) until the receiver has consumed every chunk:
    /// `Sender::wait` returns before the receiver has read the TransferDone.
    fn assert_drained(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            let st = self.receiver.stats();
            if (st.allocated_chunks, st.reserved_chunks) == (0, 0) {
                return;
            }
            if Instant::now() >= deadline {
                panic!("bench: receiver still holds chunks {WAIT:?} after the run: {st:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Moves `bytes` (a multiple of one request) as requests of 16 chunks,
    /// `WINDOW` in flight, and waits for all of them.
    fn run(&self, bytes: usize, pattern: Pattern) {
        match pattern {
            Pattern::StoreAll => self.run_stored(bytes, false),
            Pattern::FirstBatchAhead => self.run_stored(bytes, true),
            Pattern::InPlace | Pattern::InPlaceCopied | Pattern::Registered => {
                self.run_in_place(bytes, pattern)
            }
        }
    }

    /// The `store` patterns (`first_ahead`: `FirstBatchAhead`).
    fn run_stored(&self, bytes: usize, first_ahead: bool) {
        let per_req = CHUNKS_PER_REQ * self.chunk;
        let in_src = self.src.len() / per_req;
        let n = bytes / per_req;
        let batches = CHUNKS_PER_REQ / BATCH;
        let ids: Vec<String> = (0..n).map(|_| unique("e2e")).collect();
        let mut inflight: VecDeque<usize> = VecDeque::with_capacity(WINDOW + 1);
        for r in 0..n {
            if first_ahead {
                if r == 0 {
                    self.store_batch(&ids[0], 0, 0);
                }
                if r + 1 < n {
                    self.store_batch(&ids[r + 1], 0, (r + 1) % in_src);
                }
                for part in 1..batches {
                    self.store_batch(&ids[r], part, r % in_src);
                }
            } else {
                for part in 0..batches {
                    self.store_batch(&ids[r], part, r % in_src);
                }
            }
            inflight.push_back(r);
            if inflight.len() >= WINDOW {
                if let Some(done) = inflight.pop_front() {
                    self.wait(&ids[done]);
                }
            }
        }
        for r in inflight {
            self.wait(&ids[r]);
        }
    }
}

/// A [`page_aligned`] buffer of `len` bytes holding the bench's source
/// pattern (byte `i` is `i * 31 % 251`: no page alike, none zero-filled).
fn patterned(len: usize) -> memmap2::MmapMut {
    let mut m = page_aligned(len, 0);
    for (i, b) in m.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    m
}

fn bench_e2e(c: &mut Criterion) {
    for chunk in CHUNK_SIZES {
        let e = E2e::new(chunk);
        let mut dst = page_aligned(BYTES_PER_ITER, 0);
        let mut group = c.benchmark_group(format!("e2e_shm/{}KiB", chunk >> 10));
        group.throughput(Throughput::Bytes(BYTES_PER_ITER as u64));
        group.sample_size(10);
        group.bench_function(BenchmarkId::new("memcpy", "1 thread"), |b| {
            b.iter(|| memcpy_chunks(&e.src, &mut dst, chunk))
        });
        // The fewest copies the shm design needs (caller → staging, staging →
        // receive buffer), for context.
        let mut mid = page_aligned(BYTES_PER_ITER, 0);
        group.bench_function(BenchmarkId::new("memcpy_twice", "1 thread"), |b| {
            b.iter(|| {
                memcpy_chunks(&e.src, &mut mid, chunk);
                memcpy_chunks(&mid, &mut dst, chunk);
            })
        });
        group.bench_function(BenchmarkId::new("kvferry", "store_all"), |b| {
            b.iter(|| e.run(BYTES_PER_ITER, Pattern::StoreAll))
        });
        group.bench_function(BenchmarkId::new("kvferry", "first_batch_ahead"), |b| {
            b.iter(|| e.run(BYTES_PER_ITER, Pattern::FirstBatchAhead))
        });
        group.bench_function(BenchmarkId::new("kvferry", "in_place"), |b| {
            b.iter(|| e.run(BYTES_PER_ITER, Pattern::InPlace))
        });
        group.bench_function(BenchmarkId::new("kvferry", "in_place_copied"), |b| {
            b.iter(|| e.run(BYTES_PER_ITER, Pattern::InPlaceCopied))
        });
        group.bench_function(BenchmarkId::new("kvferry", "registered"), |b| {
            b.iter(|| e.run(BYTES_PER_ITER, Pattern::Registered))
        });
        group.finish();
        e.assert_drained();
    }
}

// ----- benches 2 and 3: AllocRequest round trips -------------------------------

/// Receive-buffer slot size for the control-plane benches.
const CTRL_CHUNK: u64 = 4096;

/// An anonymous 1-key AllocRequest, as a kvferry sender would encode it.
fn alloc_request(key: &str, seq: u64) -> Vec<u8> {
    encode(&Message::AllocRequest(AllocRequest {
        keys: vec![key.to_owned()],
        fmt: 0,
        shape: vec![CTRL_CHUNK as i64],
        dtype: "uint8".into(),
        last_chunk_toks: CTRL_CHUNK as i64,
        req_id: String::new(),
        is_last_batch: true,
        total_chunks: 1,
        seq: Some(seq),
    }))
}

/// A raw DEALER client on its own ZMQ context; every receive has a deadline.
fn dealer(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    let s = ctx.socket(zmq::DEALER).expect("bench: dealer socket");
    s.set_linger(0).expect("linger");
    s.set_rcvtimeo(WAIT.as_millis() as i32).expect("rcvtimeo");
    s.set_sndhwm(0).expect("sndhwm");
    s.set_rcvhwm(0).expect("rcvhwm");
    s.connect(endpoint).expect("bench: dealer connects");
    s
}

/// Receives one reply and decodes it as an AllocResponse.
fn recv_reply(s: &zmq::Socket, what: &str) -> AllocResponse {
    let frames = match s.recv_multipart(0) {
        Ok(f) => f,
        Err(e) => panic!("bench: no reply from the {what} within {WAIT:?}: {e}"),
    };
    let payload = frames.last().map(Vec::as_slice).unwrap_or(&[]);
    match decode(payload) {
        Ok(Message::AllocResponse(r)) => r,
        other => panic!("bench: unexpected reply from the {what}: {other:?}"),
    }
}

/// Baseline server: a raw ROUTER on its own context that answers every
/// message with the same reply bytes.
struct PingPong {
    endpoint: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PingPong {
    fn start(reply: Vec<u8>) -> Self {
        let ctx = zmq::Context::new();
        let s = ctx.socket(zmq::ROUTER).expect("bench: router socket");
        s.set_linger(0).expect("linger");
        s.set_rcvtimeo(50).expect("rcvtimeo");
        s.set_sndhwm(0).expect("sndhwm");
        s.set_rcvhwm(0).expect("rcvhwm");
        s.bind("tcp://127.0.0.1:0").expect("bench: router binds");
        let endpoint = s
            .get_last_endpoint()
            .expect("endpoint")
            .expect("utf-8 endpoint");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let _ctx = ctx;
            // Relaxed: a stop flag; the join below synchronises the rest.
            while !flag.load(Ordering::Relaxed) {
                match s.recv_multipart(0) {
                    Ok(frames) => {
                        let id = &frames[0];
                        s.send_multipart([id.as_slice(), &[], reply.as_slice()], 0)
                            .expect("bench: pong sent");
                    }
                    Err(zmq::Error::EAGAIN) => {}
                    Err(e) => panic!("bench: ping-pong server: {e}"),
                }
            }
        });
        Self {
            endpoint,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for PingPong {
    fn drop(&mut self) {
        // Relaxed: see the loop.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ctrl_receiver() -> Receiver {
    Receiver::start(ReceiverConfig {
        receiver_id: unique("bench-ctrl-recv"),
        capacity_chunks: 64,
        chunk_bytes: CTRL_CHUNK,
        // Every request of these benches is anonymous (LMCache's untracked
        // path): each keeps a ~110-byte record for its lifetime (120 s; no
        // TransferDone ends it), so the default 16 MiB record bound answers
        // `overloaded` after ~150,000 of them (~600 iterations of
        // `alloc_pipelined`). The benches measure the control path, not
        // that bound.
        bounds: Bounds {
            max_ended_bytes: 1 << 30,
            ..Bounds::default()
        },
        ..ReceiverConfig::default()
    })
    .expect("bench: receiver starts")
}

fn bench_alloc_rtt(c: &mut Criterion) {
    let receiver = ctrl_receiver();
    let client_ctx = zmq::Context::new();
    let key = "rtt-key";
    let req = alloc_request(key, 1);
    // The kvferry reply to this request, byte for byte, for the baseline.
    let to_kvferry = dealer(&client_ctx, receiver.endpoint());
    to_kvferry.send_multipart([&[][..], &req], 0).expect("send");
    let first = recv_reply(&to_kvferry, "receiver");
    assert!(!first.is_failure(), "bench: allocation failed: {first:?}");
    assert!(receiver.remove(key), "bench: key not held after the reply");
    let pong = encode(&Message::AllocResponse(first));
    let server = PingPong::start(pong);
    let to_pingpong = dealer(&client_ctx, &server.endpoint);

    let mut group = c.benchmark_group("alloc_rtt");
    group.sample_size(20);
    group.throughput(Throughput::Elements(1));
    group.bench_function(
        BenchmarkId::new("receiver", "anonymous 1 key + remove"),
        |b| {
            b.iter(|| {
                to_kvferry.send_multipart([&[][..], &req], 0).expect("send");
                let r = recv_reply(&to_kvferry, "receiver");
                if r.is_failure() {
                    panic!("bench: allocation failed: {r:?}");
                }
                if !receiver.remove(key) {
                    panic!("bench: key {key} not held after its reply");
                }
            })
        },
    );
    group.bench_function(
        BenchmarkId::new("zmq_ping_pong", format!("{} B", req.len())),
        |b| {
            b.iter(|| {
                to_pingpong
                    .send_multipart([&[][..], &req], 0)
                    .expect("send");
                let r = recv_reply(&to_pingpong, "ping-pong server");
                black_box(r);
            })
        },
    );
    group.finish();
    let st = receiver.stats();
    assert_eq!(st.allocated_chunks, 0, "bench: state not flat: {st:?}");
}

/// AllocRequests per iteration of bench 3.
const PIPELINE_REQS: usize = 256;
/// Distinct keys (and seqs) cycled through; more than twice the window.
const PIPELINE_KEYS: usize = 64;

/// Sends `PIPELINE_REQS` anonymous AllocRequests with at most `window`
/// unanswered, matching replies by `seq` and releasing each key on reply.
fn pipelined(
    s: &zmq::Socket,
    receiver: &Receiver,
    reqs: &[Vec<u8>],
    keys: &[String],
    window: usize,
) {
    let mut in_flight: HashMap<u64, usize> = HashMap::with_capacity(window);
    let mut sent = 0;
    let mut answered = 0;
    while answered < PIPELINE_REQS {
        while sent < PIPELINE_REQS && in_flight.len() < window {
            let k = sent % PIPELINE_KEYS;
            s.send_multipart([&[][..], &reqs[k]], 0).expect("send");
            in_flight.insert(k as u64, k);
            sent += 1;
        }
        let r = recv_reply(s, "receiver");
        let seq = r.seq.expect("bench: reply without seq");
        let Some(k) = in_flight.remove(&seq) else {
            panic!("bench: reply for seq {seq}, which is not in flight");
        };
        if r.is_failure() {
            panic!("bench: allocation failed: {r:?}");
        }
        if !receiver.remove(&keys[k]) {
            panic!("bench: key {} not held after its reply", keys[k]);
        }
        answered += 1;
    }
}

fn bench_alloc_pipelined(c: &mut Criterion) {
    let receiver = ctrl_receiver();
    let ctx = zmq::Context::new();
    let s = dealer(&ctx, receiver.endpoint());
    let keys: Vec<String> = (0..PIPELINE_KEYS).map(|k| format!("pipe-{k}")).collect();
    let reqs: Vec<Vec<u8>> = keys
        .iter()
        .enumerate()
        .map(|(k, key)| alloc_request(key, k as u64))
        .collect();
    pipelined(&s, &receiver, &reqs, &keys, 1);

    let mut group = c.benchmark_group("alloc_pipelined");
    group.sample_size(20);
    group.throughput(Throughput::Elements(PIPELINE_REQS as u64));
    group.bench_function(BenchmarkId::new("one_at_a_time", "window 1"), |b| {
        b.iter(|| pipelined(&s, &receiver, &reqs, &keys, 1))
    });
    group.bench_function(BenchmarkId::new("pipelined", "window 32"), |b| {
        b.iter(|| pipelined(&s, &receiver, &reqs, &keys, 32))
    });
    group.finish();
    let st = receiver.stats();
    assert_eq!(st.allocated_chunks, 0, "bench: state not flat: {st:?}");
}

// ----- bench 4: CPU seconds per GiB ---------------------------------------------

/// User + system CPU time of the whole process.
fn process_cpu() -> Duration {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage; RUSAGE_SELF is a valid `who`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "bench: getrusage failed");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU ticks (user + system) per thread of this process, by tid, with the
/// thread's name.
fn thread_cpu() -> HashMap<u64, (String, u64)> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        let path = entry.path();
        let name = std::fs::read_to_string(path.join("comm"))
            .unwrap_or_default()
            .trim()
            .to_owned();
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue;
        };
        // Fields after the ")" that closes the name: state is field 3, utime
        // and stime are fields 14 and 15.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = f
            .get(11)
            .and_then(|u| u.parse::<u64>().ok())
            .zip(f.get(12).and_then(|s| s.parse::<u64>().ok()))
            .map_or(0, |(u, s)| u + s);
        out.insert(tid, (name, ticks));
    }
    out
}

/// Per thread-role CPU seconds between two `thread_cpu` snapshots.
fn thread_breakdown(
    before: &HashMap<u64, (String, u64)>,
    after: &HashMap<u64, (String, u64)>,
    main_tid: u64,
) -> Vec<(String, f64)> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // libzmq's I/O threads are unnamed here: they carry the process's name.
    let process_name = std::fs::read_to_string("/proc/self/comm")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let mut roles: HashMap<String, f64> = HashMap::new();
    for (tid, (name, ticks)) in after {
        let was = before.get(tid).map_or(0, |(_, t)| *t);
        let role = if *tid == main_tid {
            "caller (bench thread)".to_owned()
        } else if name.starts_with("ZMQbg") || *name == process_name {
            "zmq I/O threads".to_owned()
        } else {
            // Drop the per-instance suffix of kvferry's thread names.
            ["kvf-send-ctrl", "kvf-send-poll", "kvf-recv-ctrl"]
                .iter()
                .find(|p| name.starts_with(*p))
                .map_or_else(|| name.clone(), |p| (*p).to_owned())
        };
        *roles.entry(role).or_default() += ticks.saturating_sub(was) as f64 / hz;
    }
    let mut v: Vec<(String, f64)> = roles.into_iter().filter(|(_, s)| *s > 0.0).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

fn cpu_per_gib() {
    let gib = CPU_BYTES as f64 / f64::from(1u32 << 30);
    // SAFETY: gettid has no preconditions.
    let main_tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
    println!(
        "\ncpu_per_gib: CPU seconds (user+sys, whole process) per GiB moved; {gib} GiB per row"
    );
    println!("| case | wall (s) | GiB/s | CPU (s) | CPU s/GiB | CPU / wall |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let row = |name: &str, wall: Duration, cpu: Duration| {
        println!(
            "| {name} | {:.3} | {:.2} | {:.3} | {:.3} | {:.2} |",
            wall.as_secs_f64(),
            gib / wall.as_secs_f64(),
            cpu.as_secs_f64(),
            cpu.as_secs_f64() / gib,
            cpu.as_secs_f64() / wall.as_secs_f64()
        );
    };
    {
        let src = patterned(BYTES_PER_ITER);
        let mut dst = page_aligned(BYTES_PER_ITER, 0);
        memcpy_chunks(&src, &mut dst, 256 << 10);
        let (c0, t0) = (process_cpu(), Instant::now());
        for _ in 0..CPU_BYTES / BYTES_PER_ITER {
            memcpy_chunks(&src, &mut dst, 256 << 10);
        }
        row("memcpy, 1 thread", t0.elapsed(), process_cpu() - c0);
    }
    let mut breakdowns = Vec::new();
    let mut slice_times = Vec::new();
    for chunk in CHUNK_SIZES {
        let e = E2e::new(chunk);
        let before = thread_cpu();
        let (c0, t0) = (process_cpu(), Instant::now());
        // In slices, to see whether the rate changes as requests accumulate.
        let mut slices = Vec::with_capacity(CPU_SLICES);
        for _ in 0..CPU_SLICES {
            let ts = Instant::now();
            e.run(CPU_BYTES / CPU_SLICES, Pattern::FirstBatchAhead);
            slices.push(ts.elapsed());
        }
        let (wall, cpu) = (t0.elapsed(), process_cpu() - c0);
        slice_times.push((chunk, slices));
        let after = thread_cpu();
        row(
            &format!("kvferry e2e shm, {} KiB chunks", chunk >> 10),
            wall,
            cpu,
        );
        breakdowns.push((chunk, thread_breakdown(&before, &after, main_tid)));
        // The in-place path (header-only fill: the bulk bytes' one CPU copy
        // is the copy engine's).
        let (c0, t0) = (process_cpu(), Instant::now());
        e.run(CPU_BYTES, Pattern::InPlace);
        row(
            &format!("kvferry e2e shm in place, {} KiB chunks", chunk >> 10),
            t0.elapsed(),
            process_cpu() - c0,
        );
    }
    println!("\nper-thread CPU seconds (from /proc/self/task, 1/CLK_TCK resolution):");
    for (chunk, b) in breakdowns {
        let parts: Vec<String> = b.iter().map(|(n, s)| format!("{n} {s:.2}")).collect();
        println!("  {} KiB: {}", chunk >> 10, parts.join(", "));
    }
    println!(
        "\nwall ms per {} MiB slice, in order (requests so far grow by {} per slice at 4 KiB):",
        (CPU_BYTES / CPU_SLICES) >> 20,
        CPU_BYTES / CPU_SLICES / (CHUNKS_PER_REQ * (4 << 10))
    );
    for (chunk, slices) in slice_times {
        let ms: Vec<String> = slices
            .iter()
            .map(|d| format!("{:.0}", d.as_secs_f64() * 1e3))
            .collect();
        println!("  {} KiB: {}", chunk >> 10, ms.join(" "));
    }
}

/// Median and 90th percentile of a sample, in microseconds.
fn median_p90(v: &mut [Duration]) -> (f64, f64) {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.9))
}

/// Benches 2 and 3 again, with the two sides interleaved sample by sample,
/// so load spikes on the shared VM hit both alike; medians compared.
fn paired_ctrl() {
    const RTT_PAIRS: usize = 20_000;
    const PIPE_PAIRS: usize = 60;
    let receiver = ctrl_receiver();
    let ctx = zmq::Context::new();
    let key = "paired-key";
    let req = alloc_request(key, 1);
    let to_kvferry = dealer(&ctx, receiver.endpoint());
    to_kvferry.send_multipart([&[][..], &req], 0).expect("send");
    let first = recv_reply(&to_kvferry, "receiver");
    assert!(receiver.remove(key), "bench: key not held after the reply");
    let server = PingPong::start(encode(&Message::AllocResponse(first)));
    let to_pingpong = dealer(&ctx, &server.endpoint);
    let (mut base, mut kvf) = (Vec::with_capacity(RTT_PAIRS), Vec::with_capacity(RTT_PAIRS));
    for _ in 0..RTT_PAIRS {
        let t = Instant::now();
        to_pingpong
            .send_multipart([&[][..], &req], 0)
            .expect("send");
        black_box(recv_reply(&to_pingpong, "ping-pong server"));
        base.push(t.elapsed());
        let t = Instant::now();
        to_kvferry.send_multipart([&[][..], &req], 0).expect("send");
        let r = recv_reply(&to_kvferry, "receiver");
        if r.is_failure() || !receiver.remove(key) {
            panic!("bench: paired allocation failed: {r:?}");
        }
        kvf.push(t.elapsed());
    }
    let mean = |v: &[Duration]| v.iter().sum::<Duration>().as_secs_f64() * 1e6 / v.len() as f64;
    let (bm, km) = (mean(&base), mean(&kvf));
    let (b50, b90) = median_p90(&mut base);
    let (k50, k90) = median_p90(&mut kvf);
    // The same, each side back to back (as criterion runs them), in blocks.
    let (mut base_b2b, mut kvf_b2b) = (Vec::new(), Vec::new());
    for _ in 0..RTT_PAIRS / 1000 {
        for _ in 0..500 {
            let t = Instant::now();
            to_pingpong
                .send_multipart([&[][..], &req], 0)
                .expect("send");
            black_box(recv_reply(&to_pingpong, "ping-pong server"));
            base_b2b.push(t.elapsed());
        }
        for _ in 0..500 {
            let t = Instant::now();
            to_kvferry.send_multipart([&[][..], &req], 0).expect("send");
            let r = recv_reply(&to_kvferry, "receiver");
            if r.is_failure() || !receiver.remove(key) {
                panic!("bench: paired allocation failed: {r:?}");
            }
            kvf_b2b.push(t.elapsed());
        }
    }
    let (bbm, kbm) = (mean(&base_b2b), mean(&kvf_b2b));
    let (bb50, bb90) = median_p90(&mut base_b2b);
    let (kb50, kb90) = median_p90(&mut kvf_b2b);
    println!("\npaired (interleaved) AllocRequest round trip, {RTT_PAIRS} pairs:");
    println!("| case | median (us) | p90 (us) | mean (us) |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| zmq DEALER/ROUTER ping-pong, {} B | {b50:.1} | {b90:.1} | {bm:.1} |",
        req.len()
    );
    println!("| receiver, anonymous 1 key + remove | {k50:.1} | {k90:.1} | {km:.1} |");
    println!(
        "| ratio receiver / ping-pong | {:.2} | {:.2} | {:.2} |",
        k50 / b50,
        k90 / b90,
        km / bm
    );
    println!("| ping-pong, back to back (blocks of 500) | {bb50:.1} | {bb90:.1} | {bbm:.1} |");
    println!("| receiver, back to back (blocks of 500) | {kb50:.1} | {kb90:.1} | {kbm:.1} |");
    println!(
        "| ratio, back to back | {:.2} | {:.2} | {:.2} |",
        kb50 / bb50,
        kb90 / bb90,
        kbm / bbm
    );

    let keys: Vec<String> = (0..PIPELINE_KEYS).map(|k| format!("pp-{k}")).collect();
    let reqs: Vec<Vec<u8>> = keys
        .iter()
        .enumerate()
        .map(|(k, key)| alloc_request(key, k as u64))
        .collect();
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for _ in 0..PIPE_PAIRS {
        let t = Instant::now();
        pipelined(&to_kvferry, &receiver, &reqs, &keys, 1);
        one.push(t.elapsed());
        let t = Instant::now();
        pipelined(&to_kvferry, &receiver, &reqs, &keys, 32);
        many.push(t.elapsed());
    }
    let (o50, _) = median_p90(&mut one);
    let (m50, _) = median_p90(&mut many);
    let rate = |us: f64| PIPELINE_REQS as f64 / us * 1e6;
    println!("\npaired (interleaved) {PIPELINE_REQS} AllocRequests, {PIPE_PAIRS} pairs, medians:");
    println!("| case | per {PIPELINE_REQS} (ms) | requests/s |");
    println!("| --- | --- | --- |");
    println!("| one at a time | {:.2} | {:.0} |", o50 / 1e3, rate(o50));
    println!(
        "| 32 in flight (seq) | {:.2} | {:.0} |",
        m50 / 1e3,
        rate(m50)
    );
    println!("| speed-up | | {:.1}x |", o50 / m50);
}

criterion_group!(benches, bench_e2e, bench_alloc_rtt, bench_alloc_pipelined);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let bench_mode = std::env::args().any(|a| a == "--bench");
    if bench_mode && std::env::var_os("KVFERRY_E2E_SKIP_EXTRA").is_none() {
        paired_ctrl();
        cpu_per_gib();
    }
}
