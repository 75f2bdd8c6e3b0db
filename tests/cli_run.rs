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
