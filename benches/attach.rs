//! Attach from another process (`docs/attach.md`), each figure against a
//! baseline in the same run (read the ratios; the machine is a shared,
//! noisy 2-vCPU VM). The interleaved summary and each end-to-end line
//! say the VM's steal time over their run (`/proc/stat`): at tens of
//! percent the hypervisor stops a vCPU for milliseconds at a time, and
//! the tails (and often the medians) are the host's, not kvferry's.
//!
//! `cargo bench --bench attach -- --warm-up-time 1 --measurement-time 3`
//!
//! 1. `attach_rtt/{in_process,in_process_take,attached}`: consuming one
//!    complete one-chunk request (4 KiB), the per-chunk ring round trip.
//!    Two in-process baselines: `in_process`, the event-loop pattern of a
//!    linked-in decoder (`Receiver::watch`, its status, `Receiver::take`,
//!    read a byte, drop; `watch` makes and closes an eventfd, most of its
//!    cost), and `in_process_take`, what the daemon's session itself does
//!    (`Receiver::take` first, `watch` only for a request not complete
//!    yet; read, drop) — the like-for-like baseline. Attached: the same
//!    through a [`DecoderDaemon`] over the same receiver, from the Rust
//!    [`DecoderClient`] (SUBSCRIBE on the submission ring, the socket
//!    doorbell only if the session sleeps → the session takes → READY +
//!    CHUNK on the completion ring → read a byte in place → RELEASE). Requests are
//!    written (untimed) by an in-process `Sender` in rounds of
//!    [`RTT_ROUND`]; only their consumption is timed.
//!    After criterion's groups, first the round trip of a client that has
//!    just attached ([`fresh_rounds`]: its first pass over its completion
//!    ring, against `in_process_take`, alternating), then the same three
//!    paths once more, interleaved
//!    round by round ([`RTT_PAIRS`] rounds of [`RTT_ROUND`] requests each):
//!    the median per-request time of each and the median of the per-round
//!    ratios, attached to each baseline. The attached rounds start right
//!    after the (untimed) fill, so each pays one doorbell wake-up of a
//!    session that went to sleep meanwhile; a fourth path, attached with
//!    the session awake (one untimed submission wakes it right before the
//!    timed round), is the steady state of a busy decoder. Last, the rings'
//!    floor (a RELEASE of an unknown tag answered REFUSED: the hand-offs
//!    and the session round without the receiver's work). Then
//!    `in_process_take` and attached-awake again over requests of
//!    [`MULTI_CHUNKS`] chunks, per chunk: the ring's cost per request
//!    spread over a request as a decoder usually gets it (the one-chunk
//!    rounds are the worst case, and the figure the target is read from).
//!    The paths of a round run within a few milliseconds of each other, so
//!    a burst of load on the shared VM hits all of them, where criterion's
//!    groups run one path for seconds, then the other. Each round runs in
//!    both placements of the client's and the session's threads, one after
//!    the other ([`Placement`]): `free`, the scheduler's choice, and
//!    `apart`, the session and the receiver's threads on the last CPU and
//!    the client on the others (what `kvferry receiver --attach --cpus N`
//!    does with the decoder started elsewhere). The in-process baselines
//!    consume where the session does (in `apart`, on the last CPU): a
//!    `take` on a CPU other than the receiver control thread's costs more
//!    than twice one on it, which a baseline on the client's CPU would
//!    have put into the ratio (`docs/benchmarks.md`, "Attach, 2026-12-07
//!    (5)"). Before them, one line says where the
//!    scheduler puts a thread it wakes ([`wake_placement`]), which decides
//!    `free`: on the project's VM nearly always on the waker's CPU, so
//!    every hand-off there is a context switch on one CPU. All of this
//!    runs twice: with the daemon's default session (it lingers up to
//!    250 µs after its last work, then sleeps) and with a session that
//!    polls for [`RTT_POLL_IDLE`] after its last work
//!    ([`AttachConfig::poll_idle`], io_uring's `sq_thread_idle`), which a
//!    round then finds awake; the polling session runs, yielding, through
//!    the baselines' rounds too.
//!    Then the prefill worker's round trip ([`prefill_rtt`]): a
//!    one-chunk request from BEGIN to DONE through a [`PrefillDaemon`]
//!    against the same request written in process by an identical sender,
//!    rounds alternating; both include the admission round trip to the
//!    receiver over ZMQ and the shm copy.
//! 2. After criterion's groups (skip with `KVFERRY_ATTACH_SKIP_E2E=1`;
//!    `KVFERRY_ATTACH_SKIP_RTT=1` skips the interleaved round trips of 1):
//!    end to end through the real binaries with the Python clients
//!    (`clients/python/bench_e2e.py`): a Python prefill worker attached to
//!    `kvferry sender --attach` fills 256 KiB chunks in place
//!    (`KVFERRY_ATTACH_E2E_CHUNK_KIB=N`: N KiB), the shm
//!    transport moves them into `kvferry receiver --attach`, a Python
//!    decoder reads them in place and releases them; payload bytes per
//!    second vs a single-thread memcpy of the same bytes (chunk by chunk,
//!    between two page-aligned buffers of the receive buffer's size, as
//!    the engine's slots are: [`page_aligned`]) timed right before and
//!    after. The receive buffer's file is at the receiver's default
//!    place ([`default_region_path`]: `/dev/shm` if there is one). Both of
//!    the script's modes: `stamp` (the bytes move once, in the daemon's
//!    transport) and `full` (Python also writes every byte into staging and
//!    copies every byte out). Each in three placements of the threads, runs
//!    alternating ([`E2ePlacement`]): `none`, the scheduler's choice
//!    (`--copy-cpu none`, the receiver's `--spare-cpu none`); `auto`, the
//!    daemons' default (`--copy-cpu auto`: the copy engine alone on the
//!    last CPU, the daemon's other threads on the others; the receiver's
//!    `--spare-cpu auto`: its threads on the others too), the clients
//!    started on every CPU, each keeping off the CPU the hello names
//!    (since 2026-12-07 (4); before, left to the scheduler): what a user
//!    gets without placing anything; and
//!    `apart`, the copy engine alone on the last CPU (`kvferry sender
//!    --copy-cpu`) and every other thread of the four processes on the
//!    others (the daemons' `--cpus`, the clients started there), which
//!    docs/attach.md tells the operator of a small machine to do. And
//!    each through two daemon set-ups ([`Daemons`]): `two`, `kvferry
//!    receiver --attach` and `kvferry sender --attach` (ZMQ over loopback
//!    TCP between them), and `node`, one `kvferry node` serving both roles
//!    (ZMQ `inproc://` between them; docs/attach.md, "One process for both
//!    roles"). `KVFERRY_ATTACH_E2E_POLL_IDLE_US=N` starts the daemons
//!    with `--attach-poll-idle-us N` (polling sessions);
//!    `KVFERRY_ATTACH_E2E_CONTROL=ipc` has the receiver listen on an
//!    `ipc://` socket and gives the sender that one;
//!    `KVFERRY_ATTACH_E2E_CONTROL=tcp` starts the receiver with
//!    `--no-local-control`, loopback TCP throughout; unset, the daemons'
//!    default: the sender, given the TCP endpoint, moves to the Unix
//!    socket the receiver offers (docs/protocol.md, "Local control"). The worker declares
//!    each request's one batch at its begin (`begin_declared`: one
//!    AllocRequest round trip per request);
//!    `KVFERRY_ATTACH_E2E_UNDECLARED=1` has it begin, stage and submit with
//!    keys instead (two), as before 2026-12-07 (10).

mod common;

