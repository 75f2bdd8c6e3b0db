#!/usr/bin/env bash
# Runs a command inside a QEMU guest that has a soft-RoCE device (rdma_rxe),
# with this checkout visible at the same path, and exits with the command's
# exit code. See docs/rdma.md ("The soft-RoCE guest").
#
#   tests/soft-roce/vm.sh [--check | --build] [COMMAND...]
#
#   --check  say whether a guest can run here (exit 0) or why not (exit 2)
#   --build  build (or find) the cached guest image, print its path, exit
#   COMMAND  run by `sh -c` inside the guest, in the checkout, as root
#            (default: a shell-free probe, `ibv_devinfo -d rxe0`)
#
# The guest: Debian bookworm's own kernel (linux-image-6.1.0-*-amd64) and a
# root built with `debootstrap --variant=minbase`, packed with only the
# kernel modules it needs into an initramfs that is the whole root. The
# image is built once and cached outside the checkout (KVFERRY_VM_CACHE,
# default /var/cache/kvferry-vm when writable, else ~/.cache/kvferry/vm),
# keyed by a hash of the recipe below; building it needs root (or sudo) and
# Debian's mirror (~2 minutes). Inside: `-nic none` (no network outside the
# guest), a veth pair veth0 (10.77.0.1) / veth1 (10.77.0.2), and `rxe0` on
# veth0 (GID index 1 is its IPv4 RoCE v2 GID). The checkout and, when they
# exist, ~/.cargo and ~/.rustup are shared read-only over 9p with a tmpfs
# overlay on top: the guest can write anywhere, nothing reaches the host.
#
# Acceleration: KVM when /dev/kvm can run a stock kernel (a CPU with vmx or
# svm, and not kvm_pvm, which runs only PVM-aware kernels), TCG otherwise;
# the first line printed says which and why. KVFERRY_VM_ACCEL=tcg|kvm
# overrides.
#
# Every wait is bounded: the guest must report that it booted within
# KVFERRY_VM_BOOT_TIMEOUT seconds (default 180) and finish within
# KVFERRY_VM_TIMEOUT seconds (default 1200), or it is killed with a message
# saying which deadline passed (exit 124).
#
# Environment passed into the guest: every KVFERRY_* and RUST_* variable of
# the caller, plus KVFERRY_RDMA_DEVICE=rxe0, KVFERRY_RDMA_GID_INDEX=1 and
# KVFERRY_RDMA_REQUIRE_DEVICE=1 unless the caller set them.
#
# Other knobs: KVFERRY_VM_MEM (MiB, default 3072), KVFERRY_VM_CPUS (default
# 2), KVFERRY_VM_MIRROR (default http://deb.debian.org/debian).
#
# Exit codes: the command's own; 2 no guest can run here (reason on stderr);
# 3 the image could not be built; 124 a deadline passed; 125 the guest
# stopped without reporting the command's exit code.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
checkout=$(cd "$here/../.." && pwd)
self="$here/$(basename "$0")"

say() { echo "vm.sh: $*" >&2; }
die() {
    local code=$1
    shift
    say "$*"
    exit "$code"
}

as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo -n)

# --- recipe begin (the image cache key is a hash of this block) -----------
suite=bookworm
guest_pkgs=kmod,iproute2,rdma-core,ibverbs-providers,ibverbs-utils,libibverbs1,perftest,procps
guest_modules="virtio_pci 9pnet_virtio 9p overlay veth crc32_generic rdma_rxe"

# /init of the guest: the initramfs is its whole root. Mounts the shares
# listed in /mnt/ctl/shares (tag and path per line) read-only with a tmpfs
# overlay at the host's path, sets up veth0/veth1 and rxe0, runs
# /mnt/ctl/cmd, writes its exit code to /mnt/ctl/rc and powers off.
guest_init='#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
stty -onlcr </dev/console 2>/dev/null
off() { sync; echo o >/proc/sysrq-trigger; sleep 5; echo b >/proc/sysrq-trigger; }
for m in virtio_pci 9pnet_virtio 9p overlay veth crc32_generic rdma_rxe; do
    modprobe "$m" || { echo "guest: modprobe $m failed"; off; }
done
mkdir -p /mnt/ctl
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 ctl /mnt/ctl || { echo "guest: cannot mount the control share"; off; }
while read -r tag path; do
    mkdir -p "/mnt/lower/$tag" "/run/ov/$tag/up" "/run/ov/$tag/work" "$path"
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose "$tag" "/mnt/lower/$tag" &&
        mount -t overlay overlay -o "lowerdir=/mnt/lower/$tag,upperdir=/run/ov/$tag/up,workdir=/run/ov/$tag/work" "$path" ||
        { echo "guest: cannot mount $path"; off; }
