"""report.py's arithmetic on synthetic results folders (standard library only)."""

import json
import os
import tempfile
import unittest

import report

MS = 1_000_000
S = 1_000_000_000


def rec(send_ms, first_ms, last_ms, tokens, err=None):
    r = dict(send_ns=send_ms * MS, first_ns=first_ms * MS, last_ns=last_ms * MS, end_ns=last_ms * MS,
             tokens=tokens, error=err)
    r["server_token_ns"] = [int((first_ms - 1 + i * (last_ms - first_ms) / max(tokens - 1, 1)) * MS)
                            for i in range(tokens)]
    return r


def write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        if path.endswith(".jsonl"):
            f.write("".join(json.dumps(x) + "\n" for x in obj))
        else:
            json.dump(obj, f)


def write_progress(path, rate_per_s, t0_s, t1_s):
    with open(path, "w") as f:
        for k in range(int((t1_s - t0_s) * 10) + 1):
            t = t0_s + k / 10
            f.write(f"{int(t * S)} {rate_per_s * (t - t0_s):.3f}\n")


STATUS = {"preemptions": 30, "resumes": 30, "preempted_s": 4.5, "offline_gpus": 2, "offline_pids": [11, 12],
          "online_pids": [21, 22], "disable_us": {"n": 30, "p50_us": 1500.0, "p99_us": 2100.0},
          "edge_to_disable_us": {"n": 30, "p50_us": 1700.0, "p99_us": 2500.0}, "arrival_to_disable_us": {},
          "issue": "serial (measured: 2 GPUs: serial 1594 us (1.97x one GPU), parallel 1729 us (2.13x), one GPU 810 us)",
          "errors": 0, "last_error": None}


