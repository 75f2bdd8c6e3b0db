"""Stand-ins for the parts of LMCache's PD path that need torch, a GPU, the
paged memory allocator or NIXL, so LMCache's *real* PD code
(`lmcache.v1.storage_backend.pd_backend_async`: `PDBackendAsync`, its msgspec
message classes, `ReservationManager`, the sender and receiver coroutines)
runs unchanged on a CPU-only CI machine.

Every stand-in, and why it is needed (nothing else is replaced; everything
else imported is LMCache 0.5.6 as published on PyPI):

1. `torch` (sys.modules): LMCache imports torch at module level for dtype
   objects (`torch.bfloat16`, ... in `lmcache.utils`' dtype tables),
   `torch.Size`, `torch.device` and `torch.cuda.is_available()` (device
   detection). The stand-in provides exactly those, with `numel()` and
   `itemsize` (what `lmcache.utils.get_size_bytes` uses), plus no-op
   `inference_mode`/`no_grad` decorators. Any other attribute raises
   AttributeError, so an unexpected use fails loudly instead of silently.
2. `lmcache.device_ops`: LMCache's native kernels (`lmcache_native`, linked
   against libc10.so from a real torch). `lmcache/__init__` already falls
   back to "CLI-only mode" without them; `memory_management` still imports
   the name. The stand-in raises if any op is *called* (the PD path calls
   none: the allocator below replaces the pinned-memory code using them).
3. `lmcache.v1.storage_backend` package `__init__` (sys.modules): it imports
   every storage backend (GDS, local disk, P2P, remote) and their GPU
   connectors. The package is registered with its real `__path__` but
   without running that `__init__`, so `pd_backend_async` and
   `abstract_backend` (the modules the PD code uses) load from the wheel.
4. `lmcache.integration.vllm.utils` (sys.modules): vLLM integration helpers
   whose import loads vLLM KV-layout detection (native code). PD code takes
   only `get_size_bytes` from it, which that module re-exports from
   `lmcache.utils`; the stand-in exports that same real function.
5. The memory allocator (`pd_backend_async.PagedCpuGpuMemoryAllocator`,
   monkeypatched): the real one allocates pinned host or GPU memory through
   torch. The stand-in hands out fixed-size slots of one buffer; a slot's
   `meta.address` is its index (what LMCache's receiver puts in
   `remote_indexes`). Optionally the buffer is a kvferry buffer file
   (header + slots, docs of `src/primitives/region.rs`) so a kvferry sender can write
   into it with its shm data plane. Memory objects carry LMCache's real
   `MemoryObjMetadata` and `MemoryFormat`.
6. The transfer channel (`pd_backend_async.CreateTransferChannel`,
   monkeypatched): NIXL, LMCache's data plane. The sender-side stand-in
   records each batched write (objects, `remote_indexes`) and, when told
   the path of the receiver's buffer file, copies the bytes there; the
   receiver side does nothing (NIXL would be passive there too).
"""

import importlib.util
import mmap
import os
import struct
import sys
import threading
import types


# ---------------------------------------------------------------- 1. torch
class _Dtype:
    def __init__(self, name, itemsize):
        self.name = name
        self.itemsize = itemsize

    def __repr__(self):
        return f"torch.{self.name}"


class _Size(tuple):
    def numel(self):
        n = 1
        for d in self:
            n *= d
        return n


class _Device:
    def __init__(self, type="cpu", index=None):
        self.type = type
        self.index = index


class _NoAccelerator:
    @staticmethod
    def is_available():
        return False


def _identity_decorator(mode=True):
    return lambda f: f


def _torch_module():
    t = types.ModuleType("torch")
    t.__doc__ = "kvferry tests/lmcache stand-in for torch (see standins.py)"
    t.__version__ = "0.0+kvferry-standin"
    t.Size = _Size
    t.device = _Device
    t.dtype = _Dtype
    t.Tensor = type("Tensor", (), {})
    t.cuda = _NoAccelerator()
    t.inference_mode = _identity_decorator
    t.no_grad = _identity_decorator
    for names, size in [
        (("float16", "half"), 2),
        (("bfloat16",), 2),
        (("float32", "float"), 4),
        (("float64", "double"), 8),
        (("int8",), 1),
        (("uint8",), 1),
        (("int16",), 2),
        (("uint16",), 2),
        (("int32",), 4),
        (("uint32",), 4),
        (("int64",), 8),
        (("uint64",), 8),
        (("bool",), 1),
        (("float8_e4m3fn",), 1),
        (("float8_e5m2",), 1),
        (("complex64",), 8),
        (("complex128",), 16),
    ]:
        d = _Dtype(names[0], size)
        for n in names:
            setattr(t, n, d)

    def missing(name):
        raise AttributeError(f"torch stand-in has no {name!r}")

    t.__getattr__ = missing
    return t


def install():
    """Installs stand-ins 1-4 and imports LMCache's PD module; returns it."""
    sys.modules["torch"] = _torch_module()
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    import lmcache  # noqa: E402  (real package; logs "CLI-only mode")

    class _NoDeviceOps:
        def __getattr__(self, name):
            def op(*_a, **_k):
                raise RuntimeError(f"LMCache device op {name} called in the stand-in")

            return op

    lmcache.device_ops = _NoDeviceOps()  # 2.

    v1 = importlib.util.find_spec("lmcache.v1")
    pkg = types.ModuleType("lmcache.v1.storage_backend")  # 3.
    pkg.__path__ = [os.path.join(os.path.dirname(v1.origin), "storage_backend")]
    sys.modules["lmcache.v1.storage_backend"] = pkg

    import lmcache.utils  # noqa: E402

    vu = types.ModuleType("lmcache.integration.vllm.utils")  # 4.
    vu.get_size_bytes = lmcache.utils.get_size_bytes
    sys.modules["lmcache.integration.vllm.utils"] = vu

    import lmcache.v1.storage_backend.pd_backend_async as pd  # noqa: E402

    return pd


