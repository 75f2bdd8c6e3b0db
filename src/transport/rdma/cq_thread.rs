//! The CQ-poll thread (`kvf-rdma-cq`): polls the completion queue, maps work
//! completions to per-op [`Completion`]s (see `inflight`), adds the ones the
//! poster decided at once, and pushes them to the completion ring the
//! [`Completions`](crate::transport::Completions) half reads, like the shm
//! copy engine does.
//!
//! Waiting: after an empty poll it backs off with the project's one policy
//! ([`kvferry_ring::Backoff`]: spin briefly, then yield a few times), then
//! arms the CQ (`ibv_req_notify_cq`), polls once more (a completion
//! may have arrived before arming) and sleeps in `poll(2)` on the completion
//! channel's fd, the poster's eventfd and the device's async event fd.
//!
//! Housekeeping (after every sleep, and every [`HOUSEKEEP_EVERY`] passes
//! while busy): asynchronous events are handled (see `events`) and the
//! stall watchdog fences a queue pair whose writes made no progress for the
//! stall timeout (see `inflight::Stall`), so every write ends even if the
//! NIC never gives up on its own.

use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;
use kvferry_ring::spsc::Producer;
use kvferry_ring::{Backoff, Step};

use crate::transport::{Completion, CompletionStatus};

use super::events::{action, EventAction};
use super::inflight::{Inflight, Stall};
use super::peers::{PeerQp, Shared};
use super::regions::LocalMrs;
use super::verbs::{Channel, Context, Cq, Qp};

/// Work completions taken per poll.
const WC_BATCH: usize = 64;
/// Longest sleep without a wakeup (a safety net; wakeups are event-driven,
/// and it bounds how late the stall watchdog looks).
const SLEEP_MS: i32 = 1000;
/// Busy passes between two housekeeping rounds.
const HOUSEKEEP_EVERY: u32 = 1024;

/// Everything the thread owns.
pub(super) struct CqThread {
    pub(super) cq: Arc<Cq>,
    pub(super) channel: Arc<Channel>,
    pub(super) shared: Arc<Shared>,
    pub(super) out: Producer<Completion>,
    /// The device context (its async events).
    pub(super) ctx: Arc<Context>,
    /// The staging segments' MRs (and the caller regions'), kept
    /// registered (and the staging memory alive) until this thread is
    /// gone, even if the poster's drop stopped waiting.
    pub(super) _mrs: Arc<LocalMrs>,
    /// See [`RdmaConfig::stall_timeout`](super::RdmaConfig::stall_timeout).
    pub(super) stall_timeout: Duration,
}

impl CqThread {
    /// Runs until the poster is gone and nothing is in flight, or the
    /// completion half is gone. Dropping `self` closes the completion ring.
    pub(super) fn run(mut self) {
        let mut wcs = vec![ffi::ibv_wc::default(); WC_BATCH];
        let mut done: Vec<Completion> = Vec::with_capacity(WC_BATCH);
        let mut idle = Backoff::new();
        let mut passes: u32 = 0;
        tracing::debug!("rdma cq thread started");
        loop {
            done.clear();
            passes = passes.wrapping_add(1);
            if passes % HOUSEKEEP_EVERY == 0 {
                self.housekeep(&mut done);
            }
            done.append(&mut self.shared.immediate.lock());
            if let Err(e) = self.take(&mut wcs, &mut done) {
                tracing::debug!(error = %e, "rdma cq poll failed: failing every queue pair");
                self.fail_everything(&mut done);
            }
            if !done.is_empty() {
                idle.reset();
                // Credits guarantee room; fewer pushed means nobody listens.
                if self.out.push_slice(&done) < done.len() {
                    tracing::debug!("rdma cq thread: completion half gone, stopping");
                    break;
                }
                continue;
            }
            if self.shared.is_closing() && self.shared.all_idle() {
                break;
            }
            if idle.snooze() != Step::ShouldPark {
                continue;
            }
            idle.reset();
            if let Err(e) = self.cq.arm() {
                tracing::debug!(error = %e, "arming the CQ failed; sleeping with a timeout");
            }
            // A completion that arrived before arming raised no event: look
            // once more before sleeping.
            if let Err(e) = self.take(&mut wcs, &mut done) {
                tracing::debug!(error = %e, "rdma cq poll failed: failing every queue pair");
                self.fail_everything(&mut done);
            }
            if !done.is_empty() {
                if self.out.push_slice(&done) < done.len() {
                    break;
                }
                continue;
            }
            self.sleep();
            self.housekeep(&mut done);
            if !done.is_empty() && self.out.push_slice(&done) < done.len() {
                break;
            }
        }
        tracing::debug!("rdma cq thread stopped");
    }

