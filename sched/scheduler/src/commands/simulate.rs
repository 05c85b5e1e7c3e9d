//! `valve-scheduler simulate ARGS...`: runs the cluster simulator, the `valve-sim` program, with
//! the same arguments (and `--json` if given before `simulate`); its exit code is this one's.

use std::ffi::{OsStr, OsString};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

/// The environment variable naming the simulator program to run instead of the one found.
pub const PROGRAM_ENV: &str = "VALVE_SIM";

/// The simulator's program name.
const PROGRAM: &str = "valve-sim";

/// The arguments, every one for `valve-sim` (`valve-scheduler simulate --help` shows its help).
#[derive(Args, Debug)]
#[command(disable_help_flag = true)]
pub struct SimulateArgs {
    /// Arguments for valve-sim (`valve-scheduler simulate --help` lists them).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ARGS"
    )]
    pub args: Vec<OsString>,
}

/// Replaces this process with `valve-sim ARGS...`; returns only if it cannot be started.
pub fn exec(a: &SimulateArgs, json: bool) -> anyhow::Result<ExitCode> {
    let program = match std::env::var_os(PROGRAM_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => {
            let exe = std::env::current_exe().ok();
            let dir = exe.as_deref().and_then(Path::parent);
            locate(dir, std::env::var_os("PATH").as_deref()).ok_or_else(|| {
                anyhow::anyhow!(
                    "simulate: cannot find the `{PROGRAM}` program next to this one{} or on PATH. \
                     Install the valve-scheduler package (it ships /usr/bin/{PROGRAM}), build it \
                     with `cargo build --release -p valve-sim`, or set {PROGRAM_ENV} to its path",
                    dir.map_or(String::new(), |d| format!(" (in {})", d.display()))
                )
            })?
        }
    };
    let err = std::process::Command::new(&program)
        .args(pass_through(&a.args, json))
        .exec();
    Err(anyhow::anyhow!(
        "simulate: cannot run {}: {err}{}",
        program.display(),
        if std::env::var_os(PROGRAM_ENV).is_some() {
            format!(" (named by {PROGRAM_ENV}; unset it to use the one installed)")
        } else {
            String::new()
        }
    ))
}

/// The arguments for `valve-sim`: the user's, plus `--json` when it was given globally (before
/// `simulate`) and is not among them already.
fn pass_through(args: &[OsString], json: bool) -> Vec<OsString> {
    let mut out = args.to_vec();
    if json && !args.iter().any(|a| a == "--json") {
        out.push("--json".into());
    }
    out
}

/// `valve-sim` in `dir` (this executable's directory), else in the first directory of `path`
/// (a `PATH` value) that holds it as an executable file.
fn locate(dir: Option<&Path>, path: Option<&OsStr>) -> Option<PathBuf> {
    let on_path = path.map(|p| std::env::split_paths(p).collect::<Vec<_>>());
    dir.map(Path::to_path_buf)
        .into_iter()
        .chain(on_path.into_iter().flatten())
        .map(|d| d.join(PROGRAM))
        .find(|p| is_executable(p))
}

/// Whether `p` is a regular file someone may execute.
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use super::{locate, pass_through, PROGRAM};

    /// Writes an executable (`exec` true) or plain `valve-sim` file into `dir`.
    fn put(dir: &Path, exec: bool) {
        let p = dir.join(PROGRAM);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        let mode = if exec { 0o755 } else { 0o644 };
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn the_program_next_to_this_one_comes_before_path() {
        let (here, a, b) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        put(b.path(), true);
        let path = std::env::join_paths([a.path(), b.path()]).unwrap();
        // Not next to this one: the first PATH directory that has it.
        assert_eq!(
            locate(Some(here.path()), Some(&path)),
            Some(b.path().join(PROGRAM))
        );
        put(here.path(), true);
        assert_eq!(
            locate(Some(here.path()), Some(&path)),
            Some(here.path().join(PROGRAM))
        );
    }

    #[test]
    fn a_missing_or_non_executable_program_is_not_found() {
        let (here, a) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        assert_eq!(locate(Some(here.path()), None), None);
        put(a.path(), false);
        assert_eq!(locate(Some(here.path()), Some(a.path().as_os_str())), None);
        assert_eq!(locate(None, None), None);
    }

    #[test]
    fn a_global_json_is_passed_once() {
        let args: Vec<OsString> = vec!["--preset".into(), "small".into()];
        assert_eq!(pass_through(&args, false), args);
        assert_eq!(
            pass_through(&args, true).last(),
            Some(&OsString::from("--json"))
        );
        let with: Vec<OsString> = vec!["--json".into()];
        assert_eq!(pass_through(&with, true), with);
    }
}
