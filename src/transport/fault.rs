//! Fault injection: a [`Transport`] wrapper that fails chosen writes, delays
//! completions and delivers them out of order, for tests of the sender's
//! completion handling.
//!
//! - A failed op is *not* written: it is posted to the inner transport with
//!   `len = 0` and its `work_id` is remembered; when its completion comes
//!   back it is reported as [`CompletionStatus::Injected`]. So it still uses
//!   a credit and completes in its place, like a real failed write.
//! - Whether an op fails is a pure function of `(seed, work_id)` (plus the
//!   explicit `fail_work_ids`), so a seeded run fails the same ops whatever
//!   the batching and credit pattern. Work ids of ops in flight at the same
//!   time should be distinct (the sender's are).
//! - `delay` holds every completion at least that long; `reorder` holds each
//!   one for a random time in `[delay, 2 * delay]` and releases the ones due
//!   together in shuffled order. Both are timed waits on the inner
//!   completion queue (no spinning).
//!
//! Held completions still count as in flight: the wrapper's poster accepts
//! at most `credits()` ops that were not yet delivered.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::protocol::Descriptor;
use crate::staging::StagingBuffer;

use super::{
    Completion, CompletionStatus, Completions, PeerIndex, PollStatus, Poster, RemoteBuffer,
    Started, Transport, TransportError, WriteOp,
};

/// Longest accepted [`FaultConfig::delay`].
pub const MAX_FAULT_DELAY: Duration = Duration::from_secs(3600);

/// What to inject.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultConfig {
    /// Probability in `0.0..=1.0` that an op fails (decided from `seed` and
    /// the op's `work_id`).
    pub fail_rate: f64,
    /// Ops with these work ids always fail.
    pub fail_work_ids: Vec<u64>,
    /// Hold each completion at least this long (at most [`MAX_FAULT_DELAY`]).
    pub delay: Duration,
    /// Hold completions for a random time in `[delay, 2 * delay]` and release
    /// the ones due together in shuffled order.
    pub reorder: bool,
    /// Seed of the failure choice and the shuffle.
    pub seed: u64,
}

impl FaultConfig {
    /// Checks the ranges: `fail_rate` finite in `0..=1`, `delay` at most
    /// [`MAX_FAULT_DELAY`]; else [`TransportError::Config`].
    pub fn validate(&self) -> Result<(), TransportError> {
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(TransportError::Config(format!(
                "fault fail_rate {} is not in 0..=1",
                self.fail_rate
            )));
        }
        if self.delay > MAX_FAULT_DELAY {
            return Err(TransportError::Config(format!(
                "fault delay {:?} is longer than {MAX_FAULT_DELAY:?}",
                self.delay
            )));
        }
        Ok(())
    }

    /// True if the op tagged `work_id` is to fail.
    pub fn fails(&self, work_id: u64) -> bool {
        self.fail_work_ids.contains(&work_id) || roll(self.seed, work_id) < self.fail_rate
    }
}

/// A uniform number in `[0, 1)` derived from `(seed, work_id)` (splitmix64).
fn roll(seed: u64, work_id: u64) -> f64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    (mix(seed ^ mix(work_id)) >> 11) as f64 / (1u64 << 53) as f64
}

/// Wraps a transport and injects the faults of a [`FaultConfig`].
pub struct FaultTransport {
    inner: Box<dyn Transport>,
    cfg: FaultConfig,
}

impl FaultTransport {
    /// Wraps `inner`. `cfg` is validated by [`Transport::start`].
    pub fn new(inner: Box<dyn Transport>, cfg: FaultConfig) -> Self {
        Self { inner, cfg }
    }
}

impl Transport for FaultTransport {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn local_descriptor(&self) -> Descriptor {
        self.inner.local_descriptor()
    }