use std::hint::black_box;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{memcpy_chunks, page_aligned};
use criterion::{criterion_group, Criterion, Throughput};
use kvferry::attach::{
    AttachConfig, DecoderClient, DecoderDaemon, Event, PrefillClient, PrefillDaemon, PrefillEvent,
};
use kvferry::receiver::{Receiver, ReceiverConfig, RequestStatus};
use kvferry::region::default_region_path;
use kvferry::sender::{
    RequestSpec, RequestStatus as SendStatus, Sender, SenderConfig, TransferSpec,
};

/// Bytes per chunk of bench 1.
const RTT_CHUNK: u64 = 4096;
/// Requests written per untimed round of bench 1 (the receiver holds them
/// all until they are consumed).
const RTT_ROUND: usize = 64;
/// Deadline of every wait.
const WAIT: Duration = Duration::from_secs(30);

static NEXT: AtomicU64 = AtomicU64::new(0);

fn unique(prefix: &str) -> String {
    // Relaxed: only distinct numbers are needed.
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn deadline() -> Instant {
    Instant::now() + WAIT
}

// ----- bench 1: per-chunk round trip ------------------------------------------

/// An in-process receiver and sender over shm, and a way to put complete
/// one-chunk requests into the receiver.
struct Rig {
    receiver: Arc<Receiver>,
    sender: Sender,
    payload: Vec<u8>,
}

impl Rig {
    fn new() -> Self {
        let receiver = Arc::new(
            Receiver::start(ReceiverConfig {
                listen: "tcp://127.0.0.1:0".into(),
                receiver_id: unique("rtt-recv"),
                capacity_chunks: RTT_ROUND * 2,
                chunk_bytes: RTT_CHUNK,
                ..ReceiverConfig::default()
            })
            .expect("receiver starts"),
        );
        let sender = Sender::new(SenderConfig {
            sender_id: unique("rtt-send"),
            staging_slots: RTT_ROUND,
            chunk_bytes: RTT_CHUNK,
            ..SenderConfig::default()
        })
        .expect("sender starts");
        Self {
            receiver,
            sender,
            payload: vec![0x5a; RTT_CHUNK as usize],
        }
    }

    /// Writes `n` complete requests of `chunks` chunks each and waits
    /// until the receiver has them all; returns their ids.
    fn fill(&self, n: usize, chunks: usize) -> Vec<String> {
        let ids: Vec<String> = (0..n).map(|_| unique("rtt")).collect();
        let payloads = vec![self.payload.as_slice(); chunks];
        for id in &ids {
            let spec = TransferSpec::new(id, self.receiver.endpoint(), chunks, true);
            let keys: Vec<String> = (0..chunks).map(|i| format!("{id}/{i}")).collect();
            self.sender.store(&spec, &keys, &payloads).expect("stored");
        }
        for id in &ids {
            self.receiver
                .wait_ready(id, deadline())
                .unwrap_or_else(|e| panic!("request {id} not ready: {e:?}"));
        }
        ids
    }

    /// Waits until every slot is back (released requests are freed by the
    /// daemon after the client's RELEASE).
    fn drained(&self) {
        let end = deadline();
        while self.receiver.stats().allocated_chunks != 0 {
            assert!(Instant::now() < end, "receiver slots not returned");
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Consumes `ids` in process: watch, status, take, read, drop.
fn consume_in_process(r: &Receiver, ids: &[String]) {
    for id in ids {
        let h = r.watch(id).expect("watch");
        assert_eq!(h.status(), RequestStatus::Ready);
        let chunks = r.take(id).expect("take");
        read_each(&chunks);
    }
}

/// Reads one byte of every chunk of a taken request, in place.
fn read_each(chunks: &kvferry::receiver::RequestChunks) {
    for i in 0..chunks.len() {
        black_box(chunks.get(i).expect("in range").bytes()[0]);
    }
}

/// Consumes `ids` in process the way the daemon's session does for a
/// complete request: `take` (no watch), read, drop. (The session watches
/// only a request not complete yet; [`Rig::fill`] waited for every one.)
fn consume_in_process_take_first(r: &Receiver, ids: &[String]) {
    for id in ids {
        let chunks = r.take(id).expect("complete: fill waited for it");
        read_each(&chunks);
    }
}

/// Consumes `ids` through the attach rings: subscribe, READY, read, release.
fn consume_attached(c: &mut DecoderClient, ids: &[String]) {
    for id in ids {
        let tag = c.subscribe(id).expect("subscribe");
        match c.next_event(deadline()).expect("an event") {
            Event::Ready(d) => {
                assert_eq!(d.tag(), tag);
                for i in 0..d.chunks().len() {
                    black_box(c.chunk(&d, i).expect("chunk")[0]);
                }
                c.release(d).expect("release");
            }
            other => panic!("expected READY for {id}, got {other:?}"),
        }
    }
}

/// The rings' floor: a RELEASE of a tag the session does not know, answered
/// REFUSED, once per id — the two hand-offs and the session round of
/// [`consume_attached`] without the receiver's work (no take, no release
/// of chunks). Not a baseline: it splits the attached time.
fn ring_floor(c: &mut DecoderClient, ids: &[String]) {
    for i in 0..ids.len() {
        let tag = (1 << 40) + i as u64;
        c.submit_raw(kvferry::attach::layout::DecoderSubmit::release(tag))
            .expect("submitted");
        match c.next_event(deadline()).expect("an event") {
            Event::Refused { tag: t, .. } => assert_eq!(t, tag),
            other => panic!("expected REFUSED for {tag}, got {other:?}"),
        }
    }
}

/// The attached half of bench 1: a [`DecoderDaemon`] over the rig's
/// receiver and a client attached to it.
struct Attached {
    client: DecoderClient,
    _daemon: DecoderDaemon,
    dir: std::path::PathBuf,
}

impl Attached {
    /// Its session polls for `poll_idle` after its last work
    /// ([`AttachConfig::poll_idle`]; zero: the default, the linger only).
    fn new(rig: &Rig, poll_idle: Duration) -> Self {
        let dir = std::env::temp_dir().join(unique("kvferry-attach-bench"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let daemon = DecoderDaemon::start(
            Arc::clone(&rig.receiver),
            AttachConfig {
                poll_idle,
                ..AttachConfig::new(dir.join("attach.sock"))
            },
        )
        .expect("daemon starts");
        let client = DecoderClient::connect(daemon.socket(), WAIT).expect("attaches");
        Self {
            client,
            _daemon: daemon,
            dir,
        }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rtt(c: &mut Criterion) {
    let rig = Rig::new();
    let mut attached = Attached::new(&rig, Duration::ZERO);
    let client = &mut attached.client;

    let mut group = c.benchmark_group("attach_rtt");
    group.throughput(Throughput::Elements(1));
    group.sample_size(20);
    group.bench_function("in_process", |b| {
        b.iter_custom(|iters| {
            timed_rounds(&rig, iters, |ids| consume_in_process(&rig.receiver, ids))
        })
    });
    group.bench_function("in_process_take", |b| {
        b.iter_custom(|iters| {
            timed_rounds(&rig, iters, |ids| {
                consume_in_process_take_first(&rig.receiver, ids)
            })
        })
    });
    group.bench_function("attached", |b| {
        b.iter_custom(|iters| timed_rounds(&rig, iters, |ids| consume_attached(client, ids)))
    });
    group.finish();
}

/// Rounds of [`rtt_interleaved`] (each: every path once).
const RTT_PAIRS: usize = 60;

/// Chunks per request of [`rtt_interleaved`]'s multi-chunk paths (a
/// request as a decoder usually gets it, against bench 1's worst case of
/// one chunk, where the per-request costs are all per chunk).
const MULTI_CHUNKS: usize = 8;

/// Pins thread `tid` (0: the calling thread) to `cpu`.
fn pin(tid: libc::pid_t, cpu: usize) {
    assert!(
        set_affinity(tid, [cpu]),
        "sched_setaffinity({tid}, {cpu}) failed"
    );
}

/// The set of `cpus`.
fn cpu_set(cpus: impl IntoIterator<Item = usize>) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside it
    // (every cpu < CPU_SETSIZE on any machine this bench runs on).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        set
    }
}

/// Lets thread `tid` (0: the calling thread) run on `set`; false if the
/// kernel refused (the thread is gone, or no CPU of them is there). One
/// system call, nothing else: safe between `fork` and `exec`.
fn apply_set(tid: libc::pid_t, set: &libc::cpu_set_t) -> bool {
    // SAFETY: sched_setaffinity only reads `set` for the size passed.
    unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), set) == 0 }
}

/// Lets thread `tid` (0: the calling thread) run on `cpus`; false if the
/// kernel refused.
fn set_affinity(tid: libc::pid_t, cpus: impl IntoIterator<Item = usize>) -> bool {
    apply_set(tid, &cpu_set(cpus))
}

/// The threads of process `pid`: (thread id, name).
fn threads_of(pid: u32) -> Vec<(libc::pid_t, String)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let tid = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        Some((tid, comm.trim().to_string()))
    })
    .collect()
}

