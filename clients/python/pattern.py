"""CI helper of the check scripts: the test bytes writers fill chunks with
and readers check, so a slot written for another chunk is caught."""

PERIOD = bytes(range(256)) * 2


def pattern(start, length):
    """`length` bytes counting up from `start` (mod 256), wrapping."""
    start &= 0xFF
    reps = length // 256 + 2
    return ((PERIOD[start:256] + PERIOD[:start]) * reps)[:length]
