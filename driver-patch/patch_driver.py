#!/usr/bin/env python3
"""Valve's one-line driver patch: add a lock flag to the FIFO_DISABLE_CHANNELS (0x2080110b) entry of
an open-gpu-kernel-modules tree, so RM takes only the target GPU's lock for it instead of every GPU's.

The entry is found by its method id, the flag's bit is read from the same tree's control.h, exactly
one line changes, and a second run changes nothing. See docs/driver-patch.md for why this flag and
why a tree whose entry lacks API_LOCK_READONLY (the 525 branch) is refused."""
import argparse
import difflib
import hashlib
import os
import re
import sys

METHOD_ID = 0x2080110B
GENERATED = "src/nvidia/generated/g_subdevice_nvoc.c"
CONTROL_H = "src/nvidia/inc/kernel/rmapi/control.h"
FLAGS = {
    "gpu-lock-device-only": "RMCTRL_FLAGS_GPU_LOCK_DEVICE_ONLY",
    "route-to-physical": "RMCTRL_FLAGS_ROUTE_TO_PHYSICAL",
}
API_LOCK_READONLY = "RMCTRL_FLAGS_API_LOCK_READONLY"
# Exit codes (documented in --help).
OK, USAGE, PROPRIETARY, UNSUPPORTED, NOT_PATCHED = 0, 2, 3, 4, 10

METHOD_RE = re.compile(r"/\*methodId=\*/\s*0x([0-9a-fA-F]+)u?\s*,")
FLAGS_RE = re.compile(r"^(?P<pre>\s*/\*flags=\*/\s*)0x(?P<hex>[0-9a-fA-F]+)(?P<suf>u?\s*,.*)$")
ENTRY_START_RE = re.compile(r"^\s*\{\s*/\*\s*\[\d+\]\s*\*/")


