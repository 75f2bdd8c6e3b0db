#!/usr/bin/env bash
# LMCache interop suite (issue 12): LMCache's real PD code, pinned version,
# against kvferry's binaries. Builds a venv once, outside the clone, keyed
# by the LMCache version and this script's dependency pins, then runs
# suite.py. Prints `N passed, M failed`; exits non-zero on any failure,
# including when the wheel cannot be fetched from PyPI.
#
#   tests/lmcache/run.sh [SCENARIO ...]
#
# KVFERRY_BIN: the kvferry binary (default: target/debug/kvferry, built if
# missing). KVFERRY_LMCACHE_VENV: the venv (default
# ~/.cache/kvferry/lmcache-venv-<version>-<pins hash>). Needs python3.11
# (the wheel is cp311) with the venv module.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

LMCACHE_VERSION=0.5.6
# LMCache's own PD module needs these at import (its wheel declares many
# more, GPU ones included, installed with --no-deps so none of them come).
# Versions within LMCache 0.5.6's declared bounds.
PINS=(
    "pyzmq==27.3.0" "msgspec==0.23.0" "PyYAML==6.0.4" "requests==2.34.2"
    "sortedcontainers==2.4.0" "cachetools==8.0.2" "prometheus_client==0.24.1"
    "py-cpuinfo==9.0.0" "psutil==7.2.2" "aiohttp==3.14.5" "numpy==2.2.6"
    "aiofile==3.12.3"
)

python=""
for p in python3.11 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
        python="$(command -v "$p")"
        break
    fi
done
if [ -z "$python" ]; then
    echo "tests/lmcache: no python3.11 found (the LMCache $LMCACHE_VERSION wheel is cp311)"
    echo "0 passed, 1 failed"
    exit 1
fi

key="$(printf '%s\n' "$LMCACHE_VERSION" "${PINS[@]}" | sha256sum | cut -c1-12)"
venv="${KVFERRY_LMCACHE_VENV:-$HOME/.cache/kvferry/lmcache-venv-$LMCACHE_VERSION-$key}"
if [ ! -f "$venv/.complete" ]; then
    echo "tests/lmcache: building $venv (once)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    # pip's resolver lists every GPU dependency --no-deps left out: keep
    # that noise in a log next to the venv.
    log="$venv.pip.log"
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "lmcache==$LMCACHE_VERSION" >"$log" 2>&1 \
        || ! "$venv/bin/pip" install --quiet --disable-pip-version-check "${PINS[@]}" >>"$log" 2>&1; then
        tail -5 "$log"
        rm -rf "$venv"
        echo "tests/lmcache: cannot fetch lmcache==$LMCACHE_VERSION (or its pinned deps) from PyPI"
        echo "0 passed, 1 failed"
        exit 1
    fi
    touch "$venv/.complete"
fi

bin="${KVFERRY_BIN:-$root/target/debug/kvferry}"
if [ -z "${KVFERRY_BIN:-}" ] && [ ! -x "$bin" ]; then
    (cd "$root" && cargo build --quiet --bin kvferry)
fi
exec "$venv/bin/python" "$here/suite.py" "$bin" "$@"
