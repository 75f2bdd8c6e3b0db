//! Threads, child processes and scratch directories of the black-box
//! tests: a test thread joined with a deadline, a private temp directory
//! removed on drop, a child killed on drop with its stdout lines read on a
//! thread, a free loopback port, a bounded wait for exit. Self-contained,
//! so a test file can include just this:
//! `#[path = "common/process.rs"] mod process;` (`tests/common` re-exports
//! it too).
//!
//! Every wait has a deadline ([`PROC_WAIT`] unless the caller passes one);
//! hitting it kills the child and fails the test naming what hung.
#![allow(dead_code)] // each test file uses its own subset

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long a child may take to print a line or to exit before the test
/// is declared hung (generous: the CI machine is loaded).
pub const PROC_WAIT: Duration = Duration::from_secs(30);

/// The value of field `name` (with its colon) of a `/proc/.../status`
/// text, trimmed.
pub fn status_field(status: &str, name: &str) -> Option<String> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(|v| v.trim().to_owned())
}

/// A CPU list as `Cpus_allowed_list` spells it: `0-2,5` → [0, 1, 2, 5].
pub fn parse_cpu_list(list: &str) -> Vec<usize> {
    list.split(',')
        .flat_map(|item| match item.split_once('-') {
            Some((lo, hi)) => (lo.parse().unwrap()..=hi.parse().unwrap()).collect(),
            None => vec![item.parse().unwrap()],
        })
        .collect()
}

/// The CPUs the calling thread may run on, from `/proc/thread-self/status`.
pub fn thread_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/thread-self/status").expect("own status");
    parse_cpu_list(&status_field(&status, "Cpus_allowed_list:").expect("Cpus_allowed_list"))
}

/// Gives the child `cmd` spawns an `RLIMIT_NOFILE` of `n` (soft and hard),
/// for tests of what a process does when it runs out of descriptors.
pub fn limit_nofile(cmd: &mut Command, n: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing
    // else between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let rl = libc::rlimit {
                rlim_cur: n,
                rlim_max: n,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &rl) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Sends SIGTERM to `child`, as an operator stops a daemon (it exits
/// cleanly, removing its files); false if kill(2) failed.
pub fn sigterm(child: &Child) -> bool {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return false;
    };
    // SAFETY: kill(2) takes a pid and a signal and touches no memory of
    // ours; the pid is our own child's, which stays ours until reaped.
    unsafe { libc::kill(pid, libc::SIGTERM) == 0 }
}

/// A command running test `test` of this test binary again, alone
/// (`--exact`, one test thread, its output not captured): how a test puts
/// a role of its own in a child process (the caller sets the env var that
/// names the role, and spawns it).
pub fn rerun_alone(test: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary's path"));
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    cmd
}

/// `kvferry node` (the binary of this package) with both attach sockets
/// and its buffer file in `dir` (`decoders.sock`, `workers.sock`, `buf`),
/// listening on a free loopback port: `capacity` receive slots and
/// `staging` staging slots of `chunk` bytes in `shares` shares. The
/// caller adds its own options and spawns it.
pub fn node_command(
    dir: &TempDir,
    chunk: u64,
    capacity: u32,
    staging: u32,
    shares: u32,
) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    cmd.args(["node", "--listen", "tcp://127.0.0.1:0"])
        .args(["--capacity-chunks", &capacity.to_string()])
        .args(["--chunk-bytes", &chunk.to_string()])
        .args(["--staging-slots", &staging.to_string()])
        .args(["--attach-shares", &shares.to_string()])
        .arg("--attach")
        .arg(dir.join("decoders.sock"))
        .arg("--prefill-attach")
        .arg(dir.join("workers.sock"))
        .arg("--shm-path")
        .arg(dir.join("buf"))
        .stdin(Stdio::null());
    cmd
}

