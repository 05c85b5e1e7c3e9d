#!/usr/bin/env bash
# CI's check of the Debian packages (root, Debian 12): build them (scripts/package.sh), install
# them with dpkg, run what they installed in /usr/bin (`valvectl demo`; `valve-scheduler simulate`
# through the installed valve-sim; `valvectl doctor` must fail, naming the missing driver, on a
# machine without a GPU), check the group and the config,
# then purge them and check nothing is left. On any failure the packages are purged too.
# VALVE_PACKAGE_PROFILE (default dev: the binaries `cargo test` built, so CI compiles nothing
# new) picks the cargo profile packaged; scripts/package.sh alone packages release builds.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "ci-package: needs root (dpkg -i); run it as root or skip it" >&2
  exit 1
fi
for p in valvectl valve-scheduler; do
  if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    echo "ci-package: $p is already installed here; remove it first (dpkg --purge $p)" >&2
    exit 1
  fi
done

profile=${VALVE_PACKAGE_PROFILE:-dev}
bash scripts/package.sh --profile "$profile" --fast
debs=(target/debian/valvectl_*.deb target/debian/valve-scheduler_*.deb)

# The package leaves its group behind on purge (files elsewhere may belong to it); the group this
# check made it create is removed again, so that the next run tests its creation too.
group_before=$(getent group valve || true)
purge() {
  dpkg --purge valvectl valve-scheduler >/dev/null 2>&1 || true
  if [ -z "$group_before" ] && getent group valve >/dev/null; then
    groupdel valve
  fi
}
trap purge EXIT

fail() {
  echo "ci-package: FAIL: $*" >&2
  exit 1
}

echo "== dpkg -i ${debs[*]}"
dpkg -i "${debs[@]}"
/usr/bin/valvectl --version | grep -qx "valvectl [0-9.]*" || fail "valvectl --version"
/usr/bin/valve-scheduler --version | grep -qx "valve-scheduler [0-9.]*" || fail "valve-scheduler --version"
/usr/bin/valve-sim --version | grep -qx "valve-sim [0-9.]*" || fail "valve-sim --version"
getent group valve >/dev/null || fail "the package created no 'valve' group"
if [ -n "$group_before" ]; then echo "== the valve group was there before: its creation was not tested"; fi
[ -f /etc/valve/valve.toml ] || fail "no /etc/valve/valve.toml"
dpkg-query -W -f='${Conffiles}' valvectl | grep -q /etc/valve/valve.toml \
  || fail "/etc/valve/valve.toml is not a conffile"
grep -q '^ExecStart=/usr/bin/valvectl daemon' /lib/systemd/system/valve.service \
  || fail "valve.service does not run /usr/bin/valvectl"

echo "== /usr/bin/valvectl demo --requests 1 (the gate on the in-memory GPU)"
demo=$(/usr/bin/valvectl demo --requests 1) || fail "valvectl demo failed"
echo "$demo" | grep -q "froze the offline job 1 time(s) and released it 1 time(s)" \
  || fail "valvectl demo did not show one freeze and one release"

# A tiny simulation (the small preset takes a minute in a dev build): the scheduler must find and
# run the packaged simulator.
echo "== /usr/bin/valve-scheduler simulate --nodes 3 --days 0.05 --policies online-only,valve"
sim=$(env -u VALVE_SIM /usr/bin/valve-scheduler simulate --nodes 3 --days 0.05 --policies online-only,valve) \
  || fail "valve-scheduler simulate failed"
echo "$sim" | grep -q '^| valve |' || fail "valve-scheduler simulate printed no row for the valve policy"

# doctor without a GPU: exit code 1 (a FAIL line) and a line that names the missing driver.
if [ -e /dev/nvidiactl ]; then
  echo "== this machine has an NVIDIA driver: the no-GPU doctor check is skipped"
else
  echo "== /usr/bin/valvectl doctor (no GPU here: must fail)"
  set +e
  out=$(/usr/bin/valvectl doctor 2>&1)
  rc=$?
  set -e
  echo "$out"
  [ "$rc" -eq 1 ] || fail "valvectl doctor exited $rc, want 1"
  echo "$out" | grep -q '^\[FAIL\] driver .*NVIDIA kernel driver is not loaded' \
    || fail "valvectl doctor's output does not name the missing NVIDIA driver"
fi

echo "== dpkg --purge valvectl valve-scheduler"
dpkg --purge valvectl valve-scheduler
for f in /usr/bin/valvectl /usr/bin/valve-scheduler /usr/bin/valve-sim /etc/valve/valve.toml \
  /lib/systemd/system/valve.service; do
  [ ! -e "$f" ] || fail "$f is still there after the purge"
done
purge
trap - EXIT
echo "ci-package: ok"
