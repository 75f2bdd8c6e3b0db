"""Attaches a decoder and then a prefill worker from the main thread and
prints what they did to its CPU set (docs/attach.md, "Placing the
threads"), for tests/cli_threads.rs:

    PLACED <decoder's kept_off_cpu> <worker's kept_off_cpu> <CPUs, comma-separated>

usage: placement_check.py DECODER_SOCKET WORKER_SOCKET
"""

import os
import sys

import kvferry_attach


def main():
    dec = kvferry_attach.DecoderClient(sys.argv[1])
    work = kvferry_attach.PrefillClient(sys.argv[2])
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    print("PLACED %s %s %s" % (dec.kept_off_cpu, work.kept_off_cpu, cpus), flush=True)
    work.close()
    dec.close()


if __name__ == "__main__":
    main()
