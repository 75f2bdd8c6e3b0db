//! The transport conformance suite: the `Poster` / `Completions` contract
//! every transport keeps, written once and run against shm
//! (`tests/transport_shm.rs`), tcp (`tests/transport_tcp.rs`) and rdma
//! (`tests/transport_rdma.rs`, skipped without a device, run in the
//! soft-RoCE guest). Each transport implements [`Fixture`] (its receiver
//! side and how to connect to it) and instantiates the checks with
//! [`conformance_suite!`]; what only one transport has (shm mapping and
//! geometry checks, tcp grants, secrets and scripted listeners, rdma queue
//! pair faults) stays in that transport's file.
//!
//! Where each earlier per-transport test's assertions live now:
//!
//! | earlier test | now |
//! |---|---|
//! | shm `a_write_lands_in_the_receiver_region` | [`a_write_lands_in_its_slot_and_nowhere_else`] |
//! | shm `many_ops_across_two_peers_with_credit_flow` | [`many_ops_across_two_receivers_with_credit_flow`] |
//! | shm `out_of_bounds_ops_complete_with_an_error_and_write_nothing` | [`out_of_bounds_ops_complete_with_an_error_and_write_nothing`] |
//! | shm / tcp `unknown_and_disconnected_peers_complete_with_unknown_peer` | [`unknown_and_disconnected_peers_complete_with_unknown_peer`] (tcp's wait for the connection to close: [`Fixture::await_disconnected`]) |
//! | shm `post_stops_at_the_credit_limit_and_resumes_after_poll`, tcp `post_stops_at_the_credit_limit_and_poll_respects_max_and_deadline` | [`post_stops_at_the_credit_limit_and_resumes_after_poll`] (shm's in-order completions: [`Fixture::IN_ORDER`]) |
//! | shm / tcp `dropping_the_poster_delivers_every_completion_then_closed` | [`dropping_the_poster_delivers_every_completion_then_closed`] |
//! | shm `poll_times_out_when_idle_and_respects_max` | [`poll_times_out_when_idle_and_respects_max`] |
//! | shm / tcp `post_fails_with_closed_once_the_engine_stopped` | [`post_fails_with_closed_once_the_engine_stopped`] |
//! | shm `connect_checks_the_descriptor_and_the_file`, tcp `connect_checks_the_descriptor_and_reports_typed_errors`, rdma `the_generic_connect_and_foreign_descriptors_are_refused`: the foreign-descriptor parts | [`connect_refuses_foreign_descriptors`]; the rest stays in each file |
//! | shm `idle_engine_thread_sleeps`, tcp `idle_engine_and_data_threads_sleep` | [`idle_threads_sleep`] (shm and tcp; rdma's CQ thread is not checked, as before) |
//! | tcp `writes_land_in_granted_slots_with_credit_flow` | [`many_ops_across_two_receivers_with_credit_flow`] (credit flow, one connection per receiver: [`Fixture::connections`]) and [`a_write_spanning_slots_and_an_empty_write_land`] |
//! | rdma `writes_land_in_the_receivers_slots` | [`many_ops_across_two_receivers_with_credit_flow`] (`senders() == 1`: [`Fixture::connections`]) |
//! | rdma `bad_ops_complete_at_once_with_their_reason` | [`out_of_bounds_ops_complete_with_an_error_and_write_nothing`] and [`unknown_and_disconnected_peers_complete_with_unknown_peer`] |
#![allow(dead_code)] // not every transport runs every check

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::protocol::Descriptor;
use kvferry::staging::StagingBuffer;
use kvferry::transport::{
    Completion, CompletionStatus, Completions, PollStatus, Poster, RemoteBuffer, TransportError,
    WriteOp,
};

use crate::common_transport::{collect, op, pattern, post_all, WAIT};

/// Slot size of every receive buffer and staging buffer in the suite.
pub const CHUNK: u64 = 4096;

