//! Structural pre-check of a frame, run before serde sees it.
//!
//! One linear pass over the msgpack bytes, with no allocation proportional to
//! declared lengths. It guarantees what serde + rmp-serde would otherwise
//! discover late or not at all:
//! - the frame is exactly one well-formed msgpack value, a map, with no
//!   trailing bytes and no reserved marker (0xc1);
//! - every declared length fits in the bytes that remain (so a tiny frame that
//!   declares an array of 2^32-1 elements is refused here, before anything is
//!   reserved for it);
//! - nesting depth <= `Limits::effective_max_depth()`, element count <= `Limits::max_elements`;
//! - the message map's keys (and the descriptor map's keys) are UTF-8 strings,
//!   none repeated;
//! - `"type"` is present, a string, and a known message type;
//! - every required field of that type is present.
//!
//! After this pass, rmp-serde only has to check value types and ranges.

use super::messages::required_fields;
use super::{Limits, ProtocolError};

/// A msgpack value header: what one marker (plus its length bytes) announces.
enum Header<'a> {
    /// Any value without children (nil, bool, int, float, bin, ext), already skipped.
    Scalar(&'static str),
    /// A string; the payload is returned and already skipped.
    Str(&'a [u8]),
    /// An array of this many elements (not yet read).
    Array(u64),
    /// A map of this many key/value pairs (not yet read).
    Map(u64),
}

impl Header<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Header::Scalar(k) => k,
            Header::Str(_) => "str",
            Header::Array(_) => "array",
            Header::Map(_) => "map",
        }
    }
}

struct Cursor<'a, 'l> {
    buf: &'a [u8],
    pos: usize,
    elements: usize,
    limits: &'l Limits,
}

