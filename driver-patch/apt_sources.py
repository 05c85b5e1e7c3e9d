#!/usr/bin/env python3
"""Prints a one-line-format apt sources list that is the machine's own Debian archive entries with
the `contrib` and `non-free` components added (Debian ships
nvidia-open-kernel-source in contrib), for a private `apt-get update` (Dir::Etc::SourceList). Reads
/etc/apt/sources.list and /etc/apt/sources.list.d/*.list|*.sources; writes no file itself and
never names an archive host: every address comes from the machine's configuration."""
import glob
import os
import sys


def one_line_entries(path):
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        words = line.split()[1:]
        opts = ""
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                opts += words.pop(0) + " "
            if not words:
                continue  # an unterminated [options] block: not an entry apt would use either
            opts += words.pop(0)
        if len(words) >= 3:
            yield opts, words[0], [words[1]], words[2:]


def deb822_entries(path):
    stanza = {}
    text = open(path, encoding="utf-8", errors="replace").read()
    for block in text.split("\n\n"):
        stanza = {}
        for line in block.splitlines():
            if line.startswith("#") or ":" not in line:
                continue
            key, value = line.split(":", 1)
            stanza[key.strip().lower()] = value.strip()
        if "deb" not in stanza.get("types", "").split() or stanza.get("enabled", "yes") == "no":
            continue
        opts = f"[signed-by={stanza['signed-by']}]" if stanza.get("signed-by", "").startswith("/") else ""
        for uri in stanza.get("uris", "").split():
            yield opts, uri, stanza.get("suites", "").split(), stanza.get("components", "").split()


def main():
    files = glob.glob("/etc/apt/sources.list") + sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
    entries = []
    for f in files:
        entries += list(one_line_entries(f))
    for f in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        entries += list(deb822_entries(f))
    out = []
    for opts, uri, suites, comps in entries:
        # Only archives that carry Debian's own components (main), not third-party repositories.
        if "main" not in comps or uri.rstrip("/").endswith("-security"):
            continue
        for suite in suites:
            wanted = list(dict.fromkeys(comps + ["contrib", "non-free"]))
            out.append(" ".join(x for x in ["deb", opts, uri, suite] + wanted if x))
    if not out:
        sys.exit("apt_sources.py: no Debian archive with a 'main' component in this machine's apt sources")
    print("\n".join(out))


if __name__ == "__main__":
    main()
