//! The completion half of the TCP transport.

use std::sync::Arc;
use std::time::Instant;

use kvferry_ring::spsc::Consumer;
use kvferry_ring::WaitStatus;

use crate::transport::{Completion, Completions, PollStatus};

use super::engine::Shared;

/// Owns the completion ring's consumer.
pub(super) struct TcpCompletions {
    pub(super) cq: Consumer<Completion>,
    pub(super) shared: Arc<Shared>,
}

impl Completions for TcpCompletions {
    fn poll(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
        deadline: Option<Instant>,
    ) -> PollStatus {
        let max = max.min(self.cq.capacity());
        if max == 0 {
            return PollStatus::Ready(0);
        }
        loop {
            let start = out.len();
            out.resize(start + max, Completion::default());
            let n = self.cq.pop_into(&mut out[start..]);
            out.truncate(start + n);
            if n > 0 {
                self.shared.returned.add(n);
                return PollStatus::Ready(n);
            }
            match self.cq.wait(deadline) {
                WaitStatus::Ready => {}
                WaitStatus::Closed => return PollStatus::Closed,
                WaitStatus::TimedOut => return PollStatus::TimedOut,
            }
        }
    }
}
