//! Deterministic chunk payloads for load generation and verification.
//!
//! Generating fresh random bytes for gigabytes of chunks would cost more CPU
//! than moving them, so chunks are cut from a small pool of random blocks:
//! chunk `i` of request `r` is pool block `hash(r, i) % POOL` with a 16-byte
//! header `(request number, chunk index)` in front. A decoder recomputes the
//! block and length from the key alone and compares byte for byte, so a chunk
//! written to the wrong slot, cut short or overwritten by another request is
//! caught.

use rand::{RngCore, SeedableRng};

/// Blocks in the pool.
const POOL: usize = 16;
/// Bytes of the per-chunk header.
pub const HEADER: usize = 16;

/// The pool of random blocks, one per run (same seed ⇒ same bytes).
#[derive(Debug)]
pub struct Payloads {
    chunk_bytes: usize,
    pool: Vec<Vec<u8>>,
}

/// Identity of one chunk, parsed back from its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkId {
    /// Request number (unique in the run).
    pub request: u64,
    /// Chunk index in the request.
    pub index: u32,
    /// Chunks in the request.
    pub total: u32,
}

impl ChunkId {
    /// The key naming this chunk: `"{req_id}/{index}/{total}"`.
    pub fn key(&self, req_id: &str) -> String {
        format!("{req_id}/{}/{}", self.index, self.total)
    }

    /// The key naming this chunk in LMCache's `CacheEngineKey` string form
    /// (`model@world_size@worker_id@chunk_hash_hex@dtype`), which an LMCache
    /// receiver requires of every key: `"{req_id}@1@0@{index:x}@uint8"`.
    pub fn lmcache_key(&self, req_id: &str) -> String {
        format!("{req_id}@1@0@{:x}@uint8", self.index)
    }
}

fn mix(a: u64, b: u64) -> u64 {
    // splitmix64 finaliser over the pair.
    let mut z = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Payloads {
    /// A pool for chunks of at most `chunk_bytes` (at least [`HEADER`]).
    pub fn new(chunk_bytes: usize, seed: u64) -> Self {
        let chunk_bytes = chunk_bytes.max(HEADER);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let pool = (0..POOL)
            .map(|_| {
                let mut b = vec![0u8; chunk_bytes];
                rng.fill_bytes(&mut b);
                b
            })
            .collect();
        Self { chunk_bytes, pool }
    }

    /// Length of chunk `id`: full, except a request's last chunk, which is
    /// shorter (between half and all of a chunk) like a prompt's tail.
    pub fn len_of(&self, id: ChunkId) -> usize {
        if id.index + 1 < id.total {
            return self.chunk_bytes;
        }
        let half = self.chunk_bytes / 2;
        let span = (self.chunk_bytes - half).max(1) as u64;
        (half + (mix(id.request, u64::from(id.index)) % span) as usize).max(HEADER)
    }

    /// Writes chunk `id` into `out` (resized to its length).
    pub fn fill(&self, id: ChunkId, out: &mut Vec<u8>) {
        let len = self.len_of(id);
        let block = &self.pool[(mix(id.request, u64::from(id.index)) % POOL as u64) as usize];
        out.clear();
        out.extend_from_slice(&id.request.to_le_bytes());
        out.extend_from_slice(&u64::from(id.index).to_le_bytes());
        out.extend_from_slice(&block[HEADER..len]);
    }

    /// Writes chunk `id` at the start of `out` (a staging slot, at least
    /// [`len_of`](Self::len_of) bytes) and returns its length.
    pub fn fill_slice(&self, id: ChunkId, out: &mut [u8]) -> usize {
        let len = self.len_of(id).min(out.len());
        let block = &self.pool[(mix(id.request, u64::from(id.index)) % POOL as u64) as usize];
        out[0..8].copy_from_slice(&id.request.to_le_bytes());
        out[8..16].copy_from_slice(&u64::from(id.index).to_le_bytes());
        out[HEADER..len].copy_from_slice(&block[HEADER..len]);
        len
    }

    /// True if `bytes` (a whole slot or more) starts with exactly chunk `id`.
    pub fn verify(&self, id: ChunkId, bytes: &[u8]) -> bool {
        let len = self.len_of(id);
        if bytes.len() < len {
            return false;
        }
        let block = &self.pool[(mix(id.request, u64::from(id.index)) % POOL as u64) as usize];
        bytes[0..8] == id.request.to_le_bytes()
            && bytes[8..16] == u64::from(id.index).to_le_bytes()
            && bytes[HEADER..len] == block[HEADER..len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_verify_and_detect_corruption() {
        let p = Payloads::new(4096, 7);
        let id = ChunkId {
            request: 3,
            index: 1,
            total: 4,
        };
        let mut buf = Vec::new();
        p.fill(id, &mut buf);
        assert_eq!(buf.len(), 4096);
        assert!(p.verify(id, &buf));
        let other = ChunkId {
            request: 4,
            index: 1,
            total: 4,
        };
        assert!(!p.verify(other, &buf), "another request's chunk is caught");
        buf[100] ^= 1;
        assert!(!p.verify(id, &buf), "a flipped byte is caught");
        let last = ChunkId {
            request: 3,
            index: 3,
            total: 4,
        };
        p.fill(last, &mut buf);
        assert!(buf.len() >= 2048 && buf.len() <= 4096);
        assert!(
            !p.verify(last, &buf[..buf.len() - 1]),
            "a short slot is caught"
        );
        assert_eq!(last.key("p0-r3"), "p0-r3/3/4");
        assert_eq!(last.lmcache_key("p0-r3"), "p0-r3@1@0@3@uint8");
    }
}
