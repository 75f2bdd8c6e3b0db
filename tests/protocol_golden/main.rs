//! Golden-bytes tests for the control-plane wire format, one test binary
//! split by concern:
//!
//! - `golden`: the golden frames (named data files `tests/golden/*.hex`,
//!   described in `tests/golden/README.md`), their loader, and the message
//!   each must decode to;
//! - `messages`: every golden frame decodes to its message and encodes back
//!   byte for byte; field order, unknown fields, defaults, required fields,
//!   integer widths;
//! - `placement`: golden replies as LMCache's sender checks them;
//! - `errors`: every refusal is a typed error; reply hints from frames that
//!   fail to decode; `validate`.
//!
//! Every frame was written by hand from the msgpack spec (fixmap 0x8N,
//! fixarray 0x9N, fixstr 0xa0|len followed by the text, uint8 0xcc, ...), in
//! the field order PROTOCOL.md declares. Each must decode to the expected
//! value, and encoding that value must give back exactly these bytes (what
//! msgspec produces), so kvferry and LMCache peers understand each other.

mod errors;
mod golden;
mod messages;
mod placement;

use golden::*;
use kvferry::protocol::*;

/// Splits a top-level msgpack map into raw (key, value) byte slices, by hand
/// (independent of the crate's own scanner).
fn entries(frame: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let (n, mut pos) = match frame[0] {
        m @ 0x80..=0x8f => (usize::from(m & 0x0f), 1),
        0xde => (usize::from(u16::from_be_bytes([frame[1], frame[2]])), 3),
        m => panic!("not a map: {m:#x}"),
    };
    let mut out = Vec::new();
    for _ in 0..n {
        let k = skip(frame, pos);
        let v = skip(frame, k);
        out.push((frame[pos..k].to_vec(), frame[k..v].to_vec()));
        pos = v;
    }
    assert_eq!(pos, frame.len(), "trailing bytes in test frame");
    out
}

/// Returns the offset just past the msgpack value starting at `pos`.
fn skip(b: &[u8], pos: usize) -> usize {
    let be = |at: usize, n: usize| {
        b[at..at + n]
            .iter()
            .fold(0usize, |a, &x| (a << 8) | usize::from(x))
    };
    let m = b[pos];
    match m {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => pos + 1,
        0x80..=0x8f => (0..usize::from(m & 0x0f) * 2).fold(pos + 1, |p, _| skip(b, p)),
        0x90..=0x9f => (0..usize::from(m & 0x0f)).fold(pos + 1, |p, _| skip(b, p)),
        0xa0..=0xbf => pos + 1 + usize::from(m & 0x1f),
        0xc4 | 0xd9 => pos + 2 + be(pos + 1, 1),
        0xc5 | 0xda => pos + 3 + be(pos + 1, 2),
        0xc6 | 0xdb => pos + 5 + be(pos + 1, 4),
        0xca => pos + 5,
        0xcb => pos + 9,
        0xcc | 0xd0 => pos + 2,
        0xcd | 0xd1 => pos + 3,
        0xce | 0xd2 => pos + 5,
        0xcf | 0xd3 => pos + 9,
        0xdc => (0..be(pos + 1, 2)).fold(pos + 3, |p, _| skip(b, p)),
        0xde => (0..be(pos + 1, 2) * 2).fold(pos + 3, |p, _| skip(b, p)),
        m => panic!("test helper does not handle marker {m:#x}"),
    }
}

/// Reassembles a map from entries (fixmap / map16 header).
fn map(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = if entries.len() < 16 {
        vec![0x80 | entries.len() as u8]
    } else {
        let n = entries.len() as u16;
        vec![0xde, (n >> 8) as u8, n as u8]
    };
    for (k, v) in entries {
        out.extend_from_slice(k);
        out.extend_from_slice(v);
    }
    out
}

/// fixstr-encoded key, for building entries.
fn key(k: &str) -> Vec<u8> {
    assert!(k.len() < 32);
    let mut v = vec![0xa0 | k.len() as u8];
    v.extend_from_slice(k.as_bytes());
    v
}

fn without(frame: &[u8], field: &str) -> Vec<u8> {
    let e: Vec<_> = entries(frame)
        .into_iter()
        .filter(|(k, _)| *k != key(field))
        .collect();
    assert_eq!(e.len() + 1, entries(frame).len(), "{field} not in frame");
    map(&e)
}

fn with(frame: &[u8], extra: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut e = entries(frame);
    e.extend_from_slice(extra);
    map(&e)
}

fn replace(frame: &[u8], field: &str, value: &[u8]) -> Vec<u8> {
    let e: Vec<_> = entries(frame)
        .into_iter()
        .map(|(k, v)| {
            if k == key(field) {
                (k, value.to_vec())
            } else {
                (k, v)
            }
        })
        .collect();
    map(&e)
}
