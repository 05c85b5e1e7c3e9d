//! `valve-scheduler profile-job` end to end against a stand-in `valvectl` (a script that keeps
//! the pool cap in a file) and a job that reports progress, slower when it started capped.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Answers `pool cap`, `pool status` as the daemon would, remembering the cap in `$dir/cap`.
const VALVECTL: &str = r#"#!/bin/bash
state="$(dirname "$0")/cap"
case "$*" in
  *"pool cap"*--lift*) echo none > "$state"; echo '{}' ;;
  *"pool cap"*) echo capped > "$state"; echo '{}' ;;
  *"pool status"*)
    n=4; [ "$(cat "$state" 2>/dev/null)" = capped ] && n=2
    echo "{\"gpus\":[{\"gpu\":0,\"offline\":$n,\"handle_bytes\":1073741824}]}" ;;
  *) echo '{}' ;;
esac
"#;

/// 120 units/s, or 100 where the job started under a cap (as continuous batching did).
const JOB: &str = r#"#!/bin/bash
per=12; [ "$(cat "$(dirname "$0")/cap" 2>/dev/null)" = capped ] && per=10
u=0
while true; do
  u=$((u + per)); echo "$(date +%s%3N) $u" >> "$VALVE_PROGRESS_DIR/$SLURM_JOB_ID"; sleep 0.1
done
"#;

fn script(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p.display().to_string()
}

fn profile(fresh_alone: bool) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let valvectl = script(dir.path(), "valvectl", VALVECTL);
    let job = script(dir.path(), "job.sh", JOB);
    let out = dir.path().join("profile.json");
    let run = Command::new(env!("CARGO_BIN_EXE_valve-scheduler"))
        .args([
            "profile-job",
            "--name",
            "fake",
            "--caps",
            "2GiB",
            "--warmup",
            "1s",
        ])
        .args(["--settle", "1s", "--seconds", "2s", "--alone-seconds", "2s"])
        .args(fresh_alone.then_some("--fresh-alone=true"))
        .args(["--valvectl", &valvectl])
        .arg("--out")
        .arg(&out)
        .args(["--", &job])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "profile-job failed: {stderr}");
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

/// The job's rates are nominal at most (its shell loop only adds time), so the checks are of
/// ratios and upper bounds, not of levels.
fn ratio(x: f64, y: f64) -> f64 {
    x / y
}

#[test]
fn t_alone_comes_from_a_second_run_started_uncapped_and_the_curve_keeps_its_shape() {
    let p = profile(true);
    let alone = p["alone_per_s"].as_f64().unwrap();
    let capped_run = p["measured"]["capped_run_alone_per_s"].as_f64().unwrap();
    let r = ratio(alone, capped_run);
    assert!(
        (r - 1.2).abs() < 0.1,
        "T_alone {alone} over the capped run's {capped_run}: {p}"
    );
    let curve = p["curve"].as_array().unwrap();
    assert_eq!(curve.len(), 2, "{p}");
    let (small, full) = (
        curve[0]["per_s"].as_f64().unwrap(),
        curve[1]["per_s"].as_f64().unwrap(),
    );
    assert_eq!(full, alone, "{p}");
    assert!(
        (ratio(small, alone) - 1.0).abs() < 0.1,
        "the 2 GiB point {small} scaled: {p}"
    );
}

#[test]
fn one_run_by_default_keeps_the_capped_runs_level() {
    let p = profile(false);
    let alone = p["alone_per_s"].as_f64().unwrap();
    assert!(
        alone > 0.0 && alone <= 102.0,
        "T_alone {alone} (the capped run's, 100 at most): {p}"
    );
    assert!(p["measured"].get("capped_run_alone_per_s").is_none(), "{p}");
}
