//! The receiver core with a fake [`HelloAcceptor`]: a `Hello` for the
//! acceptor's kind is answered with what `accept` returned, an `accept`
//! error is a typed `peer_unavailable` reply, and the sender's data plane is
//! forgotten when a lease of its requests expires or it says `Hello` again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::core::{CoreConfig, Outcome, Output, ReceiverCore};
use super::HelloAcceptor;
use crate::protocol::{
    AllocRequest, AllocResponse, Descriptor, ErrorCode, Hello, HelloAck, Message,
};

const P: &[u8] = b"peer-a";

#[derive(Debug, Clone, PartialEq)]
enum Call {
    Accept(Descriptor),
    Forget(Descriptor),
}

/// Records every call; `accept` answers with a descriptor derived from the
/// sender's QP number, or fails while `refuse` is set.
#[derive(Debug, Clone, Default)]
struct Fake {
    calls: Arc<Mutex<Vec<Call>>>,
    refuse: Arc<Mutex<Option<String>>>,
}

impl HelloAcceptor for Fake {
    fn kind(&self) -> &'static str {
        "rdma"
    }

    fn accept(&mut self, sender: &Descriptor) -> Result<Descriptor, String> {
        self.calls.lock().push(Call::Accept(sender.clone()));
        if let Some(e) = self.refuse.lock().clone() {
            return Err(e);
        }
        match sender {
            Descriptor::Rdma { qp_num, .. } => Ok(qp(qp_num + 1000)),
            other => Err(format!("not an rdma descriptor: {other:?}")),
        }
    }

    fn forget(&mut self, sender: &Descriptor) {
        self.calls.lock().push(Call::Forget(sender.clone()));
    }
}

fn qp(qp_num: u32) -> Descriptor {
    Descriptor::Rdma {
        qp_num,
        lid: 0,
        gid: vec![0; 16],
        rkey: 7,
        addr: 4096,
        len: 4096,
    }
}

fn cfg() -> CoreConfig {
    CoreConfig {
        receiver_id: "r".into(),
        capacity_chunks: 4,
        chunk_bytes: 1024,
        admission_timeout: Duration::from_secs(60),
        lease: Duration::from_secs(30),
        quarantine_grace: Duration::from_secs(10),
        transport: "shm".into(),
        descriptor: Descriptor::None,
        other_transports: Vec::new(),
        answer_hello: true,
        auto_consume: false,
        bounds: super::bounds::Bounds::default(),
        consume_grace: Duration::from_secs(1),
    }
}

fn core(fake: &Fake, t0: Instant) -> ReceiverCore {
    ReceiverCore::new(cfg(), t0).with_acceptor(Box::new(fake.clone()))
}

fn hello(transport: &str, descriptor: Descriptor) -> Message {
    Message::Hello(Hello {
        sender_id: "s1".into(),
        version: crate::protocol::PROTOCOL_VERSION,
        transport: transport.into(),
        descriptor,
    })
}

/// The one message sent in `out`.
fn sent(out: &mut Vec<Output>) -> Message {
    let mut msgs: Vec<Message> = out
        .drain(..)
        .filter_map(|o| match o {
            Output::Send { message, .. } => Some(message),
            Output::Finished { .. } | Output::ForgetPeer { .. } => None,
        })
        .collect();
    assert_eq!(msgs.len(), 1, "expected one message, got {msgs:?}");
    msgs.remove(0)
}

fn ack(m: Message) -> HelloAck {
    match m {
        Message::HelloAck(a) => a,
        other => panic!("expected a HelloAck, got {other:?}"),
    }
}

fn failure(m: Message) -> AllocResponse {
    match m {
        Message::AllocResponse(r) if r.is_failure() => r,
        other => panic!("expected a failure reply, got {other:?}"),
    }
}

#[test]
fn a_hello_for_the_acceptors_kind_is_answered_with_what_accept_returned() {
    let t0 = Instant::now();
    let fake = Fake::default();
    let mut c = core(&fake, t0);
    let mut out = Vec::new();
    c.handle(P, hello("rdma", qp(5)), t0, &mut out);
    let a = ack(sent(&mut out));
    assert_eq!(a.transport, "rdma");
    assert_eq!(a.descriptor, qp(1005));
    assert_eq!((a.chunk_bytes, a.capacity_chunks), (1024, 4));
    assert_eq!(*fake.calls.lock(), vec![Call::Accept(qp(5))]);
    assert_eq!(c.accepted_senders(), 1);
}

