"""Unit tests of run.py's checks made before a benchmark starts (standard library only)."""

import os
import sys
import unittest

import run


def refused(test: unittest.TestCase, *args: str) -> str:
    """run.py's main with these arguments exits 2 before anything starts; its stderr."""
    import contextlib
    import io

    argv, sys.argv = sys.argv, ["run.py", "--valvectl", "x", "--out", "/tmp/x", *args]
    try:
        with test.assertRaises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()) as err:
            run.main()
    finally:
        sys.argv = argv
    test.assertEqual(e.exception.code, 2)
    return err.getvalue()


class Configs(unittest.TestCase):
    def test_every_known_configuration_runs_in_any_order_after_alone(self):
        self.assertIsNone(run.config_problem(list(run.CONFIGS), have_sizes=False))

    def test_a_misspelt_configuration_is_named_with_the_choices(self):
        msg = run.config_problem(["alone", "valve-mad"], have_sizes=False)
        self.assertIn("valve-mad", msg)
        self.assertIn("valve-miad", msg)

    def test_static_without_an_alone_run_before_it_is_refused_unless_sizes_exist(self):
        self.assertIn("alone before static", run.config_problem(["static", "alone"], have_sizes=False))
        self.assertIsNone(run.config_problem(["static"], have_sizes=True))


class Episodes(unittest.TestCase):
    def test_sizes_and_rates_are_comma_separated_numbers(self):
        self.assertEqual(run.floats("5,10,25.5"), [5.0, 10.0, 25.5])

    def test_a_misspelt_policy_stops_the_episodes_before_anything_starts(self):
        self.assertIn("lru", refused(self, "episodes", "--policies", "alg1,lru"))


    def test_an_episode_lead_that_leaves_no_tail_stops_before_anything_starts(self):
        self.assertIn("--tail", refused(self, "episodes", "--lead", "18"))

    def test_the_episode_budget_keeps_room_for_a_group_and_the_last_base_at_the_longest_episode(self):
        import types
        import time

        a = types.SimpleNamespace(budget_s=200.0, measure_s=20.0, drain_s=3.0, policies=["alg1", "fifo"])
        done = [dict(t0=0.0, t_stop=30.0)]  # the longest so far: 30 s + 3 s drain + 1 s = 34 s an episode
        now = time.monotonic()
        self.assertFalse(run.out_of_budget(a, done, now - 60))  # 60 + 4 x 34 = 196 <= 200
        self.assertTrue(run.out_of_budget(a, done, now - 70))  # 70 + 136 > 200
        self.assertFalse(run.out_of_budget(types.SimpleNamespace(**{**vars(a), "budget_s": 0}), done, now - 1e6))


def have_transformers_5() -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return int(transformers.__version__.split(".")[0]) >= 5


