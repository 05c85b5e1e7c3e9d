#!/usr/bin/env bash
# Builds XSched (its CUDA Level-1 shim libshimcuda.so and the xserver scheduler) on a GPU host
# from the tarball xsched_pack.sh makes; no internet needed. Prints the build's wall time.
#
# Usage: hwtests/serving/xsched_build.sh SRC.tar.gz INSTALL_DIR [JOBS]
#   cmake: the one on PATH, else the `cmake` wheel in .carry/whl (pip installs it to a temp dir)
#   PLATFORM=none builds without XSched's CUDA platform (xserver and the scheduler only)
# Leaves INSTALL_DIR/bin/xserver and INSTALL_DIR/lib/libshimcuda.so (with the libcuda.so.1 link).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
[ $# -ge 2 ] || { echo "usage: $0 SRC.tar.gz INSTALL_DIR [JOBS]" >&2; exit 2; }
tarball="$1"
install="$(mkdir -p "$2" && cd "$2" && pwd)"
jobs="${3:-$(nproc)}"
platform="${PLATFORM:-cuda}"
[ -f "$tarball" ] || { echo "xsched_build: $tarball: no such file (make it with xsched_pack.sh)" >&2; exit 1; }
t0=$(date +%s.%N)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! command -v cmake >/dev/null; then
  whl="$(ls "$root"/.carry/whl/cmake-*.whl 2>/dev/null | head -1 || true)"
  [ -n "$whl" ] || { echo "xsched_build: no cmake on PATH and no .carry/whl/cmake-*.whl" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --target "$work/cmake" "$whl"
  export PATH="$work/cmake/cmake/data/bin:$PATH"
fi
# XSched's CUDA platform carries its own CUDA headers and opens the driver's libcuda at run time:
# the build needs no CUDA toolkit (nor a GPU), only gcc.

tar -xzf "$tarball" -C "$work"
src="$work/xsched"
# XSched builds its own code with -Werror, and newer compilers warn where its compiler did not
# (gcc 12: range-loop-construct in utils/region.h): keep the warnings, not as errors.
grep -rl --include=CMakeLists.txt -e '-Werror' "$src" | grep -v '/3rdparty/ipc/' | xargs -r sed -i 's/^\( *\)-Werror$/\1/'
flags=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$install" -DSHIM_SOFTLINK=ON -DBUILD_TEST=OFF
       -DBUILD_SERVICE=ON -DCMAKE_POLICY_VERSION_MINIMUM=3.5)
[ "$platform" = cuda ] && flags+=(-DPLATFORM_CUDA=ON)
echo "== xsched: configure ($platform, cmake $(cmake --version | head -1 | awk '{print $3}'))"
cmake -S "$src" -B "$work/build" "${flags[@]}" > "$install/configure.log" 2>&1 ||
  { tail -30 "$install/configure.log"; echo "xsched_build: configure failed (see $install/configure.log)" >&2; exit 1; }
echo "== xsched: build, $jobs jobs"
cmake --build "$work/build" --target install -- -j"$jobs" > "$install/build.log" 2>&1 ||
  { grep -m5 -B2 -A5 "error" "$install/build.log" | head -40; echo "xsched_build: build failed (see $install/build.log)" >&2; exit 1; }
cp "$src/SOURCES.txt" "$install/SOURCES.txt"
missing=()
[ -x "$install/bin/xserver" ] || missing+=(bin/xserver)
[ "$platform" = cuda ] && { [ -e "$install/lib/libshimcuda.so" ] || missing+=(lib/libshimcuda.so); }
if [ ${#missing[@]} -gt 0 ]; then
  echo "xsched_build: built, but ${missing[*]} missing under $install" >&2
  exit 1
fi
echo "== xsched built in $(awk "BEGIN{printf \"%.0f\", $(date +%s.%N) - $t0}") s: $install"