/// One transport under test: a started sender side (poster and completion
/// half over a staging buffer) and the receivers it is connected to.
pub trait Fixture: Sized {
    /// The transport's name (`Transport::kind`, `TransportError::Unsupported`).
    const KIND: &'static str;
    /// True if the transport completes one peer's writes in posting order.
    const IN_ORDER: bool;
    /// Thread names (prefixes of `/proc/self/task/*/comm`) of the engine
    /// threads that must sleep when idle, one kind each.
    const THREADS: &'static [&'static str];

    /// False, after saying why (`SKIP <test>: ...`), where the transport
    /// cannot run on this host.
    fn available(test: &str) -> bool {
        let _ = test;
        true
    }
    /// Starts the sender side over `staging` with `credits` credits.
    fn start(staging: Arc<StagingBuffer>, credits: usize) -> Self;
    /// A new receiver of `capacity` slots of [`CHUNK`] bytes, every slot
    /// writable by this sender, connected; returns its index (for
    /// [`Fixture::read_slot`]) and its peer index.
    fn add_receiver(&mut self, capacity: u64) -> (usize, u32);
    /// Connects receiver `rx` again (after a disconnect: a fresh peer).
    fn reconnect(&mut self, rx: usize) -> Result<u32, TransportError>;
    /// The first `CHUNK` bytes of slot `slot` of receiver `rx`.
    fn read_slot(&self, rx: usize, slot: u32) -> Vec<u8>;
    /// Data connections receiver `rx` has open, where the transport counts them.
    fn connections(&self, rx: usize) -> Option<usize> {
        let _ = rx;
        None
    }
    /// Waits until receiver `rx` noticed that the sender disconnected it
    /// (where it can notice).
    fn await_disconnected(&self, rx: usize) {
        let _ = rx;
    }
    /// A descriptor of another transport, which `connect` must refuse.
    fn foreign() -> Descriptor;
    /// The poster and the completion half, those not dropped.
    fn parts(&mut self) -> (Option<&mut dyn Poster>, Option<&mut dyn Completions>);
    /// The poster and the completion half (both still there).
    fn io(&mut self) -> (&mut dyn Poster, &mut dyn Completions) {
        match self.parts() {
            (Some(p), Some(c)) => (p, c),
            _ => panic!("{}: the poster or the completions were dropped", Self::KIND),
        }
    }
    /// The poster (still there).
    fn poster(&mut self) -> &mut dyn Poster {
        self.parts().0.expect("the poster was dropped")
    }
    /// The completion half (still there).
    fn completions(&mut self) -> &mut dyn Completions {
        self.parts().1.expect("the completions were dropped")
    }
    /// Drops the poster (the completion half stays).
    fn drop_poster(&mut self);
    /// Drops the completion half (the poster stays).
    fn drop_completions(&mut self);
}

/// The two halves of a started transport held as trait objects (what
/// `Transport::start` returns), for fixtures to keep and hand out in
/// [`Fixture::parts`].
pub struct Halves {
    /// The poster, `None` once dropped.
    pub poster: Option<Box<dyn Poster>>,
    /// The completion half, `None` once dropped.
    pub completions: Option<Box<dyn Completions>>,
}

impl Halves {
    /// Both halves, as `Transport::start` returned them.
    pub fn new((poster, completions): (Box<dyn Poster>, Box<dyn Completions>)) -> Self {
        Halves {
            poster: Some(poster),
            completions: Some(completions),
        }
    }

    /// See [`Fixture::parts`].
    pub fn parts(&mut self) -> (Option<&mut dyn Poster>, Option<&mut dyn Completions>) {
        (
            self.poster.as_mut().map(|p| &mut **p as _),
            self.completions.as_mut().map(|c| &mut **c as _),
        )
    }
}

/// Instantiates the suite for `$fixture`: one `#[test]` per check, in a
/// module `conformance`, each skipped where [`Fixture::available`] says so.
/// Checks named after the `;` are instantiated too (those not every
/// transport runs).
macro_rules! conformance_suite {
    ($fixture:ty $(; $($extra:ident),*)?) => {
        mod conformance {
            conformance_suite!(@tests $fixture;
                a_write_lands_in_its_slot_and_nowhere_else,
                many_ops_across_two_receivers_with_credit_flow,
                a_write_spanning_slots_and_an_empty_write_land,
                out_of_bounds_ops_complete_with_an_error_and_write_nothing,
                unknown_and_disconnected_peers_complete_with_unknown_peer,
                post_stops_at_the_credit_limit_and_resumes_after_poll,
                dropping_the_poster_delivers_every_completion_then_closed,
                poll_times_out_when_idle_and_respects_max,
                post_fails_with_closed_once_the_engine_stopped,
                connect_refuses_foreign_descriptors
                $($(, $extra)*)?
            );
        }
    };
    (@tests $fixture:ty; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                use $crate::suite::Fixture as _;
                if <$fixture>::available(concat!("conformance::", stringify!($name))) {
                    $crate::suite::$name::<$fixture>();
                }
            }
        )*
    };
}

