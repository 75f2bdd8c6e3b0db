//! Who may write which slot over the TCP data plane.
//!
//! Two parts, both owned by the [`ReceiverCore`](super::core::ReceiverCore):
//!
//! - [`DataKeys`]: the secret issued to each sender in its `HelloAck` (TCP
//!   only) and the token it stands for. The data thread looks a preamble's
//!   secret up once per connection, under the receiver's lock.
//! - [`GrantTable`]: one atomic word per slot naming the token allowed to
//!   write it right now. The core sets it when it grants a slot to a batch
//!   of a request whose sender holds a token, seals it when the request
//!   completes, and clears it when the slot is freed. The data thread
//!   checks it, without the lock, at each write header and around every
//!   `read` into the slot.
//!
//! # The word and its states
//!
//! ```text
//!   0              free / not writable over TCP
//!   token << 1     granted to `token`, no read landing now
//!   token << 1 | 1 granted to `token`, the data thread is inside a `read`
//!                  into the slot ("busy")
//!   1 (PENDING)    freed by the core while busy: the data thread finishes
//!                  the free once its `read` returns
//! ```
//!
//! Only the data thread (there is one) moves a word into or out of *busy*,
//! with compare-and-swap: `begin_write` `G → G|1` only if the word still
//! names its token, `end_write` `G|1 → G`. Only the core moves a word out
//! of *granted*: `seal` `G → 0` (never while busy), `revoke` `G → 0` or
//! `G|1 → PENDING`. Tokens are never 0, so `PENDING` is no granted word.
//!
//! # Why no byte lands in a slot its grantee does not hold
//!
//! A slot leaves the core's hands (back to the allocator, to be granted to
//! someone else) only through [`GrantTable::revoke`] returning
//! [`Revoked::Free`], which it does only after a successful CAS from a word
//! that was not busy. Every `read` into a slot happens between a successful
//! `begin_write` and its `end_write`. So either the revoke's CAS comes
//! first — then `begin_write` fails (the word no longer names the token)
//! and nothing is read — or `begin_write` comes first — then the revoke
//! sees *busy* (the CAS on the same word is totally ordered) and defers:
//! the slot stays allocated until `end_write` sees `PENDING` and the data
//! thread returns it to the core ([`ReceiverCore::free_deferred`]).
//! Ordering: `end_write`'s CAS is `Release` and `revoke`'s is `Acquire`, so
//! the bytes of a `read` happen-before whoever gets the slot next; in the
//! deferred case the receiver's mutex orders them.
//!
//! [`ReceiverCore::free_deferred`]: super::core::ReceiverCore::free_deferred

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::transport::tcp::wire::SECRET_LEN;

/// A sender's data-plane identity; never 0.
pub type Token = u64;

/// A data-connection secret.
pub type Secret = [u8; SECRET_LEN];

const BUSY: u64 = 1;
const PENDING: u64 = 1;

/// What [`GrantTable::revoke`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revoked {
    /// The slot is no longer writable and may be reused now.
    Free,
    /// A read is landing in it: the data thread frees it when the read ends.
    Deferred,
}

/// What [`GrantTable::end_write`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndWrite {
    /// The grant is still there.
    Granted,
    /// The core freed the slot during the read: the caller must hand it back
    /// ([`ReceiverCore::free_deferred`](super::core::ReceiverCore::free_deferred)).
    FreeDeferred,
}

/// Per-slot write grants (see the module docs).
#[derive(Debug)]
pub struct GrantTable {
    words: Box<[AtomicU64]>,
}

