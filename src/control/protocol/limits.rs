//! Decode limits: the bounds every incoming frame is checked against.
//!
//! A peer controls every byte of a frame, so before and after deserializing the
//! decoder enforces these bounds and reports a typed
//! [`ProtocolError`](super::ProtocolError) when one is broken. Together they cap
//! the work and memory one frame can cost: the frame size bounds the input, the
//! element count bounds what the decoder builds from it (about 32 bytes of
//! buffered value per msgpack element plus the string bytes, which are already
//! bounded by the frame size), and the depth bounds the recursion.

/// Decode limits (see the module docs and `docs/protocol.md` for what is checked where).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted frame (payload bytes). Checked before anything else.
    pub max_frame_bytes: usize,
    /// Most entries in `AllocRequest.keys`, `CancelNotif.keys`,
    /// `AllocResponse.remote_indexes` and `AllocResponse.already_sent_indexes`.
    pub max_keys: usize,
    /// Longest key, in bytes of UTF-8. Also bounds the identifier strings
    /// (`req_id`, `sender_id`, `receiver_id`).
    pub max_key_bytes: usize,
    /// Largest accepted `AllocRequest.total_chunks` (the smallest is 0).
    pub max_total_chunks: i64,
    /// Most dimensions in `AllocRequest.shape`.
    pub max_shape_dims: usize,
    /// Deepest nesting of msgpack arrays/maps; the top-level map is depth 1.
    /// kvferry's own messages need 2 (message → descriptor); the rest is
    /// room for unknown fields from newer peers. Values above
    /// [`Limits::MAX_DEPTH_CAP`] act as the cap.
    pub max_depth: usize,
    /// Most msgpack values (every scalar, string, array, map and map key counts
    /// one) in a frame. Must be a little more than `2 * max_keys` for a full
    /// AllocResponse to fit.
    pub max_elements: usize,
}

impl Limits {
    /// Default largest frame: 4 MiB.
    pub const DEFAULT_MAX_FRAME_BYTES: usize = 4 << 20;
    /// Default most keys per batch: 65,536.
    pub const DEFAULT_MAX_KEYS: usize = 1 << 16;
    /// Default longest key: 4 KiB.
    pub const DEFAULT_MAX_KEY_BYTES: usize = 4 << 10;
    /// Default largest `total_chunks`: 2^24.
    pub const DEFAULT_MAX_TOTAL_CHUNKS: i64 = 1 << 24;
    /// Default most shape dimensions: 8.
    pub const DEFAULT_MAX_SHAPE_DIMS: usize = 8;
    /// Hard cap on `max_depth`, whatever the configured value. serde
    /// buffers an internally-tagged message recursively, about 2 KiB of stack
    /// per nesting level in a debug build; 64 levels stay far below the
    /// smallest thread stack kvferry uses (measured: 64 levels fit in 256 KiB,
    /// 128 do not).
    pub const MAX_DEPTH_CAP: usize = 64;
    /// Default deepest nesting: 32.
    pub const DEFAULT_MAX_DEPTH: usize = 32;
    /// Default most msgpack values per frame: 4 x 65,536.
    pub const DEFAULT_MAX_ELEMENTS: usize = 4 << 16;
}

impl Limits {
    /// The depth limit actually enforced: `max_depth`, at most [`Limits::MAX_DEPTH_CAP`].
    pub fn effective_max_depth(&self) -> usize {
        self.max_depth.min(Self::MAX_DEPTH_CAP)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: Self::DEFAULT_MAX_FRAME_BYTES,
            max_keys: Self::DEFAULT_MAX_KEYS,
            max_key_bytes: Self::DEFAULT_MAX_KEY_BYTES,
            max_total_chunks: Self::DEFAULT_MAX_TOTAL_CHUNKS,
            max_shape_dims: Self::DEFAULT_MAX_SHAPE_DIMS,
            max_depth: Self::DEFAULT_MAX_DEPTH,
            max_elements: Self::DEFAULT_MAX_ELEMENTS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_spec() {
        let l = Limits::default();
        assert_eq!(l.max_frame_bytes, 4 * 1024 * 1024);
        assert_eq!(l.max_keys, 65_536);
        assert_eq!(l.max_key_bytes, 4096);
        assert_eq!(l.max_total_chunks, 1 << 24);
        assert_eq!(l.max_shape_dims, 8);
        // A full AllocResponse (two arrays of max_keys ints) must fit the element budget.
        assert!(l.max_elements > 2 * l.max_keys + 64);
        assert!(l.max_depth >= 3);
        assert_eq!(l.effective_max_depth(), 32);
        let huge = Limits {
            max_depth: usize::MAX,
            ..Limits::default()
        };
        assert_eq!(huge.effective_max_depth(), Limits::MAX_DEPTH_CAP);
    }
}
