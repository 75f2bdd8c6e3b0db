//! Receiver rules over the wire: a real ZMQ DEALER against `Receiver::start`
//! on loopback. LMCache-mode and kvferry-mode round trips, LMCache byte
//! compatibility of the replies, dedup, and the error codes that depend on a
//! single request's content (zero_total_chunks, buffer_too_small,
//! protocol_violation, chunk_too_large, inconsistent_request,
//! allocation_failed). Admission, cancel and lease paths are in
//! `receiver_admission.rs`; malformed frames in `receiver_malformed.rs`.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use std::time::Instant;

use common::*;
use kvferry::protocol::{decode, AllocRequest, Descriptor, ErrorCode, Message, PROTOCOL_VERSION};
use kvferry::receiver::WaitError;

/// An AllocRequest encoded exactly as LMCache's msgspec struct would: the
/// tag first, then every field in declaration order, defaults included, no
/// kvferry extension.
fn msgspec_alloc(
    keys: &[&str],
    shape: &[u64],
    dtype: &str,
    last_chunk_toks: u64,
    req_id: &str,
    is_last_batch: bool,
    total_chunks: u64,
) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_map_len(&mut b, 9).unwrap();
    rmp::encode::write_str(&mut b, "type").unwrap();
    rmp::encode::write_str(&mut b, "AllocRequest").unwrap();
    rmp::encode::write_str(&mut b, "keys").unwrap();
    rmp::encode::write_array_len(&mut b, keys.len() as u32).unwrap();
    for k in keys {
        rmp::encode::write_str(&mut b, k).unwrap();
    }
    rmp::encode::write_str(&mut b, "fmt").unwrap();
    rmp::encode::write_uint(&mut b, 1).unwrap();
    rmp::encode::write_str(&mut b, "shape").unwrap();
    rmp::encode::write_array_len(&mut b, shape.len() as u32).unwrap();
    for d in shape {
        rmp::encode::write_uint(&mut b, *d).unwrap();
    }
    rmp::encode::write_str(&mut b, "dtype").unwrap();
    rmp::encode::write_str(&mut b, dtype).unwrap();
    rmp::encode::write_str(&mut b, "last_chunk_toks").unwrap();
    rmp::encode::write_uint(&mut b, last_chunk_toks).unwrap();
    rmp::encode::write_str(&mut b, "req_id").unwrap();
    rmp::encode::write_str(&mut b, req_id).unwrap();
    rmp::encode::write_str(&mut b, "is_last_batch").unwrap();
    rmp::encode::write_bool(&mut b, is_last_batch).unwrap();
    rmp::encode::write_str(&mut b, "total_chunks").unwrap();
    rmp::encode::write_uint(&mut b, total_chunks).unwrap();
    b
}

/// The reply msgspec would produce for `AllocResponse(remote_indexes, already_sent_indexes)`.
fn msgspec_response(remote: &[i64], already: &[i64]) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_map_len(&mut b, 3).unwrap();
    rmp::encode::write_str(&mut b, "type").unwrap();
    rmp::encode::write_str(&mut b, "AllocResponse").unwrap();
    rmp::encode::write_str(&mut b, "remote_indexes").unwrap();
    rmp::encode::write_array_len(&mut b, remote.len() as u32).unwrap();
    for i in remote {
        rmp::encode::write_sint(&mut b, *i).unwrap();
    }
    rmp::encode::write_str(&mut b, "already_sent_indexes").unwrap();
    rmp::encode::write_array_len(&mut b, already.len() as u32).unwrap();
    for i in already {
        rmp::encode::write_sint(&mut b, *i).unwrap();
    }
    b
}

/// The field names of a top-level msgpack map, in order.
fn top_level_fields(raw: &[u8]) -> Vec<String> {
    // Re-encode through the typed decoder is not enough (it would hide extra
    // fields), so walk the map: values here are strs, ints and int arrays.
    let mut rd = raw;
    let n = rmp::decode::read_map_len(&mut rd).expect("reply is a map");
    let mut names = Vec::new();
    for _ in 0..n {
        let len = rmp::decode::read_str_len(&mut rd).expect("field name") as usize;
        names.push(String::from_utf8(rd[..len].to_vec()).expect("utf-8 field name"));
        rd = &rd[len..];
        skip_value(&mut rd);
    }
    assert!(rd.is_empty(), "trailing bytes after the reply map");
    names
}

