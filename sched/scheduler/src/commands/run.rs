//! `valve-scheduler run`: the scheduler's loop against Slurm, until SIGINT or SIGTERM.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;

use super::common::{duration, EngineArgs, ModelArgs};
use super::metrics::SchedulerMetrics;
use super::print::{print_pass, LoopLog};
use super::stop::{install_signals, nap, stopped};
use crate::error::{exit, usage, Fail};
use valve_scheduler::driver::{backoff, pass, LockError, SlurmEngine, StateFile, StateLock};
use valve_scheduler::replay::unix_ms;

/// Places held Valve jobs and evicts those that keep missing their SLA, every --interval.
///
/// Each pass reads Slurm (`sinfo --json`, `squeue --json`; jobs whose comment starts with
/// `valve:`, as `valve-scheduler submit` writes it), fetches every open node's harvest document
/// from its agent, decides, and acts: `scontrol update nodelist=NODE comment=...` + `release` to
/// place, `scontrol requeuehold` to evict. Slurm holds all job state, so the scheduler can be
/// stopped and restarted at any time; only the SLA monitor's miss streaks and the nodes' learned
/// speed factors live in --state (without it they are learned again from scratch). One
/// scheduler runs per --state: a second one on the same file exits with code 5 and names the
/// first one's pid (the lock is STATE.lock, released when the holder exits).
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Time between passes.
    #[arg(long, default_value = "10s", value_parser = duration)]
    interval: Duration,
    /// The SLA monitor's state (miss streaks, recent evictions, nodes' speed factors).
    #[arg(long, default_value = "/var/lib/valve-scheduler/state.json")]
    state: std::path::PathBuf,
    /// One pass, printed, then exit.
    #[arg(long)]
    once: bool,
    /// Decide but change nothing in Slurm (and leave --state alone).
    #[arg(long)]
    dry_run: bool,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9402).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// The state for this scheduler alone, held until the value is dropped (the kernel releases it
/// on any exit); another scheduler's hold is exit code 5.
fn lock(state: &StateFile) -> anyhow::Result<StateLock> {
    state.lock().map_err(|e| match e {
        LockError::Held { .. } => Fail {
            code: exit::BUSY,
            msg: e.to_string(),
        }
        .into(),
        LockError::Io { .. } => usage(e.to_string()),
    })
}

/// Runs the loop.
pub fn exec(a: &RunArgs, json: bool) -> anyhow::Result<ExitCode> {
    if a.interval.is_zero() {
        return Err(usage("--interval must be above 0"));
    }
    let params = a.model.params()?;
    let mut agents = a.engine.agents()?;
    let mut engine = SlurmEngine::new(a.engine.slurm());
    let state = StateFile::new(&a.state);
    // One scheduler per state (a dry run changes nothing, so it may look beside one).
    let _lock = if a.dry_run { None } else { Some(lock(&state)?) };
    let mut monitor = state.load().map_err(usage)?;
    let metrics = match a.metrics_addr {
        Some(addr) => Some(SchedulerMetrics::serve(addr)?),
        None => None,
    };
    install_signals()?;
    let mut failures = 0u32;
    let mut log = LoopLog::default();
    while !stopped() {
        let started = Instant::now();
        match pass(
            &mut engine,
            &mut agents,
            &mut monitor,
            &params,
            &unix_ms,
            a.dry_run,
        ) {
            Err(e) => {
                failures += 1;
                if let Some(m) = &metrics {
                    m.engine_error();
                }
                if a.once {
                    return Err(Fail {
                        code: exit::ENGINE,
                        msg: e.message,
                    }
                    .into());
                }
                let wait = backoff(failures - 1, Duration::from_secs(60)).max(a.interval);
                tracing::warn!(
                    "pass failed ({}); next try in {wait:?}; every job stays in Slurm",
                    e.message
                );
                nap(wait);
                continue;
            }
            Ok((snap, plan, applied)) => {
                failures = 0;
                if let Some(m) = &metrics {
                    m.record(&snap, &plan, &applied, started.elapsed());
                }
                print_pass(&plan, &applied, &agents, json, a.once, &mut log);
                if !a.dry_run {
                    state.save(&monitor).map_err(|e| anyhow::anyhow!(e))?;
                }
                if a.once {
                    return Ok(if applied.unreachable {
                        ExitCode::from(exit::ENGINE)
                    } else {
                        ExitCode::SUCCESS
                    });
                }
            }
        }
        nap(a.interval.saturating_sub(started.elapsed()));
    }
    tracing::info!("stopping: no pass is under way; Slurm keeps every job");
    Ok(ExitCode::SUCCESS)
}
