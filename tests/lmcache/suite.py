#!/usr/bin/env python3
"""LMCache's own PD code as kvferry's peer (issue 12).

LMCache 0.5.6's real `PDBackendAsync` (sender and receiver coroutines,
`ReservationManager`, msgspec message classes), with only torch, the memory
allocator and the NIXL channel replaced (standins.py lists and justifies
each), against kvferry's binaries over ZMQ on loopback:

- LMCache's sender -> `kvferry receiver`, ProxyNotif to `kvferry proxy`;
- `kvferry sender` -> LMCache's receiver, ProxyNotif decoded with LMCache's
  own `ProxyNotif` class;
- a raw DEALER speaking LMCache's message classes -> `kvferry receiver`,
  every reply decoded strictly with LMCache's `PDMsg` and checked as
  LMCache's sender checks it;
- a Python prefill worker (clients/python/kvferry_attach.py) attached to
  `kvferry sender --attach` -> LMCache's receiver, which allocates its
  memory objects from the worker's fmt, shape, dtype and last chunk's
  token count.

Usage: suite.py KVFERRY_BINARY [SCENARIO ...]. Prints one line per scenario
and `N passed, M failed`; exits 1 on any failure. Run through run.sh (it
builds the cached venv).
"""

import asyncio
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import standins  # noqa: E402

pd = standins.install()
pd.PagedCpuGpuMemoryAllocator = standins.StandInPagedAllocator
pd.CreateTransferChannel = standins.create_transfer_channel

import msgspec  # noqa: E402
import torch  # noqa: E402  (the stand-in)
import zmq  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

BIN = None
WAIT = 20.0  # the longest any single wait may take
# One chunk: KV_2LTD (layers, 2, tokens, hidden) = (1, 2, 16, 64) bfloat16.
TOKENS = 16
KV_SHAPE = (1, 2, TOKENS, 64)
CHUNK = 1 * 2 * TOKENS * 64 * 2  # 4096 bytes
META = LMCacheMetadata(
    model_name="m",
    world_size=1,
    local_world_size=1,
    worker_id=0,
    local_worker_id=0,
    kv_dtype=torch.bfloat16,
    kv_shape=KV_SHAPE,
)


class Fail(Exception):
    pass


# ProxyFailed(req_id="r1", code="cancelled") as kvferry encodes it.
PROXY_FAILED_HEX = "83a474797065ab50726f78794661696c6564a67265715f6964a27231a4636f6465a963616e63656c6c6564"

def check(cond, what):
    if not cond:
        raise Fail(what)


