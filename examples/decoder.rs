//! The decode half of a two-process pair (the other half: `prefill.rs`).
//!
//! Starts a [`Receiver`] on loopback (shm, plus the TCP data plane), prints
//! its endpoint, then waits for `REQUESTS` requests (`req-0`, `req-1`, ...),
//! reads each one's chunks in place and checks every byte.
//!
//! ```sh
//! cargo run --example decoder -- 4        # prints: decoder listening on tcp://127.0.0.1:PORT
//! cargo run --example prefill -- tcp://127.0.0.1:PORT 4 shm   # in another shell (or tcp)
//! ```

use std::error::Error;
use std::io::Write;
use std::time::{Duration, Instant};

use kvferry::{Receiver, ReceiverConfig};

#[path = "common/mod.rs"]
mod common;
use common::{CHUNKS, CHUNK_BYTES};

/// How long the decoder waits for each request.
const WAIT: Duration = Duration::from_secs(60);

fn main() -> Result<(), Box<dyn Error>> {
    let requests: usize = match std::env::args().nth(1) {
        Some(n) => n.parse().map_err(|e| format!("REQUESTS {n:?}: {e}"))?,
        None => 4,
    };
    let receiver = Receiver::start(ReceiverConfig {
        listen: "tcp://127.0.0.1:0".into(),
        capacity_chunks: 2 * CHUNKS,
        chunk_bytes: CHUNK_BYTES as u64,
        tcp_data: Some("127.0.0.1:0".parse()?),
        ..Default::default()
    })?;
    // The one line the prefill side needs (tests/examples.rs reads it).
    println!("decoder listening on {}", receiver.endpoint());
    std::io::stdout().flush()?;

    for r in 0..requests {
        let id = common::req_id(r);
        let ready = receiver.watch(&id)?;
        ready
            .wait(Instant::now() + WAIT)
            .map_err(|e| format!("{id}: {e}"))?;
        let chunks = receiver.take(&id)?;
        if chunks.len() != CHUNKS {
            return Err(format!("{id}: {} chunks", chunks.len()).into());
        }
        for (c, chunk) in chunks.iter().enumerate() {
            common::check(r, c, chunk.key(), chunk.bytes())?;
        }
        println!(
            "decoder: {id} in place, {} bytes verified",
            chunks.total_bytes()
        );
    }
    println!("decoder: {requests} requests received");
    Ok(())
}
