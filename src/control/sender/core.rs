//! The sender's per-request protocol decisions, I/O-free: what a request may
//! send, what a reply to one of its batches means, which answered batches
//! are posted, when it is complete, and how an abort is fenced
//! (invariant 7: in-flight writes end before CancelNotif).
//!
//! [`Progress`] is one request's protocol state as plain data (no sockets,
//! no transport, no clock, no staging handles); the ctrl thread
//! (`ctrl.rs`, fed completions by `poll.rs`) executes what it decides. The model check
//! (`tests/model/`) drives the same code, so the rules it checks are the
//! engine's, not a transcription. Peer-level state (handshake modes, the
//! LMCache-mode send queue, timers) stays in the shell; see
//! docs/architecture.md, "Sender core".
//!
//! Generic over the terminal status `S` so the model can use a small
//! `Hash` status; the engine uses [`RequestStatus`](super::RequestStatus).

use std::collections::VecDeque;

use smallvec::SmallVec;

pub use super::reply::RemoteSlots;
use crate::protocol::{AllocResponse, ErrorCode};

/// The terminal statuses the core produces.
pub trait Status: Clone {
    /// A failure with a code and a reason.
    fn failed(code: ErrorCode, reason: String) -> Self;
}

impl Status for super::RequestStatus {
    fn failed(code: ErrorCode, reason: String) -> Self {
        super::RequestStatus::Failed { code, reason }
    }
}

/// Sender rules. The engine always runs [`Rules::KVFERRY`]; the other
/// values exist for the model check, which shows that it finds the
/// deadlocks of the designs they describe (docs/model-check.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rules {
    /// A request not yet admitted sends only its first batch (kvferry).
    /// Off: every queued batch is sent at once (LMCache's transfer tasks).
    pub gate_unadmitted: bool,
    /// Answered batches are posted strictly in order, stopping at the first
    /// that cannot get staging (LMCache; kvferry before the staging-order
    /// fix, which deadlocks). Off: every postable batch is posted.
    pub stage_in_order: bool,
}

impl Rules {
    /// kvferry's rules.
    pub const KVFERRY: Rules = Rules {
        gate_unadmitted: true,
        stage_in_order: false,
    };
}

/// A request's lifecycle on the sender.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Phase<S> {
    /// First AllocRequest not yet answered.
    Pending,
    /// The receiver admitted it.
    Admitted,
    /// Cancelled or failed; waiting for in-flight writes before
    /// CancelNotif. Holds the terminal status to report.
    Aborting(S),
    /// Terminal.
    Done(S),
}

impl<S> Phase<S> {
    /// `Pending` or `Admitted`.
    pub fn live(&self) -> bool {
        matches!(self, Phase::Pending | Phase::Admitted)
    }
}

/// Whose turn it is on a receiver that serves one request at a time
/// (kvferry against an LMCache receiver: `Mode::Legacy`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Turn<H>(Option<H>);

impl<H> Default for Turn<H> {
    fn default() -> Self {
        Turn(None)
    }
}

impl<H: PartialEq + Clone> Turn<H> {
    /// No request holds the receiver.
    pub fn is_free(&self) -> bool {
        self.0.is_none()
    }

    /// Gives the turn back if `me` holds it; true if it did (the oldest
    /// waiting request may go next).
    pub fn release<Q: PartialEq + ?Sized>(&mut self, me: &Q) -> bool
    where
        H: std::borrow::Borrow<Q>,
    {
        if self.0.as_ref().is_some_and(|h| h.borrow() == me) {
            self.0 = None;
            true
        } else {
            false
        }
    }
}

/// The messages to a receiver that answers one at a time, in order (an
/// LMCache receiver: its replies carry no `seq`). At most one message is
/// outstanding; the others wait in send order, already encoded (`B`).
/// `O` names what a message was, `T` when it went out (the shell's clock).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InOrder<O, B, T> {
    outstanding: Option<(O, T)>,
    waiting: VecDeque<(O, B)>,
}

impl<O, B, T> Default for InOrder<O, B, T> {
    fn default() -> Self {
        Self {
            outstanding: None,
            waiting: VecDeque::new(),
        }
    }
}

