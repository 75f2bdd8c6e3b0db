//! ctrl's handshake with each receiver: connecting and saying `Hello`, the
//! LMCache fallback, a late `HelloAck`, and the re-handshake after a lost
//! data plane (a method group of [`Ctrl`]; the protocol state of requests is
//! the sender core's).

use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::protocol::{
    decode, encode_into, AllocResponse, ErrorCode, Hello, Message, PROTOCOL_VERSION,
};
use crate::transport::{PeerIndex, RemoteBuffer};
use crate::zmq_io::readable;

use super::super::peer::{Mode, Outstanding, Peer};
use super::super::table::{ReqKey, ReqState};
use super::{Ctrl, OLD_SOCKET_LINGER_MS};

impl Ctrl {
    /// The peer for `endpoint`, connecting (and saying Hello) on first use.
    pub(super) fn peer_for(&mut self, endpoint: &str) -> Result<usize, String> {
        if let Some(&i) = self.peer_by_endpoint.get(endpoint) {
            return Ok(i);
        }
        let token = self.peers.len();
        let mut peer = Peer::connect(&self.shared.cfg.sender_id, endpoint, 0, self.now)
            .map_err(|e| format!("cannot connect to receiver {endpoint}: {e}"))?;
        if let Err(e) = self.reactor.register(&peer.sock, token) {
            return Err(format!(
                "cannot watch the socket of receiver {endpoint}: {e}"
            ));
        }
        if self.shared.cfg.use_extensions {
            self.say_hello(&mut peer);
        } else {
            self.become_legacy(&mut peer);
        }
        self.peers.push(peer);
        self.peer_by_endpoint.insert(endpoint.to_owned(), token);
        Ok(token)
    }

    /// Sends `Hello` carrying the descriptor the data plane prepared for
    /// this receiver (shm, tcp: none; rdma: a queue pair made for it), which
    /// the peer keeps for the `HelloAck`.
    pub(super) fn say_hello(&mut self, peer: &mut Peer) {
        peer.last_hello = Some(self.now);
        let descriptor = match self.poster.prepare() {
            Ok(d) => d,
            Err(e) => {
                peer.mode = Mode::Failed(format!(
                    "data plane to {}: cannot prepare the {} transport for it: {e}",
                    peer.endpoint, self.shared.cfg.transport
                ));
                return;
            }
        };
        let hello = Message::Hello(Hello {
            sender_id: self.shared.cfg.sender_id.clone(),
            version: PROTOCOL_VERSION,
            transport: self.shared.cfg.transport.clone(),
            descriptor: descriptor.clone(),
        });
        self.buf.clear();
        encode_into(&hello, &mut self.buf);
        peer.prepared = Some(descriptor);
        if let Err(e) = peer.send_raw(&self.buf) {
            peer.mode = Mode::Failed(format!("cannot send Hello to {}: {e}", peer.endpoint));
            self.discard_prepared(peer);
        }
    }

    /// Releases what was prepared for a receiver whose `Hello` will not be
    /// answered with a usable `HelloAck`.
    pub(super) fn discard_prepared(&mut self, peer: &mut Peer) {
        if let Some(d) = peer.prepared.take() {
            self.poster.discard_prepared(&d);
        }
    }

    /// Switches a peer to LMCache mode with its statically configured buffer.
    pub(super) fn become_legacy(&mut self, peer: &mut Peer) {
        self.discard_prepared(peer);
        let Some(remote) = self.static_peers.get(&peer.endpoint).cloned() else {
            peer.mode = Mode::Failed(no_static_buffer(&peer.endpoint, ""));
            return;
        };
        match self.poster.connect(&remote) {
            Ok(index) => {
                peer.index = Some(index);
                peer.remote = Some(remote);
                peer.mode = Mode::Legacy;
                debug!(endpoint = %peer.endpoint, "receiver in LMCache mode (no Hello)");
            }
            Err(e) => peer.mode = Mode::Failed(format!("data plane to {}: {e}", peer.endpoint)),
        }
    }

    /// Replaces a peer's socket so late replies to the old one are shed.
    /// False if no new socket could be made (the old one stays).
    pub(super) fn renew_socket(&mut self, i: usize) -> bool {
        self.replace_socket(i).is_some()
    }

