#!/usr/bin/env bash
# Soft-RoCE stress run of kvferry's rdma transport: finds an RDMA device (or
# creates an rxe device on a network interface), builds kvferry with
# `--features rdma` and runs `kvferry run --transport rdma` with many
# concurrent requests, printing the report. See docs/rdma.md.
#
# Environment (all optional):
#   NETDEV       interface for a new rxe device (default: the default route's)
#   RXE_NAME     name of the rxe device to create (default: rxe0)
#   KVFERRY_RDMA_DEVICE / KVFERRY_RDMA_GID_INDEX  passed to kvferry
#   PREFILLERS DECODERS REQUESTS CONCURRENCY      load (default 4 2 20000 8)
#   EXTRA_ARGS   more `kvferry run` options
#   KVFERRY_BIN  a kvferry binary built with `--features rdma` (skips the
#                build; the CI guest runs one built on the host)
#
# The run is the real thing: every receiver offers rdma, every sender's Hello
# carries a queue pair made for that receiver (Poster::prepare), the
# receiver answers with one made for that sender (RdmaReceiverSide::accept)
# and the HelloAck connects the pair (Poster::connect_prepared); decoders
# check every byte and the report (printed on stdout) ends in a leak check.
# CI runs it inside the soft-RoCE guest (tests/soft-roce/ci.sh).
#
# Exit codes: 0 run passed, 1 run failed, 2 refused (no RDMA possible here,
# missing tools or rights), 3 build failed.
set -euo pipefail
cd "$(dirname "$0")/../.."

PREFILLERS=${PREFILLERS:-4}
DECODERS=${DECODERS:-2}
REQUESTS=${REQUESTS:-20000}
CONCURRENCY=${CONCURRENCY:-8}
RXE_NAME=${RXE_NAME:-rxe0}

refuse() {
    echo "stress.sh: REFUSED: $*" >&2
    exit 2
}

# Names of the RDMA devices the kernel exposes (real NICs or rxe/siw).
devices() {
    ls /sys/class/infiniband 2>/dev/null || true
}

# Why this kernel cannot do soft-RoCE, or nothing if it can.
rxe_unavailable_reason() {
    if [ -d /sys/module/rdma_rxe ]; then
        return 0 # loaded or built in
    fi
    local why=()
    why+=("/sys/module/rdma_rxe does not exist (module not loaded, not built in)")
    if command -v modprobe >/dev/null; then
        if modprobe -n rdma_rxe 2>/dev/null; then
            return 0 # loadable
        fi
        why+=("modprobe -n rdma_rxe: $(modprobe -n rdma_rxe 2>&1 | head -1)")
    else
        why+=("modprobe is not installed")
    fi
    [ -d "/lib/modules/$(uname -r)" ] || why+=("/lib/modules/$(uname -r) does not exist (no loadable modules)")
    if [ -r /proc/config.gz ]; then
        local cfg
        cfg=$(zcat /proc/config.gz | grep -E '^(# )?CONFIG_(INFINIBAND|RDMA_RXE)[ =]' || true)
        if echo "$cfg" | grep -qE '^CONFIG_RDMA_RXE=(y|m)'; then
            return 0
        fi
        why+=("/proc/config.gz: ${cfg:-CONFIG_RDMA_RXE not present} ")
    else
        why+=("/proc/config.gz is not readable (cannot check CONFIG_RDMA_RXE)")
    fi
    printf '%s; ' "${why[@]}"
}

device=${KVFERRY_RDMA_DEVICE:-}
if [ -z "$device" ]; then
    device=$(devices | head -1)
fi
if [ -z "$device" ]; then
    reason=$(rxe_unavailable_reason)
    if [ -n "$reason" ]; then
        refuse "no RDMA device and this kernel cannot create a soft-RoCE (rdma_rxe) device: ${reason}kernel $(uname -r) needs CONFIG_INFINIBAND and CONFIG_RDMA_RXE (see docs/rdma.md)"
    fi
    [ "$(id -u)" -eq 0 ] || refuse "creating an rxe device needs root (run as root, or create it first: rdma link add $RXE_NAME type rxe netdev <if>)"
    command -v rdma >/dev/null || refuse "the 'rdma' tool (iproute2) is needed to create an rxe device"
    netdev=${NETDEV:-$(ip -o route show default 2>/dev/null | awk '{print $5; exit}')}
    [ -n "$netdev" ] || refuse "no NETDEV given and no default route to pick an interface from"
    [ -d /sys/module/rdma_rxe ] || modprobe rdma_rxe || refuse "modprobe rdma_rxe failed"
    echo "stress.sh: creating $RXE_NAME on $netdev" >&2
    rdma link add "$RXE_NAME" type rxe netdev "$netdev" || refuse "rdma link add $RXE_NAME type rxe netdev $netdev failed"
    device=$RXE_NAME
fi
echo "stress.sh: using RDMA device $device" >&2
if command -v rdma >/dev/null; then rdma link show 2>/dev/null || true; fi

# RoCE v2 over IPv4 usually sits at GID index 1 on rxe; index 0 is the
# link-local IPv6 GID. Both ends are on this host, so either works; keep
# what the caller chose.
export KVFERRY_RDMA_DEVICE=$device

bin=${KVFERRY_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release --features rdma --bin kvferry || {
        echo "stress.sh: build failed (needs: cmake pkg-config libnl-3-dev libnl-route-3-dev libclang1-14 libclang-common-14-dev libibverbs-dev)" >&2
        exit 3
    }
    bin=target/release/kvferry
fi

set +e
# shellcheck disable=SC2086
"$bin" run --transport rdma \
    --prefillers "$PREFILLERS" --decoders "$DECODERS" \
    --requests "$REQUESTS" --concurrency "$CONCURRENCY" ${EXTRA_ARGS:-}
rc=$?
set -e
echo "stress.sh: kvferry run exited with $rc" >&2
exit "$rc"
