#!/usr/bin/env bash
# Applies Valve's one-line lock patch to an open-gpu-kernel-modules source tree, builds the kernel
# modules and (with --install) installs them. It never loads, unloads or reloads a module: the new
# nvidia.ko takes effect when the operator reloads the driver with no GPU process running.
#
# Usage: scripts/build-driver.sh --src DIR [--install] [options]
#   --src DIR             the source tree of the SAME version as the installed user-space driver
#   --install             make modules_install + depmod (root); see below for DKMS
#   --sign-key KEY --sign-cert CERT
#                         sign kernel-open/*.ko with YOUR key (PEM private key, DER/PEM certificate
#                         enrolled in MOK) through the kernel's scripts/sign-file, before installing
#   --kernel-headers DIR  kernel source headers (SYSSRC; default: those of the running kernel)
#   --kernel-output DIR   kernel build output (SYSOUT), for distributions that split the headers
#                         (Debian: SYSSRC=linux-headers-X-common, SYSOUT=linux-headers-X-amd64)
#   --jobs N              make -j N (default: nproc)
#   --force               build even if the source and installed driver versions differ
#   --allow-unsigned      install unsigned modules although this kernel enforces signatures
#                         (they will not load: only for installing into another boot's trust)
# Exit: 0 built (and installed); 1 a check failed (message says which); 2 usage; the applier's own
# exit code (3 proprietary tree, 4 unsupported tree) when it refuses the tree.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
src="" install=0 headers="" output="" jobs="$(nproc)" force=0 key="" cert="" allow_unsigned=0
usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
need() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "build-driver: $1 needs a value (see --help)" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --src) need "$@"; src="$2"; shift 2 ;;
    --install) install=1; shift ;;
    --sign-key) need "$@"; key="$2"; shift 2 ;;
    --sign-cert) need "$@"; cert="$2"; shift 2 ;;
    --kernel-headers) need "$@"; headers="$2"; shift 2 ;;
    --kernel-output) need "$@"; output="$2"; shift 2 ;;
    --jobs) need "$@"; jobs="$2"; shift 2 ;;
    --force) force=1; shift ;;
    --allow-unsigned) allow_unsigned=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build-driver: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$src" ] || { echo "build-driver: --src DIR is required (see --help)" >&2; exit 2; }
{ [ -n "$key" ] && [ -n "$cert" ]; } || { [ -z "$key" ] && [ -z "$cert" ]; } \
  || { echo "build-driver: --sign-key and --sign-cert go together" >&2; exit 2; }
die() { echo "build-driver: $*" >&2; exit 1; }
[ -d "$src/src/nvidia" ] && [ -d "$src/kernel-open" ] \
  || die "$src is not an open-gpu-kernel-modules tree (no src/nvidia and kernel-open); patch-driver.sh --src $src --check says why"

# 1. The source must match the user-space driver: the kernel module refuses clients of another version.
src_version=$(sed -n 's/^NVIDIA_VERSION *= *//p' "$src/version.mk" 2>/dev/null | head -1 || true)
loaded="" userspace=""
if [ -r /proc/driver/nvidia/version ]; then
  # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...": first dotted number.
  loaded=$(awk '/NVRM version/ { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+[.][0-9]+([.][0-9]+)?$/) { print $i; exit } }' \
    /proc/driver/nvidia/version || true)
fi
if command -v nvidia-smi >/dev/null; then
  userspace=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
fi
echo "source tree: ${src_version:-unknown}; loaded kernel module: ${loaded:-none}; nvidia-smi: ${userspace:-not available}"
for v in "$loaded" "$userspace"; do
  if [ -n "$v" ] && [ "$v" != "$src_version" ] && [ "$force" = 0 ]; then
    die "source version ${src_version:-unknown} != installed driver $v: get the open-gpu-kernel-modules tag $v (or rerun with --force if you will also install user space ${src_version:-of that version})"
  fi
done
[ -n "$loaded$userspace" ] || echo "NOTE: no installed NVIDIA driver found to compare with; make sure user space will be ${src_version:-the same version}"

