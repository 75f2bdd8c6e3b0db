//! Every refusal is a typed error; reply hints survive frames that fail to
//! decode; `validate` checks messages built in code.

use super::*;

// ---------------------------------------------------------------------------
// Every refusal is a typed error.

pub(crate) fn small_limits() -> Limits {
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
        decode_with_limits(&ALLOC_REQUEST_REF[..], &limits),
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
    assert!(decode_with_limits(&ALLOC_REQUEST_REF[..], &limits).is_ok());
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
    let f = with(&PROXY_NOTIF[..], &[(key("x"), vec![0xc1])]);
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
    let f = with(&PROXY_NOTIF[..], &[(key("deep"), v)]);
    assert_eq!(decode(&f), Err(ProtocolError::TooDeep { max: 32 }));
    // Within the limit it is fine: top map (1) + 31 arrays.
    let mut v = vec![0x91; 31];
    v.push(0x00);
    let f = with(&PROXY_NOTIF[..], &[(key("deep"), v)]);
    assert_eq!(decode(&f).unwrap(), proxy_notif());
    // A huge depth limit does not turn a deep frame into a stack overflow:
    // the limit is capped, and the scan itself is iterative.
    let limits = Limits {
        max_depth: usize::MAX,
        ..Limits::default()
    };
    let mut v = vec![0x91; 200_000];
    v.push(0x00);
    let f = with(&PROXY_NOTIF[..], &[(key("deep"), v)]);
    assert_eq!(
        decode_with_limits(&f, &limits),
        Err(ProtocolError::TooDeep {
            max: Limits::MAX_DEPTH_CAP
        })
    );
    // At the cap, decoding fits comfortably in a small thread stack.
    let mut v = vec![0x91; Limits::MAX_DEPTH_CAP - 1];
    v.push(0x00);
    let f = with(&PROXY_NOTIF[..], &[(key("deep"), v)]);
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
    let f = with(&PROXY_NOTIF[..], &[(key("deepmap"), v)]);
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
        decode_with_limits(&ALLOC_REQUEST_REF[..], &limits),
        Err(ProtocolError::TooManyElements { max: 10 })
    );
    let limits = Limits {
        max_elements: 21,
        ..Limits::default()
    };
    assert!(decode_with_limits(&ALLOC_REQUEST_REF[..], &limits).is_ok());
}

#[test]
fn field_names_must_be_strings() {
    let f = with(&PROXY_NOTIF[..], &[(vec![0x00], vec![0x01])]);
    assert_eq!(
        decode(&f),
        Err(ProtocolError::NonStringKey { found: "int" })
    );
    let f = with(&PROXY_NOTIF[..], &[(b"\xa2\xff\xfe".to_vec(), vec![0x01])]);
    assert_eq!(
        decode(&f),
        Err(ProtocolError::NonStringKey {
            found: "non-UTF-8 str"
        })
    );
    // In the descriptor map too (serde would otherwise read an int key as a field index).
    let e: Vec<_> = entries(&HELLO_ACK_TCP[..])
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
    let f = with(&ALLOC_REQUEST_REF[..], &[(key("fmt"), vec![0x02])]);
    assert_eq!(decode(&f), Err(ProtocolError::DuplicateField("fmt".into())));
    let f = with(
        &PROXY_NOTIF[..],
        &[(key("type"), b"\xaaProxyNotif".to_vec())],
    );
    assert_eq!(
        decode(&f),
        Err(ProtocolError::DuplicateField("type".into()))
    );
    let f = with(
        &PROXY_NOTIF[..],
        &[(key("zz"), vec![0x01]), (key("zz"), vec![0x02])],
    );
    assert_eq!(decode(&f), Err(ProtocolError::DuplicateField("zz".into())));
}

