//! `valve-scheduler task-prolog`: Slurm's TaskProlog for Valve jobs. It prints the `export`
//! lines that give the task the GPUs the scheduler chose and where to report progress.
//!
//! It never fails a task: a job that is not Valve's gets nothing, and problems go to stderr.

use std::process::ExitCode;

use clap::Args;
use valve_harvest::progress::{valid_job_id, DEFAULT_DIR};
use valve_scheduler::meta::JobMeta;
use valve_scheduler::slurm::Slurm;

/// Prints `export CUDA_VISIBLE_DEVICES=... VALVE_PROGRESS_DIR=...` for a Valve job.
///
/// Install it as Slurm's TaskProlog (a two-line script: `#!/bin/sh` and
/// `exec valve-scheduler task-prolog`; docs/cluster.md). It reads the job's placement from its
/// comment (`squeue -j $SLURM_JOB_ID -o %k`) and starts the job's progress file afresh, since a
/// requeued job starts its work again.
#[derive(Args, Debug)]
pub struct TaskPrologArgs {
    /// Where jobs on this node report progress (the node agent reads it).
    #[arg(long, env = "VALVE_PROGRESS_DIR", default_value = DEFAULT_DIR)]
    progress_dir: std::path::PathBuf,
    /// Use PROGRESS_DIR/$SLURMD_NODENAME: several nodes on one host (test clusters).
    #[arg(long)]
    per_node: bool,
}

/// Prints the exports; always exits 0.
pub fn exec(a: &TaskPrologArgs, _json: bool) -> anyhow::Result<ExitCode> {
    if let Err(e) = exports(a) {
        eprintln!("valve-scheduler task-prolog: {e}");
    }
    Ok(ExitCode::SUCCESS)
}

fn exports(a: &TaskPrologArgs) -> Result<(), String> {
    let job = std::env::var("SLURM_JOB_ID")
        .map_err(|_| "SLURM_JOB_ID is not set: run me as Slurm's TaskProlog")?;
    if !valid_job_id(&job) {
        return Err(format!("SLURM_JOB_ID {job:?} is not a job id"));
    }
    let comment = Slurm::default().comment(&job).map_err(|e| e.to_string())?;
    let Some(meta) = JobMeta::from_comment(&comment) else {
        return Ok(()); // not a Valve job
    };
    let meta = meta.map_err(|e| format!("job {job}: {e}"))?;
    let mut dir = a.progress_dir.clone();
    if a.per_node {
        dir = dir.join(
            std::env::var("SLURMD_NODENAME").map_err(|_| "--per-node needs SLURMD_NODENAME")?,
        );
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    // A new run reports from zero.
    let _ = std::fs::remove_file(dir.join(&job));
    if let Some(p) = &meta.placed {
        let gpus: Vec<String> = p.gpus.iter().map(u32::to_string).collect();
        println!("export CUDA_VISIBLE_DEVICES={}", gpus.join(","));
    }
    println!("export VALVE_PROGRESS_DIR={}", dir.display());
    println!("export VALVE_JOB_SLA={}", meta.sla);
    Ok(())
}
