//! Callers stopping a request: cancel and stop (its life word, its cancel
//! token, ctrl told through the submission ring, no table lock), and the
//! error a caller of a stopped request gets (a method group of `Shared`).

use std::sync::atomic::Ordering;

use super::completion::Signal;
use super::{life, request, submit, Shared, StoreError};

impl Shared {
    /// Why a request stopped taking batches, as the caller sees it:
    /// [`StoreError::Cancelled`] only for a cancel; a failure (or any ended
    /// request) is [`StoreError::RequestEnded`] with the status it ends with.
    /// The one mapping for every wait that a request's cancel token ends.
    /// Without the table lock: the request's terminal status, else its life
    /// word. Whoever fires the token set the word before (a caller's CAS,
    /// or ctrl's, whose status is published by that CAS's Release), and the
    /// token's SeqCst flag, which this caller saw fired, orders it after.
    pub(crate) fn stopped(signal: &Signal) -> StoreError {
        if let Some(s) = signal.terminal() {
            return StoreError::RequestEnded(s.clone());
        }
        match signal.life.state() {
            life::State::Stopped(life::Stop::Cancel) => StoreError::Cancelled,
            life::State::Stopped(stop) => StoreError::RequestEnded(stop.status()),
            life::State::Aborted(Some(s)) => StoreError::RequestEnded(s.clone()),
            // Live with a fired token, or completed: cannot happen (only
            // stops fire the token, a completed request is terminal first).
            life::State::Aborted(None) | life::State::Live | life::State::Completed => {
                StoreError::Cancelled
            }
        }
    }

    /// Cancels request `c`; true iff this call stopped a live request.
    pub(super) fn cancel(&self, c: &request::Common, outbox: Option<&submit::Outbox>) -> bool {
        self.stop(c, life::Stop::Cancel, outbox)
    }

    /// A caller stops request `c` (see `life.rs`): true iff this call took
    /// it out of its live phase (then it ends with `stop`'s status, whatever
    /// ctrl was about to do). Then wakes the request's waiters and tells
    /// ctrl: the key through the submission ring (`outbox`, or an end of it
    /// cloned for this call), or, if the ring is full, the overflow flag;
    /// then `wake_ctrl`. Why that is enough: the CAS that won is before the
    /// ring push (Release) or the flag store, which ctrl's pop or flag swap
    /// (Acquire) reads before it reads the word; a push or flag ctrl missed
    /// before parking is caught by the Dekker handshake of `wake_ctrl`
    /// (ctrl re-checks the ring and the flag after publishing
    /// `ctrl_parked`). No table lock, no wait.
    pub(super) fn stop(
        &self,
        c: &request::Common,
        stop: life::Stop,
        outbox: Option<&submit::Outbox>,
    ) -> bool {
        if !c.signal.life.stop(stop) {
            return false;
        }
        c.cancel.cancel();
        c.signal.wake();
        let sent = match outbox {
            Some(o) => o.attend(c.key),
            None => submit::Outbox::new(self.submit.lock().clone()).attend(c.key),
        };
        if !sent {
            // Release: pairs with ctrl's Acquire swap (it then reads the
            // words this CAS wrote); the Dekker fence is wake_ctrl's.
            self.attention_overflow.store(true, Ordering::Release);
        }
        self.wake_ctrl();
        true
    }
}
