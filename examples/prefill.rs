//! The prefill half of a two-process pair (the other half: `decoder.rs`).
//!
//! Sends `REQUESTS` requests (`req-0`, `req-1`, ...) of pattern bytes to the
//! decoder at `ENDPOINT` over `TRANSPORT` (`shm`, the default, or `tcp`),
//! writing each chunk in place into a staging slot.
//!
//! ```sh
//! cargo run --example prefill -- ENDPOINT [REQUESTS [TRANSPORT]]
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use kvferry::{RequestSpec, RequestStatus, Sender, SenderConfig};

#[path = "common/mod.rs"]
mod common;
use common::{CHUNKS, CHUNK_BYTES};

/// How long each request may take, admission included.
const WAIT: Duration = Duration::from_secs(60);

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: prefill ENDPOINT [REQUESTS [shm|tcp]]";
    let endpoint = args.next().ok_or(usage)?;
    let requests: usize = match args.next() {
        Some(n) => n.parse().map_err(|e| format!("REQUESTS {n:?}: {e}"))?,
        None => 4,
    };
    let transport = args.next().unwrap_or_else(|| "shm".into());
    let sender = Sender::new(SenderConfig {
        chunk_bytes: CHUNK_BYTES as u64,
        staging_slots: CHUNKS,
        transport: transport.clone(),
        ..Default::default()
    })?;

    for r in 0..requests {
        let id = common::req_id(r);
        let deadline = Instant::now() + WAIT;
        let req = sender.begin(RequestSpec::new(id.as_str(), endpoint.as_str(), CHUNKS))?;
        let mut batch = req.stage(CHUNKS, deadline)?;
        for (c, slot) in batch.slots_mut().enumerate() {
            common::fill(r, c, slot);
        }
        batch.submit(&common::keys(r), &[CHUNK_BYTES as u32; CHUNKS])?;
        match req.wait(deadline) {
            RequestStatus::Completed => println!("prefill: {id} sent over {transport}"),
            other => return Err(format!("{id}: {other:?}").into()),
        }
    }
    sender.close(Instant::now() + WAIT);
    println!("prefill: {requests} requests sent");
    Ok(())
}
