//! The caller → ctrl submission ring, carrying the batch descriptors
//! themselves, and the keys of requests a caller stopped: a caller thread
//! hands its [`Batch`] (request key, keys, slots or pending bytes, lengths)
//! to ctrl through the MPSC ring, so submitting a batch never writes the
//! sender's table; a `cancel` (or a reservation given back that orphans its
//! request) changes the request's life word and sends its key the same
//! way ([`Outbox::attend`]), so ctrl looks at it.
//!
//! The ring moves plain integers. A batch entry is the address of a boxed
//! batch whose ownership travels with it ([`Outbox::push`] gives it up,
//! [`Inbox::pop`] takes it back): an even number, the box being 8-aligned.
//! An attention entry is a request key shifted up by one with the low bit
//! set. Both ends live inside the sender's shared state, so a batch left in
//! the ring when the sender goes away is dropped with it ([`Inbox`]'s
//! `Drop`), never leaked.

use parking_lot::Mutex;

use kvferry_ring::mpsc::{Consumer, Producer};

use super::table::{Batch, ReqKey};

/// The ring entry: a `Box<Batch>` turned into its address, or a tagged key.
type Token = u64;

/// The low bit of an attention entry (a batch's address never has it).
const ATTENTION: Token = 1;

/// Gives up ownership of `b` into a token; [`untoken`] takes it back.
fn token(b: Box<Batch>) -> Token {
    const _: () = assert!(std::mem::align_of::<Batch>() > 1, "the tag bit is free");
    Box::into_raw(b) as usize as Token
}

/// Takes back the batch a [`token`] call gave up.
///
/// # Safety
///
/// `t` must come from [`token`] and be taken back at most once.
unsafe fn untoken(t: Token) -> Box<Batch> {
    // SAFETY: by the caller's contract `t` is the address of a live
    // `Box<Batch>` allocation whose ownership no one else holds.
    unsafe { Box::from_raw(t as usize as *mut Batch) }
}

/// What ctrl takes from the ring.
pub(crate) enum Taken {
    /// A batch to file.
    Batch(Box<Batch>),
    /// A request a caller stopped: look at its life word.
    Attention(ReqKey),
}

/// One producing end of the ring (each [`Request`](super::Request) handle
/// has its own).
pub(crate) struct Outbox {
    /// A lock because a ring producer is `Send` but not `Sync` and a
    /// request's handle is shared by its clones: only threads submitting to
    /// the same request ever contend for it.
    producer: Mutex<Producer<Token>>,
}

impl Outbox {
    pub fn new(producer: Producer<Token>) -> Self {
        Self {
            producer: Mutex::new(producer),
        }
    }

    /// Asks ctrl to look at request `key` (a caller stopped it). False if
    /// the ring is full (or `key` cannot be packed): the caller then raises
    /// the sender's attention-overflow flag instead.
    pub fn attend(&self, key: ReqKey) -> bool {
        key.to_bits63()
            .is_some_and(|bits| self.producer.lock().push((bits << 1) | ATTENTION).is_ok())
    }

    /// Hands `b` to ctrl; gives it back if the ring is full.
    pub fn push(&self, b: Box<Batch>) -> Result<(), Box<Batch>> {
        let t = token(b);
        match self.producer.lock().push(t) {
            Ok(()) => Ok(()),
            // SAFETY: a refused push returns the token it was given, made by
            // `token` just above and not taken back anywhere else.
            Err(t) => Err(unsafe { untoken(t) }),
        }
    }
}

/// The consuming end (ctrl's).
pub(crate) struct Inbox {
    /// A lock because it lives in the shared state (see the module doc);
    /// only the ctrl thread takes it while the sender runs, and the drop of
    /// the shared state after it: never contended.
    consumer: Mutex<Consumer<Token>>,
}

impl Inbox {
    pub fn new(consumer: Consumer<Token>) -> Self {
        Self {
            consumer: Mutex::new(consumer),
        }
    }

    /// The oldest entry submitted and not yet taken.
    pub fn pop(&self) -> Option<Taken> {
        let t = self.consumer.lock().pop()?;
        if t & ATTENTION != 0 {
            return Some(Taken::Attention(ReqKey::from_bits63(t >> 1)));
        }
        // SAFETY: every untagged entry was pushed by `Outbox::push` from
        // `token`, and the ring hands each pushed entry to the consumer
        // exactly once.
        Some(Taken::Batch(unsafe { untoken(t) }))
    }

    /// Nothing submitted waits.
    pub fn is_empty(&self) -> bool {
        self.consumer.lock().is_empty()
    }

    /// Holds the consumer: ctrl stops taking batches until the guard drops
    /// (tests fill the ring with it).
    #[cfg(test)]
    pub fn hold(&self) -> parking_lot::MutexGuard<'_, Consumer<Token>> {
        self.consumer.lock()
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        // Batches submitted after ctrl stopped: their staging goes with the
        // buffer, their bytes with the box.
        while self.pop().is_some() {}
    }
}

/// A connected pair with room for `capacity` batches.
pub(crate) fn channel(capacity: usize) -> (Producer<Token>, Inbox) {
    let (p, c) = kvferry_ring::mpsc::channel::<Token>(capacity);
    (p, Inbox::new(c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::sender::keys::KeyList;
    use crate::control::sender::table::BatchData;

    fn batch(n: u8) -> Box<Batch> {
        let mut slab = crate::control::sender::slab::Slab::default();
        Box::new(Batch {
            req: slab.insert(()),
            keys: KeyList::from_keys(&[format!("k{n}")]),
            lens: [u32::from(n)].into_iter().collect(),
            data: BatchData::Pending(vec![n; n as usize]),
            is_last: false,
            stored_at: std::time::Instant::now(),
            last_chunk_toks: 0,
            bytes: n as usize,
            remote: Vec::new(),
            writes: Default::default(),
            fills: false,
        })
    }

    #[test]
    fn batches_cross_in_order_a_full_ring_gives_them_back_and_leftovers_drop() {
        let (p, inbox) = channel(2);
        let out = Outbox::new(p);
        out.push(batch(1)).expect("room");
        out.push(batch(2)).expect("room");
        let back = out.push(batch(3)).expect_err("full");
        assert_eq!(back.keys.get(0), Some("k3"), "the same batch comes back");
        let Some(Taken::Batch(first)) = inbox.pop() else {
            panic!("a batch first");
        };
        assert_eq!((first.keys.get(0), first.bytes), (Some("k1"), 1));
        out.push(back).expect("room again");
        let Some(Taken::Batch(second)) = inbox.pop() else {
            panic!("a batch second");
        };
        assert_eq!(second.bytes, 2);
        let key = ReqKey::from_bits63((5 << 32) | 7);
        assert!(out.attend(key), "room for one");
        assert!(!out.attend(key), "full: the caller raises the flag");
        let Some(Taken::Batch(third)) = inbox.pop() else {
            panic!("the batch given back, pushed again");
        };
        assert_eq!(third.bytes, 3);
        let Some(Taken::Attention(k)) = inbox.pop() else {
            panic!("the attention entry, in order");
        };
        assert_eq!(k, key, "the key crosses intact");
        out.push(batch(4)).expect("room");
        // One left in the ring: `Inbox::drop` takes it back and drops it.
        drop(inbox);
    }
}