    /// [`renew_socket`](Self::renew_socket), handing back the old socket
    /// (no longer watched) instead of closing it.
    pub(super) fn replace_socket(&mut self, i: usize) -> Option<zmq::Socket> {
        let gen = self.peers[i].generation + 1;
        match Peer::socket(
            &self.shared.cfg.sender_id,
            &self.peers[i].endpoint,
            self.peers[i].route.as_deref(),
            gen,
        ) {
            Ok(sock) => {
                let _ = self.reactor.deregister(&self.peers[i].sock);
                let _ = self.reactor.register(&sock, i);
                let old = std::mem::replace(&mut self.peers[i].sock, sock);
                self.peers[i].generation = gen;
                Some(old)
            }
            Err(e) => {
                warn!(error = %e, "cannot renew the receiver socket");
                None
            }
        }
    }

    /// After a `Hello` timed out: keeps its socket listening until `until`
    /// for a late `HelloAck`, with what was prepared for it.
    pub(super) fn listen_late(
        &mut self,
        i: usize,
        old: Option<zmq::Socket>,
        prepared: Option<crate::protocol::Descriptor>,
        until: Instant,
    ) {
        match (old, prepared) {
            (Some(sock), Some(prepared)) => {
                // Watched so a late answer wakes this thread.
                let _ = self.reactor.register(&sock, i);
                self.peers[i].late = Some(super::super::peer::LateHello {
                    sock,
                    prepared,
                    until,
                    ack: None,
                });
            }
            (_, Some(prepared)) => self.poster.discard_prepared(&prepared),
            _ => {}
        }
    }

    /// Reads what arrived on the sockets of timed-out `Hello`s: a
    /// `HelloAck` offering our transport is kept; anything else (an LMCache
    /// receiver's late answer to a message it does not know) is shed.
    pub(super) fn read_late_hellos(&mut self) {
        let transport = self.shared.cfg.transport.clone();
        for p in &mut self.peers {
            let Some(late) = p.late.as_mut() else {
                continue;
            };
            let mut n = 0;
            while n < 16 && readable(&late.sock) {
                let Ok(frames) = late.sock.recv_multipart(zmq::DONTWAIT) else {
                    break;
                };
                n += 1;
                match frames.last().map(|f| decode(f)) {
                    Some(Ok(Message::HelloAck(ack))) if ack.transport == transport => {
                        debug!(endpoint = %p.endpoint, "HelloAck after the hello timeout");
                        late.ack = Some(ack);
                    }
                    other => debug!(?other, "late answer to a timed-out Hello shed"),
                }
            }
        }
    }

    /// Upgrades peers whose `HelloAck` came after the hello timeout to
    /// kvferry mode, once they are idle (LMCache mode: no message
    /// outstanding, no request being transferred; or failed for want of a
    /// static descriptor). Stops listening once the window passed or a
    /// newer handshake took over. True if any peer was upgraded.
    pub(super) fn apply_late_hellos(&mut self, now: Instant) -> bool {
        let mut any = false;
        for i in 0..self.peers.len() {
            let Some(late) = self.peers[i].late.as_ref() else {
                continue;
            };
            let p = &self.peers[i];
            let superseded = matches!(
                p.mode,
                Mode::Handshaking(_) | Mode::Extended | Mode::Reconnecting
            );
            let expired = late.ack.is_none() && now >= late.until;
            if superseded || expired {
                if let Some(late) = self.peers[i].late.take() {
                    let _ = self.reactor.deregister(&late.sock);
                    self.poster.discard_prepared(&late.prepared);
                }
                continue;
            }
            let idle = match p.mode {
                Mode::Legacy => p.in_order.is_idle() && p.turn.is_free(),
                _ => true, // Failed
            };
            if late.ack.is_none() || !idle {
                continue;
            }
            let Some(late) = self.peers[i].late.take() else {
                continue;
            };
            let _ = self.reactor.deregister(&late.sock);
            let Some(ack) = late.ack else { continue };
            let remote = RemoteBuffer {
                descriptor: ack.descriptor.clone(),
                chunk_bytes: ack.chunk_bytes,
                capacity_chunks: ack.capacity_chunks,
            };
            match self.poster.connect_prepared(&late.prepared, &remote) {
                Ok(index) => {
                    let per_pair = late.prepared != crate::protocol::Descriptor::None;
                    let old = {
                        let p = &mut self.peers[i];
                        p.rehandshake |= per_pair;
                        p.retry_hello = false;
                        p.remote = Some(remote);
                        p.mode = Mode::Extended;
                        p.index.replace(index)
                    };
                    if let Some(old) = old {
                        // The static (LMCache-mode) connection: idle, so no
                        // write of it is in flight.
                        self.poster.disconnect(old);
                    }
                    debug!(endpoint = %self.peers[i].endpoint, receiver = %ack.receiver_id, "late HelloAck: the receiver speaks kvferry");
                    self.dirty_peer(i);
                    any = true;
                }
                Err(e) => {
                    self.poster.discard_prepared(&late.prepared);
                    warn!(endpoint = %self.peers[i].endpoint, error = %e, "late HelloAck, but its data plane cannot be connected");
                }
            }
        }
        any
    }