fn skip_value(rd: &mut &[u8]) {
    use rmp::Marker;
    let marker = rmp::decode::read_marker(rd).expect("marker");
    let skip = |rd: &mut &[u8], n: usize| *rd = &rd[n..];
    match marker {
        Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {}
        Marker::U8 | Marker::I8 => skip(rd, 1),
        Marker::U16 | Marker::I16 => skip(rd, 2),
        Marker::U32 | Marker::I32 => skip(rd, 4),
        Marker::U64 | Marker::I64 => skip(rd, 8),
        Marker::FixStr(n) => skip(rd, n as usize),
        Marker::Str8 => {
            let n = rd[0] as usize;
            skip(rd, 1 + n)
        }
        Marker::Str16 => {
            let n = u16::from_be_bytes([rd[0], rd[1]]) as usize;
            skip(rd, 2 + n)
        }
        Marker::FixArray(n) => {
            for _ in 0..n {
                skip_value(rd);
            }
        }
        Marker::Array16 => {
            let n = u16::from_be_bytes([rd[0], rd[1]]);
            skip(rd, 2);
            for _ in 0..n {
                skip_value(rd);
            }
        }
        other => panic!("unexpected marker {other:?} in a reply"),
    }
}

#[test]
fn msgspec_builder_matches_the_reference_vector() {
    // PROTOCOL.md's reference vector, byte for byte.
    let mut want = vec![0x89];
    for (s, v) in [
        ("type", None),
        ("AllocRequest", None),
        ("keys", Some(vec![0x91, 0xa1, b'a'])),
        ("fmt", Some(vec![0x01])),
        ("shape", Some(vec![0x91, 0x02])),
        ("dtype", None),
        ("bf16", None),
        ("last_chunk_toks", Some(vec![0x03])),
        ("req_id", Some(vec![0xa0])),
        ("is_last_batch", Some(vec![0xc2])),
        ("total_chunks", Some(vec![0x00])),
    ] {
        want.push(0xa0 | s.len() as u8);
        want.extend_from_slice(s.as_bytes());
        if let Some(v) = v {
            want.extend(v);
        }
    }
    assert_eq!(msgspec_alloc(&["a"], &[2], "bf16", 3, "", false, 0), want);
}

