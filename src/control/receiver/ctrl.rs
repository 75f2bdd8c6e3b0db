//! The receiver's `ctrl` thread: owns the ROUTER socket, decodes frames,
//! runs them through the core under the lock, and sends the replies.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, debug_span, warn};

use crate::log_budget::LogBudget;
use crate::peer_warn;
use crate::protocol::{decode_with_limits, encode_into, peek_reply_hints, Limits};
use crate::zmq_io::{readable, Reactor};

use super::core::Output;
use super::Shared;

/// Token of the ROUTER socket in the reactor.
pub(super) const SOCKET_TOKEN: usize = 0;

/// Frames handled before the loop looks at timers and the outbox again.
const BATCH: usize = 256;

/// How long the loop sleeps at most with nothing scheduled (a safety net;
/// every state change that matters wakes it sooner).
const IDLE_WAIT: Duration = Duration::from_secs(3600);

/// The envelope of a received message: identity, and whether the sender used
/// the REQ-style empty delimiter frame (replies mirror it).
struct Envelope<'a> {
    identity: &'a [u8],
    delimited: bool,
}

pub(super) fn run(shared: Arc<Shared>, sock: zmq::Socket, mut reactor: Reactor, limits: Limits) {
    let span = debug_span!("receiver_ctrl");
    let _g = span.enter();
    let mut out: Vec<Output> = Vec::new();
    // Peers that send without the empty delimiter frame (the default is
    // with). Only peers the core keeps state for stay in it: an entry is
    // dropped when the core forgets the peer, or after the round if the
    // core never knew it, so a churn of identities leaves nothing behind.
    let mut undelimited: std::collections::HashSet<Vec<u8>> = std::collections::HashSet::new();
    let mut touched: Vec<Vec<u8>> = Vec::new();
    let mut log = LogBudget::new();
    let mut buf = Vec::with_capacity(256);
    // Acquire: pairs with the Release store in `Receiver::stop_and_join`.
    while !shared.stop.load(Ordering::Acquire) {
        // 1. Drain the socket (bounded, so timers and the outbox get a turn).
        let mut handled = 0;
        while handled < BATCH && readable(&sock) {
            let frames = match sock.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => break,
                Err(e) => {
                    warn!(error = %e, "receive failed");
                    break;
                }
            };
            handled += 1;
            let Some(env) = envelope(&frames) else {
                debug!(frames = frames.len(), "frame without identity dropped");
                continue;
            };
            // Allocate only for a peer whose envelope style changed, not on
            // every frame.
            if env.delimited {
                undelimited.remove(env.identity);
            } else if !undelimited.contains(env.identity) {
                undelimited.insert(env.identity.to_vec());
                touched.push(env.identity.to_vec());
            }
            let payload = frames.last().map(Vec::as_slice).unwrap_or(&[]);
            let now = Instant::now();
            let mut st = shared.state.lock();
            match decode_with_limits(payload, &limits) {
                Ok(msg) => st.core.handle(env.identity, msg, now, &mut out),
                Err(e) => {
                    st.bad_frames += 1;
                    debug!(error = %e, "undecodable frame");
                    let hints = peek_reply_hints(payload, &limits);
                    st.core
                        .bad_frame(env.identity, e.to_string(), hints, &mut out);
                }
            }
            if st.absorb(&mut out) {
                shared.finished_cv.notify_all();
            }
        }
        // 2. Timers, and replies queued by decoder threads.
        let next = {
            let now = Instant::now();
            let mut st = shared.state.lock();
            if st.core.next_deadline().is_some_and(|d| d <= now) {
                st.core.tick(now, &mut out);
                if st.absorb(&mut out) {
                    shared.finished_cv.notify_all();
                }
            }
            out.append(&mut st.outbox);
            st.core.next_deadline()
        };
        // 3. Send. Non-blocking: a peer whose reply queue is full (it does
        // not read) or that is gone loses the reply, counted; nobody else
        // waits for it.
        let mut dropped = 0;
        for o in out.drain(..) {
            match o {
                Output::Send { peer, message } => {
                    buf.clear();
                    encode_into(&message, &mut buf);
                    let sent = if undelimited.contains(&peer) {
                        sock.send_multipart([peer.as_slice(), buf.as_slice()], zmq::DONTWAIT)
                    } else {
                        sock.send_multipart([peer.as_slice(), &[], buf.as_slice()], zmq::DONTWAIT)
                    };
                    if let Err(e) = sent {
                        dropped += 1;
                        peer_warn!(log, Instant::now(), error = %e, "reply dropped: the peer's reply queue is full or it is gone");
                    }
                }
                Output::ForgetPeer { peer } => {
                    undelimited.remove(&peer);
                }
                Output::Finished { .. } => {}
            }
        }
        if dropped > 0 || !touched.is_empty() {
            let mut st = shared.state.lock();
            st.replies_dropped += dropped;
            for id in touched.drain(..) {
                if !st.core.has_peer(&id) {
                    undelimited.remove(&id);
                }
            }
        }
        // 4. Sleep until the socket, a waker or the next deadline.
        if readable(&sock) || !shared.state.lock().outbox.is_empty() {
            continue;
        }
        let timeout = next.map_or(IDLE_WAIT, |d| d.saturating_duration_since(Instant::now()));
        if let Err(e) = reactor.wait(Some(timeout)) {
            warn!(error = %e, "poll failed; retrying");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _ = reactor.deregister(&sock);
}

/// Splits `[identity, (b"",)? payload]`.
fn envelope(frames: &[Vec<u8>]) -> Option<Envelope<'_>> {
    match frames {
        [id, empty, _payload] if empty.is_empty() => Some(Envelope {
            identity: id,
            delimited: true,
        }),
        [id, _payload] => Some(Envelope {
            identity: id,
            delimited: false,
        }),
        [id, .., _payload] if frames.len() > 3 => Some(Envelope {
            identity: id,
            delimited: frames[1].is_empty(),
        }),
        _ => None,
    }
}