@unittest.skipUnless(have_transformers_5(), "needs torch and transformers >= 5 (the GPU hosts have them): skipped")
class EpisodesOnTheCpu(unittest.TestCase):
    def test_every_episode_runs_the_same_requests_to_the_warm_ups_count_and_drains(self):
        """offline.py --episodes with a 2-layer model on the CPU (static cache: no pool, no reclaim)."""
        import subprocess
        import sys
        import tempfile

        import common

        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, MEMBENCH_TINY="1", MEMBENCH_DEVICE="cpu")
        with tempfile.TemporaryDirectory() as t:
            d = os.path.join(t, "ep")
            os.makedirs(d)
            subprocess.run([sys.executable, "-c", f"import common; common.build_model({t + '/model'!r})"],
                           cwd=here, env=env, check=True)
            off = subprocess.Popen([sys.executable, "offline.py", "--model", t + "/model", "--mode", "static",
                                    "--num-blocks", "64", "--out", t + "/off.json", "--episodes", d,
                                    "--ready", d + "/ready", "--prompt", "100", "300", "--new-tokens", "32",
                                    "--max-batch-tokens", "256", "--max-requests", "16", "--episode-requests", "3000"],
                                   cwd=here, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                run.wait_files([d + "/ready"], [off], 120)
                done, goal = [], None
                for k in (1, 2, 3):
                    spec = dict(k=k, start_at=common.now() + 0.2, backlog=12, max_s=60)
                    spec.update(dict(measure_s=1.5) if goal is None else dict(tokens=goal))
                    common.write_json(f"{d}/episode-{k}.json.new", spec)
                    os.replace(f"{d}/episode-{k}.json.new", f"{d}/episode-{k}.json")
                    run.wait_files([f"{d}/episode-{k}.done.json"], [off], 120)
                    done.append(common.read_json(f"{d}/episode-{k}.done.json"))
                    goal = goal or done[-1]["tokens"]
                open(d + "/stop", "w").close()
                self.assertEqual(off.wait(timeout=60), 0)
            finally:
                off.kill()
        for r in done:
            self.assertEqual(r["errors"], [])
            self.assertTrue(r["drained"])
            self.assertIsNotNone(r["seconds"])
        self.assertEqual(done[1]["tokens"], done[0]["tokens"])
        # the same requests in the same order: about the same ones used and finished by the same count (a
        # finished request is replaced when the main thread sees it, a step or so after the fact)
        self.assertLessEqual(abs(done[1]["used"] - done[2]["used"]), 2)
        self.assertLessEqual(abs(done[1]["finished"] - done[2]["finished"]), 2)


class Churn(unittest.TestCase):
    def test_valve_churn_restarts_the_gate_as_run_config_starts_it_until_online_s_last_arrival(self):
        import tempfile
        from types import SimpleNamespace

        import common

        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "trace.json")
            common.write_json(trace, [dict(at=3.0, prompt=10, new_tokens=1, burst=False),
                                      dict(at=67.5, prompt=10, new_tokens=1, burst=True)])
            r = SimpleNamespace(a=SimpleNamespace(valvectl="/x/valvectl", churn_gate_every=2.0, churn_flooders=3), out=d)
            on = SimpleNamespace(pid=4242, poll=lambda: None)
            c = run.new_churn(r, "valve-churn", on, trace, go_t=100.0)
        self.assertEqual(c.cycler.start_args, ["gate", "start", "--online", "4242", "--offline-label", "batch"])
        self.assertEqual(c.cycler.start_args, run.gate_start_args(4242))
        self.assertEqual(c.cycler.deadline, 167.5)
        self.assertEqual((c.every, len(c.flooders)), (2.0, 3))
        self.assertTrue(c.cycler.alive())
        self.assertEqual(c.log_path, os.path.join(d, "valve-churn-daemon.log"))

    def test_a_gate_restart_interval_of_zero_is_refused_before_anything_starts(self):
        self.assertIn("--churn-gate-every", refused(self, "bench", "--configs", "valve-churn", "--churn-gate-every", "0"))


class Generated(unittest.TestCase):
    def test_a_requeued_request_counts_its_earlier_tokens_once(self):
        from types import SimpleNamespace

        import offline  # standard library at import time; torch only in main()

        g = offline.Generated()
        st = SimpleNamespace(generated_tokens=[1] * 30, initial_tokens=[0] * 100, _true_initial_tokens=None)
        g.step(SimpleNamespace(active_requests={"r": st}))
        # Requeued: 30 generated tokens folded into the prompt, 5 generated since.
        again = SimpleNamespace(generated_tokens=[1] * 5, initial_tokens=[0] * 130, _true_initial_tokens=100)
        g.step(SimpleNamespace(active_requests={"r": again}))
        self.assertEqual(g.total, 35)
        g.finished("r", 40)  # the output has the original split: all 40 generated tokens
        self.assertEqual(g.total, 40)
        self.assertEqual([n for _, n in g.timeline], [30, 35, 40])


