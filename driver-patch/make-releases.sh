#!/usr/bin/env bash
# Prints rows of driver-patch/releases.tsv by running the applier on real, UNPATCHED source trees
# (copies are patched in a temporary directory; the trees given are not changed).
# Usage: driver-patch/make-releases.sh [--header] SOURCE_LABEL=TREE...
#   e.g. driver-patch/make-releases.sh --header "open-gpu-kernel-modules tag 580.142=/tmp/t/580.142"
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
applier="$here/../scripts/patch-driver.sh"
file=src/nvidia/generated/g_subdevice_nvoc.c
if [ "${1:-}" = --header ]; then
  printf 'version\tfile\tmethod_id\told_flags\tnew_flags\tflag_added\tpatch_sha256\tsource\n'
  shift
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for arg in "$@"; do
  label=${arg%%=*} tree=${arg#*=}
  rm -rf "$tmp/t" && mkdir -p "$tmp/t/$(dirname "$file")" "$tmp/t/src/nvidia/inc/kernel/rmapi"
  cp "$tree/version.mk" "$tmp/t/"
  cp "$tree/$file" "$tmp/t/$file"
  cp "$tree/src/nvidia/inc/kernel/rmapi/control.h" "$tmp/t/src/nvidia/inc/kernel/rmapi/"
  set +e
  out=$("$applier" --src "$tmp/t" --emit-patch "$tmp/p" 2>&1); rc=$?
  set -e
  version=$(sed -n 's/^driver \([^:]*\):.*/\1/p' <<<"$out")
  if [ "$rc" != 0 ]; then
    version=$(sed -n 's/^NVIDIA_VERSION *= *//p' "$tree/version.mk")
    old=$(grep -A3 "FifoDisableChannels_IMPL,$" "$tree/$file" | sed -n 's/.*\/\*flags=\*\/ *\(0x[0-9a-f]*\)u,.*/\1/p' | head -1)
    printf '%s\t%s\t0x2080110b\t%s\t-\t-\t-\t%s: %s\n' "$version" "$file" "${old:--}" "$label" \
      "the applier refuses it with exit $rc; see docs/driver-patch.md"
    continue
  fi
  old=$(sed -n 's/^old flags \(0x[0-9a-f]*\);.*/\1/p' <<<"$out")
  new=$(sed -n 's/.*new flags \(0x[0-9a-f]*\)$/\1/p' <<<"$out")
  flag=$(sed -n 's/^old flags [^;]*; \([A-Z_]*\) = .*/\1/p' <<<"$out")
  printf '%s\t%s\t0x2080110b\t%s\t%s\t%s\t%s\t%s\n' "$version" "$file" "$old" "$new" "$flag" \
    "$(sha256sum "$tmp/p" | cut -d' ' -f1)" "$label"
done
