"""Reference clients for kvferry's attach protocol (docs/attach.md): a
decoder attached to `kvferry receiver --attach` and a prefill worker
attached to `kvferry sender --attach`.

Pure Python 3 standard library: socket (the lease, the submission
doorbell, and the hello's descriptors with SCM_RIGHTS), mmap + ctypes (the rings' head/tail words and the futex doorbell),
struct (the entries). A decoder reads chunk bytes in place from the
receiver's buffer, mapped read-only; a prefill worker fills staging slots in
place in the sender's staging buffer, mapped writable.

Memory ordering: ring indices are read and written with single aligned
8-byte accesses (ctypes c_uint64 over the mapping), which on x86-64 have the
acquire/release semantics the ring protocol needs. The full (store->load)
fence both doorbells need (docs/attach.md, "Doorbells") is `fence()`: a
pthread_mutex_trylock/unlock pair on a private mutex through ctypes, which
POSIX lists among the functions that synchronize memory (glibc issues a
locked instruction, a full barrier on x86-64). With it the clients write
the submission doorbell byte only when the daemon's session armed
need-wakeup, as the Rust clients do, and the completion wait cannot sleep
through a publish; its futex timeout (WAKE_SLACK) is only a backstop.
Linux x86-64 only (SYS_futex = 202).

Placement: once attached, a client takes the CPU the daemon keeps for its
copy engine (hello offset 76) out of the attaching thread's CPU set, as
the Rust clients do (docs/attach.md, "Placing the threads"); its
kept_off_cpu says which CPU (None: none). KVFERRY_ATTACH_KEEP_AFFINITY=1
keeps the set as it is.
"""

import array
import ctypes
import mmap
import os
import socket
import struct
import time

ATTACH_VERSION = 6
HELLO_LEN = 1024
# Descriptors an accepting hello carries (SCM_RIGHTS, in this order): the
# submission ring, the completion ring, the data (receive buffer read-only,
# or the worker's staging share). The client makes room for MAX_FDS and
# closes every one past HELLO_FDS.
HELLO_FDS = 3
MAX_FDS = 8
HELLO_MAGIC = b"KVFATCH1"
RING_MAGIC = b"KVFRING1"
RING_VERSION = 1
MAX_REQ_ID = 112
NO_TOKENS = 0xFFFFFFFF
NO_CPU = 0xFFFFFFFF  # hello offset 76: the daemon keeps no CPU for a copy engine
# Set to anything but "" or "0": keep the attaching thread's CPU set as is.
KEEP_AFFINITY_ENV = "KVFERRY_ATTACH_KEEP_AFFINITY"

MAX_TEXT = 224
# A BEGIN's chunk geometry (fmt, shape, dtype) follows its req_id at
# GEOMETRY_AT of the text (entry offset 144); all zero = the defaults.
GEOMETRY_AT = MAX_REQ_ID
MAX_SHAPE_DIMS = 8
MAX_DTYPE = 32

OP_SUBSCRIBE, OP_RELEASE, OP_SUBSCRIBE_ALL = 1, 2, 3
DAEMON_TAG = 1 << 63  # tags of wildcard deliveries (the daemon's)
NAME_PART = 16        # req_id bytes per NAME entry
OP_BEGIN, OP_STAGE, OP_KEY, OP_SUBMIT, OP_CANCEL = 1, 2, 3, 4, 5
EV_READY, EV_CHUNK, EV_FAILED, EV_REFUSED = 1, 2, 3, 4
EV_STAGED, EV_SLOT, EV_DONE = 5, 6, 7
EV_NAME = 8
ROLE_DECODER, ROLE_PREFILL = 1, 2

SUBMIT = struct.Struct("<IIQ112s")   # op, req_id_len, tag, req_id
PSUBMIT = struct.Struct("<IIQIIII224s")  # op, len, tag, a, b, c, text_len, text
GEOMETRY = struct.Struct("<q8qII32s")  # fmt, shape[8], ndims, dtype_len, dtype
EVENT = struct.Struct("<IIQIIII")    # kind, code, tag, a, b, len, tokens
assert SUBMIT.size == 128 and EVENT.size == 32 and PSUBMIT.size == 256
assert GEOMETRY_AT + GEOMETRY.size == MAX_TEXT

# Ring control block offsets (docs/ring.md).
OFF_TAIL, OFF_HEAD = 128, 256
OFF_BELL, OFF_NEED_WAKEUP = 384, 388
OFF_PRODUCER_TAKEN, OFF_CONSUMER_TAKEN = 400, 404

