//! Stress and fault runs of the whole engine (issue: the main job in CI).
//!
//! - in-process: 10,000 requests across 4 senders and 2 receivers with 5 %
//!   random aborts and 2 % injected write failures;
//! - a rogue client sending malformed frames at the receivers during a run;
//! - multi-process: a sender process killed with SIGKILL mid-request while
//!   another keeps going; the receiver's lease frees the dead sender's
//!   capacity and its metrics return to zero;
//! - a soak, opt-in: `KVFERRY_SOAK_SECS=600 cargo test --release --test stress -- --ignored`.

#[path = "common/process.rs"]
mod process;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::runner::{self, ChunkRange, Progress, RunConfig};
use process::{free_port, sigterm, KillOnDrop as Proc};

fn small(requests: usize) -> RunConfig {
    RunConfig {
        prefillers: 4,
        decoders: 2,
        requests,
        chunks: ChunkRange { min: 1, max: 8 },
        batch: 3,
        chunk_bytes: 4096,
        staging_slots: 12,
        capacity_chunks: 16,
        concurrency: 4,
        stall_timeout_s: 20.0,
        ..RunConfig::default()
    }
}

#[test]
fn ten_thousand_requests_with_aborts_and_write_failures() {
    let cfg = RunConfig {
        abort_rate: 0.05,
        fail_rate: 0.02,
        seed: 11,
        ..small(10_000)
    };
    let r = runner::run(cfg, Progress::Quiet).expect("run starts");
    assert!(!r.deadlock, "watchdog fired: {:#?}", r.stall_dump);
    assert_eq!(
        r.completed + r.aborted + r.failed,
        10_000,
        "every request terminal: {r:#?}"
    );
    assert!(
        r.aborted > 0 && r.failed > 0,
        "both fault kinds happened: {r:#?}"
    );
    assert_eq!(r.unexpected_failures, 0, "only injected failures: {r:#?}");
    assert_eq!(r.checksum_mismatches, 0);
    assert_eq!(
        (
            r.leaked_staging_slots,
            r.leaked_receiver_slots,
            r.leaked_reservations
        ),
        (0, 0, 0)
    );
    assert!(r.success());
}

#[test]
fn rogue_client_does_not_disturb_a_run() {
    let stop = Arc::new(AtomicBool::new(false));
    let mut rogue = None;
    let r = runner::run_with(small(600), Progress::Quiet, |endpoints, _| {
        let endpoints = endpoints.to_vec();
        let stop = Arc::clone(&stop);
        rogue = Some(std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let socks: Vec<zmq::Socket> = endpoints
                .iter()
                .map(|e| {
                    let s = ctx.socket(zmq::DEALER).expect("socket");
                    s.set_linger(0).expect("linger");
                    s.connect(e).expect("connect");
                    s
                })
                .collect();
            let frames: [&[u8]; 6] = [
                b"\xff\x00garbage",
                b"",
                b"\x81\xa4type\xa9NoSuchMsg",
                b"\x93\x01\x02\x03",
                b"\x82\xa4type\xacAllocRequest\xa4keys\xdd\xff\xff\xff\xff",
                b"\x81\xa4type",
            ];
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) && sent < 100_000 {
                for s in &socks {
                    let f = frames[(sent % frames.len() as u64) as usize];
                    let _ = s.send_multipart([&[][..], f], zmq::DONTWAIT);
                    while s.recv_multipart(zmq::DONTWAIT).is_ok() {}
                    sent += 1;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            sent
        }));
    })
    .expect("run starts");
    stop.store(true, Ordering::Relaxed);
    let sent = rogue.expect("hook ran").join().expect("rogue thread");
    assert!(sent > 0, "the rogue client sent frames");
    assert!(
        r.success(),
        "run disturbed by malformed frames: {}",
        r.render()
    );
    assert_eq!(r.completed, 600);
}

// ----- multi-process ------------------------------------------------------

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvferry")
}

fn scrape(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
}

