//! The completion half of the TCP transport.

use std::sync::Arc;
use std::time::Instant;

use kvferry_ring::spsc::Consumer;

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
        let shared = &self.shared;
        crate::transport::poll_completion_ring(&mut self.cq, out, max, deadline, |n| {
            shared.returned.add(n)
        })
    }
}
