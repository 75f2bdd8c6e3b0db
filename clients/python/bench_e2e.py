"""End-to-end attach benchmark roles (driven by benches/attach.rs, which
starts `kvferry receiver --attach` and `kvferry sender --attach`, runs one
decoder and one prefill process of this script, and prints the ratio to a
single-thread memcpy of the same bytes measured in the same run).

usage: bench_e2e.py decoder SOCKET PREFIX REQUESTS CHUNKS MODE
       bench_e2e.py prefill SOCKET PREFIX REQUESTS CHUNKS MODE WINDOW

Requests PREFIX-0 .. PREFIX-(REQUESTS-1), CHUNKS full chunks each. The
prefill worker keeps WINDOW requests in flight (begin_declared with the
request's keys, fill in place, submit_declared; with
KVFERRY_ATTACH_E2E_UNDECLARED=1 begin + stage, fill, submit with keys);
the decoder keeps a window of subscriptions ahead, reads
every delivered chunk in place and releases it.

MODE "stamp": the worker writes an 8-byte stamp (request, chunk) at both
ends of each slot and the decoder checks both; the bytes in between move
only in the daemon's transport (the issue's "data moves once": a GPU would
fill and read the slots by DMA). MODE "full": the worker copies a whole
chunk into each slot from Python (memoryview slice assignment: a memcpy)
and the decoder copies each chunk out into a buffer of its own (another
memcpy), so the bytes move three times.

Each role prints one line "E2E:<role> <t_start> <t_end> <bytes>" with
CLOCK_MONOTONIC seconds (system-wide, so the driver can combine them).

With KVFERRY_E2E_TRACE=PATH each role also writes PATH.<role>: one line per
request with its index and the CLOCK_MONOTONIC seconds of each stage
(prefill: BEGIN+STAGE pushed, STAGED popped, SUBMIT pushed, DONE popped;
decoder: READY popped, RELEASE pushed), then "wait <s>": the seconds the
role spent in next_event (the rest is Python work). docs/benchmarks.md has
the breakdown these give.
"""

import os
import struct
import sys
import time

import kvferry_attach

STAMP = struct.Struct("<Q")


def stamp_of(i, k):
    """The stamp of chunk k of request i (an integer; STAMP packs it)."""
    return (i << 20) | k


TRACE = os.environ.get("KVFERRY_E2E_TRACE")
# With KVFERRY_ATTACH_E2E_UNDECLARED=1 the worker begins, stages and
# submits with keys (two AllocRequest round trips per request) instead of
# declaring each request's one batch at its begin (one).
PLAIN = os.environ.get("KVFERRY_ATTACH_E2E_UNDECLARED") == "1"


def write_trace(role, stages, waited):
    if not TRACE:
        return
    with open("%s.%s" % (TRACE, role), "w") as f:
        for i in sorted(stages):
            f.write("%d %s\n" % (i, " ".join("%.9f" % t for t in stages[i])))
        f.write("wait %.9f\n" % waited)