    /// The peers whose data plane was lost (`apply_completions` saw
    /// `ConnectionLost` completions on `indices`) and that re-handshake:
    /// connected through a `Hello`-negotiated data plane (`rehandshake`)
    /// and still `Extended` on that index. They become `Reconnecting`.
    /// Losses on shm and tcp peers, and stale ones, are ignored.
    pub(super) fn mark_lost(&mut self, indices: &[PeerIndex]) -> Vec<usize> {
        let mut lost = Vec::new();
        for (i, p) in self.peers.iter_mut().enumerate() {
            let hit = p.index.is_some_and(|x| indices.contains(&x));
            if hit && p.rehandshake && p.mode == Mode::Extended {
                debug!(endpoint = %p.endpoint, peer = ?p.index, "data plane lost; will re-handshake");
                p.mode = Mode::Reconnecting;
                lost.push(i);
            }
        }
        lost
    }

    /// The requests a loss fails: those live, to the peers that lost their
    /// data plane (`mark_lost`'s result), when the loss is found. Taken
    /// then, not when [`abort_lost`](Self::abort_lost) runs a round later:
    /// a request begun in between (its caller may have begun it on learning
    /// of the loss from a request that round ended) has nothing on the lost
    /// data plane and waits for the re-handshake instead.
    pub(super) fn lost_victims(&self, lost: &[usize]) -> Vec<(usize, ReqKey)> {
        if lost.is_empty() {
            return Vec::new();
        }
        let t = self.shared.table.lock();
        let mut victims = Vec::new();
        for &i in lost {
            let endpoint = &self.peers[i].endpoint;
            victims.extend(
                t.reqs
                    .iter()
                    .filter(|(_, r)| &r.c.receiver == endpoint && r.p.state.live())
                    .map(|(k, _)| (i, k)),
            );
        }
        victims
    }

    /// Fails the `victims` of a lost data plane ([`lost_victims`](Self::lost_victims))
    /// that are still live: their writes cannot land any more, and their
    /// replies would come on the socket the re-handshake replaces. The
    /// usual fenced abort path runs (in-flight writes end first, then
    /// CancelNotif on the old socket).
    pub(super) fn abort_lost(&mut self, victims: Vec<(usize, ReqKey)>) {
        for (i, req) in victims {
            if self.peers[i].mode != Mode::Reconnecting {
                continue;
            }
            let endpoint = self.peers[i].endpoint.clone();
            self.abort(
                req,
                ErrorCode::WriteFailed,
                format!(
                    "the data plane to {endpoint} was lost (connection_lost); the sender re-handshakes with it"
                ),
            );
        }
    }

    /// May peer `i` say `Hello` again now (its data plane was negotiated
    /// through `Hello`, or its last data-plane connect failed, and the last
    /// `Hello` is at least `rehello_backoff` ago)?
    pub(super) fn rehello_allowed(&self, i: usize, now: Instant) -> bool {
        self.peers[i].rehello_allowed(now, self.limits.rehello_backoff)
    }

    /// Re-handshakes every `Reconnecting` peer whose aborted requests have
    /// all ended (fenced) and whose backoff has passed. True if any did.
    pub(super) fn rehello_due(&mut self, now: Instant) -> bool {
        let mut any = false;
        for i in 0..self.peers.len() {
            if self.peers[i].mode != Mode::Reconnecting || !self.rehello_allowed(i, now) {
                continue;
            }
            let ep = &self.peers[i].endpoint;
            let aborting = self
                .shared
                .table
                .lock()
                .reqs
                .values()
                .any(|r| &r.c.receiver == ep && matches!(r.p.state, ReqState::Aborting(_)));
            if !aborting {
                self.rehello(i);
                any = true;
            }
        }
        any
    }

