//! What decoder threads call (under the receiver's lock): borrows, removal,
//! taking a complete request whole, and the types of [`ReceiverCore::take`]
//! (a method group of [`ReceiverCore`]).

use std::time::{Duration, Instant};

use super::super::keys::{Borrowed, Unref};
use super::{Output, PeerId, ReceiverCore};

/// One chunk of a request handed to the decoder by [`ReceiverCore::take`]:
/// a borrow of the copy `(key, gen)`, ended with
/// [`ReceiverCore::end_borrow`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenChunk {
    /// The key.
    pub key: String,
    /// Generation of the copy borrowed.
    pub gen: u64,
    /// Slot index in the receive buffer.
    pub slot: u32,
    /// The chunk's length in bytes (at most a slot).
    pub len: u64,
    /// Token count if this was a batch's (possibly short) last chunk.
    pub tokens: Option<u32>,
}

/// Why [`ReceiverCore::take`] handed out nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TakeError {
    /// No complete request of that id waits to be taken: it is still in
    /// flight, failed, was already taken, expired unconsumed, completed
    /// without `TransferDone` (LMCache senders: read those by key), or the
    /// receiver consumes automatically.
    #[error("request {0} has no complete chunks waiting to be taken")]
    NotReady(String),
    /// Several peers completed a request of that id: which one is meant is
    /// unknown, so none is handed out (read them by key instead).
    #[error("{peers} peers completed a request named {req_id}; take refuses to guess")]
    Ambiguous {
        /// The request id.
        req_id: String,
        /// How many peers completed one.
        peers: usize,
    },
    /// A chunk of the request was already consumed by key
    /// (`get`/`remove`): the request is now only readable by key.
    #[error("chunk {key} of request {req_id} was already consumed by key")]
    Consumed {
        /// The request id.
        req_id: String,
        /// The first chunk found consumed.
        key: String,
    },
}

impl ReceiverCore {
    /// Claims one reference of a ready copy of `key` as a decoder borrow.
    pub fn borrow(&mut self, key: &str) -> Option<Borrowed> {
        self.keys.borrow(key)
    }

    /// Ends a borrow of the copy of generation `gen` (from [`Borrowed`]),
    /// consuming its reference; frees the slot if it was the last. Returns
    /// true if capacity was freed.
    pub fn end_borrow(&mut self, key: &str, gen: u64, now: Instant, out: &mut Vec<Output>) -> bool {
        let u = self.keys.end_borrow(key, gen);
        let freed = self.release(u);
        if freed {
            self.grant_parked(now, out);
        }
        freed
    }

    /// Drops one unborrowed reference of `key` (decoder `remove`). Returns
    /// false if the key is not held or all its references are borrowed.
    pub fn remove_key(&mut self, key: &str, now: Instant, out: &mut Vec<Output>) -> bool {
        match self.keys.unref(key) {
            Unref::NotHeld => false,
            u => {
                if self.release(u) {
                    self.grant_parked(now, out);
                }
                true
            }
        }
    }

    /// Borrows every chunk of the complete request `req_id`, in key order
    /// (the order its batches named them), each as a claim on the
    /// request's own reference; end each with [`ReceiverCore::end_borrow`].
    /// Only requests completed with `TransferDone` are taken (their bytes
    /// are known to be in place); a request is taken at most once.
    ///
    /// Requests are the peer's: when several peers completed a request of
    /// this id and none was taken yet, this is [`TakeError::Ambiguous`].
    /// When a chunk was consumed by key meanwhile, [`TakeError::Consumed`]:
    /// nothing is borrowed and the request is readable by key only.
    pub fn take(&mut self, req_id: &str) -> Result<Vec<TakenChunk>, TakeError> {
        let peers: Vec<PeerId> = self
            .delivered
            .peers_of(req_id)
            .map(<[u8]>::to_vec)
            .collect();
        let peer = match peers.as_slice() {
            [] => return Err(TakeError::NotReady(req_id.to_owned())),
            [one] => one,
            more => {
                return Err(TakeError::Ambiguous {
                    req_id: req_id.to_owned(),
                    peers: more.len(),
                })
            }
        };
        let Some(d) = self.delivered.remove(peer, req_id) else {
            return Err(TakeError::NotReady(req_id.to_owned()));
        };
        self.delivered_bytes -= d.charge;
        let mut taken = Vec::with_capacity(d.chunks.len());
        for (key, gen, len, tokens) in d.chunks {
            match self.keys.borrow_gen(&key, gen) {
                Some(b) => taken.push(TakenChunk {
                    key,
                    gen,
                    slot: b.slot,
                    len,
                    tokens,
                }),
                None => {
                    for t in &taken {
                        self.keys.unborrow(&t.key, t.gen);
                    }
                    return Err(TakeError::Consumed {
                        req_id: req_id.to_owned(),
                        key,
                    });
                }
            }
        }
        Ok(taken)
    }

    /// True if a copy of `key` is held and its bytes are in place.
    pub fn is_ready(&self, key: &str) -> bool {
        self.keys.get(key).is_some_and(|e| e.ready)
    }

    /// Takes the admission waits recorded since the last call.
    pub fn take_admission_waits(&mut self) -> Vec<Duration> {
        std::mem::take(&mut self.admission_waits)
    }
}