#[test]
fn lmcache_sender_gets_byte_compatible_replies() {
    let r = start(config(8));
    let c = Client::connect(r.endpoint(), "lmcache-0");
    let w = Writer::open(r.shm_path(), CHUNK_BYTES, 8);

    // The reference vector itself: an anonymous batch of one 4-byte chunk.
    c.send_raw(&msgspec_alloc(&["a"], &[2], "bf16", 3, "", false, 0));
    let raw = c.recv_raw(deadline(), "reply to the reference vector");
    let Message::AllocResponse(rep) = decode(&raw).unwrap() else {
        panic!("not an AllocResponse")
    };
    let slot_a = assert_ok(&rep, 1)[0];
    assert_eq!(
        raw,
        msgspec_response(&rep.remote_indexes, &[]),
        "success reply without extension fields"
    );
    assert_eq!(rep.seq, None);

    // A tracked request in two batches, as LMCache sends it.
    c.send_raw(&msgspec_alloc(
        &["k0", "k1"],
        &[1024],
        "uint8",
        1024,
        "r1",
        false,
        3,
    ));
    let raw = c.recv_raw(deadline(), "r1 batch 1");
    assert_eq!(
        top_level_fields(&raw),
        ["type", "remote_indexes", "already_sent_indexes"]
    );
    let Message::AllocResponse(b1) = decode(&raw).unwrap() else {
        panic!("not an AllocResponse")
    };
    let s1 = assert_ok(&b1, 2);
    c.send_raw(&msgspec_alloc(&["k2"], &[1024], "uint8", 7, "r1", true, 3));
    let raw = c.recv_raw(deadline(), "r1 batch 2");
    let Message::AllocResponse(b2) = decode(&raw).unwrap() else {
        panic!("not an AllocResponse")
    };
    assert_eq!(raw, msgspec_response(&b2.remote_indexes, &[]));
    let s2 = assert_ok(&b2, 1);
    let slots: Vec<u32> = s1.iter().chain(&s2).copied().collect();
    let mut distinct = slots.clone();
    distinct.push(slot_a);
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "distinct slots: {slots:?} and {slot_a}");

    // An LMCache request is complete with its last batch (the proxy learns
    // of the writes); its keys are visible to the decoder from then on.
    r.wait_ready("r1", deadline())
        .expect("LMCache request ready");
    for (k, s) in ["k0", "k1", "k2"].iter().zip(&slots) {
        w.write(*s, &pattern(k));
    }
    {
        let k2 = r.get("k2").expect("k2 readable");
        assert_eq!(k2.slot(), slots[2]);
        assert_eq!(k2.tokens(), Some(7), "short last chunk's token count");
        // Shape [1024] of uint8 with 7 tokens: the chunk is 7 bytes, not
        // the whole slot.
        assert_eq!(k2.bytes(), &pattern("k2")[..7]);
        assert_eq!(k2.len(), 7);
        assert!(r.get("k2").is_none(), "its only reference is borrowed");
        assert!(!r.remove("k2"), "a borrowed reference cannot be removed");
        let k0 = r.get("k0").expect("k0 readable");
        assert_eq!(k0.tokens(), None, "not a batch's last chunk");
        assert_eq!(&k0.bytes()[..16], &pattern("k0"));
    }
    assert!(r.remove("k1"));
    assert!(!r.remove("k1"), "no reference left");
    assert!(r.get("k1").is_none());
    assert!(r.get("a").is_some(), "anonymous keys are readable at once");

    // A failure reply carries error and code, still no seq.
    c.send_raw(&msgspec_alloc(&["z"], &[1024], "uint8", 1, "r2", true, 0));
    let raw = c.recv_raw(deadline(), "zero total_chunks reply");
    assert_eq!(
        top_level_fields(&raw),
        [
            "type",
            "remote_indexes",
            "already_sent_indexes",
            "error",
            "code"
        ]
    );
    let Message::AllocResponse(f) = decode(&raw).unwrap() else {
        panic!("not an AllocResponse")
    };
    assert_failure(&f, ErrorCode::ZeroTotalChunks, 1);
    assert_eq!(f.seq, None);
    assert_idle(&r);
    let s = r.stats();
    assert_eq!(s.core.requests_total.get("completed"), Some(&1));
    assert_eq!(s.core.errors_total.get("zero_total_chunks"), Some(&1));
}

#[test]
fn kvferry_sender_hello_write_and_transfer_done() {
    let r = start(config(8));
    let c = Client::connect(r.endpoint(), "kv-sender");
    let ack = c.hello();
    assert_eq!(ack.receiver_id, "test-receiver");
    assert_eq!(ack.version, PROTOCOL_VERSION);
    assert_eq!(ack.transport, "shm");
    assert_eq!(ack.chunk_bytes, CHUNK_BYTES);
    assert_eq!(ack.capacity_chunks, 8);
    match &ack.descriptor {
        Descriptor::Shm { path, len } => {
            assert_eq!(std::path::Path::new(path), r.shm_path());
            assert_eq!(*len, 8 * CHUNK_BYTES);
        }
        other => panic!("expected shm, got {other:?}"),
    }
    let w = Writer::from_ack(&ack);

    let ks = keys("q", 3);
    let b1 = c.call(&alloc("q", &ks[..2], 3, false, Some(11)), "q batch 1");
    assert_eq!(b1.seq, Some(11), "seq echoed");
    let mut slots = assert_ok(&b1, 2);
    let b2 = c.call(&alloc("q", &ks[2..], 3, true, Some(12)), "q batch 2");
    assert_eq!(b2.seq, Some(12));
    slots.extend(assert_ok(&b2, 1));
    for (k, s) in ks.iter().zip(&slots) {
        w.write(*s, &pattern(k));
    }
    // Until TransferDone a kvferry request is not ready and its keys are not readable.
    assert_eq!(r.wait_ready("q", Instant::now()), Err(WaitError::Timeout));
    assert!(r.get("q0").is_none(), "not readable before TransferDone");
    assert_eq!(r.stats().core.tracked_requests, 1, "awaiting TransferDone");
    assert_eq!(r.stats().reserved_chunks, 0, "last batch returned the rest");
    c.send(&transfer_done("q"));
    r.wait_ready("q", deadline())
        .expect("ready after TransferDone");
    assert_eq!(r.stats().core.tracked_requests, 0);
    for k in &ks {
        let chunk = r.get(k).unwrap_or_else(|| panic!("{k} readable"));
        assert_eq!(&chunk.bytes()[..16], &pattern(k), "bytes of {k}");
    }
    assert_idle(&r);
    assert!(
        !c.has_pending(),
        "TransferDone and Hello get no AllocResponse"
    );
}

