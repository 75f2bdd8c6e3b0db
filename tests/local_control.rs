//! Local control (docs/protocol.md, "Local control"): a kvferry sender that
//! reached a receiver over the shm data plane moves its control messages
//! from the `tcp://` endpoint it was given to the `ipc://` one the
//! receiver's `HelloAck` names, and goes back when nobody answers there.
//! The hostile side (random `control` offers from a fake receiver) is in
//! `hostile_ctrl.rs`; the binaries' announcement in `cli_receiver.rs`.

mod common_sender;

use std::path::PathBuf;
use std::time::Duration;

use common_sender::*;
use kvferry::receiver::{Receiver, ReceiverConfig};

/// The socket file of an `ipc://` endpoint.
fn socket_path(endpoint: &str) -> PathBuf {
    PathBuf::from(
        endpoint
            .strip_prefix("ipc://")
            .unwrap_or_else(|| panic!("not an ipc endpoint: {endpoint}")),
    )
}

/// Stores and consumes `n` requests named `prefix-i` of 5 chunks (batches
/// of 2) from `s` to `r` through `endpoint`, every byte checked.
fn transfer(s: &kvferry::sender::Sender, r: &Receiver, endpoint: &str, prefix: &str, n: u64) {
    for i in 0..n {
        let req = format!("{prefix}-{i}");
        store_request(s, endpoint, &req, i, 5, 2)
            .unwrap_or_else(|e| panic!("store of {req} over {endpoint} failed: {e}"));
        consume(r, &req, i, 5).unwrap_or_else(|e| panic!("{e}"));
    }
    wait_receiver_empty(r, &format!("after the {prefix} requests were consumed"));
}

/// A receiver with `local_control` binds `ipc://{buffer file}.ctl` and
/// offers it; a sender given its `tcp://` endpoint completes one handshake
/// there (and only one, over several requests), every byte arriving; the
/// file goes with the receiver. Without `local_control` nothing is
/// offered and nothing moves (what fails if the sender moved anyway or
/// the receiver bound the path regardless).
#[test]
fn a_same_host_sender_moves_its_control_messages_to_the_receivers_unix_socket() {
    let receiver = Receiver::start(ReceiverConfig {
        local_control: true,
        ..receiver_cfg(16)
    })
    .expect("receiver starts");
    let control = receiver
        .control_endpoint()
        .expect("a local control endpoint offered")
        .to_owned();
    assert_eq!(
        control,
        format!("ipc://{}.ctl", receiver.shm_path().display()),
        "next to the buffer file"
    );
    let file = socket_path(&control);
    assert!(file.exists(), "{} bound", file.display());
    let s = sender(sender_cfg(8, None));
    let tcp = receiver.endpoint().to_owned();
    assert!(tcp.starts_with("tcp://"), "{tcp}");
    transfer(&s, &receiver, &tcp, "local", 3);
    assert_eq!(
        s.local_control_handshakes(),
        1,
        "the sender said Hello once more, on the receiver's Unix socket, and stayed there"
    );
    drop(s);
    drop(receiver);
    assert!(
        !file.exists(),
        "{} removed with the receiver",
        file.display()
    );

    let plain = Receiver::start(receiver_cfg(16)).expect("receiver starts");
    assert_eq!(
        plain.control_endpoint(),
        None,
        "local_control is off by default"
    );
    let ctl = PathBuf::from(format!("{}.ctl", plain.shm_path().display()));
    assert!(!ctl.exists(), "nothing bound at {}", ctl.display());
    let s = sender(sender_cfg(8, None));
    let tcp = plain.endpoint().to_owned();
    transfer(&s, &plain, &tcp, "plain", 2);
    assert_eq!(
        s.local_control_handshakes(),
        0,
        "nothing offered, nothing moved"
    );
}

/// The offered path cannot be reached (here its file is gone: a sender in
/// another mount namespace sees the same): the `Hello` there goes
/// unanswered, and after `hello_timeout` the sender says `Hello` on the
/// endpoint it was given and completes its requests there, never trying
/// the Unix socket again.
#[test]
fn an_unreachable_local_endpoint_sends_the_sender_back_to_the_given_one() {
    let receiver = Receiver::start(ReceiverConfig {
        local_control: true,
        ..receiver_cfg(16)
    })
    .expect("receiver starts");
    let control = receiver.control_endpoint().expect("offered").to_owned();
    std::fs::remove_file(socket_path(&control)).expect("remove the socket file");
    let s = sender(kvferry::sender::SenderConfig {
        hello_timeout: Duration::from_millis(300),
        ..sender_cfg(8, None)
    });
    let tcp = receiver.endpoint().to_owned();
    transfer(&s, &receiver, &tcp, "back", 3);
    assert_eq!(
        s.local_control_handshakes(),
        0,
        "no handshake completed on the unreachable path"
    );
}

/// A receiver that already listens on an absolute `ipc://` path offers that
/// one (no second socket file), and a sender that was given it stays on it
/// (only a `tcp://` endpoint is left for a Unix socket).
#[test]
fn a_receiver_listening_on_a_unix_path_offers_it_and_a_sender_there_stays() {
    let dir = std::env::temp_dir().join(unique("kvferry-local-control"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let listen = format!("ipc://{}", dir.join("recv.ctl").display());
    let receiver = Receiver::start(ReceiverConfig {
        listen: listen.clone(),
        local_control: true,
        ..receiver_cfg(16)
    })
    .expect("receiver starts");
    assert_eq!(receiver.control_endpoint(), Some(listen.as_str()));
    let extra = PathBuf::from(format!("{}.ctl", receiver.shm_path().display()));
    assert!(!extra.exists(), "no second socket at {}", extra.display());
    let s = sender(sender_cfg(8, None));
    transfer(&s, &receiver, &listen, "ipc", 2);
    assert_eq!(s.local_control_handshakes(), 0, "already on a Unix socket");
    drop(receiver);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The offered path is served by another receiver (the first one's socket
/// file removed and the path taken by a second): the `HelloAck` there names
/// another `receiver_id`, so the sender goes back to the endpoint it was
/// given, and every request lands at the receiver it named, none at the
/// other.
#[test]
fn another_receiver_on_the_offered_path_sends_the_sender_back() {
    let named = Receiver::start(ReceiverConfig {
        local_control: true,
        ..receiver_cfg(16)
    })
    .expect("receiver starts");
    let control = named.control_endpoint().expect("offered").to_owned();
    std::fs::remove_file(socket_path(&control)).expect("remove the socket file");
    let squatter = Receiver::start(ReceiverConfig {
        listen: control.clone(),
        ..receiver_cfg(16)
    })
    .expect("a second receiver takes the free path");
    let s = sender(sender_cfg(8, None));
    let tcp = named.endpoint().to_owned();
    transfer(&s, &named, &tcp, "squat", 3);
    assert_eq!(s.local_control_handshakes(), 0, "no handshake kept there");
    let st = squatter.stats();
    assert_eq!(
        (st.allocated_chunks, st.core.tracked_requests),
        (0, 0),
        "nothing reached the other receiver"
    );
}