/// Where the round trip puts its client and session ([`place_rtt`]).
#[derive(Clone, Copy, PartialEq)]
enum Placement {
    /// The scheduler's choice: both threads may run on every CPU the bench
    /// started with.
    Free,
    /// The session and the receiver's threads on the last CPU, the client
    /// on the others (what `kvferry receiver --attach --cpus N` does with
    /// the decoder started elsewhere); the in-process baselines consume on
    /// the last CPU too ([`on_session_side`]).
    CopyApart,
}

impl Placement {
    fn name(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::CopyApart => "apart",
        }
    }
}

/// Where the end-to-end run puts the threads of its four processes.
#[derive(Clone, Copy, PartialEq)]
enum E2ePlacement {
    /// The scheduler's choice for every thread: the daemons started with
    /// `--copy-cpu none` (`kvferry receiver`: `--spare-cpu none`).
    Scheduler,
    /// What a user gets without placing anything: the daemons' default
    /// (`--copy-cpu auto`: the copy engine alone on the last CPU, the
    /// daemon's other threads on the others; `--spare-cpu auto`: the
    /// receiver's on the others too), the Python clients started on every
    /// CPU, each keeping its thread off the CPU the hello names (the
    /// clients' default, docs/attach.md, "Placing the threads").
    Auto,
    /// Every thread placed: the copy engine alone on the last CPU
    /// (`--copy-cpu`), every other thread of the four processes on the
    /// others (`--cpus` for the daemons, the Python clients started on
    /// them), which docs/attach.md, "Placing the threads", tells an
    /// operator of a small machine to do.
    Apart,
}

impl E2ePlacement {
    fn name(self) -> &'static str {
        match self {
            Self::Scheduler => "none",
            Self::Auto => "auto",
            Self::Apart => "apart",
        }
    }
}

/// Which daemons the end-to-end run attaches its two Python clients to.
#[derive(Clone, Copy, PartialEq)]
enum Daemons {
    /// `kvferry receiver --attach` and `kvferry sender --attach`, two
    /// processes talking ZMQ over loopback TCP.
    Two,
    /// One `kvferry node`: both roles in one process, the control messages
    /// between them over `inproc://` (docs/attach.md, "One process for
    /// both roles").
    Node,
}

impl Daemons {
    fn name(self) -> &'static str {
        match self {
            Self::Two => "two",
            Self::Node => "node",
        }
    }
}

/// The CPUs the bench started with (taken before the round trip pins
/// anything).
fn bench_cpus() -> &'static [usize] {
    kvferry::threads::allowed_cpus()
}

/// The last CPU and the others, for [`Placement::CopyApart`] and
/// [`E2ePlacement::Apart`];
/// `None` on a machine of one CPU.
fn copy_apart() -> Option<(usize, &'static [usize])> {
    match bench_cpus() {
        [rest @ .., copy] if !rest.is_empty() => Some((*copy, rest)),
        _ => None,
    }
}

/// "0,1,3" for `cpus`.
fn cpu_list(cpus: &[usize]) -> String {
    cpus.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// A command for `program` whose process starts on `cpus` (whatever this
/// thread is pinned to).
fn command_on(program: impl AsRef<std::ffi::OsStr>, cpus: &[usize]) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    let set = cpu_set(cpus.iter().copied());
    // SAFETY: the closure runs between fork and exec, where only
    // async-signal-safe calls are allowed: it makes one system call on a
    // set built before the fork, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if apply_set(0, &set) {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    cmd
}

