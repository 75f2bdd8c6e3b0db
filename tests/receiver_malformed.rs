//! Malformed frames of every class, sent by a rogue DEALER while a well-formed
//! client runs 50 requests: every rogue frame is answered with a
//! `bad_message` reply (echoing what `peek_reply_hints` recovers), the good
//! client's requests all succeed, and `stats().bad_frames` counts the frames
//! that could not be decoded.
#![cfg(not(feature = "shuttle-model"))]

mod common;

use rand::{Rng, SeedableRng};

use common::*;
use kvferry::protocol::{
    encode, AllocResponse, Descriptor, ErrorCode, HelloAck, Limits, Message, ProxyNotif,
};

const MAX_KEYS: usize = 64;
const MAX_FRAME: usize = 64 * 1024;

/// One rogue frame: what it is, its bytes, the reply's expected shape.
struct Bad {
    what: &'static str,
    bytes: Vec<u8>,
    /// Decodes fine (a type a receiver does not accept): not a bad frame.
    decodable: bool,
    n_keys: usize,
    seq: Option<u64>,
}

fn bad(what: &'static str, bytes: Vec<u8>) -> Bad {
    Bad {
        what,
        bytes,
        decodable: false,
        n_keys: 1,
        seq: None,
    }
}

/// A map `{type: AllocRequest, ...}` with custom fields, written by hand.
/// Writes one field value.
type Field<'a> = (&'a str, &'a dyn Fn(&mut Vec<u8>));

