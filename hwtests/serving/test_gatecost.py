"""Unit tests of gatecost.py's numbers (stdlib only; run by selftest.sh). No request is sent."""

import sys
import types
import unittest

sys.modules.setdefault("aiohttp", types.ModuleType("aiohttp"))
import gatecost  # noqa: E402


def request(first_ms, gaps_ms, error=None):
    ts = [int(first_ms * 1e6)]
    for g in gaps_ms:
        ts.append(ts[-1] + int(g * 1e6))
    return {"send_ns": 0, "first_ns": ts[0], "last_ns": ts[-1], "end_ns": ts[-1], "tokens": len(ts),
            "error": error, "token_ns": ts}


def block(cfg, rnd, gap_ms, per_token=None):
    recs = [request(10.0, [gap_ms] * 4), request(12.0, [gap_ms] * 4)]
    b = {"config": cfg, "round": rnd, "records": recs, "stats": gatecost.block_stats(recs)}
    if per_token:
        b["per_token"] = per_token
    return b


class Numbers(unittest.TestCase):
    def test_inter_token_gaps_skip_failed_requests_and_the_first_token(self):
        recs = [request(5.0, [8.0, 9.0]), request(5.0, [100.0], error="boom")]
        self.assertEqual(gatecost.inter_token_ms(recs), [8.0, 9.0])

    def test_each_gate_block_is_compared_with_its_own_rounds_alone_block(self):
        blocks = [block("alone", 0, 8.0), block("gate", 0, 8.8),
                  block("alone", 1, 10.0), block("gate", 1, 10.0)]
        rows = gatecost.summarize(blocks, ["alone", "gate"])
        change = rows["gate"]["itl_mean_ms_change_pct"]
        # +10% in round 0, 0% in round 1; pooling the rounds first would hide which was which.
        self.assertAlmostEqual(change["rounds"][0], 10.0, places=6)
        self.assertAlmostEqual(change["rounds"][1], 0.0, places=6)
        self.assertAlmostEqual(change["mean"], 5.0, places=6)
        self.assertIsNone(rows["alone"]["itl_mean_ms_change_pct"])
        self.assertEqual(rows["gate"]["tokens"], 20)

    def test_counters_are_per_generated_token(self):
        before = {"edges": 10, "preemptions": 1, "arrivals": 0,
                  "online_probe_hits": {"kernel_launches": 100, "graph_launches": 0, "syncs": 50}}
        after = {"edges": 30, "preemptions": 3, "arrivals": 0,
                 "online_probe_hits": {"kernel_launches": 400, "graph_launches": 40, "syncs": 250}}
        pt = gatecost.counters_between(before, after, 100)
        self.assertEqual(pt["edges"], 0.2)
        self.assertEqual(pt["kernel_launches"], 3.0)
        self.assertEqual(pt["syncs"], 2.0)

    def test_the_report_names_every_configuration_with_its_change(self):
        pt = {"edges": 0.5, "preemptions": 0.0, "arrivals": 0.0, "kernel_launches": 3.0,
              "graph_launches": 0.6, "syncs": 6.0}
        blocks = [block("alone", 0, 8.0), block("gate", 0, 8.08, pt)]
        rows = gatecost.summarize(blocks, ["alone", "gate"])
        text = gatecost.report_text("GPU X", {"server": "cb"}, rows)
        self.assertIn("GPU X", text)
        self.assertIn("| gate | 1 | 10 |", text)
        self.assertIn("+1.00%", text)
        self.assertIn("3.00 launches", text)

    def test_cpu_shares_are_of_the_ticks_between_two_readings(self):
        shares = gatecost.share_between((100, 10, 1000), (300, 30, 2000))
        self.assertEqual(shares, {"busy_pct": 20.0, "steal_pct": 2.0})

    def test_unknown_configurations_and_a_missing_alone_are_refused(self):
        with self.assertRaises(SystemExit):
            gatecost.parse_args(["--configs", "gate,alone,bogus"])
        with self.assertRaises(SystemExit):
            gatecost.parse_args(["--configs", "gate"])


if __name__ == "__main__":
    unittest.main()
