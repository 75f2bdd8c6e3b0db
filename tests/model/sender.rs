//! The sender's rules, transcribed from src/control/sender/{mod,ctrl,poll}.rs (the
//! engine has no pure sender core). Each function names the engine function
//! it mirrors; docs/model-check.md maps them line by line.

use super::config::Cfg;
use super::rx::{decode_seq, Wire};
use super::state::{viol, Data, Out, RState, Reply, State, Status, Write};

/// `Sender::store` for the next batch of `r`, up to publishing it on the
/// submission ring (ctrl's `enqueue` is folded in: the ring is FIFO).
/// Returns false if the call cannot be made now (disabled action).
pub fn store(cfg: &Cfg, st: &mut State, r: usize) -> bool {
    let s = cfg.reqs[r].sender;
    let q = &st.reqs[r];
    if st.snd[s].blocked_on.is_some() || !q.state.live() {
        return false;
    }
    let b = q.stored as usize;
    if b >= cfg.reqs[r].batches.len() {
        return false;
    }
    let n = cfg.reqs[r].batches[b];
    let staged_path = q.state == RState::Admitted || cfg.rules.stage_before_admission;
    if !staged_path && st.snd[s].pending_used + n > cfg.pending_max {
        // Backpressure: the caller gets the error at once and retries later.
        return false;
    }
    let last = b + 1 == cfg.reqs[r].batches.len();
    let q = &mut st.reqs[r];
    q.registered = true;
    q.stored_chunks += n;
    if last {
        q.last_stored = true;
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
    q.queued.push_back(b as u8);
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
    if !st.reqs[r].state.live() {
        // AllocError::Cancelled → `undo`, StoreError::Cancelled.
        let q = &mut st.reqs[r];
        q.stored_chunks -= n;
        if last {
            q.last_stored = false;
        }
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
    if !cfg.reqs[r].may_abort || !q.registered || !q.state.live() {
        return false;
    }
    q.state = RState::Aborting(Status::Cancelled);
    true
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
/// pipelined, or behind the one outstanding message.
fn send(cfg: &Cfg, st: &mut State, s: usize, o: Out) {
    if cfg.rules.one_outstanding && st.snd[s].fifo.is_some() {
        st.snd[s].waiting.push_back(o);
        return;
    }
    if cfg.rules.one_outstanding {
        st.snd[s].fifo = Some(o);
    }
    let w = match o {
        Out::Batch(req, batch) => Wire::Alloc { req, batch },
        Out::Cancel(req) => Wire::Cancel {
            req,
            sent: st.reqs[req as usize].sent,
        },
    };
    st.to_rx[s].push_back(w);
}

/// `Ctrl::progress` for request `r` (dispatching to `progress_abort` or
/// `progress_live`). The model runs it whenever it changes something; the
/// engine runs it when `r` is dirty.
pub fn progress(cfg: &Cfg, st: &mut State, r: usize) {
    match st.reqs[r].state {
        RState::Done(_) => {}
        RState::Aborting(status) => progress_abort(cfg, st, r, status),
        RState::Pending | RState::Admitted => progress_live(cfg, st, r),
    }
}

fn progress_abort(cfg: &Cfg, st: &mut State, r: usize, status: Status) {
    let s = cfg.reqs[r].sender;
    let drop_ids: Vec<u8> = {
        let q = &mut st.reqs[r];
        q.queued.drain(..).chain(q.unstaged.drain(..)).collect()
    };
    for b in drop_ids {
        release(cfg, st, r, b as usize);
    }
    let q = &st.reqs[r];
    if q.in_flight_ops > 0 || q.cancel_sent {
        return;
    }
    if q.first_sent {
        st.reqs[r].cancel_sent = true;
        send(cfg, st, s, Out::Cancel(r as u8));
    }
    finish(cfg, st, r, status);
}

fn finish(cfg: &Cfg, st: &mut State, r: usize, status: Status) {
    st.reqs[r].state = RState::Done(status);
    let s = cfg.reqs[r].sender;
    if st.snd[s].legacy_active == Some(r as u8) {
        st.snd[s].legacy_active = None;
    }
}

fn progress_live(cfg: &Cfg, st: &mut State, r: usize) {
    let s = cfg.reqs[r].sender;
    let q = &st.reqs[r];
    // 1. Send what may be sent.
    let sendable = if q.state == RState::Admitted || !cfg.rules.gate_unadmitted {
        q.queued.len()
    } else if !q.first_sent && !q.queued.is_empty() {
        if cfg.rules.one_request_at_a_time
            && st.snd[s].legacy_active.is_some_and(|a| a as usize != r)
        {
            0
        } else {
            1
        }
    } else {
        0
    };
    for _ in 0..sendable {
        let Some(b) = st.reqs[r].queued.pop_front() else {
            break;
        };
        let q = &mut st.reqs[r];
        q.awaiting_reply += 1;
        q.first_sent = true;
        q.sent = q.sent.max(b + 1);
        send(cfg, st, s, Out::Batch(r as u8, b));
    }
    if cfg.rules.one_request_at_a_time && sendable > 0 {
        st.snd[s].legacy_active = Some(r as u8);
    }
    // 2. Stage and post answered batches (`stage_and_post` on each).
    let ids: Vec<u8> = st.reqs[r].unstaged.iter().copied().collect();
    for b in ids {
        if stage_and_post(cfg, st, r, b) {
            st.reqs[r].unstaged.retain(|&x| x != b);
        } else if cfg.rules.stage_in_order {
            break;
        }
    }
    // 3. Complete.
    if is_complete(&st.reqs[r]) {
        notify_proxy(cfg, st, r);
        if cfg.rules.hello {
            st.to_rx[s].push_back(Wire::Done { req: r as u8 });
        }
        finish(cfg, st, r, Status::Completed);
    }
}

/// `Ctrl::stage_and_post`: false if the batch's bytes are in the pending
/// area and staging cannot take them now.
fn stage_and_post(cfg: &Cfg, st: &mut State, r: usize, b: u8) -> bool {
    let s = cfg.reqs[r].sender;
    let bi = b as usize;
    if let Data::Pending(n) = st.reqs[r].batches[bi].data {
        let w = st.reqs[r].batches[bi].writes.len() as u8;
        // `slots.try_alloc`: FIFO semaphore, refuses while a caller waits.
        if st.snd[s].blocked_on.is_some() || st.snd[s].staging_free < w {
            return false;
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
    st.reqs[r].in_flight_ops += 1;
    true
}

/// `Req::is_complete`.
fn is_complete(q: &super::state::SReq) -> bool {
    q.state == RState::Admitted
        && q.last_stored
        && q.last_replied
        && q.queued.is_empty()
        && q.unstaged.is_empty()
        && q.awaiting_reply == 0
        && q.in_flight_ops == 0
        && q.completed_chunks == q.stored_chunks
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
    let o = match reply.seq {
        Some(seq) => match decode_seq(seq) {
            (r, Some(b)) => Some(Out::Batch(r, b)),
            (r, None) => Some(Out::Cancel(r)),
        },
        None => st.snd[s].fifo.take(),
    };
    if let Some(Out::Batch(r, b)) = o {
        on_batch_reply(cfg, st, r as usize, b as usize, &reply);
    }
    if cfg.rules.one_outstanding && st.snd[s].fifo.is_none() {
        // `send_waiting`.
        if let Some(next) = st.snd[s].waiting.pop_front() {
            send(cfg, st, s, next);
        }
    }
    true
}

/// `Ctrl::on_batch_reply`.
fn on_batch_reply(cfg: &Cfg, st: &mut State, r: usize, b: usize, resp: &Reply) {
    let s = cfg.reqs[r].sender;
    let keys = cfg.reqs[r].batch_keys(b);
    let n = keys.len();
    let q = &mut st.reqs[r];
    q.awaiting_reply = q.awaiting_reply.saturating_sub(1);
    let bad_shape = resp.remote.len() != n.max(1) && !(n == 0 && resp.remote.is_empty());
    let out_of_range = resp
        .remote
        .iter()
        .any(|&x| x < 0 || x >= cfg.capacity as i64)
        || resp.already.iter().any(|&x| x < 0 || x as usize >= n);
    if resp.failed || bad_shape || out_of_range {
        if q.state.live() {
            q.state = RState::Aborting(Status::Failed);
        }
        return release(cfg, st, r, b);
    }
    if !q.state.live() {
        return release(cfg, st, r, b);
    }
    if q.state == RState::Pending {
        q.state = RState::Admitted;
    }
    q.completed_chunks += resp.already.len() as u8;
    if b + 1 == cfg.reqs[r].batches.len() {
        q.last_replied = true;
    }
    let writes: Vec<(u8, u8)> = (0..n)
        .filter(|j| !resp.already.contains(&(*j as i64)))
        .map(|j| (keys[j], resp.remote[j] as u8))
        .collect();
    if writes.is_empty() {
        return release(cfg, st, r, b);
    }
    if let Data::Staged(m) = q.batches[b].data {
        if !resp.already.is_empty() {
            q.batches[b].data = Data::Staged(writes.len() as u8);
            let freed = m - writes.len() as u8;
            q.batches[b].writes = writes;
            q.unstaged.push_back(b as u8);
            return give_staging(cfg, st, s, freed);
        }
    }
    q.batches[b].writes = writes;
    q.unstaged.push_back(b as u8);
}

/// A posted write completes (it landed at the receiver) and the poll thread
/// handles the completion (`poll::run`).
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
    let q = &mut st.reqs[r];
    q.in_flight_ops -= 1;
    q.completed_chunks += w.chunks.len() as u8;
}
