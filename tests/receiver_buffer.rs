//! A receive buffer the caller provides (`Receiver::start_with_buffer`): the
//! shm data plane over a caller's memfd (same-host senders map it by its
//! `/proc/<pid>/fd` path), the tcp data plane into caller memory at a
//! pointer, and the typed errors for buffers that do not fit. Each transfer
//! checks the bytes through the caller's own view of its memory, not only
//! through `ChunkRef`. The rdma case is in tests/transport_rdma.rs (it needs
//! a device; CI runs it in the soft-RoCE guest).

use std::fs::File;
use std::net::SocketAddr;
use std::os::fd::FromRawFd;
use std::time::{Duration, Instant};

use kvferry::receiver::{Receiver, ReceiverConfig, ReceiverError, RecvBuffer};
use kvferry::region::{RegionError, DATA_OFFSET};
use kvferry::sender::{RequestStatus, Sender, SenderConfig, TransferSpec};

const CHUNK: u64 = 4096;
const SLOTS: usize = 8;
const DEADLINE: Duration = Duration::from_secs(30);

fn receiver_cfg() -> ReceiverConfig {
    ReceiverConfig {
        capacity_chunks: SLOTS,
        chunk_bytes: CHUNK,
        quarantine_grace: Duration::from_millis(200),
        ..ReceiverConfig::default()
    }
}

fn sender(transport: &str) -> Sender {
    Sender::new(SenderConfig {
        staging_slots: 8,
        chunk_bytes: CHUNK,
        transport: transport.into(),
        ..SenderConfig::default()
    })
    .expect("sender starts")
}

