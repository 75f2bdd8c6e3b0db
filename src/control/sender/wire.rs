//! The sender's AllocRequest encoder: the same bytes as
//! [`crate::protocol::encode`] of a `Message::AllocRequest` (a msgpack map,
//! tag first, then the fields in declaration order, `seq` left out when
//! absent), written straight from a batch's [`KeyList`] and its request's
//! geometry, so sending a batch builds no `AllocRequest` (no key, shape or
//! id clones). `tests` pins the byte equality against the serde encoder.

use rmp::encode as mp;

use super::keys::KeyList;

/// The fields of one AllocRequest, borrowed.
pub(crate) struct AllocRequestRef<'a> {
    pub keys: &'a KeyList,
    pub fmt: i64,
    pub shape: &'a [i64],
    pub dtype: &'a str,
    pub last_chunk_toks: i64,
    pub req_id: &'a str,
    pub is_last_batch: bool,
    pub total_chunks: i64,
    pub seq: Option<u64>,
}

impl AllocRequestRef<'_> {
    /// Appends the encoding to `out`. Writing to a `Vec` cannot fail, and
    /// every length fits the 32-bit msgpack lengths (keys and shape come from
    /// batches bounded by the staging size; a string over 4 GiB cannot be a
    /// key the receiver accepts); should one not fit, `out` is restored and
    /// the frame is empty (the receiver answers `bad_message`), as
    /// [`crate::protocol::encode_into`] does.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        if self.write(out).is_none() {
            out.truncate(start);
        }
    }

    fn write(&self, out: &mut Vec<u8>) -> Option<()> {
        let len32 = |n: usize| u32::try_from(n).ok();
        let fields = 9 + u32::from(self.seq.is_some());
        mp::write_map_len(out, fields).ok()?;
        mp::write_str(out, "type").ok()?;
        mp::write_str(out, "AllocRequest").ok()?;
        mp::write_str(out, "keys").ok()?;
        mp::write_array_len(out, len32(self.keys.len())?).ok()?;
        for k in self.keys.iter() {
            mp::write_str(out, k).ok()?;
        }
        mp::write_str(out, "fmt").ok()?;
        mp::write_sint(out, self.fmt).ok()?;
        mp::write_str(out, "shape").ok()?;
        mp::write_array_len(out, len32(self.shape.len())?).ok()?;
        for &d in self.shape {
            mp::write_sint(out, d).ok()?;
        }
        mp::write_str(out, "dtype").ok()?;
        mp::write_str(out, self.dtype).ok()?;
        mp::write_str(out, "last_chunk_toks").ok()?;
        mp::write_sint(out, self.last_chunk_toks).ok()?;
        mp::write_str(out, "req_id").ok()?;
        mp::write_str(out, self.req_id).ok()?;
        mp::write_str(out, "is_last_batch").ok()?;
        mp::write_bool(out, self.is_last_batch).ok()?;
        mp::write_str(out, "total_chunks").ok()?;
        mp::write_sint(out, self.total_chunks).ok()?;
        if let Some(seq) = self.seq {
            mp::write_str(out, "seq").ok()?;
            mp::write_uint(out, seq).ok()?;
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{encode, AllocRequest, Message};

    fn both(keys: &[&str], seq: Option<u64>, fmt: i64, toks: i64, total: i64) {
        let list = KeyList::from_keys(keys);
        let shape = [-1i64, 0, 7, 300, 70_000, 5_000_000_000];
        let ours = {
            let mut out = vec![0xAA]; // appends, keeps what was there
            AllocRequestRef {
                keys: &list,
                fmt,
                shape: &shape,
                dtype: "bfloat16",
                last_chunk_toks: toks,
                req_id: "req-é",
                is_last_batch: seq.is_some(),
                total_chunks: total,
                seq,
            }
            .encode_into(&mut out);
            out
        };
        let theirs = encode(&Message::AllocRequest(AllocRequest {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            fmt,
            shape: shape.to_vec(),
            dtype: "bfloat16".into(),
            last_chunk_toks: toks,
            req_id: "req-é".into(),
            is_last_batch: seq.is_some(),
            total_chunks: total,
            seq,
        }));
        assert_eq!(ours[0], 0xAA);
        assert_eq!(&ours[1..], &theirs[..], "keys {keys:?} seq {seq:?}");
    }

    #[test]
    fn alloc_request_bytes_equal_the_serde_encoding() {
        let long = "k".repeat(300);
        both(&[], None, 0, 0, 1);
        both(&["a/0", "", &long], Some(1), -3, 4096, 32);
        both(&["x"; 40], Some(u64::MAX), i64::MIN, i64::MAX, 1 << 40);
    }
}
