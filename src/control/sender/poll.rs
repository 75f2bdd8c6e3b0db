//! The sender's `poll` thread: transport completions → staging frees →
//! chunk counts → a nudge to ctrl, which sends ProxyNotif once a request is
//! complete (ZMQ sockets stay owned by the ctrl thread alone).

use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, debug_span, warn};

use crate::protocol::ErrorCode;
use crate::stats::{Counter, Stage};
use crate::transport::{Completion, CompletionStatus, Completions, PollStatus};

use super::{RequestStatus, Shared};

/// Completions handled per lock acquisition.
const BATCH: usize = 256;

pub(super) fn run(shared: Arc<Shared>, mut completions: Box<dyn Completions>) {
    let span = debug_span!("sender_poll", sender = %shared.cfg.sender_id);
    let _g = span.enter();
    let mut buf: Vec<Completion> = Vec::with_capacity(BATCH);
    loop {
        buf.clear();
        match completions.poll(&mut buf, BATCH, None) {
            PollStatus::Ready(_) => {}
            PollStatus::TimedOut => continue,
            PollStatus::Closed => break,
        }
        let now = Instant::now();
        let mut nudge = false;
        {
            let mut t = shared.table.lock();
            for c in &buf {
                let Some(w) = t.inflight.remove(&c.work_id) else {
                    warn!(work_id = c.work_id, "completion for an unknown write");
                    continue;
                };
                shared.slots.free(w.slots);
                // The transport is done with this op's memory: a registered
                // write's regions may go once its last op gets here.
                if let Some(lease) = w.lease {
                    lease.record(c.status(), w.chunks);
                }
                if c.status() == CompletionStatus::ConnectionLost && !t.lost_peers.contains(&w.peer)
                {
                    // Published under the table lock like `attention`, so
                    // ctrl's pre-sleep check sees it (lost-wakeup safety).
                    t.lost_peers.push(w.peer);
                    nudge = true;
                }
                shared
                    .stats
                    .record(Stage::Transfer, now.saturating_duration_since(w.posted_at));
                let Some(r) = t.reqs.get_mut(w.req) else {
                    continue;
                };
                let done =
                    r.p.write_done(w.chunks as usize, c.ok(), || RequestStatus::Failed {
                        code: ErrorCode::WriteFailed,
                        reason: format!("write failed: {}", c.status()),
                    });
                if c.ok() {
                    r.bytes += w.bytes;
                    r.last_completion_at = Some(now);
                    shared.stats.add(Counter::Chunks, u64::from(w.chunks));
                    shared.stats.add(Counter::Bytes, w.bytes);
                } else if done.aborted {
                    r.aborted();
                    debug!(req_id = %r.req_id, status = %c.status(), "write failed; aborting the request");
                }
                if done.attention {
                    t.attention.push(w.req);
                }
                nudge = true;
            }
        }
        if nudge {
            shared.wake_ctrl();
        }
    }
}