def decoder(sock, prefix, requests, chunks, mode):
    c = kvferry_attach.DecoderClient(sock)
    window = min(c.max_outstanding, requests, 32)
    sink = bytearray(c.chunk_bytes)
    view, base, cb, unpack = c.view, c.data_offset, c.chunk_bytes, STAMP.unpack_from
    nxt = 0
    for _ in range(window):
        c.subscribe("%s-%d" % (prefix, nxt))
        nxt += 1
    print("E2E:subscribed", flush=True)
    done, moved, t0 = 0, 0, None
    stages, waited = {}, 0.0
    while done < requests:
        tw = time.monotonic()
        ev = c.next_event(timeout=60.0)
        now = time.monotonic()
        waited += now - tw
        if ev[0] != "ready":
            sys.exit("decoder: expected READY, got %r" % (ev,))
        if t0 is None:
            t0 = time.monotonic()
        _, tag, req_id, descs = ev
        i = int(req_id.rsplit("-", 1)[1])
        if len(descs) != chunks:
            sys.exit("decoder: %s has %d chunks" % (req_id, len(descs)))
        for k, (slot, length, _tokens) in enumerate(descs):
            if length != cb:  # the worker sends full chunks only
                sys.exit("decoder: chunk %d of %s has %d bytes" % (k, req_id, length))
            # Both stamps read in place (unpack_from: no view, no copy).
            off = base + slot * cb
            want = stamp_of(i, k)
            if (unpack(view, off)[0] != want
                    or unpack(view, off + length - 8)[0] != want):
                sys.exit("decoder: chunk %d of %s has a wrong stamp" % (k, req_id))
            if mode == "full":
                sink[:] = c.chunk((slot, length, _tokens))  # the decoder's own copy
            moved += length
        c.release(tag)
        if TRACE:
            stages[i] = [now, time.monotonic()]
        done += 1
        if nxt < requests:
            c.subscribe("%s-%d" % (prefix, nxt))
            nxt += 1
    t1 = time.monotonic()
    print("E2E:decoder %.9f %.9f %d" % (t0, t1, moved), flush=True)
    write_trace("decoder", stages, waited)
    c.close()


def prefill(sock, prefix, requests, chunks, mode, window):
    c = kvferry_attach.PrefillClient(sock)
    cb = c.chunk_bytes
    view, pack_into = c.view, STAMP.pack_into
    src = bytes(range(256)) * (cb // 256)
    lens = [cb] * chunks
    inflight = {}  # tag -> request index
    issued = done = 0
    stages, waited = {}, 0.0
    t0 = time.monotonic()

    def keys_of(i):
        return ["%s-%d/%d" % (prefix, i, k) for k in range(chunks)]

    def start():
        nonlocal issued
        rid = "%s-%d" % (prefix, issued)
        if PLAIN:
            tag = c.begin(rid, 0, chunks)
            c.stage(tag, chunks)
        else:
            tag, _batch = c.begin_declared(rid, 0, chunks, keys_of(issued), lens)
        inflight[tag] = issued
        if TRACE:
            stages[issued] = [time.monotonic()]
        issued += 1

    while issued < min(window, requests):
        start()
    while done < requests:
        tw = time.monotonic()
        ev = c.next_event(timeout=60.0)
        now = time.monotonic()
        waited += now - tw
        if ev[0] == "staged":
            _, tag, batch, slots = ev
            i = inflight[tag]
            if TRACE:
                stages[i].append(now)
            for k, s in enumerate(slots):
                if mode == "full":
                    c.slot(s)[:] = src
                # Both stamps written in place (pack_into: no view, no copy).
                st = stamp_of(i, k)
                pack_into(view, s * cb, st)
                pack_into(view, s * cb + cb - 8, st)
            if PLAIN:
                c.submit(tag, batch, keys_of(i), lens)
            else:
                c.submit_declared(tag, batch)
            if TRACE:
                stages[i].append(time.monotonic())
        elif ev[0] == "done":
            i = inflight.pop(ev[1])
            if TRACE:
                stages[i].append(now)
            done += 1
            if issued < requests:
                start()
        else:
            sys.exit("prefill: unexpected event %r" % (ev,))
    t1 = time.monotonic()
    print("E2E:prefill %.9f %.9f %d" % (t0, t1, requests * chunks * cb), flush=True)
    write_trace("prefill", stages, waited)
    c.close()


def main():
    role, sock, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    requests, chunks, mode = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    if mode not in ("stamp", "full"):
        sys.exit("MODE is stamp or full")
    if role == "decoder":
        decoder(sock, prefix, requests, chunks, mode)
    elif role == "prefill":
        prefill(sock, prefix, requests, chunks, mode, int(sys.argv[7]))
    else:
        sys.exit("role is decoder or prefill")


if __name__ == "__main__":
    main()
