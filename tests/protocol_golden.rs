//! Golden-bytes tests for the control-plane wire format.
//!
//! Every frame here is written by hand from the msgpack spec (fixmap 0x8N,
//! fixarray 0x9N, fixstr 0xa0|len followed by the text, uint8 0xcc, ...), in
//! the field order PROTOCOL.md declares. Each must decode to the expected
//! value, and encoding that value must give back exactly these bytes (what
//! msgspec produces), so kvferry and LMCache peers understand each other.

use kvferry::protocol::*;

/// Splits a top-level msgpack map into raw (key, value) byte slices, by hand
/// (independent of the crate's own scanner).
fn entries(frame: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let (n, mut pos) = match frame[0] {
        m @ 0x80..=0x8f => (usize::from(m & 0x0f), 1),
        0xde => (usize::from(u16::from_be_bytes([frame[1], frame[2]])), 3),
        m => panic!("not a map: {m:#x}"),
    };
    let mut out = Vec::new();
    for _ in 0..n {
        let k = skip(frame, pos);
        let v = skip(frame, k);
        out.push((frame[pos..k].to_vec(), frame[k..v].to_vec()));
        pos = v;
    }
    assert_eq!(pos, frame.len(), "trailing bytes in test frame");
    out
}

/// Returns the offset just past the msgpack value starting at `pos`.
fn skip(b: &[u8], pos: usize) -> usize {
    let be = |at: usize, n: usize| {
        b[at..at + n]
            .iter()
            .fold(0usize, |a, &x| (a << 8) | usize::from(x))
    };
    let m = b[pos];
    match m {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => pos + 1,
        0x80..=0x8f => (0..usize::from(m & 0x0f) * 2).fold(pos + 1, |p, _| skip(b, p)),
        0x90..=0x9f => (0..usize::from(m & 0x0f)).fold(pos + 1, |p, _| skip(b, p)),
        0xa0..=0xbf => pos + 1 + usize::from(m & 0x1f),
        0xc4 | 0xd9 => pos + 2 + be(pos + 1, 1),
        0xc5 | 0xda => pos + 3 + be(pos + 1, 2),
        0xc6 | 0xdb => pos + 5 + be(pos + 1, 4),
        0xca => pos + 5,
        0xcb => pos + 9,
        0xcc | 0xd0 => pos + 2,
        0xcd | 0xd1 => pos + 3,
        0xce | 0xd2 => pos + 5,
        0xcf | 0xd3 => pos + 9,
        0xdc => (0..be(pos + 1, 2)).fold(pos + 3, |p, _| skip(b, p)),
        0xde => (0..be(pos + 1, 2) * 2).fold(pos + 3, |p, _| skip(b, p)),
        m => panic!("test helper does not handle marker {m:#x}"),
    }
}

/// Reassembles a map from entries (fixmap / map16 header).
fn map(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = if entries.len() < 16 {
        vec![0x80 | entries.len() as u8]
    } else {
        let n = entries.len() as u16;
        vec![0xde, (n >> 8) as u8, n as u8]
    };
    for (k, v) in entries {
        out.extend_from_slice(k);
        out.extend_from_slice(v);
    }
    out
}

/// fixstr-encoded key, for building entries.
fn key(k: &str) -> Vec<u8> {
    assert!(k.len() < 32);
    let mut v = vec![0xa0 | k.len() as u8];
    v.extend_from_slice(k.as_bytes());
    v
}

fn without(frame: &[u8], field: &str) -> Vec<u8> {
    let e: Vec<_> = entries(frame)
        .into_iter()
        .filter(|(k, _)| *k != key(field))
        .collect();
    assert_eq!(e.len() + 1, entries(frame).len(), "{field} not in frame");
    map(&e)
}

fn with(frame: &[u8], extra: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut e = entries(frame);
    e.extend_from_slice(extra);
    map(&e)
}

// ---------------------------------------------------------------------------
// The golden frames.

/// PROTOCOL.md's reference vector, byte for byte.
const ALLOC_REQUEST_REF: &[u8] = b"\x89\xa4type\xacAllocRequest\xa4keys\x91\xa1a\xa3fmt\x01\
\xa5shape\x91\x02\xa5dtype\xa4bf16\xaflast_chunk_toks\x03\xa6req_id\xa0\
\xadis_last_batch\xc2\xactotal_chunks\x00";

fn alloc_request_ref() -> Message {
    Message::AllocRequest(AllocRequest {
        keys: vec!["a".into()],
        fmt: 1,
        shape: vec![2],
        dtype: "bf16".into(),
        last_chunk_toks: 3,
        req_id: String::new(),
        is_last_batch: false,
        total_chunks: 0,
        seq: None,
    })
}

/// Every field set, including the `seq` extension; multi-byte int widths.
const ALLOC_REQUEST_FULL: &[u8] = b"\x8a\xa4type\xacAllocRequest\xa4keys\x92\xa2k1\xa2k2\
\xa3fmt\x02\xa5shape\x93\x02\x10\xcd\x01\x00\xa5dtype\xa8bfloat16\
\xaflast_chunk_toks\xcc\xc8\xa6req_id\xa2r1\xadis_last_batch\xc3\
\xactotal_chunks\xcd\x01\x2c\xa3seq\xce\x00\x01\x11\x70";

fn alloc_request_full() -> Message {
    Message::AllocRequest(AllocRequest {
        keys: vec!["k1".into(), "k2".into()],
        fmt: 2,
        shape: vec![2, 16, 256],
        dtype: "bfloat16".into(),
        last_chunk_toks: 200,
        req_id: "r1".into(),
        is_last_batch: true,
        total_chunks: 300,
        seq: Some(70_000),
    })
}

/// LMCache-shaped success reply (no extensions): the answer to a 3-key
/// batch whose key 1 the receiver already holds — one slot per key to
/// write (keys 0 and 2), none for the already-sent key.
const ALLOC_RESPONSE_OK: &[u8] = b"\x83\xa4type\xadAllocResponse\xaeremote_indexes\x92\x00\x05\
\xb4already_sent_indexes\x91\x01";

fn alloc_response_ok() -> Message {
    Message::AllocResponse(AllocResponse::ok(vec![0, 5], vec![1], None))
}

/// Issue 12's case, as LMCache's own receiver answers it: 2 keys, key 0
/// held → `AllocResponse(remote_indexes=[2], already_sent_indexes=[0])`.
const ALLOC_RESPONSE_DEDUP: &[u8] = b"\x83\xa4type\xadAllocResponse\xaeremote_indexes\x91\x02\
\xb4already_sent_indexes\x91\x00";

