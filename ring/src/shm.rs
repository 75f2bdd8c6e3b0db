//! Creating and opening ring files (memmap2), shared by `spsc::shared` and
//! `mpsc::shared`. The creator fills a temporary sibling file and renames it
//! into place, so `open` never sees a half-written header; `open` validates
//! every header field before the ring is used. Anonymous rings
//! ([`create_memfd`]) live in a sealed memfd that has no name at all; the
//! other process gets the descriptor (e.g. with `SCM_RIGHTS`) and
//! [`open_file`] validates it exactly as `open` validates a path.

use std::fs::{self, File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64 as StdAtomicU64;

use memmap2::{Advice, MmapMut};

use crate::layout::{
    fingerprint, round_capacity, Control, Geometry, Header, Kind, LAYOUT_VERSION, MAGIC,
    MAX_CAPACITY, PAGE,
};
use crate::ring::Ring;
use crate::sync::Ordering;
use crate::{CapacityError, Plain, ShmError};

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ShmError + '_ {
    move |source| ShmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `statfs.f_type` of the file systems whose pages are never written back:
/// tmpfs (also memfd and `/dev/shm`), hugetlbfs, ramfs (`linux/magic.h`).
const MEMORY_FILE_SYSTEMS: [u64; 3] = [0x0102_1994, 0x9584_58f6, 0x8584_58f6];

/// Refuse a file that is not on a memory file system: see
/// [`ShmError::NotInMemory`] for what a disk-backed ring file does.
fn check_in_memory(file: &File, path: &Path) -> Result<(), ShmError> {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `file` is an open descriptor for the whole call and `st` is a
    // writable statfs buffer; fstatfs only writes into it.
    let r = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if r != 0 {
        return Err(io(path)(std::io::Error::last_os_error()));
    }
    // SAFETY: fstatfs returned 0, so it filled the buffer (and it started
    // zeroed, a valid statfs anyway).
    let f_type = unsafe { st.assume_init() }.f_type;
    // The magics are 32-bit; `f_type`'s C type differs between targets
    // (signed, 32 or 64 bits), so compare its low 32 bits.
    let fs_type = f_type as u64 & 0xffff_ffff;
    if MEMORY_FILE_SYSTEMS.contains(&fs_type) {
        return Ok(());
    }
    Err(ShmError::NotInMemory {
        path: path.to_path_buf(),
        fs_type,
    })
}

fn check_align<T>() -> Result<(), ShmError> {
    let align = std::mem::align_of::<T>();
    if align > PAGE {
        return Err(ShmError::AlignTooLarge { align });
    }
    Ok(())
}

/// Create (or atomically replace) the ring file at `path`.
pub(crate) fn create<T: Plain>(
    path: &Path,
    capacity: usize,
    kind: Kind,
) -> Result<Ring<T>, ShmError> {
    check_align::<T>()?;
    let too_large = CapacityError {
        requested: capacity,
    };
    let cap = round_capacity(capacity).ok_or(too_large)?;
    let geom = Geometry::of::<T>(cap, kind).ok_or(too_large)?;
    static COUNTER: StdAtomicU64 = StdAtomicU64::new(0);
    // Relaxed: a unique number, nothing else.
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}.{n}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let result = fill_and_rename::<T>(&tmp, path, &geom, kind);
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn fill_and_rename<T: Plain>(
    tmp: &Path,
    path: &Path,
    geom: &Geometry,
    kind: Kind,
) -> Result<Ring<T>, ShmError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(io(tmp))?;
    check_in_memory(&file, path)?;
    let map = fill::<T>(&file, tmp, geom, kind)?;
    fs::rename(tmp, path).map_err(io(path))?;
    // SAFETY: the mapping is total_len bytes and initialised for `geom`.
    Ok(unsafe { Ring::from_mapping(map, geom, kind) })
}

/// Sizes `file` for `geom`, maps it and writes the header (magic last).
fn fill<T: Plain>(
    file: &File,
    path: &Path,
    geom: &Geometry,
    kind: Kind,
) -> Result<MmapMut, ShmError> {
    file.set_len(geom.total_len).map_err(io(path))?;
    let mut map = map(file, path)?;
    populate(&map, geom.total_len);
    let ctrl = map.as_mut_ptr() as *mut Control;
    // SAFETY: the mapping is page aligned and at least total_len >=
    // size_of::<Control>() bytes, and nobody else knows the temporary file
    // yet, so we may initialise the control block in place. The zero-filled
    // stamps and slots are already valid (stamps 0, T: Plain).
    unsafe { ctrl.write(Control::new(geom, kind, fingerprint::<T>(), 0)) };
    // SAFETY: just initialised above.
    let header = unsafe { &(*ctrl).header.0 };
    // Release: pairs with the Acquire load of the magic in `open`; the magic
    // is written last so a reader that sees it sees the whole header.
    header.magic.store(MAGIC, Ordering::Release);
    Ok(map)
}

/// Create an anonymous ring: a memfd (named `name` in `/proc/*/fd` links
/// only; no file system path reaches it) sized, filled and then sealed
/// against shrinking and growing, so no process holding it can truncate
/// the ring under another's mapping (`SIGBUS`). Returns the ring and the
/// descriptor (close-on-exec) to hand to the other side.
pub(crate) fn create_memfd<T: Plain>(
    name: &std::ffi::CStr,
    capacity: usize,
    kind: Kind,
) -> Result<(Ring<T>, File), ShmError> {
    check_align::<T>()?;
    let too_large = CapacityError {
        requested: capacity,
    };
    let cap = round_capacity(capacity).ok_or(too_large)?;
    let geom = Geometry::of::<T>(cap, kind).ok_or(too_large)?;
    let path = memfd_path(name);
    // SAFETY: `name` is a NUL-terminated C string; memfd_create takes no
    // other pointer.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io(&path)(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    check_in_memory(&file, &path)?;
    let map = fill::<T>(&file, &path, &geom, kind)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own, with integer arguments.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io(&path)(std::io::Error::last_os_error()));
    }
    // SAFETY: the mapping is total_len bytes and initialised for `geom`.
    Ok((unsafe { Ring::from_mapping(map, &geom, kind) }, file))
}

