"""CI check of the Python prefill worker's CANCEL (driven by
tests/attach_prefill.rs).

usage: cancel_check.py SOCKET REQ_ID CANCELLED_CODE
Begins REQ_ID (4 chunks, receiver 0) and stages 2 slots; once the STAGED
is on the completion ring, unread, cancels the request. next_event must
skip that STAGED (the daemon gave the batch back on the CANCEL) and
return the request's FAILED with CANCELLED_CODE. Prints "PREFILL:ok".
"""

import sys

import kvferry_attach
from waiting import wait_until


def main():
    sock, req_id, cancelled = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = kvferry_attach.PrefillClient(sock)
    tag = c.begin(req_id, 0, 4)
    c.stage(tag, 2)
    wait_until(c.cq.available, "the STAGED")
    c.cancel(tag)
    ev = c.next_event(timeout=30.0)
    if ev != ("failed", tag, cancelled):
        sys.exit("expected FAILED %d for the cancelled request, got %r" % (cancelled, ev))
    print("PREFILL:ok", flush=True)


if __name__ == "__main__":
    main()