fn alloc_response_dedup() -> Message {
    Message::AllocResponse(AllocResponse::ok(vec![2], vec![0], None))
}

/// kvferry failure reply: -1 indexes plus seq, error and code.
const ALLOC_RESPONSE_FAIL: &[u8] = b"\x86\xa4type\xadAllocResponse\xaeremote_indexes\x92\xff\xff\
\xb4already_sent_indexes\x90\xa3seq\x07\xa5error\xa7too big\
\xa4code\xb0buffer_too_small";

fn alloc_response_fail() -> Message {
    Message::AllocResponse(AllocResponse::failure(
        2,
        Some(7),
        ErrorCode::BufferTooSmall,
        "too big",
    ))
}

const PROXY_NOTIF: &[u8] = b"\x82\xa4type\xaaProxyNotif\xa6req_id\xa3r-1";

fn proxy_notif() -> Message {
    Message::ProxyNotif(ProxyNotif {
        req_id: "r-1".into(),
    })
}

const CANCEL_NOTIF: &[u8] = b"\x83\xa4type\xabCancelNotif\xa6req_id\xa2r2\xa4keys\x92\xa1a\xa1b";

fn cancel_notif() -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: "r2".into(),
        keys: vec!["a".into(), "b".into()],
        seq: None,
    })
}

const CANCEL_NOTIF_SEQ: &[u8] =
    b"\x84\xa4type\xabCancelNotif\xa6req_id\xa2r2\xa4keys\x90\xa3seq\xcc\xff";

fn cancel_notif_seq() -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: "r2".into(),
        keys: vec![],
        seq: Some(255),
    })
}

const HELLO_SHM: &[u8] = b"\x85\xa4type\xa5Hello\xa9sender_id\xa2p0\xa7version\x01\
\xa9transport\xa3shm\xaadescriptor\x83\xa4kind\xa3shm\xa4path\xa8/dev/shm\
\xa3len\xce\x00\x10\x00\x00";

fn hello_shm() -> Message {
    Message::Hello(Hello {
        sender_id: "p0".into(),
        version: 1,
        transport: "shm".into(),
        descriptor: Descriptor::Shm {
            path: "/dev/shm".into(),
            len: 1 << 20,
        },
    })
}

const HELLO_NONE: &[u8] = b"\x85\xa4type\xa5Hello\xa9sender_id\xa0\xa7version\xce\xff\xff\xff\xff\
\xa9transport\xa4none\xaadescriptor\x81\xa4kind\xa4none";

fn hello_none() -> Message {
    Message::Hello(Hello {
        sender_id: String::new(),
        version: u32::MAX,
        transport: "none".into(),
        descriptor: Descriptor::None,
    })
}

const HELLO_ACK_RDMA: &[u8] = b"\x87\xa4type\xa8HelloAck\xabreceiver_id\xa2d0\xa7version\x01\
\xa9transport\xa4rdma\xaadescriptor\x87\xa4kind\xa4rdma\xa6qp_num\xcd\x01\x23\xa3lid\x00\
\xa3gid\xc4\x10\xfe\x80\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\
\xa4rkey\xce\xde\xad\xbe\xef\xa4addr\xcf\x00\x00\x7f\x00\x00\x00\x10\x00\
\xa3len\xce\x40\x00\x00\x00\
\xabchunk_bytes\xce\x00\x08\x00\x00\xafcapacity_chunks\xcd\x02\x00";

