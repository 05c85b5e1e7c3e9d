//! `valvectl bench`: preempts and resumes the same channels in a loop and reports p50/p99/max of
//! each step, for all GPUs together and per GPU; Ctrl-C ends it early (exit 130).

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use clap::Args;
use nix::sys::signal::Signal;
use serde::Serialize;
use valve::controller::{Controller, PreemptMode, PreemptPlan};
use valve::driver::RmDriver;
use valve::gpu::GpuInfo;
use valve::stats::{summarize, Summary};
use valve::Signals;

use crate::args::{parse_duration, Globals, TargetArgs};
use crate::error::CliError;

/// The arguments of `valvectl bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which channels.
    #[command(flatten)]
    pub targets: TargetArgs,
    /// Preempt/resume cycles.
    #[arg(long, default_value_t = 100)]
    pub cycles: usize,
    /// How long each preemption is held.
    #[arg(long, value_parser = parse_duration, default_value = "1ms")]
    pub hold: Duration,
    /// Pause between cycles (the work runs during it).
    #[arg(long, value_parser = parse_duration, default_value = "5ms")]
    pub gap: Duration,
    /// Issue the GPUs one after another on one thread instead of one thread per GPU.
    #[arg(long)]
    pub serial: bool,
    /// Only stop scheduling new work (no preemption).
    #[arg(long)]
    pub schedule_only: bool,
}

/// What the cycles measured.
#[derive(Default)]
struct Samples {
    disable_wall: Vec<Duration>,
    enable_wall: Vec<Duration>,
    /// Per GPU: (disable ioctl, enable ioctl) of each cycle.
    per_gpu: BTreeMap<usize, (Vec<Duration>, Vec<Duration>)>,
    interrupted: Option<Signal>,
}

/// Runs the benchmark on channels named by handle.
pub fn exec<D: RmDriver>(
    args: &BenchArgs,
    ctl: &Controller<D>,
    g: Globals,
    out: &mut dyn Write,
    signals: Option<&Signals>,
) -> Result<(), CliError> {
    let gpus = ctl.gpus();
    let targets = &args.targets;
    targets.validate()?;
    if targets.pid.is_some() {
        return Err(CliError::Usage(
            "bench takes explicit handles, not --pid".into(),
        ));
    }
    let t = targets.resolve(&gpus)?;
    let mode = if args.schedule_only {
        PreemptMode::ScheduleOnly
    } else {
        PreemptMode::Preempt
    };
    let plan = ctl.plan(&t, mode)?;
    let samples = measure(args, ctl, &plan, signals)?;
    report(args, &plan, &gpus, &samples, g, out)?;
    match samples.interrupted {
        Some(s) => Err(CliError::Interrupted(s)),
        None => Ok(()),
    }
}

/// Disables, holds, enables and pauses `args.cycles` times, or until a signal is pending.
fn measure<D: RmDriver>(
    args: &BenchArgs,
    ctl: &Controller<D>,
    plan: &PreemptPlan,
    signals: Option<&Signals>,
) -> Result<Samples, CliError> {
    let mut s = Samples {
        disable_wall: Vec::with_capacity(args.cycles),
        enable_wall: Vec::with_capacity(args.cycles),
        ..Samples::default()
    };
    for _ in 0..args.cycles {
        let guard = if args.serial {
            ctl.disable_serial(plan)?
        } else {
            ctl.disable_parallel(plan)?
        };
        std::thread::sleep(args.hold);
        let d = guard.disable_report().clone();
        let e = guard.enable()?;
        s.disable_wall.push(d.wall);
        s.enable_wall.push(e.wall);
        for g in &d.gpus {
            s.per_gpu.entry(g.gpu).or_default().0.push(g.ioctl);
        }
        for g in &e.gpus {
            s.per_gpu.entry(g.gpu).or_default().1.push(g.ioctl);
        }
        if let Some(sig) = signals.and_then(|s| s.pending()) {
            s.interrupted = Some(sig);
            break;
        }
        std::thread::sleep(args.gap);
    }
    Ok(s)
}

/// Prints the summaries (JSON with `--json`).
fn report(
    args: &BenchArgs,
    plan: &PreemptPlan,
    gpus: &[GpuInfo],
    s: &Samples,
    g: Globals,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let sd = summarize(&s.disable_wall);
    let se = summarize(&s.enable_wall);
    let per: Vec<(usize, Summary, Summary)> = s
        .per_gpu
        .iter()
        .map(|(g, (d, e))| (*g, summarize(d), summarize(e)))
        .collect();
    let serial = &args.serial;
    if g.json {
        let per_gpu = per
            .iter()
            .map(|(g, d, e)| BenchGpu {
                gpu: *g,
                name: &gpus[*g].name,
                disable_ioctl: *d,
                enable_ioctl: *e,
            })
            .collect();
        let line = BenchReport {
            channels: plan.channels(),
            gpus: plan.gpus(),
            serial: *serial,
            mode: plan.mode(),
            cycles: s.disable_wall.len(),
            disable_wall: sd,
            enable_wall: se,
            per_gpu,
        };
        writeln!(out, "{}", crate::print::json(&line))?;
    } else {
        writeln!(
            out,
            "{} cycles, {} channel(s) on {} GPU(s), {}",
            s.disable_wall.len(),
            plan.channels(),
            plan.gpus(),
            if *serial {
                "serial"
            } else {
                "one thread per GPU"
            }
        )?;
        writeln!(out, "  disable (all GPUs): {sd}")?;
        writeln!(out, "  enable  (all GPUs): {se}")?;
        for (g, d, e) in &per {
            writeln!(
                out,
                "  GPU {g} ({}): disable ioctl {d}; enable ioctl {e}",
                gpus[*g].name
            )?;
        }
    }
    Ok(())
}

/// `bench --json`: the cycle's wall times and each GPU's ioctl times.
#[derive(Serialize)]
struct BenchReport<'a> {
    channels: usize,
    gpus: usize,
    serial: bool,
    mode: PreemptMode,
    cycles: usize,
    disable_wall: Summary,
    enable_wall: Summary,
    per_gpu: Vec<BenchGpu<'a>>,
}

/// One GPU in [`BenchReport`].
#[derive(Serialize)]
struct BenchGpu<'a> {
    gpu: usize,
    name: &'a str,
    disable_ioctl: Summary,
    enable_ioctl: Summary,
}
