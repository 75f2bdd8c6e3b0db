//! A request's life word: who took it out of its live phase, decided by one
//! compare-and-swap, so a caller's cancel (or a reservation given back that
//! orphans the request) and ctrl's own ending (completion, or an abort for
//! a refusal, a failed write, a timeout) can race without a lock and exactly
//! one of them wins.
//!
//! ```text
//!         caller: cancel ──► Cancelled ─┐
//!         caller: give-back ► Orphaned ─┤ ctrl aborts with the caller's status
//!  Live ──┤                              │ (fenced like any abort)
//!         ctrl: abort ─────► Aborted ───┘
//!         ctrl: complete ──► Completed
//! ```
//!
//! The word never changes again once it left `Live`: it records the winner
//! for good. ctrl's [`Phase`](super::core::Phase) follows it (ctrl moves a
//! request a caller stopped to `Aborting` with the caller's status when it
//! takes the key from the attention ring, or when its own ending lost the
//! race), so a cancel that returned `true` always ends the request
//! `Cancelled`, and one that returned `false` changed nothing.

use std::sync::OnceLock;

// Shuttle's atomic under the model check (`life_model` below), std's
// otherwise.
use crate::sync::{AtomicU64, Ordering};

use crate::protocol::ErrorCode;

use super::RequestStatus;

/// Low bits of the word: its state; an orphaning give-back keeps its chunk
/// count above them (for the failure's reason).
const TAG: u64 = 0b111;
const LIVE: u64 = 0;
const COMPLETED: u64 = 1;
const ABORTED: u64 = 2;
const CANCELLED: u64 = 3;
const ORPHANED: u64 = 4;
const SHIFT: u32 = 3;

/// How a caller stopped a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// `cancel` / `cancel_request` / `close`.
    Cancel,
    /// A reservation of `chunks` given back after another caller reserved
    /// the last batch: the request can no longer complete
    /// ([`Stored::orphans`](super::core::Stored::orphans)).
    Orphan {
        /// The chunks given back.
        chunks: usize,
    },
}

impl Stop {
    /// The status the request ends with.
    pub fn status(self) -> RequestStatus {
        match self {
            Stop::Cancel => RequestStatus::Cancelled,
            Stop::Orphan { chunks } => RequestStatus::Failed {
                code: ErrorCode::InconsistentRequest,
                reason: format!(
                    "a batch of {chunks} chunks was given back after the last batch was stored"
                ),
            },
        }
    }

    fn word(self) -> u64 {
        match self {
            Stop::Cancel => CANCELLED,
            // A chunk count fits: it is below the request's total, itself a
            // `usize` of a batch count far below 2^61.
            Stop::Orphan { chunks } => ORPHANED | ((chunks as u64) << SHIFT),
        }
    }
}

/// Where the word says the request is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum State<'a> {
    /// Nobody ended it yet.
    Live,
    /// ctrl completed it.
    Completed,
    /// ctrl aborted it for its own reason, with this status (`None` cannot
    /// happen: see [`Life::abort`]).
    Aborted(Option<&'a RequestStatus>),
    /// A caller stopped it.
    Stopped(Stop),
}

/// The word (see the module doc) and the status of ctrl's own abort.
#[derive(Debug)]
pub(crate) struct Life {
    word: AtomicU64,
    /// Set by ctrl just before its abort's compare-and-swap; read only once
    /// the word says `Aborted`.
    failure: OnceLock<RequestStatus>,
}

impl Default for Life {
    fn default() -> Self {
        Self {
            word: AtomicU64::new(LIVE),
            failure: OnceLock::new(),
        }
    }
}

impl Life {
    /// A caller stops a live request; true iff this call did (exactly one
    /// of the racing callers and ctrl's own ending wins).
    pub fn stop(&self, stop: Stop) -> bool {
        // AcqRel/Acquire: the single RMW on one word decides the race by
        // itself (all CASes on it are totally ordered, only one leaves
        // `Live`); the word publishes nothing else of the caller's (the
        // cancel token and the attention ring that follow order themselves).
        self.leave(stop.word()).is_ok()
    }

