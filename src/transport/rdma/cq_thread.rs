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
//! channel's fd and the poster's eventfd.

use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;
use kvferry_ring::spsc::Producer;
use kvferry_ring::{Backoff, Step};

use crate::transport::{Completion, CompletionStatus};

use super::peers::Shared;
use super::verbs::{Channel, Cq};

/// Work completions taken per poll.
const WC_BATCH: usize = 64;
/// Longest sleep without a wakeup (a safety net; wakeups are event-driven).
const SLEEP_MS: i32 = 1000;

/// Everything the thread owns.
pub(super) struct CqThread {
    pub(super) cq: Arc<Cq>,
    pub(super) channel: Arc<Channel>,
    pub(super) shared: Arc<Shared>,
    pub(super) out: Producer<Completion>,
}

impl CqThread {
    /// Runs until the poster is gone and nothing is in flight, or the
    /// completion half is gone. Dropping `self` closes the completion ring.
    pub(super) fn run(mut self) {
        let mut wcs = vec![ffi::ibv_wc::default(); WC_BATCH];
        let mut done: Vec<Completion> = Vec::with_capacity(WC_BATCH);
        let mut idle = Backoff::new();
        tracing::debug!("rdma cq thread started");
        loop {
            done.clear();
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
                fd: self.channel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.shared.wake.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a live array of two pollfds; both fds stay open
        // while `self` holds the channel and the shared state.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, SLEEP_MS) };
        if rc < 0 {
            // EINTR or similar: back off briefly rather than spin.
            std::thread::sleep(Duration::from_millis(1));
        }
        self.cq.drain_events();
        self.shared.wake.clear();
    }
}