/// A staging buffer of `slots` slots, slot `s` holding `pattern(s)`.
fn staging(slots: usize) -> Arc<StagingBuffer> {
    let mut s = StagingBuffer::new(slots, CHUNK).unwrap();
    for i in 0..slots as u32 {
        s.write_slot(i, &pattern(u64::from(i), CHUNK as usize))
            .unwrap();
    }
    Arc::new(s)
}

/// Asserts every slot of receiver `rx` (of `capacity`) except `except` is zero.
fn assert_untouched<F: Fixture>(f: &F, rx: usize, capacity: u64, except: &[u32]) {
    for s in (0..capacity as u32).filter(|s| !except.contains(s)) {
        assert!(
            f.read_slot(rx, s).iter().all(|&b| b == 0),
            "{}: slot {s} of receiver {rx} touched",
            F::KIND
        );
    }
}

/// Sorted (work id, status) pairs.
fn statuses(done: &[Completion]) -> Vec<(u64, CompletionStatus)> {
    let mut v: Vec<_> = done.iter().map(|c| (c.work_id, c.status())).collect();
    v.sort_by_key(|&(w, _)| w);
    v
}

/// One write lands in its slot, completes `Ok` once, and touches nothing else.
pub fn a_write_lands_in_its_slot_and_nowhere_else<F: Fixture>() {
    let st = staging(4);
    let mut f = F::start(st.clone(), 16);
    let (rx, peer) = f.add_receiver(8);
    let (poster, comps) = f.io();
    let n = poster
        .post(&[op(42, st.slot_offset(1), 5 * CHUNK, CHUNK, peer)])
        .unwrap();
    assert_eq!(n, 1);
    let done = collect(comps, 1, "single write");
    assert_eq!(done, vec![Completion::new(42, CompletionStatus::Ok)]);
    assert!(done[0].ok());
    assert_eq!(poster.in_flight(), 0);
    assert_eq!(f.read_slot(rx, 5), pattern(1, CHUNK as usize));
    assert_untouched(&f, rx, 8, &[5]);
}

/// 64 writes to two receivers through 8 credits: every op completes exactly
/// once, `Ok`, and every byte lands where its op said (receiver slots in
/// reverse order of the staging slots).
pub fn many_ops_across_two_receivers_with_credit_flow<F: Fixture>() {
    const SLOTS: u64 = 16;
    let st = staging(32);
    let mut f = F::start(st.clone(), 8);
    let (r0, p0) = f.add_receiver(SLOTS);
    let (r1, p1) = f.add_receiver(SLOTS);
    assert_ne!(p0, p1);
    let target = |w: u64| {
        let rx = (w % 2) as usize;
        (rx, SLOTS - 1 - (w / 2) % SLOTS)
    };
    let ops: Vec<WriteOp> = (0..64u64)
        .map(|w| {
            let (rx, slot) = target(w);
            let peer = if rx == 0 { p0 } else { p1 };
            op(
                1000 + w,
                st.slot_offset((w % 32) as u32),
                slot * CHUNK,
                CHUNK,
                peer,
            )
        })
        .collect();
    let (poster, comps) = f.io();
    assert_eq!(poster.credits(), 8);
    let done = post_all(poster, comps, &ops);
    assert_eq!(done.len(), ops.len());
    assert!(done.iter().all(Completion::ok), "{done:?}");
    let ids: HashSet<u64> = done.iter().map(|c| c.work_id).collect();
    assert_eq!(ids.len(), ops.len(), "every op completes exactly once");
    assert_eq!(ids, ops.iter().map(|o| o.work_id).collect());
    assert_eq!(poster.in_flight(), 0);
    // Ops w and w + 32 write the same staging slot to the same place.
    for w in 0..32u64 {
        let (rx, slot) = target(w);
        assert_eq!(
            f.read_slot([r0, r1][rx], slot as u32),
            pattern(w, CHUNK as usize),
            "op {w}: receiver {rx} slot {slot}"
        );
    }
    for rx in [r0, r1] {
        if let Some(n) = f.connections(rx) {
            assert_eq!(n, 1, "one data connection per receiver");
        }
    }
}

