//! The run's worker threads: prefillers that store chunked requests
//! (interleaving batches of their requests in flight, like an inference
//! worker running chunked prefill for several prompts), and decoders that
//! verify and consume each request once the proxy says it is complete.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver as Rx, RecvTimeoutError, Sender as Tx};
use rand::{Rng, SeedableRng};
use tracing::{debug, warn};

use crate::proxy::ProxyListener;
use crate::sender::{Request, RequestSpec, RequestStatus, Sender, StoreError, TransferSpec};

use super::payload::ChunkId;
use super::{Planned, Run, RunConfig};

/// The running worker threads.
pub(super) struct Handles {
    prefillers: Vec<JoinHandle<()>>,
    decoders: Vec<JoinHandle<()>>,
    decoder_tx: Vec<Tx<String>>,
}

impl Handles {
    /// Waits for the prefillers, then lets the decoders drain and stop;
    /// each group gets `limit` in all (a worker still running then is
    /// detached with a warning, see [`crate::threads::join_within`]).
    pub fn join(self, limit: Duration) {
        let join_all = |threads: Vec<JoinHandle<()>>, what: &str| {
            let end = Instant::now() + limit;
            for t in threads {
                let left = end.saturating_duration_since(Instant::now());
                let _ = crate::threads::join_within(t, left, what);
            }
        };
        join_all(self.prefillers, "runner prefiller");
        drop(self.decoder_tx);
        join_all(self.decoders, "runner decoder");
    }
}

/// Starts decoders, hooks the proxy and the senders' callbacks, and starts
/// the prefillers.
pub(super) fn start(run: &Arc<Run>, proxy: Option<&ProxyListener>) -> std::io::Result<Handles> {
    let mut decoder_tx = Vec::new();
    let mut decoders = Vec::new();
    for d in 0..run.receivers.len() {
        let (tx, rx) = unbounded::<String>();
        decoder_tx.push(tx);
        let run = Arc::clone(run);
        decoders.push(crate::threads::spawn_named(
            &format!("kvf-decoder-{d}"),
            None,
            move || decode_loop(&run, d, &rx),
        )?);
    }
    // The proxy routes each complete request to its decoder, like a request
    // router would.
    if let Some(proxy) = proxy {
        let run = Arc::clone(run);
        let routes = decoder_tx.clone();
        proxy.set_callback(move |n| {
            let d = run.planned.lock().get(&n.req_id).map(|p| p.decoder);
            if let Some(d) = d {
                let _ = routes[d].send(n.req_id.clone());
            }
        });
    }
    // Each prefiller learns of its requests' terminal statuses here.
    let mut done_rx = Vec::new();
    for (p, sender) in run.senders.iter().enumerate() {
        let (tx, rx) = unbounded::<(String, RequestStatus)>();
        done_rx.push(rx);
        let run2 = Arc::clone(run);
        let fail_injected = run.cfg.fail_rate > 0.0;
        let local_decoders = !run.receivers.is_empty();
        sender.set_callback(move |req, status| {
            if *status != RequestStatus::Completed || !local_decoders {
                // In-process, completed requests are counted by their
                // decoder once verified.
                run2.finish(status, fail_injected);
                run2.planned.lock().remove(req);
            }
            let _ = tx.send((req.to_owned(), status.clone()));
            debug!(prefiller = p, req, ?status, "terminal");
        });
    }
    let mut prefillers = Vec::new();
    let per = run.cfg.requests / run.cfg.prefillers;
    let extra = run.cfg.requests % run.cfg.prefillers;
    let mut first = 0u64;
    for (p, rx) in done_rx.into_iter().enumerate() {
        let quota = per + usize::from(p < extra);
        let run = Arc::clone(run);
        let start = first;
        first += quota as u64;
        prefillers.push(crate::threads::spawn_named(
            &format!("kvf-prefill-{p}"),
            None,
            move || prefill_loop(&run, p, start, quota, &rx),
        )?);
    }
    Ok(Handles {
        prefillers,
        decoders,
        decoder_tx,
    })
}

/// One request being stored.
struct Active {
    req_id: String,
    id: u64,
    total: u32,
    next: u32,
    decoder: usize,
    /// Cancel after storing this many chunks (deliberate abort).
    abort_after: Option<u32>,
    /// The handle (in-place mode: begun when the request starts, so its
    /// admission runs while earlier requests are still being filled).
    req: Option<Request>,
}

