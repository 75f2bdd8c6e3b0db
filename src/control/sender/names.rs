//! The sender's name index: request id → the request's [`Common`] state
//! (key, receiver, total, stored count, `Signal`, cancel token), for the
//! calls that name a request by its id: `Sender::status` / `wait` /
//! `cancel_request`, the copying `Sender::store` (its geometry checks) and
//! `begin`'s duplicate check. None of them takes the table lock.
//!
//! Its own small lock, held only to look an id up, to insert, or to remove:
//! written by `begin` (which checks and inserts under one hold, so two
//! `begin`s of one id cannot both succeed) and by ctrl when the table
//! forgets an ended request (after the table lock is released: the lock
//! order is names → table, taken so only by `begin`). Bounded like the
//! table: one entry per request the table holds, plus the requests ctrl
//! forgot in its current step.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::request::Common;
use super::table::ReqKey;

/// Request id → its [`Common`] state.
#[derive(Default)]
pub(crate) struct Names {
    map: Mutex<HashMap<Arc<str>, Arc<Common>>>,
}

impl Names {
    /// The request named `req_id` (live, or ended and still remembered).
    pub fn get(&self, req_id: &str) -> Option<Arc<Common>> {
        self.map.lock().get(req_id).cloned()
    }

    /// The map, held (for `begin`'s check-then-insert).
    pub fn lock(&self) -> MutexGuard<'_, HashMap<Arc<str>, Arc<Common>>> {
        self.map.lock()
    }

    /// Forgets the requests of `forgotten` (id and key), each only if the
    /// entry under its id is still that request.
    pub fn forget(&self, forgotten: impl IntoIterator<Item = (Arc<str>, ReqKey)>) {
        let mut map = self.map.lock();
        for (id, key) in forgotten {
            if map.get(&id).is_some_and(|c| c.key == key) {
                map.remove(&id);
            }
        }
    }

    /// Every request not yet terminal.
    pub fn active(&self) -> Vec<Arc<Common>> {
        self.map
            .lock()
            .values()
            .filter(|c| c.signal.terminal().is_none())
            .cloned()
            .collect()
    }
}
