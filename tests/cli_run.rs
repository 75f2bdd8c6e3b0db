//! The `kvferry run` and `kvferry proxy` commands as a user runs them.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvferry")
}

/// Runs `kvferry` with `args`, failing the test if it takes longer than
/// `limit`.
fn run(args: &[&str], limit: Duration) -> std::process::Output {
    let mut child = Command::new(bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvferry");
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "kvferry {args:?} did not finish within {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn run_prints_a_json_report_with_the_documented_fields() {
    let out = run(
        &[
            "run",
            "--requests",
            "60",
            "--chunks",
            "1..6",
            "--chunk-bytes",
            "4096",
            "--json",
            "-q",
        ],
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    for field in [
        "completed",
        "aborted",
        "failed",
        "bytes",
        "gbps",
        "chunks_per_s",
        "latency_us",
        "max_concurrent_admitted",
        "leaked_staging_slots",
        "leaked_receiver_slots",
        "leaked_reservations",
        "checksum_mismatches",
        "elapsed_s",
        "deadlock",
    ] {
        assert!(v.get(field).is_some(), "report lacks {field}: {v}");
    }
    assert_eq!(v["completed"], 60);
    assert_eq!(v["deadlock"], false);
    assert_eq!(v["result"], "OK", "the table's verdict");
    assert_eq!(
        v["sender_path"], "in-place",
        "the zero-copy path is the default"
    );
    assert_eq!(v["sender_copies_per_chunk"], 0);
    for stage in [
        "pending",
        "admission_wait",
        "staging_wait",
        "transfer",
        "notify",
    ] {
        let s = &v["latency_us"][stage];
        assert!(
            s["p50"].is_u64() && s["p99"].is_u64() && s["max"].is_u64(),
            "stage {stage}: {s}"
        );
    }
}

#[test]
fn copy_store_selects_the_copying_path_and_says_so() {
    let out = run(
        &[
            "run",
            "--requests",
            "40",
            "--chunks",
            "1..6",
            "--chunk-bytes",
            "4096",
            "--copy-store",
            "--json",
            "-q",
        ],
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(v["completed"], 40);
    assert_eq!(v["sender_path"], "copying-store");
    assert_eq!(v["sender_copies_per_chunk"], 1);
    assert_eq!(v["config"]["copy_store"], true);
}

#[test]
fn run_table_report_and_config_file() {
    let path = std::env::temp_dir().join(format!("kvferry-run-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "requests = 30\nchunk_bytes = 4096\nchunks = \"2..5\"\nabort_rate = 0.2\n",
    )
    .expect("write config");
    let out = run(
        &[
            "run",
            "--config",
            path.to_str().expect("utf8 path"),
            "--seed",
            "3",
            "-q",
        ],
        Duration::from_secs(60),
    );
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "report:\n{text}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("30 requests of 2..5 chunks"),
        "config file applied:\n{text}"
    );
    assert!(
        text.contains("leak check") && text.contains("result       OK"),
        "table:\n{text}"
    );
}

#[test]
fn bad_options_exit_2_with_a_message() {
    for (args, needle) in [
        (vec!["run", "--batch", "0"], "--batch"),
        (vec!["run", "--chunks", "9..3"], "chunk range"),
        (vec!["run", "--abort-rate", "1.5"], "--abort-rate"),
        (vec!["run", "--chunk-bytes", "8"], "--chunk-bytes"),
        (vec!["run", "--chunk-bytes", "4294967296"], "--chunk-bytes"),
        (vec!["run", "--transport", "udp"], "--transport"),
        (
            vec!["run", "--transport", "rdma", "--requests", "1"],
            "rdma",
        ),
        (
            vec!["run", "--config", "/nonexistent/kvferry.toml"],
            "cannot read",
        ),
        (vec!["sender", "--requests", "1"], "--connect"),
    ] {
        let out = run(&args, Duration::from_secs(30));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?} should exit 2; stderr: {err}"
        );
        assert!(
            err.contains(needle),
            "{args:?}: stderr should mention {needle:?}: {err}"
        );
    }
}

#[test]
fn proxy_counts_ready_requests_and_reports_as_json() {
    let mut child = Command::new(bin())
        .args([
            "proxy",
            "--listen",
            "tcp://127.0.0.1:0",
            "--expect",
            "2",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn proxy");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("announcement").expect("utf8");
    let endpoint = first
        .strip_prefix("kvferry proxy listening on ")
        .expect("announcement line")
        .to_owned();
    let ctx = zmq::Context::new();
    let push = ctx.socket(zmq::PUSH).expect("socket");
    push.connect(&endpoint).expect("connect");
    for req in ["a", "a", "b"] {
        let frame = kvferry::protocol::encode(&kvferry::protocol::Message::ProxyNotif(
            kvferry::protocol::ProxyNotif { req_id: req.into() },
        ));
        push.send(&frame, 0).expect("send");
    }
    push.send(&b"junk"[..], 0).expect("send junk");
    // The proxy counts asynchronously: give it a bounded moment.
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: plain kill(2) of our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let rest: String = lines.map_while(Result::ok).collect::<Vec<_>>().join("\n");
    let status = child.wait().expect("proxy exits");
    assert!(status.success());
    let v: serde_json::Value = serde_json::from_str(&rest).expect("JSON report");
    assert_eq!(v["notifications"], 3, "{v}");
    assert_eq!(
        v["requests_ready"], 1,
        "only a got both expected notifications: {v}"
    );
    assert_eq!(v["malformed_frames"], 1, "{v}");
}

/// Issue 12, part 3: `kvferry sender` facing a receiver that does not
/// answer `Hello` (an in-process kvferry receiver emulating LMCache's).
/// Without a static buffer every request fails with a message saying what
/// is missing; with `--static-buffer ENDPOINT=PATH` (the receiver's buffer
/// file) the run completes, in LMCache mode (no TransferDone, so the
/// receiver's `--consume` grace releases the chunks).
#[test]
fn sender_addresses_a_receiver_without_hello_through_a_static_buffer() {
    let receiver = kvferry::receiver::Receiver::start(kvferry::receiver::ReceiverConfig {
        listen: "tcp://127.0.0.1:0".into(),
        capacity_chunks: 16,
        chunk_bytes: 4096,
        answer_hello: false,
        auto_consume: true,
        consume_grace: Duration::from_millis(20),
        ..Default::default()
    })
    .expect("receiver starts");
    let ep = receiver.endpoint().to_owned();
    let load = [
        "--requests",
        "12",
        "--chunks",
        "1..6",
        "--batch",
        "2",
        "--chunk-bytes",
        "4096",
        "--capacity-chunks",
        "16",
        "--json",
        "--quiet",
    ];
    let mut args = vec!["sender", "--connect", &ep];
    args.extend(load);
    let out = run(&args, Duration::from_secs(60));
    assert!(!out.status.success(), "no static buffer: the run fails");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        all.contains("did not answer Hello") && all.contains("--static-buffer"),
        "the failure says what is missing:\n{all}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("a JSON report ({e}):\n{all}"));
    assert_eq!(v["result"], "FAILED", "the verdict of a failed run");

    let spec = format!("{ep}={}", receiver.shm_path().display());
    let mut args = vec!["sender", "--connect", &ep, "--static-buffer", &spec];
    args.extend(load);
    let out = run(&args, Duration::from_secs(60));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "JSON report ({e}); stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(out.status.success(), "{v}");
    assert_eq!(v["completed"], 12, "{v}");
    let st = receiver.stats();
    assert_eq!(
        st.core.requests_total.get("completed").copied(),
        Some(12),
        "{st:?}"
    );

    // A path that is no kvferry buffer file is refused up front (exit 2).
    let bad = format!("{ep}=/nonexistent/kvferry.buf");
    let mut args = vec!["sender", "--connect", &ep, "--static-buffer", &bad];
    args.extend(load);
    let out = run(&args, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NIXL"), "{err}");
}