/// Stores `n` distinct chunks as request `req`, waits for both ends, and
/// checks each chunk's bytes through `ChunkRef` and through `view` (the
/// caller's own memory at a slot), while borrowed.
fn transfer(s: &Sender, r: &Receiver, req: &str, n: u8, view: impl Fn(u32) -> Vec<u8>) {
    let chunks: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            (0..CHUNK)
                .map(|b| (b as u8).wrapping_mul(31) ^ (0x40 + i))
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let keys: Vec<String> = (0..n).map(|i| format!("{req}-k{i}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let spec = TransferSpec::new(req, r.endpoint(), usize::from(n), true);
    s.store(&spec, &key_refs, &refs).expect("store");
    let deadline = Instant::now() + DEADLINE;
    assert_eq!(
        s.wait(req, deadline),
        Some(RequestStatus::Completed),
        "{req}"
    );
    r.wait_ready(req, deadline).expect("ready");
    let mut held = Vec::new();
    for (k, want) in keys.iter().zip(&chunks) {
        let c = r.get(k).unwrap_or_else(|| panic!("{k} held"));
        assert_eq!(c.bytes(), &want[..], "bytes of {k} through ChunkRef");
        assert_eq!(view(c.slot()), *want, "bytes of {k} in the caller's memory");
        held.push(c);
    }
}

/// A page-aligned, zeroed heap allocation the test owns.
struct Pages {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Pages {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Self { ptr, layout }
    }

    /// Slot `slot`'s bytes, read through the caller's pointer.
    fn slot(&self, slot: u32) -> Vec<u8> {
        assert!((u64::from(slot) + 1) * CHUNK <= self.layout.size() as u64);
        // SAFETY: inside the allocation (asserted); the caller holds a
        // borrow of the slot, so nothing writes it meanwhile.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.add((u64::from(slot) * CHUNK) as usize),
                CHUNK as usize,
            )
        }
        .to_vec()
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

fn memfd(len: u64) -> File {
    // SAFETY: a NUL-terminated name and flags; a negative result is an error.
    let fd = unsafe { libc::memfd_create(c"kvferry-test-buffer".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    f
}

#[test]
fn shm_writes_land_in_the_callers_memfd() {
    let file = memfd(DATA_OFFSET + SLOTS as u64 * CHUNK);
    let mine = file.try_clone().unwrap();
    let r = Receiver::start_with_buffer(receiver_cfg(), RecvBuffer::from_file(file)).unwrap();
    let announced = r.shm_path().to_string_lossy().into_owned();
    assert!(announced.starts_with("/proc/"), "{announced}");
    let s = sender("shm");
    transfer(&s, &r, "buf-shm", 3, |slot| {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; CHUNK as usize];
        mine.read_exact_at(&mut b, DATA_OFFSET + u64::from(slot) * CHUNK)
            .unwrap();
        b
    });
    drop(s);
    drop(r);
    assert!(mine.metadata().unwrap().len() >= DATA_OFFSET + SLOTS as u64 * CHUNK);
}

#[test]
fn tcp_writes_land_in_caller_memory_at_a_pointer() {
    let mem = Pages::new(SLOTS * CHUNK as usize);
    let cfg = ReceiverConfig {
        tcp_data: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..receiver_cfg()
    };
    // SAFETY: `mem` is dropped after the receiver, the sender and every
    // borrow (all dropped inside `transfer` or below); only the receiver
    // writes it meanwhile.
    let buffer = unsafe { RecvBuffer::from_raw(mem.ptr, SLOTS * CHUNK as usize) };
    let r = Receiver::start_with_buffer(cfg, buffer).unwrap();
    assert_eq!(r.region().data_ptr(), mem.ptr);
    assert!(r.region().file_path().is_none());
    let s = sender("tcp");
    transfer(&s, &r, "buf-tcp", 4, |slot| mem.slot(slot));
    drop(s);
    drop(r);
}

#[test]
fn buffers_that_do_not_fit_are_typed_errors() {
    let mem = Pages::new(SLOTS * CHUNK as usize);
    let tcp = ReceiverConfig {
        tcp_data: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..receiver_cfg()
    };
    // SAFETY: `mem` outlives this attempt, which builds no region.
    let odd = unsafe { RecvBuffer::from_raw(mem.ptr.wrapping_add(8), SLOTS * CHUNK as usize - 8) };
    match Receiver::start_with_buffer(tcp.clone(), odd) {
        Err(ReceiverError::Region(RegionError::Misaligned { addr, .. })) => {
            assert_eq!(addr, mem.ptr as usize + 8)
        }
        other => panic!("expected Misaligned, got {other:?}"),
    }
    // SAFETY: `mem` outlives this attempt, which builds no region.
    let short = unsafe { RecvBuffer::from_raw(mem.ptr, SLOTS * CHUNK as usize - 1) };
    match Receiver::start_with_buffer(tcp, short) {
        Err(ReceiverError::Region(RegionError::TooSmall { needed, .. })) => {
            assert_eq!(needed, SLOTS as u64 * CHUNK)
        }
        other => panic!("expected TooSmall, got {other:?}"),
    }
    // SAFETY: `mem` outlives this attempt, which builds no region.
    let no_plane = unsafe { RecvBuffer::from_raw(mem.ptr, SLOTS * CHUNK as usize) };
    assert!(matches!(
        Receiver::start_with_buffer(receiver_cfg(), no_plane),
        Err(ReceiverError::Config(m)) if m.contains("no shm data plane")
    ));
    // A slot of 4 GiB: a chunk's length is 32 bits wherever it travels.
    for chunk_bytes in [0, 1 << 32] {
        assert!(matches!(
            Receiver::start(ReceiverConfig { chunk_bytes, ..receiver_cfg() }),
            Err(ReceiverError::Config(m)) if m.contains("chunk_bytes must be in 1..=4294967295")
        ));
    }
    // A file one byte short of header + slots.
    let file = memfd(DATA_OFFSET + SLOTS as u64 * CHUNK - 1);
    assert!(matches!(
        Receiver::start_with_buffer(receiver_cfg(), RecvBuffer::from_file(file)),
        Err(ReceiverError::Region(RegionError::TooSmall { .. }))
    ));
}