impl GrantTable {
    /// A table of `slots` ungranted slots.
    pub fn new(slots: usize) -> Self {
        Self {
            words: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn word(&self, slot: u32) -> Option<&AtomicU64> {
        self.words.get(slot as usize)
    }

    /// Core: `slot`, just allocated (so its word is 0), may be written by
    /// `token` from now on.
    pub fn grant(&self, slot: u32, token: Token) {
        debug_assert!(token != 0 && token < 1 << 63);
        if let Some(w) = self.word(slot) {
            // Release: pairs with the data thread's Acquire loads; nothing is
            // published through the grant besides the grant itself.
            w.store(token << 1, Ordering::Release);
        }
    }

    /// Core: the request writing `slot` completed; it is no longer
    /// writable. Returns false (and changes nothing) if a read is landing in
    /// it right now, which a sender that waited for its acks never causes.
    pub fn seal(&self, slot: u32) -> bool {
        let Some(w) = self.word(slot) else {
            return true;
        };
        // AcqRel on success: orders the reads that landed (their Release
        // `end_write`) before the decoder is told the bytes are ready.
        let mut cur = w.load(Ordering::Acquire);
        loop {
            if cur & BUSY != 0 && cur != PENDING {
                return false;
            }
            match w.compare_exchange_weak(cur, 0, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Core: `slot` is being freed. See [`Revoked`].
    pub fn revoke(&self, slot: u32) -> Revoked {
        let Some(w) = self.word(slot) else {
            return Revoked::Free;
        };
        // Acquire (both arms): the bytes of every finished read happen-before
        // the slot's reuse (pairs with `end_write`'s Release).
        let mut cur = w.load(Ordering::Acquire);
        loop {
            let (next, result) = if cur & BUSY != 0 && cur != PENDING {
                (PENDING, Revoked::Deferred)
            } else {
                (0, Revoked::Free)
            };
            match w.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return result,
                Err(now) => cur = now,
            }
        }
    }

    /// Data thread: whether `slot` is granted to `token` now.
    pub fn is_granted_to(&self, slot: u32, token: Token) -> bool {
        // Acquire: pairs with `grant`'s Release.
        self.word(slot)
            .is_some_and(|w| w.load(Ordering::Acquire) == token << 1)
    }

    /// Data thread: claims `slot` for one `read` by `token`'s connection;
    /// false if it is not (or no longer) granted to `token`.
    pub fn begin_write(&self, slot: u32, token: Token) -> bool {
        // Acquire: a revoke/regrant before this CAS is seen in full.
        self.word(slot).is_some_and(|w| {
            w.compare_exchange(
                token << 1,
                token << 1 | BUSY,
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_ok()
        })
    }

    /// Data thread: the `read` that [`GrantTable::begin_write`] allowed has
    /// returned.
    pub fn end_write(&self, slot: u32, token: Token) -> EndWrite {
        let Some(w) = self.word(slot) else {
            return EndWrite::Granted;
        };
        // Release: the read's bytes happen-before a later revoke's Acquire.
        match w.compare_exchange(
            token << 1 | BUSY,
            token << 1,
            Ordering::Release,
            Ordering::Acquire,
        ) {
            Ok(_) => EndWrite::Granted,
            Err(_) => {
                // Only `revoke` changes a busy word, to PENDING: the slot is
                // ours to hand back. Release: as above, for the core that
                // frees it under the lock (which orders it too).
                w.store(0, Ordering::Release);
                EndWrite::FreeDeferred
            }
        }
    }
}

/// Most secrets kept at once. Each Hello asking for tcp issues one, so a
/// peer churning identities could otherwise grow the table without bound
/// (DESIGN invariant 9); past this the oldest secret is revoked, whose
/// sender's data connections are then refused until it says Hello again.
/// At about 300 bytes an entry (identity, secret, token, order) this bounds
/// the table near 20 MiB.
pub const MAX_SECRETS: usize = 65_536;

/// The secrets issued to senders and their tokens (see the module docs).
#[derive(Debug, Default)]
pub struct DataKeys {
    by_peer: HashMap<Vec<u8>, (Token, Secret)>,
    by_secret: HashMap<Secret, Token>,
    /// Issue order (tokens only grow), for revoking the oldest at the bound.
    order: std::collections::BTreeMap<Token, Vec<u8>>,
    last: Token,
}

impl DataKeys {
    /// Issues a fresh secret to `peer`, replacing (revoking) the one it had.
    pub fn issue(&mut self, peer: &[u8]) -> (Token, Secret) {
        self.forget(peer);
        while self.by_peer.len() >= MAX_SECRETS {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.forget(&oldest);
        }
        self.last += 1;
        let token = self.last;
        let secret: Secret = rand::random();
        self.by_peer.insert(peer.to_vec(), (token, secret));
        self.by_secret.insert(secret, token);
        self.order.insert(token, peer.to_vec());
        (token, secret)
    }

    /// The token of `peer`'s current secret.
    pub fn token_of(&self, peer: &[u8]) -> Option<Token> {
        self.by_peer.get(peer).map(|(t, _)| *t)
    }

    /// The token a data connection presenting `secret` acts for. An all-zero
    /// secret (a sender that got none) matches nothing: `rand` does not
    /// produce it in practice, and it is refused explicitly.
    pub fn lookup(&self, secret: &Secret) -> Option<Token> {
        if secret.iter().all(|&b| b == 0) {
            return None;
        }
        self.by_secret.get(secret).copied()
    }

    /// Revokes `peer`'s secret (it said `Hello` again, or is gone: whoever
    /// prunes a departed peer's state calls this too).
    pub fn forget(&mut self, peer: &[u8]) {
        if let Some((t, s)) = self.by_peer.remove(peer) {
            self.by_secret.remove(&s);
            self.order.remove(&t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_grantee_writes_and_only_while_granted() {
        let g = GrantTable::new(4);
        assert!(!g.begin_write(0, 7), "ungranted");
        g.grant(0, 7);
        assert!(g.is_granted_to(0, 7));
        assert!(!g.is_granted_to(0, 8));
        assert!(!g.begin_write(0, 8), "another token");
        assert!(g.begin_write(0, 7));
        assert_eq!(g.end_write(0, 7), EndWrite::Granted);
        assert!(g.seal(0));
        assert!(!g.begin_write(0, 7), "sealed: the request completed");
        assert!(!g.is_granted_to(0, 7));
        assert_eq!(g.revoke(0), Revoked::Free);
        // Out of range: never writable, revoke harmless.
        assert!(!g.begin_write(9, 7));
        assert!(!g.is_granted_to(9, 7));
        assert_eq!(g.revoke(9), Revoked::Free);
    }

    #[test]
    fn a_free_during_a_read_is_deferred_to_the_reader() {
        let g = GrantTable::new(2);
        g.grant(1, 3);
        assert!(g.begin_write(1, 3));
        assert!(!g.seal(1), "sealing while a read lands is refused");
        assert_eq!(g.revoke(1), Revoked::Deferred);
        assert!(!g.begin_write(1, 3), "no new read once freed");
        assert_eq!(g.end_write(1, 3), EndWrite::FreeDeferred);
        g.grant(1, 4);
        assert!(g.begin_write(1, 4), "regranted after the hand-back");
        assert_eq!(g.end_write(1, 4), EndWrite::Granted);
        assert_eq!(g.revoke(1), Revoked::Free);
    }

    /// The two threads race on one slot many times: every slot hand-back
    /// happens exactly once (by the core or by the reader), and no read
    /// starts after a free the core performed itself.
    #[test]
    fn racing_revokes_and_reads_hand_each_slot_back_once() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        const ROUNDS: u64 = 20_000;
        let g = Arc::new(GrantTable::new(1));
        let freed_by_reader = Arc::new(AtomicU64::new(0));
        let in_read = Arc::new(AtomicBool::new(false));
        let mut freed_by_core = 0u64;
        let reader = {
            let (g, f, in_read) = (g.clone(), freed_by_reader.clone(), in_read.clone());
            std::thread::spawn(move || {
                for round in 1..=ROUNDS {
                    // Spin (bounded) until this round's grant is visible.
                    for _ in 0..1_000 {
                        if g.begin_write(0, round) {
                            in_read.store(true, Ordering::SeqCst);
                            in_read.store(false, Ordering::SeqCst);
                            if g.end_write(0, round) == EndWrite::FreeDeferred {
                                f.fetch_add(1, Ordering::SeqCst);
                            }
                            break;
                        }
                        std::hint::spin_loop();
                    }
                }
            })
        };
        for round in 1..=ROUNDS {
            // The slot is free (word 0) unless the reader still owes a
            // hand-back of the previous round; wait for that, bounded.
            let mut spins = 0;
            while g.words[0].load(Ordering::SeqCst) != 0 {
                spins += 1;
                assert!(spins < 100_000_000, "a deferred free was never handed back");
                std::hint::spin_loop();
            }
            g.grant(0, round);
            std::hint::spin_loop();
            if g.revoke(0) == Revoked::Free {
                freed_by_core += 1;
                assert!(
                    !in_read.load(Ordering::SeqCst),
                    "the core freed a slot while a read was landing"
                );
            }
        }
        reader.join().unwrap();
        let mut spins = 0;
        while g.words[0].load(Ordering::SeqCst) != 0 {
            spins += 1;
            assert!(spins < 100_000_000, "last hand-back missing");
            std::hint::spin_loop();
        }
        assert_eq!(
            freed_by_core + freed_by_reader.load(Ordering::SeqCst),
            ROUNDS
        );
    }

    #[test]
    fn secrets_map_to_their_sender_until_replaced() {
        let mut k = DataKeys::default();
        let (t1, s1) = k.issue(b"a");
        let (t2, s2) = k.issue(b"b");
        assert_ne!(t1, t2);
        assert_ne!(s1, s2);
        assert_eq!(k.lookup(&s1), Some(t1));
        assert_eq!(k.token_of(b"b"), Some(t2));
        let (t3, s3) = k.issue(b"a");
        assert_eq!(k.lookup(&s1), None, "a new Hello revokes the old secret");
        assert_eq!(k.lookup(&s3), Some(t3));
        assert_eq!(k.token_of(b"a"), Some(t3));
        assert_eq!(k.lookup(&[0; SECRET_LEN]), None);
        k.forget(b"a");
        assert_eq!(k.lookup(&s3), None);
        assert_eq!(k.token_of(b"a"), None);
        assert_eq!(k.lookup(&s2), Some(t2));
    }

    #[test]
    fn the_secret_table_is_bounded_and_revokes_the_oldest() {
        let mut k = DataKeys::default();
        let (_, first) = k.issue(b"peer-0");
        for i in 1..MAX_SECRETS {
            k.issue(format!("peer-{i}").as_bytes());
        }
        assert_eq!(k.by_peer.len(), MAX_SECRETS);
        assert!(
            k.lookup(&first).is_some(),
            "at the bound, nothing revoked yet"
        );
        let (t, newest) = k.issue(b"one-more");
        assert_eq!(k.by_peer.len(), MAX_SECRETS, "never above the bound");
        assert_eq!(k.by_secret.len(), MAX_SECRETS);
        assert_eq!(k.order.len(), MAX_SECRETS);
        assert_eq!(k.lookup(&first), None, "the oldest secret was revoked");
        assert_eq!(k.lookup(&newest), Some(t));
    }
}