/// Fills staging in place with chunks `next..next + n` of `a` and submits
/// them (the in-place path: no sender copy).
fn stage_batch(run: &Run, a: &Active, req: &Request, n: u32) -> Result<(), StoreError> {
    let mut batch = req.stage(n as usize, Instant::now() + run.cfg.stall_timeout())?;
    let mut lens = Vec::with_capacity(n as usize);
    for (slot, index) in batch.slots_mut().zip(a.next..a.next + n) {
        let id = ChunkId {
            request: a.id,
            index,
            total: a.total,
        };
        lens.push(run.payloads.fill_slice(id, slot) as u32);
    }
    batch.submit(&keys_of(&run.cfg, a, n), &lens)
}

/// The keys of chunks `next..next + n` of `a`, in the configured format.
fn keys_of(cfg: &RunConfig, a: &Active, n: u32) -> Vec<String> {
    (a.next..a.next + n)
        .map(|index| {
            let id = ChunkId {
                request: a.id,
                index,
                total: a.total,
            };
            cfg.chunk_key(&id, &a.req_id)
        })
        .collect()
}

/// Copies chunks `next..next + n` of `a` in with `store` (the copying path).
fn store_batch(
    run: &Run,
    sender: &Sender,
    a: &Active,
    n: u32,
    bufs: &mut [Vec<u8>],
) -> Result<(), StoreError> {
    let last = a.next + n == a.total;
    for (k, index) in (a.next..a.next + n).enumerate() {
        run.payloads.fill(
            ChunkId {
                request: a.id,
                index,
                total: a.total,
            },
            &mut bufs[k],
        );
    }
    let chunks: Vec<&[u8]> = bufs[..n as usize].iter().map(Vec::as_slice).collect();
    let spec = TransferSpec::new(&a.req_id, &run.endpoints[a.decoder], a.total as usize, last);
    sender.store(&spec, &keys_of(&run.cfg, a, n), &chunks)
}