SYS_FUTEX = 202
FUTEX_WAIT = 0
# The completion wait's futex timeout: a backstop only (the fence makes a
# lost wake-up impossible), so an idle client wakes 10 times a second.
WAKE_SLACK = 0.1
# Empty polls of the completion ring before the futex wait (one
# time.monotonic() each), at most: each ring adapts its own number between
# MIN_SPINS and SPINS (Ring.wait).
SPINS = 64
MIN_SPINS = 2
# After its polls a wait yields the CPU (os.sched_yield between checks) for
# this ring's linger before the futex wait, as the Rust clients and the
# daemon's sessions do (src/util/linger.rs): LINGER seconds, adapted up to
# LINGER_MAX after sleeps that the daemon ended that soon (Ring.wait).
LINGER = 50e-6
LINGER_MAX = 250e-6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# fence(): a full memory barrier. pthread_mutex_trylock and _unlock
# "synchronize memory" (POSIX.1-2017, 4.12); glibc's trylock is a locked
# cmpxchg, which x86-64 orders against every earlier store and later load.
_FENCE_MUTEX = ctypes.create_string_buffer(64)  # >= sizeof(pthread_mutex_t)
if _libc.pthread_mutex_init(_FENCE_MUTEX, None) != 0:
    raise OSError("pthread_mutex_init failed")
_FENCE_AT = ctypes.addressof(_FENCE_MUTEX)
_trylock, _unlock = _libc.pthread_mutex_trylock, _libc.pthread_mutex_unlock
_trylock.argtypes = _unlock.argtypes = [ctypes.c_void_p]


def fence():
    """A full (store->load) memory barrier (the module docs say how)."""
    if _trylock(_FENCE_AT) == 0:
        _unlock(_FENCE_AT)


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class AttachError(Exception):
    """The daemon refused, or broke the protocol."""


# madvise(2) advice filling a mapping's page tables up front (Linux 5.14;
# Python's mmap module does not name them).
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23


def _populate(mm, length, advice):
    """Fills the page tables of `mm`'s first `length` bytes, so the first
    touch of each page takes no page fault (several us each on a VM, in the
    middle of a round trip; a 256 KiB chunk is 64 pages). Best effort: an
    older kernel refuses the advice and the pages fault in on first use."""
    try:
        mm.madvise(advice, 0, min(length, len(mm)))
    except (OSError, ValueError):
        pass


