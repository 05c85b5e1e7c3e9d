//! `valve-scheduler explain`: one dry pass now, printed: why each job is pending, where it would
//! go and what the model predicts there, how running jobs fare against their SLA.

use std::process::ExitCode;

use clap::Args;

use super::common::{EngineArgs, ModelArgs};
use super::print::print_plan;
use crate::error::{exit, Fail};
use valve_scheduler::driver::{pass, SlurmEngine, StateFile};
use valve_scheduler::replay::unix_ms;

/// Shows what the scheduler would decide now, and why, without changing anything.
///
/// Pending jobs show the best place the model found and its factors (idle x memory x
/// alignment x the node's speed factor where it is not 1); running jobs show their measured
/// share of alone against their SLA and their miss streak; nodes whose learned speed factor is
/// not 1 are listed (streaks and speeds from --state, which is read, not written).
#[derive(Args, Debug)]
pub struct ExplainArgs {
    /// Only these jobs (default: all of the scheduler's jobs).
    jobs: Vec<String>,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// The running scheduler's state (its miss streaks and nodes' speed factors).
    #[arg(long, default_value = "/var/lib/valve-scheduler/state.json")]
    state: std::path::PathBuf,
}

/// Runs a dry pass and prints it.
pub fn exec(a: &ExplainArgs, json: bool) -> anyhow::Result<ExitCode> {
    let params = a.model.params()?;
    let mut agents = a.engine.agents()?;
    let mut engine = SlurmEngine::new(a.engine.slurm());
    let mut monitor = StateFile::new(&a.state).load().unwrap_or_default();
    let (_, mut plan, _) = pass(
        &mut engine,
        &mut agents,
        &mut monitor,
        &params,
        &unix_ms,
        true,
    )
    .map_err(|e| Fail {
        code: exit::ENGINE,
        msg: e.message,
    })?;
    if !a.jobs.is_empty() {
        let keep = |j: &String| a.jobs.contains(j);
        plan.decisions.retain(|d| keep(&d.job));
        plan.waiting.retain(|w| keep(&w.job));
        plan.refused.retain(|r| keep(&r.job));
        plan.checks.retain(|c| keep(&c.job));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print_plan(&plan);
        for (node, e) in &agents.errors {
            println!("agent of {node}: {e}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
