//! The scheduler's commands as processes, without a Slurm cluster (stand-in Slurm programs
//! through `--slurm-bin`): one scheduler per state file, errors an operator reads.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_valve-scheduler");

/// A directory of stand-in Slurm programs: `scontrol ping` reports slurmctld down, as the real
/// one does (on stdout, exit 1, nothing on stderr).
fn slurm_down(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = "#!/bin/sh\necho 'Slurmctld(primary) at ctl1 is DOWN'\nexit 1\n";
    for p in ["scontrol", "sinfo", "squeue"] {
        std::fs::write(bin.join(p), script).unwrap();
        let ok = Command::new("chmod").arg("+x").arg(bin.join(p)).status();
        assert!(ok.unwrap().success());
    }
    bin
}

fn run(bin: &Path, state: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("run")
        .arg("--slurm-bin")
        .arg(bin)
        .arg("--state")
        .arg(state)
        .args(["--agent-url", "http://127.0.0.1:1/{node}"])
        .args(extra)
        .env_remove("SLURM_CONF")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Waits until `first` has written its pid into the lock file.
fn wait_for_lock(lock: &Path, first: &mut Child) {
    let end = Instant::now() + Duration::from_secs(20);
    let want = first.id().to_string();
    while std::fs::read_to_string(lock).unwrap_or_default().trim() != want {
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first scheduler exited"
        );
        assert!(Instant::now() < end, "no lock file {}", lock.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_second_scheduler_on_one_state_is_refused_until_the_first_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let bin = slurm_down(dir.path());
    let state = dir.path().join("state.json");
    let log_path = dir.path().join("first.log");
    let mut first = run(&bin, &state, &["--interval", "1s"])
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    wait_for_lock(&dir.path().join("state.json.lock"), &mut first);

    let second = run(&bin, &state, &["--once"]).output().unwrap();
    let err = text(&second);
    assert_eq!(second.status.code(), Some(5), "{err}");
    assert!(
        err.contains(&format!("pid {}", first.id())) && err.contains("--state"),
        "{err}"
    );
    // A dry run changes nothing, so it may look beside a running scheduler.
    let dry = run(&bin, &state, &["--once", "--dry-run"])
        .output()
        .unwrap();
    assert_eq!(dry.status.code(), Some(3), "{}", text(&dry));

    // SIGKILL: no code of the scheduler's runs, the kernel still drops the lock.
    let end = Instant::now() + Duration::from_secs(20);
    let mut log = String::new();
    while !log.contains("pass failed") && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        log = std::fs::read_to_string(&log_path).unwrap();
    }
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(
        log.contains("pass failed (slurmctld is not reachable (`scontrol ping`: exit status 1"),
        "{log}"
    );
    assert!(
        !log.contains('\x1b'),
        "colour codes in a log that is not a terminal: {log:?}"
    );
    let third = run(&bin, &state, &["--once"]).output().unwrap();
    assert_eq!(
        third.status.code(),
        Some(3),
        "the lock is free again; slurmctld is still down: {}",
        text(&third)
    );
}

#[test]
fn a_down_slurmctld_is_reported_with_what_scontrol_said() {
    let dir = tempfile::tempdir().unwrap();
    let bin = slurm_down(dir.path());
    let out = run(&bin, &dir.path().join("state.json"), &["--once"])
        .output()
        .unwrap();
    let err = text(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("`scontrol ping`: exit status 1: Slurmctld(primary) at ctl1 is DOWN"),
        "{err}"
    );
}

#[test]
fn a_negative_sla_is_refused_by_name_before_sbatch_runs() {
    let dir = tempfile::tempdir().unwrap();
    let profile = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/job.json");
    for sla in ["-1", "-0.5"] {
        let out = Command::new(BIN)
            .args(["submit", "--profile", profile, "--sla", sla])
            .args(["--", "--wrap", "true"])
            .env("PATH", dir.path()) // no sbatch: it must not be reached
            .output()
            .unwrap();
        let err = text(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("--sla {sla} is negative")) && !err.contains("'-- "),
            "{err}"
        );
    }
}
