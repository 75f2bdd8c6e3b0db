//! The sender: the ctrl thread's per-request decisions are the real
//! `kvferry::sender::core::Progress` (send gate, reply handling, posting
//! order, completion, fenced abort, write completion); this file executes
//! them on the model's state as ctrl.rs and poll.rs do on the engine's
//! (staging and pending-area accounting, the peer's send queue, the wire).
//! The LMCache-mode send queue is the core's `InOrder` too. The caller side
//! (`store`, `unblock`) is still transcribed from src/control/sender/mod.rs
//! (`begin`) and batch.rs; docs/model-check.md maps every function.

use kvferry::sender::core::{AbortStep, Phase, RemoteSlots, ReplyStep, Rules as CoreRules};

use super::config::Cfg;
use super::rx::{decode_seq, Wire};
use super::state::{viol, Data, Out, RState, Reply, State, Status, Write};

/// The core's rules for the configuration.
fn rules(cfg: &Cfg) -> CoreRules {
    CoreRules {
        gate_unadmitted: cfg.rules.gate_unadmitted,
        stage_in_order: cfg.rules.stage_in_order,
    }
}

/// `Sender::store` for the next batch of `r`, up to publishing it on the
/// submission ring (ctrl's `enqueue` is folded in: the ring is FIFO).
/// Returns false if the call cannot be made now (disabled action).
pub fn store(cfg: &Cfg, st: &mut State, r: usize) -> bool {
    let s = cfg.reqs[r].sender;
    let q = &st.reqs[r];
    if st.snd[s].blocked_on.is_some() || !q.p.state.live() {
        return false;
    }
    let b = q.stored as usize;
    if b >= cfg.reqs[r].batches.len() {
        return false;
    }
    let n = cfg.reqs[r].batches[b];
    let staged_path = q.p.state == RState::Admitted || cfg.rules.stage_before_admission;
    if !staged_path && st.snd[s].pending_used + n > cfg.pending_max {
        // Backpressure: the caller gets the error at once and retries later.
        return false;
    }
    let last = b + 1 == cfg.reqs[r].batches.len();
    let q = &mut st.reqs[r];
    q.registered = true;
    q.count.chunks += n as usize;
    if last {
        q.count.last = true;
    }
    if staged_path {
        // `slots.alloc(n, deadline, cancel)`: all-or-nothing, FIFO, blocking.
        if st.snd[s].staging_free >= n {
            st.snd[s].staging_free -= n;
            publish(st, r, b, Data::Staged(n));
        } else {
            st.snd[s].blocked_on = Some(r as u8);
        }
    } else {
        st.snd[s].pending_used += n;
        publish(st, r, b, Data::Pending(n));
    }
    true
}

fn publish(st: &mut State, r: usize, b: usize, data: Data) {
    let q = &mut st.reqs[r];
    q.batches[b].data = data;
    q.p.queued.push_back(b as u64);
    q.stored += 1;
}

/// The blocked caller of sender `s` returns from `slots.alloc`: granted when
/// enough slots are free, or woken by the request's cancel token.
pub fn unblock(cfg: &Cfg, st: &mut State, s: usize) -> bool {
    let Some(r) = st.snd[s].blocked_on else {
        return false;
    };
    let r = r as usize;
    let b = st.reqs[r].stored as usize;
    let n = cfg.reqs[r].batches[b];
    let last = b + 1 == cfg.reqs[r].batches.len();
    if !st.reqs[r].p.state.live() {
        // AllocError::Cancelled → `undo`, StoreError::Cancelled.
        let q = &mut st.reqs[r];
        q.count = q.count.unreserve(n as usize, last);
        st.snd[s].blocked_on = None;
        return true;
    }
    if st.snd[s].staging_free < n {
        return false;
    }
    st.snd[s].staging_free -= n;
    st.snd[s].blocked_on = None;
    publish(st, r, b, Data::Staged(n));
    true
}

/// `Sender::cancel_request`.
pub fn cancel(cfg: &Cfg, st: &mut State, r: usize) -> bool {
    let q = &mut st.reqs[r];
    cfg.reqs[r].may_abort && q.registered && q.p.abort_with(Status::Cancelled)
}

/// Returns a batch's bytes (`release_data`).
fn release(cfg: &Cfg, st: &mut State, r: usize, b: usize) {
    let s = cfg.reqs[r].sender;
    match std::mem::replace(&mut st.reqs[r].batches[b].data, Data::Gone) {
        Data::Gone => {}
        Data::Pending(n) => match st.snd[s].pending_used.checked_sub(n) {
            Some(v) => st.snd[s].pending_used = v,
            None => st.viol |= viol::ACCOUNTING,
        },
        Data::Staged(n) => give_staging(cfg, st, s, n),
    }
}

