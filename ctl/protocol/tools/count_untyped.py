#!/usr/bin/env python3
"""Counts json! calls and ["key"] lookups outside test code in the given crates (default: the
four that speak the protocol): the untyped protocol left. Test modules (`#[cfg(test)] mod x`,
inline or in their own file) do not count. Usage: ctl/protocol/tools/count_untyped.py [-v] [CRATE...]"""
import os, re, sys
KEY = re.compile(r'\[\s*"[A-Za-z_][A-Za-z0-9_]*"\s*\]')
def test_only_files(root):
    # files that are only compiled under cfg(test): declared as `#[cfg(test)] mod x;`
    out = set()
    for d, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith('.rs'): continue
            p = os.path.join(d, f)
            src = open(p).read()
            for m in re.finditer(r'#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+(\w+)\s*;', src):
                name = m.group(1)
                base = p[:-3] if not f in ('mod.rs','lib.rs','main.rs') else d
                for cand in (os.path.join(base, name + '.rs'), os.path.join(base, name)):
                    if f in ('mod.rs','lib.rs','main.rs'):
                        cand = cand.replace(base, d)
                    out.add(os.path.normpath(cand))
    return out
def strip_test_mods(src):
    out, i = [], 0
    for m in re.finditer(r'#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+\w+\s*\{', src):
        if m.start() < i: continue
        out.append(src[i:m.start()])
        depth, j = 1, m.end()
        while depth and j < len(src):
            depth += {'{':1,'}':-1}.get(src[j],0); j += 1
        i = j
    out.append(src[i:])
    return ''.join(out)
tot_j = tot_k = 0
verbose = '-v' in sys.argv
crates = [a for a in sys.argv[1:] if a != '-v'] or [
    'ctl/daemon', 'ctl/valvectl', 'ctl/client', 'ctl/client-py']
for root in crates:
    root = os.path.join(root, 'src')
    skip = test_only_files(root)
    for d, _, fs in os.walk(root):
        for f in sorted(fs):
            p = os.path.normpath(os.path.join(d, f))
            if not p.endswith('.rs') or any(p == s or p.startswith(s + '/') for s in skip): continue
            src = strip_test_mods(open(p).read())
            j = src.count('json!'); k = len(KEY.findall(src))
            if verbose and (j or k): print(f'{j:4} {k:4} {p}')
            tot_j += j; tot_k += k
print(f'json!: {tot_j}  ["key"]: {tot_k}')
