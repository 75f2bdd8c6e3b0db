//! The TCP transport: `kvferry run` scenarios over loopback, a cut data
//! connection mid-transfer, and transport-level tests against a receiver's
//! data listener.

use kvferry::runner::{self, ChunkRange, Progress, RunConfig};

fn small(requests: usize) -> RunConfig {
    RunConfig {
        prefillers: 2,
        decoders: 2,
        requests,
        chunks: ChunkRange { min: 1, max: 8 },
        batch: 3,
        chunk_bytes: 4096,
        staging_slots: 12,
        capacity_chunks: 16,
        concurrency: 4,
        stall_timeout_s: 20.0,
        transport: "tcp".into(),
        ..RunConfig::default()
    }
}

#[test]
fn run_over_tcp_succeeds_without_leaks() {
    let r = runner::run(small(500), Progress::Quiet).expect("run starts");
    assert!(r.success(), "{}", r.render());
    assert_eq!(r.completed, 500, "{}", r.render());
}