# 1b. GSP. The open module runs every GPU through GSP firmware (Turing and newer only) and the patch relies on it:
# on a GPU without GSP the control returns NOT_SUPPORTED with or without the patch. Warn (the tree cannot tell):
# a proprietary module loaded now means the install would switch this machine to the open module.
if [ -r /proc/driver/nvidia/version ] && ! grep -q "Open Kernel Module" /proc/driver/nvidia/version; then
  echo "WARNING: the loaded NVIDIA module is the proprietary one. Installing the patched open module replaces it: it supports only"
  echo "         Turing and newer GPUs and always runs them with GSP firmware. Check every GPU here before installing."
fi
fw_dirs="/lib/firmware $(cat /sys/module/firmware_class/parameters/path 2>/dev/null || true)"
if [ -n "$src_version" ] && ! ls $(for d in $fw_dirs; do echo "$d/nvidia/$src_version/gsp_"'*.bin'; done) >/dev/null 2>&1; then
  echo "WARNING: no GSP firmware for $src_version (nvidia/$src_version/gsp_*.bin under: $fw_dirs). The open module cannot"
  echo "         start a GPU without it; it comes with the user-space driver package of the same version."
fi

# 2. Kernel headers: given explicitly, or those of the running kernel (NVIDIA's makefile finds them).
make_args=()
kbuild="/lib/modules/$(uname -r)/build"
if [ -n "$headers" ]; then
  [ -f "$headers/Makefile" ] || die "no kernel headers at $headers (--kernel-headers)"
  make_args+=("SYSSRC=$headers")
  [ -z "$output" ] || make_args+=("SYSOUT=$output")
  kbuild="${output:-$headers}"
else
  [ -f "$kbuild/Makefile" ] || die "no kernel headers for the running kernel $(uname -r) ($kbuild): install them (Debian/Ubuntu: apt-get install linux-headers-$(uname -r)) or pass --kernel-headers DIR"
fi

# 3. Module signing: does this kernel refuse unsigned modules?
enforce="" sb=""
[ "$(cat /sys/module/module/parameters/sig_enforce 2>/dev/null)" = "Y" ] && enforce="module.sig_enforce=Y"
grep -qs '^CONFIG_MODULE_SIG_FORCE=y' "/boot/config-$(uname -r)" && enforce="${enforce:+$enforce, }CONFIG_MODULE_SIG_FORCE=y"
lockdown=$(grep -o '\[[a-z]*\]' /sys/kernel/security/lockdown 2>/dev/null | tr -d '[]' || true)
[ -n "$lockdown" ] && [ "$lockdown" != none ] && enforce="${enforce:+$enforce, }lockdown=$lockdown"
if command -v mokutil >/dev/null; then
  sb=$(mokutil --sb-state 2>/dev/null | head -1 || true)
  case "$sb" in *enabled*) enforce="${enforce:+$enforce, }$sb" ;; esac
fi
[ "$(cat /proc/sys/kernel/modules_disabled 2>/dev/null)" = 1 ] && echo "WARNING: /proc/sys/kernel/modules_disabled is 1: no module can be loaded until reboot"
sign_file="$kbuild/scripts/sign-file"
if [ -n "$enforce" ]; then
  echo "this kernel enforces module signatures ($enforce)"
  if [ -z "$key" ]; then
    cat <<MSG
The patched modules must be signed with YOUR OWN key, enrolled in the machine's MOK list, or they
will not load. Once per machine:
  openssl req -new -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=\$(hostname) NVIDIA module signing/" \\
      -keyout /root/mok/valve-mok.priv -outform DER -out /root/mok/valve-mok.der
  mokutil --import /root/mok/valve-mok.der   # set a one-time password, reboot, confirm in MokManager