impl<O, B, T: Copy> InOrder<O, B, T> {
    /// Queues message `o` at `now`: true if it must go out now (nothing is
    /// outstanding); else it waits, as `payload()`.
    pub fn send(&mut self, o: O, now: T, payload: impl FnOnce() -> B) -> bool {
        if self.outstanding.is_some() {
            self.waiting.push_back((o, payload()));
            return false;
        }
        self.outstanding = Some((o, now));
        true
    }

    /// A reply came (at `now`): what it answers, and the next waiting
    /// message, now outstanding, to send.
    pub fn answered(&mut self, now: T) -> (Option<O>, Option<B>) {
        let o = self.outstanding.take().map(|(o, _)| o);
        let next = self.waiting.pop_front().map(|(n, bytes)| {
            self.outstanding = Some((n, now));
            bytes
        });
        (o, next)
    }

    /// What the unanswered message is.
    pub fn outstanding(&self) -> Option<&O> {
        self.outstanding.as_ref().map(|(o, _)| o)
    }

    /// When the unanswered message went out.
    pub fn sent_at(&self) -> Option<T> {
        self.outstanding.as_ref().map(|&(_, t)| t)
    }

    /// Nothing outstanding, nothing waiting.
    pub fn is_idle(&self) -> bool {
        self.outstanding.is_none() && self.waiting.is_empty()
    }

    /// Forgets every message (the connection is replaced): the outstanding
    /// one first, then the waiting ones in order.
    pub fn drain(&mut self) -> impl Iterator<Item = O> + '_ {
        self.outstanding
            .take()
            .map(|(o, _)| o)
            .into_iter()
            .chain(self.waiting.drain(..).map(|(o, _)| o))
    }
}

/// What the callers stored of a request: the chunks of the batches they
/// reserved so far, and whether the last batch is among them. The shell
/// keeps it apart from [`Progress`] (caller threads reserve without
/// ctrl's lock); [`Progress::is_complete`] takes it as an input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stored {
    /// Chunks reserved.
    pub chunks: usize,
    /// The last batch was reserved.
    pub last: bool,
}

/// Why a batch cannot be reserved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The last batch was stored already.
    AfterLast,
    /// It would bring the count to `chunks`, past the request's total.
    TooMany {
        /// The count it would reach.
        chunks: usize,
    },
    /// An empty batch that is not the last one.
    EmptyNotLast,
}

impl Stored {
    /// The count after a batch of `n` chunks of a request of `total`, and
    /// whether that batch is the last: `is_last` is the caller's claim, or
    /// `None` to end the request when the count reaches `total`.
    pub fn reserve(
        self,
        n: usize,
        total: usize,
        is_last: Option<bool>,
    ) -> Result<(Stored, bool), Refusal> {
        if self.last {
            return Err(Refusal::AfterLast);
        }
        let chunks = self.chunks + n;
        if chunks > total {
            return Err(Refusal::TooMany { chunks });
        }
        let last = is_last.unwrap_or(chunks == total);
        if n == 0 && !last {
            return Err(Refusal::EmptyNotLast);
        }
        Ok((Stored { chunks, last }, last))
    }

    /// True if giving back a batch (`last`: it was the last one) leaves the
    /// request unable to complete: another batch reserved the last place,
    /// so no batch can take the given-back chunks' place
    /// ([`Refusal::AfterLast`]), and completing would skip them. The shell
    /// fails the request then.
    pub fn orphans(self, last: bool) -> bool {
        self.last && !last
    }

    /// The count without a reservation of `n` chunks (`last`: it was the
    /// last batch) whose batch was never handed over.
    pub fn unreserve(self, n: usize, last: bool) -> Stored {
        Stored {
            chunks: self.chunks.saturating_sub(n),
            last: self.last && !last,
        }
    }
}

/// One request's protocol state (batches are named by the shell's ids).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Progress<S> {
    /// Where the request is in its lifecycle.
    pub state: Phase<S>,
    /// Batches received from callers, not yet sent, in order.
    pub queued: VecDeque<u64>,
    /// AllocRequests sent and not answered.
    pub awaiting_reply: usize,
    /// Answered batches not yet posted (their bytes may wait for staging).
    pub unstaged: VecDeque<u64>,
    /// Writes posted (or waiting for transport credit) and not completed.
    pub in_flight_ops: usize,
    /// Chunks written, or already held by the receiver.
    pub completed_chunks: usize,
    /// The last batch was answered.
    pub last_replied: bool,
    /// The first AllocRequest went out.
    pub first_sent: bool,
    /// The CancelNotif went out.
    pub cancel_sent: bool,
}

