//! Black-box tests of the `/metrics` HTTP endpoint over raw TCP sockets.
//! Every wait has a deadline; hitting one fails with what hung.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kvferry::metrics::{write_stats, MetricsServer, MetricsServerConfig, MetricsWriter};
use kvferry::stats::{Counter, SharedStats, Stage};
use rand::{Rng, SeedableRng};

const DEADLINE: Duration = Duration::from_secs(10);

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn fixed_body() -> String {
    "# HELP kvferry_test_up Up.\n# TYPE kvferry_test_up gauge\nkvferry_test_up 1\n".to_owned()
}

fn start(config: MetricsServerConfig) -> MetricsServer {
    MetricsServer::start_with(localhost(), config, fixed_body).unwrap()
}

struct Response {
    status_line: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Read until the server closes the connection (it always sends
/// `Connection: close`), failing if that takes longer than DEADLINE.
fn read_until_close(stream: &mut TcpStream, what: &str) -> Vec<u8> {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .unwrap_or_else(|| {
                panic!("{what}: server did not close the connection within {DEADLINE:?}")
            });
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("{what}: no response / no close within {DEADLINE:?}")
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return out,
            Err(e) => panic!("{what}: read error {e}"),
        }
    }
}

fn parse_response(raw: &[u8], what: &str) -> Response {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| {
            panic!(
                "{what}: no complete response head in {:?}",
                String::from_utf8_lossy(raw)
            )
        });
    let head = std::str::from_utf8(&raw[..end]).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap().to_owned();
    let headers = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect();
    Response {
        status_line,
        headers,
        body: raw[end + 4..].to_vec(),
    }
}

fn request(addr: SocketAddr, raw: &[u8]) -> Response {
    let what = format!(
        "request {:?}",
        String::from_utf8_lossy(&raw[..raw.len().min(40)])
    );
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_write_timeout(Some(DEADLINE)).unwrap();
    s.write_all(raw).unwrap();
    let raw = read_until_close(&mut s, &what);
    parse_response(&raw, &what)
}