fn alloc_map(fields: &[Field<'_>]) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_map_len(&mut b, fields.len() as u32 + 1).unwrap();
    rmp::encode::write_str(&mut b, "type").unwrap();
    rmp::encode::write_str(&mut b, "AllocRequest").unwrap();
    for (name, value) in fields {
        rmp::encode::write_str(&mut b, name).unwrap();
        value(&mut b);
    }
    b
}

fn str_array(b: &mut Vec<u8>, n: usize) {
    rmp::encode::write_array_len(b, n as u32).unwrap();
    for i in 0..n {
        rmp::encode::write_str(b, &format!("k{i}")).unwrap();
    }
}

fn rogue_frames() -> Vec<Bad> {
    let mut v = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x006b_7666_6572_7279);
    for _ in 0..5 {
        let len = rng.random_range(1..200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        v.push(bad("random bytes", bytes));
    }
    v.push(bad("empty payload", Vec::new()));
    let good = encode(&alloc("t", &keys("t", 3), 3, true, Some(77)));
    v.push(Bad {
        n_keys: 3, // the keys array is complete in the first half
        ..bad("truncated AllocRequest", good[..good.len() - 20].to_vec())
    });
    let mut trailing = good.clone();
    trailing.extend_from_slice(&[0x01, 0x02]);
    v.push(Bad {
        n_keys: 3,
        seq: Some(77),
        ..bad("trailing bytes", trailing)
    });
    v.push(bad("not a map: array", vec![0x93, 0x01, 0x02, 0x03]));
    v.push(bad("not a map: str", vec![0xa3, b'a', b'b', b'c']));
    v.push(bad("not a map: int", vec![0x2a]));
    v.push(bad(
        "invalid marker",
        vec![0x81, 0xa4, b't', b'y', b'p', b'e', 0xc1],
    ));
    v.push(bad("unknown type", {
        let mut b = Vec::new();
        rmp::encode::write_map_len(&mut b, 1).unwrap();
        rmp::encode::write_str(&mut b, "type").unwrap();
        rmp::encode::write_str(&mut b, "Bogus").unwrap();
        b
    }));
    v.push(bad("no type", {
        let mut b = Vec::new();
        rmp::encode::write_map_len(&mut b, 1).unwrap();
        rmp::encode::write_str(&mut b, "keys").unwrap();
        rmp::encode::write_array_len(&mut b, 0).unwrap();
        b
    }));
    v.push(bad(
        "missing required field",
        alloc_map(&[("keys", &|b| str_array(b, 1))]),
    ));
    v.push(Bad {
        seq: Some(42),
        ..bad(
            "wrong field type (keys is an int)",
            alloc_map(&[
                ("keys", &|b| {
                    rmp::encode::write_uint(b, 5).map(drop).unwrap()
                }),
                ("fmt", &|b| rmp::encode::write_uint(b, 1).map(drop).unwrap()),
                ("shape", &|b| {
                    rmp::encode::write_array_len(b, 1).unwrap();
                    rmp::encode::write_uint(b, 1024).unwrap();
                }),
                ("dtype", &|b| rmp::encode::write_str(b, "uint8").unwrap()),
                ("last_chunk_toks", &|b| {
                    rmp::encode::write_uint(b, 1).map(drop).unwrap()
                }),
                ("seq", &|b| {
                    rmp::encode::write_uint(b, 42).map(drop).unwrap()
                }),
            ]),
        )
    });
    v.push(Bad {
        n_keys: 3,
        seq: Some(43),
        ..bad(
            "negative total_chunks",
            alloc_map(&[
                ("keys", &|b| str_array(b, 3)),
                ("fmt", &|b| rmp::encode::write_uint(b, 1).map(drop).unwrap()),
                ("shape", &|b| {
                    rmp::encode::write_array_len(b, 1).unwrap();
                    rmp::encode::write_uint(b, 1024).unwrap();
                }),
                ("dtype", &|b| rmp::encode::write_str(b, "uint8").unwrap()),
                ("last_chunk_toks", &|b| {
                    rmp::encode::write_uint(b, 1).map(drop).unwrap()
                }),
                ("req_id", &|b| rmp::encode::write_str(b, "neg").unwrap()),
                ("total_chunks", &|b| {
                    rmp::encode::write_sint(b, -5).map(drop).unwrap()
                }),
                ("seq", &|b| {
                    rmp::encode::write_uint(b, 43).map(drop).unwrap()
                }),
            ]),
        )
    });
    v.push(bad(
        "too many keys",
        encode(&alloc("many", &keys("m", MAX_KEYS + 1), 100, true, None)),
    ));
    v.push(bad("huge declared keys array", {
        let mut b = Vec::new();
        rmp::encode::write_map_len(&mut b, 2).unwrap();
        rmp::encode::write_str(&mut b, "type").unwrap();
        rmp::encode::write_str(&mut b, "AllocRequest").unwrap();
        rmp::encode::write_str(&mut b, "keys").unwrap();
        b.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0xa1, b'k']);
        b
    }));
    // A frame above `max_frame_bytes` never reaches the decoder: the ROUTER's
    // ZMQ_MAXMSGSIZE drops the connection before buffering it (tested in
    // tests/hostile_ctrl.rs). The largest frame that may be decoded still
    // gets its error.
    v.push(bad("frame at the size limit", vec![0x90; MAX_FRAME]));
    v.push(bad("deep nesting", {
        let mut b = vec![0x81, 0xa1, b'x'];
        b.extend([0x91; 100]);
        b.push(0x01);
        b
    }));
    v.push(Bad {
        decodable: true,
        ..bad(
            "AllocResponse sent to a receiver",
            encode(&Message::AllocResponse(AllocResponse::ok(
                vec![1],
                vec![],
                None,
            ))),
        )
    });
    v.push(Bad {
        decodable: true,
        ..bad(
            "ProxyNotif sent to a receiver",
            encode(&Message::ProxyNotif(ProxyNotif { req_id: "p".into() })),
        )
    });
    v.push(Bad {
        decodable: true,
        ..bad(
            "HelloAck sent to a receiver",
            encode(&Message::HelloAck(HelloAck {
                receiver_id: "x".into(),
                version: 1,
                transport: "shm".into(),
                descriptor: Descriptor::None,
                chunk_bytes: 1,
                capacity_chunks: 1,
                control: None,
            })),
        )
    });
    v
}

