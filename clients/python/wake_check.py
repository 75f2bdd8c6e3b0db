"""Checks that the Python client never loses a wake-up (docs/attach.md,
"Doorbells"): submissions spaced from none to 2 ms apart land in every
phase of the daemon session's linger, arming and sleep, and every answer
lands in every phase of the client's own spin, arming and futex wait. With
the futex backstop switched off (WAKE_SLACK of an hour), a doorbell byte
skipped while the session slept, or a completion wait that slept through
a publish, leaves this script waiting for an answer that never comes: it
exits non-zero at its deadline, naming the submission. Each submission is
a RELEASE of a tag the client never used, which the session answers with
REFUSED (unknown tag) and which changes nothing else.

Then the completion wait's linger (Ring.wait): its adaptation's mapping,
and a wait whose answer comes 0.3 s later (from another thread) must sleep
after its linger, spending little CPU, however long its linger was
(LINGER_MAX), and come back to LINGER (the producer was idle).

Usage: python3 wake_check.py SOCKET    (prints "WAKE OK"; exit status 0 = passed)
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvferry_attach as ka  # noqa: E402

ROUNDS = 20
UNKNOWN_TAG = 6  # the refusal code "unknown tag" (docs/attach.md)


def main():
    ka.WAKE_SLACK = 3600.0  # no backstop: a lost wake-up hangs until the deadline
    c = ka.DecoderClient(sys.argv[1])
    for i in range(13 * ROUNDS):
        # 0, 1, 2, 4, .. 1024 us and 2 ms, then again: a fixed pattern.
        k = i % 13
        pause = 0 if k == 0 else 2000 if k == 12 else 1 << (k - 1)
        time.sleep(pause / 1e6)
        tag = 10_000 + i
        c._submit(ka.OP_RELEASE, tag)
        try:
            ev = c.next_event(timeout=10.0)
        except TimeoutError:
            sys.exit("submission %d after %d us: no answer (a lost wake-up)" % (i, pause))
        if ev != ("refused", tag, UNKNOWN_TAG):
            sys.exit("submission %d: expected REFUSED for tag %d, got %r" % (i, tag, ev))
    check_linger(c)
    c.close()
    print("WAKE OK", flush=True)


def check_linger(c):
    for slept, want in [(0.0, ka.LINGER), (100e-6, 200e-6), (200e-6, ka.LINGER_MAX),
                        (ka.LINGER_MAX, ka.LINGER), (1.0, ka.LINGER)]:
        got = ka._after_sleep(slept)
        if abs(got - want) > 1e-9:
            sys.exit("linger after a sleep of %g s: %g, expected %g" % (slept, got, want))
    c.cq.linger = ka.LINGER_MAX
    tag = 99_999
    late = threading.Timer(0.3, lambda: c._submit(ka.OP_RELEASE, tag))
    used = time.thread_time()
    late.start()
    try:
        ev = c.next_event(timeout=10.0)
    except TimeoutError:
        sys.exit("the late submission was never answered")
    used = time.thread_time() - used
    late.join(timeout=10.0)
    if ev != ("refused", tag, UNKNOWN_TAG):
        sys.exit("expected REFUSED for tag %d, got %r" % (tag, ev))
    # Yielding through the 0.3 s would have used most of it.
    if used > 0.1:
        sys.exit("a wait of 0.3 s used %.3f s of CPU: it did not sleep after its linger" % used)
    if c.cq.linger != ka.LINGER:
        sys.exit("after a long sleep the linger is %g s, expected %g" % (c.cq.linger, ka.LINGER))


if __name__ == "__main__":
    main()