/// One write covering two slots (a coalesced run) lands in both; an empty
/// write completes `Ok`.
pub fn a_write_spanning_slots_and_an_empty_write_land<F: Fixture>() {
    let st = staging(8);
    let mut f = F::start(st.clone(), 8);
    let (rx, p) = f.add_receiver(4);
    let (poster, comps) = f.io();
    let done = post_all(
        poster,
        comps,
        &[
            op(100, st.slot_offset(6), CHUNK, 2 * CHUNK, p),
            op(101, 0, 0, 0, p),
        ],
    );
    assert_eq!(
        statuses(&done),
        vec![(100, CompletionStatus::Ok), (101, CompletionStatus::Ok)]
    );
    assert_eq!(f.read_slot(rx, 1), pattern(6, CHUNK as usize));
    assert_eq!(f.read_slot(rx, 2), pattern(7, CHUNK as usize));
    assert_untouched(&f, rx, 4, &[1, 2]);
}

/// Ops outside either buffer (by one byte, by overflowing `u64`, by length)
/// complete `OutOfBounds` and write nothing; an empty op at the very end is
/// fine; the transport stays healthy.
pub fn out_of_bounds_ops_complete_with_an_error_and_write_nothing<F: Fixture>() {
    const SLOTS: u64 = 4;
    let end = SLOTS * CHUNK;
    let st = staging(SLOTS as usize);
    let mut f = F::start(st.clone(), 16);
    let (rx, p) = f.add_receiver(SLOTS);
    let bad = [
        op(1, 0, end - 10, 11, p),     // remote end one past the area
        op(2, end - 10, 0, 11, p),     // local end one past staging
        op(3, 0, u64::MAX - 4, 10, p), // remote end overflows u64
        op(4, u64::MAX, 0, 1, p),      // local end overflows u64
        op(5, 0, end, 0, p),           // empty op at the end: fine
        op(6, 0, end + 1, 0, p),       // empty op past the end
        op(7, 0, 0, u64::MAX, p),      // huge length
        op(8, 0, end, CHUNK, p),       // a whole slot past the end
        op(9, end, 0, CHUNK, p),       // a whole staging slot past the end
    ];
    let (poster, comps) = f.io();
    assert_eq!(poster.post(&bad).unwrap(), bad.len());
    let done = collect(comps, bad.len(), "out-of-bounds ops");
    use CompletionStatus::{Ok, OutOfBounds};
    assert_eq!(
        statuses(&done),
        vec![
            (1, OutOfBounds),
            (2, OutOfBounds),
            (3, OutOfBounds),
            (4, OutOfBounds),
            (5, Ok),
            (6, OutOfBounds),
            (7, OutOfBounds),
            (8, OutOfBounds),
            (9, OutOfBounds),
        ]
    );
    if F::IN_ORDER {
        let ids: Vec<u64> = done.iter().map(|c| c.work_id).collect();
        assert_eq!(ids, (1..=9).collect::<Vec<_>>(), "completed in order");
    }
    assert_untouched(&f, rx, SLOTS, &[]);
    // Still healthy.
    let (poster, comps) = f.io();
    poster.post(&[op(10, 0, 3 * CHUNK, CHUNK, p)]).unwrap();
    assert!(collect(comps, 1, "write after errors")[0].ok());
    assert_eq!(f.read_slot(rx, 3), pattern(0, CHUNK as usize));
}

/// Writes to a peer never connected, or disconnected, complete
/// `UnknownPeer` and write nothing; disconnecting twice or an unknown peer
/// is a no-op; connecting again gives a fresh peer that works.
pub fn unknown_and_disconnected_peers_complete_with_unknown_peer<F: Fixture>() {
    let st = staging(2);
    let mut f = F::start(st.clone(), 8);
    let (rx, p) = f.add_receiver(2);
    let (poster, comps) = f.io();
    let done = post_all(
        poster,
        comps,
        &[
            op(1, 0, 0, 16, p + 1),
            op(2, 0, 0, 16, 77),
            op(3, 0, 0, CHUNK, p),
        ],
    );
    use CompletionStatus::{Ok, UnknownPeer};
    assert_eq!(
        statuses(&done),
        vec![(1, UnknownPeer), (2, UnknownPeer), (3, Ok)]
    );
    assert_eq!(f.read_slot(rx, 0), pattern(0, CHUNK as usize));
    let (poster, comps) = f.io();
    poster.disconnect(p);
    poster.disconnect(p); // twice: no-op
    poster.disconnect(12345); // unknown: ignored
    let done = post_all(poster, comps, &[op(4, CHUNK, CHUNK, CHUNK, p)]);
    assert_eq!(statuses(&done), vec![(4, UnknownPeer)]);
    f.await_disconnected(rx);
    assert_untouched(&f, rx, 2, &[0]);
    // Connecting again gets a fresh index that works.
    let p2 = f.reconnect(rx).expect("reconnect");
    assert_ne!(p2, p);
    let (poster, comps) = f.io();
    let done = post_all(poster, comps, &[op(5, CHUNK, CHUNK, CHUNK, p2)]);
    assert_eq!(statuses(&done), vec![(5, Ok)]);
    assert_eq!(f.read_slot(rx, 1), pattern(1, CHUNK as usize));
}