    /// ctrl's own abort with `status`; `Some(stop)` if a caller stopped the
    /// request first (report the caller's status instead).
    pub fn abort(&self, status: &RequestStatus) -> Option<Stop> {
        // Set before the CAS (whose Release publishes it), so whoever reads
        // `Aborted` (Acquire) finds it; if the CAS loses, it is never read.
        let _ = self.failure.set(status.clone());
        self.leave(ABORTED).err().and_then(caller_stop)
    }

    /// ctrl completes the request: `Ok` if it did, `Err(Some(stop))` if a
    /// caller stopped it first (ctrl aborts it with that status instead),
    /// `Err(None)` if it had ended already (ctrl does not complete twice).
    pub fn complete(&self) -> Result<(), Option<Stop>> {
        self.leave(COMPLETED).map_err(caller_stop)
    }

    /// The caller's stop, if a caller ended the request.
    pub fn stopped_by_caller(&self) -> Option<Stop> {
        caller_stop(self.load())
    }

    /// Where the request is.
    pub fn state(&self) -> State<'_> {
        match self.load() {
            LIVE => State::Live,
            COMPLETED => State::Completed,
            ABORTED => State::Aborted(self.failure.get()),
            w => caller_stop(w).map_or(State::Live, State::Stopped),
        }
    }

    fn load(&self) -> u64 {
        // Acquire: pairs with the Release of the CAS that wrote the word
        // (for `Aborted`: so `failure` is seen set).
        self.word.load(Ordering::Acquire)
    }

    /// `Live` → `to`; the word found if it was not `Live`.
    fn leave(&self, to: u64) -> Result<(), u64> {
        // AcqRel on success: Release publishes `failure` (see `abort`);
        // Acquire on failure: the loser reads the winner's word.
        self.word
            .compare_exchange(LIVE, to, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }
}

fn caller_stop(w: u64) -> Option<Stop> {
    match w & TAG {
        CANCELLED => Some(Stop::Cancel),
        ORPHANED => Some(Stop::Orphan {
            chunks: (w >> SHIFT) as usize,
        }),
        _ => None,
    }
}

#[cfg(all(test, not(feature = "shuttle-model")))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn one_party_leaves_live_and_the_word_keeps_it() {
        let l = Life::default();
        assert_eq!(l.state(), State::Live);
        assert!(l.stop(Stop::Orphan { chunks: 7 }));
        assert!(!l.stop(Stop::Cancel), "stopped once");
        assert_eq!(l.complete(), Err(Some(Stop::Orphan { chunks: 7 })));
        assert_eq!(
            l.abort(&RequestStatus::Cancelled),
            Some(Stop::Orphan { chunks: 7 })
        );
        assert_eq!(l.state(), State::Stopped(Stop::Orphan { chunks: 7 }));
        let failed = RequestStatus::Failed {
            code: ErrorCode::WriteFailed,
            reason: "x".into(),
        };
        let a = Life::default();
        assert_eq!(a.abort(&failed), None);
        assert_eq!(a.state(), State::Aborted(Some(&failed)));
        assert!(!a.stop(Stop::Cancel));
        assert_eq!(a.complete(), Err(None));
    }

    /// Callers cancelling while ctrl completes, all released onto the same
    /// word at once, round after round, each after a varying head start:
    /// per round exactly one wins, and a cancel returned true exactly in the
    /// rounds the word says a caller won. Bounded rounds; every spin has a
    /// deadline (`STALL` without progress).
    #[test]
    fn a_cancel_racing_completion_wins_exactly_when_it_says_so() {
        use std::sync::atomic::AtomicBool;
        use std::time::{Duration, Instant};
        const ROUNDS: usize = 20_000;
        /// Party 0 completes (ctrl), the others cancel.
        const PARTIES: usize = 3;
        let lives: Arc<Vec<Life>> = Arc::new((0..ROUNDS).map(|_| Life::default()).collect());
        // Per round and party: its call won.
        let wins: Arc<Vec<AtomicBool>> = Arc::new(
            (0..ROUNDS * PARTIES)
                .map(|_| AtomicBool::new(false))
                .collect(),
        );
        // Round `r` starts when `go` passes r; `done` counts finished calls.
        let (go, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        // A hang is one wait without progress this long (a deadline on the
        // whole run failed on a 2-CPU machine loaded with other tests,
        // where each yield may give a whole time slice away).
        const STALL: Duration = Duration::from_secs(30);
        let spin_until = move |what: &str, cond: &dyn Fn() -> bool| {
            let end = Instant::now() + STALL;
            while !cond() {
                assert!(Instant::now() < end, "hung {STALL:?} waiting for {what}");
                std::thread::yield_now();
            }
        };
        let parties: Vec<_> = (0..PARTIES)
            .map(|k| {
                let (lives, wins, go, done) = (
                    Arc::clone(&lives),
                    Arc::clone(&wins),
                    Arc::clone(&go),
                    Arc::clone(&done),
                );
                std::thread::spawn(move || {
                    for r in 0..ROUNDS {
                        spin_until("the round to start", &|| go.load(Ordering::Acquire) > r);
                        // Varying head starts, so any party may come first.
                        for _ in 0..(r * (7 + 6 * k)) % 331 {
                            std::hint::spin_loop();
                        }
                        let won = if k == 0 {
                            lives[r].complete().is_ok()
                        } else {
                            lives[r].stop(Stop::Cancel)
                        };
                        wins[r * PARTIES + k].store(won, Ordering::Release);
                        done.fetch_add(1, Ordering::AcqRel);
                    }
                })
            })
            .collect();
        for r in 0..ROUNDS {
            go.store(r + 1, Ordering::Release);
            spin_until("the round's calls", &|| {
                done.load(Ordering::Acquire) >= PARTIES * (r + 1)
            });
        }
        for p in parties {
            p.join().expect("party");
        }
        let mut completed = 0;
        for r in 0..ROUNDS {
            let won = |k: usize| wins[r * PARTIES + k].load(Ordering::Acquire);
            let cancels = (1..PARTIES).filter(|&k| won(k)).count();
            assert_eq!(
                usize::from(won(0)) + cancels,
                1,
                "round {r}: exactly one of the completion and the cancels won"
            );
            assert_eq!(
                cancels == 1,
                lives[r].stopped_by_caller() == Some(Stop::Cancel),
                "round {r}: a cancel returned true iff the word says it won"
            );
            completed += usize::from(won(0));
        }
        eprintln!("{completed} of {ROUNDS} rounds completed, the others cancelled");
    }
}

