//! A stateright model of kvferry's admission protocol: N senders (the real
//! `kvferry::sender::core` decisions, executed on the model state by
//! `sender.rs`; the caller side transcribed), one receiver (the real
//! `kvferry::receiver::core::ReceiverCore`, rebuilt from the log of its
//! inputs), FIFO channels per sender↔receiver pair in each direction, a
//! transport that completes posted writes in any order, a decoder and a
//! proxy. See docs/model-check.md.

pub mod config;
pub mod rx;
pub mod sender;
pub mod state;

use kvferry::protocol::Message;
use kvferry::receiver::core::{Outcome, Output};
use stateright::{Model, Property};

use self::config::Cfg;
use self::rx::RxIn;
use self::state::{viol, RState, Reply, State, Status};

/// One step of the system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The caller thread of the request's sender calls `store` for its next batch.
    Store(u8),
    /// The blocked caller thread of this sender returns from the staging wait.
    Unblock(u8),
    /// The caller cancels the request.
    Cancel(u8),
    /// The sender's ctrl thread runs `progress` for the request.
    Progress(u8),
    /// The receiver's ctrl thread handles the next message from this sender.
    DeliverToRx(u8),
    /// This sender's ctrl thread reads the next reply.
    DeliverToTx(u8),
    /// The write of `(req, batch)` lands and its completion is polled.
    Land(u8, u8),
    /// The decoder consumes the request's next key.
    Consume(u8),
}

/// The model: a configuration.
pub struct Pd {
    /// What is checked.
    pub cfg: Cfg,
}

impl Pd {
    /// Applies `a` to `st`; false if it is not enabled.
    fn apply(&self, st: &mut State, a: &Action) -> bool {
        let cfg = &self.cfg;
        match *a {
            Action::Store(r) => sender::store(cfg, st, r as usize),
            Action::Unblock(s) => sender::unblock(cfg, st, s as usize),
            Action::Cancel(r) => sender::cancel(cfg, st, r as usize),
            Action::Progress(r) => {
                let before = st.clone();
                sender::progress(cfg, st, r as usize);
                *st != before
            }
            Action::DeliverToRx(s) => {
                let Some(w) = st.to_rx[s as usize].pop_front() else {
                    return false;
                };
                let step = rx::step(cfg, &st.log, &RxIn::Msg(s, w.clone()));
                st.log.push(RxIn::Msg(s, w));
                self.absorb(st, step);
                true
            }
            Action::DeliverToTx(s) => sender::on_reply(cfg, st, s as usize),
            Action::Land(r, b) => {
                match st.writes.iter().position(|w| (w.req, w.batch) == (r, b)) {
                    Some(i) => sender::complete(cfg, st, i),
                    None => return false,
                }
                true
            }
            Action::Consume(r) => {
                let ru = r as usize;
                if !self.can_consume(st, ru) {
                    return false;
                }
                let pos = st.consumed[ru] as usize;
                let key = cfg.reqs[ru].keys[pos];
                let step = rx::step(cfg, &st.log, &RxIn::Consume(key));
                st.log.push(RxIn::Consume(key));
                match step.borrowed {
                    Some(slot) if st.slot_data[slot as usize] == Some(key) => {}
                    Some(_) => st.viol |= viol::READ_UNLANDED,
                    None => st.viol |= viol::DECODER_MISS,
                }
                if let Some(x) = st.req_slot[ru][pos] {
                    st.slot_hold[x as usize] &= !(1 << ru);
                }
                st.consumed[ru] += 1;
                self.absorb(st, step);
                true
            }
        }
    }

    fn can_consume(&self, st: &State, r: usize) -> bool {
        st.rx_outcome[r] == Some(true)
            && st.proxy[r] > 0
            && (st.consumed[r] as usize) < self.cfg.reqs[r].total()
    }