/// `post` takes no more ops than there are credits, gives them back as the
/// completions are polled, and `in_flight` counts what is outstanding.
pub fn post_stops_at_the_credit_limit_and_resumes_after_poll<F: Fixture>() {
    let st = staging(16);
    let mut f = F::start(st.clone(), 4);
    let (_, p) = f.add_receiver(16);
    let ops: Vec<WriteOp> = (0..10)
        .map(|i| op(i, i * CHUNK, i * CHUNK, CHUNK, p))
        .collect();
    let (poster, comps) = f.io();
    assert_eq!(poster.credits(), 4);
    assert_eq!(poster.post(&ops).unwrap(), 4);
    assert_eq!(poster.in_flight(), 4);
    assert_eq!(poster.post(&ops[4..]).unwrap(), 0, "no credit left");
    let mut out = Vec::new();
    assert_eq!(comps.poll(&mut out, 0, None), PollStatus::Ready(0));
    let first = collect(comps, 3, "first three");
    assert_eq!(poster.in_flight(), 1);
    assert_eq!(
        poster.post(&ops[4..]).unwrap(),
        3,
        "three credits came back"
    );
    let rest = collect(comps, 4, "rest");
    let mut ids: Vec<u64> = first.iter().chain(&rest).map(|c| c.work_id).collect();
    if F::IN_ORDER {
        assert_eq!(ids, (0..7).collect::<Vec<_>>(), "completed in order");
    }
    ids.sort_unstable();
    assert_eq!(ids, (0..7).collect::<Vec<_>>());
    assert!(first.iter().chain(&rest).all(Completion::ok));
    assert_eq!(poster.in_flight(), 0);
    assert_eq!(poster.post(&ops[7..]).unwrap(), 3);
    collect(comps, 3, "last round");
    assert_eq!(poster.in_flight(), 0);
}

/// Dropping the poster with writes in flight: every one still completes
/// (`Ok`, once), `poll` respects `max`, then the completion half reports
/// `Closed`, and stays so.
pub fn dropping_the_poster_delivers_every_completion_then_closed<F: Fixture>() {
    const N: u64 = 32;
    let st = staging(2);
    let mut f = F::start(st.clone(), 64);
    let (_, p) = f.add_receiver(2);
    let ops: Vec<WriteOp> = (0..N)
        .map(|w| op(w, (w % 2) * CHUNK, (w % 2) * CHUNK, CHUNK, p))
        .collect();
    assert_eq!(f.poster().post(&ops).unwrap(), ops.len());
    f.drop_poster();
    let comps = f.completions();
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    loop {
        match comps.poll(&mut out, 3, Some(deadline)) {
            PollStatus::Ready(n) => assert!((1..=3).contains(&n), "max 3, got {n}"),
            PollStatus::Closed => break,
            PollStatus::TimedOut => panic!("close: poll timed out after {} completions", out.len()),
        }
    }
    assert!(out.iter().all(Completion::ok), "{out:?}");
    let mut ids: Vec<u64> = out.iter().map(|c| c.work_id).collect();
    if F::IN_ORDER {
        assert_eq!(ids, (0..N).collect::<Vec<_>>(), "completed in order");
    }
    ids.sort_unstable();
    assert_eq!(ids, (0..N).collect::<Vec<_>>(), "each completed once");
    assert_eq!(
        comps.poll(&mut out, 1, Some(Instant::now() + WAIT)),
        PollStatus::Closed,
        "stays closed"
    );
}

