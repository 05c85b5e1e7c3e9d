#!/usr/bin/env bash
# CI proof of the driver patch on a real tree: fetch Debian 12's open-gpu-kernel-modules source
# package through a private apt setup (archive addresses read from this machine's own apt sources;
# the machine's apt configuration is not changed), apply the patch, check it, compare its hash
# with driver-patch/releases.tsv, and compile the patched translation unit with the tree's own
# build rules (unpatched and patched, to show the change reaches the object file).
# It also downloads the binary package nvidia-open-kernel-source (the same upstream version) and
# checks that the applier refuses it: that package ships the resource manager prebuilt
# (nv-kernel.o_binary), so it cannot carry the patch; the source package can.
# Skips (exit 0) when not root or without apt. Work dir: $VALVE_DRIVER_CI_DIR or /var/tmp/valve-driver-ci.
#
# --full (not run by the test script; about 5 minutes on 2 cores): also install linux-headers-amd64
# (an ordinary apt-get install from the machine's own configuration) and build every module of the
# patched tree against those headers, then check that nvidia.ko carries the patched flags.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
full=0
case "${1:-}" in
  --full) full=1 ;;
  "") ;;
  *) echo "usage: scripts/ci-driver-patch.sh [--full]" >&2; exit 2 ;;
esac
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "SKIP: the driver-patch CI needs root and apt-get"; exit 0
fi
work="${VALVE_DRIVER_CI_DIR:-/var/tmp/valve-driver-ci}"
mkdir -p "$work/lists/partial" "$work/src"
start=$(date +%s)

"$repo/scripts/patch-driver.sh" apt-sources > "$work/sources.list"
sed 's/^deb /deb-src /' "$work/sources.list" >> "$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
mkdir -p "$work/cache/archives/partial"
apt-get -qq "${apt_opts[@]}" update
pkg=nvidia-open-gpu-kernel-modules
version=$(apt-cache "${apt_opts[@]}" showsrc "$pkg" | sed -n 's/^Version: //p' | head -1)
upstream=${version%-*}
[ -n "$upstream" ] || { echo "ci-driver-patch: no source package $pkg in this machine's archives (contrib)"; exit 1; }
orig="$work/src/${pkg}_${upstream}.orig.tar.xz"
if [ ! -f "$orig" ]; then
  # Only the upstream tarball is needed; the Debian packaging part may be unavailable.
  (cd "$work/src" && apt-get -qq "${apt_opts[@]}" source --download-only "$pkg" >/dev/null 2>&1 || true)
fi
[ -f "$orig" ] || { echo "ci-driver-patch: could not download $orig"; exit 1; }
tree="$work/tree"
rm -rf "$tree" && mkdir -p "$tree"
tar -C "$tree" --strip-components=1 -xf "$orig"
echo "source: Debian $pkg $version ($(du -sh "$orig" | cut -f1) tarball), fetched in $(( $(date +%s) - start )) s"

# Compile the translation unit before patching, for comparison.
obj=_out/Linux_x86_64/g_subdevice_nvoc.o
make -s -C "$tree/src/nvidia" "$obj" -j"$(nproc)" >/dev/null
cp "$tree/src/nvidia/$obj" "$work/unpatched.o"

set +e
"$repo/scripts/patch-driver.sh" --src "$tree" --check; rc=$?
set -e
[ "$rc" = 10 ] || { echo "ci-driver-patch: --check on the pristine tree gave $rc, expected 10 (not patched)"; exit 1; }
"$repo/scripts/patch-driver.sh" --src "$tree" --emit-patch "$work/valve.patch"
"$repo/scripts/patch-driver.sh" --src "$tree" --check
second=$("$repo/scripts/patch-driver.sh" --src "$tree")
echo "$second" | grep -q "already patched" || { echo "ci-driver-patch: second run was not a no-op"; exit 1; }
sha=$(sha256sum "$work/valve.patch" | cut -d' ' -f1)
want=$(awk -F'\t' -v v="$upstream" '$1 == v && $8 ~ /^Debian/ {print $7}' "$repo/driver-patch/releases.tsv")
[ "$sha" = "$want" ] || { echo "ci-driver-patch: patch sha256 $sha != releases.tsv ${want:-<none for $upstream>}"; exit 1; }
echo "patch hash matches releases.tsv ($sha)"

