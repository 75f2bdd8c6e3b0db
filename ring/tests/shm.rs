//! Shared-memory rings: two-process transfers (the test binary re-executes
//! itself as the child), header validation, side ownership and closing.
#![cfg(not(loom))]

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_ring::{mpsc, spsc, ShmError, Side, WaitStatus};

/// Env var naming the role of a re-executed child.
const ROLE: &str = "KVFERRY_RING_TEST_ROLE";
/// Env var giving the child the ring path.
const RING: &str = "KVFERRY_RING_TEST_PATH";
/// Env var giving a producer child its entry count.
const COUNT: &str = "KVFERRY_RING_TEST_COUNT";
/// Entries crossing in each two-process test.
const TOTAL: u64 = 1_000_000;
/// A side that makes no progress for this long is declared hung. The
/// deadline is about progress, not total time: on an oversubscribed machine
/// (CPU hogs beside the test) a transfer was seen to take minutes, with
/// every side still moving.
const STALL: Duration = Duration::from_secs(60);

/// Prints an MPSC `u64` ring's indexes and the stamps and slots around its
/// head, read straight from the file (offsets from `docs/ring.md`): what a
/// stalled side needs to tell a lost wakeup (stamps set, consumer asleep)
/// from a lost publish (stamp missing).
fn dump_mpsc_words(path: &Path, who: &str) {
    let Ok(f) = std::fs::File::open(path) else {
        return;
    };
    let word = |off: u64| {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, off)
            .map(|()| u64::from_le_bytes(b))
            .unwrap_or(u64::MAX)
    };
    let (capacity, stamps, slots) = (word(16), word(48), word(56));
    let (tail, head) = (word(128), word(256));
    eprintln!(
        "{who}: ring head {head}, tail {tail}, producers word {:#x}",
        word(392) & 0xffff_ffff
    );
    for pos in head.saturating_sub(2)..(head + 4).min(tail + 1) {
        let i = pos & capacity.wrapping_sub(1);
        eprintln!(
            "  position {pos}: stamp {} (published = {}), entry {:#x}",
            word(stamps + 8 * i),
            pos + 1,
            word(slots + 8 * i)
        );
    }
}

/// Ring files live on tmpfs: the crate refuses a disk-backed file
/// (`ShmError::NotInMemory`).
const RING_DIR: &str = "/dev/shm";

/// A unique ring path under [`RING_DIR`], removed on drop.
struct TempPath(PathBuf);

impl TempPath {
    fn new(tag: &str) -> Self {
        Self::in_dir(Path::new(RING_DIR), tag)
    }

