//! The sender's side: [`RdmaTransport`] (one device context, protection
//! domain, memory regions over the staging buffer's segments and the
//! caller's regions, CQ with a completion channel) and its two halves,
//! [`RdmaPoster`] and [`RdmaCompletions`].
//!
//! Connecting a receiver takes two steps because an RC queue pair needs the
//! peer's QP number: [`Poster::prepare`] creates a queue pair (INIT) and
//! returns the descriptor for the `Hello`; [`Poster::connect_prepared`]
//! takes the receiver's `HelloAck` descriptor and moves the queue pair to
//! RTR and RTS. The generic [`Poster::connect`] cannot do this (it is given
//! only the receiver's side), see docs/rdma.md.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvferry_ring::spsc::Consumer;
use parking_lot::Mutex;

use crate::protocol::Descriptor;
use crate::staging::StagingBuffer;
use crate::transport::{
    descriptor_kind, Completion, CompletionStatus, Completions, LocalRegistry, PeerIndex,
    PollStatus, Poster, RemoteBuffer, Started, Transport, TransportError, WriteOp,
};

use super::config::RdmaConfig;
use super::cq_thread::CqThread;
use super::inflight::Inflight;
use super::info::QpInfo;
use super::peers::{PeerQp, Shared};
use super::plan::{plan, Step};
use super::qp_state::QpStep;
use super::regions::{LocalMrs, LocalView};
use super::verbs::{connect, Channel, Context, Cq, Pd, Qp, WriteWr};

/// Name of the CQ-poll thread.
pub const CQ_THREAD_NAME: &str = "kvf-rdma-cq";

/// The RDMA transport before [`Transport::start`]: the device is already
/// open, so a host without one fails at construction with
/// [`TransportError::NoDevice`].
pub struct RdmaTransport {
    cfg: RdmaConfig,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("device", &self.ctx.name)
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl RdmaTransport {
    /// Validates `cfg` and opens its device (named, or the first one).
    pub fn new(cfg: RdmaConfig) -> Result<Self, TransportError> {
        cfg.validate()?;
        let ctx = Context::open(cfg.device.as_deref(), cfg.port, cfg.gid_index)?;
        tracing::debug!(device = %ctx.name, port = cfg.port, "rdma device open");
        Ok(Self { cfg, ctx })
    }

    /// The name of the open device.
    pub fn device_name(&self) -> &str {
        &self.ctx.name
    }

    /// Starts the data plane and returns the concrete halves (the posting
    /// half connects receivers with [`Poster::prepare`] /
    /// [`Poster::connect_prepared`]).
    pub fn start_rdma(
        self,
        local: Arc<StagingBuffer>,
    ) -> Result<(RdmaPoster, RdmaCompletions), TransportError> {
        let credits = self.cfg.credits;
        let max_wr = u32::try_from(credits)
            .map_err(|_| TransportError::Config(format!("{credits} credits")))?;
        let pd = Pd::new(self.ctx.clone())?;
        // One MR per staging segment (each share, then the rest), so a
        // share can be re-registered over fresh pages when it is renewed.
        let mrs = Arc::new(LocalMrs::new(pd.clone(), local.clone())?);
        let channel = Channel::new(self.ctx.clone())?;
        // At most one signalled entry per op in flight, plus the flush
        // entries of ops a QP error already failed (and whose credits were
        // returned): twice the credits always suffices.
        let cq = Cq::new(
            self.ctx.clone(),
            credits.saturating_mul(2),
            Some(channel.clone()),
        )?;
        let (tx, rx) = kvferry_ring::spsc::try_channel::<Completion>(credits)
            .map_err(|e| TransportError::Config(e.to_string()))?;
        let shared = Arc::new(Shared::new()?);
        let thread = CqThread {
            cq: cq.clone(),
            channel,
            shared: shared.clone(),
            out: tx,
            ctx: self.ctx.clone(),
            _mrs: mrs.clone(),
            stall_timeout: self.cfg.stall_timeout,
        };
        let handle =
            crate::threads::spawn_named(CQ_THREAD_NAME, self.cfg.pin_cpu, move || thread.run())?;
        let credits = rx.capacity().min(credits);
        let poster = RdmaPoster {
            cfg: self.cfg,
            mrs,
            pd,
            cq,
            local,
            shared: shared.clone(),
            prepared: HashMap::new(),
            posted: 0,
            credits,
            max_wr,
            steps: Vec::new(),
            thread: Some(handle),
        };
        Ok((poster, RdmaCompletions { rx, shared }))
    }
}

impl Transport for RdmaTransport {
    fn kind(&self) -> &'static str {
        "rdma"
    }

