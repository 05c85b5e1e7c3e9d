"""Unit tests of stamp.py's clock mapping and of server.py's stamp flag on CPU (stdlib only; run
by selftest.sh). The GPU path (GpuStamper) needs CUDA and is not run here."""

import argparse
import contextlib
import io
import sys
import types
import unittest

import stamp

# server.py imports aiohttp's web at the top; its flag handling needs none of it.
_aiohttp = sys.modules.setdefault("aiohttp", types.ModuleType("aiohttp"))
if not hasattr(_aiohttp, "web"):
    _aiohttp.web = None
import server  # noqa: E402

US = 1_000
GPU_AHEAD = 1_700_000_000_000_000_000  # %globaltimer - CLOCK_MONOTONIC on a made-up host


def sample(before, start_after_before, width):
    """A launch whose window is [before, before + width] and whose kernel started inside it."""
    return (before, before + start_after_before + GPU_AHEAD, before + width)


class Calibrate(unittest.TestCase):
    def test_the_narrowest_window_gives_the_offset_from_its_midpoint_and_its_width_as_bound(self):
        samples = [sample(1_000 * US, 30 * US, 90 * US), sample(2_000 * US, 6 * US, 10 * US),
                   sample(3_000 * US, 20 * US, 40 * US)]
        m = stamp.calibrate(samples)
        self.assertEqual(m["bound_ns"], 10 * US)
        self.assertEqual(m["offset_ns"], GPU_AHEAD + 1 * US)  # started 6 us in, midpoint at 5 us
        self.assertEqual(m["samples"], 3)

    def test_a_mapped_stamp_is_within_the_bound_and_the_wrong_sign_is_not(self):
        m = stamp.calibrate([sample(5_000 * US, 4 * US, 8 * US)])
        true_ns = 9_000 * US
        mapped = stamp.to_monotonic(true_ns + GPU_AHEAD, m)
        self.assertLessEqual(abs(mapped - true_ns), m["bound_ns"])
        wrong = true_ns + GPU_AHEAD + m["offset_ns"]  # adding the offset instead of subtracting it
        self.assertGreater(abs(wrong - true_ns), m["bound_ns"])

    def test_impossible_samples_are_skipped_and_none_left_is_an_error(self):
        bad = [(10, 5 + GPU_AHEAD, 5), (10, 0, 20)]  # after < before; a stamp never written
        m = stamp.calibrate(bad + [sample(100, 2, 50)])
        self.assertEqual(m["bound_ns"], 50)
        with self.assertRaises(ValueError):
            stamp.calibrate(bad)


class Check(unittest.TestCase):
    def m(self, offset, bound):
        return {"offset_ns": offset, "bound_ns": bound}

    def test_a_steady_narrow_mapping_is_not_flagged(self):
        c = stamp.mapping_check(self.m(1000, 5 * US), self.m(1000 + 3 * US, 8 * US))
        self.assertEqual((c["drift_ns"], c["bound_ns"], c["flagged"]), (3 * US, 8 * US, False))

    def test_without_calibration_times_drift_or_a_wide_window_over_the_limit_is_flagged(self):
        drift = stamp.mapping_check(self.m(0, 5 * US), self.m(-25 * US, 5 * US))
        self.assertTrue(drift["flagged"])
        self.assertIn("drifted -25.0 us", drift["why"])
        wide = stamp.mapping_check(self.m(0, 21 * US), self.m(0, 5 * US))
        self.assertTrue(wide["flagged"])
        self.assertIn("error bound 21.0 us", wide["why"])

    def test_a_missing_calibration_is_flagged_and_named(self):
        c = stamp.mapping_check(self.m(0, 5 * US), None)
        self.assertTrue(c["flagged"])
        self.assertIsNone(c["drift_ns"])
        self.assertIn("no end calibration", c["why"])
        self.assertIn("no start and no end", stamp.mapping_check(None, None)["why"])


