#!/usr/bin/env bash
# Installs what building and testing Valve needs on Debian 12 / Ubuntu 22.04+: the C toolchain and
# clang for the BPF programs, libelf/zlib for libbpf, pkg-config, python3 for the benchmarks' self-tests,
# and Slurm (22.05 on Debian 12: slurmctld, slurmd, clients, slurmrestd) for the scheduler's local test cluster
# (scripts/slurm-local.sh), and dpkg-dev for the Debian packages (scripts/package.sh). Installing
# Slurm pulls in munge; nothing is started without systemd.
# Rust itself (>= 1.85, with rustfmt and clippy) comes from rustup and is not installed here.
set -euo pipefail

packages=(build-essential clang llvm libelf-dev zlib1g-dev pkg-config linux-libc-dev ca-certificates xz-utils python3
          slurmctld slurmd slurm-client slurmrestd dpkg-dev)

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then sudo_cmd=(sudo); else
    echo "setup: run as root (or install sudo): apt-get needs it" >&2; exit 1
  fi
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: system packages already present"
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found: install Rust >= 1.85 with rustup (https://rustup.rs), then run 'cargo build --release'" >&2
  exit 1
fi
rustc_minor=$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')
if [ "${rustc_minor:-0}" -lt 85 ]; then
  echo "setup: $(rustc --version) is too old: Valve needs Rust >= 1.85 (rustup update)" >&2
  exit 1
fi
echo "setup: ok ($(rustc --version))"
