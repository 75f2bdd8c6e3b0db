//! `--consume` for allocations that never get a `TransferDone`: a request of
//! an LMCache peer (which never says `Hello`, so never sends `TransferDone`)
//! and an anonymous batch.
//!
//! A receiver that only counts (`auto_consume`) releases a kvferry request's
//! chunks on its `TransferDone`. An LMCache sender's writes cannot be
//! observed (its data plane is NIXL; it tells only the proxy), so such an
//! allocation counts as delivered a fixed grace after its last reply was
//! sent, and its references are dropped then. This queue holds them until
//! that instant, in reply order.
//!
//! Bounded by what it holds: each entry keeps references on slots (at most
//! the buffer) or dedup pins of requests answered within the last grace.

use std::collections::VecDeque;
use std::time::Instant;

/// One allocation waiting for its grace to pass.
#[derive(Debug)]
struct Entry<T> {
    due: Instant,
    peer: Vec<u8>,
    req_id: String,
    item: T,
}

/// Allocations to consume once their grace has passed, oldest first.
#[derive(Debug)]
pub(crate) struct ConsumeLater<T> {
    queue: VecDeque<Entry<T>>,
}

impl<T> Default for ConsumeLater<T> {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
        }
    }
}

impl<T> ConsumeLater<T> {
    /// Queues `item` (what `peer`'s `req_id` holds; `""` for an anonymous
    /// batch) for consumption at `due`. Entries are consumed in push order;
    /// with a constant grace and a monotonic clock that is `due` order.
    pub fn push(&mut self, due: Instant, peer: &[u8], req_id: &str, item: T) {
        self.queue.push_back(Entry {
            due,
            peer: peer.to_vec(),
            req_id: req_id.to_owned(),
            item,
        });
    }

    /// The oldest entry if its grace has passed at `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<T> {
        if self.queue.front()?.due <= now {
            self.queue.pop_front().map(|e| e.item)
        } else {
            None
        }
    }

    /// Removes and returns the oldest pending entry of `peer`'s `req_id`
    /// (a cancel after the last batch: its references go at once). Linear
    /// in the entries pending; a cancel of an untracked request is rare.
    pub fn take(&mut self, peer: &[u8], req_id: &str) -> Option<T> {
        let at = self
            .queue
            .iter()
            .position(|e| e.peer == peer && e.req_id == req_id)?;
        self.queue.remove(at).map(|e| e.item)
    }

    /// When the oldest entry is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.queue.front().map(|e| e.due)
    }

    /// Entries pending.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn entries_come_out_in_order_once_due() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut q = ConsumeLater::default();
        assert_eq!(q.next_due(), None);
        q.push(t0 + ms(10), b"p", "a", 1);
        q.push(t0 + ms(20), b"p", "b", 2);
        assert_eq!(q.next_due(), Some(t0 + ms(10)));
        assert_eq!(q.pop_due(t0 + ms(9)), None, "not yet");
        assert_eq!(q.pop_due(t0 + ms(10)), Some(1));
        assert_eq!(q.pop_due(t0 + ms(10)), None, "b is due later");
        assert_eq!(q.pop_due(t0 + ms(30)), Some(2));
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn take_finds_the_entry_of_that_peer_and_request_only() {
        let t0 = Instant::now();
        let mut q = ConsumeLater::default();
        q.push(t0, b"p", "a", 1);
        q.push(t0, b"q", "a", 2);
        q.push(t0, b"p", "b", 3);
        assert_eq!(q.take(b"q", "b"), None);
        assert_eq!(q.take(b"q", "a"), Some(2));
        assert_eq!(q.take(b"q", "a"), None, "taken once");
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop_due(t0), Some(1));
        assert_eq!(q.pop_due(t0), Some(3));
    }
}
