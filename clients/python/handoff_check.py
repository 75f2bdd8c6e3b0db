"""Checks the Python client's hand-off bounds (docs/attach.md, "Handshake"):
a fake daemon sends an accepting hello with no, too few or too many
descriptors (SCM_RIGHTS); the client raises AttachError each time, closes
every descriptor it received, and attaches nothing. Then the check of a
READY's CHUNK (and a STAGED's SLOT) entries: every field that can be wrong
is, once each, and the batch is refused. Exit status 0 = passed.

Usage: python3 handoff_check.py
"""

import os
import socket
import struct
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvferry_attach as ka  # noqa: E402


def hello():
    b = bytearray(ka.HELLO_LEN)
    b[0:8] = ka.HELLO_MAGIC
    struct.pack_into("<IIIIII", b, 8, ka.ATTACH_VERSION, ka.ROLE_DECODER, 0, 1,
                     ka.SUBMIT.size, ka.EVENT.size)
    struct.pack_into("<II", b, 72, ka.HELLO_FDS, ka.NO_CPU)
    return bytes(b)


def fake_daemon(path, fds):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            if fds:
                socket.send_fds(conn, [hello()], fds)
            else:
                conn.sendall(hello())
            conn.recv(1)  # until the client closes
        srv.close()

    t = threading.Thread(target=serve)
    t.start()
    return t


def check_entries():
    """ka._entries accepts a well-formed batch and refuses each bad field."""
    n, tag, slots = 5, 77, 16

    def batch(**bad):
        out = b""
        for i in range(n):
            f = dict(kind=ka.EV_CHUNK, tag=tag, slot=i + 3, idx=i, length=100 + i, tokens=9)
            if i == 2:
                f.update(bad)
            out += ka.EVENT.pack(f["kind"], 0, f["tag"], f["slot"], f["idx"],
                                 f["length"], f["tokens"])
        return out

    got = ka._entries(batch(), n, ka.EV_CHUNK, tag, slots)
    if got != ([3, 4, 5, 6, 7], [100, 101, 102, 103, 104], [9] * n):
        sys.exit("a good batch read as %r" % (got,))
    for bad in (dict(kind=ka.EV_SLOT), dict(tag=tag + 1), dict(idx=3), dict(slot=slots),
                dict(tag=tag | 1 << 40)):
        if ka._entries(batch(**bad), n, ka.EV_CHUNK, tag, slots) is not None:
            sys.exit("a batch with %r was accepted" % (bad,))
    if ka._entries(b"", 0, ka.EV_CHUNK, tag, slots) != ([], [], []):
        sys.exit("an empty batch was refused")
    print("entries: a good batch read, 5 bad ones refused")


def main():
    check_entries()
    with tempfile.TemporaryDirectory() as d:
        for n in (0, 2, 4, 12):
            r, w = os.pipe()
            path = os.path.join(d, "fake-%d.sock" % n)
            t = fake_daemon(path, [w] * n)
            os.close(w)  # the daemon's copies travel in the message
            try:
                ka.DecoderClient(path, timeout=10.0)
            except ka.AttachError as e:
                print("%d descriptors: refused: %s" % (n, e))
            else:
                sys.exit("%d descriptors: the client attached" % n)
            t.join(10.0)
            # EOF only once every received copy of the write end is closed.
            os.set_blocking(r, False)
            if os.read(r, 1) != b"":
                sys.exit("%d descriptors: a received descriptor stayed open" % n)
            os.close(r)
    print("HANDOFF OK")


if __name__ == "__main__":
    main()
