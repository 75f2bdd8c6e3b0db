//! What the examples share: the request shape and the byte pattern the
//! decode side checks.
#![allow(dead_code)] // each example uses its part

/// Chunks per request.
pub const CHUNKS: usize = 4;
/// Bytes per chunk (and per slot).
pub const CHUNK_BYTES: usize = 64 * 1024;

/// The id of request `r`.
pub fn req_id(r: usize) -> String {
    format!("req-{r}")
}

/// The keys of request `r`'s chunks, in order.
pub fn keys(r: usize) -> Vec<String> {
    (0..CHUNKS).map(|c| format!("{}/{c}", req_id(r))).collect()
}

/// Fills chunk `c` of request `r`.
pub fn fill(r: usize, c: usize, chunk: &mut [u8]) {
    for (o, b) in chunk.iter_mut().enumerate() {
        *b = pattern(r, c, o);
    }
}

/// Checks chunk `c` of request `r`: its key, length and every byte.
pub fn check(r: usize, c: usize, key: &str, bytes: &[u8]) -> Result<(), String> {
    let want = &keys(r)[c];
    if key != want || bytes.len() != CHUNK_BYTES {
        return Err(format!(
            "chunk {c} of {}: got {key} ({} B)",
            req_id(r),
            bytes.len()
        ));
    }
    match (0..bytes.len()).find(|&o| bytes[o] != pattern(r, c, o)) {
        Some(o) => Err(format!("{key}: byte {o} differs")),
        None => Ok(()),
    }
}

fn pattern(r: usize, c: usize, offset: usize) -> u8 {
    (r * 31 + c * 7 + offset) as u8
}