#[test]
fn dedup_pins_keys_and_reports_already_sent() {
    let r = start(config(8));
    let a = Client::connect(r.endpoint(), "dedup-a");
    let b = Client::connect(r.endpoint(), "dedup-b");
    // y is a whole chunk in both batches (not a batch's last, which is
    // `last_chunk_toks` long): only a copy of the asking length is pinned.
    let ra = a.call(
        &alloc("A", &["y".into(), "x".into()], 2, true, None),
        "A's batch",
    );
    let sa = assert_ok(&ra, 2);
    let rb = b.call(
        &alloc("B", &["y".into(), "z".into()], 2, true, Some(1)),
        "B's batch",
    );
    // Issue 12: one slot per key to write, none for the already-sent y
    // (`[y's slot, z's slot]` made LMCache's sender abort).
    let sb = assert_ok(&rb, 1);
    assert_eq!(rb.already_sent_indexes, vec![0], "y is already held");
    assert!(!sa.contains(&sb[0]), "z gets its own slot");
    assert_eq!(r.stats().allocated_chunks, 3, "y is stored once");
    // y has two references: the first remove keeps it.
    assert!(r.remove("y"));
    assert!(r.get("y").is_some(), "still held by the other request");
    // (that borrow consumed y's last reference)
    assert!(r.remove("x") && r.remove("z"));
    assert_idle(&r);

    // A duplicate key counts toward total_chunks: B declares 1 chunk, its
    // first batch is a dedup hit, so a second chunk breaks the total.
    a.call(&alloc("C", &["w".into()], 1, true, None), "C");
    let d1 = b.call(&alloc("D", &["w".into()], 1, false, None), "D batch 1");
    assert_eq!(d1.already_sent_indexes, vec![0]);
    let d2 = b.call(&alloc("D", &["v".into()], 1, true, None), "D batch 2");
    assert_failure(&d2, ErrorCode::ProtocolViolation, 1);
    assert!(r.remove("w"), "C's reference survives D's rollback");
    assert!(!r.remove("w"), "D's pin was dropped by its rollback");
    assert_idle(&r);
}

/// Dedup only against written keys: a kvferry writer's key is "already
/// sent" only after its TransferDone; a request asking for it meanwhile gets
/// a slot of its own and writes its own copy.
#[test]
fn kvferry_dedup_waits_for_the_writers_transfer_done() {
    let r = start(config(8));
    let a = Client::connect(r.endpoint(), "dedup-kv-a");
    let b = Client::connect(r.endpoint(), "dedup-kv-b");
    let w = Writer::from_ack(&a.hello());
    b.hello();
    let k = "shared".to_owned();
    let ra = a.call(
        &alloc("A", std::slice::from_ref(&k), 1, true, Some(1)),
        "A's batch",
    );
    let sa = assert_ok(&ra, 1);
    let rb = b.call(
        &alloc("B", &[k.clone(), "b".into()], 2, true, Some(1)),
        "B's batch",
    );
    let sb = assert_ok(&rb, 2);
    assert!(
        rb.already_sent_indexes.is_empty(),
        "A has not finished writing the key: B writes its own copy"
    );
    assert_ne!(sb[0], sa[0], "B's copy has its own slot");
    assert_eq!(r.stats().allocated_chunks, 3);
    w.write(sa[0], &pattern(&k));
    a.send(&transfer_done("A"));
    r.wait_ready("A", deadline()).expect("A ready");
    // A's copy is written now: a third request is told "already sent".
    let rc = b.call(
        &alloc("C", std::slice::from_ref(&k), 1, true, Some(2)),
        "C's batch",
    );
    assert_eq!(rc.already_sent_indexes, vec![0]);
    assert_ok(&rc, 0);
    w.write(sb[0], &pattern(&k));
    w.write(sb[1], &pattern("b"));
    b.send(&transfer_done("B"));
    b.send(&transfer_done("C"));
    r.wait_ready("B", deadline()).expect("B ready");
    r.wait_ready("C", deadline()).expect("C ready");
    // Three references (A, C on A's copy; B on its own): all readable.
    let refs: Vec<_> = (0..3)
        .map(|i| r.get(&k).unwrap_or_else(|| panic!("reference {i} of {k}")))
        .collect();
    for c in &refs {
        assert_eq!(&c.bytes()[..16], &pattern(&k));
    }
    assert!(r.get(&k).is_none(), "every reference claimed");
    drop(refs);
    assert!(r.remove("b"));
    assert_idle(&r);
}