Then rerun with --sign-key /root/mok/valve-mok.priv --sign-cert /root/mok/valve-mok.der, which runs
  $sign_file sha256 KEY CERT MODULE.ko   for each kernel-open/*.ko
MSG
    if [ "$install" = 1 ] && [ "$allow_unsigned" = 0 ]; then
      die "refusing to install unsigned modules on a kernel that enforces signatures: the driver would fail to load at the next reload or boot (use --sign-key/--sign-cert, or --allow-unsigned if you know why)"
    fi
  fi
fi
if [ -n "$key" ]; then
  [ -r "$key" ] && [ -r "$cert" ] || die "cannot read --sign-key $key or --sign-cert $cert"
  [ -x "$sign_file" ] || die "no $sign_file in the kernel headers; install the headers package that ships scripts/sign-file"
fi

# 4. The patch (idempotent; refuses trees it does not understand, with its own exit code).
set +e
"$here/scripts/patch-driver.sh" --src "$src"; rc=$?
set -e
[ "$rc" = 0 ] || { echo "build-driver: the patch was not applied (patch-driver.sh exit $rc); nothing built" >&2; exit "$rc"; }

# 5. Build.
echo "building: make -C $src modules -j$jobs ${make_args[*]:-}"
start=$(date +%s)
make -C "$src" modules -j"$jobs" "${make_args[@]}"
ko="$src/kernel-open/nvidia.ko"
[ -f "$ko" ] || die "the build finished without $ko"
echo "built $ko and the other kernel-open/*.ko in $(( $(date +%s) - start )) s"
"$here/scripts/patch-driver.sh" --src "$src" --check >/dev/null || die "the tree no longer reads as patched after the build"

# 6. Sign (before installing, so the installed files are the signed ones).
if [ -n "$key" ]; then
  for m in "$src"/kernel-open/*.ko; do
    "$sign_file" sha256 "$key" "$cert" "$m"
    echo "signed $m"
  done
fi

# 7. Install.
if [ "$install" = 1 ]; then
  [ "$(id -u)" = 0 ] || die "--install needs root"
  marker=$(mktemp); trap 'rm -f "$marker"' EXIT
  make -C "$src" modules_install "${make_args[@]}"
  depmod -a "$(uname -r)"
  echo "installed the patched modules for kernel $(uname -r). The running driver is unchanged."
  # Another nvidia.ko (DKMS puts its own in updates/, which depmod prefers) may shadow the one just installed:
  # check what modprobe would load, and that it carries the patched flags.
  if command -v modinfo >/dev/null; then
    resolved=$(modinfo -k "$(uname -r)" -n nvidia 2>/dev/null || true)
    if [ -z "$resolved" ] || [ ! "$resolved" -nt "$marker" ]; then
      echo "WARNING: modprobe would load ${resolved:-no nvidia module}, not the module just installed: remove or move that"
      echo "         file (or its DKMS module, see below), run depmod -a $(uname -r), and rerun this script."
    elif [ "${resolved%.ko}" != "$resolved" ]; then
      want=$("$here/scripts/patch-driver.sh" --src "$src" --check 2>/dev/null | sed -n 's/.*new flags \(0x[0-9a-f]*\)$/\1/p')
      got=$("$here/scripts/patch-driver.sh" entry-flags "$resolved" 2>/dev/null || true)
      [ "$got" = "$want" ] && echo "modprobe will load $resolved, which carries the patched flags $got" \
        || echo "WARNING: $resolved carries flags ${got:-unreadable}, expected $want"
    else
      echo "modprobe will load $resolved (the module just installed; compressed, flags not read)"
    fi
  fi
  if command -v dkms >/dev/null; then
    managed=$(dkms status 2>/dev/null | grep -i '^nvidia' || true)
    if [ -n "$managed" ]; then
      cat <<MSG
DKMS manages an NVIDIA module here:
$managed
DKMS rebuilds its own (unpatched) source on every kernel update and may overwrite these modules.
Patch the DKMS source too, then rebuild through DKMS (same version required):
  $here/scripts/patch-driver.sh --src /usr/src/nvidia-${src_version} --check   # exit 3: prebuilt RM, cannot be patched
  $here/scripts/patch-driver.sh --src /usr/src/nvidia-${src_version}
  dkms build nvidia/${src_version} --force && dkms install nvidia/${src_version} --force
If the DKMS source has a prebuilt resource manager (exit 3), remove the DKMS module
(dkms remove nvidia/${src_version} --all) and rerun this script after each kernel update.
MSG
    else
      echo "dkms is present but manages no NVIDIA module: rerun this script after each kernel update."
    fi
  fi
fi
cat <<MSG
REMINDER: nothing was loaded or unloaded. The patched driver takes effect only after the NVIDIA
modules are reloaded while NO process uses a GPU (stop GPU jobs, nvidia-persistenced and the
display manager; then rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia; modprobe nvidia), or
after a reboot. Then 'valvectl doctor' reports "patched: per-GPU lock" on hosts with 2 or more GPUs.
MSG
