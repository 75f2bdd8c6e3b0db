//! [`ByRequest`]: per-request state keyed by (peer, `req_id`).
//!
//! A request belongs to the peer that opened it: two peers reusing a
//! `req_id` are two requests, never merged (DESIGN invariant 8; LMCache keys
//! by `req_id` alone, kvferry must not). The map is nested — `req_id`, then
//! the owners of that id — so each id is stored once, a lookup needs no
//! allocation, and "does another peer own this id?" (the `not_owner` answer)
//! is one lookup.

use std::collections::HashMap;

use smallvec::SmallVec;

/// Routing identity of a peer (the ZMQ identity frame).
pub type PeerId = Vec<u8>;

/// Values keyed by (peer, `req_id`). See the module docs.
#[derive(Debug)]
pub(crate) struct ByRequest<T> {
    map: HashMap<String, SmallVec<[(PeerId, T); 1]>>,
    len: usize,
}

impl<T> Default for ByRequest<T> {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            len: 0,
        }
    }
}

impl<T> ByRequest<T> {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `peer`'s value for `req_id`.
    pub(crate) fn get(&self, peer: &[u8], req_id: &str) -> Option<&T> {
        self.map
            .get(req_id)?
            .iter()
            .find(|(p, _)| p == peer)
            .map(|(_, v)| v)
    }

    /// `peer`'s value for `req_id`, mutably.
    pub(crate) fn get_mut(&mut self, peer: &[u8], req_id: &str) -> Option<&mut T> {
        self.map
            .get_mut(req_id)?
            .iter_mut()
            .find(|(p, _)| p == peer)
            .map(|(_, v)| v)
    }

    /// True if `peer` has a value for `req_id`.
    pub(crate) fn contains(&self, peer: &[u8], req_id: &str) -> bool {
        self.get(peer, req_id).is_some()
    }

    /// The peers that have an entry for `req_id`, oldest entry first.
    pub(crate) fn peers_of<'a>(&'a self, req_id: &str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.map
            .get(req_id)
            .into_iter()
            .flat_map(|v| v.iter().map(|(p, _)| p.as_slice()))
    }

    /// True if a peer other than `peer` has a value for `req_id`.
    pub(crate) fn owned_by_other(&self, peer: &[u8], req_id: &str) -> bool {
        self.map
            .get(req_id)
            .is_some_and(|v| v.iter().any(|(p, _)| p != peer))
    }

    /// Sets `peer`'s value for `req_id`; returns the one it replaces.
    pub(crate) fn insert(&mut self, peer: &[u8], req_id: &str, value: T) -> Option<T> {
        if let Some(slot) = self.get_mut(peer, req_id) {
            return Some(std::mem::replace(slot, value));
        }
        self.map
            .entry(req_id.to_owned())
            .or_default()
            .push((peer.to_vec(), value));
        self.len += 1;
        None
    }

    /// Removes `peer`'s value for `req_id`.
    pub(crate) fn remove(&mut self, peer: &[u8], req_id: &str) -> Option<T> {
        let owners = self.map.get_mut(req_id)?;
        let i = owners.iter().position(|(p, _)| p == peer)?;
        let (_, v) = owners.swap_remove(i);
        if owners.is_empty() {
            self.map.remove(req_id);
        }
        self.len -= 1;
        Some(v)
    }

    /// Every entry as `(peer, req_id, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &str, &T)> {
        self.map
            .iter()
            .flat_map(|(id, v)| v.iter().map(move |(p, t)| (p.as_slice(), id.as_str(), t)))
    }

    /// Every value.
    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.map.values().flat_map(|v| v.iter().map(|(_, t)| t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_peers_reusing_an_id_are_two_entries() {
        let mut m = ByRequest::default();
        assert_eq!(m.insert(b"a", "x", 1), None);
        assert_eq!(m.insert(b"b", "x", 2), None);
        assert_eq!(m.len(), 2);
        assert_eq!((m.get(b"a", "x"), m.get(b"b", "x")), (Some(&1), Some(&2)));
        assert!(m.owned_by_other(b"c", "x") && m.owned_by_other(b"a", "x"));
        assert_eq!(m.remove(b"c", "x"), None, "a stranger removes nothing");
        assert_eq!(m.remove(b"a", "x"), Some(1));
        assert!(!m.owned_by_other(b"b", "x"), "only b's own entry is left");
        assert_eq!(m.insert(b"b", "x", 3), Some(2), "same owner replaces");
        assert_eq!(m.remove(b"b", "x"), Some(3));
        assert!(m.is_empty() && m.map.is_empty());
    }
}
