#!/usr/bin/env bash
# Builds Valve's Debian packages with cargo-deb from release builds:
#   target/debian/valvectl_<version>_amd64.deb         valvectl, valve.service, /etc/valve/valve.toml
#   target/debian/valve-scheduler_<version>_amd64.deb  valve-scheduler, valve-sim
# and prints their paths. Installs the pinned cargo-deb first if it is missing. Install with
#   sudo apt install ./target/debian/valvectl_*.deb ./target/debian/valve-scheduler_*.deb
# Options: --profile NAME packages another cargo profile's binaries (scripts/ci-package.sh uses
# dev, the build `cargo test` made); --fast compresses less (quicker, larger packages).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
deb_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=${2:?--profile needs a cargo profile, e.g. release or dev}; shift 2 ;;
    --fast) deb_flags+=(--fast); shift ;;
    *) echo "package: unknown option '$1' (use --profile NAME, --fast)" >&2; exit 2 ;;
  esac
done

# 3.8.0 builds with Rust 1.85, the workspace's oldest supported toolchain.
cargo_deb_version=3.8.0
have=$(cargo deb --version 2>/dev/null || true)
if [ "$have" != "cargo-deb $cargo_deb_version" ]; then
  echo "package: installing cargo-deb $cargo_deb_version (found: ${have:-none})"
  cargo install --locked cargo-deb --version "$cargo_deb_version"
fi
# cargo-deb fills in the packages' library dependencies ($auto) with dpkg-shlibdeps.
if ! command -v dpkg-shlibdeps >/dev/null; then
  echo "package: dpkg-shlibdeps not found: install dpkg-dev (scripts/setup-debian.sh does)" >&2
  exit 1
fi

echo "package: cargo build --profile $profile -p valvectl -p valve-scheduler -p valve-sim"
cargo build --profile "$profile" --locked -p valvectl -p valve-scheduler -p valve-sim
# cargo-deb warns that a dev profile is not for releases: scripts/ci-package.sh knows, and
# checks the packaging with those binaries only to reuse the test build.
if [ "$profile" = dev ]; then deb_flags+=(--quiet); fi
mkdir -p target/debian
rm -f target/debian/valvectl_*.deb target/debian/valve-scheduler_*.deb
for p in valvectl valve-scheduler; do
  # --no-build: the build above made every binary in one cargo run. --strip: the release
  # profile keeps line tables (for profiling), which would make the package 8x larger.
  cargo deb --no-build --locked --strip --profile "$profile" "${deb_flags[@]}" -p "$p" \
    -o target/debian/ >/dev/null
done
ls target/debian/valvectl_*.deb target/debian/valve-scheduler_*.deb
