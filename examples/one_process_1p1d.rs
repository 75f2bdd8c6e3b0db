//! One prefill, one decode, one router in one process, over shared memory.
//!
//! A [`Receiver`] (the decoder), a [`ProxyListener`] (the router) and a
//! [`Sender`] (the prefill node) on loopback. Each request's chunks are
//! written in place into staging slots, moved into the receiver's buffer by
//! the shm copy engine, and read back in place on the decode side, where
//! every byte is checked.
//!
//! ```sh
//! cargo run --example one_process_1p1d
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use kvferry::{ProxyListener, Receiver, ReceiverConfig, RequestSpec, RequestStatus};
use kvferry::{Sender, SenderConfig};

#[path = "common/mod.rs"]
mod common;
use common::{CHUNKS, CHUNK_BYTES};

const REQUESTS: usize = 8;

fn main() -> Result<(), Box<dyn Error>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let proxy = ProxyListener::bind("tcp://127.0.0.1:0")?;
    let receiver = Receiver::start(ReceiverConfig {
        listen: "tcp://127.0.0.1:0".into(),
        capacity_chunks: 2 * CHUNKS,
        chunk_bytes: CHUNK_BYTES as u64,
        ..Default::default()
    })?;
    let sender = Sender::new(SenderConfig {
        proxy: Some(proxy.endpoint().to_owned()),
        chunk_bytes: CHUNK_BYTES as u64,
        staging_slots: CHUNKS,
        ..Default::default()
    })?;

    let mut bytes = 0;
    for r in 0..REQUESTS {
        let id = common::req_id(r);
        let req = sender.begin(RequestSpec::new(id.as_str(), receiver.endpoint(), CHUNKS))?;
        // Staging slots in place, handed out once the receiver admitted the
        // whole request (its buffer holds two requests at a time).
        let mut batch = req.stage(CHUNKS, deadline)?;
        for (c, slot) in batch.slots_mut().enumerate() {
            common::fill(r, c, slot);
        }
        let keys = common::keys(r);
        batch.submit(&keys, &[CHUNK_BYTES as u32; CHUNKS])?;
        let status = req.wait(deadline);
        if status != RequestStatus::Completed {
            return Err(format!("{id}: {status:?}").into());
        }
        proxy.wait_ready(&id, 1, deadline)?;

        // The decoder: wait for the request, read its chunks in place.
        receiver.watch(&id)?.wait(deadline)?;
        let chunks = receiver.take(&id)?;
        if chunks.len() != CHUNKS {
            return Err(format!("{id}: {} chunks", chunks.len()).into());
        }
        for (c, chunk) in chunks.iter().enumerate() {
            common::check(r, c, chunk.key(), chunk.bytes())?;
        }
        bytes += chunks.total_bytes();
        // Dropping `chunks` releases the slots for the next request.
    }
    let left = sender.close(deadline);
    if left != 0 {
        return Err(format!("{left} requests still open at close").into());
    }
    println!(
        "one_process_1p1d: {REQUESTS} requests, {bytes} bytes moved over shm and verified, \
         {} proxy notifications",
        proxy.totals().0
    );
    Ok(())
}
