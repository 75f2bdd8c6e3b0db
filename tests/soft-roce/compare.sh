#!/usr/bin/env bash
# kvferry's RDMA throughput against ib_write_bw on the same device, same
# message size (64 KiB and 256 KiB), in the same run; prints one line per
# size with both rates and their ratio. Absolute rates under the guest's
# emulated CPU mean little; the ratio is what docs/benchmarks.md records.
#
#   tests/soft-roce/compare.sh KVFERRY_BIN
#   KVFERRY_RDMA_BENCH_BIN=TRANSPORT_RDMA_TEST_BIN tests/soft-roce/compare.sh KVFERRY_BIN
#
# With KVFERRY_RDMA_BENCH_BIN (a tests/transport_rdma.rs binary, release build for
# meaningful figures) it also runs that file's ignored
# bench_registered_memory_vs_store_over_rdma at each size: a Sender writing
# from registered memory (no sender copy) vs the copying `store`, both
# against the same ib_write_bw figure.
#
# ib_write_bw: one RC QP, WRITEs of SIZE bytes, IB_ITERS of them (default
# 2000), client and server on the same device (GID index 1, loopback).
# kvferry: `kvferry run --transport rdma` 1P1D with 8-chunk requests of
# SIZE-byte chunks (staging copy, RDMA WRITE, TransferDone, decoder
# checksum, release: the whole path), KV_BYTES of payload (default 128 MiB).
set -euo pipefail
bin=${1:?usage: compare.sh KVFERRY_BIN}
dev=${KVFERRY_RDMA_DEVICE:-rxe0}
gid=${KVFERRY_RDMA_GID_INDEX:-1}
iters=${IB_ITERS:-2000}
kv_bytes=${KV_BYTES:-134217728}

ib_gbits() { # SIZE -> average Gbit/s
    local size=$1 out port=$((18515 + size % 1000))
    timeout 120 ib_write_bw -d "$dev" -x "$gid" -s "$size" -n "$iters" -F --report_gbits -p "$port" >/dev/null 2>&1 &
    local server=$!
    sleep 1
    out=$(timeout 120 ib_write_bw -d "$dev" -x "$gid" -s "$size" -n "$iters" -F --report_gbits -p "$port" 127.0.0.1 2>&1) || {
        echo "compare.sh: ib_write_bw client failed: $out" >&2
        kill "$server" 2>/dev/null || true
        return 1
    }
    wait "$server" || true
    echo "$out" | awk -v s="$size" '$1 == s && NF >= 4 {print $4; exit}'
}

kv_gbits() { # SIZE -> Gbit/s of kvferry run
    local size=$1 requests json
    requests=$((kv_bytes / size / 8))
    json=$(timeout 300 "$bin" run --transport rdma --prefillers 1 --decoders 1 \
        --requests "$requests" --chunks 8..8 --batch 8 --chunk-bytes "$size" \
        --staging-slots 32 --capacity-chunks 64 --concurrency 4 --json --quiet)
    echo "$json" | sed -n 's/.*"gbps": *\([0-9.eE+-]*\).*/\1/p' | awk '{printf "%.4f\n", $1 * 8}'
}

bench_mbs() { # SIZE -> "store_mbs registered_mbs" of the registered-memory bench
    local size=$1 out
    out=$(KVFERRY_BENCH_SIZES=$size timeout 300 "$KVFERRY_RDMA_BENCH_BIN" --ignored --exact \
        bench_registered_memory_vs_store_over_rdma --nocapture --color never 2>&1) || {
        echo "compare.sh: the registered-memory bench failed: $out" >&2
        return 1
    }
    echo "$out" | sed -n 's/.*store_mbs=\([0-9.]*\).*registered_mbs=\([0-9.]*\).*/\1 \2/p'
}

for size in 65536 262144; do
    ib=$(ib_gbits "$size")
    kv=$(kv_gbits "$size")
    [ -n "$ib" ] && [ -n "$kv" ] || { echo "compare.sh: no figure for $size (ib '$ib', kvferry '$kv')" >&2; exit 1; }
    awk -v s="$size" -v ib="$ib" -v kv="$kv" 'BEGIN {
        printf "compare: %d KiB: ib_write_bw %.3f Gbit/s, kvferry %.3f Gbit/s, ratio kvferry/ib_write_bw %.2f\n", s / 1024, ib, kv, kv / ib }'
    if [ -n "${KVFERRY_RDMA_BENCH_BIN:-}" ]; then
        read -r st rg <<<"$(bench_mbs "$size")"
        [ -n "${rg:-}" ] || { echo "compare.sh: no bench figure for $size" >&2; exit 1; }
        awk -v s="$size" -v ib="$ib" -v st="$st" -v rg="$rg" 'BEGIN { ibm = ib * 125;
            printf "compare: %d KiB: Sender over rdma, store %.3f Gbit/s (%.2fx ib_write_bw), registered memory %.3f Gbit/s (%.2fx ib_write_bw), registered/store %.2f\n",
                s / 1024, st / 125, st / ibm, rg / 125, rg / ibm, rg / st }'
    fi
done