    fn start(self: Box<Self>, local: Arc<StagingBuffer>) -> Result<Started, TransportError> {
        self.cfg.validate()?;
        let (poster, completions) = self.inner.start(local)?;
        let shared = Arc::new(Shared::default());
        let fail_ids: HashSet<u64> = self.cfg.fail_work_ids.iter().copied().collect();
        let poster = FaultPoster {
            inner: poster,
            fail_ids,
            fail_rate: self.cfg.fail_rate,
            seed: self.cfg.seed,
            shared: shared.clone(),
            posted: 0,
            scratch: Vec::new(),
            failed: Vec::new(),
        };
        let completions = FaultCompletions {
            inner: completions,
            shared,
            delay: self.cfg.delay,
            reorder: self.cfg.reorder,
            rng: StdRng::seed_from_u64(self.cfg.seed),
            held: VecDeque::new(),
            ready: VecDeque::new(),
            incoming: Vec::new(),
            inner_closed: false,
        };
        Ok((Box::new(poster), Box::new(completions)))
    }
}

/// State shared by the two halves.
#[derive(Default)]
struct Shared {
    /// Work ids of injected failures in flight (with multiplicity).
    injected: Mutex<HashMap<u64, u32>>,
    /// Completions delivered to the caller.
    delivered: AtomicU64,
}

impl Shared {
    fn unmark(injected: &mut HashMap<u64, u32>, work_id: u64) -> bool {
        match injected.get_mut(&work_id) {
            Some(count) if *count > 1 => {
                *count -= 1;
                true
            }
            Some(_) => {
                injected.remove(&work_id);
                true
            }
            None => false,
        }
    }
}

struct FaultPoster {
    inner: Box<dyn Poster>,
    fail_ids: HashSet<u64>,
    fail_rate: f64,
    seed: u64,
    shared: Arc<Shared>,
    posted: u64,
    /// The ops as posted to the inner transport...
    scratch: Vec<WriteOp>,
    /// ...and whether each was failed.
    failed: Vec<bool>,
}

impl FaultPoster {
    fn fails(&self, work_id: u64) -> bool {
        self.fail_ids.contains(&work_id) || roll(self.seed, work_id) < self.fail_rate
    }
}

impl Poster for FaultPoster {
    fn connect(&mut self, remote: &RemoteBuffer) -> Result<PeerIndex, TransportError> {
        self.inner.connect(remote)
    }

    fn prepare(&mut self) -> Result<Descriptor, TransportError> {
        self.inner.prepare()
    }

    fn connect_prepared(
        &mut self,
        prepared: &Descriptor,
        remote: &RemoteBuffer,
    ) -> Result<PeerIndex, TransportError> {
        self.inner.connect_prepared(prepared, remote)
    }

    fn discard_prepared(&mut self, prepared: &Descriptor) {
        self.inner.discard_prepared(prepared);
    }

    fn disconnect(&mut self, peer: PeerIndex) {
        self.inner.disconnect(peer);
    }

    fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError> {
        let room = self
            .inner
            .credits()
            .saturating_sub(self.in_flight())
            .min(ops.len());
        if room == 0 {
            return Ok(0);
        }
        self.scratch.clear();
        self.failed.clear();
        for op in &ops[..room] {
            let fail = self.fails(op.work_id);
            self.scratch
                .push(if fail { WriteOp { len: 0, ..*op } } else { *op });
            self.failed.push(fail);
        }
        // Mark before posting: the completion may be polled on the other
        // thread before `post` returns.
        {
            let mut injected = self.shared.injected.lock();
            for (op, _) in self.scratch.iter().zip(&self.failed).filter(|(_, f)| **f) {
                *injected.entry(op.work_id).or_insert(0) += 1;
            }
        }
        let result = self.inner.post(&self.scratch);
        let accepted = *result.as_ref().unwrap_or(&0);
        {
            let mut injected = self.shared.injected.lock();
            let rejected = self.scratch[accepted..]
                .iter()
                .zip(&self.failed[accepted..]);
            for (op, _) in rejected.filter(|(_, f)| **f) {
                Shared::unmark(&mut injected, op.work_id);
            }
        }
        self.posted += accepted as u64;
        if accepted > 0 {
            tracing::trace!(accepted, "fault wrapper posted");
        }
        result
    }

    fn in_flight(&self) -> usize {
        // Acquire: pairs with the Release in FaultCompletions::deliver; only
        // a count (no data is published through it).
        let delivered = self.shared.delivered.load(Ordering::Acquire);
        self.posted.wrapping_sub(delivered) as usize
    }