fn prefill_loop(
    run: &Arc<Run>,
    p: usize,
    first: u64,
    quota: usize,
    done: &Rx<(String, RequestStatus)>,
) {
    let cfg = &run.cfg;
    let sender = &run.senders[p];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(cfg.seed ^ (0xA5A5_0000 + p as u64));
    let mut active: Vec<Active> = Vec::new();
    let mut in_flight = 0usize; // started and not terminal
    let mut started = 0usize;
    let mut bufs: Vec<Vec<u8>> = (0..cfg.batch)
        .map(|_| Vec::with_capacity(cfg.chunk_bytes as usize))
        .collect();
    // Acquire: pairs with the Release store that ends the run.
    while !run.stop.load(Ordering::Acquire) {
        while let Ok((_, _)) = done.try_recv() {
            in_flight -= 1;
        }
        if started == quota && in_flight == 0 {
            break;
        }
        // Start new requests up to the concurrency.
        while started < quota && in_flight < cfg.concurrency {
            let id = first + started as u64;
            let total = rng.random_range(cfg.chunks.min..=cfg.chunks.max);
            let decoder = (id as usize) % cfg.decoders;
            let abort_after = rng
                .random_bool(cfg.abort_rate)
                .then(|| rng.random_range(0..total));
            let req_id = format!("{}{p}-r{id}", run.prefix);
            let req = if cfg.copy_store {
                None
            } else {
                let spec = RequestSpec::new(&req_id, &run.endpoints[decoder], total as usize);
                match sender.begin(spec) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        warn!(req = %req_id, error = %e, "cannot begin the request");
                        run.finish(
                            &RequestStatus::Failed {
                                code: crate::protocol::ErrorCode::PeerUnavailable,
                                reason: e.to_string(),
                            },
                            false,
                        );
                        started += 1;
                        continue;
                    }
                }
            };
            run.planned.lock().insert(
                req_id.clone(),
                Planned {
                    request: id,
                    total,
                    decoder,
                    started: Instant::now(),
                },
            );
            active.push(Active {
                req_id,
                id,
                total,
                next: 0,
                decoder,
                abort_after,
                req,
            });
            started += 1;
            in_flight += 1;
        }
        // One batch of each active request per round (interleaved chunked
        // prefill across requests).
        let mut progressed = false;
        let mut i = 0;
        while i < active.len() {
            let a = &mut active[i];
            if a.abort_after.is_some_and(|k| a.next >= k) {
                if !sender.cancel_request(&a.req_id) && sender.status(&a.req_id).is_none() {
                    // Cancelled before its first batch: the sender never
                    // saw it, so no callback will report it.
                    run.finish(&RequestStatus::Cancelled, false);
                    run.planned.lock().remove(&a.req_id);
                    in_flight -= 1;
                }
                active.swap_remove(i);
                progressed = true;
                continue;
            }
            let n = (cfg.batch as u32).min(a.total - a.next);
            let last = a.next + n == a.total;
            let res = match &a.req {
                // Not admitted yet: staging waits for admission; serve the
                // other requests meanwhile.
                Some(req) if !req.is_admitted() && !req.status().is_terminal() => {
                    i += 1;
                    continue;
                }
                Some(req) => stage_batch(run, a, req, n),
                None => store_batch(run, sender, a, n, &mut bufs),
            };
            match res {
                Ok(()) => {
                    a.next += n;
                    progressed = true;
                    if last {
                        active.swap_remove(i);
                        continue;
                    }
                }
                Err(StoreError::Backpressure { .. }) => {}
                Err(StoreError::Cancelled | StoreError::RequestEnded(_)) => {
                    // Failed underneath us (e.g. an injected write failure);
                    // its terminal status arrives through the callback.
                    active.swap_remove(i);
                    progressed = true;
                    continue;
                }
                Err(e) => {
                    warn!(req = %a.req_id, error = %e, "store failed; cancelling the request");
                    sender.cancel_request(&a.req_id);
                    active.swap_remove(i);
                    progressed = true;
                    continue;
                }
            }
            i += 1;
        }
        let waiting = active
            .iter()
            .find_map(|a| a.req.as_ref().filter(|r| !r.is_admitted()));
        if let (false, Some(req)) = (progressed, waiting) {
            // Nothing to fill until a request is admitted: wait for that
            // (holding no staging: a zero-slot batch), briefly, then look
            // at the terminal statuses again.
            let _ = req.stage(0, Instant::now() + Duration::from_millis(5));
        } else if !progressed || active.is_empty() {
            // Nothing to do until a request ends (or pending space frees).
            match done.recv_timeout(Duration::from_millis(5)) {
                Ok(_) => in_flight -= 1,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
    }
}

fn decode_loop(run: &Arc<Run>, d: usize, rx: &Rx<String>) {
    let receiver = &run.receivers[d];
    loop {
        let req_id = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => {
                // Acquire: pairs with the Release store that ends the run.
                if run.stop.load(Ordering::Acquire) {
                    return;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let Some(plan) = run.planned.lock().remove(&req_id) else {
            continue;
        };
        // ProxyNotif and TransferDone travel on different sockets: wait for
        // the receiver to know the request is complete.
        let deadline = Instant::now() + run.cfg.stall_timeout();
        if let Err(e) = receiver.wait_ready(&req_id, deadline) {
            warn!(req = %req_id, error = %e, "proxy said ready but the receiver did not");
            run.tally
                .mismatches
                .fetch_add(u64::from(plan.total), Ordering::Relaxed);
            run.finish(&RequestStatus::Completed, false);
            continue;
        }
        let mut bad = 0u64;
        for index in 0..plan.total {
            let id = ChunkId {
                request: plan.request,
                index,
                total: plan.total,
            };
            match receiver.get(&run.cfg.chunk_key(&id, &req_id)) {
                Some(chunk) => {
                    if !run.payloads.verify(id, chunk.bytes()) {
                        bad += 1;
                    }
                }
                None => bad += 1,
            }
        }
        if bad > 0 {
            warn!(req = %req_id, bad, "chunks did not verify");
            run.tally.mismatches.fetch_add(bad, Ordering::Relaxed);
        }
        let us = plan.started.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
        let _ = run.end_to_end.lock().record(us.max(1));
        run.finish(&RequestStatus::Completed, false);
    }
}