#[test]
fn malformed_frames_get_errors_and_leave_a_good_client_alone() {
    let mut cfg = config(16);
    cfg.limits = Limits {
        max_keys: MAX_KEYS,
        max_frame_bytes: MAX_FRAME,
        ..Limits::default()
    };
    let r = start(cfg);
    let frames = rogue_frames();
    let undecodable = frames.iter().filter(|b| !b.decodable).count() as u64;
    std::thread::scope(|scope| {
        let good = scope.spawn(|| {
            let c = Client::connect(r.endpoint(), "good");
            for i in 0..50u64 {
                let req = format!("good-{i}");
                let ks = keys(&format!("{req}-"), 3);
                let b1 = c.call(&alloc(&req, &ks[..2], 3, false, Some(2 * i)), &req);
                assert_eq!(b1.seq, Some(2 * i));
                assert_ok(&b1, 2);
                let b2 = c.call(&alloc(&req, &ks[2..], 3, true, Some(2 * i + 1)), &req);
                assert_eq!(b2.seq, Some(2 * i + 1));
                assert_ok(&b2, 1);
                for k in &ks {
                    assert!(r.remove(k), "{k} held");
                }
            }
            assert!(!c.has_pending(), "stray reply to the good client");
        });
        let rogue = Client::connect(r.endpoint(), "rogue");
        for round in 0..3 {
            for b in &frames {
                rogue.send_raw(&b.bytes);
                let what = format!("the reply to a {} frame (round {round})", b.what);
                let rep = rogue.recv_reply(deadline(), &what);
                assert_eq!(
                    rep.code.as_deref(),
                    Some(ErrorCode::BadMessage.as_str()),
                    "{what}: {rep:?}"
                );
                assert_eq!(rep.remote_indexes, vec![-1; b.n_keys], "{what}: {rep:?}");
                assert_eq!(rep.seq, b.seq, "{what}: seq hint");
                assert!(rep.error.is_some(), "{what}: error text");
            }
        }
        good.join().expect("good client thread");
        assert!(!rogue.has_pending(), "one reply per rogue frame");
    });
    let s = r.stats();
    assert_eq!(s.bad_frames, 3 * undecodable, "{s:?}");
    assert_eq!(
        s.core.errors_total.get("bad_message").copied(),
        Some(3 * frames.len() as u64),
        "{s:?}"
    );
    assert_eq!(s.core.requests_total.get("completed"), Some(&50));
    assert_idle(&r);
}

#[test]
fn a_dealer_without_delimiter_is_answered_without_one() {
    let r = start(config(4));
    let c = Client::connect(r.endpoint(), "no-delim");
    c.send_frames(&[&encode(&alloc("", &keys("n", 1), 0, false, Some(3)))]);
    let frames = c.recv_frames(deadline(), "reply without delimiter");
    assert_eq!(frames.len(), 1, "reply mirrors the sender's envelope");
    match kvferry::protocol::decode(&frames[0]).expect("reply decodes") {
        Message::AllocResponse(rep) => {
            assert_eq!(rep.seq, Some(3));
            assert_ok(&rep, 1);
        }
        other => panic!("expected AllocResponse, got {other:?}"),
    }
    // Garbage in the same envelope gets an error the same way.
    c.send_frames(&[b"\xc1"]);
    let frames = c.recv_frames(deadline(), "error reply without delimiter");
    assert_eq!(frames.len(), 1);
    match kvferry::protocol::decode(&frames[0]).expect("reply decodes") {
        Message::AllocResponse(rep) => {
            assert_eq!(rep.error_code(), Some(ErrorCode::BadMessage));
        }
        other => panic!("expected AllocResponse, got {other:?}"),
    }
    assert!(r.remove("n0"));
    assert_idle(&r);
    assert_eq!(r.stats().bad_frames, 1);
}