fn give_staging(cfg: &Cfg, st: &mut State, s: usize, n: u8) {
    st.snd[s].staging_free += n;
    if st.snd[s].staging_free > cfg.staging {
        st.viol |= viol::ACCOUNTING;
    }
}

/// Sends a message on sender `s`'s DEALER (`send_batch` / `send_cancel`):
/// pipelined, or through the core's one-at-a-time queue.
fn send(cfg: &Cfg, st: &mut State, s: usize, o: Out) {
    let w = match o {
        Out::Batch(req, batch) => Wire::Alloc { req, batch },
        Out::Cancel(req) => Wire::Cancel {
            req,
            sent: st.reqs[req as usize].sent,
        },
    };
    if !cfg.rules.one_outstanding || st.snd[s].out.send(o, (), || w.clone()) {
        st.to_rx[s].push_back(w);
    }
}

/// `Ctrl::progress` for request `r` (dispatching to `progress_abort` or
/// `progress_live`). The model runs it whenever it changes something; the
/// engine runs it when `r` is dirty.
pub fn progress(cfg: &Cfg, st: &mut State, r: usize) {
    match st.reqs[r].p.state {
        Phase::Done(_) => {}
        Phase::Aborting(_) => progress_abort(cfg, st, r),
        Phase::Pending | Phase::Admitted => progress_live(cfg, st, r),
    }
}

/// `Ctrl::progress_abort`: the core's `abort_step`.
fn progress_abort(cfg: &Cfg, st: &mut State, r: usize) {
    let s = cfg.reqs[r].sender;
    let mut dropped = Vec::new();
    let step = st.reqs[r].p.abort_step(|b| dropped.push(b));
    for b in dropped {
        release(cfg, st, r, b as usize);
    }
    if let AbortStep::Finish { cancel, status } = step {
        if cancel {
            send(cfg, st, s, Out::Cancel(r as u8));
        }
        finish(cfg, st, r, status);
    }
}

/// `Ctrl::finish`: the request ends; a one-request-at-a-time receiver is
/// free for the next.
fn finish(cfg: &Cfg, st: &mut State, r: usize, status: Status) {
    st.reqs[r].p.finish(status);
    let s = cfg.reqs[r].sender;
    st.snd[s].turn.release(&(r as u8));
}

/// `Ctrl::progress_live`: send what the core allows, post answered batches
/// in the core's order, complete.
fn progress_live(cfg: &Cfg, st: &mut State, r: usize) {
    let s = cfg.reqs[r].sender;
    // 1. Send what may be sent.
    let turn = cfg
        .rules
        .one_request_at_a_time
        .then_some(&mut st.snd[s].turn);
    let sendable = st.reqs[r].p.sendable(rules(cfg), turn, &(r as u8));
    for _ in 0..sendable {
        let Some((b, _first)) = st.reqs[r].p.next_to_send() else {
            break;
        };
        let q = &mut st.reqs[r];
        q.sent = q.sent.max(b as u8 + 1);
        send(cfg, st, s, Out::Batch(r as u8, b as u8));
    }
    // 2. Stage and post answered batches (`stage_and_post` on each), the
    // progress taken out of the state meanwhile as ctrl does.
    let mut p = std::mem::take(&mut st.reqs[r].p);
    p.post_answered(rules(cfg), |b| stage_and_post(cfg, st, r, b as u8));
    st.reqs[r].p = p;
    // 3. Complete.
    if st.reqs[r].p.is_complete(st.reqs[r].count) {
        notify_proxy(cfg, st, r);
        if cfg.rules.hello {
            st.to_rx[s].push_back(Wire::Done { req: r as u8 });
        }
        finish(cfg, st, r, Status::Completed);
    }
}

/// `Ctrl::stage_and_post`: `None` if the batch's bytes are in the pending
/// area and staging cannot take them now; else the writes posted (one: the
/// batch's chunks are contiguous on both sides, so they coalesce).
fn stage_and_post(cfg: &Cfg, st: &mut State, r: usize, b: u8) -> Option<usize> {
    let s = cfg.reqs[r].sender;
    let bi = b as usize;
    if let Data::Pending(n) = st.reqs[r].batches[bi].data {
        let w = st.reqs[r].batches[bi].writes.len() as u8;
        // `slots.try_alloc`: FIFO semaphore, refuses while a caller waits.
        if st.snd[s].blocked_on.is_some() || st.snd[s].staging_free < w {
            return None;
        }
        st.snd[s].staging_free -= w;
        st.snd[s].pending_used -= n;
        st.reqs[r].batches[bi].data = Data::Staged(w);
    }
    let chunks = std::mem::take(&mut st.reqs[r].batches[bi].writes);
    let data = std::mem::replace(&mut st.reqs[r].batches[bi].data, Data::Gone);
    if data != Data::Staged(chunks.len() as u8) || chunks.is_empty() {
        // Empty writes are released at the reply; staged data matches writes.
        st.viol |= viol::ACCOUNTING;
    }
    let pos = st
        .writes
        .partition_point(|x| (x.req, x.batch) < (r as u8, b));
    st.writes.insert(
        pos,
        Write {
            req: r as u8,
            batch: b,
            chunks,
        },
    );
    Some(1)
}

