//! Verbs asynchronous events (`ibv_get_async_event`) and what the sender
//! does about each. A broken queue pair or port shows up here even while no
//! write is in flight, and sooner than through retries when one is.
//!
//! - a queue pair error (`QP_FATAL`, `QP_REQ_ERR`, `QP_ACCESS_ERR`,
//!   `PATH_MIG_ERR`): fence that queue pair;
//! - the port went down (`PORT_ERR`, e.g. `ip link set <netdev> down`
//!   under rxe) or the device or CQ broke (`DEVICE_FATAL`, `CQ_ERR`): fence
//!   every queue pair;
//! - anything else (`PORT_ACTIVE`, `GID_CHANGE`, `COMM_EST`, ...) is only
//!   logged.
//!
//! Fencing moves the queue pair to the error state: its outstanding writes
//! flush (`ConnectionLost`, which makes the sender re-handshake with that
//! receiver) and later posts to it fail at once.

use ibverbs_sys as ffi;

/// One asynchronous event, copied out of the verbs event before it is
/// acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// `ibv_event_type`.
    pub kind: u32,
    /// The queue pair number, for queue pair events.
    pub qp_num: Option<u32>,
    /// The port number, for port events.
    pub port: Option<u8>,
}

/// What to do about an [`AsyncEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventAction {
    /// Fence the queue pair with this number.
    FenceQp(u32),
    /// Fence every queue pair.
    FenceAll,
    /// Nothing beyond logging.
    Note,
}

/// True for the event kinds whose `element` is a queue pair.
pub fn is_qp_event(kind: u32) -> bool {
    matches!(
        kind,
        ffi::IBV_EVENT_QP_FATAL
            | ffi::IBV_EVENT_QP_REQ_ERR
            | ffi::IBV_EVENT_QP_ACCESS_ERR
            | ffi::IBV_EVENT_COMM_EST
            | ffi::IBV_EVENT_SQ_DRAINED
            | ffi::IBV_EVENT_PATH_MIG
            | ffi::IBV_EVENT_PATH_MIG_ERR
            | ffi::IBV_EVENT_QP_LAST_WQE_REACHED
    )
}

/// True for the event kinds whose `element` is a port number.
pub fn is_port_event(kind: u32) -> bool {
    matches!(
        kind,
        ffi::IBV_EVENT_PORT_ACTIVE
            | ffi::IBV_EVENT_PORT_ERR
            | ffi::IBV_EVENT_LID_CHANGE
            | ffi::IBV_EVENT_PKEY_CHANGE
            | ffi::IBV_EVENT_SM_CHANGE
            | ffi::IBV_EVENT_CLIENT_REREGISTER
            | ffi::IBV_EVENT_GID_CHANGE
    )
}

/// The sender's reaction to `ev` on a context that uses port `port`.
pub fn action(ev: &AsyncEvent, port: u8) -> EventAction {
    match ev.kind {
        ffi::IBV_EVENT_QP_FATAL
        | ffi::IBV_EVENT_QP_REQ_ERR
        | ffi::IBV_EVENT_QP_ACCESS_ERR
        | ffi::IBV_EVENT_PATH_MIG_ERR => ev.qp_num.map_or(EventAction::Note, EventAction::FenceQp),
        ffi::IBV_EVENT_PORT_ERR if ev.port.is_none_or(|p| p == port) => EventAction::FenceAll,
        ffi::IBV_EVENT_DEVICE_FATAL | ffi::IBV_EVENT_CQ_ERR => EventAction::FenceAll,
        _ => EventAction::Note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: u32, qp_num: Option<u32>, port: Option<u8>) -> AsyncEvent {
        AsyncEvent { kind, qp_num, port }
    }

    #[test]
    fn queue_pair_errors_fence_that_queue_pair() {
        for k in [
            ffi::IBV_EVENT_QP_FATAL,
            ffi::IBV_EVENT_QP_REQ_ERR,
            ffi::IBV_EVENT_QP_ACCESS_ERR,
            ffi::IBV_EVENT_PATH_MIG_ERR,
        ] {
            assert!(is_qp_event(k) && !is_port_event(k), "{k}");
            assert_eq!(
                action(&ev(k, Some(0x11), None), 1),
                EventAction::FenceQp(0x11)
            );
        }
        assert_eq!(
            action(&ev(ffi::IBV_EVENT_COMM_EST, Some(0x11), None), 1),
            EventAction::Note
        );
    }

    #[test]
    fn port_down_and_device_errors_fence_everything() {
        assert!(is_port_event(ffi::IBV_EVENT_PORT_ERR));
        assert_eq!(
            action(&ev(ffi::IBV_EVENT_PORT_ERR, None, Some(1)), 1),
            EventAction::FenceAll
        );
        assert_eq!(
            action(&ev(ffi::IBV_EVENT_PORT_ERR, None, Some(2)), 1),
            EventAction::Note,
            "another port of the device"
        );
        assert_eq!(
            action(&ev(ffi::IBV_EVENT_DEVICE_FATAL, None, None), 1),
            EventAction::FenceAll
        );
        assert_eq!(
            action(&ev(ffi::IBV_EVENT_PORT_ACTIVE, None, Some(1)), 1),
            EventAction::Note
        );
        assert_eq!(
            action(&ev(ffi::IBV_EVENT_GID_CHANGE, None, Some(1)), 1),
            EventAction::Note
        );
    }
}