#[test]
fn zero_total_chunks_is_refused() {
    let r = start(config(4));
    let c = Client::connect(r.endpoint(), "zero");
    let rep = c.call(&alloc("z", &keys("z", 2), 0, false, Some(5)), "zero total");
    assert_failure(&rep, ErrorCode::ZeroTotalChunks, 2);
    assert_eq!(rep.seq, Some(5));
    assert_eq!(
        r.stats().core.errors_total.get("zero_total_chunks"),
        Some(&1)
    );
    assert_eq!(r.stats().core.requests_total.get("rejected"), Some(&1));
    assert_idle(&r);
}

#[test]
fn request_larger_than_the_buffer_is_refused_at_once() {
    let r = start(config(4));
    let c = Client::connect(r.endpoint(), "big");
    let rep = c.call(&alloc("big", &keys("b", 1), 5, false, None), "too big");
    assert_failure(&rep, ErrorCode::BufferTooSmall, 1);
    assert!(rep.error.as_deref().unwrap().contains("buffer too small"));
    assert_idle(&r);
    // Exactly the capacity is fine.
    let ok = c.call(&alloc("fits", &keys("f", 4), 4, true, None), "fits");
    assert_ok(&ok, 4);
    for k in keys("f", 4) {
        assert!(r.remove(&k));
    }
    assert_idle(&r);
}

#[test]
fn protocol_violations_roll_back_and_quarantine_until_the_fence() {
    let r = start(config(8));
    let c = Client::connect(r.endpoint(), "pv");
    // First batch larger than the declared total: refused, nothing held.
    let rep = c.call(&alloc("p0", &keys("p0-", 3), 2, false, None), "p0");
    assert_failure(&rep, ErrorCode::ProtocolViolation, 3);
    assert_idle(&r);

    // Cumulative chunks above total_chunks (a kvferry sender): the whole
    // request is rolled back.
    let k = Client::connect(r.endpoint(), "pv-kv");
    k.hello();
    let b1 = k.call(&alloc("p1", &keys("a", 2), 3, false, Some(1)), "p1 b1");
    assert_ok(&b1, 2);
    let b2 = k.call(&alloc("p1", &keys("b", 2), 3, true, Some(2)), "p1 b2");
    assert_failure(&b2, ErrorCode::ProtocolViolation, 2);
    assert_eq!(b2.seq, Some(2));
    assert_eq!(
        r.wait_ready("p1", deadline()),
        Err(WaitError::Failed(ErrorCode::ProtocolViolation))
    );
    let s = r.stats();
    assert_eq!(s.reserved_chunks, 0, "reservation released");
    assert_eq!(s.core.tracked_requests, 0);
    assert_eq!(s.core.keys, 0, "keys of a failed request are gone");
    assert!(r.get("a0").is_none());
    // The granted slots may still be written by the sender: quarantined.
    assert_eq!(s.core.quarantined_slots, 2, "{s:?}");
    assert_eq!(s.allocated_chunks, 2, "quarantine still counts: {s:?}");
    // A later batch of the failed request gets the same error.
    let late = k.call(&alloc("p1", &keys("c", 1), 3, true, Some(3)), "p1 late");
    assert_failure(&late, ErrorCode::ProtocolViolation, 1);
    // The kvferry sender's CancelNotif is the fence: the slots come back.
    let ack = k.call(&cancel("p1", &keys("a", 2), Some(4)), "p1 fence");
    assert!(
        ack.remote_indexes.is_empty() && !ack.is_failure(),
        "{ack:?}"
    );
    assert_eq!(ack.seq, Some(4));
    assert_idle(&r);

    // kvferry sender: a batch after the last batch.
    assert_ok(&k.call(&alloc("p2", &keys("d", 1), 1, true, None), "p2"), 1);
    let after = k.call(&alloc("p2", &keys("e", 1), 1, true, None), "p2 after last");
    assert_failure(&after, ErrorCode::ProtocolViolation, 1);
    assert!(after
        .error
        .as_deref()
        .unwrap()
        .contains("after its last batch"));
    assert_eq!(
        r.wait_ready("p2", deadline()),
        Err(WaitError::Failed(ErrorCode::ProtocolViolation))
    );
    // A kvferry fence (CancelNotif after the failure) frees the quarantine.
    k.call(&cancel("p2", &[], None), "p2 fence");
    assert_idle(&r);
    assert_eq!(
        r.stats().core.errors_total.get("protocol_violation"),
        Some(&4)
    );
}