    /// [`Descriptor::None`]: the sender's descriptor is per receiver (one
    /// queue pair each), from [`Poster::prepare`].
    fn local_descriptor(&self) -> Descriptor {
        Descriptor::None
    }

    fn start(self: Box<Self>, local: Arc<StagingBuffer>) -> Result<Started, TransportError> {
        let (p, c) = self.start_rdma(local)?;
        Ok((Box::new(p), Box::new(c)))
    }
}

/// The posting half: queue pairs per receiver, posts RDMA WRITEs.
pub struct RdmaPoster {
    cfg: RdmaConfig,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    local: Arc<StagingBuffer>,
    /// The MRs over the staging segments and the caller's registered
    /// regions (shared with the sender, which registers regions and
    /// re-registers renewed shares: [`Poster::local_registry`]).
    mrs: Arc<LocalMrs>,
    shared: Arc<Shared>,
    /// Queue pairs created by `prepare`, by their QP number, waiting for
    /// the receiver's answer.
    prepared: HashMap<u32, Qp>,
    posted: u64,
    credits: usize,
    max_wr: u32,
    steps: Vec<Step>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RdmaPoster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaPoster")
            .field("posted", &self.posted)
            .field("credits", &self.credits)
            .field("prepared", &self.prepared.len())
            .finish_non_exhaustive()
    }
}

impl RdmaPoster {
    /// Posts the writes of one peer's chain; returns the completions to
    /// deliver at once (writes that could not be posted).
    fn post_chain(
        &self,
        peer: PeerIndex,
        ops: &[(WriteOp, bool)],
        mrs: &LocalView<'_>,
        now: &mut Vec<(u64, CompletionStatus)>,
    ) {
        let Some(pq) = self.shared.peer(peer) else {
            now.extend(
                ops.iter()
                    .map(|(o, _)| (o.work_id, CompletionStatus::UnknownPeer)),
            );
            return;
        };
        let mut inflight = pq.inflight.lock();
        if inflight.failed() {
            now.extend(
                ops.iter()
                    .map(|(o, _)| (o.work_id, CompletionStatus::ConnectionLost)),
            );
            return;
        }
        let mut wrs = Vec::with_capacity(ops.len());
        let mut first_seq = None;
        for (op, signalled) in ops {
            // Region 0: the MR of the staging segment holding the op's
            // slot; any other a caller's region (its own MR: the NIC reads
            // the caller's memory).
            let Some(src) = mrs.source(op.local_region, op.local_offset, op.len) else {
                // plan() checked the range against the whole buffer under
                // the same view; this is a staging range across two
                // segments (the sender's ops are one slot each) or in a
                // share being renewed (none of its slots is in use then).
                now.push((op.work_id, CompletionStatus::OutOfBounds));
                continue;
            };
            let seq = inflight.push(op.work_id);
            first_seq.get_or_insert(seq);
            wrs.push(WriteWr {
                wr_id: seq,
                local_addr: src.addr,
                // plan() rejected lengths above MAX_WRITE_LEN (2^31).
                len: op.len as u32,
                lkey: src.lkey,
                remote_addr: pq.remote.addr + op.remote_offset,
                rkey: pq.remote.rkey,
                signalled: *signalled,
            });
        }
        // The chain's last posted request is always signalled (plan() made
        // it so; this keeps it so even if an op above was skipped).
        if let Some(last) = wrs.last_mut() {
            last.signalled = true;
        }
        // SAFETY: every local range lies inside one MR (`source` above): a
        // staging segment's, whose MR keeps the buffer alive (the CQ
        // thread, which holds the CQ these writes complete on, keeps the
        // MR table until it is joined), or a caller's region, whose memory
        // the caller keeps allocated while registered
        // (`LocalRegistry::register`'s contract); the read view keeps each
        // MR registered until the post returned. The sender neither reuses
        // a staging slot, nor renews (deregisters) a share, nor lets a
        // region be deregistered before the completion of every write from
        // it, and after `ibv_dereg_mr` the NIC cannot read the memory.
        if let Err((_, e)) = unsafe { pq.qp.post_writes(&wrs) } {
            // Part of the chain may be posted without a signalled request
            // at its end: fail the queue pair and everything on it.
            tracing::debug!(peer, error = %e, "ibv_post_send failed: failing the queue pair");
            let _ = pq.qp.fence();
            let mut failed = Vec::new();
            inflight.fail_all(CompletionStatus::ConnectionLost, &mut failed);
            now.extend(failed.iter().map(|c| (c.work_id, c.status())));
        }
    }
}

