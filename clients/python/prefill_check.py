"""CI check of the Python prefill worker (driven by tests/attach_prefill.rs).

usage: prefill_check.py SOCKET REQ_ID N LAST_LEN
Attaches to `kvferry sender --attach SOCKET`, begins REQ_ID (N chunks, to
the daemon's receiver 0), stages the N slots, fills them in place with the
pattern decoder_check.py verifies (byte j of chunk i is (i * 31 + j) & 0xff;
all chunks are full but the last, LAST_LEN bytes), submits them with keys
REQ_ID/000.. and prints "PREFILL:ok" once the sender reports DONE.
"""

import sys

import kvferry_attach

PERIOD = bytes(range(256)) * 2


def pattern(i, length):
    start = (i * 31) & 0xFF
    reps = length // 256 + 2
    return ((PERIOD[start:256] + PERIOD[:start]) * reps)[:length]


def main():
    sock, req_id, n, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    c = kvferry_attach.PrefillClient(sock)
    tag = c.begin(req_id, 0, n)
    batch = c.stage(tag, n)
    ev = c.next_event(timeout=30.0)
    if ev[0] != "staged" or ev[1] != tag or ev[2] != batch or len(ev[3]) != n:
        sys.exit("expected STAGED of %d slots, got %r" % (n, ev))
    lens = []
    for i, slot in enumerate(ev[3]):
        length = last if i + 1 == n else c.chunk_bytes
        c.slot(slot)[:length] = pattern(i, length)  # in place, no staging copy
        lens.append(length)
    c.submit(tag, batch, ["%s/%03d" % (req_id, i) for i in range(n)], lens)
    ev = c.next_event(timeout=30.0)
    if ev != ("done", tag):
        sys.exit("expected DONE, got %r" % (ev,))
    print("PREFILL:ok", flush=True)
    c.close()


if __name__ == "__main__":
    main()
