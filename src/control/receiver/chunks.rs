//! [`RequestChunks`]: a complete request's chunks borrowed in place, in key
//! order, with their lengths; dropping it releases them all at once.

use std::sync::Arc;
use std::time::Instant;

use super::core::TakenChunk;
use super::Shared;

/// The chunks of one complete request, borrowed in the receive buffer (no
/// copy), in the order its batches named them. Each chunk's slot is the
/// request's own copy, written completely (its `TransferDone` arrived) and
/// written by no one while this lives. Dropping it releases every chunk
/// (one lock, one pass); a slot is freed with its last reference (another
/// request may share a deduplicated chunk).
pub struct RequestChunks {
    shared: Arc<Shared>,
    req_id: String,
    chunks: Vec<TakenChunk>,
}

impl std::fmt::Debug for RequestChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestChunks")
            .field("req_id", &self.req_id)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

/// One chunk of a [`RequestChunks`]: its key, exact bytes and token count.
#[derive(Debug, Clone, Copy)]
pub struct ChunkView<'a> {
    key: &'a str,
    slot: u32,
    bytes: &'a [u8],
    tokens: Option<u32>,
}

impl<'a> ChunkView<'a> {
    /// The key.
    pub fn key(&self) -> &'a str {
        self.key
    }

    /// The slot index in the receive buffer.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The chunk's bytes: exactly its length, in place.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The chunk's length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// True for a zero-length chunk.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Token count if this was a batch's (possibly short) last chunk.
    pub fn tokens(&self) -> Option<u32> {
        self.tokens
    }
}

impl RequestChunks {
    pub(super) fn new(shared: Arc<Shared>, req_id: String, chunks: Vec<TakenChunk>) -> Self {
        Self {
            shared,
            req_id,
            chunks,
        }
    }

    /// The request id.
    pub fn req_id(&self) -> &str {
        &self.req_id
    }

    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// True if the request had no chunk.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Sum of the chunks' lengths.
    pub fn total_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len).sum()
    }

    /// Chunk `i` (key order), if it exists.
    pub fn get(&self, i: usize) -> Option<ChunkView<'_>> {
        self.chunks.get(i).map(|c| self.view(c))
    }

    /// The chunks in key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = ChunkView<'_>> + '_ {
        self.chunks.iter().map(|c| self.view(c))
    }

    fn view<'a>(&'a self, c: &'a TakenChunk) -> ChunkView<'a> {
        ChunkView {
            key: &c.key,
            slot: c.slot,
            // SAFETY: `c` is a borrow of a ready copy in `c.slot`
            // (`ReceiverCore::take`), ended only when `self` drops, which
            // outlives the returned view.
            bytes: unsafe { self.shared.slot_bytes(c.slot, c.len) },
            tokens: c.tokens,
        }
    }
}

impl Drop for RequestChunks {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        let mut out = Vec::new();
        let now = Instant::now();
        for c in self.chunks.drain(..) {
            st.core.end_borrow(&c.key, c.gen, now, &mut out);
        }
        self.shared.post(&mut st, out);
    }
}
