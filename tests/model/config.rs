//! Configurations of the admission-protocol model: who sends which request,
//! how it is split into batches, the buffer sizes, and which sender rules
//! apply (kvferry's, kvferry's LMCache-compatibility mode, or LMCache's).

/// The sender's rules. Each flag is one rule in which kvferry and LMCache
/// differ (docs/model-check.md, "Sender rules").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rules {
    /// The sender says `Hello` and the receiver answers: kvferry extensions
    /// (`seq`-matched replies, `TransferDone`, fenced cancel). Off: the
    /// receiver treats the peer as an LMCache sender.
    pub hello: bool,
    /// `store` takes staging slots before the request is admitted (LMCache:
    /// `allocate()` in the worker thread). kvferry: only admitted requests
    /// take staging; others wait in the pending area.
    pub stage_before_admission: bool,
    /// At most one message outstanding per receiver; the others queue behind
    /// it in send order (LMCache's `_async_alloc_locks[receiver]`, kvferry's
    /// `Mode::Legacy` fifo/waiting queues).
    pub one_outstanding: bool,
    /// A request not yet admitted sends only its first batch (kvferry,
    /// `progress_live` "sendable"). LMCache: every stored batch is a transfer
    /// task that sends as soon as it holds the lock.
    pub gate_unadmitted: bool,
    /// With `one_outstanding`: only one request at a time per receiver
    /// (kvferry `Peer::turn`, the core's `Turn`).
    pub one_request_at_a_time: bool,
    /// `progress_live` stages and posts answered batches strictly in order,
    /// stopping at the first one that cannot get staging (the engine before
    /// the fix of commit "sender: post answered batches past one that waits
    /// for staging"). Off: every answered batch that can be posted is.
    pub stage_in_order: bool,
}

impl Rules {
    /// kvferry talking to a kvferry receiver (`Mode::Extended`).
    pub const KVFERRY: Rules = Rules {
        hello: true,
        stage_before_admission: false,
        one_outstanding: false,
        gate_unadmitted: true,
        one_request_at_a_time: false,
        stage_in_order: false,
    };
    /// kvferry before the staging-order fix (deadlocks, see the docs).
    pub const KVFERRY_IN_ORDER_STAGING: Rules = Rules {
        stage_in_order: true,
        ..Rules::KVFERRY
    };
    /// kvferry talking to an LMCache receiver (`Mode::Legacy`).
    pub const KVFERRY_LEGACY: Rules = Rules {
        hello: false,
        stage_before_admission: false,
        one_outstanding: true,
        gate_unadmitted: true,
        one_request_at_a_time: true,
        stage_in_order: false,
    };
    /// LMCache's current sender (pd_async_reservation_design.md).
    pub const LMCACHE: Rules = Rules {
        hello: false,
        stage_before_admission: true,
        one_outstanding: true,
        gate_unadmitted: false,
        one_request_at_a_time: false,
        stage_in_order: true,
    };
}

/// One request.
#[derive(Clone, Debug)]
pub struct ReqCfg {
    /// Index of the sender that transfers it.
    pub sender: usize,
    /// Its keys, as indexes into [`Cfg::key_names`], in chunk order.
    pub keys: Vec<u8>,
    /// Batch sizes, in order; they sum to `keys.len()`.
    pub batches: Vec<u8>,
    /// The caller may cancel it at any step.
    pub may_abort: bool,
}

impl ReqCfg {
    /// Key indexes of batch `b`.
    pub fn batch_keys(&self, b: usize) -> &[u8] {
        let start: usize = self.batches[..b].iter().map(|&n| n as usize).sum();
        &self.keys[start..start + self.batches[b] as usize]
    }
    /// Chunks in the request.
    pub fn total(&self) -> usize {
        self.keys.len()
    }
}

/// A whole configuration.
#[derive(Clone, Debug)]
pub struct Cfg {
    /// Name in reports.
    pub name: &'static str,
    /// Receiver slots (= ledger capacity).
    pub capacity: usize,
    /// Staging slots per sender.
    pub staging: u8,
    /// Pending-area bound per sender, in chunks (a full pending area makes
    /// `store` return `Backpressure`; the caller retries later).
    pub pending_max: u8,
    /// Number of senders.
    pub senders: usize,
    /// The requests (global index = position).
    pub reqs: Vec<ReqCfg>,
    /// Key names (dedup: two requests naming the same key index).
    pub key_names: Vec<String>,
    /// Sender rules.
    pub rules: Rules,
}

impl Cfg {
    /// A configuration where request `i` has `sizes[i]` fresh keys split
    /// into batches of at most `batch`.
    #[allow(clippy::too_many_arguments)]
    pub fn simple(
        name: &'static str,
        capacity: usize,
        staging: u8,
        senders_of: &[usize],
        sizes: &[u8],
        batch: u8,
        may_abort: &[bool],
        rules: Rules,
    ) -> Cfg {
        let mut key_names = Vec::new();
        let mut reqs = Vec::new();
        for (i, (&sender, &size)) in senders_of.iter().zip(sizes).enumerate() {
            let mut keys = Vec::new();
            for j in 0..size {
                keys.push(key_names.len() as u8);
                key_names.push(format!("r{i}k{j}"));
            }
            let mut batches = Vec::new();
            let mut left = size;
            while left > 0 {
                batches.push(left.min(batch));
                left -= left.min(batch);
            }
            reqs.push(ReqCfg {
                sender,
                keys,
                batches,
                may_abort: may_abort.get(i).copied().unwrap_or(false),
            });
        }
        let senders = senders_of.iter().max().map_or(0, |m| m + 1);
        let pending_max = sizes.iter().map(|&s| s as usize).sum::<usize>() as u8;
        Cfg {
            name,
            capacity,
            staging,
            pending_max,
            senders,
            reqs,
            key_names,
            rules,
        }
    }

    /// The request name `r{i}`.
    pub fn req_name(r: usize) -> String {
        format!("r{r}")
    }

    /// The routing identity of sender `s`.
    pub fn peer(s: usize) -> Vec<u8> {
        format!("s{s}").into_bytes()
    }
}