impl<'a> Cursor<'a, '_> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, start: usize) -> Result<&'a [u8], ProtocolError> {
        if n > self.remaining() {
            return Err(ProtocolError::Truncated { offset: start });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be(&mut self, n: usize, start: usize) -> Result<u64, ProtocolError> {
        let bytes = self.take(n, start)?;
        Ok(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// Reads one value header, skipping the payload of scalars and strings.
    fn header(&mut self) -> Result<Header<'a>, ProtocolError> {
        let start = self.pos;
        self.elements += 1;
        if self.elements > self.limits.max_elements {
            return Err(ProtocolError::TooManyElements {
                max: self.limits.max_elements,
            });
        }
        let marker = self.take(1, start)?[0];
        let h = match marker {
            0x00..=0x7f | 0xe0..=0xff => Header::Scalar("int"),
            0x80..=0x8f => Header::Map(u64::from(marker & 0x0f)),
            0x90..=0x9f => Header::Array(u64::from(marker & 0x0f)),
            0xa0..=0xbf => Header::Str(self.take(usize::from(marker & 0x1f), start)?),
            0xc0 => Header::Scalar("nil"),
            0xc1 => return Err(ProtocolError::InvalidMarker { offset: start }),
            0xc2 | 0xc3 => Header::Scalar("bool"),
            0xc4..=0xc6 => {
                let n = self.be(1 << (marker - 0xc4), start)?;
                self.skip(n, start)?;
                Header::Scalar("bin")
            }
            0xc7..=0xc9 => {
                let n = self.be(1 << (marker - 0xc7), start)?;
                self.skip(n.saturating_add(1), start)?; // type byte + data
                Header::Scalar("ext")
            }
            0xca => {
                self.skip(4, start)?;
                Header::Scalar("float")
            }
            0xcb => {
                self.skip(8, start)?;
                Header::Scalar("float")
            }
            0xcc..=0xcf => {
                self.skip(1 << (marker - 0xcc), start)?;
                Header::Scalar("int")
            }
            0xd0..=0xd3 => {
                self.skip(1 << (marker - 0xd0), start)?;
                Header::Scalar("int")
            }
            0xd4..=0xd8 => {
                self.skip(1 + (1 << (marker - 0xd4)), start)?; // type byte + data
                Header::Scalar("ext")
            }
            0xd9..=0xdb => {
                let n = self.be(1 << (marker - 0xd9), start)?;
                let n =
                    usize::try_from(n).map_err(|_| ProtocolError::Truncated { offset: start })?;
                Header::Str(self.take(n, start)?)
            }
            0xdc | 0xdd => Header::Array(self.be(2 << (marker - 0xdc), start)?),
            0xde | 0xdf => Header::Map(self.be(2 << (marker - 0xde), start)?),
        };
        // Every child takes at least one byte: a container declaring more
        // children than bytes remain cannot be complete.
        let children = match h {
            Header::Array(n) => n,
            Header::Map(n) => n.saturating_mul(2),
            _ => 0,
        };
        if children > self.remaining() as u64 {
            return Err(ProtocolError::Truncated { offset: start });
        }
        Ok(h)
    }

    fn skip(&mut self, n: u64, start: usize) -> Result<(), ProtocolError> {
        let n = usize::try_from(n).map_err(|_| ProtocolError::Truncated { offset: start })?;
        self.take(n, start).map(|_| ())
    }

    fn check_depth(&self, depth: usize) -> Result<(), ProtocolError> {
        let max = self.limits.effective_max_depth();
        if depth > max {
            Err(ProtocolError::TooDeep { max })
        } else {
            Ok(())
        }
    }

    /// Skips the children of container `first`, which sits at `depth`
    /// (iteratively: no recursion however deep the limit allows).
    fn skip_children(&mut self, first: Header<'a>, depth: usize) -> Result<(), ProtocolError> {
        // (children still to read, depth of that container), innermost last.
        let mut open: Vec<(u64, usize)> = Vec::new();
        self.open_container(&first, depth, &mut open)?;
        while let Some(top) = open.last_mut() {
            top.0 -= 1;
            let child_depth = top.1 + 1;
            if top.0 == 0 {
                open.pop();
            }
            let h = self.header()?;
            self.open_container(&h, child_depth, &mut open)?;
        }
        Ok(())
    }

    /// If `h` is a container at `depth`, checks the depth and records its children.
    fn open_container(
        &self,
        h: &Header<'a>,
        depth: usize,
        open: &mut Vec<(u64, usize)>,
    ) -> Result<(), ProtocolError> {
        let children = match *h {
            Header::Array(n) => n,
            // Cannot overflow: `header` checked 2n against the remaining bytes.
            Header::Map(n) => n * 2,
            _ => return Ok(()),
        };
        self.check_depth(depth)?;
        if children > 0 {
            open.push((children, depth));
        }
        Ok(())
    }

    /// Walks a map whose keys must be UTF-8 strings, calling `on_entry` with
    /// each key and the value's header; `on_entry` returns whether it consumed
    /// the value's children itself.
    fn walk_string_keyed_map(
        &mut self,
        pairs: u64,
        depth: usize,
        mut on_entry: impl FnMut(&mut Self, &'a str, &Header<'a>) -> Result<bool, ProtocolError>,
    ) -> Result<(), ProtocolError> {
        for _ in 0..pairs {
            let key = match self.header()? {
                Header::Str(bytes) => {
                    std::str::from_utf8(bytes).map_err(|_| ProtocolError::NonStringKey {
                        found: "non-UTF-8 str",
                    })?
                }
                other => {
                    return Err(ProtocolError::NonStringKey {
                        found: other.kind(),
                    })
                }
            };
            let value = self.header()?;
            if !on_entry(self, key, &value)? {
                self.skip_children(value, depth + 1)?;
            }
        }
        Ok(())
    }
}

/// Checks the structure of `frame` (see the module docs). `frame.len()` must
/// already be within `limits.max_frame_bytes`.
pub(crate) fn scan(frame: &[u8], limits: &Limits) -> Result<(), ProtocolError> {
    let mut cur = Cursor {
        buf: frame,
        pos: 0,
        elements: 0,
        limits,
    };
    let pairs = match cur.header()? {
        Header::Map(n) => n,
        other => {
            return Err(ProtocolError::NotAMap {
                found: other.kind(),
            })
        }
    };
    cur.check_depth(1)?;
    // Keys are bounded by the frame (checked against remaining bytes above).
    let mut keys: Vec<&str> = Vec::with_capacity(pairs.min(16) as usize);
    let mut type_value: Option<Result<&str, &'static str>> = None;
    cur.walk_string_keyed_map(pairs, 1, |cur, key, value| {
        keys.push(key);
        match key {
            "type" => {
                type_value = Some(match *value {
                    Header::Str(b) => std::str::from_utf8(b).map_err(|_| "non-UTF-8 str"),
                    ref other => Err(other.kind()),
                });
                Ok(false)
            }
            "descriptor" => match *value {
                Header::Map(n) => {
                    cur.check_depth(2)?;
                    cur.walk_string_keyed_map(n, 2, |_, _, _| Ok(false))?;
                    Ok(true)
                }
                _ => Ok(false),
            },
            _ => Ok(false),
        }
    })?;
    if cur.pos != frame.len() {
        return Err(ProtocolError::TrailingBytes {
            extra: frame.len() - cur.pos,
        });
    }
    let type_name = match type_value {
        None => return Err(ProtocolError::MissingType),
        Some(Err(found)) => return Err(ProtocolError::TypeNotString { found }),
        Some(Ok(t)) => t,
    };
    let (type_name, required) = required_fields(type_name)
        .ok_or_else(|| ProtocolError::UnknownType(type_name.to_owned()))?;
    keys.sort_unstable();
    if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
        return Err(ProtocolError::DuplicateField(w[0].to_owned()));
    }
    for &field in required {
        if keys.binary_search(&field).is_err() {
            return Err(ProtocolError::MissingField {
                message_type: type_name,
                field,
            });
        }
    }
    Ok(())
}

/// What a receiver can still learn from a frame it could not decode, to shape
/// its failure reply: the `seq` to echo (so a kvferry sender with many
/// requests in flight can match the reply) and the number of keys (LMCache's
/// failure shape is `[-1] * max(len(keys), 1)`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplyHints {
    /// Top-level `seq`, if present and a non-negative integer.
    pub seq: Option<u64>,
    /// Declared length of the top-level `keys` array, if present and at most `Limits::max_keys`.
    pub n_keys: Option<usize>,
}

