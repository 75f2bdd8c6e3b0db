//! `--cpus`, `--copy-cpu` (`kvferry sender`, `kvferry node`) and
//! `--spare-cpu` (`kvferry receiver`; docs/attach.md, "Placing the
//! threads"): the daemons' threads run where the options put them, those
//! spawned after the confinement (ZMQ's I/O threads, a client's session at
//! its hello) included, and a
//! bad value is refused at start naming its option. Read from
//! `/proc/<pid>/task/*/status`. Every wait has a deadline.
#![cfg(not(feature = "shuttle-model"))]

#[path = "common/process.rs"]
mod process;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvferry::attach::{DecoderClient, PrefillClient};
use process::{
    parse_cpu_list, sigterm, status_and_stderr, status_field, thread_cpus, ChildProc, TempDir,
};

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");
const WAIT: Duration = Duration::from_secs(30);

/// Threads of a process: (name, thread id, the CPUs it may run on).
type Threads = Vec<(String, i32, Vec<usize>)>;

/// Every thread of `pid`, from `/proc/<pid>/task/*/status`.
fn threads_of(pid: u32) -> Threads {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let tid = e.file_name().to_str()?.parse().ok()?;
        let status = std::fs::read_to_string(e.path().join("status")).ok()?;
        let name = status_field(&status, "Name:")?;
        Some((
            name,
            tid,
            parse_cpu_list(&status_field(&status, "Cpus_allowed_list:")?),
        ))
    })
    .collect()
}

/// A client's session thread (`attach-<client id>`; the accept thread is
/// `attach-accept`).
fn is_session(name: &str) -> bool {
    name.strip_prefix("attach-")
        .is_some_and(|id| id.parse::<u64>().is_ok())
}

