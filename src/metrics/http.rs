//! Minimal HTTP/1.x request-head reading and parsing for the metrics
//! endpoint. Everything here treats the peer as hostile: sizes and time are
//! capped, and no input makes it panic.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

/// Why a request head could not be read or parsed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub(crate) enum RequestError {
    /// The peer closed the connection without sending anything.
    #[error("connection closed before any request byte")]
    Empty,
    /// The peer closed the connection in the middle of the head.
    #[error("connection closed in the middle of the request head")]
    Truncated,
    /// No complete head within the size cap.
    #[error("request head exceeds {limit} bytes")]
    HeadTooLarge {
        /// The cap in bytes.
        limit: usize,
    },
    /// No complete head within the time cap.
    #[error("timed out reading the request head")]
    Timeout,
    /// The request line is not `METHOD SP target SP HTTP/x.y`.
    #[error("malformed request line")]
    BadRequestLine,
    /// A header line is not `name: value`.
    #[error("malformed header line")]
    BadHeader,
    /// `HTTP/x.y` other than 1.0 or 1.1.
    #[error("unsupported HTTP version")]
    BadVersion,
    /// A socket error while reading.
    #[error("socket error while reading: {0:?}")]
    Io(io::ErrorKind),
}

/// HTTP version of a parsed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    Http10,
    Http11,
}

impl Version {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Version::Http10 => "HTTP/1.0",
            Version::Http11 => "HTTP/1.1",
        }
    }
}

/// A parsed request line (headers are validated, not kept).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RequestHead<'a> {
    pub(crate) method: &'a str,
    pub(crate) target: &'a str,
    pub(crate) version: Version,
}

/// Response status codes the endpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Ok,
    BadRequest,
    NotFound,
    MethodNotAllowed,
    RequestTimeout,
    HeaderTooLarge,
    InternalError,
    Unavailable,
    VersionNotSupported,
}

impl Status {
    pub(crate) fn line(self) -> &'static str {
        match self {
            Status::Ok => "200 OK",
            Status::BadRequest => "400 Bad Request",
            Status::NotFound => "404 Not Found",
            Status::MethodNotAllowed => "405 Method Not Allowed",
            Status::RequestTimeout => "408 Request Timeout",
            Status::HeaderTooLarge => "431 Request Header Fields Too Large",
            Status::InternalError => "500 Internal Server Error",
            Status::Unavailable => "503 Service Unavailable",
            Status::VersionNotSupported => "505 HTTP Version Not Supported",
        }
    }
}

impl RequestError {
    /// The status to answer with, or `None` if there is nobody to answer.
    pub(crate) fn status(&self) -> Option<Status> {
        match self {
            RequestError::Empty | RequestError::Io(_) => None,
            RequestError::Truncated | RequestError::BadRequestLine | RequestError::BadHeader => {
                Some(Status::BadRequest)
            }
            RequestError::HeadTooLarge { .. } => Some(Status::HeaderTooLarge),
            RequestError::Timeout => Some(Status::RequestTimeout),
            RequestError::BadVersion => Some(Status::VersionNotSupported),
        }
    }
}

/// Offset just past the blank line that ends the head (`\r\n\r\n`, or a
/// bare `\n\n` from lenient clients), if present.
pub(crate) fn find_head_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < buf.len() {
        if buf[i] == b'\n' {
            match buf.get(i + 1) {
                Some(b'\n') => return Some(i + 2),
                Some(b'\r') if buf.get(i + 2) == Some(&b'\n') => return Some(i + 3),
                _ => {}
            }
        }
        i += 1;
    }
    None
}