/// Best-effort peek at a (possibly invalid) frame for [`ReplyHints`].
///
/// Walks the top-level map as far as it is well-formed and within `limits`,
/// and stops at the first problem; never panics, never allocates in proportion
/// to declared lengths. The hints are only hints: use them for the failure
/// reply, never to act on the request.
pub fn peek_reply_hints(frame: &[u8], limits: &Limits) -> ReplyHints {
    let mut hints = ReplyHints::default();
    if frame.len() > limits.max_frame_bytes {
        return hints;
    }
    let mut cur = Cursor {
        buf: frame,
        pos: 0,
        elements: 0,
        limits,
    };
    let Ok(Header::Map(pairs)) = cur.header() else {
        return hints;
    };
    for _ in 0..pairs {
        let Ok(Header::Str(key)) = cur.header() else {
            break;
        };
        let start = cur.pos;
        let Ok(value) = cur.header() else {
            break;
        };
        match (key, &value) {
            (b"seq", Header::Scalar("int")) => {
                hints.seq = read_non_negative(&frame[start..cur.pos])
            }
            (b"keys", Header::Array(n)) => {
                hints.n_keys = usize::try_from(*n).ok().filter(|&n| n <= limits.max_keys);
            }
            _ => {}
        }
        if cur.skip_children(value, 2).is_err() {
            break;
        }
    }
    hints
}

/// The value of one complete msgpack integer, if it is non-negative.
fn read_non_negative(bytes: &[u8]) -> Option<u64> {
    let (&marker, rest) = bytes.split_first()?;
    let be = || rest.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    match marker {
        0x00..=0x7f => Some(u64::from(marker)),
        0xcc..=0xcf => Some(be()),
        // Signed markers: non-negative when the sign bit of the first byte is clear.
        0xd0..=0xd3 if rest.first().is_some_and(|&b| b < 0x80) => Some(be()),
        _ => None,
    }
}
