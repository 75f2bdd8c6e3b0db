//! The copy engine: the thread that plays the NIC for the shm transport. It
//! takes [`WriteOp`]s from the submission ring, bounds-checks them, copies
//! the bytes from the staging buffer into the mapped receiver buffer and
//! posts one [`Completion`] per op to the completion ring. When the ring
//! runs dry it lingers ([`LINGER_MAX`], yielding), then parks on the
//! submission ring's doorbell.
//!
//! The linger is for the wake-up it saves. Waking the engine's CPU from
//! idle cost 44 µs on the project's 2-vCPU VM (`perf sched`, every wake-up
//! of `kvf-shm-copy` in an end-to-end run), a seventh of a 4 MiB request's
//! copy at 12 GiB/s; when the rest of the pipeline is the bound (the CPU
//! that every other thread shares), the engine idles between requests and
//! paid it for nearly every one. By default the engine has a CPU of its
//! own (`--copy-cpu auto`), where lingering takes nothing from another
//! thread; where it shares one, each check yields.
//!
//! Completions go out every [`FLUSH_BYTES`] copied, not only once per
//! popped batch: with several requests' writes popped together, a request
//! whose writes are done must not wait for the copies of the requests
//! behind it (that turned a window of requests in flight into lockstep
//! bursts: `docs/benchmarks.md`, "Python end to end").

use std::sync::Arc;

use kvferry_ring::spsc::{Consumer, Producer};
use kvferry_ring::WaitStatus;

use crate::region::Region;
use crate::staging::StagingBuffer;
use crate::transport::{Completion, CompletionStatus, WriteOp};
use crate::util::linger::{linger_within, LINGER_MAX};

use super::peers::PeerTable;

/// Ops taken from the submission ring per batch (the peer table is refreshed
/// once per batch).
const BATCH: usize = 64;

/// Bytes copied after which the completions of the ops copied so far are
/// published, even mid-batch: about 0.1 ms of copying at memcpy speed, so a
/// request waits at most that long for the ops popped after its own, while
/// small ops (64 × 4 KiB) still go out with one publish per batch.
const FLUSH_BYTES: u64 = 1 << 20;

/// Everything the engine thread owns.
pub(super) struct Engine {
    pub(super) sq: Consumer<WriteOp>,
    pub(super) cq: Producer<Completion>,
    pub(super) local: Arc<StagingBuffer>,
    pub(super) peers: Arc<PeerTable>,
}

impl Engine {
    /// Runs until the poster is gone and every op was completed (or until
    /// the completion half is gone: then nobody can observe completions).
    /// Dropping `self` at the end closes the completion ring.
    pub(super) fn run(mut self) {
        let mut ops = vec![WriteOp::default(); BATCH];
        let mut done = Vec::with_capacity(BATCH);
        let mut regions: Vec<Option<Arc<Region>>> = Vec::new();
        let mut seen_version = 0u64;
        tracing::debug!("shm copy engine started");
        'run: loop {
            if self.sq.is_empty() {
                // The next op, or the poster's close, ends it at once.
                linger_within(LINGER_MAX, || !self.sq.is_empty() || self.sq.is_closed());
            }
            match self.sq.wait(None) {
                WaitStatus::Ready => {}
                WaitStatus::Closed => break,
                WaitStatus::TimedOut => continue,
            }
            let n = self.sq.pop_into(&mut ops);
            if n == 0 {
                continue;
            }
            // After taking the ops, so a peer connected before they were
            // posted is visible (see PeerTable::bump).
            self.peers.refresh(&mut seen_version, &mut regions);
            done.clear();
            let mut copied = 0u64;
            for (i, op) in ops[..n].iter().enumerate() {
                let status = execute(op, &self.local, &regions);
                tracing::trace!(work_id = op.work_id, %status, "shm write");
                done.push(Completion::new(op.work_id, status));
                // Saturating: a peer's bogus length (refused above) only
                // flushes early.
                copied = copied.saturating_add(op.len);
                if copied >= FLUSH_BYTES || i + 1 == n {
                    if !self.publish(&done) {
                        tracing::debug!("shm copy engine: completion half gone, stopping");
                        break 'run;
                    }
                    done.clear();
                    copied = 0;
                }
            }
        }
        tracing::debug!("shm copy engine stopped");
    }

    /// Publishes `done` on the completion ring; false if the completion
    /// half is gone (credits guarantee room for every completion, so fewer
    /// pushed means nobody is listening).
    fn publish(&mut self, done: &[Completion]) -> bool {
        self.cq.push_slice(done) == done.len()
    }
}

