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

Usage: python3 wake_check.py SOCKET    (prints "WAKE OK"; exit status 0 = passed)
"""

import os
import sys
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
    c.close()
    print("WAKE OK", flush=True)


if __name__ == "__main__":
    main()