fn wait_until(deadline: Instant, what: &str, mut f: impl FnMut() -> bool) {
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn killed_sender_process_frees_its_capacity_through_the_lease() {
    let port = free_port();
    let mport = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let maddr: SocketAddr = format!("127.0.0.1:{mport}").parse().expect("addr");
    let mut receiver = Proc(
        Command::new(bin())
            .args([
                "receiver",
                "--listen",
                &endpoint,
                "--capacity-chunks",
                "24",
                "--chunk-bytes",
                "65536",
            ])
            .args(["--lease-ms", "800", "--quarantine-ms", "800", "--consume"])
            .args(["--metrics", &maddr.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn receiver"),
    );
    let out = receiver.0.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .expect("receiver announces itself");
    assert!(
        line.starts_with("kvferry receiver listening on"),
        "unexpected: {line}"
    );
    // The reader (and the pipe's read end) is gone now: the receiver's later
    // announcement lines meet EPIPE, which must not stop it (it once did,
    // `println!` panicking, and every scrape below then failed).
    let sender = |id: &str, requests: &str| {
        Command::new(bin())
            .args([
                "sender",
                "--connect",
                &endpoint,
                "--sender-id",
                id,
                "--requests",
                requests,
            ])
            .args([
                "--chunks",
                "4..12",
                "--chunk-bytes",
                "65536",
                "--staging-slots",
                "12",
            ])
            .args([
                "--capacity-chunks",
                "24",
                "--concurrency",
                "3",
                "--stall-timeout",
                "30",
                "-q",
                "--json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sender")
    };
    // The victim: far more work than it will get to do.
    let mut victim = Proc(sender("victim", "1000000"));
    // Freeze the victim, then look: killing it right after a scrape that saw
    // its requests tracked could land between two requests (nothing tracked,
    // so nothing for the lease to expire), or just before a TransferDone.
    // Frozen, what the receiver tracks for it can only end through the lease.
    let deadline = Instant::now() + Duration::from_secs(20);
    let victim_pid = victim.0.id() as i32;
    wait_until(deadline, "the victim to hold receiver capacity", || {
        // SAFETY: kill(2) of our own child process.
        unsafe { libc::kill(victim_pid, libc::SIGSTOP) };
        // Let messages it sent before it froze (a TransferDone) land first.
        std::thread::sleep(Duration::from_millis(100));
        let held = scrape(maddr)
            .and_then(|b| metric(&b, "kvferry_receiver_tracked_requests"))
            .is_some_and(|v| v > 0.0);
        if !held {
            // SAFETY: as above.
            unsafe { libc::kill(victim_pid, libc::SIGCONT) };
        }
        held
    });
    victim.0.kill().expect("SIGKILL the victim");
    let _ = victim.0.wait();
    // Another sender keeps completing while the dead one's leases run out.
    let survivor = sender("survivor", "150");
    let output = survivor.wait_with_output().expect("survivor runs");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "survivor failed: {report}");
    assert!(
        report.contains("\"completed\": 150"),
        "survivor report: {report}"
    );
    // Leases and quarantine return the receiver to zero.
    let deadline = Instant::now() + Duration::from_secs(20);
    wait_until(
        deadline,
        "receiver metrics to return to zero after the lease",
        || {
            scrape(maddr).is_some_and(|b| {
                metric(&b, "kvferry_receiver_reserved_chunks") == Some(0.0)
                    && metric(&b, "kvferry_receiver_allocated_chunks") == Some(0.0)
                    && metric(&b, "kvferry_receiver_tracked_requests") == Some(0.0)
            })
        },
    );
    let body = scrape(maddr).expect("metrics");
    assert!(
        body.contains("kvferry_receiver_requests_total{outcome=\"lease_expired\"}"),
        "the dead sender's requests expired by lease:\n{body}"
    );
    // SIGTERM, not the guard's SIGKILL: the receiver removes its shm file.
    sigterm(&receiver.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    wait_until(deadline, "the receiver to exit on SIGTERM", || {
        receiver.0.try_wait().ok().flatten().is_some()
    });
}

#[test]
#[ignore = "soak: set KVFERRY_SOAK_SECS (default 60) and run with --ignored"]
fn soak() {
    let secs: u64 = std::env::var("KVFERRY_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut round = 0u64;
    while Instant::now() < end {
        let cfg = RunConfig {
            abort_rate: 0.05,
            fail_rate: 0.02,
            seed: round,
            ..small(5_000)
        };
        let r = runner::run(cfg, Progress::Quiet).expect("run starts");
        assert!(r.success(), "soak round {round} failed:\n{}", r.render());
        round += 1;
    }
    eprintln!("soak: {round} rounds of 5,000 requests in {secs} s");
}

/// A receiver that says Hello but never answers an AllocRequest: nothing
/// can finish, and the watchdog must say so instead of hanging.
#[test]
fn watchdog_reports_a_stall_with_a_state_dump() {
    use kvferry::protocol::{decode, encode, Descriptor, HelloAck, Message, PROTOCOL_VERSION};
    use kvferry::region::{default_region_path, Region};
    let region = Region::create(&default_region_path(), 4096, 16).expect("region");
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).expect("socket");
    router.set_linger(0).expect("linger");
    router.bind("tcp://127.0.0.1:0").expect("bind");
    let endpoint = router.get_last_endpoint().expect("endpoint").expect("utf8");
    let stop = Arc::new(AtomicBool::new(false));
    let silent = {
        let stop = Arc::clone(&stop);
        let ack = Message::HelloAck(HelloAck {
            receiver_id: "silent".into(),
            version: PROTOCOL_VERSION,
            transport: "shm".into(),
            descriptor: Descriptor::Shm {
                path: region.path().to_string_lossy().into_owned(),
                len: region.data_len(),
            },
            chunk_bytes: 4096,
            capacity_chunks: 16,
            control: None,
        });
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if router.poll(zmq::POLLIN, 50).unwrap_or(0) == 0 {
                    continue;
                }
                let Ok(frames) = router.recv_multipart(0) else {
                    continue;
                };
                if let Some(Ok(Message::Hello(_))) = frames.last().map(|f| decode(f)) {
                    let reply = encode(&ack);
                    let _ = router.send_multipart([frames[0].as_slice(), &[], reply.as_slice()], 0);
                }
            }
        })
    };
    let cfg = RunConfig {
        prefillers: 1,
        stall_timeout_s: 1.0,
        ..small(4)
    };
    let r = runner::run_remote(
        cfg,
        vec![endpoint],
        None,
        "stalled",
        Progress::Quiet,
        |_, _| {},
    )
    .expect("run starts");
    stop.store(true, Ordering::Relaxed);
    let _ = silent.join();
    assert!(r.deadlock, "the watchdog fired: {}", r.render());
    assert!(!r.success());
    assert!(
        r.stall_dump.iter().any(|l| l.contains("awaiting reply 1")),
        "request state dumped: {:#?}",
        r.stall_dump
    );
    assert!(
        r.stall_dump.iter().any(|l| l.contains("kvf-send-ctrl")),
        "thread states dumped: {:#?}",
        r.stall_dump
    );
}