/// Read bytes until the head is complete, at most `limit` bytes and at most
/// `timeout` in total (so a client trickling one byte at a time is cut off
/// too). Returns the buffer and the head length.
pub(crate) fn read_head(
    stream: &mut TcpStream,
    limit: usize,
    timeout: Duration,
) -> Result<(Vec<u8>, usize), RequestError> {
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; limit];
    let mut len = 0;
    loop {
        if let Some(end) = find_head_end(&buf[..len]) {
            return Ok((buf, end));
        }
        if len >= limit {
            return Err(RequestError::HeadTooLarge { limit });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(RequestError::Timeout);
        }
        stream
            .set_read_timeout(Some(deadline - now))
            .map_err(|e| RequestError::Io(e.kind()))?;
        match stream.read(&mut buf[len..]) {
            Ok(0) if len == 0 => return Err(RequestError::Empty),
            Ok(0) => return Err(RequestError::Truncated),
            Ok(n) => len += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(RequestError::Timeout)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RequestError::Io(e.kind())),
        }
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Parse and validate a complete head (as delimited by [`find_head_end`]).
pub(crate) fn parse_head(head: &[u8]) -> Result<RequestHead<'_>, RequestError> {
    let mut lines = head
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let request_line = lines.next().ok_or(RequestError::BadRequestLine)?;
    let request_line =
        std::str::from_utf8(request_line).map_err(|_| RequestError::BadRequestLine)?;
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(RequestError::BadRequestLine);
    };
    if method.is_empty() || !method.bytes().all(is_tchar) {
        return Err(RequestError::BadRequestLine);
    }
    if target.is_empty() || !target.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(RequestError::BadRequestLine);
    }
    let version = match version {
        "HTTP/1.0" => Version::Http10,
        "HTTP/1.1" => Version::Http11,
        v if v.starts_with("HTTP/") => return Err(RequestError::BadVersion),
        _ => return Err(RequestError::BadRequestLine),
    };
    for line in lines {
        if line.is_empty() {
            break; // the blank line that ends the head
        }
        let colon = line
            .iter()
            .position(|&b| b == b':')
            .ok_or(RequestError::BadHeader)?;
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            return Err(RequestError::BadHeader);
        }
        if value.iter().any(|&b| b == 0 || b == b'\r') {
            return Err(RequestError::BadHeader);
        }
    }
    Ok(RequestHead {
        method,
        target,
        version,
    })
}