/// Shuttle model of the life word (the real code, shuttle's atomic): two
/// callers stop a request (a cancel, an orphaning give-back) while ctrl
/// completes or aborts it, under every schedule shuttle tries; exactly one
/// wins, each call's answer says whether it did, the word keeps the winner,
/// and ctrl's abort status is there when the word says `Aborted`. Run:
/// `cargo test -p kvferry --lib --features shuttle-model life_model`.
#[cfg(all(test, feature = "shuttle-model"))]
mod life_model {
    use super::*;
    use std::sync::Arc;

    fn race(ctrl_completes: bool) {
        let failed = RequestStatus::Failed {
            code: ErrorCode::WriteFailed,
            reason: "w".into(),
        };
        let l = Arc::new(Life::default());
        let callers: Vec<_> = [Stop::Cancel, Stop::Orphan { chunks: 3 }]
            .into_iter()
            .map(|stop| {
                let l = Arc::clone(&l);
                shuttle::thread::spawn(move || (stop, l.stop(stop)))
            })
            .collect();
        let ctrl_won = if ctrl_completes {
            l.complete().is_ok()
        } else {
            l.abort(&failed).is_none()
        };
        let won: Vec<Stop> = callers
            .into_iter()
            .filter_map(|c| {
                let (stop, won) = c.join().expect("caller");
                won.then_some(stop)
            })
            .collect();
        assert_eq!(usize::from(ctrl_won) + won.len(), 1, "exactly one winner");
        match (l.state(), won.first()) {
            (State::Completed, None) => assert!(ctrl_completes && ctrl_won),
            (State::Aborted(s), None) => {
                assert!(!ctrl_completes && ctrl_won);
                assert_eq!(s, Some(&failed), "the abort's status is published");
            }
            (State::Stopped(s), Some(&w)) => assert_eq!(s, w, "the word keeps the winner"),
            (state, w) => panic!("word {state:?} with caller winner {w:?}"),
        }
    }

    #[test]
    fn exactly_one_party_ends_a_request_under_every_schedule() {
        for completes in [true, false] {
            shuttle::check_random(move || race(completes), 2000);
            shuttle::check_pct(move || race(completes), 2000, 3);
        }
    }
}