impl<S> Default for Progress<S> {
    /// A new request: pending, nothing stored (allocation-free).
    fn default() -> Self {
        Self {
            state: Phase::Pending,
            queued: VecDeque::new(),
            awaiting_reply: 0,
            unstaged: VecDeque::new(),
            in_flight_ops: 0,
            completed_chunks: 0,
            last_replied: false,
            first_sent: false,
            cancel_sent: false,
        }
    }
}

/// What a reply to one batch means for it.
#[derive(Debug, PartialEq, Eq)]
pub enum ReplyStep {
    /// The receiver refused it (or sent a reply no correct receiver
    /// sends): the request became `Aborting` (wake its waiters) and the
    /// batch's data is released.
    Abort,
    /// Release the batch's data, unwritten: the request is no longer live.
    Release,
    /// The receiver holds every chunk of the batch already: release its
    /// data, the batch is delivered (nothing to write).
    AllHeld,
    /// Write chunk position `j` to receiver slot `remote[j]`, except the
    /// `dedup` positions the receiver already holds (release their
    /// staging). The batch now waits in `unstaged` to be posted.
    Write {
        /// Receiver slot per chunk position (`-1` for dedup'd ones).
        remote: Vec<i64>,
        /// Chunk positions the receiver already holds, ascending.
        dedup: SmallVec<[usize; 16]>,
    },
}

/// A reply's effect, with whether it admitted the request.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    /// This reply admitted the request (`Pending` → `Admitted`).
    pub admitted: bool,
    /// What to do with the batch.
    pub step: ReplyStep,
}

/// What a write completion means for its request.
#[derive(Debug, PartialEq, Eq)]
pub struct WriteDone {
    /// This failure started the abort: wake the request's waiters.
    pub aborted: bool,
    /// ctrl must look at the request (its last write ended, or one failed).
    pub attention: bool,
}

/// The next step of an aborting request.
#[derive(Debug, PartialEq, Eq)]
pub enum AbortStep<S> {
    /// Writes are still in flight (their completions call again), or the
    /// abort already ended.
    Wait,
    /// Fenced: send CancelNotif if `cancel` (something was sent), then end
    /// with `status`.
    Finish {
        /// Send CancelNotif (for every key named so far).
        cancel: bool,
        /// The terminal status.
        status: S,
    },
}

impl<S: Status> Progress<S> {
    /// Starts the abort path of a live request; false if it is not live.
    pub fn abort_with(&mut self, status: S) -> bool {
        if !self.state.live() {
            return false;
        }
        self.state = Phase::Aborting(status);
        true
    }

    /// Every write completed, the last batch answered, nothing left to
    /// send: the request is complete (invariant 3's condition). `stored`:
    /// what the callers stored.
    pub fn is_complete(&self, stored: Stored) -> bool {
        matches!(self.state, Phase::Admitted)
            && stored.last
            && self.last_replied
            && self.queued.is_empty()
            && self.unstaged.is_empty()
            && self.awaiting_reply == 0
            && self.in_flight_ops == 0
            && self.completed_chunks == stored.chunks
    }

    /// How many queued batches may be sent now: all once admitted; before,
    /// only the first (one AllocRequest asks for admission), and on a
    /// one-request-at-a-time receiver (`turn`) only when no other request
    /// holds it. Sending takes the turn for `me`. Pop them with
    /// [`next_to_send`](Self::next_to_send).
    pub fn sendable<H: PartialEq + Clone>(
        &self,
        rules: Rules,
        turn: Option<&mut Turn<H>>,
        me: &H,
    ) -> usize {
        let n = if matches!(self.state, Phase::Admitted) || !rules.gate_unadmitted {
            self.queued.len()
        } else if !self.first_sent && !self.queued.is_empty() {
            let busy = turn
                .as_ref()
                .is_some_and(|t| t.0.as_ref().is_some_and(|a| a != me));
            usize::from(!busy)
        } else {
            0
        };
        if let Some(t) = turn.filter(|_| n > 0) {
            t.0 = Some(me.clone());
        }
        n
    }