#[test]
fn other_transports_do_not_reach_the_acceptor() {
    let t0 = Instant::now();
    let fake = Fake::default();
    let mut c = core(&fake, t0);
    let mut out = Vec::new();
    c.handle(P, hello("shm", Descriptor::None), t0, &mut out);
    let a = ack(sent(&mut out));
    assert_eq!(
        (a.transport.as_str(), a.descriptor),
        ("shm", Descriptor::None)
    );
    // Not offered at all: the default offer, as without an acceptor.
    c.handle(P, hello("tcp", Descriptor::None), t0, &mut out);
    assert_eq!(ack(sent(&mut out)).transport, "shm");
    assert!(fake.calls.lock().is_empty());
    assert_eq!(c.accepted_senders(), 0);
}

#[test]
fn an_accept_error_is_a_peer_unavailable_reply_with_the_reason() {
    let t0 = Instant::now();
    let fake = Fake::default();
    *fake.refuse.lock() = Some("ibv_modify_qp(RTR): Invalid argument".into());
    let mut c = core(&fake, t0);
    let mut out = Vec::new();
    c.handle(P, hello("rdma", qp(5)), t0, &mut out);
    let r = failure(sent(&mut out));
    assert_eq!(r.code.as_deref(), Some(ErrorCode::PeerUnavailable.as_str()));
    let reason = r.error.unwrap_or_default();
    assert!(
        reason.contains("cannot set up the rdma data plane")
            && reason.contains("ibv_modify_qp(RTR): Invalid argument"),
        "{reason}"
    );
    assert_eq!(c.accepted_senders(), 0, "nothing to forget later");
    // A malformed sender descriptor goes the same way.
    *fake.refuse.lock() = None;
    c.handle(P, hello("rdma", Descriptor::None), t0, &mut out);
    let r = failure(sent(&mut out));
    assert!(r
        .error
        .unwrap_or_default()
        .contains("not an rdma descriptor"));
}

#[test]
fn a_second_hello_forgets_the_first_data_plane() {
    let t0 = Instant::now();
    let fake = Fake::default();
    let mut c = core(&fake, t0);
    let mut out = Vec::new();
    c.handle(P, hello("rdma", qp(5)), t0, &mut out);
    c.handle(P, hello("rdma", qp(6)), t0, &mut out);
    assert_eq!(
        *fake.calls.lock(),
        vec![
            Call::Accept(qp(5)),
            Call::Forget(qp(5)),
            Call::Accept(qp(6))
        ]
    );
    assert_eq!(c.accepted_senders(), 1);
}

#[test]
fn lease_expiry_forgets_the_senders_data_plane() {
    let t0 = Instant::now();
    let fake = Fake::default();
    let mut c = core(&fake, t0);
    let mut out = Vec::new();
    c.handle(P, hello("rdma", qp(5)), t0, &mut out);
    out.clear();
    c.handle(P, first_batch("A", 1), t0, &mut out);
    assert!(!alloc_reply(&mut out).is_failure(), "A admitted");
    c.tick(t0 + Duration::from_secs(10), &mut out);
    assert_eq!(fake.calls.lock().len(), 1, "lease still running");
    c.tick(t0 + Duration::from_secs(60), &mut out);
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Finished {
            outcome: Outcome::Failed(ErrorCode::LeaseExpired),
            ..
        }
    )));
    assert_eq!(
        *fake.calls.lock(),
        vec![Call::Accept(qp(5)), Call::Forget(qp(5))]
    );
    assert_eq!(c.accepted_senders(), 0);
}

/// The first batch (one chunk of two) of request `req_id`, with `seq`.
fn first_batch(req_id: &str, seq: u64) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: vec!["k0".into()],
        fmt: 1,
        shape: vec![1024],
        dtype: "uint8".into(),
        last_chunk_toks: 1024,
        req_id: req_id.into(),
        is_last_batch: false,
        total_chunks: 2,
        seq: Some(seq),
    })
}

