//! The golden frames: one named data file each in `tests/golden/`
//! (`tests/golden/README.md` says what each is and where its bytes come
//! from), loaded by [`Frame`], and the message each must decode to.

use std::ops::Deref;
use std::sync::OnceLock;

use kvferry::protocol::*;

/// A golden frame: the text of its `.hex` file (compiled in), parsed once.
/// Derefs to the frame's bytes.
pub struct Frame {
    hex: &'static str,
    bytes: OnceLock<Vec<u8>>,
}

impl Frame {
    /// A frame over the text of a `.hex` file.
    pub const fn new(hex: &'static str) -> Self {
        Frame {
            hex,
            bytes: OnceLock::new(),
        }
    }
}

impl Deref for Frame {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes.get_or_init(|| parse_hex(self.hex))
    }
}

/// The bytes a `.hex` file spells: pairs of hex digits, separated by
/// whitespace or not; `#` starts a comment that runs to the end of the line.
pub fn parse_hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(|l| l.bytes().filter(|b| !b.is_ascii_whitespace()))
        .collect();
    assert!(digits.len() % 2 == 0, "odd number of hex digits");
    digits
        .chunks(2)
        .map(|p| {
            let s = std::str::from_utf8(p).expect("ascii");
            u8::from_str_radix(s, 16).unwrap_or_else(|e| panic!("`{s}` is not a hex byte: {e}"))
        })
        .collect()
}

#[test]
fn the_hex_loader_reads_bytes_and_skips_comments() {
    assert_eq!(
        parse_hex("# a comment\n82 a4  # type\nff00\n"),
        vec![0x82, 0xa4, 0xff, 0x00]
    );
}

/// PROTOCOL.md's reference vector, byte for byte.
pub static ALLOC_REQUEST_REF: Frame = Frame::new(include_str!("../golden/alloc_request_ref.hex"));

pub fn alloc_request_ref() -> Message {
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
pub static ALLOC_REQUEST_FULL: Frame = Frame::new(include_str!("../golden/alloc_request_full.hex"));

pub fn alloc_request_full() -> Message {
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
pub static ALLOC_RESPONSE_OK: Frame = Frame::new(include_str!("../golden/alloc_response_ok.hex"));

pub fn alloc_response_ok() -> Message {
    Message::AllocResponse(AllocResponse::ok(vec![0, 5], vec![1], None))
}

/// Issue 12's case, as LMCache's own receiver answers it: 2 keys, key 0
/// held → `AllocResponse(remote_indexes=[2], already_sent_indexes=[0])`.
pub static ALLOC_RESPONSE_DEDUP: Frame =
    Frame::new(include_str!("../golden/alloc_response_dedup.hex"));

pub fn alloc_response_dedup() -> Message {
    Message::AllocResponse(AllocResponse::ok(vec![2], vec![0], None))
}

/// kvferry failure reply: -1 indexes plus seq, error and code.
pub static ALLOC_RESPONSE_FAIL: Frame =
    Frame::new(include_str!("../golden/alloc_response_fail.hex"));

pub fn alloc_response_fail() -> Message {
    Message::AllocResponse(AllocResponse::failure(
        2,
        Some(7),
        ErrorCode::BufferTooSmall,
        "too big",
    ))
}

pub static PROXY_NOTIF: Frame = Frame::new(include_str!("../golden/proxy_notif.hex"));

pub fn proxy_notif() -> Message {
    Message::ProxyNotif(ProxyNotif {
        req_id: "r-1".into(),
    })
}

pub static CANCEL_NOTIF: Frame = Frame::new(include_str!("../golden/cancel_notif.hex"));

pub fn cancel_notif() -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: "r2".into(),
        keys: vec!["a".into(), "b".into()],
        seq: None,
    })
}

pub static CANCEL_NOTIF_SEQ: Frame = Frame::new(include_str!("../golden/cancel_notif_seq.hex"));

pub fn cancel_notif_seq() -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: "r2".into(),
        keys: vec![],
        seq: Some(255),
    })
}

pub static HELLO_SHM: Frame = Frame::new(include_str!("../golden/hello_shm.hex"));

pub fn hello_shm() -> Message {
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

pub static HELLO_NONE: Frame = Frame::new(include_str!("../golden/hello_none.hex"));

pub fn hello_none() -> Message {
    Message::Hello(Hello {
        sender_id: String::new(),
        version: u32::MAX,
        transport: "none".into(),
        descriptor: Descriptor::None,
    })
}

pub static HELLO_ACK_RDMA: Frame = Frame::new(include_str!("../golden/hello_ack_rdma.hex"));

pub fn hello_ack_rdma() -> Message {
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
        control: None,
    })
}