/// An idle `poll` times out at its deadline; `max` 0 returns at once; a
/// busy one returns at most `max`.
pub fn poll_times_out_when_idle_and_respects_max<F: Fixture>() {
    let st = staging(4);
    let mut f = F::start(st.clone(), 8);
    let comps = f.completions();
    let mut out = Vec::new();
    let soon = Instant::now() + Duration::from_millis(20);
    assert_eq!(comps.poll(&mut out, 8, Some(soon)), PollStatus::TimedOut);
    assert!(out.is_empty());
    assert_eq!(comps.poll(&mut out, 0, Some(soon)), PollStatus::Ready(0));
    let (_, p) = f.add_receiver(4);
    let ops: Vec<WriteOp> = (0..4)
        .map(|i| op(i, i * CHUNK, i * CHUNK, CHUNK, p))
        .collect();
    let (poster, comps) = f.io();
    assert_eq!(poster.post(&ops).unwrap(), 4);
    match comps.poll(&mut out, 2, Some(Instant::now() + WAIT)) {
        PollStatus::Ready(n) => assert!((1..=2).contains(&n), "max respected, got {n}"),
        s => panic!("poll after post: {s:?}"),
    }
    let got = out.len();
    out.extend(collect(comps, 4 - got, "remaining"));
    assert_eq!(out.len(), 4);
    let soon = Instant::now() + Duration::from_millis(20);
    assert_eq!(comps.poll(&mut out, 8, Some(soon)), PollStatus::TimedOut);
    assert_eq!(out.len(), 4, "nothing more");
}

/// Once nobody listens for completions, the engine stops at its next
/// completion and `post` fails with `Closed`; connecting then either works
/// or says `Closed`.
pub fn post_fails_with_closed_once_the_engine_stopped<F: Fixture>() {
    let st = staging(1);
    let mut f = F::start(st.clone(), 8);
    let (rx, p) = f.add_receiver(1);
    f.drop_completions();
    let deadline = Instant::now() + WAIT;
    let mut work_id = 0;
    loop {
        match f.poster().post(&[op(work_id, 0, 0, 64, p)]) {
            Err(TransportError::Closed) => break,
            Ok(_) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
        work_id += 1;
        assert!(
            Instant::now() < deadline,
            "engine did not stop after its completion half was dropped"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(matches!(
        f.reconnect(rx),
        Ok(_) | Err(TransportError::Closed)
    ));
}

/// The name `TransportError::Unsupported` gives descriptor `d`'s kind.
fn kind_of(d: &Descriptor) -> &'static str {
    match d {
        Descriptor::None => "none",
        Descriptor::Shm { .. } => "shm",
        Descriptor::Tcp { .. } => "tcp",
        Descriptor::Rdma { .. } => "rdma",
    }
}

/// `connect` refuses a descriptor of another transport, and none at all,
/// naming both.
pub fn connect_refuses_foreign_descriptors<F: Fixture>() {
    let st = staging(1);
    let mut f = F::start(st, 8);
    for descriptor in [F::foreign(), Descriptor::None] {
        let remote = RemoteBuffer {
            descriptor: descriptor.clone(),
            chunk_bytes: CHUNK,
            capacity_chunks: 4,
        };
        match f.poster().connect(&remote) {
            Err(TransportError::Unsupported {
                transport,
                descriptor: kind,
            }) => {
                assert_eq!(transport, F::KIND);
                assert_eq!(kind, kind_of(&descriptor));
            }
            other => panic!("{}: connect({descriptor:?}) = {other:?}", F::KIND),
        }
    }
}

/// Threads of this process whose name starts with `prefix`: (tid, state letter).
pub fn thread_states(prefix: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim().starts_with(prefix) {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // The state letter is the first field after "(comm)".
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().next());
            found.push((
                task.file_name().to_string_lossy().into_owned(),
                state.unwrap_or("gone").to_owned(),
            ));
        }
    }
    found
}

/// After a write, the transport's engine threads ([`Fixture::THREADS`])
/// sleep (state `S`): an idle transport uses no CPU.
pub fn idle_threads_sleep<F: Fixture>() {
    let mine =
        || -> Vec<(String, String)> { F::THREADS.iter().flat_map(|p| thread_states(p)).collect() };
    let before: HashSet<String> = mine().into_iter().map(|(tid, _)| tid).collect();
    let st = staging(1);
    let mut f = F::start(st, 8);
    let (_, p) = f.add_receiver(1);
    let (poster, comps) = f.io();
    post_all(poster, comps, &[op(1, 0, 0, 64, p)]);
    // Ours are among the threads that appeared (tests run in parallel; a
    // thread names itself once it runs); all of those must be seen asleep
    // at once.
    let deadline = Instant::now() + WAIT;
    loop {
        let new: Vec<(String, String)> = mine()
            .into_iter()
            .filter(|(tid, _)| !before.contains(tid))
            .collect();
        if new.len() >= F::THREADS.len() && new.iter().all(|(_, s)| s == "S") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} threads {:?} never all went to sleep: {new:?}",
            F::KIND,
            F::THREADS
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
