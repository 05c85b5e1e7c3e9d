#!/usr/bin/env python3
"""Prints the flags that a compiled object or module (g_subdevice_nvoc.o, nv-kernel.o, nvidia.ko)
carries for FIFO_DISABLE_CHANNELS, to show that the patched value reached the binary.

The exported-method table entry is laid out as: pointer, u32 flags, u32 accessRight, u32 methodId,
so each little-endian occurrence of the method id preceded by a small accessRight is reported."""
import struct
import sys

METHOD_ID = 0x2080110B


def entry_flags(data):
    found = []
    needle = struct.pack("<I", METHOD_ID)
    at = data.find(needle)
    while at != -1:
        if at >= 8:
            flags, access = struct.unpack_from("<II", data, at - 8)
            if access < 0x100 and flags < 0x1000000:
                found.append(flags)
        at = data.find(needle, at + 1)
    return found


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: entry_flags.py OBJECT")
    with open(sys.argv[1], "rb") as f:
        flags = entry_flags(f.read())
    print(" ".join(f"{x:#x}" for x in flags) or "none")
    return 0 if len(flags) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
