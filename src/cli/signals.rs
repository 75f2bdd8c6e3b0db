//! Waiting for SIGINT/SIGTERM without spinning.

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Blocks until SIGINT or SIGTERM arrives. Returns the signal, or an error if
/// the handlers could not be installed.
pub fn wait_for_termination() -> std::io::Result<i32> {
    let mut signals = Signals::new([SIGINT, SIGTERM])?;
    Ok(signals.forever().next().unwrap_or(SIGTERM))
}