    fn drop_deadline(&self) -> Duration {
        self.inner.drop_deadline()
    }

    fn credits(&self) -> usize {
        self.inner.credits()
    }

    fn local_registry(&self) -> Option<Arc<dyn crate::transport::LocalRegistry>> {
        self.inner.local_registry()
    }
}

struct FaultCompletions {
    inner: Box<dyn Completions>,
    shared: Arc<Shared>,
    delay: Duration,
    reorder: bool,
    rng: StdRng,
    /// Completions taken from the inner transport, with their release time.
    held: VecDeque<(Instant, Completion)>,
    /// Released completions not yet handed out (when `max` was small).
    ready: VecDeque<Completion>,
    incoming: Vec<Completion>,
    inner_closed: bool,
}

impl FaultCompletions {
    /// Rewrites injected failures and holds the new completions.
    fn take_incoming(&mut self, now: Instant) {
        if self.incoming.is_empty() {
            return;
        }
        let mut injected = self.shared.injected.lock();
        for mut c in self.incoming.drain(..) {
            if !injected.is_empty() && Shared::unmark(&mut injected, c.work_id) {
                c.status = CompletionStatus::Injected as u32;
            }
            let hold = if self.reorder {
                let extra = self.rng.random_range(0..=self.delay.as_nanos() as u64);
                self.delay + Duration::from_nanos(extra)
            } else {
                self.delay
            };
            // delay <= MAX_FAULT_DELAY (validated), so this cannot overflow
            // in practice; fall back to `now` rather than panic.
            let at = now.checked_add(hold).unwrap_or(now);
            self.held.push_back((at, c));
        }
    }

    /// Moves due held completions to `ready` (shuffled if `reorder`).
    fn release_due(&mut self, now: Instant) {
        let before = self.ready.len();
        if self.reorder {
            let mut i = 0;
            while i < self.held.len() {
                if self.held[i].0 <= now {
                    if let Some((_, c)) = self.held.swap_remove_back(i) {
                        self.ready.push_back(c);
                    }
                } else {
                    i += 1;
                }
            }
            let fresh = &mut self.ready.make_contiguous()[before..];
            fresh.shuffle(&mut self.rng);
        } else {
            // Release times are monotonic without reorder: due ones are a prefix.
            while self.held.front().is_some_and(|(at, _)| *at <= now) {
                if let Some((_, c)) = self.held.pop_front() {
                    self.ready.push_back(c);
                }
            }
        }
    }

    fn deliver(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let n = max.min(self.ready.len());
        out.extend(self.ready.drain(..n));
        // Release: pairs with the Acquire in FaultPoster::in_flight.
        self.shared.delivered.fetch_add(n as u64, Ordering::Release);
        n
    }
}

impl Completions for FaultCompletions {
    fn poll(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
        deadline: Option<Instant>,
    ) -> PollStatus {
        if max == 0 {
            return PollStatus::Ready(0);
        }
        let mut first = true;
        loop {
            let now = Instant::now();
            self.release_due(now);
            if !self.ready.is_empty() {
                return PollStatus::Ready(self.deliver(out, max));
            }
            if self.inner_closed && self.held.is_empty() {
                return PollStatus::Closed;
            }
            if !first && deadline.is_some_and(|d| now >= d) {
                return PollStatus::TimedOut;
            }
            first = false;
            let next_release = self.held.iter().map(|(at, _)| *at).min();
            let wake = match (deadline, next_release) {
                (Some(d), Some(r)) => Some(d.min(r)),
                (d, r) => d.or(r),
            };
            if self.inner_closed {
                // Only held completions remain: sleep until the next is due
                // (or the deadline). `wake` is Some because `held` is not empty.
                if let Some(wake) = wake {
                    std::thread::sleep(wake.saturating_duration_since(now));
                }
                continue;
            }
            let mut incoming = std::mem::take(&mut self.incoming);
            let status = self.inner.poll(&mut incoming, usize::MAX, wake);
            self.incoming = incoming;
            match status {
                PollStatus::Ready(_) => self.take_incoming(Instant::now()),
                PollStatus::Closed => self.inner_closed = true,
                PollStatus::TimedOut => {}
            }
        }
    }
}
