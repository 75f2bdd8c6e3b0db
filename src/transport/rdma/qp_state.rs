//! The RC queue pair state machine: the attributes and masks for each
//! `ibv_modify_qp` step RESET → INIT → RTR → RTS (and → ERR to fail a queue
//! pair), built as plain structs so they are checked without a device.

use ffi::ibv_qp_attr_mask as mask;
use ibverbs_sys as ffi;

use super::info::{initial_psn, QpInfo};

/// Local-ACK timeout exponent: 4.096 µs * 2^14 ≈ 67 ms per try.
pub const ACK_TIMEOUT: u8 = 14;
/// Transport retries before a write fails with `RETRY_EXC_ERR` (the
/// default of [`QpParams::retry_count`]). Not 7: rxe's completer never
/// decrements a retry count of 7, so a write to a vanished peer would be
/// retried forever (issue 14); with 6 it fails after about 0.5 s.
pub const RETRY_COUNT: u8 = 6;
/// RNR retries (7 would mean "forever"; 6 keeps every write finite).
pub const RNR_RETRY: u8 = 6;
/// Minimal RNR NAK timer (12 = 0.64 ms).
pub const MIN_RNR_TIMER: u8 = 12;

/// What a queue pair is connected with, besides the peer's [`QpInfo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpParams {
    /// Port number on the device (1-based).
    pub port: u8,
    /// Index of the local GID used for global routing (RoCE).
    pub gid_index: u8,
    /// Path MTU (an `ibv_mtu` value, the port's active MTU).
    pub path_mtu: u32,
    /// Remote access the queue pair allows (`ibv_access_flags` bits).
    pub access: u32,
    /// Transport retries (`retry_cnt`), normally [`RETRY_COUNT`].
    pub retry_count: u8,
}

/// One step of the state machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QpStep {
    /// RESET → INIT: port, partition key, access flags.
    Init,
    /// INIT → RTR: the peer's QP number, route and PSN.
    Rtr(QpInfo),
    /// RTR → RTS: own PSN, timeouts and retries.
    Rts,
    /// any → ERR: flushes every outstanding work request.
    Err,
}

/// The attributes and mask of `step` for local QP `own_qp_num`.
pub fn attrs(
    step: &QpStep,
    p: &QpParams,
    own_qp_num: u32,
) -> (ffi::ibv_qp_attr, ffi::ibv_qp_attr_mask) {
    let mut a = ffi::ibv_qp_attr::default();
    match step {
        QpStep::Init => {
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
            a.pkey_index = 0;
            a.port_num = p.port;
            a.qp_access_flags = p.access;
            let m = mask::IBV_QP_STATE
                | mask::IBV_QP_PKEY_INDEX
                | mask::IBV_QP_PORT
                | mask::IBV_QP_ACCESS_FLAGS;
            (a, m)
        }
        QpStep::Rtr(remote) => {
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = p.path_mtu;
            a.dest_qp_num = remote.qp_num;
            a.rq_psn = initial_psn(remote.qp_num);
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = MIN_RNR_TIMER;
            a.ah_attr.dlid = remote.lid;
            a.ah_attr.sl = 0;
            a.ah_attr.src_path_bits = 0;
            a.ah_attr.port_num = p.port;
            if remote.is_global() {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
                a.ah_attr.grh.sgid_index = p.gid_index;
                a.ah_attr.grh.hop_limit = 0xff;
            }
            let m = mask::IBV_QP_STATE
                | mask::IBV_QP_AV
                | mask::IBV_QP_PATH_MTU
                | mask::IBV_QP_DEST_QPN
                | mask::IBV_QP_RQ_PSN
                | mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | mask::IBV_QP_MIN_RNR_TIMER;
            (a, m)
        }
        QpStep::Rts => {
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
            a.sq_psn = initial_psn(own_qp_num);
            a.timeout = ACK_TIMEOUT;
            a.retry_cnt = p.retry_count;
            a.rnr_retry = RNR_RETRY;
            a.max_rd_atomic = 1;
            let m = mask::IBV_QP_STATE
                | mask::IBV_QP_SQ_PSN
                | mask::IBV_QP_TIMEOUT
                | mask::IBV_QP_RETRY_CNT
                | mask::IBV_QP_RNR_RETRY
                | mask::IBV_QP_MAX_QP_RD_ATOMIC;
            (a, m)
        }
        QpStep::Err => {
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
            (a, mask::IBV_QP_STATE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> QpParams {
        QpParams {
            port: 1,
            gid_index: 1,
            path_mtu: ffi::IBV_MTU_1024,
            access: ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            retry_count: RETRY_COUNT,
        }
    }

    fn remote(gid: [u8; 16], lid: u16) -> QpInfo {
        QpInfo {
            qp_num: 0x42,
            lid,
            gid,
            rkey: 7,
            addr: 0x1000,
            len: 4096,
        }
    }

    #[test]
    fn init_sets_port_and_access() {
        let (a, m) = attrs(&QpStep::Init, &params(), 0x17);
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(a.port_num, 1);
        assert_eq!(a.qp_access_flags, params().access);
        assert_eq!(
            m.0,
            (mask::IBV_QP_STATE
                | mask::IBV_QP_PKEY_INDEX
                | mask::IBV_QP_PORT
                | mask::IBV_QP_ACCESS_FLAGS)
                .0
        );
    }

    #[test]
    fn rtr_routes_to_the_peer_by_gid_or_lid() {
        let (a, m) = attrs(&QpStep::Rtr(remote([9; 16], 0)), &params(), 0x17);
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(a.dest_qp_num, 0x42);
        assert_eq!(a.rq_psn, initial_psn(0x42), "expects the peer's send PSN");
        assert_eq!(a.path_mtu, ffi::IBV_MTU_1024);
        assert_eq!(a.ah_attr.is_global, 1);
        // SAFETY: `raw` is the only representation of the GID union; every
        // bit pattern is a valid [u8; 16].
        assert_eq!(unsafe { a.ah_attr.grh.dgid.raw }, [9; 16]);
        assert_eq!(a.ah_attr.grh.sgid_index, 1);
        assert!(m.0 & mask::IBV_QP_AV.0 != 0 && m.0 & mask::IBV_QP_DEST_QPN.0 != 0);
        assert!(m.0 & mask::IBV_QP_RQ_PSN.0 != 0 && m.0 & mask::IBV_QP_PATH_MTU.0 != 0);
        let (a, _) = attrs(&QpStep::Rtr(remote([0; 16], 5)), &params(), 0x17);
        assert_eq!(a.ah_attr.is_global, 0, "InfiniBand LID routing");
        assert_eq!(a.ah_attr.dlid, 5);
    }

    #[test]
    fn rts_uses_own_psn_and_finite_retries() {
        let (a, m) = attrs(&QpStep::Rts, &params(), 0x17);
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(a.sq_psn, initial_psn(0x17));
        assert!(a.rnr_retry < 7, "rnr_retry 7 would retry forever");
        assert!(a.retry_cnt < 7, "rxe retries a retry_cnt of 7 forever");
        assert_eq!((a.timeout, a.retry_cnt), (ACK_TIMEOUT, RETRY_COUNT));
        assert!(m.0 & mask::IBV_QP_SQ_PSN.0 != 0 && m.0 & mask::IBV_QP_RNR_RETRY.0 != 0);
        let (a, m) = attrs(&QpStep::Err, &params(), 0x17);
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_ERR);
        assert_eq!(m.0, mask::IBV_QP_STATE.0);
    }
}
