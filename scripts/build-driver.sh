#!/usr/bin/env bash
# Applies Valve's one-line lock patch to an open-gpu-kernel-modules source tree, builds the kernel
# modules and (with --install) installs them. It never loads, unloads or reloads a module: the new
# nvidia.ko takes effect when the operator reloads the driver with no GPU process running.
#
# Usage: scripts/build-driver.sh --src DIR [--install] [--kernel-headers DIR [--kernel-output DIR]] [--jobs N] [--force]
#   --src DIR             the source tree of the SAME version as the installed user-space driver
#   --install             make modules_install (and DKMS registration when dkms is present)
#   --kernel-headers DIR  kernel source headers (SYSSRC; default: those of the running kernel)
#   --kernel-output DIR   kernel build output (SYSOUT), for distributions that split the headers
#                         (Debian: SYSSRC=linux-headers-X-common, SYSOUT=linux-headers-X-amd64)
#   --force               build even if the source and installed driver versions differ
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
src="" install=0 headers="" output="" jobs="$(nproc)" force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --src) src="$2"; shift 2 ;;
    --install) install=1; shift ;;
    --kernel-headers) headers="$2"; shift 2 ;;
    --kernel-output) output="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-driver: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$src" ] || { echo "build-driver: --src DIR is required (see --help)" >&2; exit 2; }
die() { echo "build-driver: $*" >&2; exit 1; }

# 1. The source must match the user-space driver, or the module will refuse its clients.
src_version=$(sed -n 's/^NVIDIA_VERSION *= *//p' "$src/version.mk" 2>/dev/null || true)
installed=""
if [ -r /proc/driver/nvidia/version ]; then
  installed=$(grep -o '[0-9]\+\.[0-9]\+\(\.[0-9]\+\)\?' /proc/driver/nvidia/version | head -1)
elif command -v nvidia-smi >/dev/null; then
  installed=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
fi
echo "source tree: ${src_version:-unknown}; installed driver: ${installed:-none found}"
if [ -n "$installed" ] && [ "$installed" != "$src_version" ] && [ "$force" = 0 ]; then
  die "source version ${src_version:-unknown} != installed driver $installed: get the open-gpu-kernel-modules tag $installed (or rerun with --force if you will also install user space $src_version)"
fi

# 2. Kernel headers: given explicitly, or those of the running kernel (NVIDIA's makefile finds them).
make_args=()
if [ -n "$headers" ]; then
  [ -f "$headers/Makefile" ] || die "no kernel headers at $headers (--kernel-headers)"
  make_args+=("SYSSRC=$headers")
  [ -z "$output" ] || make_args+=("SYSOUT=$output")
else
  [ -f "/lib/modules/$(uname -r)/build/Makefile" ] || die "no kernel headers for the running kernel $(uname -r): install them (Debian/Ubuntu: apt-get install linux-headers-$(uname -r)) or pass --kernel-headers DIR"
fi

# 3. The patch (idempotent).
"$here/scripts/patch-driver.sh" --src "$src"

# 4. Build.
echo "building: make -C $src modules -j$jobs ${make_args[*]:-}"
make -C "$src" modules -j"$jobs" "${make_args[@]}"
ko="$src/kernel-open/nvidia.ko"
[ -f "$ko" ] || die "the build finished without $ko"
echo "built $ko"

# 5. Module signing: a kernel that enforces signatures will refuse an unsigned nvidia.ko.
enforce=0
if [ "$(cat /sys/module/module/parameters/sig_enforce 2>/dev/null)" = "Y" ]; then enforce=1; fi
sb=$(mokutil --sb-state 2>/dev/null || true)
case "$sb" in *enabled*) enforce=1 ;; esac
if [ "$enforce" = 1 ]; then
  cat <<MSG
NOTE: this kernel enforces module signatures (${sb:-module.sig_enforce=Y}). Sign the modules with YOUR key
before installing, e.g. with a key enrolled in MOK (mokutil --import key.der, then reboot and confirm):
  for m in $src/kernel-open/*.ko; do
    /lib/modules/\$(uname -r)/build/scripts/sign-file sha256 key.priv key.der "\$m"
  done
MSG
fi

# 6. Install.
if [ "$install" = 1 ]; then
  [ "$(id -u)" = 0 ] || die "--install needs root"
  make -C "$src" modules_install "${make_args[@]}"
  depmod -a
  if command -v dkms >/dev/null; then
    echo "dkms is present: register the patched tree as its own DKMS module if you want rebuilds on kernel updates (dkms add/build/install)"
  fi
  echo "installed. The running driver is unchanged."
fi
cat <<MSG
REMINDER: nothing was loaded. The patched driver takes effect only after the NVIDIA modules are
reloaded while NO process uses a GPU (stop GPU jobs and nvidia-persistenced, rmmod nvidia_uvm
nvidia_drm nvidia_modeset nvidia, modprobe nvidia), or after a reboot. Then 'valvectl doctor'
reports "patched: per-GPU lock" on hosts with 2 or more GPUs.
MSG