class Linear(unittest.TestCase):
    """Each stamp mapped with the offset interpolated in time between the two calibrations."""

    # The first H200 run (2026-11-2x): the offset grew by 1,782,828 ns in 185.6 s.
    START = {"offset_ns": 1795659981484958917, "bound_ns": 3 * US, "samples": 50, "at_ns": 89973879163}
    END = {"offset_ns": 1795659981486741745, "bound_ns": 4 * US, "samples": 50, "at_ns": 275529336367}

    def test_the_h200_runs_midpoint_stamp_is_corrected_by_half_the_drift(self):
        mid = (self.START["at_ns"] + self.END["at_ns"]) // 2
        drift = self.END["offset_ns"] - self.START["offset_ns"]
        raw = mid + self.START["offset_ns"] + drift // 2  # the GPU read this at host time `mid`
        by_start = stamp.to_monotonic(raw, self.START)
        self.assertAlmostEqual(by_start - mid, drift / 2, delta=1)  # 891 us late by the start offset
        self.assertAlmostEqual(stamp.to_monotonic_linear(raw, self.START, self.END), mid, delta=5)
        c = stamp.mapping_check(self.START, self.END)
        self.assertAlmostEqual(c["drift_ppm"], 9.608, places=3)
        self.assertTrue(c["corrected"])
        self.assertFalse(c["flagged"], c["why"])  # 1.8 ms of drift, corrected: not flagged

    def test_stamps_at_either_calibration_map_by_its_own_offset_and_beyond_extrapolate(self):
        s, e = self.START, self.END
        for m in (s, e):
            raw = m["at_ns"] + m["offset_ns"]
            self.assertEqual(stamp.to_monotonic_linear(raw, s, e), m["at_ns"])
        later = e["at_ns"] + 10**9  # 1 s after the end: 9.6 us more drift
        raw = later + e["offset_ns"] + round(9.608 * 1000)
        self.assertAlmostEqual(stamp.to_monotonic_linear(raw, s, e), later, delta=5)

    def test_one_calibration_alone_maps_by_its_offset(self):
        raw = 10**18
        self.assertEqual(stamp.to_monotonic_linear(raw, self.START, None), raw - self.START["offset_ns"])
        self.assertEqual(stamp.to_monotonic_linear(raw, None, self.END), raw - self.END["offset_ns"])
        no_time = {"offset_ns": self.END["offset_ns"], "bound_ns": 1}  # an older server's mapping
        self.assertEqual(stamp.to_monotonic_linear(raw, self.START, no_time), raw - self.START["offset_ns"])

    def test_remap_keeps_the_raw_and_the_servers_value_and_skips_unstamped_records(self):
        mid = (self.START["at_ns"] + self.END["at_ns"]) // 2
        raw = mid + (self.START["offset_ns"] + self.END["offset_ns"]) // 2
        server = raw - self.START["offset_ns"]
        recs = [{"gpu_start_ns": server, "gpu_start_globaltimer_ns": raw,
                 "mapping_offset_ns": self.START["offset_ns"]},
                {"gpu_start_ns": None, "gpu_start_globaltimer_ns": 0}, {"send_ns": 1}]
        self.assertEqual(stamp.remap_records(recs, self.START, self.END), 1)
        self.assertAlmostEqual(recs[0]["gpu_start_ns"], mid, delta=5)
        self.assertEqual((recs[0]["gpu_start_server_ns"], recs[0]["gpu_start_globaltimer_ns"]), (server, raw))
        self.assertEqual(recs[1:], [{"gpu_start_ns": None, "gpu_start_globaltimer_ns": 0}, {"send_ns": 1}])
        self.assertEqual(stamp.remap_records(recs, None, None), 0)

    def test_with_times_only_a_wide_bound_or_a_missing_calibration_is_flagged(self):
        wide = dict(self.END, bound_ns=25 * US)
        self.assertIn("error bound 25.0 us", stamp.mapping_check(self.START, wide)["why"])
        c = stamp.mapping_check(self.START, None)
        self.assertEqual((c["flagged"], c["corrected"], c["drift_ppm"]), (True, False, None))

    def test_stamp_fields_map_by_the_servers_offset_and_an_unwritten_stamp_is_none(self):
        f = stamp.stamp_fields(self.START["offset_ns"] + 5, self.START)
        self.assertEqual(f, {"gpu_start_ns": 5, "gpu_start_globaltimer_ns": self.START["offset_ns"] + 5,
                             "mapping_offset_ns": self.START["offset_ns"]})
        self.assertIsNone(stamp.stamp_fields(0, self.START)["gpu_start_ns"])


class Driver(unittest.TestCase):
    def test_no_driver_library_is_a_named_error(self):
        with self.assertRaises(stamp.StampError) as e:
            stamp.Driver("libvalve-no-such-cuda.so.1")
        self.assertIn("--stamp-first-kernel", str(e.exception))


class ServerFlag(unittest.TestCase):
    def choose(self, **kw):
        a = argparse.Namespace(**dict(dict(stamp_first_kernel=None, engine="graph", device="cuda"), **kw))
        ap = argparse.ArgumentParser()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            return server.stamp_choice(a, ap), err.getvalue()

    def test_off_by_default(self):
        self.assertEqual(self.choose(), (None, ""))

    def test_on_cpu_it_is_off_with_a_message(self):
        path, msg = self.choose(stamp_first_kernel=__file__, device="cpu")
        self.assertIsNone(path)
        self.assertIn("needs --device cuda", msg)

    def test_on_cuda_it_passes_the_file_and_refuses_a_missing_one_or_the_cb_engine(self):
        self.assertEqual(self.choose(stamp_first_kernel=__file__)[0], __file__)
        for kw in (dict(stamp_first_kernel="/nonexistent/stamp.ptx"), dict(stamp_first_kernel=__file__, engine="cb")):
            with self.assertRaises(SystemExit):
                self.choose(**kw)


if __name__ == "__main__":
    unittest.main()
