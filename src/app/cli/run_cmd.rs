//! `kvferry run`: the main job (xPyD on one machine).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::runner::{self, ChunkRange, Progress, RunConfig, RunError};

/// Arguments of `kvferry run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The load options.
    #[command(flatten)]
    pub load: LoadArgs,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
}

/// The load a run generates. Every option may also come from `--config`
/// (TOML, same names with `_`); the command line wins.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// TOML file with the same keys as the options.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Prefill senders [default: 2].
    #[arg(long)]
    pub prefillers: Option<usize>,
    /// Decode receivers [default: 1].
    #[arg(long)]
    pub decoders: Option<usize>,
    /// Requests in the whole run [default: 2000].
    #[arg(long)]
    pub requests: Option<usize>,
    /// Chunks per request, MIN..MAX [default: 1..32].
    #[arg(long)]
    pub chunks: Option<ChunkRange>,
    /// Chunks per store call [default: 4].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Bytes per chunk [default: 262144].
    #[arg(long)]
    pub chunk_bytes: Option<u64>,
    /// Staging slots per prefiller [default: 64].
    #[arg(long)]
    pub staging_slots: Option<usize>,
    /// Receive slots per decoder [default: 64, below the chunks in flight so
    /// admission is exercised].
    #[arg(long)]
    pub capacity_chunks: Option<usize>,
    /// Requests in flight per prefiller [default: 4].
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Fraction of requests cancelled part-way [default: 0].
    #[arg(long)]
    pub abort_rate: Option<f64>,
    /// Fraction of writes that fail (fault injection) [default: 0].
    #[arg(long)]
    pub fail_rate: Option<f64>,
    /// Seed of every random choice [default: 1].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Data plane: shm, tcp or rdma [default: shm].
    #[arg(long)]
    pub transport: Option<String>,
    /// Seconds without progress before the watchdog declares a deadlock [default: 10].
    #[arg(long)]
    pub stall_timeout: Option<f64>,
    /// Hand chunks over with the copying `store` (one more copy per chunk)
    /// instead of filling staging in place [default: in place].
    #[arg(long)]
    pub copy_store: bool,
}

impl LoadArgs {
    /// The configuration: defaults, then `--config`, then the options.
    pub fn config(&self) -> Result<RunConfig, String> {
        let mut c = match &self.config {
            Some(p) => RunConfig::from_file(p)?,
            None => RunConfig::default(),
        };
        macro_rules! over {
            ($($f:ident => $g:ident),*) => { $( if let Some(v) = self.$f.clone() { c.$g = v; } )* };
        }
        over!(prefillers => prefillers, decoders => decoders, requests => requests, chunks => chunks,
              batch => batch, chunk_bytes => chunk_bytes, staging_slots => staging_slots,
              capacity_chunks => capacity_chunks, concurrency => concurrency, abort_rate => abort_rate,
              fail_rate => fail_rate, seed => seed, transport => transport, stall_timeout => stall_timeout_s);
        if self.copy_store {
            c.copy_store = true;
        }
        c.validate()?;
        Ok(c)
    }
}

/// The progress mode for a command's flags.
pub fn progress_mode(quiet: bool) -> Progress {
    if quiet {
        Progress::Quiet
    } else if std::io::stderr().is_terminal() {
        Progress::Bar
    } else {
        Progress::Lines
    }
}

/// Runs the job and prints the report. Exit code 0 only if every request
/// not deliberately aborted or failed completed and nothing leaked.
pub fn run(a: RunArgs) -> ExitCode {
    let cfg = match a.load.config() {
        Ok(c) => c,
        Err(e) => return super::usage_error(e),
    };
    finish(runner::run(cfg, progress_mode(a.quiet)), a.json)
}

/// Prints a run's report (table or JSON) and turns it into the exit code.
pub fn finish(result: Result<runner::RunReport, RunError>, json: bool) -> ExitCode {
    let report = match result {
        Ok(r) => r,
        Err(e @ (RunError::Config(_) | RunError::Unavailable(_))) => return super::usage_error(e),
        Err(e) => return super::runtime_error(e),
    };
    if json {
        match report.to_json() {
            Ok(s) => super::say!("{s}"),
            Err(e) => return super::runtime_error(format!("cannot encode the report: {e}")),
        }
    } else {
        print!("{}", report.render());
    }
    let ok = report.success();
    if report.deadlock {
        // Threads may be stuck: leave without joining them.
        let _ = std::io::Write::flush(&mut std::io::stdout());
        std::process::exit(1);
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