done </mnt/ctl/shares
ip link set lo up
ip link add veth0 type veth peer name veth1
ip addr add 10.77.0.1/24 dev veth0
ip addr add 10.77.0.2/24 dev veth1
ip link set veth0 up
ip link set veth1 up
sleep 1
rdma link add rxe0 type rxe netdev veth0 || { echo "guest: rdma link add rxe0 failed"; dmesg | tail -5; off; }
echo "$(cut -d" " -f1 /proc/uptime)" >/mnt/ctl/booted
cd "$(cat /mnt/ctl/cwd)"
sh /mnt/ctl/cmd </dev/null
echo $? >/mnt/ctl/rc
off
'

# Builds the image into $1 (a directory that does not exist yet).
build_image() {
    local dest=$1 work root kpkg kver
    local mirror=${KVFERRY_VM_MIRROR:-http://deb.debian.org/debian}
    work=$(mktemp -d "$(dirname "$dest")/build.XXXXXX")
    # shellcheck disable=SC2064
    trap "${as_root[*]} rm -rf '$work'" EXIT
    root=$work/root
    local t0=$SECONDS
    say "building the guest image (debootstrap $suite, ~2 min, log: $work/build.log)"
    "${as_root[@]}" debootstrap --variant=minbase --include="$guest_pkgs" "$suite" "$root" "$mirror" \
        >"$work/build.log" 2>&1 || {
        tail -20 "$work/build.log" >&2
        return 1
    }
    # The kernel: the one linux-image-amd64 points to, unpacked (not
    # installed: that would pull initramfs-tools and run it).
    echo "deb $mirror $suite main" | "${as_root[@]}" tee "$root/etc/apt/sources.list" >/dev/null
    "${as_root[@]}" chroot "$root" apt-get -q update >>"$work/build.log" 2>&1 || {
        tail -20 "$work/build.log" >&2
        return 1
    }
    kpkg=$("${as_root[@]}" chroot "$root" apt-cache depends linux-image-amd64 |
        sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -1)
    [ -n "$kpkg" ] || {
        say "cannot resolve linux-image-amd64 in $suite"
        return 1
    }
    say "kernel package $kpkg"
    "${as_root[@]}" chroot "$root" sh -c "cd /tmp && apt-get -q download $kpkg && dpkg-deb -x /tmp/${kpkg}_*.deb /tmp/kernel && rm /tmp/*.deb" \
        >>"$work/build.log" 2>&1 || {
        tail -20 "$work/build.log" >&2
        return 1
    }
    kver=$(ls "$root/tmp/kernel/lib/modules")
    "${as_root[@]}" cp "$root/tmp/kernel/boot/vmlinuz-$kver" "$work/vmlinuz"
    "${as_root[@]}" mkdir -p "$root/lib/modules"
    "${as_root[@]}" mv "$root/tmp/kernel/lib/modules/$kver" "$root/lib/modules/$kver"
    "${as_root[@]}" rm -rf "$root/tmp/kernel"
    # Only the modules $guest_modules need (and what they depend on).
    "${as_root[@]}" chroot "$root" depmod "$kver"
    local m mods=
    for m in $guest_modules; do
        mods+=$("${as_root[@]}" chroot "$root" modprobe -S "$kver" --show-depends "$m" |
            awk '$1 == "insmod" {print $2}') || {
            say "modprobe --show-depends $m failed for kernel $kver"
            return 1
        }
        mods+=$'\n'
    done
    mods=$(echo "$mods" | grep . | sort -u)
    say "modules: $(echo "$mods" | xargs -n1 basename | tr '\n' ' ')"
    local keep=$work/keep
    mkdir -p "$keep"
    for m in $mods; do
        "${as_root[@]}" install -D -m 0644 "$root$m" "$keep$m"
    done
    "${as_root[@]}" cp "$root/lib/modules/$kver"/modules.{order,builtin,builtin.modinfo} "$keep/lib/modules/$kver/" 2>/dev/null || true
    "${as_root[@]}" rm -rf "$root/lib/modules/$kver"
    "${as_root[@]}" cp -a "$keep/lib/modules/$kver" "$root/lib/modules/$kver"
    "${as_root[@]}" chroot "$root" depmod "$kver"
    # Trim what a test guest never reads.
    "${as_root[@]}" rm -rf "$root"/usr/share/{doc,man,info,locale} "$root"/var/cache/apt/* \
        "$root"/var/lib/apt/lists/* "$root"/usr/share/zoneinfo
    printf '%s' "$guest_init" | "${as_root[@]}" tee "$root/init" >/dev/null
    "${as_root[@]}" chmod 0755 "$root/init"
    (cd "$root" && "${as_root[@]}" find . -xdev -print0 | "${as_root[@]}" cpio --null -o -H newc --quiet) >"$work/initrd.cpio"
    echo "$kpkg $kver" >"$work/kernel"
    mkdir -p "$dest"
    mv "$work/vmlinuz" "$work/initrd.cpio" "$work/kernel" "$dest/"
    touch "$dest/ok"
    say "image built in $((SECONDS - t0)) s: $(du -sh "$dest/initrd.cpio" | cut -f1) initramfs, kernel $kver"
    "${as_root[@]}" rm -rf "$work"
    trap - EXIT
}
# --- recipe end ------------------------------------------------------------

recipe_hash() {
    sed -n '/^# --- recipe begin/,/^# --- recipe end/p' "$self" | sha256sum | cut -c1-16
}

cache_root() {
    if [ -n "${KVFERRY_VM_CACHE:-}" ]; then
        echo "$KVFERRY_VM_CACHE"
    elif mkdir -p /var/cache/kvferry-vm 2>/dev/null && [ -w /var/cache/kvferry-vm ]; then
        echo /var/cache/kvferry-vm
    else
        echo "${XDG_CACHE_HOME:-$HOME/.cache}/kvferry/vm"
    fi
}

# Why a guest cannot run here, or nothing.
no_guest_reason() {
    local why=()
    command -v qemu-system-x86_64 >/dev/null || why+=("qemu-system-x86_64 is not installed (apt: qemu-system-x86)")
    [ "$(uname -m)" = x86_64 ] || why+=("the host is $(uname -m), the guest image is amd64")
    local image
    image="$(cache_root)/$(recipe_hash)"
    if [ ! -f "$image/ok" ]; then
        command -v debootstrap >/dev/null || why+=("no cached image and debootstrap is not installed (apt: debootstrap)")
        command -v cpio >/dev/null || why+=("no cached image and cpio is not installed (apt: cpio)")
        if ((${#as_root[@]})) && ! sudo -n true 2>/dev/null; then
            why+=("no cached image and building one needs root or password-less sudo")
        fi
    fi
    ((${#why[@]})) && printf '%s; ' "${why[@]}"
    return 0
}

# Chooses kvm or tcg; prints "accel reason".
choose_accel() {
    case "${KVFERRY_VM_ACCEL:-}" in
    kvm | tcg)
        echo "$KVFERRY_VM_ACCEL KVFERRY_VM_ACCEL=$KVFERRY_VM_ACCEL"
        return
        ;;
    "") ;;
    *) die 2 "KVFERRY_VM_ACCEL must be kvm or tcg, not '$KVFERRY_VM_ACCEL'" ;;
    esac
    if [ ! -e /dev/kvm ]; then
        echo "tcg no /dev/kvm"
    elif [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then
        echo "tcg /dev/kvm is not read-writable by $(id -un)"
    elif [ -d /sys/module/kvm_pvm ]; then
        echo "tcg /dev/kvm is kvm_pvm, which runs only PVM-aware kernels, not Debian's"
    elif ! grep -qwE 'vmx|svm' /proc/cpuinfo; then
        echo "tcg the CPU has no vmx/svm (nested virtualisation is off)"
    else
        echo "kvm /dev/kvm with hardware virtualisation"
    fi
}

# Prints the image directory, building it first if needed.
image_dir() {
    local root dir
    root=$(cache_root)
    dir="$root/$(recipe_hash)"
    mkdir -p "$root"
    if [ ! -f "$dir/ok" ]; then
        # One builder at a time; the lock wait is bounded too.
        exec 9>"$root/.lock"
        flock -w 900 9 || die 3 "another vm.sh held $root/.lock for 15 minutes"
        if [ ! -f "$dir/ok" ]; then
            rm -rf "$dir"
            build_image "$dir" || die 3 "building the guest image failed"
        fi
        exec 9>&-
    fi
    echo "$dir"
}

case "${1:-}" in
--check)
    reason=$(no_guest_reason)
    [ -z "$reason" ] || die 2 "no guest can run here: ${reason%; }"
    echo "vm.sh: a guest can run here ($(choose_accel))"
    exit 0
    ;;
--build)
    reason=$(no_guest_reason)
    [ -z "$reason" ] || die 2 "no guest can run here: ${reason%; }"
    image_dir
    exit 0
    ;;
--*) die 2 "unknown option $1 (see the header of $self)" ;;
esac

read -r accel accel_why <<<"$(choose_accel)"
echo "vm.sh: accel=$accel ($accel_why)"
reason=$(no_guest_reason)
[ -z "$reason" ] || die 2 "no guest can run here: ${reason%; }"
image=$(image_dir)
say "image $image ($(cat "$image/kernel"))"

ctl=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-vm.XXXXXX")
qpid=
cleanup() {
    [ -z "$qpid" ] || kill -9 "$qpid" 2>/dev/null || true
    rm -rf "$ctl"
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM

# POSIX single-quoting (the guest runs the command file with dash, which
# does not read bash's $'...' from printf %q).
shq() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

# The command, with the caller's KVFERRY_* / RUST_* environment.
{
    echo "export KVFERRY_RDMA_DEVICE=rxe0 KVFERRY_RDMA_GID_INDEX=1 KVFERRY_RDMA_REQUIRE_DEVICE=1"
    while IFS= read -r name; do
        printf 'export %s=%s\n' "$name" "$(shq "${!name}")"
    done < <(compgen -e | grep -E '^(KVFERRY_|RUST_)' | grep -vE '^KVFERRY_VM_')
    if (($#)); then
        printf 'exec sh -c %s\n' "$(shq "$*")"
    else
        echo "exec ibv_devinfo -d rxe0"
    fi
} >"$ctl/cmd"
pwd >"$ctl/cwd"
case "$(pwd)/" in
"$checkout"/*) ;;
*) echo "$checkout" >"$ctl/cwd" ;;
esac

shares=(-virtfs "local,path=$ctl,mount_tag=ctl,security_model=none,id=ctl")
n=0
share() {
    [ -d "$1" ] || return 0
    shares+=(-virtfs "local,path=$1,mount_tag=s$n,security_model=none,readonly=on,id=s$n")
    echo "s$n $1" >>"$ctl/shares"
    n=$((n + 1))
}
: >"$ctl/shares"
share "$checkout"
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
    case "$(realpath -m "$CARGO_TARGET_DIR")/" in "$checkout"/*) ;; *) share "$(realpath "$CARGO_TARGET_DIR")" ;; esac
fi
share "${CARGO_HOME:-$HOME/.cargo}"
share "${RUSTUP_HOME:-$HOME/.rustup}"

accel_args=(-accel tcg,thread=multi -cpu max)
[ "$accel" = kvm ] && accel_args=(-accel kvm -cpu host)

boot_timeout=${KVFERRY_VM_BOOT_TIMEOUT:-180}
timeout=${KVFERRY_VM_TIMEOUT:-1200}
t0=$SECONDS
qemu-system-x86_64 -nodefaults -no-user-config -no-reboot -display none \
    "${accel_args[@]}" -smp "${KVFERRY_VM_CPUS:-2}" -m "${KVFERRY_VM_MEM:-3072}" \
    -kernel "$image/vmlinuz" -initrd "$image/initrd.cpio" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off" \
    -nic none -chardev stdio,id=con,signal=off -serial chardev:con \
    "${shares[@]}" </dev/null &
qpid=$!

booted=
while kill -0 "$qpid" 2>/dev/null; do
    elapsed=$((SECONDS - t0))
    if [ -z "$booted" ] && [ -s "$ctl/booted" ]; then
        booted=1
        say "guest up after ${elapsed} s (guest uptime $(cat "$ctl/booted") s), running the command"
    fi
    if [ -z "$booted" ] && ((elapsed > boot_timeout)); then
        say "HUNG: the guest did not finish booting within ${boot_timeout} s (KVFERRY_VM_BOOT_TIMEOUT); killed"
        exit 124
    fi
    if ((elapsed > timeout)); then
        say "HUNG: the guest command did not finish within ${timeout} s (KVFERRY_VM_TIMEOUT); killed"
        exit 124
    fi
    sleep 1
done
wait "$qpid" || true
qpid=
if [ ! -s "$ctl/rc" ]; then
    die 125 "the guest stopped after $((SECONDS - t0)) s without reporting the command's exit code (see the console output above)"
fi
rc=$(cat "$ctl/rc")
say "command exited with $rc after $((SECONDS - t0)) s"
exit "$rc"
