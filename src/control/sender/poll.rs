//! The sender's `poll` thread: transport completions → ctrl. It takes no
//! lock and touches no request state: every completion record it polls
//! from the transport goes, as is, onto an SPSC ring that only the ctrl
//! thread drains (`Ctrl::apply_completions`: writes in flight, staging
//! frees, leases, lost peers, chunk counts), then it wakes ctrl.
//!
//! # Why the ring cannot fill
//! Every entry is the completion of an op ctrl posted and has not applied
//! yet, and ctrl never has more such ops than the ring has room (it caps
//! what it hands the transport by that, `Ctrl::flush_backlog`), so a
//! transport that completes each op once finds room for every completion.
//! The ring is sized by the transport's credits ([`ring_capacity`]), so in
//! normal operation the cap is the transport's own.
//! Should one complete an op twice (a bug), the push waits instead of
//! dropping (see [`hand_over`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_ring::spsc::Producer;
use tracing::{debug_span, warn};

use crate::backoff::{Backoff, Step};
use crate::transport::{Completion, Completions, PollStatus};

use super::Shared;

/// Completions taken from the transport per poll.
const BATCH: usize = 256;

/// Room in the poll → ctrl ring, in completions (16 bytes each), for a
/// transport with `credits` writes in flight at most: also the most ops
/// ctrl keeps posted and not yet applied (module doc). At least the
/// credits (rounded up to a power of two by the ring), so the cap binds
/// only while ctrl lags behind completions the transport already counted
/// back; at least 1024 and at most 2^20 (16 MiB, the transports' own
/// largest ring).
pub(super) fn ring_capacity(credits: usize) -> usize {
    credits.clamp(1024, crate::transport::MAX_RING_CAPACITY)
}

/// How long a push onto a full ring waits before it says so (and waits on).
const FULL_RING_WARN: Duration = Duration::from_secs(1);

pub(super) fn run(
    shared: Arc<Shared>,
    mut completions: Box<dyn Completions>,
    mut to_ctrl: Producer<Completion>,
) {
    let span = debug_span!("sender_poll", sender = %shared.cfg.sender_id);
    let _g = span.enter();
    let mut buf: Vec<Completion> = Vec::with_capacity(BATCH);
    loop {
        buf.clear();
        match completions.poll(&mut buf, BATCH, None) {
            PollStatus::Ready(_) => {}
            PollStatus::TimedOut => continue,
            PollStatus::Closed => break,
        }
        hand_over(&mut to_ctrl, &buf, || shared.wake_ctrl());
        // After the push (Release): the Dekker handshake of `wake_ctrl`
        // with ctrl's pre-sleep check of the ring.
        shared.wake_ctrl();
    }
}

/// Pushes every one of `batch` onto the ring, in order (`wake` wakes
/// ctrl). A full ring waits for ctrl (spin, yield, then 100 µs naps; a
/// warning each [`FULL_RING_WARN`] naming what hangs) and never drops a
/// completion:
/// dropping one would leave its write in flight forever, its staging
/// taken and its request unfinished. The wait ends once ctrl made room, or
/// once ctrl is gone (the ring closed: ctrl's state, and with it the
/// writes these completions are about, went with it, after the transport
/// that could still read their memory).
fn hand_over(to_ctrl: &mut Producer<Completion>, batch: &[Completion], wake: impl Fn()) {
    let mut rest = batch;
    let mut backoff = Backoff::new();
    let mut warn_at = None;
    loop {
        rest = &rest[to_ctrl.push_slice(rest)..];
        if rest.is_empty() || to_ctrl.is_closed() {
            return;
        }
        wake();
        let now = Instant::now();
        let at = *warn_at.get_or_insert(now + FULL_RING_WARN);
        if now >= at {
            warn!(
                waiting = rest.len(),
                capacity = to_ctrl.capacity(),
                "completion ring to ctrl full for {FULL_RING_WARN:?}: ctrl is not draining it"
            );
            warn_at = Some(now + FULL_RING_WARN);
        }
        if backoff.snooze() == Step::ShouldPark {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::CompletionStatus;

    fn batch(n: u64) -> Vec<Completion> {
        (0..n)
            .map(|i| Completion::new(i, CompletionStatus::Ok))
            .collect()
    }

    #[test]
    fn a_full_ring_waits_for_room_and_loses_no_completion() {
        let (mut p, mut c) = kvferry_ring::spsc::channel::<Completion>(4);
        let got = std::thread::spawn(move || {
            let mut got = Vec::new();
            let end = Instant::now() + Duration::from_secs(30);
            while got.len() < 40 {
                assert!(Instant::now() < end, "the pusher hung: got {}", got.len());
                match c.pop() {
                    Some(x) => got.push(x.work_id),
                    // Slower than the pusher: it keeps finding the ring full.
                    None => std::thread::sleep(Duration::from_millis(1)),
                }
            }
            got
        });
        let woken = std::sync::atomic::AtomicUsize::new(0);
        hand_over(&mut p, &batch(40), || {
            woken.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        let got = got.join().expect("consumer");
        assert_eq!(
            got,
            (0..40).collect::<Vec<_>>(),
            "every completion, in order"
        );
        assert!(
            woken.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "a full ring wakes ctrl"
        );
    }

    #[test]
    fn a_closed_ring_ends_the_wait() {
        let (mut p, c) = kvferry_ring::spsc::channel::<Completion>(4);
        drop(c);
        // Returns (ctrl is gone) instead of waiting for room forever.
        hand_over(&mut p, &batch(10), || {});
    }
}
