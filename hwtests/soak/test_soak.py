"""CPU tests of the soak's and the freeze probe's arithmetic (no GPU, no daemon)."""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "freeze"))

import analyze  # noqa: E402
import soak  # noqa: E402


class SoakArithmetic(unittest.TestCase):
    def test_iterations_inside_count_only_those_strictly_between(self):
        stamps = [(10, 1), (20, 2), (30, 3)]
        self.assertEqual(soak.inside(stamps, 10, 30), 1)
        self.assertEqual(soak.inside(stamps, 0, 100), 3)

    def test_a_reply_without_a_check_is_absent_never_confirmed(self):
        self.assertEqual(soak.freeze_of({"pid": 1}), ("absent", None))
        self.assertEqual(soak.freeze_of(None), ("absent", None))
        self.assertEqual(soak.freeze_of({"freeze": {"outcome": "running", "after_us": 7}}), ("running", 7))

    def test_summary_of_samples(self):
        s = soak.summary([5, 1, 3])
        self.assertEqual((s["n"], s["p50"], s["max"]), (3, 3, 5))
        self.assertIsNone(soak.summary([]))


class ProbeAnalysis(unittest.TestCase):
    def test_tokens_map_resident_channel_ids_to_their_owner(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rm.log")
            with open(path, "w") as f:
                f.write("alloc 1c2 c1d0001e 5c000010 5c00001c c86f -\n")
                f.write("ctrl 1c2 c1d0001e 5c00001c c36f0108 1000b\n")
                f.write("alloc 1c3 c1d0001f 5c000010 5c00001c c86f -\n")
            chids, chans, _ = analyze.read_log(path, 0x1C2)
        self.assertEqual(chids, {11: "c1d0001e:5c00001c"})
        self.assertEqual(chans, {"c1d0001e:5c00001c": "c86f"})
        maps = {"A": (chids, chans, {})}
        self.assertEqual(analyze.owner("0xb", maps), "A c1d0001e:5c00001c")
        self.assertEqual(analyze.owner("0xc", maps), "unknown 0xc")
        self.assertEqual(analyze.owner("error Rm(RmStatus(33))", maps), "none resident")

    def test_a_hold_row_counts_iterations_after_the_disable_only(self):
        h = {"before": {"resident": {"samples": {}}},
             "during": {"disabled_ns": 0, "enable_ns": 100_000_000, "disable_us": 900.0,
                        "first_5ms": {"samples": {"0xb": 2}},
                        "resident": {"samples": {"0xb": 1}, "mean_call_us": 400.0},
                        "state": [{"enabled": 1, "result": "Ok(())"}],
                        "daemon_check": {"outcome": "running"}}}
        maps = {"A": ({11: "x:y"}, {}, {})}
        row = analyze.hold_row("h", h, maps, {"A": [1_000_000, 50_000_000]})
        self.assertEqual(row["iterations_inside"], {"A": 1})
        self.assertEqual(row["resident_owners"], {"A x:y": 3})
        self.assertEqual(row["channels_enabled_during"], 1)
        json.dumps(row)


if __name__ == "__main__":
    unittest.main()
