//! The completion half of the shm transport.

use std::sync::Arc;
use std::time::Instant;

use kvferry_ring::spsc::Consumer;

use crate::transport::{Completion, Completions, PollStatus};

use crate::transport::credits::Returned;

/// Owns the completion ring's consumer.
pub(super) struct ShmCompletions {
    pub(super) cq: Consumer<Completion>,
    pub(super) returned: Arc<Returned>,
}

impl Completions for ShmCompletions {
    fn poll(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
        deadline: Option<Instant>,
    ) -> PollStatus {
        let returned = &self.returned;
        crate::transport::poll_completion_ring(&mut self.cq, out, max, deadline, |n| {
            returned.add(n)
        })
    }
}