    /// Takes the next queued batch to send its AllocRequest; true in the
    /// second place if it is the request's first.
    pub fn next_to_send(&mut self) -> Option<(u64, bool)> {
        let id = self.queued.pop_front()?;
        self.awaiting_reply += 1;
        let first = !self.first_sent;
        self.first_sent = true;
        Some((id, first))
    }

    /// The reply `resp` to batch `id` of chunks of `lens` bytes (`is_last`:
    /// the request's last batch), from a receive buffer of `slots`.
    pub fn on_reply(
        &mut self,
        id: u64,
        lens: &[u32],
        is_last: bool,
        slots: RemoteSlots,
        resp: &AllocResponse,
    ) -> Reply {
        let n = lens.len();
        self.awaiting_reply = self.awaiting_reply.saturating_sub(1);
        let mapped = match super::reply::map_reply(lens, slots, resp) {
            Ok(m) => m,
            Err((code, reason)) => {
                tracing::debug!(code = code.as_str(), %reason, "batch refused; aborting the request");
                let aborted = self.abort_with(S::failed(code, reason));
                let step = if aborted {
                    ReplyStep::Abort
                } else {
                    ReplyStep::Release
                };
                return Reply {
                    admitted: false,
                    step,
                };
            }
        };
        if !self.state.live() {
            // Aborting: the receiver's slots go back with the CancelNotif.
            return Reply {
                admitted: false,
                step: ReplyStep::Release,
            };
        }
        let admitted = matches!(self.state, Phase::Pending);
        if admitted {
            self.state = Phase::Admitted;
        }
        let dedup = mapped.already_sent;
        self.completed_chunks += dedup.len();
        if is_last {
            self.last_replied = true;
        }
        if dedup.len() >= n {
            return Reply {
                admitted,
                step: ReplyStep::AllHeld,
            };
        }
        self.unstaged.push_back(id);
        Reply {
            admitted,
            step: ReplyStep::Write {
                remote: mapped.remote,
                dedup,
            },
        }
    }

    /// Posts answered batches: `post(id)` stages and posts batch `id`,
    /// returning the writes it queued, or `None` if its bytes must wait for
    /// staging. A waiting batch does not hold back the ones behind it
    /// (they may hold the very staging slots it waits for: the deadlock
    /// found by tests/model_check.rs), unless `rules.stage_in_order`.
    pub fn post_answered(&mut self, rules: Rules, mut post: impl FnMut(u64) -> Option<usize>) {
        let mut k = 0;
        while k < self.unstaged.len() {
            match post(self.unstaged[k]) {
                Some(ops) => {
                    self.in_flight_ops += ops;
                    self.unstaged.remove(k);
                }
                None if rules.stage_in_order => break,
                None => k += 1,
            }
        }
    }

    /// A posted write (of `chunks` chunks) ended: landed if `ok`, else the
    /// request aborts with `failure()`.
    pub fn write_done(
        &mut self,
        chunks: usize,
        ok: bool,
        failure: impl FnOnce() -> S,
    ) -> WriteDone {
        self.in_flight_ops = self.in_flight_ops.saturating_sub(1);
        let aborted = if ok {
            self.completed_chunks += chunks;
            false
        } else {
            self.abort_with(failure())
        };
        WriteDone {
            aborted,
            attention: self.in_flight_ops == 0 || !ok,
        }
    }

    /// A write that was never handed to the transport was withdrawn.
    pub fn write_withdrawn(&mut self) {
        self.in_flight_ops = self.in_flight_ops.saturating_sub(1);
    }

    /// One step of the abort path: drops unsent and unposted batches
    /// (`release(id)` each), then, once no write is in flight, fences with
    /// CancelNotif (if anything was sent) and ends.
    pub fn abort_step(&mut self, mut release: impl FnMut(u64)) -> AbortStep<S> {
        let Phase::Aborting(status) = &self.state else {
            return AbortStep::Wait;
        };
        let status = status.clone();
        for id in self.queued.drain(..).chain(self.unstaged.drain(..)) {
            release(id);
        }
        if self.in_flight_ops > 0 || self.cancel_sent {
            return AbortStep::Wait;
        }
        let cancel = self.first_sent;
        self.cancel_sent |= cancel;
        AbortStep::Finish { cancel, status }
    }

    /// Ends the request with `status`.
    pub fn finish(&mut self, status: S) {
        self.state = Phase::Done(status);
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