/// A `Hello` from sender `sender_id` (the socket identity is separate).
fn hello_from(sender_id: &str, descriptor: Descriptor) -> Message {
    Message::Hello(Hello {
        sender_id: sender_id.into(),
        version: crate::protocol::PROTOCOL_VERSION,
        transport: "rdma".into(),
        descriptor,
    })
}

#[test]
fn a_re_hello_on_a_new_socket_generation_forgets_only_that_senders_earlier_data_plane() {
    // A kvferry sender re-handshakes on a new socket: identity
    // "{sender_id}-to-{endpoint}#{generation}".
    const OLD: &[u8] = b"s1-to-tcp://r:1";
    const NEW: &[u8] = b"s1-to-tcp://r:1#1";
    const NEWER: &[u8] = b"s1-to-tcp://r:1#2";
    const OTHER_ENDPOINT: &[u8] = b"s1-to-tcp://r-alias:1";
    const OTHER_SENDER: &[u8] = b"s2-to-tcp://r:1";
    let t0 = Instant::now();
    let fake = Fake::default();
    let mut c = core(&fake, t0);
    let mut out = Vec::new();
    c.handle(OLD, hello_from("s1", qp(5)), t0, &mut out);
    c.handle(OTHER_ENDPOINT, hello_from("s1", qp(7)), t0, &mut out);
    c.handle(OTHER_SENDER, hello_from("s2", qp(8)), t0, &mut out);
    out.clear();
    // A request admitted under the old identity.
    c.handle(OLD, first_batch("A", 1), t0, &mut out);
    assert!(!alloc_reply(&mut out).is_failure(), "A admitted");
    fake.calls.lock().clear();

    c.handle(NEW, hello_from("s1", qp(6)), t0, &mut out);
    assert_eq!(ack(sent(&mut out)).descriptor, qp(1006));
    assert_eq!(
        *fake.calls.lock(),
        vec![Call::Forget(qp(5)), Call::Accept(qp(6))],
        "the old generation's data plane is forgotten, nobody else's"
    );
    assert_eq!(c.accepted_senders(), 3);

    // The request tracked under the old identity is not broken: the
    // sender's CancelNotif (sent on the old socket) still releases it.
    c.handle(
        OLD,
        Message::CancelNotif(crate::protocol::CancelNotif {
            req_id: "A".into(),
            keys: vec!["k0".into()],
            seq: Some(2),
        }),
        t0,
        &mut out,
    );
    assert!(
        out.iter().any(|o| matches!(
            o,
            Output::Finished {
                outcome: Outcome::Failed(ErrorCode::Cancelled),
                ..
            }
        )),
        "{out:?}"
    );
    out.clear();
    assert_eq!(c.stats().slots_in_use, 0);

    // Generation 2 forgets generation 1 the same way.
    fake.calls.lock().clear();
    c.handle(NEWER, hello_from("s1", qp(9)), t0, &mut out);
    assert_eq!(
        *fake.calls.lock(),
        vec![Call::Forget(qp(6)), Call::Accept(qp(9))]
    );
    assert_eq!(c.accepted_senders(), 3);

    // An identity that only looks like another generation, from another
    // sender_id, forgets nothing of s1's.
    fake.calls.lock().clear();
    c.handle(b"s1-to-tcp://r:1#3", hello_from("s3", qp(10)), t0, &mut out);
    assert_eq!(*fake.calls.lock(), vec![Call::Accept(qp(10))]);
    assert_eq!(c.accepted_senders(), 4);
}

#[test]
fn identity_stems_strip_only_a_numeric_generation_suffix() {
    use super::core::identity_stem;
    assert_eq!(identity_stem(b"s-to-tcp://r:1"), b"s-to-tcp://r:1");
    assert_eq!(identity_stem(b"s-to-tcp://r:1#12"), b"s-to-tcp://r:1");
    assert_eq!(identity_stem(b"s-to-ipc://a#b"), b"s-to-ipc://a#b");
    assert_eq!(identity_stem(b"s-to-x#"), b"s-to-x#");
    assert_eq!(identity_stem(b""), b"");
}

/// The one AllocResponse in `out`.
fn alloc_reply(out: &mut Vec<Output>) -> AllocResponse {
    match sent(out) {
        Message::AllocResponse(r) => r,
        other => panic!("expected an AllocResponse, got {other:?}"),
    }
}