class Serve(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        write(os.path.join(self.dir, "meta.json"), {"gpus": 2, "configs": ["alone", "gate", "timeslice"]})
        alone = [rec(1000 * i, 1000 * i + 10, 1000 * i + 40, 4) for i in range(1, 11)]
        gated = [rec(1000 * i, 1000 * i + 20, 1000 * i + 80, 4) for i in range(1, 11)]
        write(os.path.join(self.dir, "alone", "records-0.json"), alone)
        g = os.path.join(self.dir, "gate")
        write(os.path.join(g, "records-0.json"), gated)
        write(os.path.join(g, "alone-window.json"), {"start_ns": 0, "end_ns": 1 * S})
        for k in range(2):
            write_progress(os.path.join(g, f"progress-g{k}.txt"), 10.0, 0, 12)
        write(os.path.join(g, "gate-status.json"), STATUS)
        write(os.path.join(g, "gate-trace.jsonl"), [
            {"seq": 1, "t_ns": 5 * S, "event": "disable", "pid": 0, "end_ns": 5 * S + 1_000_000, "ok": True},
            {"seq": 2, "t_ns": 6 * S, "event": "enable", "pid": 0, "end_ns": 6 * S + 500_000, "ok": True},
            {"seq": 3, "t_ns": 7 * S, "event": "disable", "pid": 0, "end_ns": 7 * S + 3_000_000, "ok": True},
            {"seq": 4, "t_ns": 8 * S, "event": "disable", "pid": 11, "end_ns": 8 * S + 9_000_000, "ok": True}])

    def test_rows_ratios_and_gate(self):
        rep = report.serve_report(self.dir)
        rows = {r["config"]: r for r in rep["rows"]}
        self.assertEqual(set(rows), {"alone", "gate"})  # timeslice: no folder, no row
        self.assertAlmostEqual(rows["alone"]["ttft_p50_ms"], 10.0)
        self.assertAlmostEqual(rows["gate"]["tpot_p99_ms"], 20.0)
        self.assertAlmostEqual(rows["gate"]["vs_alone"]["ttft_p99_ms"], 2.0)
        self.assertAlmostEqual(rows["gate"]["vs_alone"]["tpot_p50_ms"], 2.0)
        self.assertAlmostEqual(rows["gate"]["server_tpot_p50_ms"], 20.0)
        g = rows["gate"]["gate"]
        self.assertAlmostEqual(g["preemptions_per_request"], 3.0)
        self.assertEqual(g["disable_trace_n"], 2)  # the per-process retry is not a whole disable
        self.assertAlmostEqual(g["disable_trace_p50_us"], 1000.0)
        self.assertAlmostEqual(g["disable_trace_p99_us"], 3000.0)
        self.assertEqual(g["issue_probe"], dict(gpus=2, serial_us=1594.0, parallel_us=1729.0, single_us=810.0,
                                               mode="serial"))
        self.assertIsNone(rows["alone"]["gate"])
        # Frozen from 5.001 s to 6 s (the per-process retry at 8 s is not a whole disable) and from
        # 7.003 s to the window's end at 10.08 s, of the window 1 .. 10.08 s.
        self.assertAlmostEqual(g["frozen_share"], (0.999 + 3.077) / 9.08, places=4)
        self.assertAlmostEqual(g["idle_share"], 1 - 0.8 / 9.08, places=4)

    def test_offline_against_alone_and_harvest(self):
        rows = {r["config"]: r for r in report.serve_report(self.dir)["rows"]}
        off = rows["gate"]["offline"]
        self.assertEqual([x["gpu"] for x in off], [0, 1])
        self.assertAlmostEqual(off[0]["alone_per_s"], 10.0, places=6)
        # Running at its alone rate all through: offline vs alone 1, and more than all the idle time.
        self.assertAlmostEqual(rows["gate"]["offline_vs_alone"], 1.0, places=6)
        self.assertGreater(rows["gate"]["harvested"], 1.0)

    def test_markdown_says_na_for_what_was_not_measured(self):
        md = report.serve_markdown(report.serve_report(self.dir))
        self.assertIn("| alone (n/a) | 10 (0) |", md)
        self.assertIn("n/a", md)
        self.assertIn("810 / 1594 / 1729", md)

    def test_dry_run_is_labelled(self):
        self.assertIn("Dry run on a CPU", report.note({"dry_run": True}))
        self.assertNotIn("Dry run", report.note({"dry_run": False}))


class Pieces(unittest.TestCase):
    def test_issue_probe_absent(self):
        self.assertIsNone(report.issue_probe("serial (default, not measured)"))
        self.assertIsNone(report.issue_probe(None))

    def test_rate_and_progress(self):
        samples = [(0, 0.0), (S, 5.0), (3 * S, 25.0)]
        self.assertAlmostEqual(report.rate(samples, 0, S), 5.0)
        self.assertAlmostEqual(report.rate(samples, S, 3 * S), 10.0)
        self.assertIsNone(report.rate([], 0, S))
        self.assertIsNone(report.rate(samples, S, S))

    def test_client_alignment(self):
        a = [dict(send_ns=0, end_ns=2 * S), dict(send_ns=5 * S, end_ns=6 * S)]
        same = report.client_alignment(a, a, 0, 10 * S)
        self.assertAlmostEqual(same["score"], 1.0)
        self.assertAlmostEqual(same["union"], 0.3)
        b = [dict(send_ns=1 * S, end_ns=3 * S)]
        x = report.client_alignment(a, b, 0, 10 * S)
        self.assertAlmostEqual(x["overlap"], 0.1)
        self.assertAlmostEqual(x["union"], 0.4)
        self.assertAlmostEqual(x["score"], 0.25)
        self.assertAlmostEqual(report.client_alignment([], [], 0, S)["score"], 1.0)

    def test_unadmitted(self):
        pred = dict(idle=0.6, overlap=0.05, interrupted=0.05, memory=1.0, speed=1.0, per_s=0.0)
        self.assertAlmostEqual(report.unadmitted(pred, 10.0), 6.0)
        self.assertIsNone(report.unadmitted(None, 10.0))

    def test_profile_is_what_the_scheduler_reads(self):
        p = report.job_profile(12.5, {"gpu_pair": [0, 1], "device": "H200", "alone_s": 20}, 123)
        self.assertEqual((p["version"], p["gpus"], p["alone_per_s"]), (1, 2, 12.5))
        self.assertEqual(p["curve"], [{"memory_bytes": 1 << 30, "per_s": 12.5}])
        self.assertEqual(p["measured"], {"device": "H200", "unix_ms": 123, "seconds_per_point": 20.0})


class Align(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        write(os.path.join(self.dir, "meta.json"), {"gpu_pair": [0, 1], "window_s": 10, "job_id": "align",
                                                   "phases": ["instep", "outstep"]})
        write(os.path.join(self.dir, "alone-window.json"), {"start_ns": 0, "end_ns": 10 * S})
        write_progress(os.path.join(self.dir, "progress.txt"), 10.0, 0, 100)
        for name, score, union, job_rate in (("instep", 0.95, 0.3, 7.0), ("outstep", 0.2, 0.5, 5.0)):
            d = os.path.join(self.dir, name)
            write(os.path.join(d, "window.json"), {"start_ns": 20 * S, "end_ns": 45 * S, "start_unix_s": 1000.0,
                                                   "end_unix_s": 1025.0, "mode": name})
            write(os.path.join(d, "records-0.json"), [dict(send_ns=21 * S, end_ns=22 * S, first_ns=21 * S + MS,
                                                          last_ns=22 * S, tokens=2, error=None)])
            write(os.path.join(d, "records-1.json"), [])
            write(os.path.join(d, "harvest.json"), {
                "generated_unix_ms": 1020_000,
                "gpus": [{"index": g, "windows": [{"window_s": 10, "busy_fraction": union}]} for g in (0, 1)],
                "pairs": [{"gpus": [0, 1], "window_s": 10, "overlap_fraction": score * union,
                           "union_fraction": union, "score": score}],
                "jobs": [{"job": "align", "rates": [{"window_s": 10, "per_s": job_rate, "covered_s": 10}]}]})
            aligned = score >= 0.8
            pred = dict(per_s=10.0 * (1 - union) if aligned else 0.0, share=0.0, idle=1 - union, overlap=0.0,
                        interrupted=0.0, memory=1.0, speed=1.0, aligned=aligned, min_alignment=score)
            write(os.path.join(d, "prediction.json"), {"node": "align", "gpus": [0, 1], "prediction": pred})

    def test_phases(self):
        rep = report.align_report(self.dir)
        self.assertAlmostEqual(rep["meta"]["alone_per_s"], 10.0, places=6)
        r = {x["phase"]: x for x in rep["rows"]}
        self.assertAlmostEqual(r["instep"]["measured_per_s"], 7.0)
        self.assertEqual(r["instep"]["measured_from"], "document")
        self.assertAlmostEqual(r["instep"]["measured_vs_alone"], 0.7, places=6)
        self.assertAlmostEqual(r["instep"]["predicted_error"], 0.0, places=6)
        self.assertAlmostEqual(r["outstep"]["predicted_per_s"], 0.0)
        self.assertAlmostEqual(r["outstep"]["predicted_error"], 1.0)
        self.assertAlmostEqual(r["outstep"]["unadmitted_per_s"], 5.0, places=6)
        self.assertAlmostEqual(r["outstep"]["unadmitted_error"], 0.0, places=6)
        self.assertEqual(r["outstep"]["doc_busy"], {0: 0.5, 1: 0.5})
        md = report.align_markdown(rep)
        self.assertIn("| outstep (outstep) |", md)

    def test_without_document_the_progress_file_counts(self):
        for name in ("instep", "outstep"):
            os.remove(os.path.join(self.dir, name, "harvest.json"))
            os.remove(os.path.join(self.dir, name, "prediction.json"))
        r = report.align_report(self.dir)["rows"][0]
        self.assertEqual(r["measured_from"], "progress file")
        self.assertAlmostEqual(r["measured_per_s"], 10.0, places=6)
        self.assertIsNone(r["predicted_per_s"])
        self.assertIsNone(r["predicted_error"])


class Cli(unittest.TestCase):
    def test_usage_and_missing_meta(self):
        self.assertEqual(report.main(["--help"]), 0)
        self.assertEqual(report.main(["serve"]), 2)
        self.assertEqual(report.main(["serve", tempfile.mkdtemp()]), 2)


if __name__ == "__main__":
    unittest.main()
