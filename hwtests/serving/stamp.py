"""The graph server's first-kernel stamp (`server.py --stamp-first-kernel stamp.ptx`): a one-thread
kernel (hwtests/cuda/stamp.cu) that writes the GPU's %globaltimer, launched through the CUDA driver
API (ctypes, libcuda.so.1) just before each request's first kernel, and the mapping of %globaltimer
onto the host's CLOCK_MONOTONIC, so that the bench can report arrival -> first kernel running.

Mapping: repeated launches, each bracketed by time.monotonic_ns() just before the launch and just
after cuStreamSynchronize. The stamp ran inside [before, after]; the narrowest window wins, offset =
stamp - its midpoint, and its width is the mapping's error bound. The GPU clock drifts against the
host's (9.6 ppm, linear, on the first H200 run: 1.8 ms over 185 s), so the bench maps each stamp
with the offset interpolated linearly between the calibrations before and after its runs
(`to_monotonic_linear`, `remap_records`). All but `GpuStamper` (CUDA and torch) is pure and tested
on CPU by test_stamp.py.
"""

import ctypes
import os
import time

KERNEL = b"valve_stamp"
DRIFT_LIMIT_NS = 20_000


class StampError(RuntimeError):
    """The stamp cannot run: a driver call failed, or there is no CUDA context on this thread."""


def calibrate(samples):
    """(before_ns, stamp_ns, after_ns) host/GPU/host triples -> the mapping from the narrowest
    window: offset_ns (stamp - window midpoint), bound_ns (the window's width) and the count."""
    valid = [s for s in samples if s[2] >= s[0] and s[1]]
    if not valid:
        raise ValueError("calibrate: no sample with after >= before and a nonzero stamp")
    before, stamp, after = min(valid, key=lambda s: s[2] - s[0])
    mid = before + (after - before) // 2
    return {"offset_ns": stamp - mid, "bound_ns": after - before, "samples": len(samples), "at_ns": mid}


def to_monotonic(stamp_ns, mapping):
    """A %globaltimer stamp on the host's CLOCK_MONOTONIC (ns), by the mapping from `calibrate`."""
    return stamp_ns - mapping["offset_ns"]


def linear(start, end):
    """Whether the two calibrations define a drift rate: both there, with distinct times (`at_ns`)."""
    return bool(start and end and "at_ns" in start and "at_ns" in end and end["at_ns"] != start["at_ns"])


def to_monotonic_linear(stamp_ns, start, end):
    """A %globaltimer stamp on CLOCK_MONOTONIC by the offset interpolated linearly in time between
    the start and end calibrations (extrapolated outside them); with one of them only, by that one.

    The offset at host time t is o0 + (t - a0) * drift / span, and t = stamp - offset(t); solved
    exactly in integers (stamps are ~1.8e18 ns: a float would lose hundreds of ns)."""
    if not linear(start, end):
        return to_monotonic(stamp_ns, start or end)
    a0, o0 = start["at_ns"], start["offset_ns"]
    span, drift = end["at_ns"] - a0, end["offset_ns"] - o0
    d = stamp_ns - o0 - a0  # t - a0 by the start offset alone
    return a0 + (d * span) // (span + drift)


def remap_records(records, start, end):
    """Maps each stamped record's raw `gpu_start_globaltimer_ns` again by `to_monotonic_linear`
    into `gpu_start_ns`, keeping the server's own single-offset value as `gpu_start_server_ns`.
    Without either calibration nothing changes. Returns how many records were mapped."""
    if not start and not end:
        return 0
    n = 0
    for r in records:
        raw = r.get("gpu_start_globaltimer_ns")
        if not raw:
            continue
        r.setdefault("gpu_start_server_ns", r.get("gpu_start_ns"))
        r["gpu_start_ns"] = to_monotonic_linear(raw, start, end)
        n += 1
    return n


def mapping_check(start, end, limit_ns=DRIFT_LIMIT_NS):
    """The start and end calibrations of a run (either may be None): the drift of the offset (ns and
    ppm), whether the stamps are corrected for it (`linear`), the larger error bound, and whether
    the mapping is flagged, with the reason: a missing calibration or a bound over limit_ns. A drift
    is flagged only where it cannot be corrected (calibrations without times, from older servers)."""
    why = []
    bounds = [m["bound_ns"] for m in (start, end) if m]
    drift = end["offset_ns"] - start["offset_ns"] if start and end else None
    corrected = linear(start, end)
    ppm = drift / (end["at_ns"] - start["at_ns"]) * 1e6 if corrected else None
    if not start or not end:
        why.append("no " + " and no ".join(n for n, m in (("start", start), ("end", end)) if not m)
                   + " calibration")
    if drift is not None and not corrected and abs(drift) > limit_ns:
        why.append(f"offset drifted {drift / 1e3:+.1f} us over the run")
    if bounds and max(bounds) > limit_ns:
        why.append(f"error bound {max(bounds) / 1e3:.1f} us")
    return {"start": start, "end": end, "drift_ns": drift, "drift_ppm": ppm, "corrected": corrected,
            "bound_ns": max(bounds) if bounds else None, "limit_ns": limit_ns, "flagged": bool(why),
            "why": "; ".join(why)}


