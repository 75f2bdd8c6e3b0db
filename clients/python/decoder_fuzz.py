"""CI check: a Python decoder taking random steps (driven by
tests/attach_decoder.rs against `kvferry receiver --attach`, which a
sender fills with N one-chunk requests PREFIX-0..N-1 of 100 bytes, byte
j = j & 0xff).

usage: decoder_fuzz.py SOCKET PREFIX N SEED

3000 steps at random: SUBSCRIBEs of requests not taken yet, taken ones,
never-written ones; releases of held deliveries (at most 3 held: the
buffer has 4 slots) and of waiting subscriptions, some at once or 1 ms
after their SUBSCRIBE (a release that crosses its READY); a wildcard now and then; RELEASEs of unknown tags.
Every delivery is checked byte for byte, every event must belong to a tag
in play. Then every request not taken yet is subscribed to and checked,
one by one (one whose READY crossed its release was consumed unseen: its
subscription is refused with TakeRefused). Prints "FUZZ:ok accounted=N
(taken T, crossed C)".
"""

import random
import sys
import time

import kvferry_attach as ka

TAKE_REFUSED, UNKNOWN_TAG = 8, 6
WANT = bytes(j & 0xFF for j in range(100))


def main():
    sock, prefix, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    c = ka.DecoderClient(sock)
    waiting, held, taken, ever = {}, {}, set(), set()
    wild = None
    unknown = 1 << 40

    def check(ev):
        kind, tag = ev[0], ev[1]
        if kind == "ready":
            req, chunks = ev[2], ev[3]
            if tag in waiting:
                if waiting.pop(tag) != req:
                    sys.exit("READY of tag %d names %r" % (tag, req))
            elif not tag & ka.DAEMON_TAG:
                sys.exit("READY of a tag not waiting: %r" % (ev,))
            if len(chunks) != 1 or bytes(c.chunk(chunks[0])) != WANT:
                sys.exit("%s: wrong chunks or bytes" % req)
            if req in taken:
                sys.exit("%s delivered twice" % req)
            taken.add(req)
            held[tag] = req
        elif kind == "failed":
            if waiting.pop(tag, None) is None:
                sys.exit("FAILED of a tag not waiting: %r" % (ev,))
        elif kind == "refused":
            waiting.pop(tag, None)

    def drain(timeout):
        while True:
            try:
                ev = c.next_event(timeout=timeout)
            except TimeoutError:
                return
            check(ev)

    for _ in range(3000):
        step = rng.randrange(10)
        if step < 4:
            pick = rng.randrange(4)
            if pick < 2:
                i = rng.randrange(n)
                req = "%s-%d" % (prefix, i)
            elif pick == 2 and taken:
                req = rng.choice(sorted(taken))
            else:
                req = "%s-x%d" % (prefix, rng.randrange(1000))
            if len(waiting) + len(held) < 32:
                tag = c.subscribe(req)
                waiting[tag] = req
                ever.add(req)
                if rng.random() < 0.3:
                    # Dropped at once, or once its READY may be posted:
                    # the release crosses the delivery either way.
                    if rng.random() < 0.5:
                        time.sleep(0.001)
                    del waiting[tag]
                    c.release(tag)
        elif step < 6 and held:
            tag = rng.choice(sorted(held))
            del held[tag]
            c.release(tag)
        elif step < 8 and waiting:
            tag = rng.choice(sorted(waiting))
            del waiting[tag]
            c.release(tag)  # may cross its READY: skipped by next_event
        elif step == 8:
            if wild is None and rng.random() < 0.3:
                wild = c.subscribe_all()
            elif wild is not None:
                c.release(wild)
                wild = None
        else:
            unknown += 1
            c.release(unknown)
        drain(0.0005)
        while len(held) > 3:
            tag = min(held)
            del held[tag]
            c.release(tag)
    if wild is not None:
        c.release(wild)
    for tag in list(held):
        c.release(tag)
    held.clear()
    for tag in list(waiting):
        c.release(tag)
    waiting.clear()
    drain(0.05)
    crossed = 0
    for i in range(n):
        req = "%s-%d" % (prefix, i)
        if req in taken:
            continue
        tag = c.subscribe(req)
        waiting[tag] = req
        ev = c.next_event(timeout=30.0)
        while ev[1] != tag:  # late events of released tags are skipped; others: check
            check(ev)
            ev = c.next_event(timeout=30.0)
        if ev[0] == "refused" and ev[2] == TAKE_REFUSED and req in ever:
            waiting.pop(tag)
            crossed += 1
            continue
        check(ev)
        if req not in taken:
            sys.exit("%s: expected READY, got %r" % (req, ev))
        for t in list(held):
            del held[t]
            c.release(t)
    # Every request accounted for: delivered here, or consumed unseen by a
    # release that crossed its READY.
    print("FUZZ:ok accounted=%d (taken %d, crossed %d)" % (len(taken) + crossed, len(taken), crossed),
          flush=True)


if __name__ == "__main__":
    main()
