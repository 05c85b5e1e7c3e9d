//! `valve-scheduler report`: a job reports its progress (total work done so far) to its node.

use std::process::ExitCode;

use clap::Args;

use crate::error::usage;
use valve_harvest::progress::{report, DEFAULT_DIR};
use valve_scheduler::replay::unix_ms;

/// Records that the job has done UNITS of work in total (tokens, samples: the unit of its profile).
///
/// Call it every few seconds from the job. The node agent turns the reports into rates that the
/// scheduler's SLA monitor compares with the job's SLA. Same as appending
/// `$(date +%s%3N) UNITS` to $VALVE_PROGRESS_DIR/$SLURM_JOB_ID.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Work done so far (not since the last report).
    units: f64,
    /// The job (default: $SLURM_JOB_ID).
    #[arg(long, env = "SLURM_JOB_ID")]
    job: Option<String>,
    /// The node's progress directory (the TaskProlog sets VALVE_PROGRESS_DIR).
    #[arg(long, env = "VALVE_PROGRESS_DIR", default_value = DEFAULT_DIR)]
    dir: std::path::PathBuf,
}

/// Appends one report.
pub fn exec(a: &ReportArgs, _json: bool) -> anyhow::Result<ExitCode> {
    let job = a
        .job
        .as_deref()
        .ok_or_else(|| usage("no job: run inside a Slurm job or pass --job ID"))?;
    report(&a.dir, job, unix_ms(), a.units).map_err(|e| usage(e.to_string()))?;
    Ok(ExitCode::SUCCESS)
}
