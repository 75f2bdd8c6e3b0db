//! The `kvferry` binary's code (feature `cli`): the command line and the load
//! runner.

#[cfg(feature = "cli")]
pub mod cli;

#[cfg(feature = "cli")]
pub mod runner;