fn hello_ack_rdma() -> Message {
    let mut gid = vec![0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[15] = 1;
    Message::HelloAck(HelloAck {
        receiver_id: "d0".into(),
        version: 1,
        transport: "rdma".into(),
        descriptor: Descriptor::Rdma {
            qp_num: 0x123,
            lid: 0,
            gid,
            rkey: 0xdead_beef,
            addr: 0x7f00_0000_1000,
            len: 1 << 30,
        },
        chunk_bytes: 512 * 1024,
        capacity_chunks: 512,
    })
}

const HELLO_ACK_TCP: &[u8] = b"\x87\xa4type\xa8HelloAck\xabreceiver_id\xa2d1\xa7version\x01\
\xa9transport\xa3tcp\xaadescriptor\x82\xa4kind\xa3tcp\xa4addr\xad10.0.0.2:7401\
\xabchunk_bytes\xcd\x10\x00\xafcapacity_chunks\x00";

fn hello_ack_tcp() -> Message {
    Message::HelloAck(HelloAck {
        receiver_id: "d1".into(),
        version: 1,
        transport: "tcp".into(),
        descriptor: Descriptor::Tcp {
            addr: "10.0.0.2:7401".into(),
            secret: None,
        },
        chunk_bytes: 4096,
        capacity_chunks: 0,
    })
}

/// With the data-connection secret (a kvferry extension of the descriptor,
/// after `addr`).
const HELLO_ACK_TCP_SECRET: &[u8] = b"\x87\xa4type\xa8HelloAck\xabreceiver_id\xa2d1\xa7version\x01\
\xa9transport\xa3tcp\xaadescriptor\x83\xa4kind\xa3tcp\xa4addr\xad10.0.0.2:7401\
\xa6secret\xd9\x2000112233445566778899aabbccddeeff\
\xabchunk_bytes\xcd\x10\x00\xafcapacity_chunks\x00";

fn hello_ack_tcp_secret() -> Message {
    Message::HelloAck(HelloAck {
        receiver_id: "d1".into(),
        version: 1,
        transport: "tcp".into(),
        descriptor: Descriptor::Tcp {
            addr: "10.0.0.2:7401".into(),
            secret: Some("00112233445566778899aabbccddeeff".into()),
        },
        chunk_bytes: 4096,
        capacity_chunks: 0,
    })
}

const TRANSFER_DONE: &[u8] =
    b"\x83\xa4type\xacTransferDone\xa6req_id\xa2r9\xa3seq\xcf\xff\xff\xff\xff\xff\xff\xff\xff";

fn transfer_done() -> Message {
    Message::TransferDone(TransferDone {
        req_id: "r9".into(),
        seq: Some(u64::MAX),
    })
}

const TRANSFER_DONE_NO_SEQ: &[u8] = b"\x82\xa4type\xacTransferDone\xa6req_id\xa2r9";

fn transfer_done_no_seq() -> Message {
    Message::TransferDone(TransferDone {
        req_id: "r9".into(),
        seq: None,
    })
}

const HEARTBEAT: &[u8] = b"\x82\xa4type\xa9Heartbeat\xa9sender_id\xa2p7";

fn heartbeat() -> Message {
    Message::Heartbeat(Heartbeat {
        sender_id: "p7".into(),
    })
}

fn golden() -> Vec<(&'static str, &'static [u8], Message)> {
    vec![
        (
            "AllocRequest (reference vector)",
            ALLOC_REQUEST_REF,
            alloc_request_ref(),
        ),
        (
            "AllocRequest (all fields)",
            ALLOC_REQUEST_FULL,
            alloc_request_full(),
        ),
        ("AllocResponse (ok)", ALLOC_RESPONSE_OK, alloc_response_ok()),
        (
            "AllocResponse (dedup)",
            ALLOC_RESPONSE_DEDUP,
            alloc_response_dedup(),
        ),
        (
            "AllocResponse (failure)",
            ALLOC_RESPONSE_FAIL,
            alloc_response_fail(),
        ),
        ("ProxyNotif", PROXY_NOTIF, proxy_notif()),
        ("CancelNotif", CANCEL_NOTIF, cancel_notif()),
        ("CancelNotif (seq)", CANCEL_NOTIF_SEQ, cancel_notif_seq()),
        ("Hello (shm)", HELLO_SHM, hello_shm()),
        ("Hello (none)", HELLO_NONE, hello_none()),
        ("HelloAck (rdma)", HELLO_ACK_RDMA, hello_ack_rdma()),
        ("HelloAck (tcp)", HELLO_ACK_TCP, hello_ack_tcp()),
        (
            "HelloAck (tcp, secret)",
            HELLO_ACK_TCP_SECRET,
            hello_ack_tcp_secret(),
        ),
        ("TransferDone", TRANSFER_DONE, transfer_done()),
        (
            "TransferDone (no seq)",
            TRANSFER_DONE_NO_SEQ,
            transfer_done_no_seq(),
        ),
        ("Heartbeat", HEARTBEAT, heartbeat()),
    ]
}

#[test]
fn reference_vector_from_protocol_md() {
    assert_eq!(decode(ALLOC_REQUEST_REF).unwrap(), alloc_request_ref());
    assert_eq!(encode(&alloc_request_ref()), ALLOC_REQUEST_REF);
}

#[test]
fn golden_frames_decode_and_encode_byte_exact() {
    for (name, bytes, msg) in golden() {
        assert_eq!(
            decode(bytes).unwrap_or_else(|e| panic!("{name}: {e}")),
            msg,
            "{name}: decode"
        );
        assert_eq!(encode(&msg), bytes, "{name}: encode is not byte-identical");
        assert_eq!(decode(&encode(&msg)).unwrap(), msg, "{name}: round trip");
    }
}

/// LMCache 0.5.6's sender checks on a reply to `n_keys` keys, written out
/// as its `_async_transfer_task` does (independent of `placement`).
fn lmcache_accepts(n_keys: usize, r: &AllocResponse) -> Result<(), String> {
    let already: std::collections::BTreeSet<i64> = r.already_sent_indexes.iter().copied().collect();
    if already.iter().any(|&i| i < 0 || i as usize >= n_keys) {
        return Err(format!(
            "Invalid already_sent_indexes from receiver: {already:?}"
        ));
    }
    let expected = n_keys - already.len();
    if r.remote_indexes.len() != expected {
        return Err(format!(
            "AllocResponse inconsistency: total_keys={n_keys}, already_sent={}, remote_indexes={}, expected={expected}",
            already.len(),
            r.remote_indexes.len()
        ));
    }
    Ok(())
}

/// Every golden reply passes LMCache's sender check for the batch it
/// answers, and `placement` reads it the same way.
#[test]
fn golden_replies_pass_lmcaches_consistency_check() {
    type Case = (&'static [u8], usize, &'static [(usize, i64)]);
    let cases: [Case; 3] = [
        (ALLOC_RESPONSE_OK, 3, &[(0, 0), (2, 5)]),
        (ALLOC_RESPONSE_DEDUP, 2, &[(1, 2)]),
        (ALLOC_RESPONSE_FAIL, 2, &[(0, -1), (1, -1)]),
    ];
    for (bytes, n_keys, writes) in cases {
        let Message::AllocResponse(r) = decode(bytes).unwrap() else {
            panic!("not an AllocResponse");
        };
        assert_eq!(lmcache_accepts(n_keys, &r), Ok(()), "{r:?}");
        let p = placement(n_keys, &r).unwrap();
        assert_eq!(p.writes.as_slice(), writes, "{r:?}");
    }
    // The reply kvferry's receiver used to send for issue 12's case.
    let old = AllocResponse::ok(vec![0, 2], vec![0], None);
    assert_eq!(
        lmcache_accepts(2, &old),
        Err("AllocResponse inconsistency: total_keys=2, already_sent=1, remote_indexes=2, expected=1".into())
    );
    assert!(placement(2, &old).is_err());
}

#[test]
fn every_message_type_has_a_golden_frame() {
    let mut seen: Vec<&str> = golden().iter().map(|(_, _, m)| m.type_name()).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 8, "{seen:?}");
}

// ---------------------------------------------------------------------------
// Field order, unknown fields, defaults, required fields.

#[test]
fn any_field_order_is_accepted_including_type_last() {
    for (name, bytes, msg) in golden() {
        let e = entries(bytes);
        let mut reversed = e.clone();
        reversed.reverse();
        assert_eq!(decode(&map(&reversed)).unwrap(), msg, "{name}: reversed");
        for r in 1..e.len() {
            let mut rotated = e.clone();
            rotated.rotate_left(r);
            assert_eq!(
                decode(&map(&rotated)).unwrap(),
                msg,
                "{name}: rotated by {r}"
            );
        }
    }
}