    /// Polls the CQ once and maps what it returned into `done`.
    fn take(
        &self,
        wcs: &mut [ffi::ibv_wc],
        done: &mut Vec<Completion>,
    ) -> Result<(), crate::transport::TransportError> {
        let n = self.cq.poll(wcs)?;
        if n == 0 {
            return Ok(());
        }
        let by_qpn = self.shared.by_qpn.read();
        for wc in &wcs[..n] {
            let status = wc
                .error()
                .map_or(ffi::ibv_wc_status::IBV_WC_SUCCESS, |(s, _)| s);
            match by_qpn.get(&wc.qp_num) {
                Some(peer) => peer.inflight.lock().on_wc(wc.wr_id(), status, done),
                None => tracing::debug!(qp_num = wc.qp_num, "completion for an unknown QP"),
            }
            if status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                tracing::debug!(
                    qp_num = wc.qp_num,
                    status,
                    "rdma write failed; its QP is in error"
                );
            }
        }
        Ok(())
    }

    /// Handles pending asynchronous events and runs the stall watchdog;
    /// ops it fails go to `done`.
    fn housekeep(&self, done: &mut Vec<Completion>) {
        let now = Instant::now();
        while let Some(ev) = self.ctx.take_async_event() {
            let by_qpn = self.shared.by_qpn.read();
            match action(&ev, self.ctx.port) {
                EventAction::FenceQp(qp_num) => {
                    tracing::warn!(?ev, "rdma queue pair error event: fencing it");
                    if let Some(p) = by_qpn.get(&qp_num) {
                        fence(p, now);
                    }
                }
                EventAction::FenceAll => {
                    tracing::warn!(
                        ?ev,
                        "rdma port or device error event: fencing every queue pair"
                    );
                    by_qpn.values().for_each(|p| fence(p, now));
                }
                EventAction::Note => tracing::debug!(?ev, "rdma async event"),
            }
        }
        for p in self.shared.by_qpn.read().values() {
            let mut inflight = p.inflight.lock();
            match inflight.stall(now, self.stall_timeout) {
                Stall::No => {}
                Stall::Fence => {
                    tracing::warn!(
                        qp_num = p.qp.qp_num(),
                        in_flight = inflight.len(),
                        timeout = ?self.stall_timeout,
                        "rdma queue pair made no progress: fencing it"
                    );
                    fence_locked(&p.qp, &mut inflight, now);
                }
                Stall::GiveUp => {
                    tracing::warn!(
                        qp_num = p.qp.qp_num(),
                        "no flush completions from a fenced rdma queue pair: failing its writes"
                    );
                    inflight.fail_all(CompletionStatus::TransportError, done);
                }
            }
        }
    }

    /// The CQ itself broke: every op in flight fails.
    fn fail_everything(&self, done: &mut Vec<Completion>) {
        for peer in self.shared.by_qpn.read().values() {
            peer.inflight
                .lock()
                .fail_all(CompletionStatus::TransportError, done);
        }
    }

    /// Sleeps until the channel has an event, the poster rings, or the
    /// safety timeout passes; then consumes the wakeups.
    fn sleep(&self) {
        let mut fds = [
            libc::pollfd {
                fd: self.ctx.async_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.channel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.shared.wake.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a live array of three pollfds; the fds stay open
        // while `self` holds the context, the channel and the shared state.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, SLEEP_MS) };
        if rc < 0 {
            // EINTR or similar: back off briefly rather than spin.
            std::thread::sleep(Duration::from_millis(1));
        }
        self.cq.drain_events();
        let _ = self.shared.wake.clear();
    }
}

/// Moves `p`'s queue pair to the error state (its writes flush) and marks
/// it fenced, under its in-flight lock so a concurrent post either is
/// flushed or sees the failed state.
fn fence(p: &PeerQp, now: Instant) {
    fence_locked(&p.qp, &mut p.inflight.lock(), now);
}

/// [`fence`] with the in-flight lock of `qp` already held.
fn fence_locked(qp: &Qp, inflight: &mut Inflight, now: Instant) {
    if let Err(e) = qp.fence() {
        tracing::debug!(error = %e, "fencing a queue pair failed");
    }
    inflight.fenced(now);
}