/// Executes one op: a checked copy from staging (or a registered region) into the peer's slot area.
fn execute(
    op: &WriteOp,
    local: &StagingBuffer,
    regions: &[Option<Arc<Region>>],
) -> CompletionStatus {
    let Some(Some(region)) = regions.get(op.peer as usize) else {
        return CompletionStatus::UnknownPeer;
    };
    let within =
        |offset: u64, limit: u64| offset.checked_add(op.len).is_some_and(|end| end <= limit);
    let Some(src) = local.source(op.local_region, op.local_offset, op.len) else {
        return CompletionStatus::OutOfBounds;
    };
    if !within(op.remote_offset, region.data_len()) {
        return CompletionStatus::OutOfBounds;
    }
    if op.len == 0 {
        return CompletionStatus::Ok;
    }
    // SAFETY: `source` checked the local range lies inside the staging
    // buffer or the registered region (which the sender keeps registered,
    // and its owner keeps valid, until this op's completion was polled), and
    // remote_offset + len <= region.data_len() (checked above, without
    // overflow), so both ranges lie inside live memory. They do not overlap:
    // the receive buffer is a separate file mapping. The bytes are plain u8.
    // Exclusive use of both ranges while the op is in flight is the
    // control-plane contract (the sender does not reuse the staging slot
    // before the completion, a registered range is not written by its owner
    // before the write's completion — `Sender::register`'s contract; the
    // receiver granted the remote slot to this write alone).
    unsafe {
        std::ptr::copy_nonoverlapping(
            src,
            region.data_ptr().add(op.remote_offset as usize),
            op.len as usize,
        );
    }
    CompletionStatus::Ok
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvferry_ring::WaitStatus;

    use super::*;
    use crate::transport::EngineRings;

    /// Spins for `d` (a gap between two ops, not a measurement).
    fn pause_for(d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {
            std::hint::spin_loop();
        }
    }

    /// The engine lingers after its last op, then parks. Its submission
    /// ring tells which: a push that finds the consumer armed to sleep
    /// (`take_wakeup`) found the engine parking or parked. The engine and
    /// this test run on CPUs of their own: without the linger, the ring's
    /// own spin and yields park the engine within a few µs of running dry,
    /// so every op 50 µs after the last completion finds it parking (on
    /// one shared CPU the test's thread could run before the engine parks,
    /// and prove nothing).
    #[test]
    fn the_engine_lingers_after_its_last_op_then_parks() {
        crate::threads::on_two_cpus("the engine and its poster apart", |a, b| {
            crate::threads::confine_current(&[a]).expect("confine the test");
            let rings = EngineRings::new(8).expect("rings");
            let engine = Engine {
                sq: rings.sq_rx,
                cq: rings.cq_tx,
                local: Arc::new(StagingBuffer::new(1, 4096).expect("staging")),
                peers: Arc::new(PeerTable::default()),
            };
            let thread = std::thread::spawn(move || {
                crate::threads::confine_current(&[b]).expect("confine the engine");
                engine.run();
            });
            let (mut sq, mut cq) = (rings.sq_tx, rings.cq_rx);
            // One op `gap` after the last completion (to no peer: answered
            // without a copy); true if the push found the engine parking.
            let mut op_after = |work_id: u64, gap: Duration| -> bool {
                pause_for(gap);
                let op = WriteOp {
                    work_id,
                    ..WriteOp::default()
                };
                assert!(sq.push(op).is_ok(), "the submission ring is full");
                let parking = sq.take_wakeup();
                let status = cq.wait(Some(Instant::now() + Duration::from_secs(10)));
                assert_eq!(
                    status,
                    WaitStatus::Ready,
                    "the engine did not answer op {work_id} within 10 s"
                );
                let done = cq.pop().expect("a completion");
                assert_eq!(done.work_id, work_id);
                assert_eq!(done.status(), CompletionStatus::UnknownPeer);
                parking
            };
            op_after(0, Duration::ZERO);
            // Once is enough: an engine descheduled for the whole linger in
            // some rounds is the machine's load, not a missing linger.
            let lingered = (1..=200).any(|id| !op_after(id, Duration::from_micros(50)));
            assert!(
                lingered,
                "200 ops 50 µs after the last completion all found the engine parking: it does not linger"
            );
            let parked = (201..=220).any(|id| op_after(id, Duration::from_millis(20)));
            assert!(
                parked,
                "20 ops 20 ms after the last completion all found the engine awake: it never parks"
            );
            drop(sq);
            crate::threads::join_within(thread, Duration::from_secs(10), "shm copy engine")
                .expect("the engine stops once its submission ring closes");
        });
    }
}