/// Values of every msgpack kind, nested, as a newer peer might send.
fn unknown_entries() -> Vec<(Vec<u8>, Vec<u8>)> {
    vec![
        // {"a": [1, {"b": nil}, -5], "c": bin(2)}
        (
            key("zz_future"),
            b"\x82\xa1a\x93\x01\x81\xa1b\xc0\xfb\xa1c\xc4\x02\x00\x01".to_vec(),
        ),
        // [true, 1.5 (float64), "s", ext fixext1, [], {}]
        (
            key("another"),
            b"\x96\xc3\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\xa1s\xd4\x01\x07\x90\x80".to_vec(),
        ),
        (key("f32"), b"\xca\x3f\xc0\x00\x00".to_vec()),
        (key("n"), b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00".to_vec()),
        // A map with a non-string key inside an unknown field is fine.
        (key("intkeys"), b"\x81\x01\x02".to_vec()),
    ]
}

#[test]
fn unknown_fields_are_ignored() {
    for (name, bytes, msg) in golden() {
        let frame = with(bytes, &unknown_entries());
        assert_eq!(decode(&frame).unwrap(), msg, "{name}");
        // And before "type", too.
        let mut e = unknown_entries();
        e.extend(entries(bytes));
        assert_eq!(
            decode(&map(&e)).unwrap(),
            msg,
            "{name}: unknown fields first"
        );
    }
}

#[test]
fn unknown_descriptor_fields_are_ignored() {
    let e: Vec<_> = entries(HELLO_SHM)
        .into_iter()
        .map(|(k, v)| {
            if k == key("descriptor") {
                // {"kind":"shm","path":"/dev/shm","len":1<<20,"numa":[0,1]}
                (k, b"\x84\xa4kind\xa3shm\xa4path\xa8/dev/shm\xa3len\xce\x00\x10\x00\x00\xa4numa\x92\x00\x01".to_vec())
            } else {
                (k, v)
            }
        })
        .collect();
    assert_eq!(decode(&map(&e)).unwrap(), hello_shm());
}

#[test]
fn missing_optional_fields_take_defaults() {
    // LMCache's defaults: req_id "", is_last_batch false, total_chunks 0; no seq.
    let minimal = b"\x86\xa4type\xacAllocRequest\xa4keys\x91\xa1a\xa3fmt\x01\xa5shape\x91\x02\
\xa5dtype\xa4bf16\xaflast_chunk_toks\x03";
    assert_eq!(decode(minimal).unwrap(), alloc_request_ref());
    for field in ["req_id", "is_last_batch", "total_chunks"] {
        assert_eq!(
            decode(&without(ALLOC_REQUEST_REF, field)).unwrap(),
            alloc_request_ref(),
            "{field}"
        );
    }
    // already_sent_indexes defaults to [].
    let resp = b"\x82\xa4type\xadAllocResponse\xaeremote_indexes\x91\x03";
    assert_eq!(
        decode(resp).unwrap(),
        Message::AllocResponse(AllocResponse::ok(vec![3], vec![], None))
    );
    // Extension fields may be absent or nil.
    for field in ["seq", "error", "code"] {
        let frame = with(resp, &[(key(field), vec![0xc0])]);
        assert_eq!(
            decode(&frame).unwrap(),
            Message::AllocResponse(AllocResponse::ok(vec![3], vec![], None)),
            "{field}: nil"
        );
    }
    let frame = with(TRANSFER_DONE_NO_SEQ, &[(key("seq"), vec![0xc0])]);
    assert_eq!(decode(&frame).unwrap(), transfer_done_no_seq());
}

fn required(type_name: &str) -> &'static [&'static str] {
    match type_name {
        "AllocRequest" => &["keys", "fmt", "shape", "dtype", "last_chunk_toks"],
        "AllocResponse" => &["remote_indexes"],
        "ProxyNotif" => &["req_id"],
        "CancelNotif" => &["req_id", "keys"],
        "Hello" => &["sender_id", "version", "transport", "descriptor"],
        "HelloAck" => &[
            "receiver_id",
            "version",
            "transport",
            "descriptor",
            "chunk_bytes",
            "capacity_chunks",
        ],
        "TransferDone" => &["req_id"],
        "Heartbeat" => &["sender_id"],
        other => panic!("{other}"),
    }
}

#[test]
fn missing_required_field_is_a_typed_error() {
    for (name, bytes, msg) in golden() {
        let type_name = msg.type_name();
        for (k, _) in entries(bytes) {
            let field = std::str::from_utf8(&k[1..]).unwrap();
            if field == "type" {
                continue;
            }
            let result = decode(&without(bytes, field));
            if required(type_name).contains(&field) {
                assert_eq!(
                    result,
                    Err(ProtocolError::MissingField {
                        message_type: type_name,
                        field: required(type_name).iter().find(|f| **f == field).unwrap()
                    }),
                    "{name}: without {field}"
                );
            } else {
                assert!(
                    result.is_ok(),
                    "{name}: optional {field} removed: {result:?}"
                );
            }
        }
    }
}

