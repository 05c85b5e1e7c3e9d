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
# A toolchain that links libstdc++ statically (the GPU host's /opt/gcc 13.3 seems to: in its crash
# libstdc++.so.6 was loaded after libcudnn, not with the shim) puts a second libstdc++ into XSched's,
# and only the shim hides it (--exclude-libs,ALL); libpreempt.so and libhalcuda.so export it:
# std::locale::id::_S_refcount, std::locale::classic, and the facet ids as GNU-unique symbols, so
# the process's one std::num_put<char>::id is theirs, numbered by their copy's locale. The system
# libstdc++.so.6 that PyTorch loads later then indexes its own locale with those ids, and the first
# `ostream << long` in `import torch` calls std::codecvt<char16_t>::do_unshift: SIGSEGV. Hiding the
# static archives' symbols in every XSched library keeps each copy private; with a shared libstdc++
# the flag changes nothing. LDFLAGS from the environment still applies.
flags=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$install" -DSHIM_SOFTLINK=ON -DBUILD_TEST=OFF
       -DBUILD_SERVICE=ON -DCMAKE_POLICY_VERSION_MINIMUM=3.5
       "-DCMAKE_SHARED_LINKER_FLAGS=${LDFLAGS:+$LDFLAGS }-Wl,--exclude-libs,ALL")
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
# None of XSched's libraries may export libstdc++'s runtime (see the linker flag above).
if command -v nm >/dev/null; then
  for lib in "$install"/lib/lib*.so; do
    [ -L "$lib" ] && continue
    # operator new, __cxa_throw, std::locale's id counter and classic(): defined only by libstdc++
    if nm -D --defined-only "$lib" | grep -q -E ' (_Znwm|__cxa_throw|_ZNSt6locale2id11_S_refcountE|_ZNSt6locale7classicEv)$'; then
      echo "xsched_build: $lib exports libstdc++'s runtime (a static libstdc++ not hidden)" >&2
      exit 1
    fi
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "xsched_build: built, but ${missing[*]} missing under $install" >&2
  exit 1
fi
echo "== xsched built in $(awk "BEGIN{printf \"%.0f\", $(date +%s.%N) - $t0}") s: $install"
