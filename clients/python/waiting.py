"""CI helper of the check scripts: a bounded wait for a condition that
another process makes true (a ring index, an entry on a ring)."""

import sys
import time


def wait_until(cond, what, timeout=30.0):
    """Polls cond() every millisecond; exits naming `what` if it is still
    false after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            sys.exit("timed out waiting for " + what)
        time.sleep(0.001)