#[test]
fn get_metrics_serves_the_rendered_text() {
    let stats = SharedStats::new();
    stats.add(Counter::Chunks, 12);
    stats.record(Stage::Transfer, Duration::from_micros(80));
    let render_stats = stats.clone();
    let server = MetricsServer::start(localhost(), move || {
        let mut w = MetricsWriter::new();
        write_stats(&mut w, "sender", &render_stats);
        w.finish()
    })
    .unwrap();
    assert_ne!(server.local_addr().port(), 0);
    let r = request(
        server.local_addr(),
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n",
    );
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    assert!(
        r.header("Content-Type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{:?}",
        r.headers
    );
    assert_eq!(r.header("Connection"), Some("close"));
    assert_eq!(
        r.header("Content-Length").unwrap(),
        r.body.len().to_string()
    );
    let body = String::from_utf8(r.body).unwrap();
    assert!(
        body.contains("\nkvferry_sender_chunks_total 12\n"),
        "{body}"
    );
    assert!(body.contains(
        "kvferry_sender_stage_duration_microseconds_bucket{stage=\"transfer\",le=\"100\"} 1\n"
    ));
    // The closure is called per scrape: a new value shows up.
    stats.add(Counter::Chunks, 1);
    let r = request(server.local_addr(), b"GET /metrics?x=1 HTTP/1.1\r\n\r\n");
    assert!(String::from_utf8(r.body)
        .unwrap()
        .contains("\nkvferry_sender_chunks_total 13\n"));
    server.shutdown();
}

#[test]
fn http_1_0_and_head() {
    let server = start(MetricsServerConfig::default());
    let r = request(server.local_addr(), b"GET /metrics HTTP/1.0\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.0 200 OK");
    assert_eq!(r.body, fixed_body().as_bytes());
    // Bare-LF line endings are tolerated.
    let r = request(server.local_addr(), b"GET /metrics HTTP/1.1\nHost: x\n\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    let r = request(server.local_addr(), b"HEAD /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    assert_eq!(
        r.header("Content-Length").unwrap(),
        fixed_body().len().to_string()
    );
    assert!(r.body.is_empty());
}

#[test]
fn not_found_method_not_allowed_bad_request() {
    let server = start(MetricsServerConfig::default());
    let addr = server.local_addr();
    for path in ["/", "/metricsx", "/metrics/", "*"] {
        let r = request(addr, format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes());
        assert_eq!(r.status_line, "HTTP/1.1 404 Not Found", "{path}");
    }
    for method in ["POST", "PUT", "DELETE", "OPTIONS"] {
        let r = request(
            addr,
            format!("{method} /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").as_bytes(),
        );
        assert_eq!(r.status_line, "HTTP/1.1 405 Method Not Allowed", "{method}");
        assert_eq!(r.header("Allow"), Some("GET, HEAD"));
    }
    let garbage: &[&[u8]] = &[
        b"hello\r\n\r\n",
        b"GET /metrics\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nbad header line\r\n\r\n",
        b"\x00\x01\x02\xff\r\n\r\n",
    ];
    for g in garbage {
        let r = request(addr, g);
        assert_eq!(
            r.status_line,
            "HTTP/1.1 400 Bad Request",
            "{:?}",
            String::from_utf8_lossy(g)
        );
        assert_eq!(r.header("Connection"), Some("close"));
    }
    let r = request(addr, b"GET /metrics HTTP/2.0\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 505 HTTP Version Not Supported");
    // A head cut short by the client closing its side.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metr").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let r = parse_response(
        &read_until_close(&mut s, "truncated head"),
        "truncated head",
    );
    assert_eq!(r.status_line, "HTTP/1.1 400 Bad Request");
}

#[test]
fn oversized_head_gets_431_and_the_connection_closes() {
    let server = start(MetricsServerConfig::default());
    let mut raw = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
    raw.extend_from_slice(&[b'a'; 16 * 1024]);
    raw.extend_from_slice(b"\r\n\r\n");
    let r = request(server.local_addr(), &raw); // reads until the server closes
    assert!(
        r.status_line == "HTTP/1.1 431 Request Header Fields Too Large"
            || r.status_line == "HTTP/1.1 400 Bad Request",
        "{}",
        r.status_line
    );
}

#[test]
fn slow_client_gets_408() {
    let server = start(MetricsServerConfig {
        head_timeout: Duration::from_millis(200),
        ..Default::default()
    });
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.write_all(b"GET /metr").unwrap(); // and then nothing
    let r = parse_response(&read_until_close(&mut s, "slow client"), "slow client");
    assert_eq!(r.status_line, "HTTP/1.1 408 Request Timeout");
}

/// An idle client must not delay another one: with a 30 s head timeout, a
/// server that served connections one at a time would answer the second
/// client only after DEADLINE (10 s) and the test would fail.
#[test]
fn idle_client_does_not_block_others() {
    let server = start(MetricsServerConfig {
        head_timeout: Duration::from_secs(30),
        ..Default::default()
    });
    let mut idle = TcpStream::connect(server.local_addr()).unwrap();
    let r = request(server.local_addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    // The idle connection is still open and unanswered.
    idle.set_nonblocking(true).unwrap();
    let mut b = [0u8; 16];
    match idle.read(&mut b) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("idle connection was answered or closed early: {other:?}"),
    }
    // Connecting and leaving without a byte is handled quietly.
    drop(idle);
    let r = request(server.local_addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
}

/// At the cap, a new scrape displaces the oldest connection still sending
/// its head (a slow-loris client), which is dropped unanswered.
#[test]
fn at_the_cap_a_scrape_displaces_the_oldest_slow_client() {
    let server = start(MetricsServerConfig {
        head_timeout: Duration::from_secs(30),
        max_connections: 1,
        ..Default::default()
    });
    let addr = server.local_addr();
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.write_all(b"GET /metr").unwrap();
    // Let the server take the slow connection first (bounded wait for the
    // first byte of an answer that must not come).
    slow.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut b = [0u8; 16];
    assert!(
        matches!(slow.read(&mut b), Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut))
    );
    let r = request(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    assert!(
        read_until_close(&mut slow, "displaced slow client").is_empty(),
        "the displaced client gets no answer"
    );
}

/// Only when every held connection is being answered (here: a client that
/// does not read a large response) does a new one get 503, and the slot
/// comes back once that client's deadline passed.
#[test]
fn connection_cap_answers_503_only_while_all_are_being_answered() {
    let big = "x".repeat(16 << 20);
    let server = MetricsServer::start_with(
        localhost(),
        MetricsServerConfig {
            head_timeout: Duration::from_millis(500),
            max_connections: 1,
            ..Default::default()
        },
        move || big.clone(),
    )
    .unwrap();
    let addr = server.local_addr();
    let mut stuck = TcpStream::connect(addr).unwrap();
    stuck.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    // Its response (16 MiB, never read) fills the socket buffers: the
    // server is busy answering it until its 500 ms deadline.
    std::thread::sleep(Duration::from_millis(100));
    let r = request(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 503 Service Unavailable");
    let deadline = Instant::now() + DEADLINE;
    loop {
        let r = request(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        if r.status_line == "HTTP/1.1 200 OK" {
            break;
        }
        assert_eq!(r.status_line, "HTTP/1.1 503 Service Unavailable");
        assert!(
            Instant::now() < deadline,
            "the stuck client's connection was never dropped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(stuck);
}

/// Slow-loris: more trickling clients than the cap, while scrapes run.
/// Every scrape succeeds, and the server never runs more than its one
/// thread (it used to spawn one per connection).
#[test]
fn slow_loris_clients_never_starve_scrapes_or_grow_threads() {
    let server = MetricsServer::start_with(
        localhost(),
        MetricsServerConfig {
            head_timeout: Duration::from_secs(30),
            max_connections: 8,
            thread_name: "kvf-test-mloris".into(),
            ..Default::default()
        },
        fixed_body,
    )
    .unwrap();
    let addr = server.local_addr();
    let mut loris: Vec<TcpStream> = Vec::new();
    let threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|n| n.starts_with("kvf-test-mloris") || n.starts_with("kvferry-metrics-c"))
            .count()
    };
    for round in 0..50 {
        // Two more slow clients each round, each sending one more byte.
        for _ in 0..2 {
            if let Ok(s) = TcpStream::connect(addr) {
                loris.push(s);
            }
        }
        for s in &mut loris {
            let _ = s.write(b"G");
        }
        let r = request(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert_eq!(r.status_line, "HTTP/1.1 200 OK", "scrape {round}");
        assert_eq!(threads(), 1, "round {round}: one server thread");
    }
}

#[test]
fn panicking_render_gives_500_and_server_survives() {
    let first = Arc::new(AtomicBool::new(true));
    let f = first.clone();
    let server = MetricsServer::start(localhost(), move || {
        // SeqCst: test flag, no pairing concerns.
        if f.swap(false, Ordering::SeqCst) {
            panic!("render failure injected by the test");
        }
        fixed_body()
    })
    .unwrap();
    let r = request(server.local_addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 500 Internal Server Error");
    let r = request(server.local_addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
}

/// Random bytes never crash the server; every connection is answered or
/// closed, and the server keeps serving.
#[test]
fn random_garbage_never_kills_the_server() {
    let server = start(MetricsServerConfig {
        head_timeout: Duration::from_millis(500),
        ..Default::default()
    });
    let addr = server.local_addr();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x006b_7666_6572_7279);
    let alphabet: &[u8] = b"GETPOSHAD /metrics?HTTP/1.0\r\n\r\n:\x00\xff\t ";
    for i in 0..150 {
        let len = rng.random_range(0..200);
        let raw: Vec<u8> = (0..len)
            .map(|_| {
                if rng.random_bool(0.8) {
                    alphabet[rng.random_range(0..alphabet.len())]
                } else {
                    rng.random()
                }
            })
            .collect();
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&raw).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let out = read_until_close(&mut s, &format!("garbage #{i}"));
        assert!(
            out.is_empty() || out.starts_with(b"HTTP/1."),
            "garbage #{i}: odd reply {:?}",
            String::from_utf8_lossy(&out)
        );
    }
    let r = request(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
}

fn assert_finishes_within(what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    rx.recv_timeout(DEADLINE)
        .unwrap_or_else(|_| panic!("{what} did not finish within {DEADLINE:?}"));
}

#[test]
fn shutdown_joins_promptly_even_with_an_idle_client() {
    let server = start(MetricsServerConfig {
        head_timeout: Duration::from_secs(30),
        ..Default::default()
    });
    let addr = server.local_addr();
    let _idle = TcpStream::connect(addr).unwrap();
    assert_eq!(
        request(addr, b"GET /metrics HTTP/1.1\r\n\r\n").status_line,
        "HTTP/1.1 200 OK"
    );
    assert_finishes_within("MetricsServer::shutdown", move || server.shutdown());
    let e = TcpStream::connect(addr).expect_err("listener still open after shutdown");
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
}

#[test]
fn drop_stops_the_server() {
    let server = start(MetricsServerConfig::default());
    let addr = server.local_addr();
    assert_finishes_within("dropping MetricsServer", move || drop(server));
    let e = TcpStream::connect(addr).expect_err("listener still open after drop");
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
}

#[test]
fn bind_error_names_the_address() {
    let taken = TcpListener::bind(localhost()).unwrap();
    let addr = taken.local_addr().unwrap();
    let e = MetricsServer::start(addr, String::new).expect_err("bind on a taken port succeeded");
    assert_eq!(e.kind(), ErrorKind::AddrInUse);
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
}

#[test]
fn many_sequential_scrapes() {
    let server = start(MetricsServerConfig {
        max_connections: 2,
        ..Default::default()
    });
    for i in 0..100 {
        let r = request(server.local_addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
        assert_eq!(r.status_line, "HTTP/1.1 200 OK", "scrape {i}");
    }
    let deadline = Instant::now() + DEADLINE;
    while request(server.local_addr(), b"GET /metrics HTTP/1.1\r\n\r\n").status_line
        != "HTTP/1.1 200 OK"
    {
        assert!(
            Instant::now() < deadline,
            "slots leaked: still 503 after {DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
