"""Unit tests of analysis.py on small hand-made records (stdlib only; run by selftest.sh)."""

import unittest

import analysis as a

MS = 1_000_000


def req(send, first, end, tokens=5, idle=True):
    return {
        "send_ns": send,
        "first_ns": first,
        "end_ns": end,
        "tokens": tokens,
        "idle_at_send": idle,
        "error": None,
    }


class Stats(unittest.TestCase):
    def test_percentiles_are_nearest_rank(self):
        xs = list(range(1, 101))
        self.assertEqual(a.percentile(xs, 50), 50)
        self.assertEqual(a.percentile(xs, 99), 99)
        self.assertEqual(a.percentile(xs, 100), 100)
        self.assertIsNone(a.percentile([], 50))

    def test_union_merges_overlaps_and_clips(self):
        iv = [(0, 10), (5, 15), (20, 30), (40, 50)]
        self.assertEqual(a.union_ns(iv, 0, 100), 35)
        self.assertEqual(a.union_ns(iv, 8, 45), 7 + 10 + 5)

    def test_ttft_tpot_and_busy_share(self):
        rs = [req(0, 10 * MS, 50 * MS), req(100 * MS, 108 * MS, 148 * MS)]
        s = a.request_stats(rs)
        self.assertEqual((s["ttft_p50_ms"], s["ttft_p99_ms"]), (8.0, 10.0))
        self.assertEqual(s["tpot_p50_ms"], 10.0)
        self.assertAlmostEqual(a.busy_share(rs), 98 / 148)

    def test_harvest_counts_offline_progress_in_idle_time(self):
        rs = [req(0, MS, 50 * MS), req(150 * MS, 151 * MS, 200 * MS)]
        # Offline runs at 1000 it/s alone; in the window it did 100 iterations = 0.1 s of work,
        # and online was idle 100 ms of the 200 ms window.
        progress = [(0, 0), (200 * MS, 100)]
        h = a.harvest(rs, progress, 1000.0)
        self.assertAlmostEqual(h["harvested"], 1.0)
        self.assertAlmostEqual(h["offline_vs_alone"], 0.5)

    def test_a_run_is_started_only_if_it_can_end_before_the_deadline(self):
        self.assertTrue(a.fits_deadline(0, [], 10))
        self.assertTrue(a.fits_deadline(400, [50, 60], 460))
        self.assertFalse(a.fits_deadline(410, [50, 60], 460))  # the longest run would overrun

    def test_rounds_of_one_configuration_are_summed_before_dividing(self):
        # Round 1 as above (0.1 s of offline work in 100 ms idle of 200 ms); round 2, 1 s later:
        # online busy the whole 100 ms window and offline did nothing.
        r1 = [req(0, MS, 50 * MS), req(150 * MS, 151 * MS, 200 * MS)]
        r2 = [req(1000 * MS, 1001 * MS, 1100 * MS)]
        progress = [(0, 0), (200 * MS, 100), (2000 * MS, 100)]
        h = a.harvest_runs([(r1, progress), (r2, progress)], 1000.0)
        self.assertAlmostEqual(h["harvested"], 1.0)  # 0.1 s of work in 0.1 s of idle time
        self.assertAlmostEqual(h["offline_vs_alone"], 0.1 / 0.3)
        self.assertAlmostEqual(a.busy_share_runs([r1, r2]), (100 + 100) / 300)


