//! The completion mapping: which [`WriteOp`](crate::transport::WriteOp)s a
//! work completion finishes, and with which status.
//!
//! Each queue pair keeps the ops posted to it in posting order, each under
//! a sequence number (the work request's `wr_id`). Work requests on an RC
//! queue pair complete in order, so:
//!
//! - a successful completion for sequence `s` (a signalled request)
//!   completes every op up to `s` as `Ok`;
//! - an error completion for `s` means the requests before `s` succeeded (a
//!   failed request always produces a completion, and it would have come
//!   first), `s` failed with its mapped status, and the queue pair is now in
//!   the error state: every later op fails with `ConnectionLost` at once and
//!   later posts to it fail too (the flush completions the NIC still
//!   delivers for them are ignored).
//!
//! Stalls: a queue pair with ops in flight and no completion for the stall
//! timeout is [`Stall::Fence`]d (moved to the error state by the caller, so
//! the NIC flushes its requests and their completions arrive fenced); if
//! the flushes do not come within another timeout, [`Stall::GiveUp`] fails
//! its ops without them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ibverbs_sys::ibv_wc_status as wc;

use crate::transport::{Completion, CompletionStatus};

/// Maps a work-completion status to a [`CompletionStatus`].
///
/// - success → `Ok`;
/// - the request or the peer vanished: flushed (queue pair in error),
///   transport or RNR retries exhausted → `ConnectionLost`;
/// - a range outside a registered region or a bad key: local length or
///   protection error, remote access or invalid request → `OutOfBounds`;
/// - anything else → `TransportError`.
pub fn map_wc_status(status: u32) -> CompletionStatus {
    match status {
        wc::IBV_WC_SUCCESS => CompletionStatus::Ok,
        wc::IBV_WC_WR_FLUSH_ERR | wc::IBV_WC_RETRY_EXC_ERR | wc::IBV_WC_RNR_RETRY_EXC_ERR => {
            CompletionStatus::ConnectionLost
        }
        wc::IBV_WC_LOC_LEN_ERR
        | wc::IBV_WC_LOC_PROT_ERR
        | wc::IBV_WC_REM_ACCESS_ERR
        | wc::IBV_WC_REM_INV_REQ_ERR => CompletionStatus::OutOfBounds,
        _ => CompletionStatus::TransportError,
    }
}

/// What the stall watchdog should do with a queue pair
/// ([`Inflight::stall`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    /// Nothing in flight, or it is progressing (or its flush is awaited).
    No,
    /// Ops in flight and no completion for the timeout: move the queue pair
    /// to the error state and call [`Inflight::fenced`].
    Fence,
    /// Fenced a timeout ago and the flushes never came: fail the ops with
    /// [`Inflight::fail_all`].
    GiveUp,
}

/// The ops in flight on one queue pair.
#[derive(Debug, Default)]
pub struct Inflight {
    /// `(sequence, work_id)` in posting order.
    entries: VecDeque<(u64, u64)>,
    next_seq: u64,
    failed: bool,
    /// When the oldest op in flight was posted or last completed one.
    progress_at: Option<Instant>,
    /// When the queue pair was fenced (moved to the error state).
    fenced_at: Option<Instant>,
}