/// The session thread of the bench's one attached client (spawned after
/// the hello the client got: waited for).
fn session_thread() -> libc::pid_t {
    let end = deadline();
    // Unnamed threads carry the process's name, which may itself read
    // attach-<digits> (a copy of this binary named so).
    let own = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
    loop {
        let found: Vec<libc::pid_t> = threads_of(std::process::id())
            .into_iter()
            // The session threads are named attach-<client id>.
            .filter(|(_, comm)| {
                comm != own.trim()
                    && comm
                        .strip_prefix("attach-")
                        .is_some_and(|n| n.parse::<u32>().is_ok())
            })
            .map(|(tid, _)| tid)
            .collect();
        match found.as_slice() {
            [tid] => return *tid,
            more => assert!(
                more.len() < 2 && Instant::now() < end,
                "want the one session thread, found {more:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Where [`Placement`] puts the round trip's threads: (the session's and
/// the receiver's CPUs, the client's CPUs). `None` for `apart` on a machine
/// of one CPU.
fn rtt_cpus(placement: Placement) -> Option<(&'static [usize], &'static [usize])> {
    match (placement, copy_apart()) {
        (Placement::Free, _) => Some((bench_cpus(), bench_cpus())),
        // The last CPU alone (what follows `rest`), and `rest`.
        (Placement::CopyApart, Some((_, rest))) => Some((&bench_cpus()[rest.len()..], rest)),
        (Placement::CopyApart, None) => None,
    }
}

/// Places the round trip's threads: `Free`, all on every CPU the bench
/// started with; `CopyApart`, the session and the rig's receiver threads
/// (`kvf-recv-*`: its control thread writes the state a `take` reads) on
/// the last CPU, and this thread (the client) on the others: what
/// `kvferry receiver --attach --cpus N` does with the decoder started
/// elsewhere. The in-process baselines consume where the session does
/// ([`on_session_side`]). Changing a thread's set does not move it until
/// it next runs somewhere it may not, so a `free` round right after an
/// `apart` one starts apart, the receiver's threads included; its fill
/// puts the session to sleep, and the wake-up places it (see
/// [`wake_placement`]). False on a machine of one CPU, where there is no
/// `apart`.
fn place_rtt(placement: Placement, session: libc::pid_t) -> bool {
    let Some((session_cpus, own_cpus)) = rtt_cpus(placement) else {
        return false;
    };
    let receiver = threads_of(std::process::id())
        .into_iter()
        .filter(|(_, comm)| comm.starts_with("kvf-recv"))
        .map(|(tid, _)| tid);
    for tid in std::iter::once(session).chain(receiver) {
        assert!(
            set_affinity(tid, session_cpus.iter().copied()),
            "sched_setaffinity of thread {tid} failed for {}",
            placement.name()
        );
    }
    assert!(
        set_affinity(0, own_cpus.iter().copied()),
        "sched_setaffinity failed for {}",
        placement.name()
    );
    true
}

/// Runs `consume` (an in-process baseline's timed consumption) on the
/// session's CPUs of `placement`, then puts this thread back on the
/// client's: the in-process decoder takes where the daemon's session
/// would, so a baseline and the attached path read the receiver's state
/// from the same place (a `take` on the CPU of the receiver's control
/// thread costs less than half of one on another, `docs/benchmarks.md`,
/// "Attach, 2026-12-07 (5)"). The move happens before the clock starts.
fn on_session_side(placement: Placement, consume: impl FnOnce() -> Duration) -> Duration {
    let (Placement::CopyApart, Some((session_cpus, own_cpus))) = (placement, rtt_cpus(placement))
    else {
        return consume();
    };
    assert!(
        set_affinity(0, session_cpus.iter().copied()),
        "sched_setaffinity"
    );
    // Runs where it may: the kernel moved this thread before returning.
    let took = consume();
    assert!(
        set_affinity(0, own_cpus.iter().copied()),
        "sched_setaffinity"
    );
    took
}

/// What the scheduler does with a woken thread, which decides where the
/// round trip's session runs after its doorbell wake-up: a thread asleep
/// on a futex is woken [`WAKES`] times, [`WAKE_GAP`] apart, by this
/// thread spinning (as a client does right after its doorbell); how often
/// it ran on the waker's CPU, and how long after the wake it ran, with it
/// free and then with it confined to another CPU. On the project's 2-vCPU
/// VM nearly every wake-up lands on the waker's CPU (a halted vCPU is
/// never chosen), and one that must run elsewhere takes tens of µs (the
/// hypervisor wakes that vCPU): the `free` round trips there are
/// context switches on one CPU, the `apart` ones pay the slow wake once
/// per round.
fn wake_placement() {
    const WAKES: usize = 200;
    const WAKE_GAP: Duration = Duration::from_micros(500);
    let Some((last, rest)) = copy_apart() else {
        return;
    };
    // `confine`: the sleeper on the last CPU, this thread on the others.
    let run = |confine: bool| -> (usize, f64) {
        if confine {
            assert!(set_affinity(0, rest.iter().copied()), "sched_setaffinity");
        }
        // Its value: the number of wakes asked; the sleeper answers each
        // with its CPU in `ran` (+1, 0 = not yet).
        let word = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let ran = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (w, r) = (Arc::clone(&word), Arc::clone(&ran));
        let sleeper = std::thread::spawn(move || {
            if confine {
                pin(0, last);
            }
            let mut seen = 0;
            while seen < WAKES as u32 {
                // Acquire: pairs with the waker's Release increment.
                let now = w.load(Ordering::Acquire);
                if now == seen {
                    futex(&w, libc::FUTEX_WAIT, seen);
                    continue;
                }
                seen = now;
                // SAFETY: sched_getcpu takes no arguments.
                let cpu = unsafe { libc::sched_getcpu() };
                // Release: the waker reads it after its spin.
                r.store(cpu as u32 + 1, Ordering::Release);
            }
        });
        let (mut same, mut lags) = (0, Vec::with_capacity(WAKES));
        for i in 0..WAKES as u32 {
            std::thread::sleep(WAKE_GAP);
            // Relaxed: the Release store of `word` below publishes it.
            ran.store(0, Ordering::Relaxed);
            let t = Instant::now();
            // Release: publishes the reset of `ran` before the wake.
            word.store(i + 1, Ordering::Release);
            futex(&word, libc::FUTEX_WAKE, 1);
            // SAFETY: as above.
            let here = unsafe { libc::sched_getcpu() } as u32 + 1;
            let cpu = loop {
                // Acquire: pairs with the sleeper's Release store.
                match ran.load(Ordering::Acquire) {
                    0 => {
                        assert!(t.elapsed() < WAIT, "wake_placement: the sleeper never ran");
                        std::hint::spin_loop();
                    }
                    cpu => break cpu,
                }
            };
            lags.push(t.elapsed().as_secs_f64() * 1e6);
            same += usize::from(cpu == here);
        }
        sleeper.join().expect("sleeper");
        assert!(
            set_affinity(0, bench_cpus().iter().copied()),
            "sched_setaffinity"
        );
        lags.sort_by(f64::total_cmp);
        (same, lags[WAKES / 2])
    };
    let (same, lag) = run(false);
    let (_, far) = run(true);
    println!(
        "
wake-ups ({WAKES} futex wakes {} µs apart, the waker spinning): the woken thread ran \
         on the waker's CPU in {same} of {WAKES}, {lag:.1} µs after the wake (median); \
         confined to CPU {last}: {far:.1} µs",
        WAKE_GAP.as_micros()
    );
}

/// One futex call on `word`: a wait of at most a second while it still
/// holds `val` (the caller re-checks), or a wake of `val` waiters.
fn futex(word: &std::sync::atomic::AtomicU32, op: libc::c_int, val: u32) {
    let second = libc::timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    // SAFETY: the word is a live, aligned u32 and `second` a live timespec
    // for the whole call (a wake ignores the timeout).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op | libc::FUTEX_PRIVATE_FLAG,
            val,
            &second as *const libc::timespec,
        );
    }
}

/// "median per-round ratio M (p10 P, p90 Q)" of `ratios` (sorted here).
fn ratio_summary(ratios: &mut [f64]) -> String {
    ratios.sort_by(f64::total_cmp);
    let at = |tenths: usize| ratios[ratios.len() * tenths / 10];
    format!(
        "median per-round ratio {:.2} (p10 {:.2}, p90 {:.2})",
        at(5),
        at(1),
        at(9)
    )
}

/// The CPU time counters of `/proc/stat`'s first line (all CPUs, in
/// ticks): `user nice system idle iowait irq softirq steal …`.
fn cpu_ticks() -> Option<Vec<u64>> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    line.split_whitespace().map(|f| f.parse().ok()).collect()
}

/// "VM steal N %": the share of CPU time the hypervisor gave to other
/// guests since `before` (`cpu_ticks`), so a reader knows when the
/// figures next to it were taken on a starved VM (the project's VMs have
/// shown 0-40 %); "VM steal unknown" where `/proc/stat` says nothing.
fn steal_since(before: &Option<Vec<u64>>) -> String {
    let (Some(a), Some(b)) = (before, cpu_ticks()) else {
        return "VM steal unknown".into();
    };
    let d: Vec<u64> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| y.saturating_sub(*x))
        .collect();
    // The first eight: guest and guest_nice (9-10) are counted in user.
    let total: u64 = d.iter().take(8).sum();
    match d.get(7) {
        Some(steal) if total > 0 => {
            format!("VM steal {:.0} %", 100.0 * *steal as f64 / total as f64)
        }
        _ => "VM steal unknown".into(),
    }
}

/// The per-round figures of [`rtt_interleaved`] for one placement, in µs
/// per request (per chunk for the multi-chunk ones) and as ratios.
#[derive(Default)]
struct RttRounds {
    in_process: Vec<f64>,
    attached: Vec<f64>,
    ratio: Vec<f64>,
    take: Vec<f64>,
    ratio_take: Vec<f64>,
    awake: Vec<f64>,
    ratio_awake: Vec<f64>,
    floor: Vec<f64>,
    multi_take: Vec<f64>,
    multi_awake: Vec<f64>,
    multi_ratio: Vec<f64>,
}

