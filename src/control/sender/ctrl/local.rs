//! ctrl's move of a receiver's control messages to its same-host socket
//! (a method group of [`Ctrl`]). A kvferry receiver that answers `Hello`
//! with the shm data plane may name an `ipc://` endpoint of its own socket
//! (`HelloAck::control`): a sender that could open the buffer file is on
//! that host, so it says `Hello` again there, on a fresh socket whose
//! identity still names the endpoint it was given, and from then on every
//! AllocRequest, reply and `TransferDone` of that receiver crosses a Unix
//! socket instead of the loopback TCP stack. The receiver forgets the
//! first socket's state when the second says `Hello` (same identity stem).
//! Only from a `tcp://` endpoint (`ipc://` and `inproc://` ones already
//! skip the TCP stack). Tried once per receiver: a `Hello` unanswered there
//! within `hello_timeout` (another mount namespace, a path this process may
//! not reach), or answered by a receiver with another `receiver_id`, goes
//! back to the given endpoint for good.

use std::time::Instant;

use tracing::debug;

use crate::protocol::HelloAck;

use super::Ctrl;

/// The data plane whose `HelloAck` may move the control messages: only
/// reaching its file proves the receiver is on this host.
const LOCAL_TRANSPORT: &str = "shm";

impl Ctrl {
    /// On a usable `HelloAck` from peer `i`: if it offers a same-host
    /// endpoint this peer has not tried, moves the peer's socket there and
    /// says `Hello` again (the data plane is connected on that `Hello`'s
    /// answer instead). True if it did (the `HelloAck` is then dropped).
    pub(super) fn move_to_local_control(&mut self, i: usize, ack: &HelloAck) -> bool {
        let p = &self.peers[i];
        let Some(control) = ack.control.as_deref() else {
            return false;
        };
        if p.local_receiver.is_some()
            || ack.transport != LOCAL_TRANSPORT
            || self.shared.cfg.transport != LOCAL_TRANSPORT
            || !control.starts_with("ipc:///")
            || !p.endpoint.starts_with("tcp://")
        {
            return false;
        }
        debug!(endpoint = %p.endpoint, control, "receiver on this host: control over its Unix socket");
        self.peers[i].route = Some(control.to_owned());
        self.peers[i].local_receiver = Some(ack.receiver_id.clone());
        self.hello_again(i);
        true
    }

    /// A `HelloAck` on the same-host endpoint from another receiver than
    /// the one that offered it (a socket file taken over, a receiver
    /// naming another's): back to the endpoint it was given, with a new
    /// `Hello`. True if it applied (the `HelloAck` is then dropped).
    pub(super) fn local_control_mismatch(&mut self, i: usize, ack: &HelloAck) -> bool {
        let p = &self.peers[i];
        if p.route.is_none() || p.local_receiver.as_deref() == Some(ack.receiver_id.as_str()) {
            return false;
        }
        debug!(endpoint = %p.endpoint, receiver = %ack.receiver_id, "another receiver on the same-host endpoint: back to the one given");
        self.back_to_given(i);
        true
    }

    /// A handshaking peer whose `Hello` on the receiver's same-host
    /// endpoint was not answered in time (`Peer::local_hello_timed_out`):
    /// back to the endpoint it was given, with a new `Hello`.
    pub(super) fn local_control_unanswered(&mut self, i: usize, now: Instant) {
        let p = &self.peers[i];
        if !p.local_hello_timed_out(now, &self.limits) {
            return;
        }
        debug!(endpoint = %p.endpoint, "no answer on the receiver's same-host endpoint: back to the one given");
        self.back_to_given(i);
    }

    /// Forgets peer `i`'s same-host route and says `Hello` again on the
    /// endpoint it was given (for good: `local_receiver` stays set, so
    /// [`move_to_local_control`](Self::move_to_local_control) does not
    /// try again).
    fn back_to_given(&mut self, i: usize) {
        self.peers[i].route = None;
        self.hello_again(i);
    }

    /// Drops what the last `Hello` prepared and says `Hello` again on a new
    /// socket to the peer's current route (`Ctrl::hello_on_new_socket`).
    fn hello_again(&mut self, i: usize) {
        if let Some(d) = self.peers[i].prepared.take() {
            self.poster.discard_prepared(&d);
        }
        self.hello_on_new_socket(i);
    }
}
