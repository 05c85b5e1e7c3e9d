#!/usr/bin/env bash
# Tests of the driver-patch applier on synthetic trees; prints "N passed, M failed".
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out=$(PYTHONDONTWRITEBYTECODE=1 python3 -W error::ResourceWarning -m unittest -v "$here/test_patch_driver.py" 2>&1)
rc=$?
echo "$out" | grep -E "\.\.\. |^(FAIL|ERROR):" | head -40
total=$(echo "$out" | sed -n 's/^Ran \([0-9]*\) tests\?.*/\1/p')
bad=$(echo "$out" | sed -n 's/^FAILED (\(.*\))/\1/p' | grep -o '\(failures\|errors\)=[0-9]\+' | cut -d= -f2 | awk '{s+=$1} END {print s+0}')
bad=${bad:-0}
if [ -z "$total" ]; then echo "$out" | tail -20; echo "0 passed, 1 failed"; exit 1; fi
skipped=$(echo "$out" | sed -n 's/.*skipped=\([0-9]*\).*/\1/p' | tail -1)
skipped=${skipped:-0}
summary="$((total - bad - skipped)) passed, $bad failed"
[ "$skipped" = 0 ] || summary="$summary, $skipped skipped (--install test needs root)"
echo "$summary"
exit $rc