#[test]
fn chunk_larger_than_a_slot_is_refused() {
    let r = start(config(4));
    let c = Client::connect(r.endpoint(), "ctl");
    c.hello(); // kvferry sender: its CancelNotif fences the rollback below
    let big = |req_id: &str, total: i64| {
        Message::AllocRequest(AllocRequest {
            keys: vec![format!("{req_id}-k")],
            fmt: 1,
            shape: vec![2, CHUNK_BYTES as i64], // 2 x slot size of uint8
            dtype: "uint8".into(),
            last_chunk_toks: 1,
            req_id: req_id.into(),
            is_last_batch: true,
            total_chunks: total,
            seq: None,
        })
    };
    // On a first batch: refused, nothing reserved.
    assert_failure(&c.call(&big("c1", 1), "c1"), ErrorCode::ChunkTooLarge, 1);
    assert_idle(&r);
    // On a later batch: the admitted request is rolled back.
    assert_ok(
        &c.call(&alloc("c2", &keys("c2-", 1), 2, false, None), "c2 b1"),
        1,
    );
    assert_failure(&c.call(&big("c2", 2), "c2 b2"), ErrorCode::ChunkTooLarge, 1);
    assert_eq!(
        r.wait_ready("c2", deadline()),
        Err(WaitError::Failed(ErrorCode::ChunkTooLarge))
    );
    // Anonymous: refused too.
    assert_failure(
        &c.call(&big("", 0), "anonymous"),
        ErrorCode::ChunkTooLarge,
        1,
    );
    // Unknown dtype: bad geometry is a bad message.
    let mut odd = alloc("c3", &keys("c3-", 1), 1, true, None);
    if let Message::AllocRequest(a) = &mut odd {
        a.dtype = "complex256".into();
    }
    assert_failure(&c.call(&odd, "unknown dtype"), ErrorCode::BadMessage, 1);
    c.call(&cancel("c2", &[], None), "c2 fence");
    assert_idle(&r);
}

#[test]
fn changed_total_chunks_is_inconsistent() {
    let r = start(config(8));
    let c = Client::connect(r.endpoint(), "inc");
    c.hello(); // kvferry sender: its CancelNotif fences the rollback below
    assert_ok(
        &c.call(&alloc("i", &keys("i", 2), 4, false, Some(1)), "i b1"),
        2,
    );
    let rep = c.call(&alloc("i", &keys("j", 1), 5, false, Some(2)), "i b2");
    assert_failure(&rep, ErrorCode::InconsistentRequest, 1);
    assert_eq!(rep.seq, Some(2));
    assert_eq!(
        r.wait_ready("i", deadline()),
        Err(WaitError::Failed(ErrorCode::InconsistentRequest))
    );
    let s = r.stats();
    assert_eq!((s.reserved_chunks, s.core.tracked_requests), (0, 0));
    assert_eq!(s.core.requests_total.get("failed"), Some(&1));
    c.call(&cancel("i", &[], None), "i fence");
    assert_idle(&r);
}

