"""CI check: a Python prefill worker taking random steps (driven by
tests/attach_prefill.rs against `kvferry sender --attach` writing into
`kvferry receiver --attach`), with a Python decoder in the same process
checking every request that ends DONE.

usage: prefill_fuzz.py SENDER_SOCKET RECEIVER_SOCKET PREFIX REQUESTS SEED CANCELLED_CODE

Random valid steps until REQUESTS requests have ended: BEGINs of 1-6
chunks (at most 3 live; some declaring a first batch of part of the
request, begin_declared, whose slots come staged and go with
submit_declared, in any order with the request's other batches), STAGEs
of part of what a request still needs,
fills and SUBMITs of a held batch now or steps later, CANCELs at any
point of a request's life (some right behind a STAGE, so that its
STAGED crosses the CANCEL). Byte j of chunk i of request number q is
(q * 7 + i * 31 + j) & 0xff, so a slot written for another request or
chunk is caught. Every DONE request is subscribed to on the receiver,
checked byte for byte and released; every cancelled one must end FAILED
with CANCELLED_CODE, or DONE if the CANCEL crossed its end (the CANCEL is
then refused, UNKNOWN_TAG). Prints "FUZZ:ok done=D cancelled=C crossed=X
declared=B" (B: requests begun with a declared batch).
"""

import random
import sys
import time

import kvferry_attach as ka
from pattern import pattern

UNKNOWN_TAG = 6


def chunk_bytes(q, i, length):
    return pattern(q * 7 + i * 31, length)


def chunk_len(q, i, n, chunk_bytes):
    return chunk_bytes if i + 1 < n else 1 + (q * 37) % chunk_bytes


class Live:
    def __init__(self, q, n):
        self.q, self.n = q, n
        self.asked = self.written = 0
        # Index of the next chunk a plain batch carries (a declared batch
        # carries chunks 0..k).
        self.plain = 0
        self.declared = None  # (batch, k) until submitted
        self.cancelled = False


def main():
    ssock, rsock, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    requests, seed, cancelled_code = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    rng = random.Random(seed)
    w = ka.PrefillClient(ssock)
    d = ka.DecoderClient(rsock)
    cb = w.chunk_bytes
    live, held, crossed = {}, [], set()
    counts = {"done": 0, "cancelled": 0, "crossed": 0}
    q_next = 0
    declared_count = [0]
    end = time.monotonic() + 120.0

    def req_id(q):
        return "%s-%d" % (prefix, q)

    def cancel(tag):
        live[tag].cancelled = True
        w.cancel(tag)
        held[:] = [h for h in held if h[0] != tag]

    def verify(l):
        rid = req_id(l.q)
        tag = d.subscribe(rid)
        ev = d.next_event(timeout=30.0)
        if ev[0] != "ready" or ev[1] != tag:
            sys.exit("%s: expected READY, got %r" % (rid, ev))
        chunks = ev[3]
        if len(chunks) != l.n:
            sys.exit("%s: %d chunks, expected %d" % (rid, len(chunks), l.n))
        for i, desc in enumerate(chunks):
            want = chunk_bytes(l.q, i, chunk_len(l.q, i, l.n, cb))
            if bytes(d.chunk(desc)) != want:
                sys.exit("%s: chunk %d differs at the receiver" % (rid, i))
        d.release(tag)

    def on_event(ev):
        kind, tag = ev[0], ev[1]
        if kind == "staged":
            if tag not in live or live[tag].cancelled:
                sys.exit("STAGED of a request not live or cancelled: %r" % (ev,))
            held.append((tag, ev[2], ev[3]))
        elif kind == "done":
            l = live.pop(tag, None)
            if l is None or l.written != l.n:
                sys.exit("DONE of a request not live or not written: %r" % (ev,))
            verify(l)
            if l.cancelled:
                crossed.add(tag)
                counts["crossed"] += 1
            else:
                counts["done"] += 1
        elif kind == "failed":
            l = live.pop(tag, None)
            if l is None or not l.cancelled or ev[2] != cancelled_code:
                sys.exit("a request failed by itself: %r" % (ev,))
            held[:] = [h for h in held if h[0] != tag]
            counts["cancelled"] += 1
        elif kind == "refused":
            if ev[2] != UNKNOWN_TAG or tag not in crossed:
                sys.exit("a valid step refused: %r" % (ev,))
            crossed.discard(tag)
        else:
            sys.exit("unknown event %r" % (ev,))

    while sum(counts.values()) < requests or live:
        if time.monotonic() > end:
            sys.exit("requests never ended: %d live" % len(live))
        winding_down = sum(counts.values()) >= requests
        step = rng.randrange(10)
        tags = list(live)
        if step < 2 and not winding_down and len(live) < 3:
            n = rng.randint(1, 6)
            l = Live(q_next, n)
            if rng.random() < 0.4:
                k = rng.randint(1, n)
                keys = ["%s/%03d" % (req_id(q_next), i) for i in range(k)]
                lens = [chunk_len(q_next, i, n, cb) for i in range(k)]
                tag, batch = w.begin_declared(req_id(q_next), 0, n, keys, lens)
                l.declared, l.asked, l.plain = (batch, k), k, k
                declared_count[0] += 1
            else:
                tag = w.begin(req_id(q_next), 0, n)
            live[tag] = l
            q_next += 1
        elif step < 5 and tags:
            tag = rng.choice(tags)
            l = live[tag]
            if not l.cancelled and l.asked < l.n:
                k = rng.randint(1, min(4, l.n - l.asked))
                w.stage(tag, k)
                l.asked += k
                if rng.random() < 0.2:
                    cancel(tag)
        elif step < 8 and held:
            tag, batch, slots = held.pop(rng.randrange(len(held)))
            l = live[tag]
            declared = l.declared is not None and l.declared[0] == batch
            first = 0 if declared else l.plain
            keys, lens = [], []
            for j, s in enumerate(slots):
                i = first + j
                data = chunk_bytes(l.q, i, chunk_len(l.q, i, l.n, cb))
                w.slot(s)[:len(data)] = data
                keys.append("%s/%03d" % (req_id(l.q), i))
                lens.append(len(data))
            l.written += len(slots)
            if declared:
                l.declared = None
                w.submit_declared(tag, batch)
            else:
                l.plain += len(slots)
                w.submit(tag, batch, keys, lens)
        elif step == 8 and tags and rng.random() < (0.05 if winding_down else 0.3):
            tag = rng.choice(tags)
            if not live[tag].cancelled:
                cancel(tag)
        elif winding_down:
            for tag, l in live.items():
                if not l.cancelled and l.asked < l.n:
                    k = min(4, l.n - l.asked)
                    w.stage(tag, k)
                    l.asked += k
        timeout = 0.002 if not held else 0.0
        while True:
            try:
                ev = w.next_event(timeout=timeout)
            except TimeoutError:
                break
            timeout = 0.0
            on_event(ev)
    print("FUZZ:ok done=%d cancelled=%d crossed=%d declared=%d"
          % (counts["done"], counts["cancelled"], counts["crossed"], declared_count[0]),
          flush=True)


if __name__ == "__main__":
    main()