    fn in_dir(dir: &Path, tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        TempPath(dir.join(format!("kvferry-ring-{tag}-{}-{n}", std::process::id())))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A child process killed on drop if still running.
struct ChildGuard(Child, &'static str);

impl ChildGuard {
    fn spawn(test: &str, role: &'static str, path: &Path) -> Self {
        Self::spawn_counting(test, role, path, TOTAL / 2)
    }

    /// Like `spawn`, for a producer role that pushes `count` entries.
    fn spawn_counting(test: &str, role: &'static str, path: &Path, count: u64) -> Self {
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                test,
                "--nocapture",
                "--test-threads=1",
                "--include-ignored",
            ])
            .env(ROLE, role)
            .env(RING, path)
            .env(COUNT, count.to_string())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        ChildGuard(child, role)
    }

    /// Wait for exit until `deadline`; kill and fail if it hangs.
    fn wait_success(mut self, deadline: Instant) {
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                assert!(status.success(), "child {} failed: {status}", self.1);
                return;
            }
            if Instant::now() > deadline {
                let _ = self.0.kill();
                panic!("child {} hung (killed)", self.1);
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL the child now and reap it.
    fn kill(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Bounded backoff for a producer facing a full ring: spin, yield, then nap.
/// `deadline` is reset on every successful push (progress-based).
fn backoff(round: &mut u32, deadline: Instant, what: &str) {
    if Instant::now() >= deadline && std::env::var(ROLE).is_ok_and(|r| r.starts_with("mpsc")) {
        if let Ok(p) = std::env::var(RING) {
            dump_mpsc_words(Path::new(&p), what);
        }
    }
    assert!(
        Instant::now() < deadline,
        "{what}: ring stayed full for {STALL:?}"
    );
    *round += 1;
    if *round < 32 {
        std::hint::spin_loop();
    } else if *round < 64 {
        thread::yield_now();
    } else {
        thread::sleep(Duration::from_micros(50));
    }
}

/// The payload of entry `i` (splitmix64), so a checksum catches corruption.
fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn child_spsc_producer(path: &Path) {
    let ring = spsc::shared::open::<[u64; 2]>(path).unwrap();
    let mut p = ring.producer().unwrap();
    let mut deadline = Instant::now() + STALL;
    let mut i = 0;
    let mut round = 0;
    let mut buf = Vec::with_capacity(64);
    while i < TOTAL {
        let pushed = if i % 2 == 0 {
            p.push([i, mix(i)]).is_ok() as u64
        } else {
            buf.clear();
            buf.extend((i..(i + 64).min(TOTAL)).map(|k| [k, mix(k)]));
            p.push_slice(&buf) as u64
        };
        if pushed == 0 {
            backoff(&mut round, deadline, "spsc child");
        } else {
            round = 0;
            i += pushed;
            deadline = Instant::now() + STALL;
        }
    }
    // Dropping the producer (as a process exit through main does) closes
    // the ring for the parent.
    drop(p);
}

#[test]
fn two_process_spsc() {
    if let Ok(role) = std::env::var(ROLE) {
        if role == "spsc-producer" {
            child_spsc_producer(Path::new(&std::env::var(RING).unwrap()));
        }
        return;
    }
    let path = TempPath::new("spsc");
    let ring = spsc::shared::create::<[u64; 2]>(&path.0, 1024).unwrap();
    let mut c = ring.consumer().unwrap();
    let child = ChildGuard::spawn("two_process_spsc", "spsc-producer", &path.0);
    let (mut count, mut sum, mut want_sum) = (0u64, 0u64, 0u64);
    loop {
        match c.wait(Some(Instant::now() + STALL)) {
            WaitStatus::Ready => {}
            WaitStatus::Closed => break,
            WaitStatus::TimedOut => {
                panic!("spsc parent: no entry for {STALL:?} after {count} entries")
            }
        }
        let b = c.peek();
        let (x, y) = b.as_slices();
        for [seq, payload] in x.iter().chain(y) {
            assert_eq!(*seq, count, "entry out of order or lost");
            sum = sum.wrapping_add(*payload);
            want_sum = want_sum.wrapping_add(mix(count));
            count += 1;
        }
    }
    assert_eq!(count, TOTAL);
    assert_eq!(sum, want_sum, "checksum mismatch");
    child.wait_success(Instant::now() + Duration::from_secs(30));
}

fn child_mpsc_producer(path: &Path, id: u64) {
    let ring = mpsc::shared::open::<u64>(path).unwrap();
    let mut p = ring.producer().unwrap();
    let mut deadline = Instant::now() + STALL;
    let n: u64 = std::env::var(COUNT).unwrap().parse().unwrap();
    let mut i = 0;
    let mut round = 0;
    while i < n {
        let ok = if i % 3 == 0 {
            match p.reserve(4.min((n - i) as usize)) {
                Some(mut b) => {
                    for k in 0..b.len() {
                        b.set(k, (id << 32) | (i + k as u64)).unwrap();
                    }
                    let k = b.len() as u64;
                    b.commit();
                    i += k;
                    true
                }
                None => false,
            }
        } else if p.push((id << 32) | i).is_ok() {
            i += 1;
            true
        } else {
            false
        };
        if ok {
            round = 0;
            deadline = Instant::now() + STALL;
        } else {
            backoff(&mut round, deadline, "mpsc child");
        }
    }
    drop(p);
}

/// Two child processes × 500,000 entries into one shared MPSC ring (push
/// and `reserve` batches), checked per producer for order and by checksum.
/// This test found the lost wakeup of the cross-process doorbell when it used
/// `MEMBARRIER_CMD_GLOBAL_EXPEDITED` (about one run in six: a child saw the
/// ring full while the parent slept on published entries); see
/// `barrier.rs`.
///
/// It also failed twice when its ring file lived in `temp_dir()` (ext4 on the
/// CI machine): one child's first `reserve(4)` claimed four positions and
/// blocked in the page fault of its first store into the file (ext4's
/// `page_mkwrite`, under the load of a full build), so the consumer waited at
/// those positions while the other child filled the ring and reported it
/// full for 60 s. Ring files must be on tmpfs; see
/// `create_and_open_refuse_a_disk_backed_file`.
///
/// With the ring file on tmpfs it still wedged once, in a clean-clone CI run
/// on 2026-12-01 (a child reported the ring full for 60 s at head 841799 /
/// tail 842820 while the parent went on to 958898). That was a lost wakeup
/// in `wait`: a ring from a producer publishing a later position than the
/// one the consumer waited at was counted in the bell value the consumer
/// then slept on, so the consumer slept until its own 60 s deadline while
/// both children found the ring full (docs/ring.md, "Fixed: a swallowed
/// wake-up"; loom model `mpsc_later_publish_does_not_swallow_the_wakeup`).
#[test]
fn two_process_mpsc() {
    if let Ok(role) = std::env::var(ROLE) {
        let path = PathBuf::from(std::env::var(RING).unwrap());
        match role.as_str() {
            "mpsc-producer-0" => child_mpsc_producer(&path, 0),
            "mpsc-producer-1" => child_mpsc_producer(&path, 1),
            _ => {}
        }
        return;
    }
    let path = TempPath::new("mpsc");
    let ring = mpsc::shared::create::<u64>(&path.0, 1024).unwrap();
    let mut c = ring.consumer().unwrap();
    // Hold a producer until both children have attached (seen by their first
    // entry), so the ring cannot close between one child's exit and the
    // other's attach.
    let mut placeholder = Some(ring.producer().unwrap());
    let children = [
        ChildGuard::spawn("two_process_mpsc", "mpsc-producer-0", &path.0),
        ChildGuard::spawn("two_process_mpsc", "mpsc-producer-1", &path.0),
    ];
    let mut next = [0u64; 2];
    let (mut count, mut sum) = (0u64, 0u64);
    loop {
        match c.wait(Some(Instant::now() + STALL)) {
            WaitStatus::Ready => {}
            WaitStatus::Closed => break,
            WaitStatus::TimedOut => {
                dump_mpsc_words(&path.0, "mpsc parent");
                panic!("mpsc parent: no entry for {STALL:?} after {count} entries ({next:?})")
            }
        }
        let b = c.peek();
        for v in b.iter() {
            let (id, seq) = ((v >> 32) as usize, v & 0xffff_ffff);
            assert!(id < 2, "corrupt entry {v:#x}");
            assert_eq!(seq, next[id], "producer {id} lost or reordered an entry");
            next[id] += 1;
            sum = sum.wrapping_add(mix(v));
            count += 1;
        }
        drop(b);
        if next[0] > 0 && next[1] > 0 {
            placeholder = None;
        }
    }
    if count != TOTAL {
        dump_mpsc_words(&path.0, "mpsc parent");
    }
    assert!(placeholder.is_none());
    assert_eq!(count, TOTAL);
    assert_eq!(next, [TOTAL / 2, TOTAL / 2]);
    let want: u64 = (0..2u64)
        .flat_map(|id| (0..TOTAL / 2).map(move |i| mix((id << 32) | i)))
        .fold(0, u64::wrapping_add);
    assert_eq!(sum, want, "checksum mismatch");
    for child in children {
        child.wait_success(Instant::now() + Duration::from_secs(30));
    }
}

#[test]
fn two_mappings_in_one_process_share_ring_and_doorbell() {
    let path = TempPath::new("maps");
    let a = spsc::shared::create::<u32>(&path.0, 8).unwrap();
    let b = spsc::shared::open::<u32>(&path.0).unwrap();
    assert_eq!((a.capacity(), b.capacity()), (8, 8));
    assert_eq!(b.path(), path.0.as_path());
    let mut p = a.producer().unwrap();
    let mut c = b.consumer().unwrap();
    // The consumer sleeps on its own mapping; the wake comes through the
    // other mapping, so this needs the shared (non-private) futex.
    let h = thread::spawn(move || {
        let s = c.wait(Some(Instant::now() + Duration::from_secs(30)));
        (s, c.pop(), c)
    });
    thread::sleep(Duration::from_millis(50));
    p.push(77).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !h.is_finished() {
        assert!(
            Instant::now() < deadline,
            "hung: consumer on second mapping"
        );
        thread::sleep(Duration::from_millis(1));
    }
    let (s, v, c) = h.join().unwrap();
    assert_eq!((s, v), (WaitStatus::Ready, Some(77)));
    drop(p);
    assert_eq!(
        c.wait(Some(Instant::now() + Duration::from_secs(30))),
        WaitStatus::Closed
    );
}

/// Overwrite bytes of the file at `offset`.
fn patch(path: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

fn spsc_file(tag: &str) -> TempPath {
    let p = TempPath::new(tag);
    drop(spsc::shared::create::<u64>(&p.0, 16).unwrap());
    p
}

#[test]
fn open_missing_file_is_io_error() {
    let p = TempPath::new("missing");
    let err = spsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(
        matches!(err, ShmError::Io { ref path, .. } if path == &p.0),
        "{err:?}"
    );
}

#[test]
fn open_short_file_is_truncated() {
    let p = TempPath::new("short");
    std::fs::write(&p.0, [0u8; 100]).unwrap();
    let err = spsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(
        matches!(
            err,
            ShmError::Truncated {
                len: 100,
                expected: 512
            }
        ),
        "{err:?}"
    );
}

#[test]
fn open_truncated_slots_is_truncated() {
    let p = spsc_file("trunc");
    let f = OpenOptions::new().write(true).open(&p.0).unwrap();
    f.set_len(512 + 8).unwrap();
    let err = spsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(
        matches!(
            err,
            ShmError::Truncated {
                len: 520,
                expected: 640
            }
        ),
        "{err:?}"
    );
}

#[test]
fn corrupt_magic() {
    let p = spsc_file("magic");
    patch(&p.0, 0, b"NOTARING");
    let err = spsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(matches!(err, ShmError::BadMagic { .. }), "{err:?}");
}

#[test]
fn corrupt_version() {
    let p = spsc_file("version");
    patch(&p.0, 8, &99u32.to_ne_bytes());
    let err = spsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(
        matches!(
            err,
            ShmError::VersionMismatch {
                found: 99,
                expected: kvferry_ring::LAYOUT_VERSION
            }
        ),
        "{err:?}"
    );
}

#[test]
fn wrong_kind() {
    let p = spsc_file("kind");
    let err = mpsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(
        matches!(
            err,
            ShmError::KindMismatch {
                found: 1,
                expected: 2
            }
        ),
        "{err:?}"
    );
}

#[test]
fn corrupt_capacity() {
    let p = spsc_file("cap");
    patch(&p.0, 16, &3u64.to_ne_bytes());
    let err = spsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(matches!(err, ShmError::BadCapacity { found: 3 }), "{err:?}");
    patch(&p.0, 16, &0u64.to_ne_bytes());
    assert!(matches!(
        spsc::shared::open::<u64>(&p.0),
        Err(ShmError::BadCapacity { found: 0 })
    ));
}

#[test]
fn wrong_entry_size() {
    let p = spsc_file("size");
    let err = spsc::shared::open::<u32>(&p.0).unwrap_err();
    assert!(
        matches!(
            err,
            ShmError::EntrySizeMismatch {
                found: 8,
                expected: 4
            }
        ),
        "{err:?}"
    );
}

#[test]
fn wrong_entry_align() {
    let p = spsc_file("align");
    let err = spsc::shared::open::<[u8; 8]>(&p.0).unwrap_err();
    assert!(
        matches!(
            err,
            ShmError::EntryAlignMismatch {
                found: 8,
                expected: 1
            }
        ),
        "{err:?}"
    );
}

#[test]
fn wrong_type_same_layout() {
    let p = spsc_file("type");
    let err = spsc::shared::open::<i64>(&p.0).unwrap_err();
    assert!(
        matches!(err, ShmError::FingerprintMismatch { .. }),
        "{err:?}"
    );
    assert!(matches!(
        spsc::shared::open::<f64>(&p.0),
        Err(ShmError::FingerprintMismatch { .. })
    ));
}

#[test]
fn corrupt_layout_offset() {
    let p = spsc_file("layout");
    patch(&p.0, 56, &4096u64.to_ne_bytes());
    let err = spsc::shared::open::<u64>(&p.0).unwrap_err();
    assert!(
        matches!(
            err,
            ShmError::LayoutMismatch {
                field: "slots_offset",
                found: 4096,
                expected: 512
            }
        ),
        "{err:?}"
    );
}

#[test]
fn create_rejects_huge_capacity_and_alignment() {
    let p = TempPath::new("huge");
    let err = spsc::shared::create::<u8>(&p.0, usize::MAX).unwrap_err();
    assert!(matches!(err, ShmError::Capacity(_)), "{err:?}");
    assert!(!p.0.exists());

    #[derive(Clone, Copy)]
    #[repr(C, align(8192))]
    struct Huge([u8; 8192]);
    // SAFETY: a byte array (any bit pattern), no pointers.
    unsafe impl kvferry_ring::Plain for Huge {}
    let err = mpsc::shared::create::<Huge>(&p.0, 2).unwrap_err();
    assert!(
        matches!(err, ShmError::AlignTooLarge { align: 8192 }),
        "{err:?}"
    );
}

/// A ring file on a disk-backed file system is refused by `create` and
/// `open` (the cause of the stuck cross-process producer, docs/ring.md).
/// Uses cargo's per-target temp dir, which is under `target/`.
#[test]
fn create_and_open_refuse_a_disk_backed_file() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let probe = TempPath::in_dir(dir, "probe");
    std::fs::write(&probe.0, b"probe").unwrap();
    if is_tmpfs(&probe.0) {
        eprintln!("SKIP: {} is on tmpfs here", dir.display());
        return;
    }
    let disk = TempPath::in_dir(dir, "disk");
    let err = mpsc::shared::create::<u64>(&disk.0, 8).unwrap_err();
    assert!(
        matches!(err, ShmError::NotInMemory { ref path, .. } if path == &disk.0),
        "{err:?}"
    );
    assert!(err.to_string().contains("/dev/shm"), "{err}");
    assert!(!disk.0.exists(), "create left a file behind");
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&*disk.0.file_name().unwrap().to_string_lossy())
        })
        .collect();
    assert!(leftovers.is_empty(), "temporary file left: {leftovers:?}");
    // A valid ring file copied to disk is refused by open, for both kinds.
    let good = TempPath::new("good");
    drop(spsc::shared::create::<u64>(&good.0, 8).unwrap());
    std::fs::copy(&good.0, &disk.0).unwrap();
    let err = spsc::shared::open::<u64>(&disk.0).unwrap_err();
    assert!(matches!(err, ShmError::NotInMemory { .. }), "{err:?}");
    assert!(matches!(
        mpsc::shared::open::<u64>(&disk.0),
        Err(ShmError::NotInMemory { .. })
    ));
}

/// True if `path` is on tmpfs (`statfs` type `TMPFS_MAGIC`).
fn is_tmpfs(path: &Path) -> bool {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` a writable buffer.
    let r = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) };
    assert_eq!(r, 0, "statfs {}", path.display());
    // SAFETY: statfs succeeded and filled `st`.
    (unsafe { st.assume_init() }.f_type as u64 & 0xffff_ffff) == 0x0102_1994
}

#[test]
fn create_in_missing_dir_is_io_error() {
    let p = Path::new(RING_DIR)
        .join("kvferry-ring-no-such-dir")
        .join("ring");
    let err = spsc::shared::create::<u8>(&p, 4).unwrap_err();
    assert!(matches!(err, ShmError::Io { .. }), "{err:?}");
}

#[test]
fn each_side_is_taken_once() {
    let p = TempPath::new("sides");
    let a = spsc::shared::create::<u64>(&p.0, 4).unwrap();
    let b = spsc::shared::open::<u64>(&p.0).unwrap();
    let _prod = a.producer().unwrap();
    let _cons = b.consumer().unwrap();
    assert!(matches!(
        b.producer(),
        Err(ShmError::SideTaken(Side::Producer))
    ));
    assert!(matches!(
        a.consumer(),
        Err(ShmError::SideTaken(Side::Consumer))
    ));
    let m = TempPath::new("msides");
    let r = mpsc::shared::create::<u64>(&m.0, 4).unwrap();
    let _c = r.consumer().unwrap();
    assert!(matches!(
        r.consumer(),
        Err(ShmError::SideTaken(Side::Consumer))
    ));
    let _p1 = r.producer().unwrap();
    let _p2 = mpsc::shared::open::<u64>(&m.0).unwrap().producer().unwrap();
    assert_eq!(
        format!("{}", ShmError::SideTaken(Side::Consumer)),
        "the consumer side of this ring is already taken"
    );
}

#[test]
fn mpsc_closes_when_last_attached_producer_detaches() {
    let p = TempPath::new("mclose");
    let r = mpsc::shared::create::<u64>(&p.0, 4).unwrap();
    let mut c = r.consumer().unwrap();
    // No producer attached yet: open, not closed.
    assert!(!c.is_closed());
    let mut p1 = r.producer().unwrap();
    let p2 = mpsc::shared::open::<u64>(&p.0).unwrap().producer().unwrap();
    p1.push(1).unwrap();
    drop(p1);
    assert!(!c.is_closed());
    drop(p2);
    assert!(c.is_closed());
    assert_eq!(c.pop(), Some(1));
    assert_eq!(c.wait(None), WaitStatus::Closed);
    assert!(matches!(r.producer(), Err(ShmError::Closed)));
}

#[test]
fn create_replaces_existing_file() {
    let p = spsc_file("replace");
    let r = spsc::shared::create::<u32>(&p.0, 4).unwrap();
    assert_eq!(r.capacity(), 4);
    assert!(spsc::shared::open::<u32>(&p.0).is_ok());
    assert!(matches!(
        spsc::shared::open::<u64>(&p.0),
        Err(ShmError::EntrySizeMismatch { .. })
    ));
}

/// The marker file a hanging child creates once it holds an unpublished
/// reservation.
fn marker(path: &Path) -> PathBuf {
    let mut m = path.as_os_str().to_owned();
    m.push(".reserved");
    PathBuf::from(m)
}

/// Wait (bounded) until the child created its marker.
fn wait_for_marker(path: &Path) {
    let deadline = Instant::now() + STALL;
    while !marker(path).exists() {
        assert!(Instant::now() < deadline, "child never reserved its slot");
        thread::sleep(Duration::from_millis(2));
    }
}

/// Child: publish entries, then reserve and fill one more slot without
/// publishing it, say so with the marker file, and wait to be killed.
fn child_reserve_and_hang(path: &Path, kind: &str) {
    let hang = || {
        std::fs::write(marker(path), b"").unwrap();
        thread::sleep(STALL);
        // Not killed: exit without destructors, so nothing is published.
        std::process::exit(3);
    };
    if kind == "mpsc" {
        let ring = mpsc::shared::open::<u64>(path).unwrap();
        let mut p = ring.producer().unwrap();
        p.push(1).unwrap();
        let mut b = p.reserve(1).unwrap();
        b.set(0, 2).unwrap();
        hang();
    } else {
        let ring = spsc::shared::open::<u64>(path).unwrap();
        let mut p = ring.producer().unwrap();
        p.push(1).unwrap();
        assert_eq!(p.push_slice(&[2, 3]), 2);
        let mut b = p.reserve(1).unwrap();
        b.set(0, 4).unwrap();
        hang();
    }
}

/// Documents the MPSC hazard behind the attach design (docs/ring.md, "What
/// remains true of MPSC"): a producer process killed between its claim and
/// its publish leaves a position that is never stamped, so the consumer
/// cannot pass it, even though a live producer published after it. The
/// dead producer never detaches, so the ring never closes either.
#[test]
fn mpsc_producer_killed_inside_a_reserve_wedges_the_ring() {
    if std::env::var(ROLE).is_ok_and(|r| r == "mpsc-reserve-and-hang") {
        child_reserve_and_hang(Path::new(&std::env::var(RING).unwrap()), "mpsc");
        return;
    }
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let path = TempPath::new("mdead");
    let _marker = TempPath(marker(&path.0));
    let ring = mpsc::shared::create::<u64>(&path.0, 8).unwrap();
    let mut c = ring.consumer().unwrap();
    let mut live = ring.producer().unwrap();
    let child = ChildGuard::spawn(
        "mpsc_producer_killed_inside_a_reserve_wedges_the_ring",
        "mpsc-reserve-and-hang",
        &path.0,
    );
    wait_for_marker(&path.0);
    child.kill();
    live.push(3).unwrap();
    // The dead child's push is readable; its reservation (position 1) is
    // never stamped, and the live producer's entry (position 2) is behind it.
    assert_eq!(c.pop(), Some(1));
    assert_eq!(c.len(), 2, "positions 1 (dead, claimed) and 2 (live)");
    assert_eq!(
        c.wait(Some(Instant::now() + Duration::from_millis(100))),
        WaitStatus::TimedOut
    );
    assert_eq!(c.pop(), None, "the consumer passed an unpublished position");
    drop(live);
    assert!(!c.is_closed(), "a killed producer never detaches");
}

/// The attach design's answer to the hazard above: a killed SPSC producer
/// leaves its ring consistent. Everything it committed is readable, its
/// open reservation is not, and the ring stays open (the consumer learns of
/// the death by other means, e.g. a pidfd, and drops the ring).
#[test]
fn spsc_producer_killed_inside_a_reserve_leaves_committed_entries() {
    if std::env::var(ROLE).is_ok_and(|r| r == "spsc-reserve-and-hang") {
        child_reserve_and_hang(Path::new(&std::env::var(RING).unwrap()), "spsc");
        return;
    }
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let path = TempPath::new("sdead");
    let _marker = TempPath(marker(&path.0));
    let ring = spsc::shared::create::<u64>(&path.0, 8).unwrap();
    let mut c = ring.consumer().unwrap();
    let child = ChildGuard::spawn(
        "spsc_producer_killed_inside_a_reserve_leaves_committed_entries",
        "spsc-reserve-and-hang",
        &path.0,
    );
    wait_for_marker(&path.0);
    child.kill();
    let mut got = [0u64; 8];
    assert_eq!(c.pop_into(&mut got), 3);
    assert_eq!(&got[..3], &[1, 2, 3]);
    assert_eq!(
        c.wait(Some(Instant::now() + Duration::from_millis(100))),
        WaitStatus::TimedOut
    );
    assert!(!c.is_closed(), "a killed producer never detaches");
}

/// Stress (ignored: about a minute on a loaded 2-vCPU machine; run with
/// `cargo test -p kvferry-ring --release --test shm -- --ignored
/// mpsc_stress`): three producer processes push `STRESS` entries each
/// (single pushes and `reserve` batches) into one 256-slot shared MPSC ring
/// while a fourth is SIGKILLed mid-stream. Every entry of the live producers
/// arrives exactly once and in per-producer order; the killed one's entries
/// form a gap-free prefix. If the kill lands between the victim's claim and
/// its publish, the ring wedges (the hazard shown by
/// `mpsc_producer_killed_inside_a_reserve_wedges_the_ring`) and the test
/// fails saying so. That happened in 1 of 15 runs of a bounded loop
/// (2026-12-01, two CPU hogs): the dump showed the victim's position never
/// stamped (its slot still held the lap-old stamp and entry) and the three
/// live producers stuck "full" behind it. This is why MPSC shared rings are
/// not for independently failing processes (docs/ring.md).
#[test]
#[ignore = "long cross-process stress; run on purpose"]
fn mpsc_stress_processes_with_a_killed_producer() {
    const STRESS: u64 = 200_000;
    const TEST: &str = "mpsc_stress_processes_with_a_killed_producer";
    if let Ok(role) = std::env::var(ROLE) {
        let path = PathBuf::from(std::env::var(RING).unwrap());
        if let Some(id) = role.strip_prefix("mpsc-producer-") {
            child_mpsc_producer(&path, id.parse().unwrap());
        }
        return;
    }
    let path = TempPath::new("mstress");
    let ring = mpsc::shared::create::<u64>(&path.0, 256).unwrap();
    let mut c = ring.consumer().unwrap();
    // Our own producer keeps the ring open; the victim never detaches.
    let _keep_open = ring.producer().unwrap();
    let live = [
        ChildGuard::spawn_counting(TEST, "mpsc-producer-0", &path.0, STRESS),
        ChildGuard::spawn_counting(TEST, "mpsc-producer-1", &path.0, STRESS),
        ChildGuard::spawn_counting(TEST, "mpsc-producer-2", &path.0, STRESS),
    ];
    let mut victim = Some(ChildGuard::spawn_counting(
        TEST,
        "mpsc-producer-3",
        &path.0,
        STRESS,
    ));
    let mut next = [0u64; 4];
    while next[..3].iter().any(|&n| n < STRESS) {
        match c.wait(Some(Instant::now() + STALL)) {
            WaitStatus::Ready => {}
            s => {
                dump_mpsc_words(&path.0, "mpsc stress parent");
                panic!(
                    "stress consumer: {s:?} after {next:?} (claimed but unpublished: {}); \
                     a wedge here means the victim was killed between claim and publish",
                    c.len()
                )
            }
        }
        for v in c.peek().iter() {
            let (id, seq) = ((v >> 32) as usize, v & 0xffff_ffff);
            assert!(id < 4, "corrupt entry {v:#x}");
            assert_eq!(seq, next[id], "producer {id} lost, duplicated or reordered");
            next[id] += 1;
        }
        if next[3] >= STRESS / 20 {
            if let Some(v) = victim.take() {
                v.kill();
            }
        }
    }
    for child in live {
        child.wait_success(Instant::now() + Duration::from_secs(30));
    }
    // Drain what the victim published before it died.
    while c.wait(Some(Instant::now() + Duration::from_millis(200))) == WaitStatus::Ready {
        for v in c.peek().iter() {
            let (id, seq) = ((v >> 32) as usize, v & 0xffff_ffff);
            assert_eq!((id, seq), (3, next[3]), "unexpected entry after the end");
            next[3] += 1;
        }
    }
    assert!(victim.is_none(), "the victim was never killed: {next:?}");
    assert!(next[3] < STRESS, "the victim finished before it was killed");
    assert_eq!(c.len(), 0, "a claimed position was never published");
    eprintln!(
        "stress: live producers {STRESS} each; victim killed after {} entries",
        next[3]
    );
}

/// Child: push `COUNT` entries `(id << 32) | i` into its own SPSC ring.
fn child_spsc_client(path: &Path, id: u64) {
    let ring = spsc::shared::open::<u64>(path).unwrap();
    let mut p = ring.producer().unwrap();
    let n: u64 = std::env::var(COUNT).unwrap().parse().unwrap();
    let (mut i, mut round, mut deadline) = (0, 0, Instant::now() + STALL);
    while i < n {
        if p.push((id << 32) | i).is_ok() {
            i += 1;
            round = 0;
            deadline = Instant::now() + STALL;
        } else {
            backoff(&mut round, deadline, "spsc client");
        }
    }
}

/// The layout proposed for cross-process attach: one SPSC ring per client
/// process. Four clients push into their own rings, one is SIGKILLed
/// mid-stream, and the other three still deliver every entry exactly once
/// and in order; the dead client's ring holds a gap-free prefix.
#[test]
fn per_client_spsc_rings_survive_a_killed_client() {
    const N: u64 = 50_000;
    const TEST: &str = "per_client_spsc_rings_survive_a_killed_client";
    const ROLES: [&str; 4] = ["client-0", "client-1", "client-2", "client-3"];
    if let Ok(role) = std::env::var(ROLE) {
        if let Some(id) = role.strip_prefix("client-") {
            child_spsc_client(
                Path::new(&std::env::var(RING).unwrap()),
                id.parse().unwrap(),
            );
        }
        return;
    }
    let paths: Vec<TempPath> = (0..4).map(|_| TempPath::new("client")).collect();
    let rings: Vec<_> = paths
        .iter()
        .map(|p| spsc::shared::create::<u64>(&p.0, 64).unwrap())
        .collect();
    let mut cons: Vec<_> = rings.iter().map(|r| r.consumer().unwrap()).collect();
    let mut children: Vec<Option<ChildGuard>> = paths
        .iter()
        .zip(ROLES)
        .map(|(p, role)| Some(ChildGuard::spawn_counting(TEST, role, &p.0, N)))
        .collect();
    let mut next = [0u64; 4];
    let mut buf = [0u64; 64];
    let mut deadline = Instant::now() + STALL;
    // Until the live clients are done and the victim was killed mid-stream.
    while next[..3].iter().any(|&n| n < N) || children[3].is_some() {
        let mut got = false;
        for (id, c) in cons.iter_mut().enumerate() {
            let k = c.pop_into(&mut buf);
            for v in &buf[..k] {
                assert_eq!(
                    *v,
                    ((id as u64) << 32) | next[id],
                    "client {id} lost or reordered"
                );
                next[id] += 1;
            }
            got |= k > 0;
        }
        if next[3] >= N / 10 {
            if let Some(victim) = children[3].take() {
                victim.kill();
            }
        }
        if got {
            deadline = Instant::now() + STALL;
        } else {
            assert!(
                Instant::now() < deadline,
                "no entry for {STALL:?}: {next:?}"
            );
            thread::sleep(Duration::from_micros(100));
        }
    }
    for child in children[..3].iter_mut().filter_map(Option::take) {
        child.wait_success(Instant::now() + Duration::from_secs(30));
    }
    assert!(
        children[3].is_none(),
        "the victim finished before it was killed: {next:?}"
    );
    // Whatever the victim committed before it died is there, nothing more.
    loop {
        let k = cons[3].pop_into(&mut buf);
        if k == 0 {
            break;
        }
        for v in &buf[..k] {
            assert_eq!(*v, (3 << 32) | next[3], "the dead client's ring has a gap");
            next[3] += 1;
        }
    }
    assert!(next[3] < N, "the victim finished before it was killed");
    assert_eq!(cons[3].len(), 0);
}

#[test]
fn anonymous_ring_is_a_sealed_memfd_checked_like_a_file() {
    use std::os::fd::AsRawFd;
    let a = spsc::shared::create_anonymous::<u32>(c"kvferry-test-ring", 8).unwrap();
    let f = a.file().expect("an anonymous ring has its memfd");
    let link = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).unwrap();
    assert!(
        link.to_string_lossy()
            .starts_with("/memfd:kvferry-test-ring"),
        "no file-system name: {}",
        link.display()
    );
    assert!(f.set_len(0).is_err(), "sealed against shrinking");
    let dup = f.try_clone().unwrap();
    let b = spsc::shared::from_file::<u32>(&dup, "received").unwrap();
    drop(dup);
    let mut p = a.producer().unwrap();
    let mut c = b.consumer().unwrap();
    p.push(5).unwrap();
    assert_eq!(c.pop(), Some(5));
    // The same header checks as `open`: wrong entry type.
    let e = spsc::shared::from_file::<u64>(f, "received").unwrap_err();
    assert!(
        matches!(e, kvferry_ring::ShmError::EntrySizeMismatch { .. }),
        "{e}"
    );
    // A descriptor that is no ring.
    let plain = std::fs::File::open("/proc/self/status").unwrap();
    assert!(spsc::shared::from_file::<u32>(&plain, "status").is_err());
}

/// Page faults taken so far by the calling thread (minor and major).
fn thread_faults() -> u64 {
    // SAFETY: a zeroed rusage is valid; getrusage writes into it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_THREAD of the calling thread, into a valid rusage.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
    (u.ru_minflt + u.ru_majflt) as u64
}

/// Both mappings of a shared ring, the creator's and one opened from its
/// descriptor, have their page tables filled for the whole ring: a first
/// pass over every slot, producer and consumer each through its own
/// mapping, takes no page fault (without it: one per page on the
/// producer's side, as the kernel allocates it, and more on the
/// consumer's).
#[test]
fn both_mappings_of_a_shared_ring_take_no_page_fault_on_a_first_pass() {
    const CAP: usize = 8192; // 64 KiB of u64 slots: 16 pages
    let a = spsc::shared::create_anonymous::<u64>(c"kvferry-test-fresh", CAP).unwrap();
    let b = spsc::shared::from_file::<u64>(a.file().unwrap(), "received").unwrap();
    let mut p = a.producer().unwrap();
    let mut c = b.consumer().unwrap();
    // Warm up the code paths and the first slot's page.
    p.push(0).unwrap();
    assert_eq!(c.pop(), Some(0));
    let before = thread_faults();
    for i in 1..=CAP as u64 {
        p.push(i).unwrap();
        assert_eq!(c.pop(), Some(i));
    }
    let faults = thread_faults() - before;
    assert!(
        faults <= 1,
        "a first pass over a fresh shared ring took {faults} page faults"
    );
}

/// Offsets of the shared index words (`docs/ring.md`, "Memory layout").
const TAIL_AT: u64 = 128;
const HEAD_AT: u64 = 256;

/// Occupancies (`tail - head`, wrapping) that no pair of sides keeping
/// the protocol ever shows in a 16-entry ring: a head ahead of the tail,
/// more than a ring between them, and far off either way.
const OFF_RING: [u64; 5] = [u64::MAX, 17, 1 << 63, 1 << 40, (1u64 << 40).wrapping_neg()];

/// A consumer process that writes a `head` no consumer keeping the
/// protocol writes (ahead of the tail, or more than a ring behind it)
/// gets a full ring: the producer neither panics on the index arithmetic
/// (a debug build did: `capacity - (tail - head)` underflowed) nor writes
/// over the entries still waiting. Once the consumer stores its real head
/// again, the ring works as before.
#[test]
fn a_consumer_scribbling_on_head_gets_a_full_ring_and_nothing_overwritten() {
    let p = spsc_file("bogus-head");
    let shared = spsc::shared::open::<u64>(&p.0).unwrap();
    let mut tx = shared.producer().unwrap();
    let mut rx = shared.consumer().unwrap();
    let mut next = 0u64;
    let mut tail = 0u64;
    for round in 0..6 {
        // Five entries waiting (the ring wraps along the rounds).
        for _ in 0..5 {
            tx.push(next).unwrap();
            next += 1;
        }
        tail += 5;
        for head in OFF_RING.map(|d| tail.wrapping_sub(d)) {
            patch(&p.0, HEAD_AT, &head.to_ne_bytes());
            // More than the ring holds: the producer reloads the head.
            assert_eq!(
                tx.push_slice(&[u64::MAX; 32]),
                0,
                "round {round}, head {head:#x}: pushed past a bogus head"
            );
            assert_eq!(
                tx.push(u64::MAX),
                Err(u64::MAX),
                "round {round}, head {head:#x}"
            );
            assert!(tx.reserve(1).is_none(), "round {round}, head {head:#x}");
            assert_eq!(tx.len(), 16, "round {round}, head {head:#x}: reads as full");
        }
        // The consumer's own head store puts the real index back.
        let mut out = [0u64; 16];
        assert_eq!(
            rx.pop_into(&mut out),
            5,
            "round {round}: the waiting entries"
        );
        assert_eq!(
            out[..5],
            [next - 5, next - 4, next - 3, next - 2, next - 1],
            "round {round}: an entry was overwritten"
        );
    }
    // Sane again: the whole ring is usable.
    assert_eq!(tx.push_slice(&[1; 16]), 16);
    assert_eq!(rx.pop_into(&mut [0u64; 16]), 16);
}

/// A producer process that writes a `tail` no producer keeping the
/// protocol writes (behind the head, or more than a ring ahead of it)
/// gives the consumer nothing to read: no stale or unwritten slot is read
/// as an entry, the ring reads as empty, and a wait ends at its deadline.
/// Once the producer publishes from its real tail again, the ring works.
#[test]
fn a_producer_scribbling_on_tail_gives_nothing_to_read() {
    let p = spsc_file("bogus-tail");
    let shared = spsc::shared::open::<u64>(&p.0).unwrap();
    let mut tx = shared.producer().unwrap();
    let mut rx = shared.consumer().unwrap();
    let mut head = 0u64;
    for round in 0..6 {
        // Entries were published and read: stale values sit in the slots.
        assert_eq!(tx.push_slice(&[round; 7]), 7);
        assert_eq!(rx.pop_into(&mut [0u64; 7]), 7);
        head += 7;
        for tail in OFF_RING.map(|d| head.wrapping_add(d)) {
            patch(&p.0, TAIL_AT, &tail.to_ne_bytes());
            let what = format!("round {round}, tail {tail:#x}");
            assert_eq!(rx.pop(), None, "{what}: read an entry past a bogus tail");
            assert_eq!(rx.pop_into(&mut [0u64; 16]), 0, "{what}");
            assert_eq!(rx.peek().len(), 0, "{what}");
            assert_eq!(rx.len(), 0, "{what}: reads as empty");
            assert!(rx.is_empty(), "{what}");
            let soon = Instant::now() + Duration::from_millis(20);
            assert_eq!(rx.wait(Some(soon)), WaitStatus::TimedOut, "{what}");
            assert!(rx.arm_wakeup(), "{what}: nothing to read, so it may sleep");
            rx.disarm_wakeup();
        }
        // The producer's own tail store puts the real index back.
        assert_eq!(tx.push(round), Ok(()));
        assert_eq!(rx.pop(), Some(round), "round {round}: after the real tail");
        head += 1;
    }
}

/// Indices are wrapping `u64`s, and a peer may have left any value in the
/// shared words before a side attaches: rings of both kinds whose indices
/// cross 2^64 carry their entries across it (a debug build panicked on the
/// index additions).
#[test]
fn indices_crossing_two_to_the_64_wrap() {
    let start = (u64::MAX - 4).to_ne_bytes();
    let p = spsc_file("wrap-spsc");
    patch(&p.0, TAIL_AT, &start);
    patch(&p.0, HEAD_AT, &start);
    let shared = spsc::shared::open::<u64>(&p.0).unwrap();
    let (mut tx, mut rx) = (shared.producer().unwrap(), shared.consumer().unwrap());
    for round in 0..3u64 {
        assert_eq!(tx.push_slice(&[round; 6]), 6, "spsc round {round}");
        {
            let mut batch = tx.reserve(4).expect("room for 4");
            assert_eq!(batch.fill_from(&[10 + round; 4]), 4);
        }
        assert_eq!(rx.len(), 10, "spsc round {round}");
        let mut out = [0u64; 6];
        assert_eq!(rx.pop_into(&mut out), 6, "spsc round {round}");
        assert_eq!(out, [round; 6], "spsc round {round}");
        let batch = rx.peek();
        assert_eq!(
            batch.iter().collect::<Vec<_>>(),
            [10 + round; 4],
            "spsc round {round}"
        );
    }

    let p = TempPath::new("wrap-mpsc");
    drop(mpsc::shared::create::<u64>(&p.0, 16).unwrap());
    patch(&p.0, TAIL_AT, &start);
    patch(&p.0, HEAD_AT, &start);
    let shared = mpsc::shared::open::<u64>(&p.0).unwrap();
    let (mut tx, mut rx) = (shared.producer().unwrap(), shared.consumer().unwrap());
    for round in 0..3u64 {
        assert_eq!(tx.push_slice(&[round; 6]), 6, "mpsc round {round}");
        {
            let mut batch = tx.reserve(4).expect("room for 4");
            assert_eq!(batch.fill_from(&[10 + round; 4]), 4);
        }
        let mut out = [0u64; 6];
        assert_eq!(rx.pop_into(&mut out), 6, "mpsc round {round}");
        assert_eq!(out, [round; 6], "mpsc round {round}");
        let batch = rx.peek();
        assert_eq!(
            batch.iter().collect::<Vec<_>>(),
            [10 + round; 4],
            "mpsc round {round}"
        );
    }
}