# ------------------------------------------------------------ 5. allocator
KVF_MAGIC = b"KVFBUF\0\x01"
KVF_DATA_OFFSET = 4096


def create_kvferry_buffer(path, chunk_bytes, capacity):
    """Creates a kvferry buffer file (layout of src/primitives/region.rs)."""
    with open(path, "wb") as f:
        f.write(KVF_MAGIC + struct.pack("<IIQQQ", 1, 0, chunk_bytes, capacity, KVF_DATA_OFFSET))
        f.truncate(KVF_DATA_OFFSET + chunk_bytes * capacity)


class Buffer:
    """`capacity` slots of `chunk_bytes`: anonymous memory or a kvferry file."""

    def __init__(self, chunk_bytes, capacity, path=None):
        self.chunk_bytes = chunk_bytes
        self.capacity = capacity
        self.path = path
        self.offset = KVF_DATA_OFFSET if path else 0
        if path:
            fd = os.open(path, os.O_RDWR)
            self.map = mmap.mmap(fd, KVF_DATA_OFFSET + chunk_bytes * capacity)
            os.close(fd)
        else:
            self.map = mmap.mmap(-1, chunk_bytes * capacity)

    def slot(self, i):
        at = self.offset + i * self.chunk_bytes
        return memoryview(self.map)[at : at + self.chunk_bytes]


class StandInMemoryObj:
    """A slot with LMCache's real `MemoryObjMetadata` and its ref counting."""

    def __init__(self, allocator, meta):
        self._allocator = allocator
        self.meta = meta

    def ref_count_up(self):
        with self._allocator.lock:
            self.meta.ref_count += 1

    def ref_count_down(self):
        with self._allocator.lock:
            self.meta.ref_count -= 1
            if self.meta.ref_count == 0:
                self._allocator.release(self.meta.address)

    def get_ref_count(self):
        return self.meta.ref_count

    def bytes(self):
        return self._allocator.buffer.slot(self.meta.address)


class _SlotAllocator:
    def __init__(self, buffer, align_bytes):
        self.buffer = buffer
        self.lock = threading.Lock()
        self.free_blocks = list(range(buffer.capacity))
        self.buffer_ptr = 0
        self.buffer_size = buffer.chunk_bytes * buffer.capacity
        self.align_bytes = align_bytes

    def release(self, index):
        self.free_blocks.append(index)


class StandInPagedAllocator:
    """Replaces `PagedCpuGpuMemoryAllocator` (CPU only; see 5. above).

    `buffer_path` (class attribute, set by the test before the backend is
    built) makes the buffer a kvferry buffer file."""

    buffer_path = None

    def __init__(self):
        self.cpu_allocator = None
        self.gpu_allocator = None

    def init_cpu_memory_allocator(self, size, shapes, dtypes, fmt, *_a, **_k):
        from lmcache.utils import get_size_bytes

        chunk = get_size_bytes(shapes, dtypes)
        buf = Buffer(chunk, size // chunk, self.buffer_path)
        self.cpu_allocator = _SlotAllocator(buf, chunk)

    def allocate(self, shapes, dtypes, fmt=None, allocator_type="cpu", **_k):
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata

        a = self.cpu_allocator
        with a.lock:
            if not a.free_blocks:
                return None
            index = a.free_blocks.pop(0)
            meta = MemoryObjMetadata(
                shape=shapes,
                dtype=dtypes,
                address=index,
                phy_size=a.buffer.chunk_bytes,
                ref_count=1,
                fmt=fmt if fmt is not None else MemoryFormat.KV_2LTD,
            )
        return StandInMemoryObj(a, meta)

    def batched_allocate(self, shapes, dtypes, batch_size, fmt=None, allocator_type="cpu", **_k):
        return [self.allocate(shapes, dtypes, fmt, allocator_type) for _ in range(batch_size)]


# ---------------------------------------------------------- 6. NIXL channel
class StandInChannel:
    """Replaces the NIXL transfer channel (see 6. above)."""

    # Set by the test: receiver buffer files by receiver id, and a hook
    # called before each write (to hold a transfer mid-request).
    receiver_files = {}
    before_write = None
    writes = []

    def __init__(self, *_a, **_k):
        self._maps = {}

    async def async_lazy_init_peer_connection(self, local_id, peer_id, peer_init_url, **_k):
        return None

    async def async_batched_write(self, objects, transfer_spec, **_k):
        hook = StandInChannel.before_write
        if hook is not None:
            await hook(objects, transfer_spec)
        rid = transfer_spec["receiver_id"]
        remote = list(transfer_spec["remote_indexes"])
        StandInChannel.writes.append((rid, remote))
        target = StandInChannel.receiver_files.get(rid)
        if target is not None:
            path, chunk_bytes, capacity = target
            buf = self._maps.get(path) or Buffer(chunk_bytes, capacity, path)
            self._maps[path] = buf
            for obj, slot in zip(objects, remote, strict=True):
                data = obj.bytes()
                buf.slot(slot)[: len(data)] = data

    def close(self):
        pass


def create_transfer_channel(*args, **kwargs):
    return StandInChannel(*args, **kwargs)
