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

    def test_drift_or_a_wide_window_over_the_limit_is_flagged(self):
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