impl RttRounds {
    /// Runs every path once, in order, in `placement` (already applied),
    /// and records the figures if `record` (the first round is untimed:
    /// page faults, first wake-ups).
    fn round(&mut self, rig: &Rig, placement: Placement, client: &mut DecoderClient, record: bool) {
        let per_request = |d: Duration| d.as_secs_f64() * 1e6 / RTT_ROUND as f64;
        let n = RTT_ROUND as u64;
        let a = baseline_rounds(rig, placement, n, 1, consume_in_process);
        let b = timed_rounds(rig, n, |ids| consume_attached(client, ids));
        let c = baseline_rounds(rig, placement, n, 1, consume_in_process_take_first);
        let d = timed_awake_rounds(rig, n, 1, client);
        let multi = (RTT_ROUND / MULTI_CHUNKS) as u64;
        let mc = baseline_rounds(
            rig,
            placement,
            multi,
            MULTI_CHUNKS,
            consume_in_process_take_first,
        );
        let md = timed_awake_rounds(rig, multi, MULTI_CHUNKS, client);
        // The floor with the session awake: one untimed hand-off wakes it
        // (it may have gone to sleep while `rounds` waited for the last
        // RELEASEs' slots, which the session returns once it finds nothing
        // more to answer).
        let ids: Vec<String> = (0..RTT_ROUND).map(|i| i.to_string()).collect();
        ring_floor(client, &ids[..1]);
        let t = Instant::now();
        ring_floor(client, &ids);
        let f = t.elapsed();
        if !record {
            return;
        }
        self.in_process.push(per_request(a));
        self.attached.push(per_request(b));
        self.ratio.push(b.as_secs_f64() / a.as_secs_f64());
        self.take.push(per_request(c));
        self.ratio_take.push(b.as_secs_f64() / c.as_secs_f64());
        self.awake.push(per_request(d));
        self.ratio_awake.push(d.as_secs_f64() / c.as_secs_f64());
        self.floor.push(per_request(f));
        // A multi-chunk round has RTT_ROUND chunks: per chunk, as
        // per_request is per one-chunk request.
        self.multi_take.push(per_request(mc));
        self.multi_awake.push(per_request(md));
        self.multi_ratio.push(md.as_secs_f64() / mc.as_secs_f64());
    }

    /// Prints the medians and ratios of the recorded rounds.
    fn report(&mut self, placement: Placement) {
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (a, b) = (median(&mut self.in_process), median(&mut self.attached));
        println!(
            "  {}: in_process {a:.2} µs, attached {b:.2} µs per request (medians); \
             attached / in_process: {}",
            placement.name(),
            ratio_summary(&mut self.ratio)
        );
        let t = median(&mut self.take);
        println!(
            "    in_process_take {t:.2} µs; attached / in_process_take: {}",
            ratio_summary(&mut self.ratio_take)
        );
        let w = median(&mut self.awake);
        println!(
            "    attached, session awake (a busy decoder: no doorbell wake-up per round) \
             {w:.2} µs; attached awake / in_process_take: {}",
            ratio_summary(&mut self.ratio_awake)
        );
        println!(
            "    the rings' floor (RELEASE of an unknown tag -> REFUSED, session awake: \
             two hand-offs and a session round, no receiver work) {:.2} µs",
            median(&mut self.floor)
        );
        let (t, w) = (median(&mut self.multi_take), median(&mut self.multi_awake));
        println!(
            "    {MULTI_CHUNKS}-chunk requests (rounds of {RTT_ROUND} chunks), per chunk: \
             in_process_take {t:.2} µs, attached with the session awake {w:.2} µs; \
             attached awake / in_process_take: {}",
            ratio_summary(&mut self.multi_ratio)
        );
    }
}

/// The poll idle of [`rtt_interleaved`]'s second pass: longer than the
/// untimed fill between two timed rounds (a few ms), so its session is
/// never asleep when a round starts.
const RTT_POLL_IDLE: Duration = Duration::from_millis(20);

/// Bench 1 again, its paths alternating round by round, then the rings'
/// floor, in both placements of the client's and the session's threads
/// (rounds alternating; module docs). The session polls for `poll_idle`
/// after its last work (zero: the daemon's default); a polling session
/// also runs, yielding, through the baselines' rounds, which they pay for.
fn rtt_interleaved(poll_idle: Duration) {
    let rig = Rig::new();
    let mut attached = Attached::new(&rig, poll_idle);
    let session = session_thread();
    let fresh = fresh_rounds(&rig, &mut attached.client, session);
    if poll_idle.is_zero() {
        // Not beside a polling session, which would take the CPUs.
        wake_placement();
    }
    let ticks = cpu_ticks();
    let mut runs: Vec<(Placement, RttRounds)> = [Placement::Free, Placement::CopyApart]
        .into_iter()
        .filter(|&p| place_rtt(p, session))
        .map(|p| (p, RttRounds::default()))
        .collect();
    for pair in 0..=RTT_PAIRS {
        for (placement, rounds) in &mut runs {
            place_rtt(*placement, session);
            rounds.round(&rig, *placement, &mut attached.client, pair > 0);
        }
    }
    place_rtt(Placement::Free, session);
    let session_mode = if poll_idle.is_zero() {
        "the session lingering, then asleep (the default)".to_owned()
    } else {
        format!(
            "the session polling for {} ms after its last work (`--attach-poll-idle-us`)",
            poll_idle.as_millis()
        )
    };
    println!(
        "\nattach_rtt interleaved ({RTT_PAIRS} rounds of {RTT_ROUND} requests per path and \
         placement, {}; {session_mode}); `free`: the scheduler's choice, `apart`: the session \
         and the receiver's threads on the last CPU, the client on the others, the in-process \
         baselines consuming where the session does:",
        steal_since(&ticks)
    );
    println!("{fresh}");
    for (placement, rounds) in &mut runs {
        rounds.report(*placement);
    }
}

/// Rounds of [`fresh_rounds`]: about one pass over a new attachment's
/// completion ring (4096 entries by default; a round posts 129).
const FRESH_ROUNDS: usize = 32;

/// The first [`FRESH_ROUNDS`] rounds of a client that has just attached,
/// against as many of `in_process_take`, alternating, the session awake
/// and placed `apart` where there is room (a fresh attachment's first
/// pass over its rings, each page of which used to cost both sides a page
/// fault): the summary line.
fn fresh_rounds(rig: &Rig, client: &mut DecoderClient, session: libc::pid_t) -> String {
    let placed = place_rtt(Placement::CopyApart, session);
    let (mut take, mut attached) = (Duration::ZERO, Duration::ZERO);
    let mut ratios = Vec::with_capacity(FRESH_ROUNDS);
    let placement = if placed {
        Placement::CopyApart
    } else {
        Placement::Free
    };
    for _ in 0..FRESH_ROUNDS {
        let t = baseline_rounds(
            rig,
            placement,
            RTT_ROUND as u64,
            1,
            consume_in_process_take_first,
        );
        let a = timed_awake_rounds(rig, RTT_ROUND as u64, 1, client);
        ratios.push(a.as_secs_f64() / t.as_secs_f64());
        (take, attached) = (take + t, attached + a);
    }
    place_rtt(Placement::Free, session);
    let per_request = |d: Duration| d.as_secs_f64() * 1e6 / (FRESH_ROUNDS * RTT_ROUND) as f64;
    format!(
        "  a fresh attachment's first {} one-chunk requests ({}, session awake): \
         in_process_take {:.2} µs, attached {:.2} µs per request; attached / in_process_take: \
         {:.2} over them all, {}",
        FRESH_ROUNDS * RTT_ROUND,
        if placed { "apart" } else { "free" },
        per_request(take),
        per_request(attached),
        attached.as_secs_f64() / take.as_secs_f64(),
        ratio_summary(&mut ratios)
    )
}

