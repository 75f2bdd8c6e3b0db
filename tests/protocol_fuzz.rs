//! Robustness of the decoder: arbitrary and mutated frames never panic and
//! never make it allocate far beyond the frame; accepted frames round-trip.
//!
//! A counting global allocator (per thread, so parallel tests do not disturb
//! each other) measures the peak heap use of single decodes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use kvferry::protocol::*;
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------
// Per-thread allocation tracking.

struct CountingAlloc;

thread_local! {
    // Const-initialized Cells without destructors: safe to touch from inside
    // the allocator (no allocation, no TLS destructor registration).
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let cur = CURRENT.with(|c| {
                c.set(c.get() + size);
                c.get()
            });
            PEAK.with(|p| p.set(p.get().max(cur)));
        }
    });
}

fn note_dealloc(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            CURRENT.with(|c| c.set(c.get().saturating_sub(size)));
        }
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees carry over; the bookkeeping only touches
// const-initialized thread-local Cells and never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_dealloc(layout.size());
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes through us).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `GlobalAlloc::alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_dealloc(layout.size());
        note_alloc(new_size);
        // SAFETY: `ptr`/`layout` come from a previous `System` allocation; forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Runs `f` and returns its result and the peak bytes it had allocated at once on this thread.
fn peak_heap<T>(f: impl FnOnce() -> T) -> (T, usize) {
    CURRENT.with(|c| c.set(0));
    PEAK.with(|p| p.set(0));
    TRACKING.with(|t| t.set(true));
    let out = f();
    TRACKING.with(|t| t.set(false));
    (out, PEAK.with(|p| p.get()))
}

// ---------------------------------------------------------------------------
// Valid messages.

fn id() -> impl Strategy<Value = String> {
    "[a-z0-9@_.-]{0,12}"
}

fn descriptor() -> impl Strategy<Value = Descriptor> {
    prop_oneof![
        Just(Descriptor::None),
        (id(), any::<u64>()).prop_map(|(path, len)| Descriptor::Shm { path, len }),
        (id(), prop::option::of(id())).prop_map(|(addr, secret)| Descriptor::Tcp { addr, secret }),
        (
            any::<u32>(),
            any::<u16>(),
            prop::collection::vec(any::<u8>(), 16),
            any::<u32>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(qp_num, lid, gid, rkey, addr, len)| Descriptor::Rdma {
                qp_num,
                lid,
                gid,
                rkey,
                addr,
                len
            }),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    let keys = || prop::collection::vec(id(), 0..6);
    prop_oneof![
        (
            keys(),
            any::<i64>(),
            prop::collection::vec(1i64..100_000, 0..8),
            prop_oneof![Just("bfloat16".to_string()), Just("fp8".to_string()), id()],
            0i64..i64::MAX,
            id(),
            any::<bool>(),
            0i64..=(1 << 24),
            any::<Option<u64>>(),
        )
            .prop_map(
                |(
                    keys,
                    fmt,
                    shape,
                    dtype,
                    last_chunk_toks,
                    req_id,
                    is_last_batch,
                    total_chunks,
                    seq,
                )| {
                    Message::AllocRequest(AllocRequest {
                        keys,
                        fmt,
                        shape,
                        dtype,
                        last_chunk_toks,
                        req_id,
                        is_last_batch,
                        total_chunks,
                        seq,
                    })
                }
            ),
        (
            prop::collection::vec(-1i64..i64::MAX, 0..6),
            prop::collection::vec(0i64..i64::MAX, 0..6),
            any::<Option<u64>>(),
            prop::option::of(id()),
            prop::option::of(id()),
        )
            .prop_map(|(remote_indexes, already_sent_indexes, seq, error, code)| {
                Message::AllocResponse(AllocResponse {
                    remote_indexes,
                    already_sent_indexes,
                    seq,
                    error,
                    code,
                })
            }),
        id().prop_map(|req_id| Message::ProxyNotif(ProxyNotif { req_id })),
        (id(), keys(), any::<Option<u64>>()).prop_map(|(req_id, keys, seq)| Message::CancelNotif(
            CancelNotif { req_id, keys, seq }
        )),
        (id(), any::<u32>(), id(), descriptor()).prop_map(
            |(sender_id, version, transport, descriptor)| {
                Message::Hello(Hello {
                    sender_id,
                    version,
                    transport,
                    descriptor,
                })
            }
        ),
        (
            id(),
            any::<u32>(),
            id(),
            descriptor(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(
                |(receiver_id, version, transport, descriptor, chunk_bytes, capacity_chunks)| {
                    Message::HelloAck(HelloAck {
                        receiver_id,
                        version,
                        transport,
                        descriptor,
                        chunk_bytes,
                        capacity_chunks,
                        control: None,
                    })
                }
            ),
        (id(), any::<Option<u64>>())
            .prop_map(|(req_id, seq)| Message::TransferDone(TransferDone { req_id, seq })),
        id().prop_map(|sender_id| Message::Heartbeat(Heartbeat { sender_id })),
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Delete(usize),
    Overwrite(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Overwrite(i, b)),
    ]
}

fn apply(frame: &mut Vec<u8>, m: &Mutation) {
    let len = frame.len();
    match *m {
        Mutation::FlipBit(i, b) if len > 0 => frame[i % len] ^= 1 << b,
        Mutation::Truncate(i) => frame.truncate(i % (len + 1)),
        Mutation::Insert(i, b) => frame.insert(i % (len + 1), b),
        Mutation::Delete(i) if len > 0 => {
            frame.remove(i % len);
        }
        Mutation::Overwrite(i, b) if len > 0 => frame[i % len] = b,
        _ => {}
    }
}

/// Decodes `frame` (and peeks its reply hints); a panic fails with the frame in hex. An accepted frame
/// must re-encode to something that decodes to the same message.
fn check(frame: &[u8]) -> Result<Message, ProtocolError> {
    let (result, hints) = catch_unwind(AssertUnwindSafe(|| {
        (decode(frame), peek_reply_hints(frame, &Limits::default()))
    }))
    .unwrap_or_else(|_| panic!("decode or peek_reply_hints panicked on frame {frame:02x?}"));
    // The hints agree with a successful decode.
    if let Ok(Message::AllocRequest(r)) = &result {
        assert_eq!(
            hints,
            ReplyHints {
                seq: r.seq,
                n_keys: Some(r.keys.len())
            },
            "{frame:02x?}"
        );
    }
    if let Ok(msg) = &result {
        let again = encode(msg);
        assert_eq!(
            decode(&again).as_ref(),
            Ok(msg),
            "accepted frame {frame:02x?} does not round-trip"
        );
    }
    result
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn valid_messages_round_trip(msg in message()) {
        let bytes = encode(&msg);
        prop_assert_eq!(decode(&bytes), Ok(msg.clone()));
        let mut buf = vec![0xaa];
        encode_into(&msg, &mut buf);
        prop_assert_eq!(&buf[1..], &bytes[..]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = check(&bytes);
    }

    #[test]
    fn map_prefixed_bytes_never_panic(n in 0u8..16, rest in prop::collection::vec(any::<u8>(), 0..256)) {
        let mut bytes = vec![0x80 | n];
        bytes.extend(rest);
        let _ = check(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(msg in message(), muts in prop::collection::vec(mutation(), 1..6)) {
        let mut frame = encode(&msg);
        for m in &muts {
            apply(&mut frame, m);
        }
        let _ = check(&frame);
    }
}

// ---------------------------------------------------------------------------
// Bulk run with a seeded fast PRNG.

/// Names a random frame may use as keys: every real field name plus junk.
const FIELD_NAMES: &[&str] = &[
    "type",
    "keys",
    "fmt",
    "shape",
    "dtype",
    "last_chunk_toks",
    "req_id",
    "is_last_batch",
    "total_chunks",
    "seq",
    "remote_indexes",
    "already_sent_indexes",
    "error",
    "code",
    "sender_id",
    "receiver_id",
    "version",
    "transport",
    "descriptor",
    "chunk_bytes",
    "capacity_chunks",
    "kind",
    "path",
    "len",
    "addr",
    "gid",
    "qp_num",
    "zz",
];

const TYPE_NAMES: &[&str] = &[
    "AllocRequest",
    "AllocResponse",
    "ProxyNotif",
    "CancelNotif",
    "Hello",
    "HelloAck",
    "TransferDone",
    "Heartbeat",
    "Nope",
];

fn put_str(out: &mut Vec<u8>, s: &str) {
    assert!(s.len() < 32);
    out.push(0xa0 | s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// A random msgpack value: ints of every width, strings, bins, nested containers.
fn random_value(rng: &mut SmallRng, out: &mut Vec<u8>, depth: u32) {
    match rng.random_range(0..14) {
        0 => out.push(rng.random_range(0..0x80)),
        1 => out.push(rng.random_range(0xe0..=0xff)),
        2 => {
            let m = rng.random_range(0xcc..=0xd3u8);
            out.push(m);
            let n = 1usize << ((m - 0xcc) % 4);
            out.extend((0..n).map(|_| rng.random::<u8>()));
        }
        3 => out.push([0xc0, 0xc2, 0xc3][rng.random_range(0..3)]),
        4 => put_str(out, FIELD_NAMES[rng.random_range(0..FIELD_NAMES.len())]),
        5 => put_str(out, TYPE_NAMES[rng.random_range(0..TYPE_NAMES.len())]),
        6 => {
            out.extend_from_slice(&[0xc4, 16]);
            out.extend((0..16).map(|_| rng.random::<u8>()));
        }
        7 => {
            out.push(0xcb);
            out.extend_from_slice(&rng.random::<f64>().to_be_bytes());
        }
        8..=10 if depth < 4 => {
            let n = rng.random_range(0..5);
            out.push(0x90 | n);
            for _ in 0..n {
                random_value(rng, out, depth + 1);
            }
        }
        11..=12 if depth < 4 => random_map(rng, out, depth + 1),
        _ => out.push(rng.random_range(0..4)),
    }
}

/// A random map keyed mostly by real field names, often with a real "type".
fn random_map(rng: &mut SmallRng, out: &mut Vec<u8>, depth: u32) {
    let n = rng.random_range(0..10u8);
    out.push(0x80 | n);
    for i in 0..n {
        let name = if i == 0 && rng.random_bool(0.8) {
            "type"
        } else {
            FIELD_NAMES[rng.random_range(0..FIELD_NAMES.len())]
        };
        put_str(out, name);
        if name == "type" && rng.random_bool(0.9) {
            put_str(out, TYPE_NAMES[rng.random_range(0..TYPE_NAMES.len())]);
        } else {
            random_value(rng, out, depth);
        }
    }
}

/// A valid frame from a small fixed pool of messages.
fn pool() -> Vec<Vec<u8>> {
    let rdma = Descriptor::Rdma {
        qp_num: 7,
        lid: 1,
        gid: vec![9; 16],
        rkey: 3,
        addr: 1 << 40,
        len: 1 << 30,
    };
    [
        Message::AllocRequest(AllocRequest {
            keys: vec!["model@1@0@abc".into(), "model@1@0@def".into()],
            fmt: 1,
            shape: vec![2, 32, 256, 8, 128],
            dtype: "bfloat16".into(),
            last_chunk_toks: 100,
            req_id: "req-1".into(),
            is_last_batch: true,
            total_chunks: 2,
            seq: Some(300),
        }),
        Message::AllocResponse(AllocResponse::ok(vec![0, 1, 2], vec![1], Some(5))),
        Message::AllocResponse(AllocResponse::failure(
            3,
            Some(6),
            ErrorCode::ProtocolViolation,
            "too many",
        )),
        Message::ProxyNotif(ProxyNotif {
            req_id: "req-1".into(),
        }),
        Message::CancelNotif(CancelNotif {
            req_id: "req-2".into(),
            keys: vec!["k".into()],
            seq: Some(1),
        }),
        Message::Hello(Hello {
            sender_id: "p".into(),
            version: 1,
            transport: "rdma".into(),
            descriptor: rdma.clone(),
        }),
        Message::HelloAck(HelloAck {
            receiver_id: "d".into(),
            version: 1,
            transport: "shm".into(),
            descriptor: Descriptor::Shm {
                path: "/dev/shm/kvferry".into(),
                len: 1 << 30,
            },
            chunk_bytes: 1 << 20,
            capacity_chunks: 1024,
            control: None,
        }),
        Message::TransferDone(TransferDone {
            req_id: "req-1".into(),
            seq: None,
        }),
        Message::Heartbeat(Heartbeat {
            sender_id: "p".into(),
        }),
    ]
    .iter()
    .map(encode)
    .collect()
}

/// A small signed value biased toward the edges of the accepted ranges.
fn edgy(rng: &mut SmallRng) -> i64 {
    match rng.random_range(0..6) {
        0 => -1,
        1 => rng.random_range(-3..3),
        2 => (1 << 24) + rng.random_range(-1..=1),
        3 => rng.random(),
        _ => rng.random_range(0..1000),
    }
}

fn random_typed(rng: &mut SmallRng) -> Message {
    let n = |rng: &mut SmallRng| rng.random_range(0..6usize);
    match rng.random_range(0..3) {
        0 => Message::AllocRequest(AllocRequest {
            keys: (0..n(rng)).map(|i| format!("k{i}")).collect(),
            fmt: rng.random(),
            shape: (0..rng.random_range(0..11)).map(|_| edgy(rng)).collect(),
            dtype: "bf16".into(),
            last_chunk_toks: edgy(rng),
            req_id: "r".into(),
            is_last_batch: rng.random(),
            total_chunks: edgy(rng),
            seq: rng.random_bool(0.5).then(|| rng.random()),
        }),
        1 => Message::AllocResponse(AllocResponse {
            remote_indexes: (0..n(rng)).map(|_| edgy(rng)).collect(),
            already_sent_indexes: (0..n(rng)).map(|_| edgy(rng)).collect(),
            seq: rng.random_bool(0.5).then(|| rng.random()),
            error: None,
            code: None,
        }),
        _ => Message::HelloAck(HelloAck {
            receiver_id: "d".into(),
            version: rng.random(),
            transport: "rdma".into(),
            descriptor: Descriptor::Rdma {
                qp_num: rng.random(),
                lid: rng.random(),
                gid: vec![0; rng.random_range(14..=17)],
                rkey: rng.random(),
                addr: rng.random(),
                len: rng.random(),
            },
            chunk_bytes: rng.random(),
            capacity_chunks: rng.random(),
            control: None,
        }),
    }
}

#[derive(Default, Debug)]
struct Tally {
    ok: usize,
    errors: std::collections::BTreeMap<&'static str, usize>,
}

fn variant(e: &ProtocolError) -> &'static str {
    use ProtocolError::*;
    match e {
        FrameTooLarge { .. } => "FrameTooLarge",
        Truncated { .. } => "Truncated",
        TrailingBytes { .. } => "TrailingBytes",
        InvalidMarker { .. } => "InvalidMarker",
        NotAMap { .. } => "NotAMap",
        TooDeep { .. } => "TooDeep",
        TooManyElements { .. } => "TooManyElements",
        NonStringKey { .. } => "NonStringKey",
        DuplicateField(_) => "DuplicateField",
        MissingType => "MissingType",
        TypeNotString { .. } => "TypeNotString",
        UnknownType(_) => "UnknownType",
        MissingField { .. } => "MissingField",
        Malformed(_) => "Malformed",
        TooManyKeys { .. } => "TooManyKeys",
        KeyTooLong { .. } => "KeyTooLong",
        IdTooLong { .. } => "IdTooLong",
        TotalChunksOutOfRange { .. } => "TotalChunksOutOfRange",
        NegativeField { .. } => "NegativeField",
        IndexOutOfRange { .. } => "IndexOutOfRange",
        TooManyShapeDims { .. } => "TooManyShapeDims",
        BadDescriptor(_) => "BadDescriptor",
        UnknownDtype(_) | EmptyShape | NonPositiveDim { .. } | ChunkBytesOverflow => {
            "chunk_bytes error from decode"
        }
    }
}

impl Tally {
    fn add(&mut self, r: Result<Message, ProtocolError>) {
        match r {
            Ok(_) => self.ok += 1,
            Err(e) => *self.errors.entry(variant(&e)).or_default() += 1,
        }
    }
}

const BULK_FRAMES: usize = 300_000;

#[test]
fn bulk_random_and_mutated_frames() {
    let mut rng = SmallRng::seed_from_u64(0x6b76_6665_7272_7901);
    let pool = pool();
    let mut tally = Tally::default();
    let mut frame = Vec::with_capacity(512);
    let start = Instant::now();
    for i in 0..BULK_FRAMES {
        frame.clear();
        match i % 5 {
            // Raw random bytes, half of them starting like a map.
            0 => {
                if rng.random_bool(0.5) {
                    frame.push(0x80 | rng.random_range(0..16));
                }
                let n = rng.random_range(0..48);
                frame.extend((0..n).map(|_| rng.random::<u8>()));
            }
            // Structured random maps (real field names, random values).
            1 => random_map(&mut rng, &mut frame, 0),
            // Well-typed messages with values drawn across their whole range
            // (reaches the content checks after serde).
            2 => encode_into(&random_typed(&mut rng), &mut frame),
            // Valid frames with 1-4 mutations.
            _ => {
                frame.extend_from_slice(&pool[rng.random_range(0..pool.len())]);
                for _ in 0..rng.random_range(1..=4) {
                    let len = frame.len();
                    let at = rng.random_range(0..=len);
                    match rng.random_range(0..5) {
                        0 if len > 0 => frame[at % len] ^= 1 << rng.random_range(0..8),
                        1 => frame.truncate(at),
                        2 => frame.insert(at, rng.random()),
                        3 if len > 0 => {
                            frame.remove(at % len);
                        }
                        _ if len > 0 => frame[at % len] = rng.random(),
                        _ => {}
                    }
                }
            }
        }
        tally.add(check(&frame));
    }
    let elapsed = start.elapsed();
    println!(
        "{BULK_FRAMES} frames in {elapsed:?}: {} ok, errors {:?}",
        tally.ok, tally.errors
    );
    // The generators must reach both sides and many distinct refusals,
    // otherwise this test exercises less than it claims.
    assert!(tally.ok > 1000, "too few accepted frames: {tally:?}");
    assert!(
        !tally.errors.contains_key("chunk_bytes error from decode"),
        "{tally:?}"
    );
    for expected in [
        "Truncated",
        "Malformed",
        "UnknownType",
        "MissingField",
        "NotAMap",
        "DuplicateField",
        "TrailingBytes",
        "TotalChunksOutOfRange",
        "NegativeField",
        "IndexOutOfRange",
        "TooManyShapeDims",
        "BadDescriptor",
    ] {
        assert!(
            tally.errors.contains_key(expected),
            "no {expected} among {tally:?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Memory: declared lengths never turn into allocations.

#[test]
fn tiny_frame_declaring_huge_array_allocates_nothing_big() {
    let frame = b"\x82\xa4type\xacAllocRequest\xa4keys\xdd\xff\xff\xff\xff\xa1a";
    let (r, peak) = peak_heap(|| decode(frame));
    assert!(matches!(r, Err(ProtocolError::Truncated { .. })), "{r:?}");
    assert!(
        peak < 64 * 1024,
        "peak heap {peak} bytes for a {}-byte frame",
        frame.len()
    );
    // Even with limits that would allow it, a declared length is never trusted.
    let limits = Limits {
        max_elements: usize::MAX,
        max_keys: usize::MAX,
        ..Limits::default()
    };
    let (r, peak) = peak_heap(|| decode_with_limits(frame, &limits));
    assert!(r.is_err());
    assert!(peak < 64 * 1024, "peak heap {peak} bytes");
}

#[test]
fn max_size_frame_is_bounded_in_memory() {
    let limits = Limits::default();
    // An unknown field holding as many one-byte ints as fit in 4 MiB:
    // the element budget stops it.
    let n = limits.max_frame_bytes - 64;
    let mut frame = b"\x83\xa4type\xaaProxyNotif\xa6req_id\xa1r\xa1x\xdd".to_vec();
    frame.extend_from_slice(&(n as u32).to_be_bytes());
    frame.resize(frame.len() + n, 0x01);
    assert!(frame.len() <= limits.max_frame_bytes);
    let (r, peak) = peak_heap(|| decode(&frame));
    assert_eq!(
        r,
        Err(ProtocolError::TooManyElements {
            max: limits.max_elements
        })
    );
    assert!(peak < 1 << 20, "peak heap {peak} bytes");

    // The largest AllocRequest the limits accept (65,536 keys of 48 bytes,
    // about 3.2 MiB): decoded, with peak heap a small multiple of the frame.
    let key = "m".repeat(48);
    let msg = Message::AllocRequest(AllocRequest {
        keys: vec![key; limits.max_keys],
        fmt: 1,
        shape: vec![2, 32, 256, 8, 128],
        dtype: "bfloat16".into(),
        last_chunk_toks: 256,
        req_id: "r".into(),
        is_last_batch: false,
        total_chunks: 1 << 20,
        seq: Some(1),
    });
    let frame = encode(&msg);
    assert!(frame.len() <= limits.max_frame_bytes, "{}", frame.len());
    let (r, peak) = peak_heap(|| decode(&frame));
    assert_eq!(r.as_ref(), Ok(&msg));
    drop(r);
    println!(
        "largest AllocRequest: frame {} bytes, peak heap while decoding {peak} bytes",
        frame.len()
    );
    assert!(
        peak < 8 * frame.len(),
        "peak heap {peak} bytes for a {}-byte frame",
        frame.len()
    );
}
