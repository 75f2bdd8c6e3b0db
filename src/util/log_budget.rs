//! [`LogBudget`]: a rate limit for log lines a peer can trigger.
//!
//! A hostile peer must not turn a 22-byte message into 181 bytes of log, so
//! every warning a peer's message causes goes through a budget: at most
//! [`LogBudget::PER_WINDOW`] lines per [`LogBudget::WINDOW`], and the first
//! line of the next window says how many were suppressed. The clock is an
//! argument, so the receiver core stays I/O-free and testable.

use std::time::{Duration, Instant};

/// A per-window line budget (see the module docs).
#[derive(Debug, Clone)]
pub struct LogBudget {
    window_start: Option<Instant>,
    used: u32,
    suppressed: u64,
}

impl Default for LogBudget {
    fn default() -> Self {
        Self::new()
    }
}

impl LogBudget {
    /// Lines allowed per window.
    pub const PER_WINDOW: u32 = 10;
    /// Length of a window.
    pub const WINDOW: Duration = Duration::from_secs(1);

    /// A fresh budget.
    pub const fn new() -> Self {
        Self {
            window_start: None,
            used: 0,
            suppressed: 0,
        }
    }

    /// Whether a line may be logged at `now`: `Some(n)` with the number of
    /// lines suppressed since the last allowed one, or `None` (suppressed).
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        let fresh = self
            .window_start
            .is_none_or(|s| now.saturating_duration_since(s) >= Self::WINDOW);
        if fresh {
            self.window_start = Some(now);
            self.used = 0;
        }
        if self.used >= Self::PER_WINDOW {
            self.suppressed += 1;
            return None;
        }
        self.used += 1;
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// `warn!` through a [`LogBudget`]: `peer_warn!(budget, now, fields..., "msg")`.
#[macro_export]
#[doc(hidden)]
macro_rules! peer_warn {
    ($budget:expr, $now:expr, $($arg:tt)+) => {
        if let Some(suppressed) = $budget.allow($now) {
            ::tracing::warn!(suppressed, $($arg)+);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_a_few_lines_per_window_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut b = LogBudget::new();
        for _ in 0..LogBudget::PER_WINDOW {
            assert_eq!(b.allow(t0), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(b.allow(t0 + Duration::from_millis(500)), None);
        }
        assert_eq!(
            b.allow(t0 + LogBudget::WINDOW),
            Some(5),
            "the next window reports what was suppressed"
        );
        assert_eq!(b.allow(t0 + LogBudget::WINDOW), Some(0));
    }
}