/// [`timed_rounds`] of the attached path with the session awake: right
/// before each timed round (after the untimed fill, which takes
/// milliseconds, long enough for the session to go to sleep) one untimed
/// RELEASE of an unknown tag wakes it, so the round measures the steady
/// state of a busy decoder; [`timed_rounds`] of [`consume_attached`] also
/// pays the doorbell wake-up of a sleeping session once per round.
fn timed_awake_rounds(rig: &Rig, iters: u64, chunks: usize, c: &mut DecoderClient) -> Duration {
    rounds(rig, iters, chunks, |ids| {
        ring_floor(c, &ids[..1]);
        let t = Instant::now();
        consume_attached(c, ids);
        t.elapsed()
    })
}

/// Runs `consume` over `iters` one-chunk requests in rounds of
/// [`RTT_ROUND`], timing only the consumption.
fn timed_rounds(rig: &Rig, iters: u64, mut consume: impl FnMut(&[String])) -> Duration {
    rounds(rig, iters, 1, |ids| {
        let t = Instant::now();
        consume(ids);
        t.elapsed()
    })
}

/// [`timed_rounds`] of an in-process baseline over requests of `chunks`
/// chunks ([`RTT_ROUND`] chunks per round), its consumption run on the
/// session's side of `placement` ([`on_session_side`]; the fill stays on
/// this thread's CPUs).
fn baseline_rounds(
    rig: &Rig,
    placement: Placement,
    iters: u64,
    chunks: usize,
    consume: fn(&Receiver, &[String]),
) -> Duration {
    rounds(rig, iters, chunks, |ids| {
        on_session_side(placement, || {
            let t = Instant::now();
            consume(&rig.receiver, ids);
            t.elapsed()
        })
    })
}

/// Fills the receiver with `iters` requests of `chunks` chunks in rounds
/// of [`RTT_ROUND`] chunks (untimed, each once the last round's slots are
/// back) and sums what `round` says it measured of each.
fn rounds(
    rig: &Rig,
    iters: u64,
    chunks: usize,
    mut round: impl FnMut(&[String]) -> Duration,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters as usize;
    while left > 0 {
        let n = left.min(RTT_ROUND / chunks);
        rig.drained();
        let ids = rig.fill(n, chunks);
        total += round(&ids);
        left -= n;
    }
    rig.drained();
    total
}

// ----- bench 1b: the prefill worker's round trip ------------------------------

/// Requests per round of [`prefill_rtt`] (each written, and then taken
/// from the receiver untimed, before the next round).
const PREFILL_ROUND: usize = 32;
/// Rounds of [`prefill_rtt`] per path.
const PREFILL_PAIRS: usize = 30;

/// A receiver, and two senders over shm writing to it: one used in
/// process, one behind a [`PrefillDaemon`] with a client attached.
/// Fields drop in order: the client and its daemon, then the in-process
/// sender, then the receiver they both write to.
struct PrefillRig {
    client: PrefillClient,
    _daemon: PrefillDaemon,
    in_process: Sender,
    receiver: Receiver,
    dir: std::path::PathBuf,
}