def stamp_fields(raw, mapping):
    """The fields a server sends for a request's stamp: the raw %globaltimer, the offset it mapped
    it with and the mapped time (None where the stamp was not written)."""
    return {"gpu_start_ns": to_monotonic(raw, mapping) if raw else None,
            "gpu_start_globaltimer_ns": raw, "mapping_offset_ns": mapping["offset_ns"]}


def _sig(fn, argtypes):
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


class Driver:
    """The few CUDA driver calls the stamp needs, each CUresult checked (`call`)."""

    def __init__(self, lib="libcuda.so.1"):
        try:
            cu = ctypes.CDLL(lib)
        except OSError as e:
            raise StampError(f"cannot load {lib} ({e}): the stamp needs the NVIDIA driver; "
                             "run without --stamp-first-kernel on a host without one") from None
        vp, pvp, u = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint
        self.fns = {
            "cuGetErrorName": _sig(cu.cuGetErrorName, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
            "cuCtxGetCurrent": _sig(cu.cuCtxGetCurrent, [pvp]),
            "cuModuleLoad": _sig(cu.cuModuleLoad, [pvp, ctypes.c_char_p]),
            "cuModuleGetFunction": _sig(cu.cuModuleGetFunction, [pvp, vp, ctypes.c_char_p]),
            "cuLaunchKernel": _sig(cu.cuLaunchKernel, [vp, u, u, u, u, u, u, u, vp, pvp, pvp]),
            "cuStreamSynchronize": _sig(cu.cuStreamSynchronize, [vp]),
        }

    def call(self, name, *args):
        rc = self.fns[name](*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.fns["cuGetErrorName"](rc, ctypes.byref(text))
            raise StampError(f"{name} failed: {(text.value or b'unknown CUresult').decode()} ({rc})")


class GpuStamper:
    """Loads the stamp kernel into the current (torch's primary) context and launches it on torch's
    current stream into a ring of device int64 slots. Create and use it on the decode thread."""

    def __init__(self, path, torch, slots=1024):
        self.torch, self.slots, self.next = torch, slots, 0
        self.drv = Driver()
        ctx = ctypes.c_void_p()
        self.drv.call("cuCtxGetCurrent", ctypes.byref(ctx))
        if not ctx.value:
            raise StampError("no CUDA context is current on this thread: make a torch CUDA call on it "
                             "first (the graph engine's decode thread does) before creating the stamper")
        mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.drv.call("cuModuleLoad", ctypes.byref(mod), path.encode())
        self.drv.call("cuModuleGetFunction", ctypes.byref(self.fn), mod, KERNEL)
        self.buf = torch.zeros(slots + 1, dtype=torch.int64, device="cuda")  # the last: calibration

    def launch(self, slot):
        """Enqueues the stamp into `slot` on torch's current stream (grid and block 1x1x1)."""
        addr = ctypes.c_uint64(self.buf.data_ptr() + 8 * slot)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(addr), ctypes.c_void_p))
        stream = ctypes.c_void_p(self.torch.cuda.current_stream().cuda_stream)
        self.drv.call("cuLaunchKernel", self.fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None)
        return stream

    def begin(self):
        """Stamps the next slot (call just before the request's first kernel); returns the slot."""
        slot = self.next % self.slots
        self.next += 1
        self.launch(slot)
        return slot

    def read(self, slot):
        """The slot's %globaltimer (ns). Call after the request: its work is done, so no wait."""
        return int(self.buf[slot].item())

    def calibrate(self, n=50):
        """`calibrate` over n launches, each between two host clock reads around a stream sync."""
        samples = []
        for _ in range(n):
            before = time.monotonic_ns()
            stream = self.launch(self.slots)
            self.drv.call("cuStreamSynchronize", stream)
            after = time.monotonic_ns()
            samples.append((before, self.read(self.slots), after))
        return calibrate(samples)


def start_stamper(path, torch, device):
    """A GpuStamper on the calling thread and a first mapping: a kernel launched here first binds
    torch's primary context to the thread (GpuStamper checks with cuCtxGetCurrent)."""
    torch.zeros(1, device=device).add_(1)
    torch.cuda.synchronize()
    stamper = GpuStamper(path, torch)
    return stamper, stamper.calibrate()


def stamp_file(path, device, ap, note):
    """The stamp PTX a server is to load (absolute), or None: off unless asked for, and off, said
    through `note`, on a device other than CUDA; a missing file is `ap`'s usage error."""
    if not path:
        return None
    if not device.startswith("cuda"):
        note(f"--stamp-first-kernel is off: it needs --device cuda, not {device} (the stamp is a CUDA kernel)")
        return None
    if not os.path.exists(path):
        ap.error(f"--stamp-first-kernel {path}: no such file (build it with hwtests/cuda/build.sh OUTDIR: "
                 "OUTDIR/stamp.ptx)")
    return os.path.abspath(path)