#[test]
fn anonymous_batch_fails_when_the_buffer_is_full() {
    let r = start(config(4));
    let c = Client::connect(r.endpoint(), "anon");
    // An admitted request reserves the whole buffer, one chunk allocated.
    assert_ok(
        &c.call(&alloc("full", &keys("f", 1), 4, false, None), "full b1"),
        1,
    );
    let rep = c.call(&alloc("", &keys("anon", 2), 0, false, Some(9)), "anonymous");
    assert_failure(&rep, ErrorCode::AllocationFailed, 2);
    assert_eq!(rep.seq, Some(9));
    // A key already held needs no room: dedup still works when full.
    let pin = c.call(&alloc("", &keys("f", 1), 0, false, None), "anonymous pin");
    assert_ok(&pin, 0);
    assert_eq!(pin.already_sent_indexes, vec![0]);
    // The admitted request's guarantee is intact.
    assert_ok(
        &c.call(&alloc("full", &keys("g", 3), 4, true, None), "full b2"),
        3,
    );
    assert!(r.remove("f0") && r.remove("f0"), "two references on f0");
    for k in keys("g", 3) {
        assert!(r.remove(&k));
    }
    assert_idle(&r);
    assert_eq!(
        r.stats().core.errors_total.get("allocation_failed"),
        Some(&1)
    );
}

/// `ipc://` endpoints, `listen` and `also_listen` alike: the receiver takes
/// a path only if nothing is there or a socket nobody serves; a file that
/// is not a socket, or a live receiver's socket, is
/// `ReceiverError::SocketFile` and stays as it was (libzmq alone unlinks
/// whatever is at the path before it binds: the file was lost, the live
/// receiver's peers went to the new one). Every endpoint serves, with
/// `also_endpoints()` in order; the files go when the receiver is dropped.
#[test]
fn an_ipc_endpoint_takes_only_a_free_path_or_a_dead_receivers_socket() {
    use kvferry::receiver::{ReceiverConfig, ReceiverError};
    use std::io::ErrorKind;
    use std::os::unix::net::UnixListener;

    let dir = TempDir::new("kvferry-ipc");
    let ipc = |name: &str| format!("ipc://{}", dir.join(name).display());
    let refused = |cfg: ReceiverConfig, kind: ErrorKind, endpoint: &str| {
        let Err(e) = kvferry::receiver::Receiver::start(cfg) else {
            panic!("{endpoint}: expected SocketFile ({kind:?}), the receiver started");
        };
        let ReceiverError::SocketFile { source, .. } = &e else {
            panic!("{endpoint}: expected SocketFile ({kind:?}), got {e:?}");
        };
        assert_eq!(source.kind(), kind, "{e}");
        assert!(e.to_string().contains(endpoint), "{e}");
    };

    // A regular file at `listen`'s path, then at `also_listen`'s: kept.
    std::fs::write(dir.join("notes"), b"keep me").unwrap();
    refused(
        ReceiverConfig {
            listen: ipc("notes"),
            ..config(4)
        },
        ErrorKind::AlreadyExists,
        &ipc("notes"),
    );
    refused(
        ReceiverConfig {
            also_listen: vec![ipc("notes")],
            ..config(4)
        },
        ErrorKind::AlreadyExists,
        &ipc("notes"),
    );
    assert_eq!(std::fs::read(dir.join("notes")).unwrap(), b"keep me");

    // A dead receiver's socket (bound, its listener gone): taken over.
    drop(UnixListener::bind(dir.join("ctl.sock")).unwrap());
    let r = start(ReceiverConfig {
        also_listen: vec![ipc("ctl.sock"), "tcp://127.0.0.1:0".into()],
        ..config(4)
    });
    let also = r.also_endpoints().to_vec();
    assert_eq!(also.len(), 2, "{also:?}");
    assert_eq!(also[0], ipc("ctl.sock"));
    assert!(
        also[1].starts_with("tcp://127.0.0.1:") && !also[1].ends_with(":0"),
        "{also:?}"
    );

    // A second receiver on the live one's path: refused, the first serves on.
    refused(
        ReceiverConfig {
            listen: ipc("ctl.sock"),
            ..config(4)
        },
        ErrorKind::AddrInUse,
        &ipc("ctl.sock"),
    );
    for (i, endpoint) in [r.endpoint().to_owned(), also[0].clone(), also[1].clone()]
        .iter()
        .enumerate()
    {
        let c = Client::connect(endpoint, &format!("ipc-{i}"));
        let req = format!("ipc-req-{i}");
        let rep = c.call(&alloc(&req, &keys(&req, 1), 1, true, Some(1)), endpoint);
        assert_ok(&rep, 1);
    }
    drop(r);
    assert!(
        !dir.join("ctl.sock").exists(),
        "the ipc socket file outlived its receiver"
    );
}
