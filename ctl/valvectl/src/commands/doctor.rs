//! `valvectl doctor`: one line per check of what this node supports (the checks themselves are
//! in [`crate::doctor`]); any FAIL makes the exit code 1.

use std::io::Write;

use clap::Args;

use crate::args::Globals;
use crate::doctor::{self, Status};
use crate::error::CliError;

/// `valvectl doctor` takes no arguments.
#[derive(Debug, Args)]
pub struct DoctorArgs {}

/// Runs every check, with this executable's `test-load` as the CUDA test load.
pub fn exec(_args: &DoctorArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let exe = std::env::current_exe().map_err(CliError::Io)?;
    let findings = doctor::run(&exe);
    if g.json {
        #[derive(serde::Serialize)]
        struct Report<'a> {
            findings: &'a [doctor::Finding],
        }
        let report = Report {
            findings: &findings,
        };
        writeln!(out, "{}", crate::print::json(&report))?;
    } else {
        for f in &findings {
            let tag = match f.status {
                Status::Ok => "ok  ",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
                Status::Skip => "skip",
            };
            writeln!(out, "[{tag}] {:<16} {}", f.check, f.detail)?;
        }
    }
    if findings.iter().any(|f| f.status == Status::Fail) {
        Err(CliError::Daemon(
            1,
            "doctor found problems (FAIL lines above)".into(),
        ))
    } else {
        Ok(())
    }
}
