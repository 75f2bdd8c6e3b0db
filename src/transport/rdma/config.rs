//! [`RdmaConfig`]: which device and port to use and how the data path
//! batches, from a [`TransportConfig`] plus `KVFERRY_RDMA_*` environment
//! variables (the shared transport config has no RDMA fields).

use std::time::Duration;

use crate::transport::{TransportConfig, TransportError, MAX_RING_CAPACITY};

use super::plan::DEFAULT_SIGNAL_EVERY;
use super::qp_state::RETRY_COUNT;

/// Default for [`RdmaConfig::stall_timeout`]: about ten times the RC retry
/// budget (`RETRY_COUNT + 1` tries of the ~67 ms ACK timeout), so a queue
/// pair is only fenced by the watchdog when the NIC itself failed to give up.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Environment variable naming the RDMA device (`mlx5_0`, `rxe0`); unset =
/// the first device.
pub const ENV_DEVICE: &str = "KVFERRY_RDMA_DEVICE";
/// Environment variable with the port number (default 1).
pub const ENV_PORT: &str = "KVFERRY_RDMA_PORT";
/// Environment variable with the GID index (default 0; on RoCE v2 often 1).
pub const ENV_GID_INDEX: &str = "KVFERRY_RDMA_GID_INDEX";

/// Configuration of the RDMA transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Device to open; `None` = the first one.
    pub device: Option<String>,
    /// Port number on the device (1-based).
    pub port: u8,
    /// Index of the local GID used for routing (RoCE needs one).
    pub gid_index: u8,
    /// Writes that may be in flight at once (completion ring capacity, CQ
    /// size and per-QP send queue depth).
    pub credits: usize,
    /// Signal every this many work requests of a chain (and always the last).
    pub signal_every: u32,
    /// Pin the CQ-poll thread to this CPU (best effort).
    pub pin_cpu: Option<usize>,
    /// RC transport retries of the sender's queue pairs (`retry_cnt`,
    /// 0..=7). Keep it at most 6: rxe treats 7 as "retry forever", which
    /// only the stall watchdog then ends.
    pub retry_count: u8,
    /// A queue pair with writes in flight and no completion for this long is
    /// moved to the error state, so its writes flush (`ConnectionLost`); if
    /// even the flushes do not come within another `stall_timeout`, its ops
    /// fail without them (`TransportError`). Also bounds dropping the poster.
    pub stall_timeout: Duration,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: 0,
            credits: crate::transport::DEFAULT_RING_CAPACITY,
            signal_every: DEFAULT_SIGNAL_EVERY,
            pin_cpu: None,
            retry_count: RETRY_COUNT,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
        }
    }
}

impl RdmaConfig {
    /// From the shared config (credits = `ring_capacity`, `pin_cpu`) and
    /// the `KVFERRY_RDMA_*` environment variables.
    pub fn from_env(cfg: &TransportConfig) -> Result<Self, TransportError> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self::from_parts(
            cfg,
            var(ENV_DEVICE),
            var(ENV_PORT).as_deref(),
            var(ENV_GID_INDEX).as_deref(),
        )
    }

    /// As [`RdmaConfig::from_env`] with the variables' values given.
    pub fn from_parts(
        cfg: &TransportConfig,
        device: Option<String>,
        port: Option<&str>,
        gid_index: Option<&str>,
    ) -> Result<Self, TransportError> {
        let num = |name: &str, v: Option<&str>, default: u8| -> Result<u8, TransportError> {
            match v {
                None => Ok(default),
                Some(s) => s.trim().parse().map_err(|_| {
                    TransportError::Config(format!("{name}={s:?} is not a number in 0..=255"))
                }),
            }
        };
        let c = Self {
            device,
            port: num(ENV_PORT, port, 1)?,
            gid_index: num(ENV_GID_INDEX, gid_index, 0)?,
            credits: cfg.ring_capacity,
            signal_every: DEFAULT_SIGNAL_EVERY,
            pin_cpu: cfg.pin_cpu,
            ..Self::default()
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the ranges: credits in `1..=MAX_RING_CAPACITY`, port at least
    /// 1, `signal_every` at least 1, `retry_count` at most 7, a non-zero
    /// `stall_timeout`.
    pub fn validate(&self) -> Result<(), TransportError> {
        if self.credits == 0 || self.credits > MAX_RING_CAPACITY {
            return Err(TransportError::Config(format!(
                "rdma credits {} must be in 1..={MAX_RING_CAPACITY}",
                self.credits
            )));
        }
        if self.port == 0 {
            return Err(TransportError::Config(
                "rdma port numbers start at 1".into(),
            ));
        }
        if self.signal_every == 0 {
            return Err(TransportError::Config(
                "rdma signal_every must be at least 1".into(),
            ));
        }
        if self.retry_count > 7 {
            return Err(TransportError::Config(format!(
                "rdma retry_count {} must be in 0..=7 (a 3-bit field)",
                self.retry_count
            )));
        }
        if self.stall_timeout.is_zero() {
            return Err(TransportError::Config(
                "rdma stall_timeout must be positive".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_parts_and_rejects_bad_values() {
        let t = TransportConfig::default();
        let c = RdmaConfig::from_parts(&t, Some("rxe0".into()), Some("1"), Some(" 3 ")).unwrap();
        assert_eq!(c.device.as_deref(), Some("rxe0"));
        assert_eq!((c.port, c.gid_index, c.credits), (1, 3, t.ring_capacity));
        assert_eq!(
            RdmaConfig::from_parts(&t, None, None, None).unwrap(),
            RdmaConfig::default()
        );
        let bad = |r: Result<RdmaConfig, TransportError>| match r {
            Err(TransportError::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        };
        assert!(bad(RdmaConfig::from_parts(&t, None, Some("x"), None)).contains(ENV_PORT));
        assert!(bad(RdmaConfig::from_parts(&t, None, None, Some("300"))).contains(ENV_GID_INDEX));
        assert!(bad(RdmaConfig::from_parts(&t, None, Some("0"), None)).contains("port"));
        let zero = TransportConfig {
            ring_capacity: 0,
            ..TransportConfig::default()
        };
        assert!(bad(RdmaConfig::from_parts(&zero, None, None, None)).contains("credits"));
        let c = RdmaConfig {
            signal_every: 0,
            ..RdmaConfig::default()
        };
        assert!(bad(c.validate().map(|()| c.clone())).contains("signal_every"));
        let c = RdmaConfig {
            retry_count: 8,
            ..RdmaConfig::default()
        };
        assert!(bad(c.validate().map(|()| c.clone())).contains("retry_count"));
        let c = RdmaConfig {
            stall_timeout: Duration::ZERO,
            ..RdmaConfig::default()
        };
        assert!(bad(c.validate().map(|()| c.clone())).contains("stall_timeout"));
    }
}
