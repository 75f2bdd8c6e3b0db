"""CI helper of the check scripts: the kvferry mappings of this process
(the attach rings, the receive buffer or the staging share) have their
page tables filled at attach (kvferry_attach maps them populated), so the
first touch of a page takes no page fault."""

import re
import sys

HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def kvferry_mappings():
    """(path, size_kb, rss_kb) of each mapping whose file names kvferry."""
    found, path, size = [], None, None
    with open("/proc/self/smaps") as f:
        for line in f:
            if HEADER.match(line):
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) > 5 and "kvferry" in fields[5] else None
            elif path and line.startswith("Size:"):
                size = int(line.split()[1])
            elif path and line.startswith("Rss:"):
                found.append((path, size, int(line.split()[1])))
    return found


def check(role, want):
    """Exits unless `want` kvferry mappings exist and each is wholly resident."""
    maps = kvferry_mappings()
    cold = [m for m in maps if m[2] < m[1]]
    if len(maps) != want or cold:
        sys.exit("%s: %d kvferry mappings (want %d), not wholly resident: %r" % (role, len(maps), want, cold))
