//! The receiver's side: [`RdmaReceiverSide`] registers the receive buffer
//! once and, for each sender that asks for `rdma` in its `Hello`, creates a
//! queue pair connected to the sender's and returns the descriptor for the
//! `HelloAck` (QP number, LID, GID, rkey, address and length of the slot
//! area). The receiver's CPU takes no part in the writes: nothing is posted
//! on these queue pairs, the sender's RDMA WRITEs land directly in the slots.

use std::collections::HashMap;
use std::sync::Arc;

use crate::protocol::Descriptor;
use crate::region::Region;
use crate::transport::TransportError;

use super::config::RdmaConfig;
use super::info::QpInfo;
use super::qp_state::QpStep;
use super::verbs::{connect, Context, Cq, Mr, Pd, Qp};

/// Access a receiver's memory region and queue pairs grant: remote write
/// (which requires local write).
fn remote_write() -> u32 {
    use ibverbs_sys::ibv_access_flags as a;
    (a::IBV_ACCESS_LOCAL_WRITE | a::IBV_ACCESS_REMOTE_WRITE).0
}

/// The receiver's RDMA endpoint: one protection domain and memory region
/// over the slot area, one RC queue pair per sender.
pub struct RdmaReceiverSide {
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    mr: Mr,
    /// By the sender's QP number.
    qps: HashMap<u32, Qp>,
}

impl std::fmt::Debug for RdmaReceiverSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaReceiverSide")
            .field("device", &self.pd.ctx.name)
            .field("senders", &self.qps.len())
            .finish_non_exhaustive()
    }
}

impl RdmaReceiverSide {
    /// Opens the device of `cfg` and registers the slot area of `region`
    /// for remote writes. [`TransportError::NoDevice`] without a device.
    pub fn new(region: Arc<Region>, cfg: &RdmaConfig) -> Result<Self, TransportError> {
        cfg.validate()?;
        let ctx = Context::open(cfg.device.as_deref(), cfg.port, cfg.gid_index)?;
        let pd = Pd::new(ctx.clone())?;
        let (addr, len) = (region.data_ptr(), region.data_len());
        let owner: Arc<dyn std::any::Any + Send + Sync> = region;
        // SAFETY: the region's mapping covers its slot area `addr..addr +
        // len` and stays mapped while `owner` (an Arc of the region) lives,
        // which the memory region keeps until it is deregistered.
        let mr = unsafe { Mr::register(pd.clone(), addr, len, remote_write(), owner)? };
        // Nothing is posted on the receiver's queue pairs, so the CQ only
        // has to exist.
        let cq = Cq::new(ctx, 16, None)?;
        Ok(Self {
            pd,
            cq,
            mr,
            qps: HashMap::new(),
        })
    }

    /// Connects a new queue pair to the sender's (its `Hello` descriptor)
    /// and returns this side's descriptor for the `HelloAck`. A sender that
    /// says hello again with the same QP number gets a fresh queue pair (the
    /// old one is destroyed). Errors: [`TransportError::Unsupported`] /
    /// [`TransportError::BadDescriptor`] for a bad descriptor, verbs errors
    /// as [`TransportError::Io`].
    pub fn accept(&mut self, sender: &Descriptor) -> Result<Descriptor, TransportError> {
        let peer = QpInfo::from_descriptor(sender)?;
        self.qps.remove(&peer.qp_num);
        // Nothing is posted on this side, so its retry count never applies.
        let params = self
            .pd
            .ctx
            .qp_params(remote_write(), super::qp_state::RETRY_COUNT);
        let qp = Qp::new(self.pd.clone(), self.cq.clone(), 1)?;
        qp.modify(&QpStep::Init, &params)?;
        connect(&qp, &params, &peer)?;
        let ctx = &self.pd.ctx;
        let info = QpInfo {
            qp_num: qp.qp_num(),
            lid: ctx.lid,
            gid: ctx.gid,
            rkey: self.mr.rkey(),
            addr: self.mr.addr,
            len: self.mr.len,
        };
        tracing::debug!(
            sender_qp = peer.qp_num,
            qp = info.qp_num,
            "rdma sender accepted"
        );
        self.qps.insert(peer.qp_num, qp);
        Ok(info.to_descriptor())
    }

    /// Destroys the queue pair of the sender whose QP number is
    /// `sender_qp_num` (e.g. when its lease expired); returns whether there
    /// was one. Writes from it fail on the sender's side afterwards.
    pub fn forget(&mut self, sender_qp_num: u32) -> bool {
        self.qps.remove(&sender_qp_num).is_some()
    }

    /// Number of connected senders.
    pub fn senders(&self) -> usize {
        self.qps.len()
    }

    /// The open device's name.
    pub fn device_name(&self) -> &str {
        &self.pd.ctx.name
    }
}

/// The receiver's core calls this from `on_hello` when a sender asks for
/// `"rdma"`: one queue pair per sender, torn down when its lease expires or
/// it says `Hello` again.
impl crate::receiver::HelloAcceptor for RdmaReceiverSide {
    fn kind(&self) -> &'static str {
        "rdma"
    }

    fn accept(&mut self, sender: &Descriptor) -> Result<Descriptor, String> {
        RdmaReceiverSide::accept(self, sender).map_err(|e| e.to_string())
    }

    fn forget(&mut self, sender: &Descriptor) {
        if let Ok(peer) = QpInfo::from_descriptor(sender) {
            if RdmaReceiverSide::forget(self, peer.qp_num) {
                tracing::debug!(sender_qp = peer.qp_num, "rdma sender forgotten");
            }
        }
    }
}
