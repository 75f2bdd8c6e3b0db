//! Minimal HTTP/1.x request-head parsing and response framing for the
//! metrics endpoint. Everything here treats the peer as hostile: no input
//! makes it panic (sizes and time are capped by the server).

/// Why a request head could not be read or parsed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub(crate) enum RequestError {
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
    /// The status to answer with.
    pub(crate) fn status(&self) -> Status {
        match self {
            RequestError::Truncated | RequestError::BadRequestLine | RequestError::BadHeader => {
                Status::BadRequest
            }
            RequestError::HeadTooLarge { .. } => Status::HeaderTooLarge,
            RequestError::Timeout => Status::RequestTimeout,
            RequestError::BadVersion => Status::VersionNotSupported,
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

/// A complete `Connection: close` response. `body` is omitted (but its
/// length still announced) when `with_body` is false (HEAD).
pub(crate) fn response_bytes(
    version: Version,
    status: Status,
    content_type: &str,
    extra_headers: &str,
    body: &[u8],
    with_body: bool,
) -> Vec<u8> {
    let mut out = format!(
        "{} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n{extra_headers}\r\n",
        version.as_str(),
        status.line(),
        body.len()
    )
    .into_bytes();
    if with_body {
        out.extend_from_slice(body);
    }
    out
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
        assert_eq!(Truncated.status(), Status::BadRequest);
        assert_eq!(BadRequestLine.status(), Status::BadRequest);
        assert_eq!(BadHeader.status(), Status::BadRequest);
        assert_eq!(HeadTooLarge { limit: 1 }.status(), Status::HeaderTooLarge);
        assert_eq!(Timeout.status(), Status::RequestTimeout);
        assert_eq!(BadVersion.status(), Status::VersionNotSupported);
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

    #[test]
    fn response_head_and_body() {
        let r = response_bytes(
            Version::Http10,
            Status::NotFound,
            "text/plain",
            "X: y\r\n",
            b"nope",
            true,
        );
        assert_eq!(
            r,
            b"HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 4\r\nConnection: close\r\nX: y\r\n\r\nnope"
        );
        let h = response_bytes(Version::Http11, Status::Ok, "t", "", b"abc", false);
        assert!(h.ends_with(b"Content-Length: 3\r\nConnection: close\r\n\r\n"));
    }
}
