//! Every golden frame decodes to its message and encodes back byte for
//! byte; field order, unknown fields, defaults, required fields and integer
//! widths as msgspec peers may send them.

use super::*;

#[test]
fn reference_vector_from_protocol_md() {
    assert_eq!(decode(&ALLOC_REQUEST_REF[..]).unwrap(), alloc_request_ref());
    assert_eq!(encode(&alloc_request_ref()), &ALLOC_REQUEST_REF[..]);
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
    let e: Vec<_> = entries(&HELLO_SHM[..])
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
            decode(&without(&ALLOC_REQUEST_REF[..], field)).unwrap(),
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
    let frame = with(&TRANSFER_DONE_NO_SEQ[..], &[(key("seq"), vec![0xc0])]);
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
        let e: Vec<_> = entries(&HELLO_SHM[..])
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
            expect(&replace(&ALLOC_REQUEST_REF[..], "fmt", one)),
            alloc_request_ref()
        );
        // shape [2] with the element as wide ints too.
        let mut shape = vec![0x91];
        shape.extend_from_slice(one);
        let Message::AllocRequest(mut r) =
            expect(&replace(&ALLOC_REQUEST_REF[..], "shape", &shape))
        else {
            panic!()
        };
        assert_eq!(r.shape, vec![1]);
        r.shape = vec![2];
        assert_eq!(Message::AllocRequest(r), alloc_request_ref());
        // Unsigned fields: seq (u64), version (u32), chunk_bytes (u64).
        let f = with(&ALLOC_REQUEST_REF[..], &[(key("seq"), one.to_vec())]);
        assert_eq!(expect(&f).seq(), Some(1));
        let Message::Hello(h) = expect(&replace(&HELLO_SHM[..], "version", one)) else {
            panic!()
        };
        assert_eq!(h.version, 1);
        let Message::HelloAck(a) = expect(&replace(&HELLO_ACK_TCP[..], "chunk_bytes", one)) else {
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
        let Message::AllocRequest(r) = expect(&replace(&ALLOC_REQUEST_REF[..], "fmt", minus_one))
        else {
            panic!()
        };
        assert_eq!(r.fmt, -1);
    }
    // Largest values.
    let Message::AllocRequest(r) = expect(&replace(
        &ALLOC_REQUEST_REF[..],
        "fmt",
        b"\xcf\x7f\xff\xff\xff\xff\xff\xff\xff",
    )) else {
        panic!()
    };
    assert_eq!(r.fmt, i64::MAX);
    let Message::AllocRequest(r) = expect(&replace(
        &ALLOC_REQUEST_REF[..],
        "fmt",
        b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
    )) else {
        panic!()
    };
    assert_eq!(r.fmt, i64::MIN);
    // total_chunks and last_chunk_toks through wide encodings.
    let f = replace(
        &ALLOC_REQUEST_REF[..],
        "total_chunks",
        b"\xd2\x00\x01\x00\x00",
    );
    let Message::AllocRequest(r) = expect(&f) else {
        panic!()
    };
    assert_eq!(r.total_chunks, 1 << 16);
}
