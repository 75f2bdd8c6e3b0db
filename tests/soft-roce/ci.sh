#!/usr/bin/env bash
# The RDMA step of .ci/run, run INSIDE the soft-RoCE guest (see
# tests/soft-roce/vm.sh and docs/rdma.md): the binaries are built on the
# host, this only runs them against the guest's rxe0.
#
#   tests/soft-roce/ci.sh LIB_TEST_BIN TRANSPORT_RDMA_TEST_BIN KVFERRY_BIN
#
# 1. the rdma unit tests (the lib test binary, filter transport::rdma);
# 2. every test of tests/transport_rdma.rs (KVFERRY_RDMA_REQUIRE_DEVICE=1:
#    none may skip), the link-flap tests on their own, one at a time (they
#    take veth0 down);
# 3. a fault run: `kvferry run --transport rdma` with 5 % aborts and 2 %
#    injected write failures;
# 4. tests/soft-roce/stress.sh, scaled by STRESS_REQUESTS (default 4000);
# 5. the comparison with ib_write_bw (tests/soft-roce/compare.sh).
# Every step is bounded by `timeout`; the first failure stops the script.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 3 ] || { echo "usage: $0 LIB_TEST_BIN TRANSPORT_RDMA_TEST_BIN KVFERRY_BIN" >&2; exit 2; }
lib=$1 itest=$2 bin=$3
export KVFERRY_RDMA_REQUIRE_DEVICE=1
start=$SECONDS
step() { echo; echo "== guest: $1 (at $((SECONDS - start)) s)"; }
bounded() {
    local limit=$1
    shift
    local rc=0
    timeout -k 10 "$limit" "$@" || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "ci.sh: HUNG: '$*' did not finish within ${limit} s; killed" >&2
    fi
    return "$rc"
}

step "rdma device"
ibv_devinfo -d "${KVFERRY_RDMA_DEVICE:-rxe0}" | grep -E 'hca_id|state|active_mtu'

step "rdma unit tests (transport::rdma)"
bounded 300 "$lib" --quiet --color never transport::rdma

step "tests/transport_rdma.rs (all but the link flap)"
KVFERRY_RDMA_RUN_REQUESTS=${KVFERRY_RDMA_RUN_REQUESTS:-250} bounded 900 "$itest" --color never --skip a_link_flap

step "tests/transport_rdma.rs: link flaps (ip link set veth0 down/up; one test at a time)"
KVFERRY_RDMA_FLAP_NETDEV=veth0 bounded 300 "$itest" --color never a_link_flap --nocapture --test-threads 1

step "fault run: kvferry run --transport rdma, 5 % aborts, 2 % write failures"
bounded 300 "$bin" run --transport rdma --prefillers 2 --decoders 2 \
    --requests "${FAULT_REQUESTS:-1000}" --chunks 1..8 --chunk-bytes 16384 \
    --abort-rate 0.05 --fail-rate 0.02 --seed 7 --quiet

step "stress: tests/soft-roce/stress.sh (4P2D)"
KVFERRY_BIN=$bin REQUESTS=${STRESS_REQUESTS:-4000} EXTRA_ARGS="--chunk-bytes 16384 --chunks 1..8 --quiet" \
    bounded 300 tests/soft-roce/stress.sh

step "comparison with ib_write_bw (same device, same message size)"
bounded 300 tests/soft-roce/compare.sh "$bin"

echo
echo "== guest: RDMA step passed in $((SECONDS - start)) s"