class WarmFrom(unittest.TestCase):
    def test_a_saved_state_is_used_only_by_the_warm_run_and_instead_of_its_first_pass(self):
        import json
        import tempfile
        from types import SimpleNamespace
        with tempfile.TemporaryDirectory() as d:
            saved = os.path.join(d, "saved.json")
            with open(saved, "w") as f:
                json.dump({"version": 1, "entries": []}, f)
            self.assertIsNone(run.warm_from_problem(None, 0, ["alone"]))
            self.assertIsNone(run.warm_from_problem(saved, 0, ["static", "valve-miad-warm"]))
            self.assertIn("add it to --configs", run.warm_from_problem(saved, 0, ["valve-miad"]))
            self.assertIn("drop --warm-prime-seconds", run.warm_from_problem(saved, 450, ["valve-miad-warm"]))
            self.assertIn("not a readable", run.warm_from_problem(os.path.join(d, "none.json"), 0, ["valve-miad-warm"]))
            out = os.path.join(d, "out")
            os.makedirs(out)
            r = SimpleNamespace(a=SimpleNamespace(warm_from=saved), out=out)
            state = run.warm_start(r, {})
            self.assertEqual(state, os.path.join(out, "reservations.json"))
            with open(state) as f:
                self.assertEqual(json.load(f), {"version": 1, "entries": []})


    def test_a_first_pass_alone_is_only_for_the_warm_run_and_not_with_a_saved_state(self):
        self.assertIsNone(run.prime_only_problem(False, None, ["alone", "static"]))
        self.assertIsNone(run.prime_only_problem(True, None, ["valve-miad-warm"]))
        self.assertIn("--configs valve-miad-warm", run.prime_only_problem(True, None, ["alone", "valve-miad-warm"]))
        self.assertIn("pass one of them", run.prime_only_problem(True, "saved.json", ["valve-miad-warm"]))


    def test_a_warm_max_age_the_daemon_would_refuse_is_refused_first(self):
        self.assertIsNone(run.warm_max_age_problem("24h"))
        self.assertIsNone(run.warm_max_age_problem("168h"))
        self.assertIsNone(run.warm_max_age_problem("90m"))
        self.assertIn("at most 7 days", run.warm_max_age_problem("720h"))
        self.assertIn("a duration such as", run.warm_max_age_problem("7d"))


class DaemonArgv(unittest.TestCase):
    def test_only_valve_churn_keeps_the_gate_watchers_and_zero_turns_it_off(self):
        from types import SimpleNamespace
        a = SimpleNamespace(valvectl="/x/valvectl", churn_keep_watchers=600)
        churn = run.daemon_argv(a, "valve-churn", 12, 6.0, None)
        self.assertEqual(churn[churn.index("--gate-keep-watchers") + 1], "600")
        self.assertNotIn("--gate-keep-watchers", run.daemon_argv(a, "valve-miad", 12, 6.0, None))
        a.churn_keep_watchers = 0
        self.assertNotIn("--gate-keep-watchers", run.daemon_argv(a, "valve-churn", 12, 6.0, None))
        warm = run.daemon_argv(SimpleNamespace(valvectl="v", warm_max_age="168h"), "valve-miad-warm", 12, 6.0, "s.json")
        self.assertEqual(warm[warm.index("--pool-warm-max-age") + 1], "168h")
        cold = run.daemon_argv(SimpleNamespace(valvectl="v", warm_max_age="168h"), "valve-miad", 12, 6.0, None)
        self.assertNotIn("--pool-warm-max-age", cold, "a cold start saves nothing and reads nothing")
        plain = run.daemon_argv(SimpleNamespace(valvectl="v"), "static", None, 6.0, None)
        self.assertEqual(plain, ["v", "daemon"], "no pool, no flags; episodes' args have no churn options")

    def test_a_pinned_lanes_daemon_gets_every_cpu_back(self):
        from types import SimpleNamespace
        from unittest import mock
        with mock.patch.dict(run.os.environ, {"VALVE_DAEMON_CPUS": "0-63"}):
            self.assertEqual(run.daemon_argv(SimpleNamespace(valvectl="v"), "static", None, 6.0, None),
                             ["taskset", "-c", "0-63", "v", "daemon"])
        for unpinned in ({}, {"VALVE_DAEMON_CPUS": ""}):
            self.assertEqual(run.daemon_cpus_prefix(unpinned), [], "a shared lane or no lane: as it is")

    def test_a_lane_pools_only_its_own_gpu(self):
        from types import SimpleNamespace
        from unittest import mock
        with mock.patch.object(run.common, "GPU", 2):
            argv = run.daemon_argv(SimpleNamespace(valvectl="v"), "valve-miad", 12, 6.0, None)
            self.assertEqual(argv[argv.index("--pool-gpus") + 1], "2")
            self.assertEqual(run.gate_start_args(7)[-2:], ["--offline-label", run.common.OFFLINE_LABEL])



if __name__ == "__main__":
    unittest.main()
