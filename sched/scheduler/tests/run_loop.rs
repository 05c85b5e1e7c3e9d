//! `valve-scheduler run` as a process, against stand-in Slurm programs (`--slurm-bin`): one
//! scheduler per state file, and what the loop says when slurmctld does not answer.

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
    let mut first = run(&bin, &state, &["--interval", "1s"]).spawn().unwrap();
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
    first.kill().unwrap();
    first.wait().unwrap();
    let third = run(&bin, &state, &["--once"]).output().unwrap();
    assert_eq!(
        third.status.code(),
        Some(3),
        "the lock is free again; slurmctld is still down: {}",
        text(&third)
    );
}
