//! `valve-scheduler simulate` as a process: it runs the `valve-sim` program with the user's
//! arguments and exits with its code, and says how to get `valve-sim` when it is missing.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_valve-scheduler");

/// A stand-in `valve-sim` in `dir` that prints its arguments one a line and exits 5.
fn stand_in(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("valve-sim");
    std::fs::write(
        &p,
        "#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\nexit 5\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_arguments_and_the_exit_code_pass_through() {
    let dir = tempfile::tempdir().unwrap();
    let sim = stand_in(dir.path());
    let o = Command::new(BIN)
        .args(["--json", "simulate", "--preset", "small", "--help"])
        .env("VALVE_SIM", &sim)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert_eq!(stdout(&o), "--preset\nsmall\n--help\n--json\n");
    // --json after `simulate` is the simulator's own, passed once.
    let o = Command::new(BIN)
        .args(["simulate", "--nodes", "3", "--json"])
        .env("VALVE_SIM", &sim)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert_eq!(stdout(&o), "--nodes\n3\n--json\n");
}

#[test]
fn a_program_named_by_valve_sim_that_is_not_there_is_named() {
    let o = Command::new(BIN)
        .args(["simulate", "--preset", "small"])
        .env("VALVE_SIM", "/nonexistent/valve-sim")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("cannot run /nonexistent/valve-sim") && e.contains("VALVE_SIM"),
        "{e}"
    );
}

#[test]
fn a_missing_valve_sim_says_how_to_get_it() {
    // A copy of the binary alone in a directory, with nothing on PATH.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let exe = dir.path().join("valve-scheduler");
    if std::fs::hard_link(BIN, &exe).is_err() {
        std::fs::copy(BIN, &exe).unwrap();
    }
    let o = Command::new(&exe)
        .args(["simulate", "--preset", "small"])
        .env_remove("VALVE_SIM")
        .env("PATH", "")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("cannot find the `valve-sim` program"), "{e}");
    assert!(e.contains(&dir.path().display().to_string()), "{e}");
    assert!(e.contains("cargo build --release -p valve-sim"), "{e}");
    // Put next to it, it runs.
    stand_in(dir.path());
    let o = Command::new(&exe)
        .args(["simulate", "--days", "1"])
        .env_remove("VALVE_SIM")
        .env("PATH", "")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert_eq!(stdout(&o), "--days\n1\n");
}