class Refusal(Exception):
    """A tree the applier will not touch; `code` is the exit code."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def read_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def read_version(src):
    """NVIDIA_VERSION from version.mk, else NV_VERSION_STRING from nvVer.h, else "unknown"."""
    for name, pattern in (("version.mk", r"^NVIDIA_VERSION\s*=\s*(\S+)"),
                          ("src/common/inc/nvVer.h", r'^#define\s+NV_VERSION_STRING\s+"([^"]+)"')):
        path = os.path.join(src, name)
        if os.path.exists(path):
            m = re.search(pattern, read_text(path), re.M)
            if m:
                return m.group(1)
    return "unknown"


def flag_bits(control_h_text):
    """All RMCTRL_FLAGS_<NAME> defines with a literal hex value."""
    return {m.group(1): int(m.group(2), 16)
            for m in re.finditer(r"^#define\s+(RMCTRL_FLAGS_[A-Z0-9_]+)\s+0x([0-9a-fA-F]+)", control_h_text, re.M)}


def check_tree(src):
    """Refuses what is not an open-gpu-kernel-modules source tree."""
    if not os.path.isdir(src):
        raise Refusal(USAGE, f"{src}: no such directory")
    gen, ctl = os.path.join(src, GENERATED), os.path.join(src, CONTROL_H)
    if not os.path.exists(gen):
        blobs = [os.path.join(r, f) for r, _, fs in os.walk(src) for f in fs if f.endswith(".o_binary")]
        if blobs:
            raise Refusal(PROPRIETARY,
                          f"{src} has a prebuilt resource manager ({os.path.relpath(blobs[0], src)}) and no {GENERATED}: "
                          "this is a packaged kernel interface (the proprietary driver, or a distribution's "
                          "nvidia-open-kernel-source), not the open-gpu-kernel-modules source. Get the source tree of "
                          "the same version (the NVIDIA open-gpu-kernel-modules tag, or the distribution's source package)")
        raise Refusal(UNSUPPORTED, f"{src} is not an open-gpu-kernel-modules tree: {GENERATED} is missing")
    if not os.path.exists(ctl):
        raise Refusal(UNSUPPORTED, f"{src}: {CONTROL_H} is missing; cannot read the flag values of this version")
    return gen, ctl


def entry_flags_line(lines, at):
    """Index of the single /*flags=*/ line of the entry whose /*methodId=*/ line is `at`."""
    flag_lines = []
    for i in range(at - 1, max(at - 16, -1), -1):
        if ENTRY_START_RE.match(lines[i]) or METHOD_RE.search(lines[i]):
            break
        if FLAGS_RE.match(lines[i].rstrip("\r\n")):
            flag_lines.append(i)
    if len(flag_lines) != 1:
        raise Refusal(UNSUPPORTED, f"the {METHOD_ID:#x} entry in {GENERATED} (line {at + 1}) has "
                                   f"{len(flag_lines)} /*flags=*/ lines; expected exactly one")
    return flag_lines[0]


def plan(src, flag_key):
    """Returns (version, path, lines, index of the flags line, old value, new value, flag name, bit).

    Raises Refusal for anything the one-line change would not be right for."""
    gen, ctl = check_tree(src)
    flag_name = FLAGS[flag_key]
    bits = flag_bits(read_text(ctl))
    for needed in (flag_name, API_LOCK_READONLY):
        if needed not in bits:
            raise Refusal(UNSUPPORTED, f"{CONTROL_H} does not define {needed}: unknown driver version layout")
    bit = bits[flag_name]
    if bit == 0 or bit & (bit - 1):
        raise Refusal(UNSUPPORTED, f"{flag_name} is {bit:#x} in {CONTROL_H}, not a single bit")
    with open(gen, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().splitlines(keepends=True)
    # The entry's flags value is repeated in `#if NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(...)` lines. Changing
    # only the /*flags=*/ line is complete only while that macro ignores its argument, as it does in every
    # generated file of 525-595 (defined as (0) in the file itself). Anything else: do not guess.
    macro = [l for l in lines if re.match(r"\s*#\s*define\s+NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG\b", l)]
    if len(macro) != 1 or not re.match(r"\s*#\s*define\s+NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG\(x\)\s+\(0\)\s*$",
                                          macro[0]):
        raise Refusal(UNSUPPORTED, f"{GENERATED} does not define NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(x) as (0); "
                                   "the flags value may matter elsewhere in the file, so a one-line change is not safe")
    hits = [i for i, l in enumerate(lines) if (m := METHOD_RE.search(l)) and int(m.group(1), 16) == METHOD_ID]
    if not hits:
        raise Refusal(UNSUPPORTED, f"{GENERATED} has no exported-method entry with methodId {METHOD_ID:#x}")
    if len(hits) > 1:
        raise Refusal(UNSUPPORTED, f"{GENERATED} has {len(hits)} entries with methodId {METHOD_ID:#x}; refusing to guess")
    idx = entry_flags_line(lines, hits[0])
    old = int(FLAGS_RE.match(lines[idx].rstrip("\r\n")).group("hex"), 16)
    # GPU_LOCK_DEVICE_ONLY narrows only the GPU lock. If the control also takes the API lock for write (the 525
    # branch: flags lack API_LOCK_READONLY), calls for different GPUs still run one at a time behind that lock,
    # so the patch would change nothing measurable: refuse rather than pretend.
    if flag_key == "gpu-lock-device-only" and not old & bit and not old & bits[API_LOCK_READONLY]:
        raise Refusal(UNSUPPORTED, f"the entry's flags {old:#x} lack {API_LOCK_READONLY} "
                                   f"({bits[API_LOCK_READONLY]:#x}): RM takes the API lock for write for this control "
                                   "in this version, so a per-GPU lock would not let GPUs be preempted in parallel. "
                                   "Use a 535 or newer driver (see docs/driver-patch.md)")
    return read_version(src), gen, lines, idx, old, old | bit, flag_name, bit


def patched_line(line, new):
    m = FLAGS_RE.match(line.rstrip("\r\n"))
    ending = line[len(line.rstrip("\r\n")):]
    return f"{m.group('pre')}{new:#x}{m.group('suf')}{ending}"


def unified_diff(lines, idx, new_line):
    after = list(lines)
    after[idx] = new_line
    return "".join(difflib.unified_diff(lines, after, "a/" + GENERATED, "b/" + GENERATED, n=3))


def write_file(path, text):
    with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
        f.write(text)


def sha256(text):
    return hashlib.sha256(text.encode("utf-8", errors="surrogateescape")).hexdigest()


HELP_EPILOG = """exit codes (the same with and without --check):
   0  patched: the flag is set now, was set already ("already patched"), or (--check) is set
  10  --check only: not patched (the entry lacks the flag); nothing changed
   2  usage error, or --src is not a directory
   3  refused: a prebuilt or proprietary driver (*.o_binary, no src/nvidia), not the source
   4  unsupported: a tree this applier does not understand or will not patch (files missing,
      no entry or several entries for the method id, flags not parseable, flag not defined,
      or a 525-branch entry where the per-GPU lock would not help); nothing changed
