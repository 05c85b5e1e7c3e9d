#!/usr/bin/env bash
# CPU self-test of the memory benchmark's arithmetic (report.py, common.py; standard library only)
# and of valve-churn's threads against a fake valvectl and a fake control socket (churn.py).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m unittest -v test_report test_run test_eviction test_episodes test_churn 2>&1 | tail -3
# The shim's handle choice (alg1, fifo, random) on a fake layout: standard library only.
(cd ../../integrations/transformers && python3 -m unittest tests.test_selection 2>&1 | tail -3)
# The varlen attention's plumbing needs torch and transformers: it says it skipped where they are missing.
python3 -m unittest -v test_varlen_attention 2>&1 | tail -7
