//! The TCP data plane across two network namespaces (issue #8).
//!
//! Two namespaces joined by a veth pair (a private /30): `kvferry receiver
//! --tcp-data` runs in one (through `ip netns exec`), `kvferry sender
//! --transport tcp` in the other. The test checks the sender's JSON report
//! (every request completed, no failure, nothing leaked), that the payload
//! really crossed the veth (the receiver side's rx byte counter grew by at
//! least the payload bytes), and the bytes themselves: the receiver keeps
//! every chunk (no `--consume`, capacity above the chunks sent), and the test
//! reads its buffer file (`/dev/shm` is shared by the namespaces) and checks
//! each slot against the run's deterministic payloads. Then SIGTERM stops the
//! receiver, which must exit 0.
//!
//! Needs root and `ip netns`; where either is missing (or `ip netns add`
//! fails, e.g. EPERM in a container) the test prints `SKIP: <reason>` and
//! passes. The namespaces are deleted by a drop guard, also on failure.
#![cfg(not(feature = "shuttle-model"))]

#[path = "common/process.rs"]
mod process;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvferry::runner::payload::{ChunkId, Payloads, HEADER};
use process::{sigterm, wait_exit_within, ChildLines, KillOnDrop as Proc};

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");
/// Longest any single wait may take before the test is declared hung.
const HANG: Duration = Duration::from_secs(20);
const REQUESTS: u64 = 30;
const CHUNK_BYTES: u64 = 4096;
const CAPACITY: u64 = 128; // > REQUESTS * max chunks (4): no slot is reused
const SEED: u64 = 7;
/// Offset of slot 0 in the receiver's buffer file (`kvferry::region`).
const DATA_OFFSET: usize = 4096;

/// Runs `ip ARGS`; the error carries the command and its stderr.
fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces (and their veth pair) of one test; deleted on drop.
struct Namespaces {
    names: Vec<String>,
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // Deleting a namespace destroys the veth end inside it (and so the pair).
        for n in &self.names {
            if let Err(e) = ip(&["netns", "del", n]) {
                eprintln!("tcp_netns cleanup: {e}");
            }
        }
    }
}

/// A file removed when dropped (the receiver's buffer if it was killed).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// Waits for `child` to exit; fails naming `what` after [`HANG`].
fn wait_exit(child: &mut Child, what: &str) -> std::process::ExitStatus {
    wait_exit_within(child, what, HANG)
}

/// Bytes received so far on `dev` in namespace `ns`.
fn rx_bytes(ns: &str, dev: &str) -> u64 {
    let json = ip(&["-n", ns, "-s", "-j", "link", "show", "dev", dev]).expect("ip link stats");
    let v: serde_json::Value = serde_json::from_str(&json).expect("ip -j output is JSON");
    v[0]["stats64"]["rx"]["bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no stats64.rx.bytes in {json}"))
}

/// Sets up the two namespaces; `Err` is the reason to skip.
fn namespaces(a: &str, b: &str) -> Result<Namespaces, String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root (network namespaces need CAP_SYS_ADMIN)".into());
    }
    ip(&["-V"])?;
    ip(&["netns", "add", a])?;
    let mut guard = Namespaces {
        names: vec![a.to_owned()],
    };
    ip(&["netns", "add", b])?;
    guard.names.push(b.to_owned());
    Ok(guard)
}