    /// Starts a new handshake with peer `i` (after a lost data plane, or
    /// to retry after a refused re-handshake): forgets the old data plane
    /// (`Poster::disconnect`), replaces the socket so late replies to the old
    /// one are shed, prepares a fresh descriptor and says `Hello`. Requests
    /// for the peer wait for the `HelloAck` as for a new receiver.
    pub(super) fn rehello(&mut self, i: usize) {
        debug!(endpoint = %self.peers[i].endpoint, "re-handshaking");
        // Batches still waiting for a reply belong to aborted requests: the
        // replies will not be read, so release their data now.
        let outstanding: Vec<Outstanding> =
            self.peers[i].by_seq.drain().map(|(_, (o, _))| o).collect();
        for o in outstanding {
            if let Outstanding::Batch(id) = o {
                let resp = AllocResponse::failure(
                    1,
                    None,
                    ErrorCode::PeerUnavailable,
                    "the data plane to the receiver was lost",
                );
                self.on_batch_reply(i, id, resp);
            }
        }
        if let Some(index) = self.peers[i].index.take() {
            self.poster.disconnect(index);
        }
        self.peers[i].remote = None;
        // What is queued on the old socket (CancelNotifs) still goes out.
        let _ = self.peers[i].sock.set_linger(OLD_SOCKET_LINGER_MS);
        self.hello_on_new_socket(i);
    }

    /// Replaces peer `i`'s socket (to its current route) and says `Hello`
    /// on the new one; requests for the peer wait for the `HelloAck`. If
    /// no socket could be made the peer fails (its waiting requests with
    /// it; a later request retries after the re-Hello backoff) and forgets
    /// its same-host route.
    pub(super) fn hello_on_new_socket(&mut self, i: usize) {
        if !self.renew_socket(i) {
            let ep = &self.peers[i].endpoint;
            self.peers[i].mode = Mode::Failed(format!("cannot open a new socket to receiver {ep}"));
            self.peers[i].last_hello = Some(self.now);
            self.peers[i].route = None;
            self.dirty_peer(i);
            return;
        }
        let mut p = self.peers.swap_remove(i);
        p.mode = Mode::Handshaking(self.now);
        self.say_hello(&mut p);
        self.peers.push(p);
        let last = self.peers.len() - 1;
        self.peers.swap(i, last);
        // Waiting requests fail at once if the Hello could not go out.
        self.dirty_peer(i);
    }

    /// A receiver with no LMCache fallback (no static descriptor) left its
    /// `Hello` unanswered for `limit` (`hello_answer_timeout`;
    /// `hello_timeout` only decides when a receiver that *has* a
    /// fallback is taken for an LMCache one, so a slow kvferry receiver,
    /// e.g. one still registering memory, is waited for and its late
    /// `HelloAck` connects it). Its waiting requests fail; a request after
    /// `rehello_backoff` tries a new `Hello`.
    pub(super) fn hello_unanswered(&mut self, i: usize, now: Instant, limit: Duration) {
        let mut p = self.peers.swap_remove(i);
        self.discard_prepared(&mut p);
        p.mode = Mode::Failed(no_static_buffer(&p.endpoint, &format!(" within {limit:?}")));
        p.retry_hello = true;
        p.last_hello = Some(now);
        self.peers.push(p);
        let last = self.peers.len() - 1;
        self.peers.swap(i, last);
        self.renew_socket(i);
        self.dirty_peer(i);
    }
}

/// Why requests to a receiver that did not answer `Hello` (`waited`: e.g.
/// `" within 5s"`) fail when no static buffer is configured for it, and
/// what would address it.
fn no_static_buffer(endpoint: &str, waited: &str) -> String {
    format!(
        "receiver at {endpoint} did not answer Hello{waited} (an LMCache receiver?) and no static buffer \
         descriptor is configured for it: give it a kvferry shm buffer file (`kvferry sender \
         --static-buffer {endpoint}=PATH`, TOML static_buffers, or SenderConfig::static_peers); \
         kvferry cannot write into an LMCache receiver's own buffer (NIXL)"
    )
}