"""


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="patch-driver.sh",
        description="Apply Valve's one-line patch to an open-gpu-kernel-modules source tree: the "
                    "FIFO_DISABLE_CHANNELS control (0x2080110b) gets a flag that makes RM lock only the "
                    "target GPU, so preempting N GPUs costs about one GPU's time instead of N.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="root of the open-gpu-kernel-modules tree (with src/nvidia and kernel-open)")
    p.add_argument("--check", action="store_true", help="report patched / not patched / unsupported; change nothing")
    p.add_argument("--flag", choices=sorted(FLAGS), default="gpu-lock-device-only",
                   help="the flag to add (default: gpu-lock-device-only; route-to-physical is for experiments "
                        "only, see docs/driver-patch.md)")
    p.add_argument("--emit-patch", metavar="FILE", help="also write the change as a unified diff to FILE")
    args = p.parse_args(argv)
    try:
        version, gen, lines, idx, old, new, flag_name, bit = plan(args.src, args.flag)
    except Refusal as e:
        word = {PROPRIETARY: "refused", UNSUPPORTED: "unsupported"}.get(e.code, "error")
        print(f"patch-driver: {word}: {e}", file=sys.stderr)
        return e.code
    if args.flag == "route-to-physical":
        print("patch-driver: warning: ROUTE_TO_PHYSICAL sends the control to GSP before the kernel-side check of "
              "pRunlistPreemptEvent, and (550+) makes it fail on vGPU guests; use only for experiments",
              file=sys.stderr)
    where = f"{GENERATED}:{idx + 1}"
    print(f"driver {version}: FIFO_DISABLE_CHANNELS entry (methodId {METHOD_ID:#x}) at {where}")
    print(f"old flags {old:#x}; {flag_name} = {bit:#x} (from {CONTROL_H}); new flags {new:#x}")
    if old == new:
        print(f"already patched ({flag_name} is set); nothing changed")
        if args.emit_patch:
            # The patch relative to the unpatched line, so the emitted file is the same either way.
            unpatched = list(lines)
            unpatched[idx] = patched_line(lines[idx], old & ~bit)
            write_file(args.emit_patch, unified_diff(unpatched, idx, lines[idx]))
        return OK
    if args.check:
        print(f"not patched: flags {old:#x} lack {flag_name}; run without --check to set it ({old:#x} -> {new:#x})")
        return NOT_PATCHED
    new_line = patched_line(lines[idx], new)
    diff = unified_diff(lines, idx, new_line)
    lines[idx] = new_line
    tmp = gen + ".valve-tmp"
    write_file(tmp, "".join(lines))
    os.replace(tmp, gen)
    if args.emit_patch:
        write_file(args.emit_patch, diff)
    print(f"patched: {where} flags {old:#x} -> {new:#x} (sha256 of the change: {sha256(diff)})")
    return OK


if __name__ == "__main__":
    sys.exit(main())