def wait_until(what, cond, limit=WAIT):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.01)
    raise Fail(f"hung: {what} (after {limit:.0f} s)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ processes
class Proc:
    """A kvferry process whose stdout lines are collected by a thread."""

    def __init__(self, args, announce):
        self.p = subprocess.Popen(
            [BIN] + args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = queue.Queue()
        self.out = []
        threading.Thread(target=self._read, daemon=True).start()
        line = self.next_line(f"{args[0]} announcing itself")
        check(line.startswith(announce), f"announcement {line!r}")
        self.endpoint = line.split()[-1]

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, what, limit=WAIT):
        try:
            line = self.lines.get(timeout=limit)
        except queue.Empty:
            raise Fail(f"hung: no output line from kvferry while waiting for {what}")
        if line is None:
            raise Fail(f"kvferry exited while waiting for {what}: {self.p.stderr.read()}")
        self.out.append(line)
        return line

    def stop(self):
        """SIGTERM, then the rest of stdout (bounded). Once."""
        if getattr(self, "_rest", None) is not None:
            return self._rest
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise Fail("hung: kvferry did not exit on SIGTERM")
        rest = []
        while True:
            try:
                line = self.lines.get(timeout=WAIT)
            except queue.Empty:
                raise Fail("hung: kvferry's stdout stayed open after it exited")
            if line is None:
                self._rest = rest
                return rest
            rest.append(line)


class Receiver(Proc):
    """`kvferry receiver` with a metrics endpoint; `extra` adds flags."""

    def __init__(self, capacity=8, extra=()):
        self.metrics_port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvferry-lmc-")
        self.shm = os.path.join(self.dir, "buf")
        super().__init__(
            [
                "receiver",
                "--listen",
                "tcp://127.0.0.1:0",
                "--capacity-chunks",
                str(capacity),
                "--chunk-bytes",
                str(CHUNK),
                "--metrics",
                f"127.0.0.1:{self.metrics_port}",
                "--shm-path",
                self.shm,
                *extra,
            ],
            "kvferry receiver listening on ",
        )
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def metric(self, name):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            body = r.read().decode()
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0


class Proxy(Proc):
    """`kvferry proxy --expect 1 --verbose`: prints `ready REQ` per request."""

    def __init__(self):
        super().__init__(
            ["proxy", "--listen", "tcp://127.0.0.1:0", "--expect", "1", "--verbose", "--json"],
            "kvferry proxy listening on ",
        )
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.ready = []

    def wait_ready(self, req_id):
        while req_id not in self.ready:
            line = self.next_line(f"the ProxyNotif of {req_id}")
            if line.startswith("ready "):
                self.ready.append(line.split()[1])

    def report(self):
        rest = self.stop()
        return json.loads("\n".join(l for l in rest if not l.startswith("ready ")))


# ------------------------------------------------------- LMCache backends
def lmcache_config(role, **kw):
    d = dict(
        chunk_size=TOKENS,
        pd_role=role,
        pd_buffer_size=CHUNK * 16,
        pd_buffer_device="cpu",
        transfer_channel="nixl",
        pd_proxy_host="127.0.0.1",
        pd_proxy_port=free_port(),
        pd_allocation_timeout_sec=5.0,
    )
    d.update(kw)
    return LMCacheEngineConfig.from_dict(d)


class Logs(logging.Handler):
    """Captures the PD module's log records (LMCache's loggers do not propagate)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []
        self.logger = logging.getLogger(pd.__name__)
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)

    def emit(self, record):
        self.records.append(record.getMessage())

    def any(self, text):
        return [r for r in self.records if text in r]

    def close(self):
        self.logger.removeHandler(self)


def abandon(backend):
    """Stops using a backend without `close()`: LMCache 0.5.6's close()
    never closes the sender's ProxyNotif PUSH socket and then blocks for
    ever in `Context.term()`. Its loops are daemon threads; the suite ends
    with `os._exit`."""
    backend.running = False


class LmcSender:
    """LMCache's real sender, aimed at one receiver, ProxyNotif to `proxy_port`."""

    def __init__(self, proxy_port, receiver_port):
        self.backend = pd.PDBackendAsync(lmcache_config("sender", pd_proxy_port=proxy_port), META)
        self.receiver_port = receiver_port
        self.completed_keys = []

    def key(self, name):
        return CacheEngineKey("m", 1, 0, abs(hash(name)) % (1 << 60), torch.bfloat16)

    def store(self, req_id, names, total, last, short_last=None):
        """One batch: chunk per name (the last one `short_last` tokens)."""
        keys = [self.key(n) for n in names]
        objs = []
        for i, n in enumerate(names):
            toks = short_last if (short_last and i == len(names) - 1) else TOKENS
            o = self.backend.allocate(torch.Size([1, 2, toks, 64]), torch.bfloat16)
            check(o is not None, "sender staging allocation")
            data = o.bytes()
            data[:] = (n.encode() * CHUNK)[:CHUNK]
            objs.append(o)
        spec = types.SimpleNamespace(
            req_id=req_id,
            is_last_prefill=last,
            total_chunks=total,
            receiver_host="127.0.0.1",
            receiver_init_port=[self.receiver_port],
            receiver_alloc_port=[self.receiver_port],
        )
        self.backend.batched_submit_put_task(
            keys, objs, transfer_spec=spec, on_complete_callback=self.completed_keys.append
        )
        # The staging ref LMCache's caller would drop after submitting.
        for o in objs:
            o.ref_count_down()

    def idle(self, req_id):
        return req_id not in self.backend._req_total_chunks

    def close(self):
        abandon(self.backend)


def lmcache_scenario(capacity=8, receiver_flags=()):
    """Decorator arguments: a kvferry receiver, a kvferry proxy, LMCache logs."""

    def wrap(f):
        def run():
            standins.StandInChannel.writes = []
            standins.StandInChannel.before_write = None
            rx = Receiver(capacity, receiver_flags)
            px = Proxy()
            logs = Logs()
            try:
                f(rx, px, logs)
                check(not logs.any("inconsistency"), f"LMCache refused a reply: {logs.any('inconsistency')}")
            finally:
                logs.close()
                for p in (rx, px):
                    try:
                        p.stop()
                    except Exception:
                        pass

        run.__name__ = f.__name__
        return run

    return wrap


# ------------------------------------- LMCache's sender vs kvferry receiver
@lmcache_scenario()
def lmcache_sender_single_batch(rx, px, logs):
    s = LmcSender(px.port, rx.port)
    try:
        s.store("single", ["a", "b", "c"], 3, True)
        px.wait_ready("single")
        wait_until("sender idle", lambda: s.idle("single"))
        check(len(s.completed_keys) == 3, f"3 keys completed: {s.completed_keys}")
        check(rx.metric('kvferry_receiver_requests_total{outcome="completed"}') == 1, "completed at kvferry")
        check(standins.StandInChannel.writes[0][1] == sorted(set(standins.StandInChannel.writes[0][1])), "distinct slots")
    finally:
        s.close()
    check(px.report()["notifications"] == 1, "one ProxyNotif")


@lmcache_scenario()
def lmcache_sender_chunked_short_last_chunk(rx, px, logs):
    s = LmcSender(px.port, rx.port)
    try:
        s.store("chunked", ["c0", "c1", "c2"], 7, False)
        s.store("chunked", ["c3", "c4", "c5"], 7, False)
        s.store("chunked", ["c6"], 7, True, short_last=5)
        px.wait_ready("chunked")
        writes = [w for _, w in standins.StandInChannel.writes]
        check(sorted(len(w) for w in writes) == [1, 3, 3], f"three batches written: {writes}")
        slots = [x for w in writes for x in w]
        check(len(set(slots)) == 7 and all(0 <= x < 8 for x in slots), f"7 distinct slots: {slots}")
        check(rx.metric('kvferry_receiver_requests_total{outcome="completed"}') == 1, "completed")
    finally:
        s.close()


@lmcache_scenario()
def lmcache_sender_too_large(rx, px, logs):
    s = LmcSender(px.port, rx.port)
    try:
        t0 = time.monotonic()
        s.store("huge", ["h0", "h1"], 9, False)
        wait_until("the refusal", lambda: logs.any("Receiver allocation failed"))
        check(time.monotonic() - t0 < 5, "refused at once, not after a timeout")
        check(rx.metric('kvferry_receiver_errors_total{code="buffer_too_small"}') == 1, "buffer_too_small")
        check(rx.metric("kvferry_receiver_allocated_chunks") == 0, "nothing held")
        check(not standins.StandInChannel.writes, "nothing written")
        wait_until("sender idle", lambda: s.idle("huge"))
    finally:
        s.close()
    check(px.report()["notifications"] == 0, "no ProxyNotif")


@lmcache_scenario(receiver_flags=("--consume", "--consume-grace-ms", "300", "--admission-timeout-ms", "5000"))
def lmcache_senders_two_requests_that_do_not_both_fit(rx, px, logs):
    a, b = LmcSender(px.port, rx.port), LmcSender(px.port, rx.port)
    try:
        a.store("fit-a", [f"a{i}" for i in range(6)], 6, True)
        px.wait_ready("fit-a")
        b.store("fit-b", [f"b{i}" for i in range(6)], 6, True)
        wait_until("fit-b parked", lambda: rx.metric('kvferry_receiver_requests_total{outcome="parked"}') == 1)
        px.wait_ready("fit-b")
        check(rx.metric('kvferry_receiver_requests_total{outcome="completed"}') == 2, "both completed")
        check(rx.metric('kvferry_receiver_requests_total{outcome="admission_timeout"}') == 0, "no timeout")
        wait_until("everything consumed", lambda: rx.metric("kvferry_receiver_allocated_chunks") == 0)
    finally:
        a.close()
        b.close()


LONG_RUN_REQUESTS = 100  # per sender


@lmcache_scenario(receiver_flags=("--consume", "--consume-grace-ms", "100", "--admission-timeout-ms", "10000"))
def lmcache_senders_long_consume_run(rx, px, logs):
    """Issue 12's load test: two LMCache senders, 200 requests of 1 to 6
    chunks in one or two batches, against 8 slots with --consume. LMCache
    senders send no TransferDone; each request's chunks go the grace after
    its last reply, so the run never stalls on capacity: every request
    completes, none ends admission_timeout."""
    senders = [LmcSender(px.port, rx.port) for _ in range(2)]
    errors = []

    def drive(n, s):
        try:
            for i in range(LONG_RUN_REQUESTS):
                req = f"long-{n}-{i}"
                total = 1 + (i * 7 + n) % 6
                names = [f"{req}-{k}" for k in range(total)]
                if total > 1 and i % 2:
                    s.store(req, names[: total // 2], total, False)
                    s.store(req, names[total // 2 :], total, True)
                else:
                    s.store(req, names, total, True)
                # At most two requests in flight per sender (its staging).
                if i >= 2:
                    prev = f"long-{n}-{i - 2}"
                    wait_until(f"{prev} idle at its sender", lambda p=prev: s.idle(p), limit=60)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(n, s), daemon=True) for n, s in enumerate(senders)]
    try:
        for t in threads:
            t.start()
        for n in range(2):
            for i in range(LONG_RUN_REQUESTS):
                px.wait_ready(f"long-{n}-{i}")
                check(not errors, f"a sender failed: {errors}")
        for t in threads:
            t.join(WAIT)
        check(not errors, f"a sender failed: {errors}")
        done = rx.metric('kvferry_receiver_requests_total{outcome="completed"}')
        check(done == 2 * LONG_RUN_REQUESTS, f"every request completed: {done}")
        check(rx.metric('kvferry_receiver_requests_total{outcome="admission_timeout"}') == 0, "no admission timeout")
        check(rx.metric('kvferry_receiver_requests_total{outcome="parked"}') > 0, "capacity was tight (requests parked)")
        check(not logs.any("Receiver allocation failed"), "no LMCache request failed")
        wait_until("everything consumed", lambda: rx.metric("kvferry_receiver_allocated_chunks") == 0)
    finally:
        for s in senders:
            s.close()


@lmcache_scenario(receiver_flags=("--quarantine-ms", "500"))
def lmcache_sender_cancel_mid_request(rx, px, logs):
    s = LmcSender(px.port, rx.port)
    try:
        s.store("cancel", ["x0", "x1", "x2"], 6, False)
        wait_until("first batch written", lambda: standins.StandInChannel.writes)
        wait_until("first batch accounted", lambda: s.backend._sent_keys.get("cancel"))
        s.backend.cancel_request("cancel")
        wait_until("cancelled at kvferry", lambda: rx.metric('kvferry_receiver_requests_total{outcome="cancelled"}') == 1)
        # An LMCache cancel is no fence: the granted slots stay quarantined
        # until --quarantine-ms, then the capacity is back.
        check(rx.metric("kvferry_receiver_quarantined_slots") == 3, "3 slots quarantined")
        wait_until("quarantine over", lambda: rx.metric("kvferry_receiver_allocated_chunks") == 0)
        s.store("after", [f"y{i}" for i in range(8)], 8, True)
        px.wait_ready("after")
    finally:
        s.close()
    check(px.report()["requests_ready"] == 1, "no ProxyNotif for the cancelled request")


@lmcache_scenario()
def lmcache_sender_total_chunks_zero(rx, px, logs):
    s = LmcSender(px.port, rx.port)
    try:
        s.store("zero", ["z0"], 0, True)
        wait_until("the refusal", lambda: rx.metric('kvferry_receiver_errors_total{code="zero_total_chunks"}') == 1)
        wait_until("LMCache saw the failure", lambda: logs.any("Receiver allocation failed"))
        check(rx.metric("kvferry_receiver_allocated_chunks") == 0, "nothing held")
    finally:
        s.close()


@lmcache_scenario()
def lmcache_sender_dedup_shared_prefix(rx, px, logs):
    s = LmcSender(px.port, rx.port)
    try:
        s.store("prefix-1", ["sys0", "sys1", "u1"], 3, True)
        px.wait_ready("prefix-1")
        s.store("prefix-2", ["sys0", "sys1", "u2"], 3, True)
        px.wait_ready("prefix-2")
        writes = [w for _, w in standins.StandInChannel.writes]
        check([len(w) for w in writes] == [3, 1], f"the second request writes only u2: {writes}")
        check(writes[1][0] not in writes[0], "u2 gets a slot of its own")
        check(rx.metric("kvferry_receiver_allocated_chunks") == 4, "sys0 and sys1 stored once")
        check(len(s.completed_keys) == 6, "every key of both requests completed")
    finally:
        s.close()
    r = px.report()
    check(r["notifications"] == 2 and r["requests_ready"] == 2, f"ProxyNotif once each: {r}")


@lmcache_scenario()
def lmcache_sender_anonymous_batch(rx, px, logs):
    s = LmcSender(px.port, rx.port)
    try:
        s.store("", ["n0", "n1"], 0, True)
        wait_until("anonymous batch written", lambda: len(s.completed_keys) == 2)
        check(rx.metric("kvferry_receiver_allocated_chunks") == 2, "2 slots")
        check(rx.metric("kvferry_receiver_tracked_requests") == 0, "not tracked")
    finally:
        s.close()
    check(px.report()["notifications"] == 0, "an anonymous batch sends no ProxyNotif")


# ------------------------------------------------------ strict decoding
def lmcache_consistency(n_keys, resp):
    """LMCache 0.5.6 sender's checks (`_async_transfer_task`), restated."""
    already = set(resp.already_sent_indexes)
    if already and (min(already) < 0 or max(already) >= n_keys):
        return "invalid already_sent_indexes"
    if len(resp.remote_indexes) != n_keys - len(already):
        return "inconsistency"
    return None


def strict_decoding_of_every_reply():
    rx = Receiver(4)
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.IDENTITY, b"lmcache-strict")
    d.connect(rx.endpoint)

    def call(payload, n_keys, what, expect_fail):
        d.send_multipart([b"", payload])
        check(d.poll(int(WAIT * 1000)), f"hung: no reply to {what}")
        frames = d.recv_multipart()
        # LMCache's exact decode: strict msgspec, tagged union of its classes.
        msg = msgspec.msgpack.decode(frames[-1], type=pd.PDMsg)
        check(isinstance(msg, pd.AllocResponse), f"{what}: {type(msg).__name__}")
        failed = any(i == -1 for i in msg.remote_indexes)
        check(failed == expect_fail, f"{what}: failure={failed}: {msg}")
        verdict = lmcache_consistency(n_keys, msg)
        # The one allowed exception: a failure reply to an empty batch is
        # [-1] (PROTOCOL.md, and LMCache's own receiver), which LMCache's
        # sender treats as an abort either way.
        check(verdict is None or (n_keys == 0 and failed), f"{what}: LMCache check: {verdict}: {msg}")
        return msg

    def req(keys, **kw):
        base = dict(keys=keys, fmt=1, shape=list(KV_SHAPE), dtype="bfloat16", last_chunk_toks=TOKENS)
        base.update(kw)
        return msgspec.msgpack.encode(pd.AllocRequest(**base))

    k = lambda n: CacheEngineKey("m", 1, 0, n, torch.bfloat16).to_string()  # noqa: E731
    try:
        call(req([k(1), k(2)], req_id="s1", total_chunks=3), 2, "first batch", False)
        call(req([], req_id="s1", total_chunks=3, is_last_batch=True), 0, "empty last batch", False)
        m = call(req([k(2), k(3)], req_id="s2", total_chunks=2, is_last_batch=True), 2, "dedup", False)
        check(m.already_sent_indexes == [0] and len(m.remote_indexes) == 1, f"dedup shape {m}")
        call(req([k(4)], req_id="big", total_chunks=5), 1, "too large", True)
        call(req([k(5)], req_id="zero", total_chunks=0), 1, "total_chunks 0", True)
        call(req([k(6)], req_id="wide", total_chunks=1, shape=[1, 2, 64, 64]), 1, "chunk too large", True)
        call(req([], req_id="zero-empty", total_chunks=0, is_last_batch=True), 0, "failure to an empty batch", True)
        call(b"\x93\x01\x02", 1, "a frame that does not decode", True)
        call(req([k(7), k(2)], req_id=""), 2, "anonymous with a held key", False)
        m = call(msgspec.msgpack.encode(pd.CancelNotif(req_id="s1", keys=[k(1)])), 0, "CancelNotif", False)
        check(m.remote_indexes == [], f"cancel reply {m}")
    finally:
        d.close()
        rx.stop()


# -------------------------------- kvferry's sender vs LMCache's receiver
def lmcache_receiver_on_buffer(prefix, capacity):
    """LMCache's real receiver allocating from a kvferry buffer file of
    `capacity` chunks (so kvferry's sender can write it by `--static-buffer`),
    and a PULL socket bound where a sender's `--proxy` sends ProxyNotif.
    Returns (work dir, buffer path, receiver endpoint, proxy port, pull, r)."""
    work = tempfile.mkdtemp(prefix=prefix)
    buf = os.path.join(work, "lmcache.buf")
    standins.create_kvferry_buffer(buf, CHUNK, capacity)
    standins.StandInPagedAllocator.buffer_path = buf
    port, proxy_port = free_port(), free_port()
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(f"tcp://127.0.0.1:{proxy_port}")
    r = pd.PDBackendAsync(
        lmcache_config(
            "receiver",
            pd_buffer_size=CHUNK * capacity,
            pd_peer_host="127.0.0.1",
            pd_peer_init_port=[port],
            pd_peer_alloc_port=[port],
        ),
        META,
    )
    standins.StandInPagedAllocator.buffer_path = None
    return work, buf, f"tcp://127.0.0.1:{port}", proxy_port, pull, r


def kvferry_sender_vs_lmcache_receiver():
    standins.StandInChannel.writes = []
    capacity = 8
    logs = Logs()
    work, buf, ep, proxy_port, pull, r = lmcache_receiver_on_buffer("kvferry-lmc-rx-", capacity)
    load = ["--chunk-bytes", str(CHUNK), "--capacity-chunks", str(capacity), "--batch", "2", "--json", "--quiet"]

    def kvferry_sender(*extra, requests=6):
        args = [BIN, "sender", "--connect", ep, "--proxy", f"tcp://127.0.0.1:{proxy_port}"]
        args += ["--requests", str(requests), "--chunks", "1..4", *load, *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=120)

    try:
        # No static buffer: refused, saying what is missing.
        out = kvferry_sender(requests=1)
        check(out.returncode != 0, "without --static-buffer the run fails")
        check("--static-buffer" in out.stdout + out.stderr, f"the message names the option: {out.stdout}{out.stderr}")
        check(logs.any("Failed to process alloc request"), "LMCache's receiver answered Hello with an error")
        # kvferry's keys are not CacheEngineKey strings: LMCache refuses them.
        out = kvferry_sender(f"--static-buffer={ep}={buf}", requests=1)
        check(out.returncode != 0, "kvferry-format keys are refused by LMCache's receiver")
        # CacheEngineKey strings and the buffer file: the run completes.
        out = kvferry_sender(f"--static-buffer={ep}={buf}", "--key-format", "lmcache")
        rep = json.loads(out.stdout or "{}")
        check(out.returncode == 0 and rep.get("completed") == 6, f"6 requests complete: {out.stdout}{out.stderr}")
        got = {}
        while pull.poll(200):
            n = msgspec.msgpack.decode(pull.recv(), type=pd.PDMsg)
            check(isinstance(n, pd.ProxyNotif), f"ProxyNotif decodes with LMCache's class: {n}")
            got[n.req_id] = got.get(n.req_id, 0) + 1
        check(len(got) == 6 and all(v == 1 for v in got.values()), f"ProxyNotif once each: {got}")
        # Every key LMCache's receiver holds names a slot kvferry wrote: the
        # runner's payload header is (request number, chunk index).
        held = 0
        bm = standins.Buffer(CHUNK, capacity, buf)
        with r.data_lock:
            for key, obj in r.data.items():
                idx = int(key.chunk_hash_hex, 16)
                header = bytes(bm.slot(obj.meta.address)[:16])
                check(int.from_bytes(header[8:16], "little") == idx, f"slot {obj.meta.address} holds chunk {idx}")
                held += 1
        check(held > 0, "LMCache's receiver holds the chunks")
    finally:
        logs.close()
        pull.close()
        abandon(r)


def attached_worker_vs_lmcache_receiver():
    """What an attached worker sets reaches LMCache's receiver as an
    in-process caller's would: LMCache allocates each memory object from
    the AllocRequest's fmt, shape and dtype, and the last chunk's from
    last_chunk_toks on the format's token axis (`MemoryFormat.token_dim`).
    Checked on what it allocated (shape, dtype, fmt of each object) and on
    the bytes the worker wrote in place. The worker attached to `kvferry
    sender --attach`."""
    worker_vs_lmcache_receiver(node=False)


def node_worker_vs_lmcache_receiver():
    """The same through `kvferry node` (`--static-buffer`, LMCache's
    receiver as the node's receiver 1)."""
    worker_vs_lmcache_receiver(node=True)


def declared_worker_vs_lmcache_receiver():
    """The same with the worker's batch declared at its begin
    (`begin_declared`): the admission AllocRequest carries the keys, the
    geometry and the last chunk's tokens, and LMCache's receiver allocates
    the same memory objects from it as from a batch's own AllocRequest."""
    worker_vs_lmcache_receiver(node=False, declared=True)


def worker_vs_lmcache_receiver(node, declared=False):
    sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
    import kvferry_attach
    from lmcache.v1.memory_management import MemoryFormat

    capacity = 8
    work, buf, ep, proxy_port, pull, r = lmcache_receiver_on_buffer("kvferry-lmc-att-", capacity)
    sock = os.path.join(work, "send.sock")
    common = ["--connect", ep, "--proxy", f"tcp://127.0.0.1:{proxy_port}",
              f"--static-buffer={ep}={buf}", "--chunk-bytes", str(CHUNK), "--staging-slots", "8",
              "--attach-shares", "1"]
    if node:
        # Receiver 0 is the node's own; LMCache's is the first --connect.
        sender = Proc(
            ["node", "--listen", "tcp://127.0.0.1:0", "--capacity-chunks", str(capacity),
             "--attach", os.path.join(work, "decoders.sock"), "--prefill-attach", sock,
             "--shm-path", os.path.join(work, "node.buf")] + common,
            "kvferry node listening on ",
        )
        while not sender.next_line("the prefill attach line").startswith(
                "kvferry node prefill attach on "):
            pass
        receiver = 1
    else:
        sender = Proc(["sender"] + common + ["--attach", sock], "kvferry sender attach on ")
        receiver = 0
    c = None
    try:
        c = kvferry_attach.PrefillClient(sock)
        fmt = MemoryFormat.KV_2LTD
        last_toks = 5
        short = CHUNK // TOKENS * last_toks  # the last chunk: 5 of 16 tokens
        lens = [CHUNK, CHUNK, short]
        hashes = [0xA770 + i for i in range(3)]
        keys = [CacheEngineKey("m", 1, 0, h, torch.bfloat16).to_string() for h in hashes]
        geometry = dict(fmt=fmt.value, shape=KV_SHAPE, dtype="bfloat16")
        if declared:
            tag, batch = c.begin_declared("att-1", receiver, 3, keys, lens,
                                          last_chunk_toks=last_toks, **geometry)
        else:
            tag = c.begin("att-1", receiver, 3, **geometry)
            batch = c.stage(tag, 3)
        ev = c.next_event(timeout=WAIT)
        check(ev[0] == "staged" and len(ev[3]) == 3, f"STAGED of 3: {ev}")
        for i, slot in enumerate(ev[3]):
            c.slot(slot)[: lens[i]] = bytes([0x40 + i]) * lens[i]
        if declared:
            c.submit_declared(tag, batch)
        else:
            c.submit(tag, batch, keys, lens, last_chunk_toks=last_toks)
        ev = c.next_event(timeout=WAIT)
        check(ev == ("done", tag), f"DONE: {ev}")
        check(pull.poll(int(WAIT * 1000)), "hung: no ProxyNotif")
        n = msgspec.msgpack.decode(pull.recv(), type=pd.PDMsg)
        check(isinstance(n, pd.ProxyNotif) and n.req_id == "att-1", f"ProxyNotif: {n}")
        bm = standins.Buffer(CHUNK, capacity, buf)
        with r.data_lock:
            objs = {int(k.chunk_hash_hex, 16): o for k, o in r.data.items()}
        check(sorted(objs) == hashes, f"LMCache holds the 3 keys: {sorted(objs)}")
        for i, h in enumerate(hashes):
            m = objs[h].meta
            want = list(KV_SHAPE)
            if i == 2:
                want[fmt.token_dim()] = last_toks
            check(list(m.shape) == want, f"chunk {i} allocated as {list(m.shape)}, expected {want}")
            check(m.dtype == torch.bfloat16, f"chunk {i} dtype {m.dtype}")
            check(m.fmt == fmt, f"chunk {i} fmt {m.fmt}")
            data = bytes(bm.slot(m.address)[: lens[i]])
            check(data == bytes([0x40 + i]) * lens[i], f"chunk {i}'s bytes in slot {m.address}")
    finally:
        if c is not None:
            c.close()
        sender.stop()
        pull.close()
        abandon(r)


def proxy_failed_vs_lmcache_proxy_decoders():
    """kvferry's ProxyFailed (golden frame of docs/protocol.md, checked byte
    for byte by tests/proxy_failure.rs) against the decoders LMCache-style
    proxies use: LMCache's tagged classes refuse the unknown tag with a
    ValidationError (a per-message try/except skips it: such a proxy waits
    for its timeout, as before); an untagged `req_id` struct or a plain map
    (the production-stack router's fallback) reads the req_id and stops
    waiting. A ProxyNotif after it still decodes."""
    frame = bytes.fromhex(PROXY_FAILED_HEX)
    for t in (pd.ProxyNotif, pd.PDMsg):
        try:
            msgspec.msgpack.decode(frame, type=t)
        except msgspec.ValidationError as e:
            check("ProxyFailed" in str(e), f"the refusal names the tag: {e}")
        else:
            raise Fail(f"{t} accepted ProxyFailed as a ready notification")

    class ReqOnly(msgspec.Struct):
        req_id: str

    check(msgspec.msgpack.decode(frame, type=ReqOnly).req_id == "r1", "an untagged req_id struct reads it")
    m = msgspec.msgpack.decode(frame)
    check(m.get("req_id") == "r1" and m.get("code") == "cancelled", f"a plain map reads it: {m}")
    n = msgspec.msgpack.decode(msgspec.msgpack.encode(pd.ProxyNotif(req_id="r2")), type=pd.PDMsg)
    check(isinstance(n, pd.ProxyNotif) and n.req_id == "r2", "ProxyNotif still decodes")


# ------------------------------------------------------------------ main
SCENARIOS = [
    lmcache_sender_single_batch,
    lmcache_sender_chunked_short_last_chunk,
    lmcache_sender_too_large,
    lmcache_senders_two_requests_that_do_not_both_fit,
    lmcache_senders_long_consume_run,
    lmcache_sender_cancel_mid_request,
    lmcache_sender_total_chunks_zero,
    lmcache_sender_dedup_shared_prefix,
    lmcache_sender_anonymous_batch,
    strict_decoding_of_every_reply,
    kvferry_sender_vs_lmcache_receiver,
    attached_worker_vs_lmcache_receiver,
    node_worker_vs_lmcache_receiver,
    declared_worker_vs_lmcache_receiver,
    proxy_failed_vs_lmcache_proxy_decoders,
]


def main(argv):
    global BIN
    if len(argv) < 2:
        print("usage: suite.py KVFERRY_BINARY [SCENARIO ...]", file=sys.stderr)
        return 2
    BIN = argv[1]
    wanted = set(argv[2:])
    passed = failed = 0
    for sc in SCENARIOS:
        if wanted and sc.__name__ not in wanted:
            continue
        t0 = time.monotonic()
        try:
            sc()
            passed += 1
            print(f"PASS {sc.__name__} ({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception as e:
            failed += 1
            detail = str(e) if isinstance(e, Fail) else traceback.format_exc()
            print(f"FAIL {sc.__name__} ({time.monotonic() - t0:.1f} s): {detail}", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    # LMCache's backends leave daemon loops behind: leave without joining.
    os._exit(code)