/// The proxy receives ProxyNotif (PUSH/PULL; nothing depends on when it is
/// delivered, so delivery is folded into the send). Checks invariant 3
/// against ground truth: every chunk's bytes are in its receiver slot.
fn notify_proxy(cfg: &Cfg, st: &mut State, r: usize) {
    st.proxy[r] += 1;
    if st.proxy[r] > 1 {
        st.viol |= viol::NOTIFY_TWICE;
    }
    for (pos, &key) in cfg.reqs[r].keys.iter().enumerate() {
        let in_place = st.req_slot[r][pos].is_some_and(|x| st.slot_data[x as usize] == Some(key));
        if !in_place {
            st.viol |= viol::NOTIFY_EARLY;
        }
    }
}

/// The ctrl thread reads one reply from sender `s`'s DEALER (`on_reply`).
pub fn on_reply(cfg: &Cfg, st: &mut State, s: usize) -> bool {
    let Some(reply) = st.to_tx[s].pop_front() else {
        return false;
    };
    let (o, next) = match reply.seq {
        Some(seq) => match decode_seq(seq) {
            (r, Some(b)) => (Some(Out::Batch(r, b)), None),
            (r, None) => (Some(Out::Cancel(r)), None),
        },
        None => st.snd[s].out.answered(()),
    };
    if let Some(Out::Batch(r, b)) = o {
        on_batch_reply(cfg, st, r as usize, b as usize, &reply);
    }
    // `send_next`.
    if let Some(w) = next {
        st.to_rx[s].push_back(w);
    }
    true
}

/// `Ctrl::on_batch_reply`: the core reads the reply; the data follows.
fn on_batch_reply(cfg: &Cfg, st: &mut State, r: usize, b: usize, resp: &Reply) {
    let s = cfg.reqs[r].sender;
    let keys = cfg.reqs[r].batch_keys(b);
    let n = keys.len();
    let last = b + 1 == cfg.reqs[r].batches.len();
    // Chunks of one byte: the model's slots hold any of them.
    let slots = RemoteSlots {
        capacity: cfg.capacity as u64,
        bytes: 1,
    };
    let reply = st.reqs[r]
        .p
        .on_reply(b as u64, &vec![1; n], last, slots, &resp.to_response());
    let (remote, dedup) = match reply.step {
        ReplyStep::Abort | ReplyStep::Release | ReplyStep::AllHeld => {
            return release(cfg, st, r, b)
        }
        ReplyStep::Write { remote, dedup } => (remote, dedup),
    };
    let writes: Vec<(u8, u8)> = (0..n)
        .filter(|j| !dedup.contains(j))
        .map(|j| (keys[j], remote[j] as u8))
        .collect();
    let q = &mut st.reqs[r];
    let freed = match q.batches[b].data {
        // Dedup'd chunks release their staging at once.
        Data::Staged(m) if !dedup.is_empty() => {
            q.batches[b].data = Data::Staged(writes.len() as u8);
            Some(m - writes.len() as u8)
        }
        _ => None,
    };
    q.batches[b].writes = writes;
    if let Some(freed) = freed {
        give_staging(cfg, st, s, freed);
    }
}

/// A posted write completes (it landed at the receiver) and the poll thread
/// handles the completion (`poll::run`: the core's `write_done`).
pub fn complete(cfg: &Cfg, st: &mut State, i: usize) {
    let w = st.writes.remove(i);
    let r = w.req as usize;
    for &(key, slot) in &w.chunks {
        let x = slot as usize;
        if st.slot_hold[x] & (1 << r) == 0 || st.slot_key[x] != Some(key) {
            st.viol |= viol::UNFENCED_WRITE;
        }
        st.slot_data[x] = Some(key);
    }
    let s = cfg.reqs[r].sender;
    give_staging(cfg, st, s, w.chunks.len() as u8);
    st.reqs[r]
        .p
        .write_done(w.chunks.len(), true, || Status::Failed);
}