/// Page faults (minor and major) taken so far by thread `tid` of this
/// process, 0 for the calling thread: `/proc/self/task/<tid>/stat`, fields
/// 10 and 12. What a test counts to see that memory was mapped up front.
pub fn thread_faults(tid: libc::pid_t) -> u64 {
    let tid = if tid == 0 {
        // SAFETY: gettid takes nothing and cannot fail.
        unsafe { libc::gettid() }
    } else {
        tid
    };
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
        .unwrap_or_else(|e| panic!("stat of thread {tid}: {e}"));
    // After the command name's closing parenthesis: field 3 on.
    let rest: Vec<&str> = stat[stat.rfind(')').map_or(0, |i| i + 1)..]
        .split_whitespace()
        .collect();
    let field = |i: usize| -> u64 {
        rest.get(i)
            .and_then(|f| f.parse().ok())
            .unwrap_or_else(|| panic!("thread {tid}'s stat has no fault count: {stat}"))
    };
    field(7) + field(9)
}

/// True for the name of an attach session thread (`attach-<client id>`;
/// not the daemon's `attach-accept`).
fn is_attach_session(name: &str) -> bool {
    name.strip_prefix("attach-")
        .is_some_and(|id| id.parse::<u32>().is_ok())
}

/// Attach session threads that process `pid` runs now: 0 once every
/// session of its attach daemons has ended.
pub fn attach_sessions(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| is_attach_session(c.trim()))
                })
                .count()
        })
        .unwrap_or(0)
}

/// The scheduler states (`R` running or runnable, `S` asleep, ...; field
/// 3 of `/proc/<pid>/task/<tid>/stat`) of the attach session threads that
/// process `pid` runs now.
pub fn attach_session_states(pid: u32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| is_attach_session(c.trim()))
        })
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            stat[stat.rfind(')')? + 1..].trim_start().chars().next()
        })
        .collect()
}

/// Panics of attach session threads in this test process so far, counted
/// by a panic hook installed on the first call (it chains to the hook it
/// replaces). Compare the counts before and after the sessions of a test.
pub fn attach_session_panics() -> usize {
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if is_attach_session(thread::current().name().unwrap_or("")) {
                // Relaxed: a count read after the sessions ended.
                PANICS.fetch_add(1, Ordering::Relaxed);
            }
            previous(info);
        }));
    });
    // Relaxed: as above.
    PANICS.load(Ordering::Relaxed)
}

/// The seed of a randomised test: `KVFERRY_FUZZ_SEED` if set (to replay
/// or widen a run), else 7.
pub fn fuzz_seed() -> u64 {
    std::env::var("KVFERRY_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7)
}

/// Fails naming `who` if the stderr a child wrote to `path` says a thread
/// panicked: nothing a peer sends may panic it, even where it lives on.
pub fn assert_no_panic_logged(path: &Path, who: &str) {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    assert!(!log.contains("panicked"), "{who} panicked:\n{log}");
}

/// A thread of the test, called `what`; see [`spawn_thread`].
pub struct Spawned<T> {
    handle: JoinHandle<T>,
    what: &'static str,
}

/// Runs `f` on a new thread called `what`.
pub fn spawn_thread<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Spawned<T> {
    let handle = thread::Builder::new()
        .name(what.to_owned())
        .spawn(f)
        .expect("spawn a test thread");
    Spawned { handle, what }
}

impl<T> Spawned<T> {
    /// The thread's value; fails the test naming the thread if it is still
    /// running after [`PROC_WAIT`] or panicked (kvferry's own bounded join,
    /// [`kvferry::threads::join_within`]).
    pub fn join(self) -> T {
        kvferry::threads::join_within(self.handle, PROC_WAIT, self.what)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Runs `f(i)` for every `i` in `0..n` at once, each on a thread called
/// `what-i`, and returns their values in order. Fails the test naming
/// `what` if one panicked or has not finished `limit` after the start
/// (then it is left running, detached: the test fails rather than hangs).
pub fn on_threads<T: Send + 'static>(
    n: u64,
    what: &'static str,
    limit: Duration,
    f: impl Fn(u64) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let end = Instant::now() + limit;
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let f = std::sync::Arc::clone(&f);
            thread::Builder::new()
                .name(format!("{what}-{i}"))
                .spawn(move || f(i))
                .expect("spawn a test thread")
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            let left = end.saturating_duration_since(Instant::now());
            kvferry::threads::join_within(h, left, what).unwrap_or_else(|e| panic!("{e}"))
        })
        .collect()
}

