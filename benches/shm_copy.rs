//! shm transport end-to-end payload throughput (post → copy engine →
//! poll) against a plain single-thread memcpy of the same bytes between the
//! same two mappings, for 4 KiB, 64 KiB and 256 KiB chunks.
//!
//! Run briefly on a shared machine:
//! `cargo bench --bench shm_copy -- --warm-up-time 1 --measurement-time 2`

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvferry::protocol::Descriptor;
use kvferry::region::{default_region_path, Region};
use kvferry::staging::StagingBuffer;
use kvferry::transport::{by_name, PollStatus, RemoteBuffer, TransportConfig, WriteOp};

/// Bytes moved per iteration (per chunk size).
const BYTES_PER_ITER: u64 = 4 << 20;

fn bench(c: &mut Criterion) {
    for chunk in [4u64 << 10, 64 << 10, 256 << 10] {
        let chunks = BYTES_PER_ITER / chunk;
        let mut staging = StagingBuffer::new(chunks as usize, chunk).expect("staging");
        for s in 0..chunks as u32 {
            staging
                .write_slot(s, &vec![s as u8; chunk as usize])
                .expect("fill staging");
        }
        let staging = Arc::new(staging);
        let region = Region::create(&default_region_path(), chunk, chunks).expect("region");
        let (mut poster, mut comps) = by_name("shm", &TransportConfig::default())
            .expect("shm")
            .start(staging.clone())
            .expect("start");
        let peer = poster
            .connect(&RemoteBuffer {
                descriptor: Descriptor::Shm {
                    path: region.path().to_string_lossy().into_owned(),
                    len: region.data_len(),
                },
                chunk_bytes: chunk,
                capacity_chunks: chunks,
            })
            .expect("connect");
        // One op per chunk (not coalesced): the engine's per-op cost counts.
        let ops: Vec<WriteOp> = (0..chunks)
            .map(|i| WriteOp {
                work_id: i,
                local_offset: i * chunk,
                remote_offset: i * chunk,
                len: chunk,
                peer,
                local_region: 0,
            })
            .collect();

        let mut group = c.benchmark_group(format!("shm_copy/{}KiB", chunk >> 10));
        group.throughput(Throughput::Bytes(BYTES_PER_ITER));
        group.sample_size(10);

        group.bench_function(BenchmarkId::new("memcpy", "1 thread"), |b| {
            b.iter(|| {
                for i in 0..chunks {
                    // SAFETY: chunk i lies inside both mappings (chunks slots
                    // of `chunk` bytes each), which are distinct mappings, and
                    // no transport write is in flight during this closure.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            staging.as_ptr().add((i * chunk) as usize),
                            region.data_ptr().add((i * chunk) as usize),
                            chunk as usize,
                        );
                    }
                }
                black_box(region.data_ptr());
            })
        });

        let mut done = Vec::with_capacity(ops.len());
        group.bench_function(BenchmarkId::new("shm_transport", "post+poll"), |b| {
            b.iter(|| {
                let deadline = Instant::now() + Duration::from_secs(30);
                let mut next = 0;
                done.clear();
                while done.len() < ops.len() {
                    if next < ops.len() {
                        next += poster.post(&ops[next..]).expect("post");
                    }
                    match comps.poll(&mut done, usize::MAX, Some(deadline)) {
                        PollStatus::Ready(_) => {}
                        s => panic!("bench: completions stalled: {s:?}"),
                    }
                }
                black_box(&done);
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
