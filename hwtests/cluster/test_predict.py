"""CPU checks of the prediction benchmark's trace and report (no GPU, standard library only)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import predict  # noqa: E402


class TraceTest(unittest.TestCase):
    def test_a_phase_replays_the_trace_at_the_asked_rate(self):
        counts = predict.azure_counts()
        self.assertGreater(len(counts), 3000)
        reqs = predict.phase_trace(counts, 10.0, 200, 2.0, False, seed=1)
        self.assertAlmostEqual(len(reqs) / 200, 2.0, delta=0.3)
        self.assertTrue(all(10.0 <= r.at < 210.0 for r in reqs))
        self.assertFalse(any(r.burst for r in reqs))
        self.assertEqual([r.at for r in reqs], sorted(r.at for r in reqs))

    def test_a_bursty_phase_adds_long_prompts_at_intervals(self):
        counts = predict.azure_counts()
        reqs = predict.phase_trace(counts, 0.0, 60, 1.0, True, seed=2, burst_every=20.0, burst_size=3)
        bursts = [r for r in reqs if r.burst]
        self.assertEqual(len(bursts) % 3, 0)
        self.assertGreaterEqual(len(bursts), 6)
        self.assertTrue(all(r.prompt >= 6000 for r in bursts))

    def test_phases_cover_every_load_and_pattern_back_to_back(self):
        plan = predict.phases([0.5, 2.0], ["steady", "bursty"])
        self.assertEqual(plan, [(0.5, "steady"), (0.5, "bursty"), (2.0, "steady"), (2.0, "bursty")])
        reqs = predict.trace_for(plan, 40.0, 3.0, seed=5)
        self.assertLess(max(r.at for r in reqs), 3.0 + 4 * 40.0)
        self.assertTrue(any(r.at > 3.0 + 3 * 40.0 for r in reqs), "the last phase has requests")


class ReportTest(unittest.TestCase):
    def test_errors_and_the_target_are_reported(self):
        self.assertAlmostEqual(predict.error(110, 100), 0.1)
        self.assertIsNone(predict.error(5, 0))
        row = dict(offline="cb", load_rps=1.5, pattern="bursty", busy=0.3, memory_mean_gib=5.0, memory_p5_gib=2.0,
                   preemptions_per_s=1.25, reclaimed_gib_per_s=0.1, idle=0.7, interrupted=0.05, memory_factor=0.9,
                   predicted=630.0, measured=600.0, error=0.05, episode_gib=2.0, gpu_sm_mhz=1980.0)
        prof = dict(alone_per_s=1092.0, measured=dict(uninterrupted_per_s=[1092.0, 1486.0]))
        md = predict.markdown(dict(device="GPU", date="2026-11-25", window_s=30, rows=[row], met=True,
                                   profiles=dict(cb=prof)))
        # measured per idle second: 600 / ((0.7 + 0 - 0.05) x 0.9) = 1026 (a row from before held_overlap)
        self.assertIn("| cb | 1.5 | bursty | 0.300 | 1.25 | 0.100 (2.0) | 5.0 / 2.0 | (0.700 + 0.000 - 0.050) x 0.900 | 630 | 600 | 5.0% | 1026 | 1980 |", md)
        row2 = dict(row, overlap=0.1, predicted=700.0, error=predict.error(700.0, 600.0))
        md2 = predict.markdown(dict(device="GPU", date="2026-11-25", window_s=30, rows=[row2], met=True, profiles={}))
        # with held time not lost: 600 / ((0.7 + 0.1 - 0.05) x 0.9) = 889
        self.assertIn("(0.700 + 0.100 - 0.050) x 0.900 | 700 | 600 | 16.7% | 889 |", md2)
        self.assertIn("target met", md)
        self.assertIn("Profile cb: T_alone 1092; uninterrupted rates 1092, 1486 (moved 30.6% while profiled).", md)


class LaneTest(unittest.TestCase):
    def test_a_lane_reads_its_own_gpu_from_the_harvest_document(self):
        from unittest import mock
        doc = dict(gpus=[dict(index=0, windows="gpu 0"), dict(index=2, windows="gpu 2")])
        with mock.patch.object(predict.common, "GPU", 2):
            self.assertEqual(predict.gpu_entry(doc)["windows"], "gpu 2")
        with mock.patch.object(predict.common, "GPU", 0):
            self.assertEqual(predict.gpu_entry(doc)["windows"], "gpu 0")

    def test_a_report_says_when_other_benchmarks_shared_the_host(self):
        from unittest import mock
        with mock.patch.dict(os.environ, {"LANES": "4", "LANE_CPUS": "16-31"}), \
                mock.patch.object(predict.common, "GPU", 1):
            self.assertEqual(predict.common.lane(), dict(gpu=1, lanes=4, cpus="16-31"))
            self.assertIn("GPU 1, one of 4 benchmarks", predict.common.lane_note())
            self.assertIn("pinned to CPUs 16-31", predict.common.lane_note())
        with mock.patch.dict(os.environ, {"LANES": "4", "LANE_CPUS": "shared"}):
            self.assertIn("sharing the host's CPUs", predict.common.lane_note())
        with mock.patch.dict(os.environ, {"LANES": "1"}):
            self.assertEqual(predict.common.lane_note(), "")


if __name__ == "__main__":
    unittest.main()
