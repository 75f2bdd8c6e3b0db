//! Waiting for SIGINT/SIGTERM without spinning.

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// SIGINT/SIGTERM handlers, installed before a command announces that it is
/// ready, so a signal sent right after the announcement is caught rather
/// than killing the process with the default action.
pub struct Termination(Signals);

impl Termination {
    /// Installs the handlers.
    pub fn install() -> std::io::Result<Self> {
        Ok(Self(Signals::new([SIGINT, SIGTERM])?))
    }

    /// Blocks until SIGINT or SIGTERM arrives (or arrived since `install`);
    /// returns the signal.
    pub fn wait(mut self) -> i32 {
        self.0.forever().next().unwrap_or(SIGTERM)
    }
}
