//! The receiver's `ctrl` thread: owns the ROUTER socket, decodes frames,
//! runs them through the core under the lock, and sends the replies.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, debug_span, warn};

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
    let mut envelopes: std::collections::HashMap<Vec<u8>, bool> = std::collections::HashMap::new();
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
            // One map entry per peer: insert (allocate) only for a new peer
            // or a changed envelope style, not on every frame.
            if envelopes.get(env.identity) != Some(&env.delimited) {
                envelopes.insert(env.identity.to_vec(), env.delimited);
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
        // 3. Send.
        for o in out.drain(..) {
            if let Output::Send { peer, message } = o {
                buf.clear();
                encode_into(&message, &mut buf);
                let delimited = envelopes.get(&peer).copied().unwrap_or(true);
                let sent = if delimited {
                    sock.send_multipart([peer.as_slice(), &[], buf.as_slice()], zmq::DONTWAIT)
                } else {
                    sock.send_multipart([peer.as_slice(), buf.as_slice()], zmq::DONTWAIT)
                };
                if let Err(e) = sent {
                    warn!(error = %e, "reply could not be sent");
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