# The binary package: apt-get download, unpack only what the applier looks at, expect a refusal (3).
mkdir -p "$work/bin"
deb=$(ls "$work"/bin/nvidia-open-kernel-source_*.deb 2>/dev/null | head -1 || true)
if [ -z "$deb" ]; then
  (cd "$work/bin" && apt-get -qq "${apt_opts[@]}" download nvidia-open-kernel-source)
  deb=$(ls "$work"/bin/nvidia-open-kernel-source_*.deb | head -1)
fi
rm -rf "$work/bin/tree" && mkdir -p "$work/bin/tree"
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/bin" ./usr/src/nvidia-open-kernel.tar.xz
tar -C "$work/bin/tree" -xf "$work/bin/usr/src/nvidia-open-kernel.tar.xz" --wildcards '*/nvidia/nv-kernel.o_binary' '*/Makefile'
set +e
"$repo/scripts/patch-driver.sh" --src "$work/bin/tree" --check >"$work/bin/out" 2>&1; rc=$?
set -e
[ "$rc" = 3 ] || { cat "$work/bin/out"; echo "ci-driver-patch: $(basename "$deb") gave exit $rc, expected 3 (refused)"; exit 1; }
echo "$(basename "$deb") (prebuilt RM) is refused as expected: $(head -c 120 "$work/bin/out")..."

make -s -C "$tree/src/nvidia" "$obj" -j"$(nproc)" >/dev/null
row=$(awk -F'\t' -v v="$upstream" '$1 == v && $8 ~ /^Debian/ {print $4, $5}' "$repo/driver-patch/releases.tsv")
old_flags=${row% *} new_flags=${row#* }
before=$("$repo/scripts/patch-driver.sh" entry-flags "$work/unpatched.o")
after=$("$repo/scripts/patch-driver.sh" entry-flags "$tree/src/nvidia/$obj")
[ "$before" = "$old_flags" ] && [ "$after" = "$new_flags" ] \
  || { echo "ci-driver-patch: compiled entry flags $before -> $after, expected $old_flags -> $new_flags"; exit 1; }
echo "compiled $obj with the tree's own rules: the entry's flags are $before unpatched, $after patched"

if [ "$full" = 1 ]; then
  if ! ls -d /usr/src/linux-headers-*-amd64 >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get -qq install -y linux-headers-amd64 >/dev/null
  fi
  sysout=$(ls -d /usr/src/linux-headers-*-amd64 | sort -V | tail -1)
  syssrc=${sysout%-amd64}-common
  # Recent Debian 6.1 kernels (6.1.192 here) have a backported 4-argument pci_resize_resource() that
  # 535.261.03's kernel-open does not know (Debian's packaging fixes it). Build-only adaptation of
  # this scratch copy, unrelated to the patch; the module is never loaded.
  if grep -q 'int exclude_bars' "$syssrc/include/linux/pci.h" 2>/dev/null; then
    sed -i 's/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size);/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size, 0);/' \
      "$tree/kernel-open/nvidia/nv-pci.c"
    echo "NOTE: adapted kernel-open/nvidia/nv-pci.c to the headers' 4-argument pci_resize_resource (build only)"
  fi
  echo "full build: make modules -j$(nproc) SYSSRC=$syssrc SYSOUT=$sysout"
  t0=$(date +%s)
  make -C "$tree" modules -j"$(nproc)" SYSSRC="$syssrc" SYSOUT="$sysout" >"$work/full-build.log" 2>&1 \
    || { tail -20 "$work/full-build.log"; echo "ci-driver-patch: full build failed (log: $work/full-build.log)"; exit 1; }
  ko_flags=$("$repo/scripts/patch-driver.sh" entry-flags "$tree/kernel-open/nvidia.ko")
  [ "$ko_flags" = "$new_flags" ] || { echo "ci-driver-patch: nvidia.ko carries flags $ko_flags, expected $new_flags"; exit 1; }
  echo "full build passed in $(( $(date +%s) - t0 )) s: $(ls "$tree"/kernel-open/*.ko | wc -l) modules; nvidia.ko carries flags $ko_flags"
fi
echo "driver-patch CI passed in $(( $(date +%s) - start )) s"
