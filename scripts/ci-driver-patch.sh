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
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "SKIP: the driver-patch CI needs root and apt-get"; exit 0
fi
work="${VALVE_DRIVER_CI_DIR:-/var/tmp/valve-driver-ci}"
mkdir -p "$work/lists/partial" "$work/src"
start=$(date +%s)

python3 "$repo/driver-patch/apt_sources.py" > "$work/sources.list"
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
if cmp -s "$work/unpatched.o" "$tree/src/nvidia/$obj"; then
  echo "ci-driver-patch: the patched object is identical to the unpatched one"; exit 1
fi
echo "compiled the patched translation unit ($obj); it differs from the unpatched object"
echo "driver-patch CI passed in $(( $(date +%s) - start )) s"