/// Write a complete `Connection: close` response. `body` is omitted (but
/// its length still announced) when `with_body` is false (HEAD).
pub(crate) fn write_response(
    stream: &mut TcpStream,
    version: Version,
    status: Status,
    content_type: &str,
    extra_headers: &str,
    body: &[u8],
    with_body: bool,
) -> io::Result<()> {
    let head = format!(
        "{} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n{extra_headers}\r\n",
        version.as_str(),
        status.line(),
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    if with_body {
        stream.write_all(body)?;
    }
    stream.flush()
}

/// Half-close our side and discard what the client still sends (bounded by
/// `max_bytes` and `timeout`), so closing does not reset the connection
/// before the client has read the response.
pub(crate) fn close_gracefully(stream: &mut TcpStream, max_bytes: usize, timeout: Duration) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = Instant::now() + timeout;
    let mut scratch = [0u8; 1024];
    let mut drained = 0;
    while drained < max_bytes {
        let now = Instant::now();
        if now >= deadline || stream.set_read_timeout(Some(deadline - now)).is_err() {
            break;
        }
        match stream.read(&mut scratch) {
            Ok(0) => break,
            Ok(n) => drained += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_end_detection() {
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\n"), Some(18));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\n\nrest"), Some(16));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
        assert_eq!(find_head_end(b""), None);
        assert_eq!(find_head_end(b"\n"), None);
        assert_eq!(find_head_end(b"\n\r"), None);
    }

    #[test]
    fn parses_valid_requests() {
        let h = parse_head(b"GET /metrics HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n").unwrap();
        assert_eq!(
            h,
            RequestHead {
                method: "GET",
                target: "/metrics",
                version: Version::Http11
            }
        );
        let h = parse_head(b"HEAD /x?y=1 HTTP/1.0\n\n").unwrap();
        assert_eq!(
            (h.method, h.target, h.version),
            ("HEAD", "/x?y=1", Version::Http10)
        );
        // Header values may hold non-UTF-8 bytes (obs-text).
        assert!(parse_head(b"GET / HTTP/1.1\r\nX: \xff\xfe\r\n\r\n").is_ok());
    }

    #[test]
    fn rejects_garbage() {
        use RequestError::*;
        let cases: &[(&[u8], RequestError)] = &[
            (b"\r\n\r\n", BadRequestLine),
            (b"GET /metrics\r\n\r\n", BadRequestLine),
            (b"GET  /metrics HTTP/1.1\r\n\r\n", BadRequestLine),
            (b"GET /metrics HTTP/1.1 extra\r\n\r\n", BadRequestLine),
            (b"G(T /metrics HTTP/1.1\r\n\r\n", BadRequestLine),
            (b"GET /m\x01 HTTP/1.1\r\n\r\n", BadRequestLine),
            (b"\xff\xfe\xfd /x HTTP/1.1\r\n\r\n", BadRequestLine),
            (b"GET /metrics FOO/1.1\r\n\r\n", BadRequestLine),
            (b"GET /metrics HTTP/2.0\r\n\r\n", BadVersion),
            (b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n", BadHeader),
            (b"GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n", BadHeader),
            (b"GET /metrics HTTP/1.1\r\n folded: x\r\n\r\n", BadHeader),
            (b"GET /metrics HTTP/1.1\r\nX: a\0b\r\n\r\n", BadHeader),
            (b"GET /metrics HTTP/1.1\r\nX: a\rb\r\n\r\n", BadHeader),
        ];
        for (input, want) in cases {
            assert_eq!(
                parse_head(input).as_ref().map_err(Clone::clone).err(),
                Some(want.clone()),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn error_statuses() {
        use RequestError::*;
        assert_eq!(Empty.status(), None);
        assert_eq!(Io(io::ErrorKind::ConnectionReset).status(), None);
        assert_eq!(Truncated.status(), Some(Status::BadRequest));
        assert_eq!(BadRequestLine.status(), Some(Status::BadRequest));
        assert_eq!(BadHeader.status(), Some(Status::BadRequest));
        assert_eq!(
            HeadTooLarge { limit: 1 }.status(),
            Some(Status::HeaderTooLarge)
        );
        assert_eq!(Timeout.status(), Some(Status::RequestTimeout));
        assert_eq!(BadVersion.status(), Some(Status::VersionNotSupported));
        assert!(HeadTooLarge { limit: 8192 }.to_string().contains("8192"));
        for s in [
            Status::Ok,
            Status::BadRequest,
            Status::NotFound,
            Status::MethodNotAllowed,
            Status::RequestTimeout,
            Status::HeaderTooLarge,
            Status::InternalError,
            Status::Unavailable,
            Status::VersionNotSupported,
        ] {
            assert!(s.line().as_bytes()[..3].iter().all(u8::is_ascii_digit));
        }
    }

    /// read_head over a real socket pair: every read outcome.
    #[test]
    fn read_head_outcomes() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let run = |send: &'static [u8], close: bool, limit: usize, timeout_ms: u64| {
            let mut client = TcpStream::connect(addr).unwrap();
            let (mut server, _) = listener.accept().unwrap();
            client.write_all(send).unwrap();
            if close {
                client.shutdown(Shutdown::Write).unwrap();
            }
            let r = read_head(&mut server, limit, Duration::from_millis(timeout_ms));
            drop(client);
            r.map(|(buf, end)| buf[..end].to_vec())
        };
        assert_eq!(
            run(b"GET / HTTP/1.1\r\n\r\nextra", false, 64, 10_000).unwrap(),
            b"GET / HTTP/1.1\r\n\r\n"
        );
        assert_eq!(run(b"", true, 64, 10_000), Err(RequestError::Empty));
        assert_eq!(
            run(b"GET / HT", true, 64, 10_000),
            Err(RequestError::Truncated)
        );
        assert_eq!(
            run(
                b"GET / HTTP/1.1\r\nX: yyyyyyyyyyyyyyyyyy\r\n",
                false,
                16,
                10_000
            ),
            Err(RequestError::HeadTooLarge { limit: 16 })
        );
        assert_eq!(run(b"GET / HT", false, 64, 50), Err(RequestError::Timeout));
        assert_eq!(run(b"", false, 64, 0), Err(RequestError::Timeout));
        // A reset connection: the client closes with unread data in its
        // receive buffer, so the kernel answers with RST.
        let client = TcpStream::connect(addr).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        server.write_all(b"unread").unwrap();
        std::thread::sleep(Duration::from_millis(20)); // let the bytes land
        drop(client);
        assert_eq!(
            read_head(&mut server, 64, Duration::from_secs(10)).map(|_| ()),
            Err(RequestError::Io(io::ErrorKind::ConnectionReset))
        );
    }
}