#[test]
fn type_field_problems() {
    assert_eq!(
        decode(&without(&PROXY_NOTIF[..], "type")),
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
            decode(&replace(&PROXY_NOTIF[..], "type", value)),
            Err(ProtocolError::TypeNotString { found }),
            "{value:x?}"
        );
    }
    for unknown in ["Foo", "proxyNotif", "", "ProxyNotif "] {
        let mut v = vec![0xa0 | unknown.len() as u8];
        v.extend_from_slice(unknown.as_bytes());
        assert_eq!(
            decode(&replace(&PROXY_NOTIF[..], "type", &v)),
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
    malformed(
        replace(&ALLOC_REQUEST_REF[..], "fmt", b"\xa1x"),
        "fmt as str",
    );
    malformed(
        replace(
            &ALLOC_REQUEST_REF[..],
            "fmt",
            b"\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00",
        ),
        "fmt as float",
    );
    malformed(
        replace(&ALLOC_REQUEST_REF[..], "keys", b"\xa1a"),
        "keys as str",
    );
    malformed(
        replace(&ALLOC_REQUEST_REF[..], "keys", b"\x91\x01"),
        "key as int",
    );
    malformed(
        replace(&ALLOC_REQUEST_REF[..], "keys", b"\x91\xa2\xc3\x28"),
        "key not UTF-8",
    );
    malformed(
        replace(&ALLOC_REQUEST_REF[..], "is_last_batch", b"\x01"),
        "bool as int",
    );
    malformed(
        replace(&ALLOC_REQUEST_REF[..], "req_id", b"\xc0"),
        "req_id nil",
    );
    // u64 beyond i64::MAX in an i64 field.
    malformed(
        replace(
            &ALLOC_REQUEST_REF[..],
            "total_chunks",
            b"\xcf\x80\x00\x00\x00\x00\x00\x00\x00",
        ),
        "total_chunks > i64::MAX",
    );
    // Negative seq, and seq as a float beyond u64.
    malformed(
        with(&ALLOC_REQUEST_REF[..], &[(key("seq"), vec![0xff])]),
        "seq = -1",
    );
    malformed(
        with(
            &ALLOC_REQUEST_REF[..],
            &[(key("seq"), b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00".to_vec())],
        ),
        "seq = i64::MIN",
    );
    malformed(
        with(
            &ALLOC_REQUEST_REF[..],
            &[(key("seq"), b"\xcb\x43\xf0\x00\x00\x00\x00\x00\x00".to_vec())],
        ),
        "seq = 2^64 as float",
    );
    // version beyond u32.
    malformed(
        replace(
            &HELLO_SHM[..],
            "version",
            b"\xcf\x00\x00\x00\x01\x00\x00\x00\x00",
        ),
        "version = 2^32",
    );
    malformed(replace(&HELLO_SHM[..], "version", b"\xff"), "version = -1");
    // lid beyond u16.
    let e: Vec<_> = entries(&HELLO_ACK_TCP[..])
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
        replace(&HELLO_SHM[..], "descriptor", b"\x91\x01"),
        "descriptor as array",
    );
}

#[test]
fn key_limits() {
    let l = small_limits();
    let three = replace(&ALLOC_REQUEST_REF[..], "keys", b"\x93\xa1a\xa1b\xa1c");
    assert_eq!(
        decode_with_limits(&three, &l),
        Err(ProtocolError::TooManyKeys {
            field: "keys",
            count: 3,
            max: 2
        })
    );
    let long = replace(&ALLOC_REQUEST_REF[..], "keys", b"\x92\xa1a\xa5abcde");
    assert_eq!(
        decode_with_limits(&long, &l),
        Err(ProtocolError::KeyTooLong {
            field: "keys",
            index: 1,
            len: 5,
            max: 4
        })
    );
    let ok = replace(&ALLOC_REQUEST_REF[..], "keys", b"\x92\xa1a\xa4abcd");
    assert!(decode_with_limits(&ok, &l).is_ok());
    // CancelNotif keys too.
    let c = replace(&CANCEL_NOTIF[..], "keys", b"\x93\xa1a\xa1b\xa1c");
    assert_eq!(
        decode_with_limits(&c, &l),
        Err(ProtocolError::TooManyKeys {
            field: "keys",
            count: 3,
            max: 2
        })
    );
    let c = replace(&CANCEL_NOTIF[..], "keys", b"\x91\xa5abcde");
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
    let r = replace(
        &ALLOC_RESPONSE_OK[..],
        "remote_indexes",
        b"\x93\x00\x01\x02",
    );
    assert_eq!(
        decode_with_limits(&r, &l),
        Err(ProtocolError::TooManyKeys {
            field: "remote_indexes",
            count: 3,
            max: 2
        })
    );
    let r = replace(
        &ALLOC_RESPONSE_OK[..],
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
    let f = replace(&ALLOC_REQUEST_REF[..], "req_id", b"\xa5abcde");
    assert_eq!(
        decode_with_limits(&f, &l),
        Err(ProtocolError::IdTooLong {
            field: "req_id",
            len: 5,
            max: 4
        })
    );
    for (frame, field) in [
        (&PROXY_NOTIF[..], "req_id"),
        (&CANCEL_NOTIF[..], "req_id"),
        (&TRANSFER_DONE[..], "req_id"),
        (&HEARTBEAT[..], "sender_id"),
        (&HELLO_SHM[..], "sender_id"),
        (&HELLO_SHM[..], "transport"),
        (&HELLO_ACK_TCP[..], "receiver_id"),
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
    // Descriptor strings: &HELLO_SHM[..]'s path is 8 bytes, &HELLO_ACK_TCP[..]'s addr 13.
    assert_eq!(
        decode_with_limits(&HELLO_SHM[..], &l),
        Err(ProtocolError::IdTooLong {
            field: "descriptor.path",
            len: 8,
            max: 4
        })
    );
    assert_eq!(
        decode_with_limits(
            &HELLO_ACK_TCP[..],
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
            decode_with_limits(&replace(&ALLOC_REQUEST_REF[..], "total_chunks", bytes), &l),
            Err(ProtocolError::TotalChunksOutOfRange { value, max: 100 })
        );
    }
    assert!(decode_with_limits(
        &replace(&ALLOC_REQUEST_REF[..], "total_chunks", b"\x64"),
        &l
    )
    .is_ok());
    // Default limit: 1 << 24 accepted, one more refused.
    assert!(decode(&replace(
        &ALLOC_REQUEST_REF[..],
        "total_chunks",
        b"\xce\x01\x00\x00\x00"
    ))
    .is_ok());
    assert_eq!(
        decode(&replace(
            &ALLOC_REQUEST_REF[..],
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
        decode(&replace(&ALLOC_REQUEST_REF[..], "last_chunk_toks", b"\xff")),
        Err(ProtocolError::NegativeField {
            field: "last_chunk_toks",
            value: -1
        })
    );
    assert_eq!(
        decode(&replace(
            &ALLOC_RESPONSE_OK[..],
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
            &ALLOC_RESPONSE_OK[..],
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
            &replace(&ALLOC_REQUEST_REF[..], "shape", b"\x94\x01\x01\x01\x01"),
            &l
        ),
        Err(ProtocolError::TooManyShapeDims { dims: 4, max: 3 })
    );
    // Zero, negative dims and an unknown dtype decode; chunk_bytes reports them.
    let Message::AllocRequest(r) =
        decode(&replace(&ALLOC_REQUEST_REF[..], "shape", b"\x92\x00\xff")).unwrap()
    else {
        panic!()
    };
    assert_eq!(
        r.chunk_bytes(),
        Err(ProtocolError::NonPositiveDim { index: 0, value: 0 })
    );
    let Message::AllocRequest(r) =
        decode(&replace(&ALLOC_REQUEST_REF[..], "dtype", b"\xa4nope")).unwrap()
    else {
        panic!()
    };
    assert_eq!(
        r.chunk_bytes(),
        Err(ProtocolError::UnknownDtype("nope".into()))
    );
    let Message::AllocRequest(r) = decode(&ALLOC_REQUEST_REF[..]).unwrap() else {
        panic!()
    };
    assert_eq!(r.chunk_bytes(), Ok(4));
}

#[test]
fn rdma_gid_must_be_16_bytes() {
    let e: Vec<_> = entries(&HELLO_ACK_TCP[..])
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
        let f = with(&PROXY_NOTIF[..], &[(key("x"), v.to_vec())]);
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
        decode(&replace(&PROXY_NOTIF[..], "type", b"\xa3Foo")).unwrap_err(),
        decode(&replace(&ALLOC_REQUEST_REF[..], "last_chunk_toks", b"\xff")).unwrap_err(),
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
        peek_reply_hints(&ALLOC_REQUEST_FULL[..], &l),
        ReplyHints {
            seq: Some(70_000),
            n_keys: Some(2)
        }
    );
    // Missing required field (decode fails), hints still there, any field order.
    let mut e = entries(&without(&ALLOC_REQUEST_FULL[..], "dtype"));
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
        let f = with(&ALLOC_REQUEST_REF[..], &[(key("seq"), v.to_vec())]);
        assert_eq!(peek_reply_hints(&f, &l).seq, None, "{v:x?}");
    }
    let three = replace(&ALLOC_REQUEST_REF[..], "keys", b"\x93\xa1a\xa1b\xa1c");
    assert_eq!(peek_reply_hints(&three, &small_limits()).n_keys, None);
    assert_eq!(peek_reply_hints(&three, &l).n_keys, Some(3));
    // Garbage and oversize frames: nothing.
    assert_eq!(peek_reply_hints(b"", &l), ReplyHints::default());
    assert_eq!(peek_reply_hints(b"\x91\x01", &l), ReplyHints::default());
    assert_eq!(
        peek_reply_hints(
            &ALLOC_REQUEST_FULL[..],
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
