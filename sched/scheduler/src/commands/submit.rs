//! `valve-scheduler submit`: `sbatch --hold --requeue` with the job's SLA and profile in its
//! comment, checked first, so that a bad SLA or profile is refused before Slurm sees it.

use std::process::ExitCode;

use clap::Args;

use super::common::read_profile;
use crate::error::{exit, usage, Fail};
use valve_scheduler::job::check_sla;
use valve_scheduler::meta::JobMeta;
use valve_scheduler::slurm::{Slurm, SlurmError};

/// Submits an offline job for the Valve scheduler to place; prints its Slurm job id.
///
/// Everything after `--` goes to sbatch (a batch script, or `--wrap "..."`, plus any sbatch
/// options). The job is submitted held; the scheduler releases it onto the node where its
/// predicted throughput meets --sla. Inside the job, `CUDA_VISIBLE_DEVICES` names the GPUs the
/// scheduler chose (through the TaskProlog, docs/cluster.md), and the job reports its progress
/// with `valve-scheduler report UNITS_DONE`.
///
/// Example: valve-scheduler submit --profile llama8b.json --sla 0.6 -- --wrap "python batch.py"
#[derive(Args, Debug)]
pub struct SubmitArgs {
    /// The job's profile (`valve-scheduler profile-job` measures one).
    #[arg(long)]
    profile: Option<std::path::PathBuf>,
    /// Submit without a profile: the scheduler places it only if it was given --default-profile.
    #[arg(long, conflicts_with = "profile")]
    no_profile: bool,
    /// The throughput SLA: the share of its throughput alone the job must keep, in (0, 1].
    // Negative numbers are taken as values, so that `--sla -1` reaches the check below instead
    // of the parser's tip to write `-- -1` (here `--` starts sbatch's arguments).
    #[arg(long, allow_negative_numbers = true)]
    sla: f64,
    /// Slurm's configuration (default: the environment's SLURM_CONF).
    #[arg(long, env = "SLURM_CONF")]
    slurm_conf: Option<std::path::PathBuf>,
    /// Arguments for sbatch.
    #[arg(last = true, required = true)]
    sbatch: Vec<String>,
}

/// Checks and submits.
pub fn exec(a: &SubmitArgs, json: bool) -> anyhow::Result<ExitCode> {
    if a.sla < 0.0 {
        return Err(usage(format!(
            "--sla {} is negative: an SLA is the share of its throughput alone the job must keep, in (0, 1], e.g. --sla 0.8",
            a.sla
        )));
    }
    let sla = check_sla(a.sla).map_err(|e| usage(e.to_string()))?;
    let profile = match (&a.profile, a.no_profile) {
        (Some(p), _) => Some(read_profile(p)?),
        (None, true) => None,
        (None, false) => {
            return Err(usage(
                "give --profile FILE (measured with `valve-scheduler profile-job`), or --no-profile if the scheduler has a --default-profile",
            ))
        }
    };
    let meta = JobMeta {
        sla,
        profile,
        placed: None,
        avoid: vec![],
        evictions: 0,
    };
    let slurm = Slurm {
        conf: a.slurm_conf.clone(),
        bin_dir: None,
    };
    let id = slurm.submit(&meta, &a.sbatch).map_err(|e| match e {
        SlurmError::TooLong(_) => usage(e.to_string()),
        e => Fail {
            code: exit::ENGINE,
            msg: e.to_string(),
        }
        .into(),
    })?;
    if json {
        println!("{}", serde_json::json!({"job": id}));
    } else {
        println!("{id}");
    }
    Ok(ExitCode::SUCCESS)
}