pub static HELLO_ACK_TCP: Frame = Frame::new(include_str!("../golden/hello_ack_tcp.hex"));

pub fn hello_ack_tcp() -> Message {
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
        control: None,
    })
}

/// With the data-connection secret (a kvferry extension of the descriptor,
/// after `addr`).
pub static HELLO_ACK_TCP_SECRET: Frame =
    Frame::new(include_str!("../golden/hello_ack_tcp_secret.hex"));

pub fn hello_ack_tcp_secret() -> Message {
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
        control: None,
    })
}

/// Offering shm with a same-host control endpoint (a kvferry extension
/// field, after `capacity_chunks`; docs/protocol.md, "Local control").
pub static HELLO_ACK_SHM_CONTROL: Frame =
    Frame::new(include_str!("../golden/hello_ack_shm_control.hex"));

pub fn hello_ack_shm_control() -> Message {
    Message::HelloAck(HelloAck {
        receiver_id: "d2".into(),
        version: 1,
        transport: "shm".into(),
        descriptor: Descriptor::Shm {
            path: "/dev/shm/k.buf".into(),
            len: 1 << 20,
        },
        chunk_bytes: 4096,
        capacity_chunks: 256,
        control: Some("ipc:///dev/shm/k.buf.ctl".into()),
    })
}

pub static TRANSFER_DONE: Frame = Frame::new(include_str!("../golden/transfer_done.hex"));

pub fn transfer_done() -> Message {
    Message::TransferDone(TransferDone {
        req_id: "r9".into(),
        seq: Some(u64::MAX),
    })
}

pub static TRANSFER_DONE_NO_SEQ: Frame =
    Frame::new(include_str!("../golden/transfer_done_no_seq.hex"));

pub fn transfer_done_no_seq() -> Message {
    Message::TransferDone(TransferDone {
        req_id: "r9".into(),
        seq: None,
    })
}

pub static HEARTBEAT: Frame = Frame::new(include_str!("../golden/heartbeat.hex"));

pub fn heartbeat() -> Message {
    Message::Heartbeat(Heartbeat {
        sender_id: "p7".into(),
    })
}

pub fn golden() -> Vec<(&'static str, &'static [u8], Message)> {
    vec![
        (
            "AllocRequest (reference vector)",
            &ALLOC_REQUEST_REF[..],
            alloc_request_ref(),
        ),
        (
            "AllocRequest (all fields)",
            &ALLOC_REQUEST_FULL[..],
            alloc_request_full(),
        ),
        (
            "AllocResponse (ok)",
            &ALLOC_RESPONSE_OK[..],
            alloc_response_ok(),
        ),
        (
            "AllocResponse (dedup)",
            &ALLOC_RESPONSE_DEDUP[..],
            alloc_response_dedup(),
        ),
        (
            "AllocResponse (failure)",
            &ALLOC_RESPONSE_FAIL[..],
            alloc_response_fail(),
        ),
        ("ProxyNotif", &PROXY_NOTIF[..], proxy_notif()),
        ("CancelNotif", &CANCEL_NOTIF[..], cancel_notif()),
        (
            "CancelNotif (seq)",
            &CANCEL_NOTIF_SEQ[..],
            cancel_notif_seq(),
        ),
        ("Hello (shm)", &HELLO_SHM[..], hello_shm()),
        ("Hello (none)", &HELLO_NONE[..], hello_none()),
        ("HelloAck (rdma)", &HELLO_ACK_RDMA[..], hello_ack_rdma()),
        ("HelloAck (tcp)", &HELLO_ACK_TCP[..], hello_ack_tcp()),
        (
            "HelloAck (tcp, secret)",
            &HELLO_ACK_TCP_SECRET[..],
            hello_ack_tcp_secret(),
        ),
        (
            "HelloAck (shm, control)",
            &HELLO_ACK_SHM_CONTROL[..],
            hello_ack_shm_control(),
        ),
        ("TransferDone", &TRANSFER_DONE[..], transfer_done()),
        (
            "TransferDone (no seq)",
            &TRANSFER_DONE_NO_SEQ[..],
            transfer_done_no_seq(),
        ),
        ("Heartbeat", &HEARTBEAT[..], heartbeat()),
    ]
}