#[test]
fn sender_and_receiver_in_two_namespaces_over_veth() {
    let pid = std::process::id();
    let (ns_a, ns_b) = (format!("kvf-a-{pid}"), format!("kvf-b-{pid}"));
    let (veth_a, veth_b) = (format!("kvfa{pid}"), format!("kvfb{pid}"));
    let x = pid % 250 + 1;
    let (ip_a, ip_b) = (format!("10.231.{x}.1"), format!("10.231.{x}.2"));
    let _guard = match namespaces(&ns_a, &ns_b) {
        Ok(g) => g,
        Err(reason) => {
            eprintln!("SKIP: {reason}");
            return;
        }
    };
    // The veth pair, one end in each namespace; addresses; links up.
    ip(&[
        "-n", &ns_a, "link", "add", &veth_a, "type", "veth", "peer", "name", &veth_b, "netns",
        &ns_b,
    ])
    .expect("veth pair");
    ip(&[
        "-n",
        &ns_a,
        "addr",
        "add",
        &format!("{ip_a}/30"),
        "dev",
        &veth_a,
    ])
    .expect("addr a");
    ip(&[
        "-n",
        &ns_b,
        "addr",
        "add",
        &format!("{ip_b}/30"),
        "dev",
        &veth_b,
    ])
    .expect("addr b");
    for (ns, dev) in [(&ns_a, &veth_a), (&ns_b, &veth_b)] {
        ip(&["-n", ns, "link", "set", "lo", "up"]).expect("lo up");
        ip(&["-n", ns, "link", "set", dev, "up"]).expect("veth up");
    }

    // The receiver in A: ctrl (ZMQ) and TCP data both on the veth address.
    let shm = PathBuf::from(format!("/dev/shm/kvferry-netns-test-{pid}.buf"));
    let _shm_guard = RemoveOnDrop(shm.clone());
    let mut receiver = Proc(
        Command::new("ip")
            .args(["netns", "exec", &ns_a, BIN, "receiver"])
            .args(["--listen", &format!("tcp://{ip_a}:0")])
            .args(["--tcp-data", &format!("{ip_a}:0")])
            .args(["--capacity-chunks", &CAPACITY.to_string()])
            .args(["--chunk-bytes", &CHUNK_BYTES.to_string()])
            .args(["--shm-path", &shm.to_string_lossy()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ip netns exec kvferry receiver"),
    );
    let lines = ChildLines::take(&mut receiver.0);
    let announced = lines.after_prefixes(
        &mut receiver.0,
        &[
            "kvferry receiver listening on ",
            "kvferry receiver tcp data on ",
        ],
    );
    let Some([endpoint, data]) = announced.map(|v| <[String; 2]>::try_from(v).unwrap()) else {
        let st = wait_exit(&mut receiver.0, "the receiver (stdout closed)");
        panic!(
            "receiver exited before announcing ({st}): {}",
            stderr_of(&mut receiver.0)
        );
    };
    assert!(
        data.starts_with(&format!("{ip_a}:")),
        "tcp data listener on the veth address: {data}"
    );

    // The sender in B.
    let rx_before = rx_bytes(&ns_a, &veth_a);
    let mut sender = Proc(
        Command::new("ip")
            .args(["netns", "exec", &ns_b, BIN, "sender"])
            .args(["--connect", &endpoint, "--transport", "tcp"])
            .args(["--requests", &REQUESTS.to_string(), "--chunks", "1..4"])
            .args(["--chunk-bytes", &CHUNK_BYTES.to_string()])
            .args(["--capacity-chunks", &CAPACITY.to_string()])
            .args(["--staging-slots", "8", "--seed", &SEED.to_string()])
            .args(["--stall-timeout", "10", "-q", "--json"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ip netns exec kvferry sender"),
    );
    let out = ChildLines::take(&mut sender.0);
    let report = out.rest(&mut sender.0, "the sender").join("\n");
    let st = wait_exit(&mut sender.0, "the sender");
    let err = stderr_of(&mut sender.0);
    assert!(
        st.success(),
        "sender failed ({st}): {report}\nstderr: {err}"
    );
    let r: serde_json::Value = serde_json::from_str(&report)
        .unwrap_or_else(|e| panic!("sender --json report ({e}): {report}"));
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {report}"));
    assert_eq!(n("completed"), REQUESTS, "{report}");
    for k in [
        "aborted",
        "failed",
        "unexpected_failures",
        "checksum_mismatches",
        "leaked_staging_slots",
        "leaked_receiver_slots",
        "leaked_reservations",
    ] {
        assert_eq!(n(k), 0, "{k}: {report}");
    }
    assert_eq!(r["deadlock"], false, "{report}");
    assert_eq!(r["config"]["transport"], "tcp", "{report}");
    let payload = n("bytes");

    // The bytes crossed the veth (shm would not touch it).
    let rx_grew = rx_bytes(&ns_a, &veth_a) - rx_before;
    assert!(
        rx_grew >= payload,
        "{ns_a}/{veth_a} received {rx_grew} bytes, less than the {payload} payload bytes"
    );

    // And they landed intact: every used slot holds one chunk of the run.
    let buf = std::fs::read(&shm).unwrap_or_else(|e| panic!("read {}: {e}", shm.display()));
    assert!(buf.len() >= DATA_OFFSET + (CAPACITY * CHUNK_BYTES) as usize);
    let mut chunks: BTreeMap<u64, BTreeMap<u32, &[u8]>> = BTreeMap::new();
    for s in buf[DATA_OFFSET..]
        .chunks_exact(CHUNK_BYTES as usize)
        .take(CAPACITY as usize)
        .filter(|s| s.iter().any(|&b| b != 0))
    {
        let request = u64::from_le_bytes(s[0..8].try_into().unwrap());
        let index = u32::try_from(u64::from_le_bytes(s[8..16].try_into().unwrap()))
            .expect("chunk index fits u32");
        let dup = chunks.entry(request).or_default().insert(index, s);
        assert!(dup.is_none(), "chunk {request}/{index} in two slots");
    }
    let keys: Vec<u64> = chunks.keys().copied().collect();
    assert_eq!(
        keys,
        (0..REQUESTS).collect::<Vec<_>>(),
        "one set of chunks per request"
    );
    let payloads = Payloads::new(CHUNK_BYTES as usize, SEED);
    let mut verified = 0u64;
    let mut nchunks = 0;
    for (request, by_index) in &chunks {
        let total = by_index.len() as u32;
        for (&index, bytes) in by_index {
            let id = ChunkId {
                request: *request,
                index,
                total,
            };
            assert!(
                index < total,
                "chunk indices of request {request} are 0..{total}"
            );
            assert!(payloads.verify(id, bytes), "chunk {id:?} does not verify");
            verified += payloads.len_of(id) as u64;
            nchunks += 1;
        }
    }
    assert!(verified >= HEADER as u64);
    assert_eq!(
        verified, payload,
        "verified bytes == the sender's payload bytes"
    );

    // SIGTERM: a clean exit that removes the buffer file. `ip netns exec`
    // execs the receiver, so the child's pid is the receiver's.
    assert!(sigterm(&receiver.0), "kill(SIGTERM)");
    let st = wait_exit(&mut receiver.0, "the receiver after SIGTERM");
    let err = stderr_of(&mut receiver.0);
    assert_eq!(st.code(), Some(0), "receiver exit {st}; stderr: {err}");
    assert!(!shm.exists(), "{} removed on exit", shm.display());
    eprintln!(
        "tcp_netns: {REQUESTS} requests, {nchunks} chunks, {payload} payload bytes verified, \
         sent from {ns_b} ({ip_b}) to {ns_a} ({data}) over veth ({rx_grew} bytes received on {veth_a})"
    );
}
