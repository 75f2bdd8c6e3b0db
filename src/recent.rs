//! [`RecentMap`]: a map that remembers only its most recently added keys,
//! for per-request bookkeeping that must stay bounded however many requests
//! a long-running process sees (finished request ids, notification counts).

use std::collections::{HashMap, VecDeque};

/// A map of string keys that forgets the oldest keys (in insertion order)
/// beyond a capacity.
#[derive(Debug, Clone)]
pub struct RecentMap<V> {
    map: HashMap<String, V>,
    order: VecDeque<String>,
    cap: usize,
}

impl<V> RecentMap<V> {
    /// An empty map remembering at most `cap` keys (at least 1).
    pub fn new(cap: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// The value of `key`, if remembered.
    pub fn get(&self, key: &str) -> Option<&V> {
        self.map.get(key)
    }

    /// Keys remembered.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The value of `key`, inserting `make()` if absent (forgetting the
    /// oldest key when the map is full).
    pub fn get_or_insert_with(&mut self, key: &str, make: impl FnOnce() -> V) -> &mut V {
        if !self.map.contains_key(key) {
            while self.order.len() >= self.cap {
                match self.order.pop_front() {
                    Some(old) => {
                        self.map.remove(&old);
                    }
                    None => break,
                }
            }
            self.order.push_back(key.to_owned());
        }
        self.map.entry(key.to_owned()).or_insert_with(make)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_values_and_forgets_the_oldest_keys() {
        let mut m = RecentMap::new(2);
        *m.get_or_insert_with("a", || 0) += 1;
        *m.get_or_insert_with("a", || 0) += 1;
        assert_eq!(m.get("a"), Some(&2), "an existing key keeps its value");
        m.get_or_insert_with("b", || 7);
        m.get_or_insert_with("c", || 9);
        assert_eq!(m.get("a"), None, "the oldest key was forgotten");
        assert_eq!((m.get("b"), m.get("c"), m.len()), (Some(&7), Some(&9), 2));
    }
}
