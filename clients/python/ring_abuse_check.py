"""CI check: a client that scribbles on its own rings' indices harms only
itself (driven by tests/attach_decoder.rs against `kvferry receiver
--attach` and tests/attach_prefill.rs against `kvferry sender --attach`;
docs/attach.md, "Security and bounds").

usage: ring_abuse_check.py decoder|prefill SOCKET

1. Its submission ring's tail put behind the session's head, then more
   than a ring ahead of it, the doorbell rung each time: the session reads
   no submission from it (no completion comes). The tail put back, the
   attachment is served again.
2. Its completion ring filled (REFUSED answers to RELEASEs, a worker's
   CANCELs, of unknown tags, none read, more waiting in the session), then its head put ahead
   of the session's tail or more than a ring behind it: the session
   writes no completion (the tail stays). The head put back, every answer
   arrives, once, in order.
Prints "ATTACH:ok" at the end.
"""

import sys
import time

import kvferry_attach as ka
from waiting import wait_until

UNKNOWN_TAG = 6  # Refusal::UnknownTag
MASK = (1 << 64) - 1
SETTLE = 0.3  # seconds the session is given to misbehave
WAIT = 30.0


def ring_doorbell(c):
    c.sock.sendall(b"\1")


def expect_quiet(c, what):
    tail = c.cq.tail.value
    ring_doorbell(c)
    time.sleep(SETTLE)
    if c.cq.tail.value != tail:
        sys.exit("%s: the session posted %d completions"
                 % (what, (c.cq.tail.value - tail) & MASK))


def main():
    role, sock = sys.argv[1], sys.argv[2]
    if role == "decoder":
        c = ka.DecoderClient(sock)
        unknown = lambda tag: ka.SUBMIT.pack(ka.OP_RELEASE, 0, tag, b"")
    elif role == "prefill":
        c = ka.PrefillClient(sock)
        unknown = lambda tag: ka.PSUBMIT.pack(ka.OP_CANCEL, 0, tag, 0, 0, 0, 0, b"")
    else:
        sys.exit("role must be decoder or prefill, not %r" % role)
    sq, cq = c.sq, c.cq

    # 1. The submission ring's tail.
    for bogus in ((sq.pos - 1) & MASK, sq.pos + sq.cap + 1, (sq.pos + (1 << 63)) & MASK):
        sq.tail.value = bogus
        expect_quiet(c, "submission tail %#x" % bogus)
    sq.tail.value = sq.pos
    ka._publish(sq, c.sock, unknown(0xFEED), 1)
    ev = c.next_event(timeout=WAIT)
    if ev != ("refused", 0xFEED, UNKNOWN_TAG):
        sys.exit("after the tail was put back: expected the refusal, got %r" % (ev,))

    # 2. The completion ring's head.
    extra = 100
    total = cq.cap + extra
    tags = range(1, total + 1)
    entries = b"".join(unknown(t) for t in tags)
    ka._publish(sq, c.sock, entries, total, wait=WAIT)
    ring_doorbell(c)
    wait_until(lambda: sq.head.value == sq.pos, "the session to read every submission")
    wait_until(lambda: cq.available() == cq.cap, "a full completion ring")
    real = cq.pos
    tail = cq.tail.value
    for bogus in ((tail + 1) & MASK, (tail - cq.cap - 1) & MASK, (tail + (1 << 63)) & MASK):
        cq.head.value = bogus
        expect_quiet(c, "completion head %#x" % bogus)
    cq.head.value = real
    for t in tags:
        ev = c.next_event(timeout=WAIT)
        if ev != ("refused", t, UNKNOWN_TAG):
            sys.exit("answer %d: expected the refusal of tag %d, got %r" % (t, t, ev))
    time.sleep(SETTLE)
    if cq.available():
        sys.exit("%d answers more than submissions" % cq.available())
    print("ATTACH:ok", flush=True)


if __name__ == "__main__":
    main()