impl PrefillRig {
    fn new() -> Self {
        let receiver = Receiver::start(ReceiverConfig {
            listen: "tcp://127.0.0.1:0".into(),
            receiver_id: unique("prtt-recv"),
            capacity_chunks: PREFILL_ROUND * 2,
            chunk_bytes: RTT_CHUNK,
            ..ReceiverConfig::default()
        })
        .expect("receiver starts");
        let sender = |staging_shares| {
            Sender::new(SenderConfig {
                sender_id: unique("prtt-send"),
                staging_slots: PREFILL_ROUND,
                staging_shares,
                chunk_bytes: RTT_CHUNK,
                ..SenderConfig::default()
            })
            .expect("sender starts")
        };
        let dir = std::env::temp_dir().join(unique("kvferry-prefill-bench"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let daemon = PrefillDaemon::start(
            Arc::new(sender(1)),
            vec![receiver.endpoint().to_owned()],
            AttachConfig::new(dir.join("prefill.sock")),
        )
        .expect("prefill daemon starts");
        let client = PrefillClient::connect(daemon.socket(), WAIT).expect("worker attaches");
        Self {
            in_process: sender(0),
            receiver,
            client,
            _daemon: daemon,
            dir,
        }
    }

    /// Takes every request of `ids` from the receiver (untimed): each must
    /// have arrived whole.
    fn consume(&self, ids: &[String]) {
        for id in ids {
            self.receiver
                .wait_ready(id, deadline())
                .unwrap_or_else(|e| panic!("request {id} not ready: {e:?}"));
            drop(self.receiver.take(id).expect("ready: taken"));
        }
    }

    /// Writes one one-chunk request in process: begin, stage (waiting for
    /// admission and a slot), fill a byte, submit, wait for its end.
    fn write_in_process(&self, id: &str) {
        let spec = RequestSpec::new(id, self.receiver.endpoint(), 1);
        let req = self.in_process.begin(spec).expect("begun");
        let mut batch = req.stage(1, deadline()).expect("staged");
        batch.slot_mut(0).expect("one slot")[0] = 0x5a;
        batch
            .submit(&[format!("{id}/0")], &[RTT_CHUNK as u32])
            .expect("submitted");
        match req.wait(deadline()) {
            SendStatus::Completed => {}
            other => panic!("request {id} ended {other:?}"),
        }
    }

    /// The same through the attach rings: BEGIN and STAGE, STAGED, fill a
    /// byte, KEY and SUBMIT, DONE.
    fn write_attached(&mut self, id: &str) {
        let c = &mut self.client;
        let tag = c.begin(id, 0, 1).expect("BEGIN");
        c.stage(tag, 1).expect("STAGE");
        let batch = match c.next_event(deadline()).expect("an event") {
            PrefillEvent::Staged(b) => b,
            other => panic!("expected STAGED for {id}, got {other:?}"),
        };
        c.slot_mut(&batch, 0).expect("one slot")[0] = 0x5a;
        let key = format!("{id}/0");
        c.submit(batch, &[key.as_str()], &[RTT_CHUNK as u32])
            .expect("SUBMIT");
        match c.next_event(deadline()).expect("an event") {
            PrefillEvent::Done { tag: t } => assert_eq!(t, tag),
            other => panic!("expected DONE for {id}, got {other:?}"),
        }
    }

    /// One round of [`PREFILL_ROUND`] requests written by `write`, one at
    /// a time; returns the time of the writes only.
    fn round(&mut self, mut write: impl FnMut(&mut Self, &str)) -> Duration {
        let ids: Vec<String> = (0..PREFILL_ROUND).map(|_| unique("prtt")).collect();
        let t = Instant::now();
        for id in &ids {
            write(self, id);
        }
        let spent = t.elapsed();
        self.consume(&ids);
        spent
    }
}

impl Drop for PrefillRig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The prefill worker's round trip, the literal "submit → completion" of
/// its rings: a one-chunk request from BEGIN to DONE through a
/// [`PrefillDaemon`] (the Rust [`PrefillClient`]), against the same
/// request written in process by an identical sender (`Sender::begin`,
/// `Request::stage`, fill, `StagedBatch::submit`, `Request::wait`). Both
/// include the request's admission round trip to the receiver over ZMQ
/// and the shm copy; the rings add the hand-offs to the daemon's session
/// and back (STAGED, then DONE). Rounds alternate; the scheduler places
/// the threads.
fn prefill_rtt() {
    let mut rig = PrefillRig::new();
    let ticks = cpu_ticks();
    let per_request = |d: Duration| d.as_secs_f64() * 1e6 / PREFILL_ROUND as f64;
    let (mut inp, mut att, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    // One untimed round first (connections, page faults).
    for pair in 0..=PREFILL_PAIRS {
        let a = rig.round(|r, id| r.write_in_process(id));
        let b = rig.round(PrefillRig::write_attached);
        if pair > 0 {
            inp.push(per_request(a));
            att.push(per_request(b));
            ratio.push(b.as_secs_f64() / a.as_secs_f64());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, b) = (median(&mut inp), median(&mut att));
    println!(
        "\nprefill round trip ({PREFILL_PAIRS} rounds of {PREFILL_ROUND} one-chunk requests \
         per path, one at a time, {}): in process (begin, stage, submit, wait) {a:.1} µs, \
         attached (BEGIN + STAGE -> STAGED, SUBMIT -> DONE) {b:.1} µs per request \
         (medians); attached / in process: {}",
        steal_since(&ticks),
        ratio_summary(&mut ratio)
    );
}

criterion_group!(benches, rtt);

// ----- bench 2: Python end to end through the binaries -------------------------

/// Chunk bytes of the end-to-end run: the 256 KiB
/// (`KVFERRY_ATTACH_E2E_CHUNK_KIB` overrides it: smaller chunks make the
/// copy a smaller part of each request, the regime of a machine with a
/// faster memcpy).
const E2E_CHUNK: usize = 256 << 10;
/// Chunks per request.
const E2E_CHUNKS: usize = 16;
/// Requests per run (`E2E_REQUESTS * E2E_CHUNKS * E2E_CHUNK` = 4 GiB: at
/// 8–10 GiB/s a run of 1 GiB was a quarter second, its start-up a
/// noticeable part of it).
const E2E_REQUESTS: usize = 1024;
/// Receive buffer and staging slots (4 requests' worth).
const E2E_SLOTS: usize = 64;
/// Requests the Python worker keeps in flight (`KVFERRY_ATTACH_E2E_WINDOW`
/// overrides it, for the sweep in docs/benchmarks.md).
const E2E_WINDOW: usize = 3;

fn e2e_window() -> usize {
    env_count("KVFERRY_ATTACH_E2E_WINDOW").unwrap_or(E2E_WINDOW)
}

/// The end to end's chunk bytes ([`E2E_CHUNK`] unless overridden).
fn e2e_chunk() -> usize {
    env_count("KVFERRY_ATTACH_E2E_CHUNK_KIB").map_or(E2E_CHUNK, |kib| kib << 10)
}

/// Receive buffer and staging slots (`KVFERRY_ATTACH_E2E_SLOTS` overrides
/// [`E2E_SLOTS`], for the sweep in docs/benchmarks.md).
fn e2e_slots() -> usize {
    env_count("KVFERRY_ATTACH_E2E_SLOTS").unwrap_or(E2E_SLOTS)
}

/// The daemons' `--attach-poll-idle-us` in the end-to-end runs
/// (`KVFERRY_ATTACH_E2E_POLL_IDLE_US`; default: not given, the daemons'
/// default of 0), to see what polling sessions cost or bring there.
fn e2e_poll_idle_us() -> Option<usize> {
    env_count("KVFERRY_ATTACH_E2E_POLL_IDLE_US")
}

/// How the two daemons' control messages travel in the end-to-end runs
/// (`KVFERRY_ATTACH_E2E_CONTROL`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum E2eControl {
    /// Unset: the daemons' default. The sender is given the receiver's
    /// loopback TCP endpoint and moves to the Unix socket its `HelloAck`
    /// offers (docs/protocol.md, "Local control").
    Default,
    /// `tcp`: the receiver offers none (`--no-local-control`): loopback
    /// TCP throughout, as before 2026-12-08.
    Tcp,
    /// `ipc`: the receiver listens on a Unix socket and the sender is
    /// given that one.
    Ipc,
}

/// [`E2eControl`] from the environment.
fn e2e_control() -> E2eControl {
    match std::env::var("KVFERRY_ATTACH_E2E_CONTROL").as_deref() {
        Ok("ipc") => E2eControl::Ipc,
        Ok("tcp") => E2eControl::Tcp,
        _ => E2eControl::Default,
    }
}

/// True with `KVFERRY_ATTACH_E2E_CONTROL=ipc`: the end-to-end receiver
/// listens on a Unix socket instead of loopback TCP.
fn e2e_over_ipc() -> bool {
    e2e_control() == E2eControl::Ipc
}

/// The receiver's `--listen` in the end-to-end runs ([`e2e_over_ipc`]: a
/// Unix socket in `dir`); the sender's `--connect` takes what the receiver
/// prints either way.
fn e2e_listen(dir: &Path, mode: &str) -> String {
    if e2e_over_ipc() {
        format!("ipc://{}", dir.join(format!("{mode}-ctl.sock")).display())
    } else {
        "tcp://127.0.0.1:0".to_owned()
    }
}

/// A positive count from the environment variable `var`, if set.
fn env_count(var: &str) -> Option<usize> {
    std::env::var(var)
        .ok()
        .and_then(|w| w.parse().ok())
        .filter(|&w| w > 0)
}

/// A child process killed on drop, its stdout lines on a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    /// The rest of the first line starting with `prefix`.
    fn line(&self, prefix: &str, what: &str) -> String {
        let end = Instant::now() + Duration::from_secs(120);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let l = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("{what}: no line {prefix:?}"));
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GiB/s of a single-thread memcpy of `bytes` in `chunk`-sized copies
/// from `src` to `dst` (each the receive buffer's size, page-aligned and
/// already touched, so no page fault is timed), after one untimed pass.
fn memcpy_gibs(src: &[u8], dst: &mut [u8], bytes: usize, chunk: usize) -> f64 {
    memcpy_chunks(src, dst, chunk);
    let t = Instant::now();
    let mut moved = 0;
    while moved < bytes {
        memcpy_chunks(src, dst, chunk);
        moved += src.len();
    }
    moved as f64 / t.elapsed().as_secs_f64() / f64::from(1u32 << 30)
}

/// One end-to-end run in `mode` through `daemons`, with the threads placed
/// as `placement` says: GiB/s from the worker's start to the decoder's
/// last release. Sockets go in `dir`; the receive buffer's file where the
/// receiver would put it by default, removed after the run (the daemons
/// are killed, so they do not remove it themselves).
fn python_e2e(mode: &str, daemons: Daemons, placement: E2ePlacement, dir: &Path) -> f64 {
    let bin = env!("CARGO_BIN_EXE_kvferry");
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    let rsock = dir.join(format!("{mode}-recv.sock"));
    let ssock = dir.join(format!("{mode}-send.sock"));
    let chunk = e2e_chunk().to_string();
    let slots = e2e_slots().to_string();
    let buf = default_region_path();
    let all = bench_cpus();
    // The daemons start on every CPU (--copy-cpu must be one they may run
    // on) and place their threads themselves; the clients start placed.
    let (daemon_cpus, copy_cpu, spare_cpu, clients) = match (placement, copy_apart()) {
        (E2ePlacement::Apart, Some((copy, rest))) => (
            vec!["--cpus".to_owned(), cpu_list(rest)],
            vec!["--copy-cpu".to_owned(), copy.to_string()],
            Vec::new(),
            rest,
        ),
        (E2ePlacement::Auto, _) => (Vec::new(), Vec::new(), Vec::new(), all),
        (E2ePlacement::Scheduler | E2ePlacement::Apart, _) => (
            Vec::new(),
            vec!["--copy-cpu".to_owned(), "none".to_owned()],
            vec!["--spare-cpu".to_owned(), "none".to_owned()],
            all,
        ),
    };
    let listen = e2e_listen(dir, mode);
    let local_args: &[&str] = if e2e_control() == E2eControl::Tcp {
        &["--no-local-control"]
    } else {
        &[]
    };
    let receiver_args = [
        "--listen",
        &listen,
        "--capacity-chunks",
        &slots,
        "--chunk-bytes",
        &chunk,
        "--attach",
        rsock.to_str().expect("utf-8 path"),
        "--shm-path",
        buf.to_str().expect("utf-8 path"),
    ];
    // One worker: its share is all of staging (the default splits staging
    // among --attach-max-clients workers).
    let staging_args = ["--staging-slots", &slots, "--attach-shares", "1"];
    let poll_args: Vec<String> = e2e_poll_idle_us()
        .map(|us| vec!["--attach-poll-idle-us".to_owned(), us.to_string()])
        .unwrap_or_default();
    let mut daemon_procs = Vec::new();
    match daemons {
        Daemons::Two => {
            let recv = Proc::spawn(
                command_on(bin, all)
                    .arg("receiver")
                    .args(receiver_args)
                    .args(local_args)
                    .args(&daemon_cpus)
                    .args(&spare_cpu)
                    .args(&poll_args),
            );
            let endpoint = recv.line("kvferry receiver listening on ", "kvferry receiver");
            recv.line("kvferry receiver attach on ", "kvferry receiver");
            let send = Proc::spawn(
                command_on(bin, all)
                    .args(["sender", "--connect", &endpoint, "--chunk-bytes", &chunk])
                    .args(staging_args)
                    .args(["--attach", ssock.to_str().expect("utf-8 path")])
                    .args(&daemon_cpus)
                    .args(&copy_cpu)
                    .args(&poll_args),
            );
            send.line("kvferry sender attach on ", "kvferry sender");
            daemon_procs.extend([send, recv]);
        }
        Daemons::Node => {
            let node = Proc::spawn(
                command_on(bin, all)
                    .arg("node")
                    .args(receiver_args)
                    .args(staging_args)
                    .args(["--prefill-attach", ssock.to_str().expect("utf-8 path")])
                    .args(&daemon_cpus)
                    .args(&copy_cpu)
                    .args(&poll_args),
            );
            node.line("kvferry node prefill attach on ", "kvferry node");
            daemon_procs.push(node);
        }
    }
    let prefix = unique(mode);
    let (requests, chunks) = (E2E_REQUESTS.to_string(), E2E_CHUNKS.to_string());
    let python = |role: &str, sock: &Path, extra: &[&str]| {
        Proc::spawn(
            command_on("python3", clients)
                .arg(py.join("bench_e2e.py"))
                .args([role, sock.to_str().expect("utf-8 path"), &prefix])
                .args([requests.as_str(), chunks.as_str(), mode])
                .args(extra)
                .env("PYTHONPATH", &py),
        )
    };
    let dec = python("decoder", &rsock, &[]);
    dec.line("E2E:subscribed", "python decoder");
    let window = e2e_window().to_string();
    let pf = python("prefill", &ssock, &[&window]);
    let times = |p: &Proc, role: &str| -> (f64, f64, f64) {
        let l = p.line(&format!("E2E:{role} "), role);
        let v: Vec<f64> = l
            .split_whitespace()
            .map(|x| x.parse().expect("a number"))
            .collect();
        (v[0], v[1], v[2])
    };
    let (t0, _, _) = times(&pf, "prefill");
    let (_, t1, bytes) = times(&dec, "decoder");
    drop((pf, dec, daemon_procs));
    let _ = std::fs::remove_file(&buf);
    // The receiver's local control socket (killed, it could not remove it).
    let _ = std::fs::remove_file(format!("{}.ctl", buf.display()));
    bytes / (t1 - t0) / f64::from(1u32 << 30)
}

fn e2e() {
    if std::env::var_os("KVFERRY_ATTACH_SKIP_E2E").is_some() {
        return;
    }
    let dir = std::env::temp_dir().join(unique("kvferry-attach-e2e"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let chunk = e2e_chunk();
    let bytes = E2E_REQUESTS * E2E_CHUNKS * chunk;
    let window = e2e_slots() * chunk;
    let placements: &[E2ePlacement] = match copy_apart() {
        Some(_) => &[
            E2ePlacement::Scheduler,
            E2ePlacement::Auto,
            E2ePlacement::Apart,
        ],
        None => &[E2ePlacement::Scheduler],
    };
    let runs: Vec<(Daemons, E2ePlacement)> = [Daemons::Two, Daemons::Node]
        .into_iter()
        .flat_map(|d| placements.iter().map(move |&p| (d, p)))
        .collect();
    println!(
        "\nattach end to end (Python worker -> kvferry sender -> shm -> kvferry receiver -> \
         Python decoder), {} MiB in {} KiB chunks, {} requests in flight, vs a single-thread \
         memcpy; daemons `two` (kvferry receiver and kvferry sender, ZMQ over {}) \
         and `node` (one kvferry node, ZMQ inproc between its roles); threads {}:",
        bytes >> 20,
        chunk >> 10,
        e2e_window(),
        match e2e_control() {
            E2eControl::Ipc => "an ipc:// socket given to the sender",
            E2eControl::Tcp => "loopback TCP (--no-local-control)",
            E2eControl::Default =>
                "loopback TCP, the sender moving to the Unix socket the receiver offers",
        },
        match copy_apart() {
            Some((copy, rest)) => format!(
                "`none` (the scheduler's choice: --copy-cpu none, --spare-cpu none), `auto` \
                 (the daemons' default, --copy-cpu auto and --spare-cpu auto: the copy engine \
                 alone on CPU {copy}, the daemons' other threads on CPUs {rest}; the clients \
                 started on every CPU, keeping off CPU {copy} by themselves) and `apart` \
                 (--copy-cpu {copy}; every other thread of the processes on CPUs {rest}: the \
                 daemons' --cpus, the clients started there); runs alternating",
                rest = cpu_list(rest)
            ),
            None => "none (one CPU: nothing to set apart)".to_owned(),
        }
    );
    let src = page_aligned(window, 0x33);
    let mut dst = page_aligned(window, 0x44);
    let mut ratios = Vec::new();
    for mode in ["stamp", "full"] {
        for _ in 0..3 {
            for &(daemons, placement) in &runs {
                let ticks = cpu_ticks();
                let before = memcpy_gibs(&src, &mut dst, bytes, chunk);
                let kvf = python_e2e(mode, daemons, placement, &dir);
                let after = memcpy_gibs(&src, &mut dst, bytes, chunk);
                let base = (before + after) / 2.0;
                let ratio = kvf / base;
                println!(
                    "  {mode:5} {:4} {:5}: kvferry {kvf:6.2} GiB/s, memcpy {base:6.2} GiB/s \
                     (before {before:.2}, after {after:.2}), ratio {ratio:.2} ({})",
                    daemons.name(),
                    placement.name(),
                    steal_since(&ticks)
                );
                ratios.push((mode, daemons, placement, ratio));
            }
        }
    }
    for mode in ["stamp", "full"] {
        for &(daemons, placement) in &runs {
            let mut r: Vec<f64> = ratios
                .iter()
                .filter(|(m, d, p, _)| *m == mode && *d == daemons && *p == placement)
                .map(|(.., r)| *r)
                .collect();
            r.sort_by(f64::total_cmp);
            println!(
                "  {mode:5} {:4} {:5}: median ratio {:.2} (of {:.2?})",
                daemons.name(),
                placement.name(),
                r[r.len() / 2],
                r
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    // The CPUs the bench started with, before the round trip pins this
    // thread.
    bench_cpus();
    benches();
    Criterion::default().configure_from_args().final_summary();
    // Only under `cargo bench` (criterion's harness gets `--bench`), not in
    // `cargo test --benches` smoke runs.
    if std::env::args().any(|a| a == "--bench") {
        if std::env::var_os("KVFERRY_ATTACH_SKIP_RTT").is_none() {
            rtt_interleaved(Duration::ZERO);
            rtt_interleaved(RTT_POLL_IDLE);
            prefill_rtt();
        }
        e2e();
    }
}