/// Waits until `pid` has `sessions` session threads (spawned after the
/// client's hello, so not yet there when `connect` returns), then returns
/// every thread's placement.
fn placements_with_sessions(pid: u32, sessions: usize) -> Threads {
    let end = Instant::now() + WAIT;
    loop {
        let p = threads_of(pid);
        if p.iter().filter(|(n, _, _)| is_session(n)).count() >= sessions {
            return p;
        }
        assert!(
            Instant::now() < end,
            "not {sessions} session threads in {pid} within {WAIT:?}: {p:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The copy engine of `threads` runs on `copy` alone, every other thread
/// on `rest`.
fn assert_copy_engine_apart(threads: &Threads, copy: &[usize], rest: &[usize]) {
    let copies: Vec<_> = threads
        .iter()
        .filter(|(n, _, _)| n == "kvf-shm-copy")
        .collect();
    assert_eq!(copies.len(), 1, "one copy engine: {threads:?}");
    assert_eq!(copies[0].2, copy, "{threads:?}");
    for (name, _, on) in threads.iter().filter(|(n, _, _)| n != "kvf-shm-copy") {
        assert_eq!(on, rest, "thread {name}: {threads:?}");
    }
}

/// Runs `attach` on a thread of its own and returns its client: a client
/// takes the daemon's copy-engine CPU out of the set of the thread that
/// attaches (docs/attach.md, "Placing the threads"), and the daemons a
/// test spawns after must still start with every CPU, as from a shell.
fn attach_apart<T: Send>(attach: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(attach).join().expect("the attaching thread"))
}

/// Spawns the daemon `args` name and returns it with every stdout line up
/// to and including the one containing `announce`.
fn spawn_lines(args: &[String], announce: &str) -> (ChildProc, Vec<String>) {
    let mut p = ChildProc::spawn(Command::new(BIN).args(args).stdin(Stdio::null()));
    let end = Instant::now() + WAIT;
    let what = format!("kvferry {args:?} to print {announce:?}");
    let mut lines = Vec::new();
    while !lines.last().is_some_and(|l: &String| l.contains(announce)) {
        match p.lines.next(&mut p.child, end, &what) {
            Some(l) => lines.push(l),
            None => panic!("{what}: it exited after {lines:?}"),
        }
    }
    (p, lines)
}

/// `parts`, one after the other, as owned arguments.
fn args_of(parts: &[&[&str]]) -> Vec<String> {
    parts.concat().into_iter().map(str::to_owned).collect()
}

/// The receive buffer's options of `kvferry receiver` and `kvferry node`.
const RECEIVER: [&str; 6] = [
    "--listen",
    "tcp://127.0.0.1:0",
    "--capacity-chunks",
    "4",
    "--chunk-bytes",
    "4096",
];

/// Stops a daemon as an operator does (SIGTERM) and returns the rest of
/// its stdout, to the end: every line it printed, the placement line that
/// follows the announcement included (a SIGKILL right after the
/// announcement could land before it).
fn terminate(p: &mut ChildProc, what: &str) -> Vec<String> {
    assert!(sigterm(&p.child), "SIGTERM to {what}");
    let rest = p.lines.rest(&mut p.child, what);
    p.wait_success(what);
    rest
}

/// Where `kvferry sender --attach` and `kvferry node` put their threads
/// with `extra` placement options, each with one attached client per
/// socket (their session threads are spawned at the hello): the
/// placements of the sender's threads, then the node's, each with every
/// line the daemon printed ([`terminate`]: read to the end after it
/// exited, so a line printed after the announcements is there too).
fn daemon_placements(extra: &[&str]) -> [(Threads, Vec<String>); 2] {
    let dir = TempDir::new("kvferry-cpus");
    let send_sock = dir.0.join("send.sock").to_str().unwrap().to_owned();
    let sender_args = args_of(&[
        &[
            "sender",
            "--connect",
            "tcp://127.0.0.1:9",
            "--chunk-bytes",
            "4096",
            "--staging-slots",
            "8",
            "--attach",
            &send_sock,
        ],
        extra,
    ]);
    let (mut send, mut send_lines) = spawn_lines(&sender_args, "kvferry sender attach on ");
    let worker =
        attach_apart(|| PrefillClient::connect(&send_sock, WAIT).expect("a worker attaches"));
    let sender = placements_with_sessions(send.child.id(), 1);
    drop(worker);
    send_lines.extend(terminate(&mut send, "the sender"));
    let (mut node, mut node_lines, dec_sock, work_sock) = node_with(&dir, extra);
    let (decoder, worker) = attach_apart(|| {
        (
            DecoderClient::connect(&dec_sock, WAIT).expect("a decoder attaches"),
            PrefillClient::connect(&work_sock, WAIT).expect("a worker attaches"),
        )
    });
    let placed = placements_with_sessions(node.child.id(), 2);
    drop((decoder, worker));
    node_lines.extend(terminate(&mut node, "the node"));
    [(sender, send_lines), (placed, node_lines)]
}

/// Nothing was set apart: the daemon has a copy engine, every thread of it
/// runs on `cpus`, and it printed no placement line.
fn assert_nothing_apart(threads: &Threads, lines: &[String], cpus: &[usize]) {
    assert!(
        threads.iter().any(|(n, _, _)| n == "kvf-shm-copy"),
        "{threads:?}"
    );
    for (name, _, on) in threads {
        assert_eq!(on, cpus, "thread {name}: {threads:?}");
    }
    assert!(
        !lines.iter().any(|l| l.contains("copy engine")),
        "{lines:?}"
    );
}

/// By default (`--copy-cpu auto`) a daemon serving prefill workers keeps
/// the last CPU it may run on for its copy engine and runs every other
/// thread, sessions included, on the rest, and says so; on one CPU it
/// places nothing.
#[test]
fn by_default_the_copy_engine_has_the_last_cpu_to_itself() {
    let cpus = kvferry::threads::allowed_cpus();
    for (threads, lines) in daemon_placements(&[]) {
        // The first line is still the announcement scripts wait for
        // (`kvferry sender attach on`, `kvferry node listening on`).
        assert!(
            lines[0].starts_with("kvferry sender attach on ")
                || lines[0].starts_with("kvferry node listening on "),
            "{lines:?}"
        );
        let said: Vec<&String> = lines.iter().filter(|l| l.contains("copy engine")).collect();
        match cpus {
            [rest @ .., copy] if !rest.is_empty() => {
                assert_copy_engine_apart(&threads, &[*copy], rest);
                assert_eq!(said.len(), 1, "{lines:?}");
                assert!(
                    said[0].ends_with(&format!("copy engine on cpu {copy}")),
                    "{lines:?}"
                );
            }
            _ => {
                eprintln!("one CPU only: nothing to keep apart");
                assert_nothing_apart(&threads, &lines, cpus);
            }
        }
    }
}

/// `--copy-cpu none` leaves every thread to the scheduler, on every CPU
/// the daemon was started with.
#[test]
fn copy_cpu_none_places_no_thread() {
    let cpus = kvferry::threads::allowed_cpus();
    for (threads, lines) in daemon_placements(&["--copy-cpu", "none"]) {
        assert_nothing_apart(&threads, &lines, cpus);
    }
}

/// `--cpus` without `--copy-cpu` is the operator's placement: the copy
/// engine runs on those CPUs with every other thread (`auto` keeps no CPU
/// for it then).
#[test]
fn with_cpus_and_no_copy_cpu_the_copy_engine_runs_on_cpus_too() {
    let first = kvferry::threads::allowed_cpus()[0];
    let list = first.to_string();
    for (threads, lines) in daemon_placements(&["--cpus", &list]) {
        assert_nothing_apart(&threads, &lines, &[first]);
    }
}

/// `--copy-cpu` and `--cpus` together: the copy engine alone on
/// `--copy-cpu`, every other thread (of both roles in `kvferry node`, the
/// sessions spawned at the clients' hellos included) on `--cpus`.
#[test]
fn the_copy_engine_runs_alone_on_its_cpu_and_every_other_thread_on_cpus() {
    let cpus = kvferry::threads::allowed_cpus();
    // Two CPUs apart where there are two; on one, both options name it.
    let (rest, copy) = (cpus[0], *cpus.last().unwrap());
    if rest == copy {
        eprintln!("one CPU only: checking placement without isolation");
    }
    let (rest_s, copy_s) = (rest.to_string(), copy.to_string());
    for (threads, _) in daemon_placements(&["--cpus", &rest_s, "--copy-cpu", &copy_s]) {
        assert_copy_engine_apart(&threads, &[copy], &[rest]);
    }
}

/// Where `kvferry receiver` puts its threads with `extra` options: with
/// `--attach` (`attach`), once a decoder attached (its session thread is
/// spawned at the hello); and every line it printed, to the end.
fn receiver_placement(attach: bool, extra: &[&str]) -> (Threads, Vec<String>) {
    let dir = TempDir::new("kvferry-cpus");
    let sock = dir.0.join("recv.sock");
    let buf = dir.0.join("buf");
    let (sock_s, buf_s) = (sock.to_str().unwrap(), buf.to_str().unwrap());
    let attach_args: &[&str] = if attach { &["--attach", sock_s] } else { &[] };
    let args = args_of(&[
        &["receiver"],
        &RECEIVER,
        &["--shm-path", buf_s],
        attach_args,
        extra,
    ]);
    let announce = if attach {
        "kvferry receiver attach on "
    } else {
        "kvferry receiver listening on "
    };
    let (mut recv, mut lines) = spawn_lines(&args, announce);
    let decoder = attach
        .then(|| attach_apart(|| DecoderClient::connect(&sock, WAIT).expect("a decoder attaches")));
    let threads = placements_with_sessions(recv.child.id(), usize::from(attach));
    assert!(threads.len() > 3, "{threads:?}");
    drop(decoder);
    lines.extend(terminate(&mut recv, "the receiver"));
    (threads, lines)
}

/// The lines of a receiver that say which CPU it left out.
fn spare_lines(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| l.contains("copy engine")).collect()
}

/// By default (`--spare-cpu auto`) a receiver serving attached decoders
/// runs every thread, sessions included, off the last CPU, which a
/// `kvferry sender --attach` on the same host gives its copy engine, and
/// says so after its announcements; `--pin-cpu` naming that CPU moves the
/// spared one down, as it moves a sender's engine. On one CPU nothing is
/// left out.
#[test]
fn by_default_a_receiver_serving_decoders_leaves_the_last_cpu_to_a_senders_copy_engine() {
    let cpus = kvferry::threads::allowed_cpus();
    let (threads, lines) = receiver_placement(true, &[]);
    assert!(
        lines[0].starts_with("kvferry receiver listening on "),
        "{lines:?}"
    );
    let [rest @ .., last] = cpus else {
        unreachable!("a process runs on some CPU")
    };
    if rest.is_empty() {
        eprintln!("one CPU only: nothing to leave out");
        for (name, _, on) in &threads {
            assert_eq!(on, cpus, "thread {name}: {threads:?}");
        }
        assert_eq!(spare_lines(&lines), Vec::<&String>::new());
        return;
    }
    for (name, _, on) in &threads {
        assert_eq!(on, rest, "thread {name}: {threads:?}");
    }
    let said = format!("kvferry receiver leaves cpu {last} to a sender's copy engine");
    assert_eq!(spare_lines(&lines), vec![&said], "{lines:?}");
    // The control thread pinned to the last CPU: the one before is spared.
    let last_s = last.to_string();
    let (threads, lines) = receiver_placement(true, &["--pin-cpu", &last_s]);
    let spared = rest[rest.len() - 1];
    let others: Vec<usize> = cpus.iter().copied().filter(|&c| c != spared).collect();
    for (name, _, on) in &threads {
        let want = if name.starts_with("kvf-recv-ctrl") {
            vec![*last]
        } else {
            others.clone()
        };
        assert_eq!(on, &want, "thread {name}: {threads:?}");
    }
    let said = format!("kvferry receiver leaves cpu {spared} to a sender's copy engine");
    assert_eq!(spare_lines(&lines), vec![&said], "{lines:?}");
}

/// `--spare-cpu none`, and a receiver without `--attach` (a load-test
/// target), leave every thread on every CPU the receiver started with.
#[test]
fn spare_cpu_none_and_a_receiver_without_attach_leave_out_no_cpu() {
    let cpus = kvferry::threads::allowed_cpus();
    for (attach, extra) in [(true, &["--spare-cpu", "none"][..]), (false, &[])] {
        let (threads, lines) = receiver_placement(attach, extra);
        for (name, _, on) in &threads {
            assert_eq!(on, cpus, "{extra:?}, thread {name}: {threads:?}");
        }
        assert_eq!(spare_lines(&lines), Vec::<&String>::new(), "{extra:?}");
    }
}

/// `--cpus` is the operator's placement: every thread of the receiver runs
/// there, the last CPU included if listed (`--spare-cpu auto` leaves
/// nothing out then).
#[test]
fn every_receiver_thread_runs_on_cpus_a_decoders_session_included() {
    let cpu = *kvferry::threads::allowed_cpus().last().unwrap();
    let (threads, lines) = receiver_placement(true, &["--cpus", &cpu.to_string()]);
    for (name, _, on) in &threads {
        assert_eq!(on, &vec![cpu], "thread {name}: {threads:?}");
    }
    assert_eq!(spare_lines(&lines), Vec::<&String>::new());
}

/// `kvferry node` with `extra` options in `dir`, the lines it printed up
/// to its last announcement, and its decoder and worker sockets (stopped
/// by [`terminate`]).
fn node_with(dir: &TempDir, extra: &[&str]) -> (ChildProc, Vec<String>, String, String) {
    let path = |name: &str| dir.0.join(name).to_str().unwrap().to_owned();
    let (dec_sock, work_sock) = (path("dec.sock"), path("work.sock"));
    let args = args_of(&[
        &["node"],
        &RECEIVER,
        &[
            "--staging-slots",
            "8",
            "--attach",
            &dec_sock,
            "--prefill-attach",
            &work_sock,
            "--shm-path",
            &path("buf"),
        ],
        extra,
    ]);
    let (node, lines) = spawn_lines(&args, "kvferry node prefill attach on ");
    (node, lines, dec_sock, work_sock)
}

/// What `clients/python/placement_check.py` says after attaching to both
/// sockets, with `KVFERRY_ATTACH_KEEP_AFFINITY` set to `keep` if given:
/// the decoder's and the worker's `kept_off_cpu` and the thread's CPUs.
fn python_placement(dec_sock: &str, work_sock: &str, keep: Option<&str>) -> String {
    let py = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    let mut cmd = Command::new("python3");
    cmd.arg(py.join("placement_check.py"))
        .args([dec_sock, work_sock])
        .env("PYTHONPATH", &py)
        .env_remove(kvferry::attach::KEEP_AFFINITY_ENV)
        .stdin(Stdio::null());
    if let Some(v) = keep {
        cmd.env(kvferry::attach::KEEP_AFFINITY_ENV, v);
    }
    let mut child = ChildProc::spawn(&mut cmd);
    let line = child.expect_line("PLACED ");
    child.wait_success("clients/python/placement_check.py");
    line["PLACED ".len()..].to_owned()
}

/// Attaches a decoder to `dec_sock`, whose daemon keeps no CPU for a copy
/// engine, on a thread of its own that may run on `cpus`: the hello names
/// none and the thread keeps every CPU.
fn a_decoder_keeps_every_cpu(dec_sock: &str, cpus: &[usize]) {
    attach_apart(|| {
        let d = DecoderClient::connect(dec_sock, WAIT).expect("a decoder attaches");
        assert_eq!(d.hello().engine_cpu, kvferry::attach::layout::NO_CPU);
        assert_eq!((d.kept_off_cpu(), thread_cpus()), (None, cpus.to_vec()));
    });
}

/// A daemon that keeps a CPU for a copy engine (by default a node, a
/// sender and a receiver serving attached clients all do) names it in the
/// hello, and a client takes it out of the set of the thread that
/// attached: the Rust and the Python clients alike, unless
/// `KVFERRY_ATTACH_KEEP_AFFINITY` is set, the thread may run there only,
/// or the daemon keeps no CPU (`--copy-cpu none`).
#[test]
fn a_client_keeps_the_thread_that_attaches_off_the_daemons_copy_engine_cpu() {
    let cpus = kvferry::threads::allowed_cpus();
    let [rest @ .., last] = cpus else {
        unreachable!("a process runs on some CPU")
    };
    let last = *last;
    let all = |v: &[usize]| {
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let dir = TempDir::new("kvferry-cpus");
    let (mut node, _, dec_sock, work_sock) = node_with(&dir, &[]);
    if rest.is_empty() {
        eprintln!("one CPU only: the node keeps none for its engine");
        a_decoder_keeps_every_cpu(&dec_sock, cpus);
        terminate(&mut node, "the node");
        return;
    }
    attach_apart(|| {
        let d = DecoderClient::connect(&dec_sock, WAIT).expect("a decoder attaches");
        assert_eq!(d.hello().engine_cpu, last as u32, "the hello names the CPU");
        assert_eq!(d.kept_off_cpu(), Some(last));
        assert_eq!(thread_cpus(), rest, "the engine's CPU taken out, no other");
        let w = PrefillClient::connect(&work_sock, WAIT).expect("a worker attaches");
        assert_eq!(w.hello().engine_cpu, last as u32);
        assert_eq!(w.kept_off_cpu(), None, "already off it");
        assert_eq!(thread_cpus(), rest);
    });
    attach_apart(|| {
        kvferry::threads::confine_current(&[last]).expect("confined");
        let w = PrefillClient::connect(&work_sock, WAIT).expect("a worker attaches");
        assert_eq!(w.kept_off_cpu(), None, "a thread placed there alone stays");
        assert_eq!(thread_cpus(), vec![last]);
    });
    assert_eq!(
        python_placement(&dec_sock, &work_sock, None),
        format!("{last} None {}", all(rest)),
        "the Python clients keep off it too"
    );
    assert_eq!(
        python_placement(&dec_sock, &work_sock, Some("1")),
        format!("None None {}", all(cpus)),
        "KVFERRY_ATTACH_KEEP_AFFINITY=1 keeps the set"
    );
    terminate(&mut node, "the node");

    // A receiver serving decoders names the CPU it leaves to a sender's
    // engine.
    let sock = dir.0.join("recv.sock");
    let args = args_of(&[
        &["receiver"],
        &RECEIVER,
        &[
            "--shm-path",
            dir.0.join("recv-buf").to_str().unwrap(),
            "--attach",
            sock.to_str().unwrap(),
        ],
    ]);
    let (mut recv, _) = spawn_lines(&args, "kvferry receiver attach on ");
    attach_apart(|| {
        let d = DecoderClient::connect(&sock, WAIT).expect("a decoder attaches");
        assert_eq!(d.hello().engine_cpu, last as u32);
        assert_eq!(
            (d.kept_off_cpu(), thread_cpus()),
            (Some(last), rest.to_vec())
        );
    });
    terminate(&mut recv, "the receiver");

    // `--copy-cpu none`: no CPU kept, none named, every set kept.
    let dir = TempDir::new("kvferry-cpus");
    let (mut node, _, dec_sock, work_sock) = node_with(&dir, &["--copy-cpu", "none"]);
    a_decoder_keeps_every_cpu(&dec_sock, cpus);
    assert_eq!(
        python_placement(&dec_sock, &work_sock, None),
        format!("None None {}", all(cpus))
    );
    terminate(&mut node, "the node");
}

#[test]
fn a_bad_cpu_option_is_refused_at_start_naming_it() {
    let dir = TempDir::new("kvferry-cpus");
    let sock = dir.0.join("s.sock");
    let s = sock.to_str().unwrap();
    let refused = |args: &[&str], says: &str| {
        // Without the refusal it would serve until killed: bounded.
        let (st, err) =
            status_and_stderr(Command::new(BIN).args(args), &format!("kvferry {args:?}"));
        assert_eq!(st.code(), Some(2), "{args:?} is refused: {err}");
        assert!(
            err.contains(says),
            "{args:?}: the message says {says:?}: {err}"
        );
        assert!(!sock.exists(), "{args:?}: refused before binding");
    };
    let sender = ["sender", "--connect", "tcp://127.0.0.1:9", "--attach", s];
    let with = |extra: &[&'static str]| [&sender[..], extra].concat();
    refused(
        &with(&["--cpus", "1000"]),
        "--cpus: cpu 1000 is not in the allowed",
    );
    refused(&with(&["--cpus", "0,x"]), "is not a CPU id");
    refused(&with(&["--cpus", "2-1"]), "reversed range");
    refused(
        &with(&["--copy-cpu", "1000"]),
        "--copy-cpu: cpu 1000 is not",
    );
    refused(
        &with(&["--copy-cpu", "last"]),
        "is not a CPU id, `auto` or `none`",
    );
    // Without --attach there is no one copy engine to place.
    refused(
        &[
            "sender",
            "--connect",
            "tcp://127.0.0.1:9",
            "--copy-cpu",
            "0",
        ],
        "--attach",
    );
    let receiver = ["receiver", "--listen", "tcp://127.0.0.1:0", "--attach", s];
    refused(
        &[&receiver[..], &["--cpus", "1000"]].concat(),
        "--cpus: cpu 1000 is not in the allowed",
    );
    refused(
        &[&receiver[..], &["--pin-cpu", "1000"]].concat(),
        "--pin-cpu: cpu 1000 is not",
    );
    refused(
        &[&receiver[..], &["--spare-cpu", "1"]].concat(),
        "is not `auto` or `none`",
    );
    // Without --attach the receiver places nothing: nothing to spare.
    refused(
        &[
            "receiver",
            "--listen",
            "tcp://127.0.0.1:0",
            "--spare-cpu",
            "none",
        ],
        "--attach",
    );
}