impl Poster for RdmaPoster {
    /// Creates a queue pair for a new receiver (state INIT) and returns
    /// the descriptor to send in `Hello`: its QP number, LID, GID, and the
    /// staging region's address and length (`rkey` 0: the receiver never
    /// accesses it).
    fn prepare(&mut self) -> Result<Descriptor, TransportError> {
        let qp = Qp::new(self.pd.clone(), self.cq.clone(), self.max_wr)?;
        qp.modify(
            &QpStep::Init,
            &self.pd.ctx.qp_params(0, self.cfg.retry_count),
        )?;
        let ctx = &self.pd.ctx;
        let info = QpInfo {
            qp_num: qp.qp_num(),
            lid: ctx.lid,
            gid: ctx.gid,
            rkey: 0,
            addr: self.local.as_ptr() as u64,
            len: self.local.len(),
        };
        self.prepared.insert(info.qp_num, qp);
        Ok(info.to_descriptor())
    }

    /// Connects the queue pair `prepared` (the descriptor
    /// [`Poster::prepare`] returned) to the receiver that answered with
    /// `remote` (RTR, then RTS); returns the peer index for
    /// [`WriteOp::peer`].
    fn connect_prepared(
        &mut self,
        prepared: &Descriptor,
        remote: &RemoteBuffer,
    ) -> Result<PeerIndex, TransportError> {
        let own = QpInfo::from_descriptor(prepared)?;
        let peer = QpInfo::from_descriptor(&remote.descriptor)?;
        peer.check_geometry(remote.chunk_bytes, remote.capacity_chunks)?;
        let qp = self.prepared.remove(&own.qp_num).ok_or_else(|| {
            TransportError::BadDescriptor(format!(
                "QP {:#x} was not prepared by this poster",
                own.qp_num
            ))
        })?;
        connect(&qp, &self.pd.ctx.qp_params(0, self.cfg.retry_count), &peer)?;
        let pq = Arc::new(PeerQp {
            qp,
            remote: peer,
            inflight: Mutex::new(Inflight::default()),
        });
        let mut peers = self.shared.peers.write();
        let index = PeerIndex::try_from(peers.len())
            .map_err(|_| TransportError::Config("more than u32::MAX peers".into()))?;
        peers.push(Some(pq.clone()));
        self.shared.by_qpn.write().insert(own.qp_num, pq);
        tracing::debug!(
            index,
            qp = own.qp_num,
            remote_qp = peer.qp_num,
            "rdma peer connected"
        );
        Ok(index)
    }

    /// Destroys the queue pair `prepared` names if it was prepared and never
    /// connected.
    fn discard_prepared(&mut self, prepared: &Descriptor) {
        if let Ok(own) = QpInfo::from_descriptor(prepared) {
            if self.prepared.remove(&own.qp_num).is_some() {
                tracing::debug!(qp = own.qp_num, "prepared rdma queue pair discarded");
            }
        }
    }

    /// Always an error: an RC queue pair needs both sides' QP numbers, so
    /// receivers are connected with [`Poster::prepare`] (before `Hello`)
    /// and [`Poster::connect_prepared`] (with the `HelloAck`), which the
    /// sender's ctrl thread does; a static (LMCache-style) peer cannot use
    /// rdma.
    fn connect(&mut self, remote: &RemoteBuffer) -> Result<PeerIndex, TransportError> {
        match &remote.descriptor {
            Descriptor::Rdma { .. } => Err(TransportError::BadDescriptor(
                "an rdma receiver can only be connected with the queue pair the sender announced in its Hello \
                 (Poster::prepare / connect_prepared); a receiver that did not answer Hello cannot use rdma, see docs/rdma.md"
                    .into(),
            )),
            other => Err(TransportError::Unsupported {
                transport: "rdma",
                descriptor: descriptor_kind(other),
            }),
        }
    }