impl Inflight {
    /// Records an op about to be posted; returns the sequence number to use
    /// as the work request's `wr_id`.
    pub fn push(&mut self, work_id: u64) -> u64 {
        if self.entries.is_empty() {
            self.progress_at = Some(Instant::now());
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.entries.push_back((seq, work_id));
        seq
    }

    /// Forgets the ops from sequence `seq` on (their post failed before the
    /// NIC took them) and returns their work ids in order.
    pub fn unpush_from(&mut self, seq: u64) -> Vec<u64> {
        let keep = self.entries.iter().take_while(|(s, _)| *s < seq).count();
        self.entries.drain(keep..).map(|(_, w)| w).collect()
    }

    /// Ops still in flight.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True once an error completion put the queue pair in the error state.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Applies the work completion of request `seq` with verbs status
    /// `status`, appending the completions it finishes to `out`. A
    /// completion for a sequence no longer in flight (a flush after the
    /// queue pair already failed) appends nothing.
    pub fn on_wc(&mut self, seq: u64, status: u32, out: &mut Vec<Completion>) {
        if !self.entries.iter().any(|(s, _)| *s == seq) {
            return;
        }
        let mapped = map_wc_status(status);
        self.progress_at = Some(Instant::now());
        while let Some(&(s, work_id)) = self.entries.front() {
            if s > seq {
                break;
            }
            self.entries.pop_front();
            let st = if s == seq {
                mapped
            } else {
                CompletionStatus::Ok
            };
            out.push(Completion::new(work_id, st));
        }
        if mapped != CompletionStatus::Ok {
            self.fail_all(CompletionStatus::ConnectionLost, out);
        }
    }

    /// The watchdog's verdict at `now` with stall timeout `limit`.
    pub fn stall(&self, now: Instant, limit: Duration) -> Stall {
        if self.entries.is_empty() {
            return Stall::No;
        }
        let waited =
            |t: Option<Instant>| t.is_some_and(|t| now.saturating_duration_since(t) >= limit);
        match self.fenced_at {
            Some(_) if waited(self.fenced_at) => Stall::GiveUp,
            Some(_) => Stall::No,
            None if waited(self.progress_at) => Stall::Fence,
            None => Stall::No,
        }
    }

    /// Records that the queue pair was moved to the error state at `now`
    /// (by the watchdog or an asynchronous event): later posts fail at once,
    /// the ops in flight end with their flush completions.
    pub fn fenced(&mut self, now: Instant) {
        self.failed = true;
        self.fenced_at.get_or_insert(now);
    }

    /// Fails every op in flight with `status` and marks the queue pair failed.
    pub fn fail_all(&mut self, status: CompletionStatus, out: &mut Vec<Completion>) {
        self.failed = true;
        out.extend(
            self.entries
                .drain(..)
                .map(|(_, w)| Completion::new(w, status)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(c: &[Completion]) -> Vec<(u64, CompletionStatus)> {
        c.iter().map(|c| (c.work_id, c.status())).collect()
    }

    #[test]
    fn maps_statuses() {
        use CompletionStatus::*;
        assert_eq!(map_wc_status(wc::IBV_WC_SUCCESS), Ok);
        assert_eq!(map_wc_status(wc::IBV_WC_WR_FLUSH_ERR), ConnectionLost);
        assert_eq!(map_wc_status(wc::IBV_WC_RETRY_EXC_ERR), ConnectionLost);
        assert_eq!(map_wc_status(wc::IBV_WC_RNR_RETRY_EXC_ERR), ConnectionLost);
        assert_eq!(map_wc_status(wc::IBV_WC_REM_ACCESS_ERR), OutOfBounds);
        assert_eq!(map_wc_status(wc::IBV_WC_LOC_PROT_ERR), OutOfBounds);
        assert_eq!(map_wc_status(wc::IBV_WC_LOC_LEN_ERR), OutOfBounds);
        assert_eq!(map_wc_status(wc::IBV_WC_REM_INV_REQ_ERR), OutOfBounds);
        assert_eq!(map_wc_status(wc::IBV_WC_FATAL_ERR), TransportError);
        assert_eq!(map_wc_status(9999), TransportError);
    }

    #[test]
    fn a_signalled_success_completes_everything_before_it() {
        let mut q = Inflight::default();
        let seqs: Vec<u64> = (10..15).map(|w| q.push(w)).collect();
        assert_eq!(seqs, vec![0, 1, 2, 3, 4]);
        let mut out = Vec::new();
        q.on_wc(2, wc::IBV_WC_SUCCESS, &mut out);
        use CompletionStatus::Ok;
        assert_eq!(ids(&out), vec![(10, Ok), (11, Ok), (12, Ok)]);
        assert_eq!(q.len(), 2);
        out.clear();
        q.on_wc(4, wc::IBV_WC_SUCCESS, &mut out);
        assert_eq!(ids(&out), vec![(13, Ok), (14, Ok)]);
        assert!(q.is_empty() && !q.failed());
    }

    #[test]
    fn an_error_fails_the_qp_and_everything_after_it() {
        let mut q = Inflight::default();
        for w in 0..6 {
            q.push(w);
        }
        let mut out = Vec::new();
        q.on_wc(2, wc::IBV_WC_REM_ACCESS_ERR, &mut out);
        use CompletionStatus::*;
        assert_eq!(
            ids(&out),
            vec![
                (0, Ok),
                (1, Ok),
                (2, OutOfBounds),
                (3, ConnectionLost),
                (4, ConnectionLost),
                (5, ConnectionLost)
            ]
        );
        assert!(q.failed() && q.is_empty());
        // The flushes the NIC delivers afterwards change nothing.
        out.clear();
        q.on_wc(4, wc::IBV_WC_WR_FLUSH_ERR, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_queue_pair_without_progress_is_fenced_then_given_up() {
        let limit = Duration::from_secs(5);
        let mut q = Inflight::default();
        let t0 = Instant::now();
        assert_eq!(q.stall(t0 + limit * 10, limit), Stall::No, "idle");
        for w in 0..3 {
            q.push(w);
        }
        let later = Instant::now() + limit;
        assert_eq!(q.stall(Instant::now(), limit), Stall::No);
        assert_eq!(q.stall(later, limit), Stall::Fence);
        // A completion is progress: the clock restarts.
        let mut out = Vec::new();
        q.on_wc(0, wc::IBV_WC_SUCCESS, &mut out);
        assert_eq!(out.len(), 1);
        let restarted = Instant::now();
        assert_eq!(q.stall(restarted + limit / 2, limit), Stall::No);
        assert_eq!(q.stall(restarted + limit * 2, limit), Stall::Fence);
        // Fenced: new posts fail; the flushes are awaited, then given up.
        let fenced = restarted + limit * 2;
        q.fenced(fenced);
        assert!(q.failed());
        assert_eq!(q.stall(fenced + limit / 2, limit), Stall::No);
        assert_eq!(q.stall(fenced + limit, limit), Stall::GiveUp);
        // The flush of the oldest op ends them all, fenced.
        out.clear();
        q.on_wc(1, wc::IBV_WC_WR_FLUSH_ERR, &mut out);
        assert_eq!(
            ids(&out),
            vec![
                (1, CompletionStatus::ConnectionLost),
                (2, CompletionStatus::ConnectionLost)
            ]
        );
        assert_eq!(q.stall(fenced + limit * 9, limit), Stall::No);
    }

    #[test]
    fn unposted_ops_are_taken_back() {
        let mut q = Inflight::default();
        for w in 100..105 {
            q.push(w);
        }
        assert_eq!(q.unpush_from(3), vec![103, 104]);
        assert_eq!(q.len(), 3);
        assert_eq!(q.push(200), 5, "sequence numbers are never reused");
        let mut out = Vec::new();
        q.fail_all(CompletionStatus::ConnectionLost, &mut out);
        assert_eq!(out.len(), 4);
        assert!(q.failed());
    }
}
