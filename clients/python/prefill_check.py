"""CI check of the Python prefill worker (driven by tests/attach_prefill.rs).

usage: prefill_check.py SOCKET REQ_ID N LAST_LEN [FMT SHAPE DTYPE LAST_TOKS] [declared]
Attaches to `kvferry sender --attach SOCKET`, begins REQ_ID (N chunks, to
the daemon's receiver 0), stages the N slots, fills them in place with the
pattern decoder_check.py verifies (byte j of chunk i is (i * 31 + j) & 0xff;
all chunks are full but the last, LAST_LEN bytes), submits them with keys
REQ_ID/000.. and prints "PREFILL:ok" once the sender reports DONE.

With FMT SHAPE DTYPE LAST_TOKS (SHAPE: dimensions joined by commas) the
request carries that chunk geometry and the last chunk that token count;
first a BEGIN of an unknown dtype and a SUBMIT of LAST_TOKS past the
shape's largest dimension are checked to be refused (codes 12 and 13).

With "declared" last, the request's one batch is declared at its begin
(begin_declared: the admission carries its keys) and handed over with
submit_declared.
"""

import sys

import kvferry_attach
import resident
from pattern import pattern



def chunk_bytes(i, length):
    return pattern(i * 31, length)


def staged(c, tag, batch, n):
    ev = c.next_event(timeout=30.0)
    if ev[0] != "staged" or ev[1] != tag or ev[2] != batch or len(ev[3]) != n:
        sys.exit("expected STAGED of %d slots, got %r" % (n, ev))
    return ev[3]


def fill(c, slots, lens):
    """Chunk i of the pattern into slot slots[i], in place (no staging copy)."""
    for i, slot in enumerate(slots):
        c.slot(slot)[:lens[i]] = chunk_bytes(i, lens[i])


def main():
    args = sys.argv[1:]
    declared = args[-1] == "declared"
    if declared:
        args.pop()
    sock, req_id, n, last = args[0], args[1], int(args[2]), int(args[3])
    geometry, toks = {}, None
    if len(args) > 4:
        fmt, shape, dtype, toks = args[4:8]
        shape = [int(d) for d in shape.split(",")]
        geometry = dict(fmt=int(fmt), shape=shape, dtype=dtype)
        toks = int(toks)
    c = kvferry_attach.PrefillClient(sock)
    resident.check("prefill worker", 3)
    if geometry:
        bad = c.begin(req_id + "-bad", 0, n, **dict(geometry, dtype="nope16"))
        ev = c.next_event(timeout=30.0)
        if ev != ("refused", bad, 12):
            sys.exit("expected REFUSED 12 (bad geometry), got %r" % (ev,))
    keys = ["%s/%03d" % (req_id, i) for i in range(n)]
    lens = [last if i + 1 == n else c.chunk_bytes for i in range(n)]
    if declared:
        tag, batch = c.begin_declared(req_id, 0, n, keys, lens, last_chunk_toks=toks,
                                      **geometry)
        fill(c, staged(c, tag, batch, n), lens)
        c.submit_declared(tag, batch)
    else:
        tag = c.begin(req_id, 0, n, **geometry)
        if geometry:
            batch = c.stage(tag, 1)
            staged(c, tag, batch, 1)
            c.submit(tag, batch, keys[:1], [1], last_chunk_toks=max(geometry["shape"]) + 1)
            ev = c.next_event(timeout=30.0)
            if ev != ("refused", tag, 13):
                sys.exit("expected REFUSED 13 (bad tokens), got %r" % (ev,))
        batch = c.stage(tag, n)
        fill(c, staged(c, tag, batch, n), lens)
        c.submit(tag, batch, keys, lens, last_chunk_toks=toks)
    ev = c.next_event(timeout=30.0)
    if ev != ("done", tag):
        sys.exit("expected DONE, got %r" % (ev,))
    print("PREFILL:ok", flush=True)
    c.close()


if __name__ == "__main__":
    main()