    fn disconnect(&mut self, peer: PeerIndex) {
        let removed = self
            .shared
            .peers
            .write()
            .get_mut(peer as usize)
            .and_then(|p| p.take());
        if let Some(pq) = removed {
            // Flush it: its in-flight ops complete (as ConnectionLost through
            // the flush completions, or Ok if already done) before the CQ
            // thread drops its last reference.
            let _ = pq.qp.fence();
            let mut done = Vec::new();
            pq.inflight
                .lock()
                .fail_all(CompletionStatus::UnknownPeer, &mut done);
            self.shared.by_qpn.write().remove(&pq.qp.qp_num());
            self.shared
                .complete_now(done.iter().map(|c| (c.work_id, c.status())));
            tracing::debug!(peer, "rdma peer disconnected");
        }
    }

    fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError> {
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            return Err(TransportError::Closed);
        }
        let room = self.credits.saturating_sub(self.in_flight()).min(ops.len());
        if room == 0 {
            return Ok(0);
        }
        let ops = &ops[..room];
        let mut steps = std::mem::take(&mut self.steps);
        let shared = self.shared.clone();
        let mrs = self.mrs.clone();
        let view = mrs.view();
        plan(
            ops,
            |id| view.len(id),
            self.cfg.signal_every,
            |p| shared.state(p),
            &mut steps,
        );
        let mut now: Vec<(u64, CompletionStatus)> = Vec::new();
        let mut chains: Vec<(PeerIndex, Vec<(WriteOp, bool)>)> = Vec::new();
        for (op, step) in ops.iter().zip(&steps) {
            match *step {
                Step::Complete(status) => now.push((op.work_id, status)),
                Step::Write { peer, signalled } => {
                    match chains.iter_mut().find(|(p, _)| *p == peer) {
                        Some((_, c)) => c.push((*op, signalled)),
                        None => chains.push((peer, vec![(*op, signalled)])),
                    }
                }
            }
        }
        self.steps = steps;
        // Counted before anything can complete, so in_flight never underflows.
        self.posted += room as u64;
        for (peer, chain) in &chains {
            self.post_chain(*peer, chain, &view, &mut now);
        }
        self.shared.complete_now(now);
        Ok(room)
    }

    fn in_flight(&self) -> usize {
        self.posted.wrapping_sub(self.shared.returned()) as usize
    }

    fn credits(&self) -> usize {
        self.credits
    }

    /// The MRs: [`Sender::register`](crate::sender::Sender::register)
    /// registers each caller region through it, and the sender re-registers
    /// a staging share through it when it renews the share.
    fn local_registry(&self) -> Option<Arc<dyn LocalRegistry>> {
        Some(self.mrs.clone())
    }

    /// A stalled queue pair is fenced after one stall timeout and its ops
    /// given up after another, so the CQ thread is done by then unless the
    /// device itself hangs.
    fn drop_deadline(&self) -> Duration {
        self.cfg.stall_timeout * 2 + Duration::from_secs(2)
    }
}

impl Drop for RdmaPoster {
    fn drop(&mut self) {
        // The CQ thread delivers what is in flight (RC retries are finite,
        // and the stall watchdog fences a queue pair the NIC does not give
        // up on), then exits and closes the ring.
        self.shared.close();
        let Some(t) = self.thread.take() else { return };
        let limit = self.drop_deadline();
        // Work requests in flight may name caller memory registered through
        // `Sender::register`, which the caller may free once the sender is
        // gone: so the drop waits for the CQ thread to see them complete or
        // flush, however long that takes (an error naming the thread is
        // logged at the deadline), rather than detach it.
        if let Err(e) = crate::threads::join_or_wait(t, limit, CQ_THREAD_NAME) {
            tracing::debug!(error = %e, in_flight = self.in_flight(), "rdma cq thread");
        }
    }
}

/// The completion half: reads the completion ring the CQ thread fills.
pub struct RdmaCompletions {
    rx: Consumer<Completion>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RdmaCompletions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaCompletions")
            .field("ready", &self.rx.len())
            .finish()
    }
}

impl Completions for RdmaCompletions {
    fn poll(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
        deadline: Option<Instant>,
    ) -> PollStatus {
        let shared = &self.shared;
        crate::transport::poll_completion_ring(&mut self.rx, out, max, deadline, |n| {
            shared.add_returned(n)
        })
    }
}