class Trace(unittest.TestCase):
    # A request sent at 10 ms: the arrival edge at 10.05 ms, offline stopped at 11.2 ms, first
    # kernel at 14 ms, resume at 60 ms. A second one at 100 ms with gating on launches: kernel
    # at 103 ms, offline stopped at 104.1 ms (after the kernel).
    TRACE = [
        {"event": "arrival", "t_ns": 10_050_000, "port": 8000},
        {"event": "disable", "t_ns": 10_100_000, "end_ns": 11_200_000, "pid": 0, "ok": True},
        {"event": "launch", "t_ns": 14 * MS, "pid": 7},
        {"event": "cooldown", "t_ns": 60 * MS, "cooldown_ns": 4 * MS},
        {"event": "enable", "t_ns": 60 * MS, "end_ns": 60_500_000, "pid": 0, "ok": True},
        {"event": "launch", "t_ns": 103 * MS, "pid": 7},
        {"event": "disable", "t_ns": 103_050_000, "end_ns": 104_100_000, "pid": 0, "ok": True},
    ]

    def test_offline_stopped_is_compared_with_the_first_kernel(self):
        rs = [req(10 * MS, 20 * MS, 50 * MS), req(100 * MS, 110 * MS, 150 * MS)]
        rows = a.per_request(rs, self.TRACE, online_pids={7})
        self.assertEqual(len(rows), 2)
        self.assertAlmostEqual(rows[0]["arrival_to_stopped_ms"], 1.2)
        self.assertAlmostEqual(rows[0]["arrival_to_kernel_ms"], 4.0)
        self.assertTrue(rows[0]["stopped_first"])
        self.assertAlmostEqual(rows[1]["arrival_to_stopped_ms"], 4.1)
        self.assertFalse(rows[1]["stopped_first"])
        # A request that arrived while another was in flight is not judged.
        busy = req(12 * MS, 20 * MS, 30 * MS, idle=False)
        self.assertEqual(a.per_request([busy], self.TRACE), [])

    def test_the_arrivals_hop_to_the_gate_thread_is_timed(self):
        trace = [dict(r, recv_ns=15_250_000) if r["event"] == "arrival" else r for r in self.TRACE]
        rs = [req(10 * MS, 20 * MS, 50 * MS), req(100 * MS, 110 * MS, 150 * MS)]
        rows = a.per_request(rs, trace, online_pids={7})
        self.assertAlmostEqual(rows[0]["arrival_to_gate_ms"], 5.2)
        self.assertIsNone(rows[0]["arrival_to_watcher_ms"], "no read_ns: an older daemon")
        self.assertIsNone(rows[1]["arrival_to_gate_ms"], "no arrival inside the second request")
        read = [dict(r, read_ns=15_100_000) if r["event"] == "arrival" else r for r in trace]
        self.assertAlmostEqual(a.per_request(rs, read, online_pids={7})[0]["arrival_to_watcher_ms"], 5.05)
        # A trace from before recv_ns was recorded: not timed.
        self.assertIsNone(a.per_request(rs, self.TRACE, online_pids={7})[0]["arrival_to_gate_ms"])

    def test_already_stopped_counts_as_stopped_first(self):
        # Sent at 30 ms while offline was still stopped from the first request.
        rows = a.per_request([req(30 * MS, 40 * MS, 45 * MS)], self.TRACE + [
            {"event": "launch", "t_ns": 31 * MS, "pid": 7}])
        self.assertTrue(rows[0]["stopped_first"])
        self.assertTrue(rows[0]["already_stopped"])
        self.assertLess(rows[0]["arrival_to_stopped_ms"], 0)
        # A request that found offline running is not marked.
        rows = a.per_request([req(10 * MS, 20 * MS, 50 * MS)], self.TRACE, online_pids={7})
        self.assertFalse(rows[0]["already_stopped"])

    def test_offline_running_inside_a_decode_is_measured(self):
        # First request decodes 14-50 ms, all inside the stop (11.2-60 ms); the second decodes
        # 104-150 ms and the stop that begins at 104.1 ms never ends: offline ran 0.1 ms of it.
        # A third decodes 61-80 ms with offline resumed at 60 ms: all 19 ms.
        rs = [req(10 * MS, 14 * MS, 50 * MS), req(100 * MS, 104 * MS, 150 * MS),
              req(58 * MS, 61 * MS, 80 * MS)]
        ran = a.offline_ran_in_decode(rs, self.TRACE)
        self.assertAlmostEqual(ran[0], 0.0)
        self.assertAlmostEqual(ran[1], 0.1)
        self.assertAlmostEqual(ran[2], 19.0)
        trace = self.TRACE + [{"event": "launch", "t_ns": 61 * MS, "pid": 7, "after_resume": True}]
        d = a.decode_summary([(rs, trace)])
        self.assertEqual((d["requests"], d["with_offline_running"], d["edges_after_resume"]), (3, 2, 1))
        self.assertAlmostEqual(d["offline_ran_max_ms"], 19.0)

    def test_tails_list_the_decisions_a_slow_first_token_waited_on(self):
        rs = [req(100 * MS, 160 * MS, 200 * MS)]
        t = a.tails(rs, self.TRACE, 50)
        self.assertEqual(len(t), 1)
        self.assertEqual(t[0]["ttft_ms"], 60)
        self.assertIn("+3.00 ms launch", t[0]["decisions"][0])
        self.assertIn("disable took 1050 us", t[0]["decisions"][1])
        self.assertEqual((t[0]["resumed_inside"], t[0]["disables_inside"]), (False, 1))
        # A request whose first token came after a resume inside it.
        t = a.tails([req(50 * MS, 70 * MS, 90 * MS)], self.TRACE, 10)
        self.assertTrue(t[0]["resumed_inside"])
        self.assertIn("+10.00 ms cooldown after 4.00 ms idle", t[0]["decisions"][0])
        self.assertNotIn("ignoring a wait", t[0]["decisions"][0])
        # A resume that ignored a wait (the gate's stuck-wait bound) says so.
        trace = [dict(r, waits_ignored=True) if r["event"] == "cooldown" else r for r in self.TRACE]
        t = a.tails([req(50 * MS, 70 * MS, 90 * MS)], trace, 10)
        self.assertIn("ignoring a wait", t[0]["decisions"][0])

    def test_late_arrivals_show_what_the_gate_was_doing(self):
        # The second request's offline stopped after its kernel: listed, with the decisions up
        # to the stop. The first was stopped first and its hop was short: not listed.
        trace = [dict(r, recv_ns=10_150_000) if r["event"] == "arrival" else r for r in self.TRACE]
        rs = [req(10 * MS, 20 * MS, 50 * MS), req(100 * MS, 110 * MS, 150 * MS)]
        late = a.late_arrivals(rs, trace, online_pids={7})
        self.assertEqual([r["send_ns"] for r in late], [100 * MS])
        self.assertEqual(late[0]["decisions"], ["+3.00 ms launch", "+3.05 ms disable took 1050 us"])
        # A hop to the gate thread over the threshold lists the first one too, with what came before.
        slow = [dict(r, recv_ns=11_050_000) if r["event"] == "arrival" else r for r in self.TRACE]
        late = a.late_arrivals(rs, slow, online_pids={7}, hop_ms=0.5)
        self.assertEqual([r["send_ns"] for r in late], [10 * MS, 100 * MS])
        self.assertTrue(late[0]["stopped_first"])
        self.assertIn("+0.05 ms arrival (gate got it +1000 us)", late[0]["decisions"])

    def test_targets_pass_and_fail(self):
        alone = {"ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "tpot_p99_ms": 5.0, "requests": 10}
        good = {"ttft_p50_ms": 10.05, "ttft_p99_ms": 20.3, "tpot_p99_ms": 5.02, "requests": 10}
        rows = [{"arrival_to_kernel_ms": 3.0, "stopped_first": True}] * 10
        checks = a.check_targets(alone, good, rows, 8, 0.95)
        self.assertTrue(all(ok for _, _, ok in checks), checks)
        bad = dict(good, ttft_p99_ms=30.0)
        checks = a.check_targets(alone, bad, rows[:9] + [{"arrival_to_kernel_ms": 1, "stopped_first": False}], 12, 0.5)
        failed = [name for name, _, ok in checks if not ok]
        self.assertEqual(len(failed), 4, checks)


class Pool(unittest.TestCase):
    @staticmethod
    def report(ttft_alone_ms, ttft_gate_ms, stopped_first):
        """One report at load 0.3: a round of alone and of the gate, one request per TTFT given."""

        def recs(ttfts):
            return [dict(req(0, int(t * MS), int(t * MS) + 10 * MS), i=i) for i, t in enumerate(ttfts)]

        per = [{"arrival_to_kernel_ms": 3.0, "stopped_first": s} for s in stopped_first]
        return {
            "runs": [{"load": 0.3, "config": "alone", "round": 0, "records": recs(ttft_alone_ms)},
                     {"load": 0.3, "config": "gate-arrival", "round": 0, "records": recs(ttft_gate_ms)}],
            "loads": [{"load": 0.3, "rows": {
                "alone": {"requests": len(ttft_alone_ms)},
                "gate-arrival": {"requests": len(ttft_gate_ms), "per_request": per,
                                 "preemptions_per_request": 0.5}}}],
        }

    def test_runs_pool_requests_and_pair_each_with_alones_same_request(self):
        one = self.report([10, 20], [11, 22], [True, True])
        two = self.report([30, 40], [30, 40], [True, False])
        pooled = a.pool_reports([one, two])[0.3]
        gate = pooled["gate-arrival"]
        self.assertEqual(gate["requests"], 4)
        self.assertEqual(gate["stopped_first"], (3, 4))
        self.assertAlmostEqual(gate["preemptions"], 2.0)
        # Ratios 1.1, 1.1, 1.0, 1.0: the median (nearest rank) is 1.0.
        self.assertAlmostEqual(gate["ttft_ratio_median"], 1.0)
        self.assertAlmostEqual(pooled["alone"]["ttft_p50_ms"], 20.0)
        self.assertAlmostEqual(gate["ttft_p50_ms_vs_alone_pct"], 10.0)

    def test_a_request_pairs_only_with_the_same_report_round_and_index(self):
        one = self.report([10], [20], [True])
        two = self.report([100], [200], [True])
        gate = a.pool_reports([one, two])[0.3]["gate-arrival"]
        self.assertAlmostEqual(gate["ttft_ratio_median"], 2.0)


class PairedInterval(unittest.TestCase):
    @staticmethod
    def config(ttfts_ms):
        """One round of requests with these TTFTs (ms), keyed as the bench keys them."""
        return {(0, i): req(0, int(t * MS), int(t * MS) + 40 * MS) for i, t in enumerate(ttfts_ms)}

    def test_a_uniform_slowdown_is_pinned_down_and_identical_runs_straddle_zero(self):
        base = self.config([10 + (i % 50) / 10 for i in range(200)])
        slower = self.config([1.05 * (10 + (i % 50) / 10) for i in range(200)])
        lo, hi = a.paired_change_interval(base, slower, a.ttft_ms, 50)
        self.assertAlmostEqual(lo, 5.0, places=6)
        self.assertAlmostEqual(hi, 5.0, places=6)
        lo, hi = a.change_intervals(base, base)["ttft_p99_ms"]
        self.assertEqual((lo, hi), (0.0, 0.0))

    def test_a_tail_of_few_requests_gives_a_wide_interval(self):
        # Two slow requests in 100 under `other` only: the p99 change depends on whether a draw
        # holds them, so the interval spans no change up to the slow value.
        base = self.config([10.0] * 100)
        other = self.config([10.0] * 98 + [20.0, 20.0])
        lo, hi = a.paired_change_interval(base, other, a.ttft_ms, 99)
        self.assertEqual((lo, hi), (0.0, 100.0))

    def test_too_few_pairs_or_unpaired_keys_give_none(self):
        self.assertIsNone(a.paired_change_interval(self.config([10] * 19), self.config([11] * 19), a.ttft_ms, 50))
        shifted = {(1, i): r for (_, i), r in self.config([10] * 50).items()}
        self.assertIsNone(a.paired_change_interval(self.config([10] * 50), shifted, a.ttft_ms, 50))

    def test_tpot_leaves_out_failed_and_one_token_requests(self):
        self.assertEqual(a.tpot_ms(req(0, 10 * MS, 50 * MS)), 10.0)
        self.assertIsNone(a.tpot_ms(req(0, 10 * MS, 50 * MS, tokens=1)))
        self.assertIsNone(a.tpot_ms(dict(req(0, 10 * MS, 50 * MS), error="reset")))


class HoldReplay(unittest.TestCase):
    @staticmethod
    def trace(delays_ms):
        """One arrival a second, each followed by a launch after its delay."""
        out = []
        for i, d in enumerate(delays_ms):
            t = (i + 1) * 1000 * MS
            out += [{"event": "arrival", "t_ns": t}, {"event": "launch", "t_ns": t + int(d * MS)}]
        return out

    def test_a_late_first_launch_is_learned_only_by_the_new_rule(self):
        # 4 ms learned: hold 8 ms. 20 ms runs past it; the next 20 ms is held through only if
        # the first was learned.
        tr = self.trace([4, 4, 20, 20, 20])
        self.assertEqual(a.hold_expiries(tr, learn_expired=False), 3)
        self.assertEqual(a.hold_expiries(tr, learn_expired=True), 1)

    def test_an_edge_after_other_launches_is_not_the_arrival_s_first_launch(self):
        # An idle arrival at 0 launches at 4 ms (hold 8 ms). An arrival at 100 ms while a
        # request runs: its next edge, at 150 ms, came 0.3 ms after another launch, so it is not
        # its first. An idle arrival at 300 ms launches 20 ms later, past the 8 ms hold (a 2 x
        # 50 ms hold, learned from the busy arrival, would have hidden that).
        tr = [{"event": "arrival", "t_ns": 0},
              {"event": "launch", "t_ns": 4 * MS, "idle_ns": 900 * MS},
              {"event": "arrival", "t_ns": 100 * MS},
              {"event": "launch", "t_ns": 150 * MS, "idle_ns": 300_000},
              {"event": "arrival", "t_ns": 300 * MS},
              {"event": "launch", "t_ns": 320 * MS, "idle_ns": 150 * MS}]
        self.assertEqual(a.first_launch_delays(tr), [4 * MS, None, 20 * MS])
        self.assertEqual(a.hold_expiries(tr, learn_expired=True), 1)

    def test_the_ceiling_is_the_hold_until_a_delay_is_learned_and_caps_it(self):
        self.assertEqual(a.hold_expiries(self.trace([150]), learn_expired=True), 0)
        self.assertEqual(a.hold_expiries(self.trace([1, 250]), learn_expired=True), 1)


class GpuStart(unittest.TestCase):
    """Arrival -> first kernel running, from the graph server's stamps (gpu_start_ns)."""

    def stamped(self, send, gpu_after_us, idle=True):
        r = req(send, send + 20 * MS, send + 100 * MS, idle=idle)
        if gpu_after_us is not None:
            r["gpu_start_ns"] = send + gpu_after_us * 1_000
        return r

    def test_idle_arrivals_only_with_p50_p99_and_unknowns_counted(self):
        recs = [self.stamped(i * 1000 * MS, 100 + 10 * i) for i in range(10)]
        recs.append(self.stamped(20_000 * MS, None))  # idle, no stamp: unknown
        recs.append(self.stamped(21_000 * MS, 5))  # busy at send: not an idle arrival
        recs[-1]["idle_at_send"] = False
        s = a.gpu_start_stats(recs)
        self.assertEqual(s["gpu_start_idle_arrivals"], 11)
        self.assertEqual(s["gpu_start_unknown"], 1)
        self.assertAlmostEqual(s["arrival_to_gpu_start_p50_ms"], 0.140)
        self.assertAlmostEqual(s["arrival_to_gpu_start_p99_ms"], 0.190)
        self.assertEqual(s["gpu_start_before_arrival"], 0)

    def test_the_time_is_stamp_minus_send_and_a_stamp_before_the_arrival_is_counted(self):
        rows = a.gpu_start_rows([self.stamped(0, 250), self.stamped(MS, -30)])
        self.assertAlmostEqual(rows[0]["arrival_to_gpu_start_ms"], 0.250)  # not -0.250
        self.assertEqual(a.gpu_start_stats([self.stamped(MS, -30)])["gpu_start_before_arrival"], 1)

    def test_no_stamps_at_all_gives_none_not_zero(self):
        s = a.gpu_start_stats([self.stamped(0, None), self.stamped(MS, None)])
        self.assertIsNone(s["arrival_to_gpu_start_p50_ms"])
        self.assertEqual(s["gpu_start_unknown"], 2)




class DisableSplit(unittest.TestCase):
    """Idle arrivals' launch -> GPU start by when the server launched after the gate's disable."""

    @staticmethod
    def marked(send, launch_us, gpu_us, idle=True):
        r = req(send, send + MS, send + 2 * MS, idle=idle)
        r.update(launch_ns=send + launch_us * 1_000, gpu_start_ns=send + gpu_us * 1_000)
        return r

    @staticmethod
    def disable(t, pid=0, ok=True):
        return {"event": "disable", "t_ns": t, "end_ns": t + 800_000, "pid": pid, "ok": ok}

    def test_the_launch_is_timed_from_the_first_whole_offline_disable_in_the_request(self):
        recs = [self.marked(0, 220, 400), self.marked(10 * MS, 220, 700), self.marked(20 * MS, 50, 250)]
        trace = [self.disable(30_000), self.disable(10 * MS + 20_000),  # issued 30 and 20 us after the sends
                 self.disable(20 * MS + 100_000, pid=9),  # one process's disable: not the gate's
                 self.disable(20 * MS + 120_000)]  # after the third request's launch (at 50 us)
        rows = a.disable_split_rows(recs, trace)
        self.assertEqual([r["launch_after_issue_us"] for r in rows], [190.0, 200.0, -70.0])
        self.assertEqual([r["launch_to_gpu_start_us"] for r in rows], [180.0, 480.0, 200.0])
        stats = a.disable_split_stats(rows)
        self.assertEqual([(b["bucket_us"], b["n"]) for b in stats], [("< 0", 1), ("0-200", 1), ("200-400", 1)])
        self.assertEqual(stats[2]["p50_us"], 480.0)

    def test_no_disable_in_the_request_busy_arrivals_and_missing_marks_give_no_row(self):
        recs = [self.marked(0, 220, 400), self.marked(10 * MS, 220, 400, idle=False),
                req(20 * MS, 21 * MS, 22 * MS)]
        trace = [self.disable(3 * MS), self.disable(10 * MS + 1), self.disable(20 * MS + 1)]
        self.assertEqual(a.disable_split_rows(recs, trace), [])  # the first disable came after the request
        self.assertEqual(a.disable_split_stats([]), [])


class HostPath(unittest.TestCase):
    """Where an idle arrival's time went: send -> recv -> host launch -> GPU start (graph servers' marks)."""

    def marked(self, send, recv_us, launch_us, gpu_us=None, idle=True):
        r = req(send, send + MS, send + 2 * MS, idle=idle)
        r.update(recv_ns=send + recv_us * 1_000, launch_ns=send + launch_us * 1_000)
        if gpu_us is not None:
            r["gpu_start_ns"] = send + gpu_us * 1_000
        return r

    def test_each_step_is_the_difference_of_its_marks_over_idle_arrivals_only(self):
        recs = [self.marked(i * MS, 40 + i, 60 + 2 * i, 90 + 3 * i) for i in range(10)]
        recs.append(self.marked(20 * MS, 900, 1900, 2900, idle=False))  # busy: not counted
        s = a.host_path_stats(recs)
        self.assertAlmostEqual(s["send_to_recv_p50_ms"], 0.044)
        self.assertAlmostEqual(s["recv_to_launch_p50_ms"], 0.024)  # (60 + 8) - (40 + 4) us
        self.assertAlmostEqual(s["launch_to_gpu_start_p99_ms"], 0.039)  # (90 + 27) - (60 + 18) us
        self.assertEqual(len(a.host_path_rows(recs)), 10)

    def test_steps_without_their_marks_are_left_out_and_no_marks_add_nothing(self):
        s = a.host_path_stats([self.marked(0, 30, 50)])  # no stamp: no GPU step
        self.assertEqual(sorted(s), ["recv_to_launch_p50_ms", "recv_to_launch_p99_ms",
                                     "send_to_recv_p50_ms", "send_to_recv_p99_ms"])
        self.assertEqual(a.host_path_stats([req(0, MS, 2 * MS)]), {})


class BracketAloneTest(unittest.TestCase):
    def test_the_reference_is_the_mean_of_the_readings_before_and_after_and_says_how_far_they_moved(self):
        mean, moved = a.bracket_alone(15.3, 18.0)
        self.assertAlmostEqual(mean, 16.65)
        self.assertAlmostEqual(moved, 2.7 / 16.65)
        self.assertEqual(a.bracket_alone(15.3, None), (15.3, None))
        self.assertEqual(a.bracket_alone(None, 18.0), (18.0, None))
        self.assertEqual(a.bracket_alone(None, None), (None, None))


if __name__ == "__main__":
    unittest.main()
