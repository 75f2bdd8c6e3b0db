"""CI check of the Python decoder client (driven by tests/attach_decoder.rs).

usage: decoder_check.py SOCKET REQ_ID N LAST_LEN MODE [LAST_TOKENS]
Subscribes to REQ_ID (REQ_ID "*": a wildcard subscription, and the first
request delivered to it is checked), prints "ATTACH:subscribed", waits for it, checks every
byte of its N chunks (byte j of chunk i is (i * 31 + j) & 0xff; all chunks
are full but the last, LAST_LEN bytes), then in MODE "release" releases it
and prints "ATTACH:ok"; in MODE "hold" prints "ATTACH:holding" and sleeps
until killed. With LAST_TOKENS the last chunk must carry that token count.
In MODE "crossed" it releases the subscription once its READY is on the
completion ring but not read, then checks that next_event skips that
READY (the daemon released the delivery) and returns the REFUSED of a
RELEASE of an unknown tag sent after it; prints "ATTACH:ok".
"""

import sys
import time

import kvferry_attach
import resident
from pattern import pattern
from waiting import wait_until



def expected(i, length):
    return pattern(i * 31, length)


def main():
    sock, req_id, n, last, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    last_tokens = int(sys.argv[6]) if len(sys.argv) > 6 else None
    c = kvferry_attach.DecoderClient(sock)
    resident.check("decoder", 3)
    if req_id == "*":
        c.subscribe_all()
        # Submissions are handled in order: once the RELEASE of an unknown
        # tag is refused, the wildcard stands.
        c.release(0xFEED)
        ev = c.next_event(timeout=30.0)
        if ev != ("refused", 0xFEED, 6):
            sys.exit("expected the fence's refusal, got %r" % (ev,))
    else:
        tag = c.subscribe(req_id)
    print("ATTACH:subscribed", flush=True)
    if mode == "crossed":
        wait_until(c.cq.available, "the READY")
        c.release(tag)
        c.release(0xFEED)
        ev = c.next_event(timeout=30.0)
        if ev != ("refused", 0xFEED, 6):
            sys.exit("expected the fence's refusal after the crossed READY, got %r" % (ev,))
        print("ATTACH:ok", flush=True)
        return
    ev = c.next_event(timeout=30.0)
    if req_id == "*":
        if ev[0] != "ready" or not ev[1] & kvferry_attach.DAEMON_TAG:
            sys.exit("expected a wildcard READY, got %r" % (ev,))
        tag = ev[1]
        print("ATTACH:got %s" % ev[2], flush=True)
    elif ev[0] != "ready" or ev[1] != tag:
        sys.exit("expected READY for tag %d, got %r" % (tag, ev))
    chunks = ev[3]
    if len(chunks) != n:
        sys.exit("expected %d chunks, got %d" % (n, len(chunks)))
    for i, desc in enumerate(chunks):
        data = c.chunk(desc)
        want_len = last if i + 1 == n else c.chunk_bytes
        if len(data) != want_len:
            sys.exit("chunk %d: %d bytes, expected %d" % (i, len(data), want_len))
        if data != expected(i, want_len):
            sys.exit("chunk %d differs" % i)
    if last_tokens is not None and chunks[-1][2] != last_tokens:
        sys.exit("last chunk: %r tokens, expected %d" % (chunks[-1][2], last_tokens))
    if mode == "hold":
        print("ATTACH:holding", flush=True)
        time.sleep(120)
        sys.exit("holder was not killed")
    c.release(tag)
    print("ATTACH:ok", flush=True)


if __name__ == "__main__":
    main()
