#!/usr/bin/env bash
# Packs XSched's source with its submodules at the commits it pins into one tarball, for a GPU host
# with no internet (xsched_build.sh builds it there). The source is read from bare git mirrors.
#
# Usage: hwtests/serving/xsched_pack.sh MIRRORS OUT.tar.gz
#   MIRRORS   a directory of bare clones named OWNER+NAME/repo (XpuOS+xsched/repo, ...)
# A submodule missing from MIRRORS is left empty and named in SOURCES.txt; XSched's own `ipc`
# library is replaced by the stand-in in hwtests/serving/xsched_ipc (same interface).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
[ $# -eq 2 ] || { echo "usage: $0 MIRRORS OUT.tar.gz" >&2; exit 2; }
mirrors="$1"
out="$2"
main="$mirrors/XpuOS+xsched/repo"
[ -d "$main" ] || { echo "xsched_pack: no bare clone at $main (fetch github:XpuOS/xsched first)" >&2; exit 1; }

# Upstream repositories of the forks XSched pins (the pinned commits are upstream ones).
declare -A upstream=(
  [CLI11]=CLIUtils+CLI11 [cpp-httplib]=yhirose+cpp-httplib [jsoncpp]=open-source-parsers+jsoncpp
  [ftxui]=ArthurSonzogni+FTXUI [cuxtra]=XpuOS+cuxtra
)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
src="$tmp/xsched"

# Every blob of COMMIT of bare repo GIT into DIR; blobs the mirror lacks are listed, not fatal.
extract() {
  local git="$1" commit="$2" dir="$3" mode type obj path
  mkdir -p "$dir"
  git --git-dir="$git" ls-tree -r "$commit" | while read -r mode type obj path; do
    [ "$type" = blob ] || continue
    case "$path" in docs/*|*.pdf|*.png|*.jpg|*.gif) continue ;; esac
    mkdir -p "$dir/$(dirname "$path")"
    if ! git --git-dir="$git" cat-file blob "$obj" > "$dir/$path" 2>/dev/null; then
      rm -f "$dir/$path"
      echo "  missing blob: $path"
    fi
    if [ "$mode" = 100755 ]; then chmod +x "$dir/$path"; fi
  done
}

head="$(git --git-dir="$main" rev-parse HEAD)"
echo "xsched $head" > "$tmp/SOURCES.txt"
extract "$main" "$head" "$src" | tee -a "$tmp/SOURCES.txt"
git --git-dir="$main" ls-tree "$head" 3rdparty/ | awk '$2=="commit"{print $3, $4}' |
while read -r commit path; do
  name="${path#3rdparty/}"
  repo="${upstream[$name]:-}"
  if [ "$name" = ipc ]; then
    cp -r "$here/xsched_ipc/." "$src/$path/"
    echo "ipc: the stand-in of hwtests/serving/xsched_ipc (XpuOS/ipc $commit not available)" >> "$tmp/SOURCES.txt"
  elif [ -n "$repo" ] && git --git-dir="$mirrors/$repo/repo" cat-file -e "$commit^{commit}" 2>/dev/null; then
    extract "$mirrors/$repo/repo" "$commit" "$src/$path" >> "$tmp/SOURCES.txt"
    echo "$name: $repo $commit" >> "$tmp/SOURCES.txt"
  else
    echo "$name: MISSING ($commit not in ${repo:-any mirror})" >> "$tmp/SOURCES.txt"
  fi
done
cp "$tmp/SOURCES.txt" "$src/SOURCES.txt"
mkdir -p "$(dirname "$out")"
tar -C "$tmp" -czf "$out" xsched
echo "$out: $(du -h "$out" | cut -f1)"
cat "$tmp/SOURCES.txt" | grep -v "^  missing" || true