/// How an anonymous ring is named in errors and `SharedRing::path`.
pub(crate) fn memfd_path(name: &std::ffi::CStr) -> PathBuf {
    PathBuf::from(format!("memfd:{}", name.to_string_lossy()))
}

fn map(file: &File, path: &Path) -> Result<MmapMut, ShmError> {
    // SAFETY: memmap2's contract is that the file is not truncated or
    // resized under the mapping. Ring files are only written through the
    // mapping and never shrunk by this crate (documented in docs/ring.md);
    // all concurrent access to the mapped bytes goes through atomics or the
    // slot protocol.
    unsafe { MmapMut::map_mut(file) }.map_err(io(path))
}

/// Faults the ring's `len` bytes into `map` writable up front
/// (`MADV_POPULATE_WRITE`): without it, each side takes a page fault the
/// first time its entries reach a page (two for a 4 KiB page of entries,
/// each several µs on a VM, tens when the host backs the page then), a
/// stall in the middle of a freshly attached client's first pass over the
/// ring. `len` is the validated geometry, not the file's size, so a peer's
/// oversized file commits nothing more. Best effort: a kernel before 5.14
/// refuses the advice (EINVAL) and the pages fault in on first use, as
/// they did before.
fn populate(map: &MmapMut, len: u64) {
    if let Ok(len) = usize::try_from(len) {
        let _ = map.advise_range(Advice::PopulateWrite, 0, len.min(map.len()));
    }
}

/// Open an existing ring file and validate its header for `T` and `kind`.
pub(crate) fn open<T: Plain>(path: &Path, kind: Kind) -> Result<Ring<T>, ShmError> {
    check_align::<T>()?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io(path))?;
    open_file(&file, path, kind)
}

/// Map the ring in `file` (opened read-write, e.g. a descriptor received
/// from its creator) and validate its header for `T` and `kind`, exactly
/// as [`open`] does; `path` only names it in errors. The mapping outlives
/// the descriptor, which the caller may close.
pub(crate) fn open_file<T: Plain>(
    file: &File,
    path: &Path,
    kind: Kind,
) -> Result<Ring<T>, ShmError> {
    check_align::<T>()?;
    check_in_memory(file, path)?;
    let len = file.metadata().map_err(io(path))?.len();
    let ctrl_len = std::mem::size_of::<Control>() as u64;
    if len < ctrl_len {
        return Err(ShmError::Truncated {
            len,
            expected: ctrl_len,
        });
    }
    let map = map(file, path)?;
    // SAFETY: the mapping is page aligned and at least size_of::<Control>()
    // bytes; every field of Header is an integer (any bit pattern valid).
    let header = unsafe { &*(map.as_ptr() as *const Header) };
    let geom = validate::<T>(header, kind, len)?;
    populate(&map, geom.total_len);
    // SAFETY: `validate` checked the header against `geom` and that the file
    // holds total_len bytes.
    Ok(unsafe { Ring::from_mapping(map, &geom, kind) })
}

fn validate<T>(h: &Header, kind: Kind, len: u64) -> Result<Geometry, ShmError> {
    // Acquire: pairs with the creator's Release store of the magic.
    let magic = h.magic.load(Ordering::Acquire);
    if magic != MAGIC {
        return Err(ShmError::BadMagic { found: magic });
    }
    if h.version != LAYOUT_VERSION {
        return Err(ShmError::VersionMismatch {
            found: h.version,
            expected: LAYOUT_VERSION,
        });
    }
    if h.kind != kind as u32 {
        return Err(ShmError::KindMismatch {
            found: h.kind,
            expected: kind as u32,
        });
    }
    let cap = h.capacity;
    if cap == 0 || !cap.is_power_of_two() || cap > MAX_CAPACITY as u64 {
        return Err(ShmError::BadCapacity { found: cap });
    }
    let size = std::mem::size_of::<T>() as u64;
    if h.entry_size != size {
        return Err(ShmError::EntrySizeMismatch {
            found: h.entry_size,
            expected: size,
        });
    }
    let align = std::mem::align_of::<T>() as u64;
    if h.entry_align != align {
        return Err(ShmError::EntryAlignMismatch {
            found: h.entry_align,
            expected: align,
        });
    }
    let fp = fingerprint::<T>();
    if h.fingerprint != fp {
        return Err(ShmError::FingerprintMismatch {
            found: h.fingerprint,
            expected: fp,
        });
    }
    let geom = Geometry::of::<T>(cap, kind).ok_or(ShmError::BadCapacity { found: cap })?;
    for (field, found, expected) in [
        ("stamps_offset", h.stamps_offset, geom.stamps_offset),
        ("slots_offset", h.slots_offset, geom.slots_offset),
        ("total_len", h.total_len, geom.total_len),
    ] {
        if found != expected {
            return Err(ShmError::LayoutMismatch {
                field,
                found,
                expected,
            });
        }
    }
    if len < geom.total_len {
        return Err(ShmError::Truncated {
            len,
            expected: geom.total_len,
        });
    }
    Ok(geom)
}
