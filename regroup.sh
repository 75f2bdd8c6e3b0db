#!/usr/bin/env bash
# Regroups src/ by layer so `ls src` shows the architecture:
#
#   src/control/     the control plane: protocol, proxy, receiver, sender
#   src/transport/   the data plane (unchanged)
#   src/primitives/  engine primitives: ledger, slots, staging, region,
#                    cancel, recent, eventfd, sync
#   src/util/        plumbing: threads, zmq_io, log_budget
#   src/telemetry/   stats and the Prometheus metrics
#   src/app/         the binary's code (feature `cli`): cli, runner
#
# Module PATHS do not change: lib.rs re-exports every moved module at the
# root with its old visibility and attributes (`pub use control::sender;`,
# `use primitives::sync;`, ...), so `crate::sender::...` inside the crate and
# `kvferry::sender::...` in tests, benches, examples and users' code keep
# compiling. Only files move; the script also rewrites file-path mentions
# (`src/ledger/mod.rs` -> `src/primitives/ledger/mod.rs`) in src/, tests/,
# benches/, examples/, docs/ and README.md (never ring/, which has its own
# src/).
#
# Re-running: safe on a tree where it already ran (moves only what is still
# at its old place, touches lib.rs only for declarations still there), and
# meant to be run again after merging branches that edit the old layout:
# their edits to moved files follow the rename through git, files they ADD
# under an old directory (say src/sender/slab.rs) are moved with it by this
# script, and a module they add to lib.rs that is not listed below (say
# `attach`) stays at the top level until added to GROUPS here.
#
# Usage: ./regroup.sh   (from anywhere; needs git and python3; then
# `cargo build && cargo test` and commit the result as one commit).
set -euo pipefail
cd "$(dirname "$0")"

python3 - <<'PY'
import os, re, subprocess, textwrap

# group -> (doc of the group module, [module, ...])
GROUPS = {
    "control": ("The control plane: the wire protocol, the proxy listener, "
                "the receiver (decode side), the sender (prefill side) and attach "
                "(other processes reaching both through shared-memory rings).",
                ["attach", "protocol", "proxy", "receiver", "sender"]),
    "primitives": ("Engine primitives the control plane is built from: the "
                   "admission ledger, the slot allocator, the staging buffer, "
                   "the receive region, cancellation, bounded recent maps, "
                   "the eventfd wrapper and the sync shim for model checks.",
                   ["cancel", "eventfd", "ledger", "recent", "region", "slots",
                    "staging", "sync"]),
    "util": ("Plumbing: named threads and pinning, the ZMQ context and "
             "reactor, rate-limited logging.",
             ["log_budget", "threads", "zmq_io"]),
    "telemetry": ("Observability: per-stage statistics and their Prometheus "
                  "exposition.",
                  ["metrics", "stats"]),
    "app": ("The `kvferry` binary's code (feature `cli`): the command line "
            "and the load runner.",
            ["cli", "runner"]),
}
GROUP_OF = {m: g for g, (_, ms) in GROUPS.items() for m in ms}

def git(*args):
    subprocess.run(["git", *args], check=True)

# 1. Move files (a module is src/<m>.rs or src/<m>/).
moved = {}
for g, (_, ms) in GROUPS.items():
    for m in ms:
        for old, new in ((f"src/{m}.rs", f"src/{g}/{m}.rs"), (f"src/{m}", f"src/{g}/{m}")):
            if os.path.exists(old) and (old.endswith(".rs") or os.path.isdir(old)):
                os.makedirs(f"src/{g}", exist_ok=True)
                if os.path.isdir(old) and os.path.isdir(new):
                    # Re-run after a merge added files under the old dir.
                    for root, _, files in os.walk(old):
                        for f in files:
                            src = os.path.join(root, f)
                            dst = os.path.join(new, os.path.relpath(src, old))
                            os.makedirs(os.path.dirname(dst), exist_ok=True)
                            git("mv", src, dst)
                else:
                    git("mv", old, new)
                moved[old] = new

# 2. lib.rs: take each moved module's declaration (with its attributes and
# doc comment) out; declare it in its group's mod.rs and re-export it at the
# root with the same visibility.
lib = open("src/lib.rs").read().split("\n")
decl = re.compile(r"^(pub(?:\(crate\))? )?mod (\w+);\s*$")
out, i, taken, first_at = [], 0, {}, None
while i < len(lib):
    m = decl.match(lib[i])
    if m and m.group(2) in GROUP_OF:
        # Attributes and doc comments directly above belong to it.
        j = len(out)
        while j > 0 and re.match(r"^\s*(#\[|///)", out[j - 1]):
            j -= 1
        taken[m.group(2)] = (m.group(1) or "", out[j:])
        del out[j:]
        first_at = j if first_at is None else first_at
    else:
        out.append(lib[i])
    i += 1

def group_mod_lines(g):
    path = f"src/{g}/mod.rs"
    if os.path.exists(path):
        return open(path).read().rstrip("\n").split("\n")
    doc = textwrap.wrap(GROUPS[g][0], 76, break_on_hyphens=False)
    return ["//! " + l for l in doc] + [""]

reexports = {}
for name, (vis, attrs) in sorted(taken.items()):
    g = GROUP_OF[name]
    lines = group_mod_lines(g)
    inner_vis = "pub " if vis == "pub " else "pub(crate) "
    if attrs and lines[-1] != "":
        lines.append("")
    lines += attrs + [f"{inner_vis}mod {name};"]
    # Collapse blank-line runs the appends leave.
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines).strip("\n") + "\n")
    open(f"src/{g}/mod.rs", "w").write(text)
    git("add", f"src/{g}/mod.rs")
    keep = [a for a in attrs if a.startswith("#[cfg") or a.startswith("#[doc(hidden)")]
    reexports.setdefault(g, []).append((keep, vis, name))

if taken:
    # Insert the groups and their re-exports where the first module was.
    at = first_at
    block = ["// Files are grouped by layer under src/<group>/ (regroup.sh); the",
             "// module paths stay flat: each module is re-exported here."]
    existing = set(re.findall(r"^mod (\w+);", "\n".join(out), re.M))
    for g in GROUPS:
        if g in reexports and g not in existing:
            block.append(f"mod {g};")
    for g in GROUPS:
        for keep, vis, name in reexports.get(g, []):
            block += keep + [f"{vis}use {g}::{name};"]
    if any("regroup.sh" in l for l in out):
        block = block[2:]
    out[at:at] = block
    open("src/lib.rs", "w").write("\n".join(out))

# 3. File-path mentions: src/<m>... -> src/<g>/<m>... (not ring/src/...).
pat = re.compile(r"(?<![\w/.-])src/(" + "|".join(sorted(GROUP_OF, key=len, reverse=True)) +
                 r")(?=[/.`'\"\s):,;]|$)")
def fix(text):
    return pat.sub(lambda m: f"src/{GROUP_OF[m.group(1)]}/{m.group(1)}", text)
roots = ["src", "tests", "benches", "examples", "docs"]
files = ["README.md"] + [os.path.join(r, f) for top in roots if os.path.isdir(top)
                         for r, _, fs in os.walk(top) for f in fs
                         if f.endswith((".rs", ".md", ".sh", ".py", ".toml"))]
for f in files:
    t = open(f).read()
    n = fix(t)
    if n != t:
        open(f, "w").write(n)
PY

echo "regroup.sh: done; now: cargo fmt --all && cargo build && cargo test"