    /// Takes in the receiver's outputs: replies go on the channels, grants
    /// and failures update the ground truth about slots.
    fn absorb(&self, st: &mut State, step: rx::Step) {
        st.rx = step.view;
        if st.rx.committed as usize > self.cfg.capacity {
            st.viol |= viol::OVERCOMMIT;
        }
        for o in step.outputs {
            match o {
                Output::Send {
                    peer,
                    message: Message::AllocResponse(resp),
                } => {
                    let s = peer_index(&peer);
                    let reply = Reply {
                        seq: resp.seq,
                        remote: resp.remote_indexes.clone(),
                        already: resp.already_sent_indexes.clone(),
                        failed: resp.is_failure(),
                    };
                    self.record_grant(st, s, &reply);
                    st.to_tx[s].push_back(reply);
                }
                Output::Send { .. } => {} // HelloAck: the model starts after it.
                Output::ForgetPeer { .. } => {} // the model's peers never go idle.
                Output::Finished { req_id, outcome } => {
                    let r: usize = req_id[1..].parse().unwrap_or(usize::MAX);
                    match outcome {
                        Outcome::Ready => st.rx_outcome[r] = Some(true),
                        Outcome::Failed(_) => {
                            st.rx_outcome[r] = Some(false);
                            for h in &mut st.slot_hold {
                                *h &= !(1 << r);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Ground truth: which request holds which slot, from a successful reply.
    fn record_grant(&self, st: &mut State, s: usize, reply: &Reply) {
        if reply.failed {
            return;
        }
        let (r, b) = match reply.seq {
            Some(seq) => match rx::decode_seq(seq) {
                (r, Some(b)) => (r as usize, b as usize),
                _ => return,
            },
            None => match st.snd[s].out.outstanding() {
                Some(&state::Out::Batch(r, b)) => (r as usize, b as usize),
                _ => return,
            },
        };
        let rc = &self.cfg.reqs[r];
        let start: usize = rc.batches[..b].iter().map(|&n| n as usize).sum();
        let keys = rc.batch_keys(b);
        // The wire's one reading of a reply's shape (the sender's too).
        let Ok(p) = kvferry::protocol::placement(keys.len(), &reply.to_response()) else {
            return;
        };
        for &i in &p.already_sent {
            // A dedup hit pins the written copy: find it by key.
            let key = keys[i];
            // (The reply does not say which copy: prefer one still held.)
            let copy = |held: bool| {
                (0..st.slot_data.len())
                    .find(|&x| st.slot_data[x] == Some(key) && (!held || st.slot_hold[x] != 0))
            };
            if let Some(x) = copy(true).or_else(|| copy(false)) {
                st.slot_hold[x] |= 1 << r;
                st.req_slot[r][start + i] = Some(x as u8);
            }
        }
        for &(i, slot) in &p.writes {
            let x = slot as usize;
            if x >= st.slot_hold.len() {
                continue;
            }
            if st.slot_hold[x] != 0 {
                st.viol |= viol::SLOT_SHARED;
            }
            st.slot_hold[x] = 1 << r;
            st.slot_key[x] = Some(keys[i]);
            st.slot_data[x] = None;
            st.req_slot[r][start + i] = Some(slot as u8);
        }
    }

    /// True if no action is enabled.
    pub fn stuck(&self, st: &State) -> bool {
        let mut v = Vec::new();
        self.actions(st, &mut v);
        v.is_empty()
    }
}

fn peer_index(peer: &[u8]) -> usize {
    std::str::from_utf8(&peer[1..])
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(usize::MAX)
}

impl Model for Pd {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State::init(&self.cfg)]
    }

    fn actions(&self, st: &State, actions: &mut Vec<Action>) {
        let cfg = &self.cfg;
        let try_local = |a: Action, actions: &mut Vec<Action>| {
            let mut n = st.clone();
            if self.apply(&mut n, &a) {
                actions.push(a);
            }
        };
        for r in 0..cfg.reqs.len() {
            try_local(Action::Store(r as u8), actions);
            try_local(Action::Cancel(r as u8), actions);
            try_local(Action::Progress(r as u8), actions);
            if self.can_consume(st, r) {
                actions.push(Action::Consume(r as u8));
            }
        }
        for s in 0..cfg.senders {
            try_local(Action::Unblock(s as u8), actions);
            if !st.to_rx[s].is_empty() {
                actions.push(Action::DeliverToRx(s as u8));
            }
            if !st.to_tx[s].is_empty() {
                actions.push(Action::DeliverToTx(s as u8));
            }
        }
        for w in &st.writes {
            actions.push(Action::Land(w.req, w.batch));
        }
    }

    fn next_state(&self, st: &State, a: Action) -> Option<State> {
        let mut n = st.clone();
        self.apply(&mut n, &a).then_some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("ledger: committed <= capacity", |m: &Pd, s: &State| {
                s.viol & viol::OVERCOMMIT == 0 && s.rx.committed as usize <= m.cfg.capacity
            }),
            Property::always(
                "no slot granted while another request holds it",
                |_: &Pd, s: &State| s.viol & viol::SLOT_SHARED == 0,
            ),
            Property::always(
                "writes land only in slots their request owns",
                |_: &Pd, s: &State| s.viol & viol::UNFENCED_WRITE == 0,
            ),
            Property::always(
                "ProxyNotif at most once per request",
                |_: &Pd, s: &State| s.viol & viol::NOTIFY_TWICE == 0,
            ),
            Property::always(
                "ProxyNotif only when every chunk is in place",
                |_: &Pd, s: &State| s.viol & viol::NOTIFY_EARLY == 0,
            ),
            Property::always(
                "decoder reads only landed chunks of ready requests",
                |_: &Pd, s: &State| s.viol & (viol::READ_UNLANDED | viol::DECODER_MISS) == 0,
            ),
            Property::always("sender accounting stays in range", |_: &Pd, s: &State| {
                s.viol & viol::ACCOUNTING == 0
            }),
            Property::always("no deadlock", |m: &Pd, s: &State| {
                s.all_ended(&m.cfg) || !m.stuck(s)
            }),
            Property::always(
                "nothing held and P/D agree once all ended",
                |m: &Pd, s: &State| {
                    !(s.all_ended(&m.cfg) && m.stuck(s)) || (s.nothing_held(&m.cfg) && agree(m, s))
                },
            ),
            Property::eventually("every request ends", |m: &Pd, s: &State| {
                s.all_ended(&m.cfg)
            }),
            Property::sometimes(
                "a request waits parked at the receiver",
                |_: &Pd, s: &State| s.rx.parked > 0,
            ),
            Property::sometimes("every request completes", |m: &Pd, s: &State| {
                s.all_ended(&m.cfg)
                    && s.reqs
                        .iter()
                        .all(|q| q.p.state == RState::Done(Status::Completed))
            }),
        ]
    }
}

/// P and D report the same outcome: a request the sender completed is
/// ready at the receiver; with kvferry's extensions the reverse holds too.
fn agree(m: &Pd, s: &State) -> bool {
    s.reqs.iter().enumerate().all(|(r, q)| {
        let completed = q.p.state == RState::Done(Status::Completed);
        let ready = s.rx_outcome[r] == Some(true);
        (!completed || ready) && (!m.cfg.rules.hello || !ready || completed)
    })
}

/// A one-line summary of a state (for counterexamples).
pub fn describe(m: &Pd, s: &State) -> String {
    let mut out = format!(
        "receiver: committed {}/{} (reserved {}, allocated {}), parked {}, tracked {}; ",
        s.rx.committed, m.cfg.capacity, s.rx.reserved, s.rx.allocated, s.rx.parked, s.rx.tracked
    );
    for (i, sn) in s.snd.iter().enumerate() {
        out += &format!(
            "sender {i}: staging free {}/{}, pending {}, caller blocked on {:?}, in-order queue {:?}; ",
            sn.staging_free, m.cfg.staging, sn.pending_used, sn.blocked_on, sn.out
        );
    }
    for (r, q) in s.reqs.iter().enumerate() {
        out += &format!(
            "r{r}: {:?}, stored {}/{} batches, queued {:?}, awaiting reply {}, unstaged {:?}, in flight {}; ",
            q.p.state,
            q.stored,
            m.cfg.reqs[r].batches.len(),
            q.p.queued,
            q.p.awaiting_reply,
            q.p.unstaged,
            q.p.in_flight_ops
        );
    }
    out
}