/// A fresh directory `<tmp>/<prefix>-<pid>-<n>`, removed (with its
/// contents) on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates the directory.
    pub fn new(prefix: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        // Relaxed: only the uniqueness of the number matters.
        let n = N.fetch_add(1, Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("{prefix}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&d).expect("create the test's temp dir");
        TempDir(d)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `name` inside the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// The path of the test's Unix socket (`test.sock`) inside the directory.
    pub fn sock(&self) -> PathBuf {
        self.join("test.sock")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A loopback port that was free a moment ago (bound on port 0, then
/// closed: another process may take it meanwhile, so callers retry).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Waits for `child` to exit; kills it and fails naming `what` after
/// [`PROC_WAIT`].
pub fn wait_exit(child: &mut Child, what: &str) -> ExitStatus {
    wait_exit_within(child, what, PROC_WAIT)
}

/// Runs `cmd` to its exit (stdin and stdout closed, stderr read as it
/// comes, so a long message cannot block it) within [`PROC_WAIT`],
/// killing it and failing naming `what` past that; its status and stderr.
/// For a command expected to refuse and exit, not one that serves.
pub fn status_and_stderr(cmd: &mut Command, what: &str) -> (ExitStatus, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {what}: {e}"));
    let mut err = child.stderr.take().expect("stderr piped");
    // Ends when the child's stderr closes: at its exit (it has no children
    // of its own holding the pipe), or at the kill past the deadline.
    let reader = thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let status = wait_exit(&mut child, what);
    (status, reader.join().unwrap_or_default())
}

/// [`wait_exit`] with its own deadline `hang`.
pub fn wait_exit_within(child: &mut Child, what: &str, hang: Duration) -> ExitStatus {
    let end = Instant::now() + hang;
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("hung waiting for the process to exit: {what}");
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// Kills `child` (SIGKILL) if it still runs, and reaps it.
pub fn kill_and_reap(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// A child process killed (if still running) and reaped on drop, so a
/// failing test leaves none behind.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        kill_and_reap(&mut self.0);
    }
}

/// The lines a child writes to its (piped) stdout, read by a thread so the
/// pipe never fills.
pub struct ChildLines(mpsc::Receiver<String>);

impl ChildLines {
    /// Takes `child`'s stdout (it must be piped).
    pub fn take(child: &mut Child) -> Self {
        let stdout = child.stdout.take().expect("stdout piped");
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ChildLines(rx)
    }

    /// The next line; `None` once stdout closed (the child exited). At
    /// `end`, kills the child and fails naming `what`.
    pub fn next(&self, child: &mut Child, end: Instant, what: &str) -> Option<String> {
        match self
            .0
            .recv_timeout(end.saturating_duration_since(Instant::now()))
        {
            Ok(line) => Some(line),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                kill_and_reap(child);
                panic!("hung waiting for {what}");
            }
        }
    }

    /// The rest (trimmed) of the first line starting with `prefix`, such as
    /// `kvferry receiver listening on `; `None` if stdout closed first.
    /// Fails (killing the child) after [`PROC_WAIT`].
    pub fn after_prefix(&self, child: &mut Child, prefix: &str) -> Option<String> {
        Some(self.after_prefixes(child, &[prefix])?.remove(0))
    }

    /// For each of `prefixes`, the rest (trimmed) of the first line starting
    /// with it, in whatever order the lines come; `None` if stdout closed
    /// before all came. Fails (killing the child) after [`PROC_WAIT`].
    pub fn after_prefixes(&self, child: &mut Child, prefixes: &[&str]) -> Option<Vec<String>> {
        let end = Instant::now() + PROC_WAIT;
        let what = format!("the lines {prefixes:?}");
        let mut found: Vec<Option<String>> = vec![None; prefixes.len()];
        while found.iter().any(Option::is_none) {
            let line = self.next(child, end, &what)?;
            for (p, f) in prefixes.iter().zip(&mut found) {
                if let (None, Some(rest)) = (&f, line.strip_prefix(p)) {
                    *f = Some(rest.trim().to_owned());
                }
            }
        }
        Some(found.into_iter().flatten().collect())
    }

    /// Every line until stdout closes (the child exited); fails (killing
    /// the child) naming `what` if it stays open past [`PROC_WAIT`].
    pub fn rest(&self, child: &mut Child, what: &str) -> Vec<String> {
        let end = Instant::now() + PROC_WAIT;
        let what = format!("{what} to close its stdout");
        std::iter::from_fn(|| self.next(child, end, &what)).collect()
    }

    /// The first line containing `marker`. Fails (killing the child) if
    /// none comes within [`PROC_WAIT`] or stdout closes first.
    pub fn expect_containing(&self, child: &mut Child, marker: &str) -> String {
        let end = Instant::now() + PROC_WAIT;
        let what = format!("a line containing {marker:?}");
        loop {
            match self.next(child, end, &what) {
                Some(l) if l.contains(marker) => return l,
                Some(_) => {}
                None => panic!("the child closed stdout before printing {marker:?}"),
            }
        }
    }
}

/// A child with piped stdout, its lines read on a thread; killed on drop.
pub struct ChildProc {
    /// The child (stdout already taken).
    pub child: Child,
    /// Its stdout lines.
    pub lines: ChildLines,
}

impl ChildProc {
    /// Spawns `cmd` with stdout piped.
    pub fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {cmd:?}: {e}"));
        let lines = ChildLines::take(&mut child);
        ChildProc { child, lines }
    }

    /// Waits for a stdout line containing `marker` and returns it; fails
    /// (killing the child) naming it after [`PROC_WAIT`].
    pub fn expect_line(&mut self, marker: &str) -> String {
        self.lines.expect_containing(&mut self.child, marker)
    }

    /// [`ChildLines::after_prefixes`] of this child; fails if stdout closed
    /// before every prefix came.
    pub fn after_prefixes(&mut self, prefixes: &[&str]) -> Vec<String> {
        self.lines
            .after_prefixes(&mut self.child, prefixes)
            .unwrap_or_else(|| panic!("the child exited before printing {prefixes:?}"))
    }

    /// Waits for the child to exit and asserts it succeeded; fails naming
    /// `what` (killing the child) after [`PROC_WAIT`].
    pub fn wait_success(&mut self, what: &str) {
        let st = wait_exit(&mut self.child, what);
        assert!(st.success(), "{what}: child failed with {st}");
    }

    /// SIGKILLs the child and reaps it.
    pub fn sigkill(&mut self) {
        // Child::kill sends SIGKILL.
        self.child.kill().expect("SIGKILL the child");
        let _ = self.child.wait();
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        kill_and_reap(&mut self.child);
    }
}

/// `python3` with the reference clients (`clients/python`) on its
/// `PYTHONPATH`: add a script (see [`python_client`]) or `-c CODE`.
pub fn python3() -> Command {
    let mut cmd = Command::new("python3");
    cmd.env("PYTHONPATH", python_clients());
    cmd
}

/// The reference clients' directory.
pub fn python_clients() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python")
}

/// Starts `clients/python/<script>` with `args`.
pub fn python_client(script: &str, args: &[&str]) -> ChildProc {
    ChildProc::spawn(python3().arg(python_clients().join(script)).args(args))
}

/// Byte `j` of chunk `i` is `(i * 31 + j) & 0xff`: what
/// `clients/python/decoder_check.py` checks and `prefill_check.py` writes.
pub fn python_pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| ((i * 31 + j) & 0xff) as u8).collect()
}

/// User + system CPU ticks (1/100 s) of process `pid` so far
/// (`/proc/<pid>/stat` fields 14 and 15).
pub fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // The command name (field 2) may hold spaces: count after its ')'.
    let rest = &s[s.rfind(')').expect("stat has a comm field") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3, so fields 14 and 15 are at 11 and 12.
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}