#[test]
fn descriptor_missing_fields_or_kind_is_malformed() {
    for desc in [
        &b"\x82\xa4path\xa8/dev/shm\xa3len\x01"[..], // no kind
        &b"\x82\xa4kind\xa3shm\xa3len\x01"[..],      // no path
        &b"\x81\xa4kind\xa6nvlink"[..],              // unknown kind
        &b"\x81\xa4kind\x01"[..],                    // kind not a string
    ] {
        let e: Vec<_> = entries(HELLO_SHM)
            .into_iter()
            .map(|(k, v)| {
                if k == key("descriptor") {
                    (k, desc.to_vec())
                } else {
                    (k, v)
                }
            })
            .collect();
        assert!(
            matches!(decode(&map(&e)), Err(ProtocolError::Malformed(_))),
            "{desc:x?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Integer widths: msgspec may use any width that holds the value.

fn replace(frame: &[u8], field: &str, value: &[u8]) -> Vec<u8> {
    let e: Vec<_> = entries(frame)
        .into_iter()
        .map(|(k, v)| {
            if k == key(field) {
                (k, value.to_vec())
            } else {
                (k, v)
            }
        })
        .collect();
    map(&e)
}

#[test]
fn every_integer_width_is_accepted() {
    let expect = |f: &[u8]| decode(f).unwrap_or_else(|e| panic!("{f:x?}: {e}"));
    // fmt = 1 in every width.
    for one in [
        &b"\x01"[..],
        b"\xcc\x01",
        b"\xcd\x00\x01",
        b"\xce\x00\x00\x00\x01",
        b"\xcf\x00\x00\x00\x00\x00\x00\x00\x01",
        b"\xd0\x01",
        b"\xd1\x00\x01",
        b"\xd2\x00\x00\x00\x01",
        b"\xd3\x00\x00\x00\x00\x00\x00\x00\x01",
    ] {
        assert_eq!(
            expect(&replace(ALLOC_REQUEST_REF, "fmt", one)),
            alloc_request_ref()
        );
        // shape [2] with the element as wide ints too.
        let mut shape = vec![0x91];
        shape.extend_from_slice(one);
        let Message::AllocRequest(mut r) = expect(&replace(ALLOC_REQUEST_REF, "shape", &shape))
        else {
            panic!()
        };
        assert_eq!(r.shape, vec![1]);
        r.shape = vec![2];
        assert_eq!(Message::AllocRequest(r), alloc_request_ref());
        // Unsigned fields: seq (u64), version (u32), chunk_bytes (u64).
        let f = with(ALLOC_REQUEST_REF, &[(key("seq"), one.to_vec())]);
        assert_eq!(expect(&f).seq(), Some(1));
        let Message::Hello(h) = expect(&replace(HELLO_SHM, "version", one)) else {
            panic!()
        };
        assert_eq!(h.version, 1);
        let Message::HelloAck(a) = expect(&replace(HELLO_ACK_TCP, "chunk_bytes", one)) else {
            panic!()
        };
        assert_eq!(a.chunk_bytes, 1);
    }
    // Negative values in signed fields: fmt = -1 as negative fixint, int8, int16, int64.
    for minus_one in [
        &b"\xff"[..],
        b"\xd0\xff",
        b"\xd1\xff\xff",
        b"\xd3\xff\xff\xff\xff\xff\xff\xff\xff",
    ] {
        let Message::AllocRequest(r) = expect(&replace(ALLOC_REQUEST_REF, "fmt", minus_one)) else {
            panic!()
        };
        assert_eq!(r.fmt, -1);
    }
    // Largest values.
    let Message::AllocRequest(r) = expect(&replace(
        ALLOC_REQUEST_REF,
        "fmt",
        b"\xcf\x7f\xff\xff\xff\xff\xff\xff\xff",
    )) else {
        panic!()
    };
    assert_eq!(r.fmt, i64::MAX);
    let Message::AllocRequest(r) = expect(&replace(
        ALLOC_REQUEST_REF,
        "fmt",
        b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
    )) else {
        panic!()
    };
    assert_eq!(r.fmt, i64::MIN);
    // total_chunks and last_chunk_toks through wide encodings.
    let f = replace(ALLOC_REQUEST_REF, "total_chunks", b"\xd2\x00\x01\x00\x00");
    let Message::AllocRequest(r) = expect(&f) else {
        panic!()
    };
    assert_eq!(r.total_chunks, 1 << 16);
}

// ---------------------------------------------------------------------------
// Every refusal is a typed error.

fn small_limits() -> Limits {
    Limits {
        max_keys: 2,
        max_key_bytes: 4,
        max_total_chunks: 100,
        max_shape_dims: 3,
        ..Limits::default()
    }
}

#[test]
fn frame_too_large_is_checked_first() {
    let limits = Limits {
        max_frame_bytes: 16,
        ..Limits::default()
    };
    assert_eq!(
        decode_with_limits(ALLOC_REQUEST_REF, &limits),
        Err(ProtocolError::FrameTooLarge {
            len: ALLOC_REQUEST_REF.len(),
            max: 16
        })
    );
    // Even garbage is refused by size before it is parsed.
    assert_eq!(
        decode_with_limits(&[0xc1; 17], &limits),
        Err(ProtocolError::FrameTooLarge { len: 17, max: 16 })
    );
    let big = vec![0u8; Limits::default().max_frame_bytes + 1];
    assert!(matches!(
        decode(&big),
        Err(ProtocolError::FrameTooLarge { .. })
    ));
    // Exactly at the limit is fine.
    let limits = Limits {
        max_frame_bytes: ALLOC_REQUEST_REF.len(),
        ..Limits::default()
    };
    assert!(decode_with_limits(ALLOC_REQUEST_REF, &limits).is_ok());
}

#[test]
fn every_truncation_is_a_typed_error() {
    for (name, bytes, _) in golden() {
        for cut in 0..bytes.len() {
            assert!(
                matches!(decode(&bytes[..cut]), Err(ProtocolError::Truncated { .. })),
                "{name} cut at {cut}: {:?}",
                decode(&bytes[..cut])
            );
        }
    }
    assert_eq!(decode(&[]), Err(ProtocolError::Truncated { offset: 0 }));
}

#[test]
fn trailing_bytes_are_refused() {
    let mut f = ALLOC_REQUEST_REF.to_vec();
    f.extend_from_slice(&[0xc0, 0x01]);
    assert_eq!(decode(&f), Err(ProtocolError::TrailingBytes { extra: 2 }));
}

#[test]
fn reserved_marker_is_refused() {
    let f = with(PROXY_NOTIF, &[(key("x"), vec![0xc1])]);
    assert!(matches!(
        decode(&f),
        Err(ProtocolError::InvalidMarker { .. })
    ));
}

#[test]
fn top_level_must_be_a_map() {
    for (frame, found) in [
        (&b"\x91\x01"[..], "array"),
        (b"\xa3abc", "str"),
        (b"\x05", "int"),
        (b"\xc0", "nil"),
        (b"\xc3", "bool"),
        (b"\xcb\x00\x00\x00\x00\x00\x00\x00\x00", "float"),
        (b"\xc4\x01\x00", "bin"),
        (b"\xd4\x01\x00", "ext"),
    ] {
        assert_eq!(
            decode(frame),
            Err(ProtocolError::NotAMap { found }),
            "{frame:x?}"
        );
    }
}

#[test]
fn nesting_beyond_the_depth_limit_is_refused_without_recursion() {
    // 40 nested arrays in an unknown field: over the default 32.
    let mut v = vec![0x91; 40];
    v.push(0x00);
    let f = with(PROXY_NOTIF, &[(key("deep"), v)]);
    assert_eq!(decode(&f), Err(ProtocolError::TooDeep { max: 32 }));
    // Within the limit it is fine: top map (1) + 31 arrays.
    let mut v = vec![0x91; 31];
    v.push(0x00);
    let f = with(PROXY_NOTIF, &[(key("deep"), v)]);
    assert_eq!(decode(&f).unwrap(), proxy_notif());
    // A huge depth limit does not turn a deep frame into a stack overflow:
    // the limit is capped, and the scan itself is iterative.
    let limits = Limits {
        max_depth: usize::MAX,
        ..Limits::default()
    };
    let mut v = vec![0x91; 200_000];
    v.push(0x00);
    let f = with(PROXY_NOTIF, &[(key("deep"), v)]);
    assert_eq!(
        decode_with_limits(&f, &limits),
        Err(ProtocolError::TooDeep {
            max: Limits::MAX_DEPTH_CAP
        })
    );
    // At the cap, decoding fits comfortably in a small thread stack.
    let mut v = vec![0x91; Limits::MAX_DEPTH_CAP - 1];
    v.push(0x00);
    let f = with(PROXY_NOTIF, &[(key("deep"), v)]);
    let h = std::thread::Builder::new()
        .stack_size(512 * 1024)
        .spawn(move || decode_with_limits(&f, &limits))
        .unwrap();
    assert_eq!(h.join().unwrap(), Ok(proxy_notif()));
    // Deep nesting in a nested map as the last child, too.
    let mut v = Vec::new();
    for _ in 0..40 {
        v.extend_from_slice(b"\x82\xa1a\x00\xa1b");
    }
    v.push(0x00);
    let f = with(PROXY_NOTIF, &[(key("deepmap"), v)]);
    assert_eq!(decode(&f), Err(ProtocolError::TooDeep { max: 32 }));
}

#[test]
fn too_many_elements_is_refused() {
    let limits = Limits {
        max_elements: 10,
        ..Limits::default()
    };
    // The reference AllocRequest has 1 map + 9 keys + 9 values + 2 array items = 21 values.
    assert_eq!(
        decode_with_limits(ALLOC_REQUEST_REF, &limits),
        Err(ProtocolError::TooManyElements { max: 10 })
    );
    let limits = Limits {
        max_elements: 21,
        ..Limits::default()
    };
    assert!(decode_with_limits(ALLOC_REQUEST_REF, &limits).is_ok());
}

#[test]
fn field_names_must_be_strings() {
    let f = with(PROXY_NOTIF, &[(vec![0x00], vec![0x01])]);
    assert_eq!(
        decode(&f),
        Err(ProtocolError::NonStringKey { found: "int" })
    );
    let f = with(PROXY_NOTIF, &[(b"\xa2\xff\xfe".to_vec(), vec![0x01])]);
    assert_eq!(
        decode(&f),
        Err(ProtocolError::NonStringKey {
            found: "non-UTF-8 str"
        })
    );
    // In the descriptor map too (serde would otherwise read an int key as a field index).
    let e: Vec<_> = entries(HELLO_ACK_TCP)
        .into_iter()
        .map(|(k, v)| {
            if k == key("descriptor") {
                (k, b"\x82\xa4kind\xa3tcp\x00\xa1x".to_vec())
            } else {
                (k, v)
            }
        })
        .collect();
    assert_eq!(
        decode(&map(&e)),
        Err(ProtocolError::NonStringKey { found: "int" })
    );
}

#[test]
fn duplicate_fields_are_refused() {
    let f = with(ALLOC_REQUEST_REF, &[(key("fmt"), vec![0x02])]);
    assert_eq!(decode(&f), Err(ProtocolError::DuplicateField("fmt".into())));
    let f = with(PROXY_NOTIF, &[(key("type"), b"\xaaProxyNotif".to_vec())]);
    assert_eq!(
        decode(&f),
        Err(ProtocolError::DuplicateField("type".into()))
    );
    let f = with(
        PROXY_NOTIF,
        &[(key("zz"), vec![0x01]), (key("zz"), vec![0x02])],
    );
    assert_eq!(decode(&f), Err(ProtocolError::DuplicateField("zz".into())));
}

#[test]
fn type_field_problems() {
    assert_eq!(
        decode(&without(PROXY_NOTIF, "type")),
        Err(ProtocolError::MissingType)
    );
    assert_eq!(decode(b"\x80"), Err(ProtocolError::MissingType));
    for (value, found) in [
        (&b"\x01"[..], "int"),
        (b"\xc0", "nil"),
        (b"\xc4\x0aProxyNotif", "bin"),
        (b"\x91\xa1a", "array"),
        (b"\xa2\xc3\x28", "non-UTF-8 str"),
    ] {
        assert_eq!(
            decode(&replace(PROXY_NOTIF, "type", value)),
            Err(ProtocolError::TypeNotString { found }),
            "{value:x?}"
        );
    }
    for unknown in ["Foo", "proxyNotif", "", "ProxyNotif "] {
        let mut v = vec![0xa0 | unknown.len() as u8];
        v.extend_from_slice(unknown.as_bytes());
        assert_eq!(
            decode(&replace(PROXY_NOTIF, "type", &v)),
            Err(ProtocolError::UnknownType(unknown.into())),
            "{unknown:?}"
        );
    }
}

#[test]
fn wrong_value_types_and_out_of_range_integers_are_malformed() {
    let malformed = |f: Vec<u8>, what: &str| {
        assert!(
            matches!(decode(&f), Err(ProtocolError::Malformed(_))),
            "{what}: {:?}",
            decode(&f)
        );
    };
    malformed(replace(ALLOC_REQUEST_REF, "fmt", b"\xa1x"), "fmt as str");
    malformed(
        replace(
            ALLOC_REQUEST_REF,
            "fmt",
            b"\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00",
        ),
        "fmt as float",
    );
    malformed(replace(ALLOC_REQUEST_REF, "keys", b"\xa1a"), "keys as str");
    malformed(
        replace(ALLOC_REQUEST_REF, "keys", b"\x91\x01"),
        "key as int",
    );
    malformed(
        replace(ALLOC_REQUEST_REF, "keys", b"\x91\xa2\xc3\x28"),
        "key not UTF-8",
    );
    malformed(
        replace(ALLOC_REQUEST_REF, "is_last_batch", b"\x01"),
        "bool as int",
    );
    malformed(replace(ALLOC_REQUEST_REF, "req_id", b"\xc0"), "req_id nil");
    // u64 beyond i64::MAX in an i64 field.
    malformed(
        replace(
            ALLOC_REQUEST_REF,
            "total_chunks",
            b"\xcf\x80\x00\x00\x00\x00\x00\x00\x00",
        ),
        "total_chunks > i64::MAX",
    );
    // Negative seq, and seq as a float beyond u64.
    malformed(
        with(ALLOC_REQUEST_REF, &[(key("seq"), vec![0xff])]),
        "seq = -1",
    );
    malformed(
        with(
            ALLOC_REQUEST_REF,
            &[(key("seq"), b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00".to_vec())],
        ),
        "seq = i64::MIN",
    );
    malformed(
        with(
            ALLOC_REQUEST_REF,
            &[(key("seq"), b"\xcb\x43\xf0\x00\x00\x00\x00\x00\x00".to_vec())],
        ),
        "seq = 2^64 as float",
    );
    // version beyond u32.
    malformed(
        replace(
            HELLO_SHM,
            "version",
            b"\xcf\x00\x00\x00\x01\x00\x00\x00\x00",
        ),
        "version = 2^32",
    );
    malformed(replace(HELLO_SHM, "version", b"\xff"), "version = -1");
    // lid beyond u16.
    let e: Vec<_> = entries(HELLO_ACK_TCP)
        .into_iter()
        .map(|(k, v)| {
            if k == key("descriptor") {
                (k, b"\x87\xa4kind\xa4rdma\xa6qp_num\x01\xa3lid\xce\x00\x01\x00\x00\xa3gid\xc4\x10\
\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xa4rkey\x01\xa4addr\x01\xa3len\x01"
                    .to_vec())
            } else {
                (k, v)
            }
        })
        .collect();
    malformed(map(&e), "lid = 65536");
    malformed(
        replace(HELLO_SHM, "descriptor", b"\x91\x01"),
        "descriptor as array",
    );
}

#[test]
fn key_limits() {
    let l = small_limits();
    let three = replace(ALLOC_REQUEST_REF, "keys", b"\x93\xa1a\xa1b\xa1c");
    assert_eq!(
        decode_with_limits(&three, &l),
        Err(ProtocolError::TooManyKeys {
            field: "keys",
            count: 3,
            max: 2
        })
    );
    let long = replace(ALLOC_REQUEST_REF, "keys", b"\x92\xa1a\xa5abcde");
    assert_eq!(
        decode_with_limits(&long, &l),
        Err(ProtocolError::KeyTooLong {
            field: "keys",
            index: 1,
            len: 5,
            max: 4
        })
    );
    let ok = replace(ALLOC_REQUEST_REF, "keys", b"\x92\xa1a\xa4abcd");
    assert!(decode_with_limits(&ok, &l).is_ok());
    // CancelNotif keys too.
    let c = replace(CANCEL_NOTIF, "keys", b"\x93\xa1a\xa1b\xa1c");
    assert_eq!(
        decode_with_limits(&c, &l),
        Err(ProtocolError::TooManyKeys {
            field: "keys",
            count: 3,
            max: 2
        })
    );
    let c = replace(CANCEL_NOTIF, "keys", b"\x91\xa5abcde");
    assert_eq!(
        decode_with_limits(&c, &l),
        Err(ProtocolError::KeyTooLong {
            field: "keys",
            index: 0,
            len: 5,
            max: 4
        })
    );
    // Index lists of a reply.
    let r = replace(ALLOC_RESPONSE_OK, "remote_indexes", b"\x93\x00\x01\x02");
    assert_eq!(
        decode_with_limits(&r, &l),
        Err(ProtocolError::TooManyKeys {
            field: "remote_indexes",
            count: 3,
            max: 2
        })
    );
    let r = replace(
        ALLOC_RESPONSE_OK,
        "already_sent_indexes",
        b"\x93\x00\x01\x02",
    );
    assert_eq!(
        decode_with_limits(&r, &l),
        Err(ProtocolError::TooManyKeys {
            field: "already_sent_indexes",
            count: 3,
            max: 2
        })
    );
}

#[test]
fn identifier_limits() {
    let l = small_limits();
    let f = replace(ALLOC_REQUEST_REF, "req_id", b"\xa5abcde");
    assert_eq!(
        decode_with_limits(&f, &l),
        Err(ProtocolError::IdTooLong {
            field: "req_id",
            len: 5,
            max: 4
        })
    );
    for (frame, field) in [
        (PROXY_NOTIF, "req_id"),
        (CANCEL_NOTIF, "req_id"),
        (TRANSFER_DONE, "req_id"),
        (HEARTBEAT, "sender_id"),
        (HELLO_SHM, "sender_id"),
        (HELLO_SHM, "transport"),
        (HELLO_ACK_TCP, "receiver_id"),
    ] {
        let f = replace(frame, field, b"\xa5abcde");
        assert_eq!(
            decode_with_limits(&f, &l),
            Err(ProtocolError::IdTooLong {
                field,
                len: 5,
                max: 4
            }),
            "{field}"
        );
    }
    // Descriptor strings: HELLO_SHM's path is 8 bytes, HELLO_ACK_TCP's addr 13.
    assert_eq!(
        decode_with_limits(HELLO_SHM, &l),
        Err(ProtocolError::IdTooLong {
            field: "descriptor.path",
            len: 8,
            max: 4
        })
    );
    assert_eq!(
        decode_with_limits(
            HELLO_ACK_TCP,
            &Limits {
                max_key_bytes: 12,
                ..Limits::default()
            }
        ),
        Err(ProtocolError::IdTooLong {
            field: "descriptor.addr",
            len: 13,
            max: 12
        })
    );
}

#[test]
fn total_chunks_range() {
    let l = small_limits();
    for (bytes, value) in [
        (&b"\xff"[..], -1),
        (b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00", i64::MIN),
        (b"\x65", 101),
    ] {
        assert_eq!(
            decode_with_limits(&replace(ALLOC_REQUEST_REF, "total_chunks", bytes), &l),
            Err(ProtocolError::TotalChunksOutOfRange { value, max: 100 })
        );
    }
    assert!(decode_with_limits(&replace(ALLOC_REQUEST_REF, "total_chunks", b"\x64"), &l).is_ok());
    // Default limit: 1 << 24 accepted, one more refused.
    assert!(decode(&replace(
        ALLOC_REQUEST_REF,
        "total_chunks",
        b"\xce\x01\x00\x00\x00"
    ))
    .is_ok());
    assert_eq!(
        decode(&replace(
            ALLOC_REQUEST_REF,
            "total_chunks",
            b"\xce\x01\x00\x00\x01"
        )),
        Err(ProtocolError::TotalChunksOutOfRange {
            value: (1 << 24) + 1,
            max: 1 << 24
        })
    );
}

#[test]
fn negative_counts_and_indexes() {
    assert_eq!(
        decode(&replace(ALLOC_REQUEST_REF, "last_chunk_toks", b"\xff")),
        Err(ProtocolError::NegativeField {
            field: "last_chunk_toks",
            value: -1
        })
    );
    assert_eq!(
        decode(&replace(
            ALLOC_RESPONSE_OK,
            "remote_indexes",
            b"\x92\x00\xfe"
        )),
        Err(ProtocolError::IndexOutOfRange {
            field: "remote_indexes",
            position: 1,
            value: -2
        })
    );
    assert_eq!(
        decode(&replace(
            ALLOC_RESPONSE_OK,
            "already_sent_indexes",
            b"\x91\xff"
        )),
        Err(ProtocolError::IndexOutOfRange {
            field: "already_sent_indexes",
            position: 0,
            value: -1
        })
    );
}

#[test]
fn shape_rank_is_limited_but_dims_are_checked_by_chunk_bytes() {
    let l = small_limits();
    assert_eq!(
        decode_with_limits(
            &replace(ALLOC_REQUEST_REF, "shape", b"\x94\x01\x01\x01\x01"),
            &l
        ),
        Err(ProtocolError::TooManyShapeDims { dims: 4, max: 3 })
    );
    // Zero, negative dims and an unknown dtype decode; chunk_bytes reports them.
    let Message::AllocRequest(r) =
        decode(&replace(ALLOC_REQUEST_REF, "shape", b"\x92\x00\xff")).unwrap()
    else {
        panic!()
    };
    assert_eq!(
        r.chunk_bytes(),
        Err(ProtocolError::NonPositiveDim { index: 0, value: 0 })
    );
    let Message::AllocRequest(r) =
        decode(&replace(ALLOC_REQUEST_REF, "dtype", b"\xa4nope")).unwrap()
    else {
        panic!()
    };
    assert_eq!(
        r.chunk_bytes(),
        Err(ProtocolError::UnknownDtype("nope".into()))
    );
    let Message::AllocRequest(r) = decode(ALLOC_REQUEST_REF).unwrap() else {
        panic!()
    };
    assert_eq!(r.chunk_bytes(), Ok(4));
}

#[test]
fn rdma_gid_must_be_16_bytes() {
    let e: Vec<_> = entries(HELLO_ACK_TCP)
        .into_iter()
        .map(|(k, v)| {
            if k == key("descriptor") {
                (
                    k,
                    b"\x87\xa4kind\xa4rdma\xa6qp_num\x01\xa3lid\x00\xa3gid\xc4\x0f\
\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xa4rkey\x01\xa4addr\x01\xa3len\x01"
                        .to_vec(),
                )
            } else {
                (k, v)
            }
        })
        .collect();
    assert_eq!(
        decode(&map(&e)),
        Err(ProtocolError::BadDescriptor(
            "rdma gid is 15 bytes, expected 16".into()
        ))
    );
}

#[test]
fn huge_declared_lengths_fail_fast() {
    // keys: array32 declaring 2^32-1 elements, in a 40-byte frame.
    let mut f = b"\x82\xa4type\xacAllocRequest\xa4keys\xdd\xff\xff\xff\xff".to_vec();
    assert!(matches!(decode(&f), Err(ProtocolError::Truncated { .. })));
    f.extend_from_slice(&[0xa1, b'a']);
    assert!(matches!(decode(&f), Err(ProtocolError::Truncated { .. })));
    // map32, str32, bin32 and ext32 declaring 4 GiB.
    for v in [
        &b"\xdf\xff\xff\xff\xff"[..],
        b"\xdb\xff\xff\xff\xff",
        b"\xc6\xff\xff\xff\xff",
        b"\xc9\xff\xff\xff\xff\x01",
    ] {
        let f = with(PROXY_NOTIF, &[(key("x"), v.to_vec())]);
        assert!(
            matches!(decode(&f), Err(ProtocolError::Truncated { .. })),
            "{v:x?}"
        );
    }
    assert!(matches!(
        decode(b"\xdf\xff\xff\xff\xff"),
        Err(ProtocolError::Truncated { .. })
    ));
}

#[test]
fn every_decode_error_maps_to_bad_message() {
    for e in [
        decode(b"").unwrap_err(),
        decode(b"\x90").unwrap_err(),
        decode(&replace(PROXY_NOTIF, "type", b"\xa3Foo")).unwrap_err(),
        decode(&replace(ALLOC_REQUEST_REF, "last_chunk_toks", b"\xff")).unwrap_err(),
    ] {
        assert_eq!(e.code(), ErrorCode::BadMessage, "{e}");
    }
}

// ---------------------------------------------------------------------------
// Reply hints from frames that fail to decode.

#[test]
fn reply_hints_survive_bad_frames() {
    let l = Limits::default();
    // A full request: seq and key count.
    assert_eq!(
        peek_reply_hints(ALLOC_REQUEST_FULL, &l),
        ReplyHints {
            seq: Some(70_000),
            n_keys: Some(2)
        }
    );
    // Missing required field (decode fails), hints still there, any field order.
    let mut e = entries(&without(ALLOC_REQUEST_FULL, "dtype"));
    e.reverse();
    let bad = map(&e);
    assert!(decode(&bad).is_err());
    assert_eq!(
        peek_reply_hints(&bad, &l),
        ReplyHints {
            seq: Some(70_000),
            n_keys: Some(2)
        }
    );
    // Truncated after seq was seen: seq kept.
    let f = map(&[
        (key("seq"), b"\xd2\x00\x00\x00\x05".to_vec()),
        (key("keys"), b"\x93\xa1a".to_vec()),
    ]);
    assert_eq!(
        peek_reply_hints(&f, &l),
        ReplyHints {
            seq: Some(5),
            n_keys: None
        }
    );
    // Negative or non-int seq: none. Too many keys: none.
    for v in [&b"\xff"[..], b"\xd0\xfe", b"\xa1x", b"\xc0"] {
        let f = with(ALLOC_REQUEST_REF, &[(key("seq"), v.to_vec())]);
        assert_eq!(peek_reply_hints(&f, &l).seq, None, "{v:x?}");
    }
    let three = replace(ALLOC_REQUEST_REF, "keys", b"\x93\xa1a\xa1b\xa1c");
    assert_eq!(peek_reply_hints(&three, &small_limits()).n_keys, None);
    assert_eq!(peek_reply_hints(&three, &l).n_keys, Some(3));
    // Garbage and oversize frames: nothing.
    assert_eq!(peek_reply_hints(b"", &l), ReplyHints::default());
    assert_eq!(peek_reply_hints(b"\x91\x01", &l), ReplyHints::default());
    assert_eq!(
        peek_reply_hints(
            ALLOC_REQUEST_FULL,
            &Limits {
                max_frame_bytes: 8,
                ..Limits::default()
            }
        ),
        ReplyHints::default()
    );
}

#[test]
fn validate_checks_messages_built_in_code() {
    let Message::AllocRequest(mut r) = alloc_request_full() else {
        panic!()
    };
    assert_eq!(
        validate(&Message::AllocRequest(r.clone()), &Limits::default()),
        Ok(())
    );
    r.total_chunks = -5;
    let m = Message::AllocRequest(r);
    assert_eq!(
        validate(&m, &Limits::default()),
        Err(ProtocolError::TotalChunksOutOfRange {
            value: -5,
            max: 1 << 24
        })
    );
    // Encoding never refuses; the peer's decode does.
    assert_eq!(
        decode(&encode(&m)),
        validate(&m, &Limits::default()).map(|()| m.clone())
    );
}