class Ring:
    """One side of a kvferry-ring SPSC ring (a memfd the daemon passed;
    `path` only names it in errors)."""

    def __init__(self, fd, path, entry_size, side):
        self.mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        magic, version, kind, cap, esize = struct.unpack_from("<8sIIQQ", self.mm, 0)
        slots_offset = struct.unpack_from("<Q", self.mm, 56)[0]
        if magic != RING_MAGIC or version != RING_VERSION or kind != 1:
            raise AttachError("%s: not a kvferry SPSC ring v1" % path)
        if esize != entry_size or cap == 0 or cap & (cap - 1):
            raise AttachError("%s: entry size %d / capacity %d unexpected" % (path, esize, cap))
        if len(self.mm) < slots_offset + cap * esize:
            raise AttachError("%s: truncated" % path)
        _populate(self.mm, slots_offset + cap * esize, MADV_POPULATE_WRITE)
        self.cap, self.esize, self.slots = cap, esize, slots_offset
        self.tail = ctypes.c_uint64.from_buffer(self.mm, OFF_TAIL)
        self.head = ctypes.c_uint64.from_buffer(self.mm, OFF_HEAD)
        self.bell = ctypes.c_uint32.from_buffer(self.mm, OFF_BELL)
        self.need_wakeup = ctypes.c_uint32.from_buffer(self.mm, OFF_NEED_WAKEUP)
        taken = ctypes.c_uint32.from_buffer(
            self.mm, OFF_PRODUCER_TAKEN if side == "producer" else OFF_CONSUMER_TAKEN)
        if taken.value:
            raise AttachError("%s: %s side already taken" % (path, side))
        taken.value = 1
        # Private copies of our own index (we are its only writer).
        self.pos = self.tail.value if side == "producer" else self.head.value
        # Consumer: this ring's current spin budget and linger (see wait).
        self.spins = SPINS
        self.linger = LINGER

    def offset(self, pos):
        return self.slots + (pos & (self.cap - 1)) * self.esize

    def _spans(self, n):
        """The byte ranges of the next `n` entries from our index: up to
        the ring's end, then (if they wrap) from its start."""
        start = self.offset(self.pos)
        first = min(n, self.cap - (self.pos & (self.cap - 1))) * self.esize
        return (start, start + first), (self.slots, self.slots + n * self.esize - first)

    # Producer side.
    def push(self, entry):
        """Writes one entry and publishes it; False if the ring is full."""
        return self.push_many(entry, 1) == 1

    def push_many(self, entries, n):
        """Writes the first entries of `entries` (n entries of esize bytes,
        as one bytes object) that fit and publishes them with one `tail`
        store; returns how many."""
        k = min(n, self.cap - (self.pos - self.head.value))
        if k <= 0:
            return 0
        (a, b), (c, d) = self._spans(k)
        self.mm[a:b] = entries[:b - a]
        if d > c:
            self.mm[c:d] = entries[b - a:b - a + d - c]
        self.pos += k
        self.tail.value = self.pos  # publish (release on x86-64)
        return k

    def take_wakeup(self):
        """After a publish: True if the consumer armed need-wakeup (it is
        cleared then), i.e. the caller must ring its doorbell."""
        fence()  # the publish before the flag load (Dekker)
        if self.need_wakeup.value:
            self.need_wakeup.value = 0
            return True
        return False

    # Consumer side.
    def available(self):
        return self.tail.value - self.pos  # acquire on x86-64

    def pop(self):
        if self.available() <= 0:
            return None
        off = self.offset(self.pos)
        entry = bytes(self.mm[off:off + self.esize])
        self.pos += 1
        self.head.value = self.pos
        return entry

    def pop_many(self, n):
        """The next `n` entries as one bytes object (None if fewer are
        published), with one `head` store: a READY's CHUNK entries were
        published together, so a decoder reads them in one go."""
        if self.available() < n:
            return None
        (a, b), (c, d) = self._spans(n)
        raw = self.mm[a:b]
        if d > c:
            raw += self.mm[c:d]
        self.pos += n
        self.head.value = self.pos
        return raw

    def wait(self, deadline):
        """Until an entry is available (True) or the deadline (False).

        Polls up to `self.spins` times, then yields the CPU between checks
        for `self.linger` seconds, then sleeps on the futex. The poll
        budget adapts: an entry that arrived during the polls (the
        producer runs on another CPU) doubles it, up to SPINS; one that
        came later halves it, down to MIN_SPINS. When the producer shares
        this process's CPU it cannot publish while we poll, so polling
        only delays it: there the budget falls to MIN_SPINS within a few
        waits, and a Python poll (~0.4 µs) is no longer spent by the
        thousand per second on a busy CPU. The yields are for that CPU:
        each lets the daemon's session run and answer, and an answer that
        comes during them costs no futex wake-up (a syscall on each side
        and two switches; on the project's 2-vCPU VM this raised the
        end-to-end bench by 7-15 %, docs/benchmarks.md, "Attach, 2026-12-07
        (8)"). The linger adapts as the Rust clients' does: a sleep that
        the producer ended within LINGER_MAX means it gave up too early,
        so the next linger is twice that sleep (LINGER to LINGER_MAX); a
        longer sleep brings it back to LINGER. An idle client yields for
        at most LINGER_MAX before it sleeps."""
        if self.available() > 0:
            return True
        budget, spins, linger_end, asleep = self.spins, 1, None, None
        while self.available() <= 0:
            now = time.monotonic()
            if now >= deadline:
                return False
            spins += 1
            if spins < budget:
                continue
            if linger_end is None:
                linger_end = now + self.linger
            if now < linger_end:
                os.sched_yield()
                continue
            if asleep is None:
                asleep = now
            # The bell before the flag (docs/ring.md, "Doorbell"): a
            # producer that clears this arming rings past `seen`, so the
            # futex cannot sleep through its ring.
            seen = self.bell.value
            self.need_wakeup.value = 1
            fence()  # the flag before the re-check (Dekker)
            if self.available() > 0:
                break
            left = min(deadline - now, WAKE_SLACK)
            ts = Timespec(int(left), int((left % 1) * 1e9))
            _libc.syscall(SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(self.bell)),
                          FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(ts), None, 0)
        self.need_wakeup.value = 0
        if asleep is not None:
            self.linger = _after_sleep(time.monotonic() - asleep)
        if spins < budget:
            self.spins = min(SPINS, budget * 2)
        else:
            self.spins = max(MIN_SPINS, budget // 2)
        return True


def _after_sleep(slept):
    """A ring's linger after a futex sleep of `slept` seconds that an entry
    ended: twice it, within LINGER and LINGER_MAX; LINGER after a sleep of
    LINGER_MAX or more (the producer was idle). src/util/linger.rs's
    after_sleep."""
    if slept >= LINGER_MAX:
        return LINGER
    return min(LINGER_MAX, max(LINGER, 2 * slept))


def _entries(raw, n, kind, tag, limit):
    """Checks the n EVENT entries `raw` holds (CHUNK or SLOT: `kind`, this
    `tag`, index 0..n-1, field a (the slot) below `limit`) and returns
    their (a, len, tokens) columns as lists, or None if one is wrong.
    Column slices of a u32 view: a few C calls for the whole batch, where
    unpacking entry by entry costs ~0.7 µs each."""
    mv = memoryview(raw)
    u32 = mv.cast("I")
    kinds, slots, idxs = u32[0::8].tolist(), u32[4::8].tolist(), u32[5::8].tolist()
    tags = mv.cast("Q")[1::4].tolist()
    if (kinds != [kind] * n or tags != [tag] * n or idxs != list(range(n))
            or (n and max(slots) >= limit)):
        return None
    return slots, u32[6::8].tolist(), u32[7::8].tolist()


def _publish(sq, sock, entries, n, wait=0.0):
    """Publishes n packed entries on the submission ring `sq` (in as few
    `tail` stores as its room allows), then writes the doorbell byte on
    `sock` if the session asked for it (need-wakeup). A full ring rings
    whatever the flag says and is retried until `wait` seconds passed,
    then raises AttachError."""
    deadline = time.monotonic() + wait
    done = 0
    while True:
        done += sq.push_many(entries[done * sq.esize:], n - done)
        if done == n:
            break
        sock.sendall(b"\1")
        if time.monotonic() >= deadline:
            raise AttachError("submission ring full")
        time.sleep(0.0001)
    if sq.take_wakeup():
        sock.sendall(b"\1")  # the doorbell


class _Hello:
    """The daemon's hello, checked (docs/attach.md)."""

    def __init__(self, sock, role, sq_entry_size):
        hello, fds, extra = b"", [], 0
        try:
            while len(hello) < HELLO_LEN:
                part, anc, flags, _ = sock.recvmsg(
                    HELLO_LEN - len(hello), socket.CMSG_SPACE(MAX_FDS * 4),
                    socket.MSG_CMSG_CLOEXEC)
                if flags & socket.MSG_CTRUNC:
                    extra += 1
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(data[:len(data) - len(data) % got.itemsize])
                        fds.extend(got)
                if not part:
                    raise AttachError("daemon closed before its hello (%d bytes)" % len(hello))
                hello += part
            self._check(hello, role, sq_entry_size, len(fds), extra)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        # Exactly HELLO_FDS (checked above): sq ring, cq ring, data.
        self.sq_fd, self.cq_fd, self.data_fd = fds

    def _check(self, hello, role, sq_entry_size, nfds, extra):
        if hello[:8] != HELLO_MAGIC:
            raise AttachError("bad hello magic")
        (version, got_role, status, self.client_id, sq_entry, cq_entry, _sqc, _cqc,
         self.slots, self.chunk_bytes, self.data_offset,
         self.max_outstanding, self.receivers) = struct.unpack_from("<IIIIIIIIQQQII", hello, 8)
        if version != ATTACH_VERSION:
            raise AttachError("attach version %d, expected %d" % (version, ATTACH_VERSION))
        if status != 0:
            raise AttachError("refused by the daemon (status %d)" % status)
        if got_role != role or sq_entry != sq_entry_size or cq_entry != EVENT.size:
            raise AttachError("unexpected role or entry sizes")
        announced = struct.unpack_from("<I", hello, 72)[0]
        if nfds != HELLO_FDS or extra or announced != HELLO_FDS:
            raise AttachError("hello carried %d descriptors (and %d more), expected %d"
                              % (nfds, extra, HELLO_FDS))
        # The CPU the daemon keeps for a copy engine, or NO_CPU.
        self.engine_cpu = struct.unpack_from("<I", hello, 76)[0]
        # Prefill: this worker's staging share (the buffer file is its memfd).
        self.share, self.shares, self.share_first_slot = struct.unpack_from("<IIQ", hello, 840)

    def close(self):
        """Closes the received descriptors (mmap keeps its own)."""
        for fd in (self.sq_fd, self.cq_fd, self.data_fd):
            os.close(fd)


def _keep_off(cpu):
    """Takes the CPU the daemon keeps for its copy engine out of the calling
    thread's CPU set (docs/attach.md, "Placing the threads"), as the Rust
    clients do: not if the daemon keeps none, if it is the thread's only
    CPU (a placement of the operator's, kept) or if KEEP_AFFINITY_ENV is
    set. Returns the CPU taken out, or None. (os.sched_setaffinity(0)
    sets the calling thread's set on Linux; threads started from it later
    inherit it.)"""
    if cpu == NO_CPU or os.environ.get(KEEP_AFFINITY_ENV, "") not in ("", "0"):
        return None
    try:
        mine = os.sched_getaffinity(0)
        if cpu not in mine or len(mine) < 2:
            return None
        os.sched_setaffinity(0, mine - {cpu})
    except OSError:
        return None
    return cpu


def _next_event(client, timeout):
    """The next event client._event() returns from client.cq within
    timeout seconds; None from _event is an entry skipped (an event of a
    tag the client let go)."""
    deadline = time.monotonic() + timeout
    while True:
        if not client.cq.wait(deadline):
            raise TimeoutError("no attach event within %.1fs" % timeout)
        ev = client._event()
        if ev is not None:
            return ev


def _connect(sock_path, timeout):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(sock_path)
    return sock


class DecoderClient:
    """An attached decoder: subscribe(req_id), next_event(), chunk(), release()."""

    def __init__(self, sock_path, timeout=30.0):
        self.sock = _connect(sock_path, timeout)
        h = _Hello(self.sock, ROLE_DECODER, SUBMIT.size)
        self.client_id, self.slots, self.chunk_bytes = h.client_id, h.slots, h.chunk_bytes
        self.data_offset, self.max_outstanding = h.data_offset, h.max_outstanding
        try:
            self.sq = Ring(h.sq_fd, "sq", SUBMIT.size, "producer")
            self.cq = Ring(h.cq_fd, "cq", EVENT.size, "consumer")
            # A read-only descriptor: it cannot be mapped writable.
            self.buf = mmap.mmap(h.data_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            h.close()
        if len(self.buf) < self.data_offset + self.slots * self.chunk_bytes:
            raise AttachError("receive buffer shorter than its geometry")
        _populate(self.buf, self.data_offset + self.slots * self.chunk_bytes, MADV_POPULATE_READ)
        self.view = memoryview(self.buf)
        # Last: a refused attach leaves the thread's CPU set as it was.
        self.kept_off_cpu = _keep_off(h.engine_cpu)
        self.tags = {}  # tag -> req_id (subscribed or held)
        self.next_tag = 1

    def _submit(self, op, tag, req_id=b""):
        _publish(self.sq, self.sock, SUBMIT.pack(op, len(req_id), tag, req_id), 1)

    def subscribe(self, req_id):
        raw = req_id.encode()
        if not 0 < len(raw) <= MAX_REQ_ID:
            raise ValueError("req_id must be 1..%d bytes" % MAX_REQ_ID)
        if len(self.tags) >= self.max_outstanding:
            raise AttachError("too many outstanding requests")
        tag = self.next_tag
        self.next_tag += 1
        self._submit(OP_SUBSCRIBE, tag, raw)
        self.tags[tag] = req_id
        return tag

    def subscribe_all(self):
        """Wildcard: every ready request no req_id subscription claims
        (docs/attach.md, "Routing"); returns its tag (release(tag) ends it).
        Deliveries arrive as ('ready', daemon_tag, req_id, chunks)."""
        tag = self.next_tag
        self.next_tag += 1
        self._submit(OP_SUBSCRIBE_ALL, tag)
        return tag

    def release(self, tag):
        self._submit(OP_RELEASE, tag)
        self.tags.pop(tag, None)

    def _let_go(self, tag):
        """A tag this client gave out and released (or unsubscribed): an
        event for it was posted before the daemon read the RELEASE, and
        the daemon released that delivery itself. Tags are never reused."""
        return not tag & DAEMON_TAG and 0 < tag < self.next_tag and tag not in self.tags

    def next_event(self, timeout=30.0):
        """('ready', tag, req_id, [(slot, len, tokens)]) | ('failed', tag,
        req_id, code) | ('refused', tag, code). A READY or FAILED of a tag
        released before it came (release() of a subscription not
        delivered yet) is skipped: the daemon released that delivery."""
        return _next_event(self, timeout)

    def _event(self):
        kind, code, tag, a, b, _len, _tok = EVENT.unpack(self.cq.pop())
        if kind in (EV_READY, EV_FAILED) and not b and self._let_go(tag):
            if kind == EV_READY and a and self.cq.pop_many(a) is None:
                raise AttachError("READY not followed by its chunks")
            return None
        if kind == EV_READY:
            req_id = self.tags.get(tag)
            if b:  # a wildcard delivery: its req_id follows in NAME entries
                if not tag & DAEMON_TAG or b > MAX_REQ_ID:
                    raise AttachError("bad wildcard READY")
                name = b""
                while len(name) < b:
                    raw = self.cq.pop()
                    if raw is None:
                        raise AttachError("READY not followed by its name")
                    k, n, t = struct.unpack_from("<IIQ", raw)
                    if k != EV_NAME or t != tag or n != min(NAME_PART, b - len(name)):
                        raise AttachError("bad NAME entry")
                    name += raw[16:16 + n]
                req_id = name.decode()
                self.tags[tag] = req_id
            raw = self.cq.pop_many(a) if a else b""
            if raw is None:
                raise AttachError("READY not followed by its chunks")
            cols = _entries(raw, a, EV_CHUNK, tag, self.slots)
            if cols is None or (a and max(cols[1]) > self.chunk_bytes):
                raise AttachError("bad CHUNK entry")
            chunks = [(slot, length, None if tokens == NO_TOKENS else tokens)
                      for slot, length, tokens in zip(*cols)]
            return ("ready", tag, req_id, chunks)
        if kind == EV_FAILED:
            return ("failed", tag, self.tags.pop(tag, None), code)
        if kind == EV_REFUSED:
            self.tags.pop(tag, None)
            return ("refused", tag, code)
        raise AttachError("unknown event kind %d" % kind)

    def chunk(self, desc):
        """A read-only memoryview of a held chunk's bytes, in place."""
        slot, length, _tokens = desc
        off = self.data_offset + slot * self.chunk_bytes
        return self.view[off:off + length]

    def close(self):
        self.sock.close()


def _tokens(last_chunk_toks):
    """A last chunk's token count as an entry carries it (None: the
    default, NO_TOKENS), checked."""
    toks = NO_TOKENS if last_chunk_toks is None else last_chunk_toks
    if not 0 <= toks <= NO_TOKENS:
        raise ValueError("last_chunk_toks must be 0..%d" % (NO_TOKENS - 1))
    return toks


def _key_entries(tag, batch, keys, lens):
    """The packed KEY entries naming chunk i of batch `batch` of `tag`
    keys[i], lens[i] bytes (each key checked: 1..MAX_TEXT bytes)."""
    if len(keys) != len(lens):
        raise ValueError("%d keys for %d lengths" % (len(keys), len(lens)))
    raws = [k.encode() for k in keys]
    for raw in raws:
        if not 0 < len(raw) <= MAX_TEXT:
            raise ValueError("key must be 1..%d bytes" % MAX_TEXT)
    return b"".join(PSUBMIT.pack(OP_KEY, length, tag, batch, i, 0, len(raw), raw)
                    for i, (raw, length) in enumerate(zip(raws, lens)))


class PrefillClient:
    """An attached prefill worker: begin(req_id, receiver, total, fmt=0,
    shape=(), dtype=""), stage(tag, n), next_event() -> ('staged', tag,
    batch, [slots]), slot(slot) (a writable memoryview, in place),
    submit(tag, batch, keys, lens, last_chunk_toks=None), cancel(tag); or
    begin_declared(req_id, receiver, total, keys, lens) -> (tag, batch)
    and submit_declared(tag, batch) (one round trip fewer)."""

    def __init__(self, sock_path, timeout=30.0):
        self.sock = _connect(sock_path, timeout)
        h = _Hello(self.sock, ROLE_PREFILL, PSUBMIT.size)
        self.client_id, self.slots, self.chunk_bytes = h.client_id, h.slots, h.chunk_bytes
        self.receivers = h.receivers
        # The buffer file is this worker's staging share alone: SLOT entries
        # index it (0..slots); other workers' slots are not in it.
        self.share, self.shares = h.share, h.shares
        try:
            self.sq = Ring(h.sq_fd, "sq", PSUBMIT.size, "producer")
            self.cq = Ring(h.cq_fd, "cq", EVENT.size, "consumer")
            self.buf = mmap.mmap(h.data_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            h.close()
        # A child this process forks does not inherit the share: it could
        # otherwise write it after this worker left (docs/attach.md, "Trust").
        self.buf.madvise(mmap.MADV_DONTFORK)
        if len(self.buf) < self.slots * self.chunk_bytes:
            raise AttachError("staging buffer shorter than its geometry")
        _populate(self.buf, self.slots * self.chunk_bytes, MADV_POPULATE_WRITE)
        self.view = memoryview(self.buf)
        # Last: a refused attach leaves the thread's CPU set as it was.
        self.kept_off_cpu = _keep_off(h.engine_cpu)
        self.next_tag = 1
        self.next_batch = 1
        self.held = set()  # (tag, batch) staged for us and not submitted
        self.declared = {}  # (tag, batch) of a declared batch -> its chunks
        self.live = set()  # tags begun and not ended (a refused BEGIN's stays)
        # Live tags we cancelled: a STAGED posted before the daemon read the
        # CANCEL (which gave the batch back) is skipped, its slots never
        # handed out.
        self.cancelled = set()

    def _push(self, op, tag, a=0, b=0, length=0, text=b"", wait=0.0, c=0, extra=b""):
        # `extra`: bytes after the text's used part (a BEGIN's geometry).
        body = text.ljust(GEOMETRY_AT, b"\0") + extra if extra else text
        _publish(self.sq, self.sock, PSUBMIT.pack(op, length, tag, a, b, c, len(text), body), 1,
                 wait)

    def _begin_entry(self, tag, req_id, receiver, total_chunks, fmt, shape, dtype,
                     declared=0, toks=0):
        """The packed BEGIN entry (c: chunks of a declared first batch,
        length: its last chunk's token count)."""
        raw = req_id.encode()
        if not 0 < len(raw) <= MAX_REQ_ID:
            raise ValueError("req_id must be 1..%d bytes" % MAX_REQ_ID)
        shape = [int(d) for d in shape]
        dt = dtype.encode()
        if len(shape) > MAX_SHAPE_DIMS or len(dt) > MAX_DTYPE:
            raise ValueError("at most %d dims and %d dtype bytes" % (MAX_SHAPE_DIMS, MAX_DTYPE))
        geometry = GEOMETRY.pack(fmt, *(shape + [0] * (MAX_SHAPE_DIMS - len(shape))),
                                 len(shape), len(dt), dt)
        return PSUBMIT.pack(OP_BEGIN, toks, tag, receiver, total_chunks, declared, len(raw),
                            raw.ljust(GEOMETRY_AT, b"\0") + geometry)

    def begin(self, req_id, receiver, total_chunks, fmt=0, shape=(), dtype=""):
        """Begins req_id; fmt, shape and dtype are the request's chunk
        geometry (AllocRequest's fields; the defaults: shape [chunk_bytes]
        of uint8). The daemon refuses a geometry out of range (code 12)."""
        tag = self.next_tag
        entry = self._begin_entry(tag, req_id, receiver, total_chunks, fmt, shape, dtype)
        self.next_tag += 1
        _publish(self.sq, self.sock, entry, 1, 0.0)
        self.live.add(tag)
        return tag

    def begin_declared(self, req_id, receiver, total_chunks, keys, lens, last_chunk_toks=None,
                       fmt=0, shape=(), dtype=""):
        """Begins req_id with its first batch declared: chunk i of it is
        keys[i], lens[i] bytes (whole but the last), the last one
        last_chunk_toks tokens (None: the tokens it holds). The admission
        carries the keys, so the receiver allocates the batch's slots as it
        admits the request: one control round trip fewer than begin +
        stage + submit. Also asks for the batch's slots (its STAGE); returns
        (tag, batch). Fill the slots of its ('staged', tag, batch, slots)
        event, then submit_declared(tag, batch)."""
        toks = _tokens(last_chunk_toks)
        if not keys or len(keys) != len(lens):
            raise ValueError("a declared batch needs as many keys as lengths, at least one")
        tag, batch = self.next_tag, self.next_batch
        n = len(keys)
        # BEGIN, its KEYs, the STAGE: one publish (ring room permitting),
        # at most one doorbell byte.
        entries = self._begin_entry(tag, req_id, receiver, total_chunks, fmt, shape, dtype,
                                    n, toks)
        entries += _key_entries(tag, batch, keys, lens)
        entries += PSUBMIT.pack(OP_STAGE, 0, tag, batch, n, 0, 0, b"")
        self.next_tag += 1
        self.next_batch += 1
        _publish(self.sq, self.sock, entries, n + 2, wait=10.0)
        self.live.add(tag)
        self.declared[(tag, batch)] = n
        return tag, batch

    def stage(self, tag, n):
        batch = self.next_batch
        self.next_batch += 1
        self._push(OP_STAGE, tag, batch, n)
        return batch

    def slot(self, slot):
        """A writable memoryview of slot `slot` of this worker's share, in place."""
        if not 0 <= slot < self.slots:
            raise IndexError("slot %d outside this worker's share" % slot)
        off = slot * self.chunk_bytes
        return self.view[off:off + self.chunk_bytes]

    def submit(self, tag, batch, keys, lens, last_chunk_toks=None):
        """last_chunk_toks: the token count of the last chunk
        (AllocRequest.last_chunk_toks; None: the tokens it holds, its bytes
        over the element size of a one-dimensional shape, its bytes
        otherwise)."""
        toks = _tokens(last_chunk_toks)
        # The KEYs and the SUBMIT in one publish (ring room permitting) and
        # at most one doorbell byte.
        entries = _key_entries(tag, batch, keys, lens)
        entries += PSUBMIT.pack(OP_SUBMIT, 0, tag, batch, len(keys), toks, 0, b"")
        _publish(self.sq, self.sock, entries, len(keys) + 1, wait=10.0)
        self.held.discard((tag, batch))

    def submit_declared(self, tag, batch):
        """Hands the declared batch of begin_declared over, its slots
        filled: its keys, lengths and tokens are the declared ones."""
        n = self.declared.pop((tag, batch), None)
        if n is None:
            raise ValueError("batch %d of tag %d is no declared batch" % (batch, tag))
        self._push(OP_SUBMIT, tag, batch, n, c=NO_TOKENS, wait=10.0)
        self.held.discard((tag, batch))

    def cancel(self, tag):
        """Cancels tag's request (its FAILED follows); a batch staged for it
        before the daemon read the CANCEL is skipped by next_event."""
        self.held = {h for h in self.held if h[0] != tag}
        self._forget_declared(tag)
        self._push(OP_CANCEL, tag)
        if tag in self.live:
            self.cancelled.add(tag)

    def _forget_declared(self, tag):
        if self.declared:  # usually empty: its batches were submitted
            self.declared = {d: n for d, n in self.declared.items() if d[0] != tag}

    def _ended(self, tag):
        self.live.discard(tag)
        self._forget_declared(tag)
        self.cancelled.discard(tag)
        # The daemon keeps batches we held at the end until we acknowledge
        # (we might still be writing them): CANCEL is the acknowledgement.
        if any(h[0] == tag for h in self.held):
            self.cancel(tag)

    def next_event(self, timeout=30.0):
        """('staged', tag, batch, [slot]) | ('done', tag) | ('failed', tag,
        code) | ('refused', tag, code)."""
        return _next_event(self, timeout)

    def _event(self):
        kind, code, tag, a, b, _len, _tok = EVENT.unpack(self.cq.pop())
        if kind == EV_STAGED and tag in self.cancelled:
            if b and self.cq.pop_many(b) is None:
                raise AttachError("STAGED not followed by its slots")
            return None
        if kind == EV_STAGED:
            raw = self.cq.pop_many(b) if b else b""
            if raw is None:
                raise AttachError("STAGED not followed by its slots")
            cols = _entries(raw, b, EV_SLOT, tag, self.slots)
            if cols is None:
                raise AttachError("bad SLOT entry")
            slots = cols[0]
            self.held.add((tag, a))
            return ("staged", tag, a, slots)
        if kind == EV_DONE:
            self._ended(tag)
            return ("done", tag)
        if kind == EV_FAILED:
            self._ended(tag)
            return ("failed", tag, code)
        if kind == EV_REFUSED:
            return ("refused", tag, code)
        raise AttachError("unknown event kind %d" % kind)

    def close(self):
        self.view.release()
        self.sock.close()
