//! TCP transport end-to-end payload throughput over loopback (post → engine
//! → socket → receiver data thread lands it in the buffer → ack → poll)
//! against a plain `std::net` send/recv of the same bytes over loopback
//! (one writer, one reader thread, one final 1-byte ack per iteration), for
//! 4 KiB, 64 KiB and 256 KiB chunks.
//!
//! Run briefly on a shared machine:
//! `cargo bench --bench tcp -- --warm-up-time 1 --measurement-time 2`

mod common;

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::page_aligned;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvferry::protocol::{
    decode, encode, AllocRequest, Descriptor, Hello, Message, PROTOCOL_VERSION,
};
use kvferry::receiver::{Receiver, ReceiverConfig};
use kvferry::staging::StagingBuffer;
use kvferry::transport::{by_name, PollStatus, RemoteBuffer, TransportConfig, WriteOp};

/// Bytes moved per iteration (per chunk size).
const BYTES_PER_ITER: u64 = 4 << 20;

/// Says Hello for tcp and grants every slot of `r` to one request through
/// the control plane, so the data thread accepts this sender's writes
/// anywhere in the buffer. Returns the HelloAck's descriptor (with the
/// secret).
fn grant_all(r: &Receiver, slots: u64, chunk: u64) -> Descriptor {
    let sock = kvferry::zmq_io::context()
        .socket(zmq::DEALER)
        .expect("dealer");
    sock.set_linger(0).expect("linger");
    sock.connect(r.endpoint()).expect("connect");
    let hello = Message::Hello(Hello {
        sender_id: "bench".into(),
        version: PROTOCOL_VERSION,
        transport: "tcp".into(),
        descriptor: Descriptor::None,
    });
    sock.send_multipart([&b""[..], &encode(&hello)], 0)
        .expect("send hello");
    let frames = sock.recv_multipart(0).expect("hello ack");
    let descriptor = match decode(frames.last().expect("payload")) {
        Ok(Message::HelloAck(a)) => a.descriptor,
        other => panic!("hello failed: {other:?}"),
    };
    let keys: Vec<String> = (0..slots).map(|i| format!("k{i}")).collect();
    let req = Message::AllocRequest(AllocRequest {
        keys,
        fmt: 1,
        shape: vec![chunk as i64],
        dtype: "uint8".into(),
        last_chunk_toks: 1,
        req_id: "bench".into(),
        is_last_batch: false,
        total_chunks: slots as i64,
        seq: None,
    });
    sock.send_multipart([&b""[..], &encode(&req)], 0)
        .expect("send");
    let frames = sock.recv_multipart(0).expect("reply");
    match decode(frames.last().expect("payload")) {
        Ok(Message::AllocResponse(a)) if a.remote_indexes.iter().all(|&i| i >= 0) => descriptor,
        other => panic!("grant failed: {other:?}"),
    }
}

/// The baseline: a reader thread that drains `BYTES_PER_ITER` bytes per
/// round and answers one byte.
fn plain_peer() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let _ = s.set_nodelay(true);
        // Page-aligned, as the receiver's buffer is (`page_aligned`).
        let mut buf = page_aligned(256 << 10, 0);
        loop {
            let mut left = BYTES_PER_ITER as usize;
            while left > 0 {
                match s.read(&mut buf[..left.min(256 << 10)]) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => left -= n,
                }
            }
            if s.write_all(&[1]).is_err() {
                return;
            }
        }
    });
    addr
}

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
        let receiver = Receiver::start(ReceiverConfig {
            capacity_chunks: chunks as usize,
            chunk_bytes: chunk,
            tcp_data: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..ReceiverConfig::default()
        })
        .expect("receiver");
        let descriptor = grant_all(&receiver, chunks, chunk);
        let (mut poster, mut comps) = by_name("tcp", &TransportConfig::default())
            .expect("tcp")
            .start(staging.clone())
            .expect("start");
        let peer = poster
            .connect(&RemoteBuffer {
                descriptor,
                chunk_bytes: chunk,
                capacity_chunks: chunks,
            })
            .expect("connect");
        // One op per chunk (not coalesced): the per-op framing counts.
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

        let mut group = c.benchmark_group(format!("tcp/{}KiB", chunk >> 10));
        group.throughput(Throughput::Bytes(BYTES_PER_ITER));
        group.sample_size(10);

        let mut plain = TcpStream::connect(plain_peer()).expect("connect plain");
        plain.set_nodelay(true).expect("nodelay");
        group.bench_function(BenchmarkId::new("std_net", "send+recv"), |b| {
            b.iter(|| {
                for i in 0..chunks {
                    // SAFETY: chunk i lies inside the staging mapping and
                    // no transport write reads it concurrently (the
                    // transport is idle during this closure).
                    let bytes = unsafe {
                        std::slice::from_raw_parts(
                            staging.as_ptr().add((i * chunk) as usize),
                            chunk as usize,
                        )
                    };
                    plain.write_all(bytes).expect("send");
                }
                let mut ack = [0u8; 1];
                plain.read_exact(&mut ack).expect("ack");
                black_box(ack);
            })
        });

        let mut done = Vec::with_capacity(ops.len());
        group.bench_function(BenchmarkId::new("tcp_transport", "post+poll"), |b| {
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
                assert!(done.iter().all(|c| c.ok()), "a write failed");
                black_box(&done);
            })
        });
        group.finish();
        drop(poster);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
