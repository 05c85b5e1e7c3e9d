//! `valvectl preempt`: disables (and preempts) channels, holds them, then resumes them; or, with
//! `--detach`, leaves them frozen and prints the command that resumes them.
//!
//! Channels named by handle are disabled here through a controller; `--pid` asks the daemon,
//! which knows the process's channels on every GPU. Either way the hold ends on `--for`, Ctrl-C,
//! SIGTERM or SIGHUP, and the channels are resumed before valvectl exits.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::Args;
use nix::sys::signal::Signal;
use serde::Serialize;
use valve::controller::BatchReport;
use valve::controller::{Controller, DisabledChannels, PreemptMode, PreemptPlan};
use valve::driver::RmDriver;
use valve::Signals;
use valve_daemon::protocol::{FreezeOutcome, PreemptReply, Request, ResumeReply, EXIT_NOT_FROZEN};

use crate::args::{parse_duration, Globals, TargetArgs};
use crate::client::daemon_call;
use crate::error::CliError;
use crate::print;

/// The arguments of `valvectl preempt`.
#[derive(Debug, Args)]
pub struct PreemptArgs {
    /// Which channels.
    #[command(flatten)]
    pub targets: TargetArgs,
    /// Hold for this long, then resume (e.g. 500ms, 2s, 1m). Default: until Ctrl-C/SIGTERM.
    #[arg(long = "for", value_name = "DURATION", value_parser = parse_duration, conflicts_with = "detach")]
    pub hold: Option<Duration>,
    /// Leave the channels disabled and exit; undo with `valvectl resume`.
    #[arg(long)]
    pub detach: bool,
    /// Only stop scheduling new work; running kernels keep running (no preemption).
    #[arg(long)]
    pub schedule_only: bool,
}

/// Preempts channels named by handle through `ctl`. Without `signals` (tests), a hold with no
/// `--for` ends at once.
pub fn exec<D: RmDriver>(
    args: &PreemptArgs,
    ctl: &Controller<D>,
    g: Globals,
    out: &mut dyn Write,
    signals: Option<&Signals>,
) -> Result<(), CliError> {
    let gpus = ctl.gpus();
    let targets = &args.targets;
    targets.validate()?;
    let t = targets.resolve(&gpus)?;
    let mode = if args.schedule_only {
        PreemptMode::ScheduleOnly
    } else {
        PreemptMode::Preempt
    };
    let plan = ctl.plan(&t, mode)?;
    let guard = ctl.disable(&plan)?;
    if args.detach {
        let undo = format!("valvectl resume {}", targets.as_command_line(&gpus, &t));
        return detach(guard, &plan, &undo, g, out);
    }
    hold_then_resume(args, guard, &plan, g, out, signals)
}

/// `--detach`: keeps the channels disabled and prints `undo`, the command that resumes them.
fn detach<D: RmDriver>(
    guard: DisabledChannels<'_, D>,
    plan: &PreemptPlan,
    undo: &str,
    g: Globals,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let rep = guard.keep_disabled();
    if g.json {
        let line = Detached {
            disabled: &rep,
            channels: plan.channels(),
            resume_command: undo,
        };
        writeln!(out, "{}", print::json(&line))?;
    } else {
        writeln!(
            out,
            "disabled {} channel(s) on {} GPU(s); they stay frozen until you run:",
            plan.channels(),
            plan.gpus()
        )?;
        writeln!(out, "  {undo}")?;
        print::batch(out, "disable", &rep)?;
    }
    Ok(())
}

/// Holds until `--for` elapses or a signal arrives, then enables and reports both steps.
fn hold_then_resume<D: RmDriver>(
    args: &PreemptArgs,
    guard: DisabledChannels<'_, D>,
    plan: &PreemptPlan,
    g: Globals,
    out: &mut dyn Write,
    signals: Option<&Signals>,
) -> Result<(), CliError> {
    let disable_rep = guard.disable_report().clone();
    if !g.json {
        writeln!(
            out,
            "disabled {} channel(s) on {} GPU(s){}",
            plan.channels(),
            plan.gpus(),
            match args.hold {
                Some(d) => format!(", holding for {d:?}"),
                None => "; Ctrl-C or SIGTERM resumes them".into(),
            }
        )?;
        out.flush()?;
    }
    let held_from = Instant::now();
    let signal = wait(signals, args.hold);
    let held = held_from.elapsed();
    let enable_rep = guard.enable()?;
    if g.json {
        let line = Held {
            channels: plan.channels(),
            gpus: plan.gpus(),
            disable: &disable_rep,
            enable: &enable_rep,
            held_us: held.as_secs_f64() * 1e6,
            ended_by: signal.map(|s| s.as_str()).unwrap_or("timer"),
        };
        writeln!(out, "{}", print::json(&line))?;
    } else {
        print::batch(out, "disable", &disable_rep)?;
        writeln!(
            out,
            "resumed after {:.1} ms{}",
            held.as_secs_f64() * 1e3,
            signal.map(|s| format!(" ({s})")).unwrap_or_default()
        )?;
        print::batch(out, "enable", &enable_rep)?;
    }
    Ok(())
}

/// Waits for `hold` or a signal; without signals, sleeps for `hold` (or not at all).
fn wait(signals: Option<&Signals>, hold: Option<Duration>) -> Option<Signal> {
    match (signals, hold) {
        (Some(s), h) => s.wait(h),
        (None, Some(h)) => {
            std::thread::sleep(h);
            None
        }
        (None, None) => None,
    }
}

/// `preempt --pid`: the daemon disables every channel of the process, then (unless `--detach`)
/// this holds and asks the daemon to resume it.
pub fn exec_pid(
    args: &PreemptArgs,
    g: Globals,
    out: &mut dyn Write,
    signals: &Signals,
) -> Result<(), CliError> {
    if args.schedule_only {
        return Err(CliError::Usage(
            "--schedule-only is not available with --pid".into(),
        ));
    }
    let pid = args.targets.pid.expect("dispatched on pid");
    let gpu = args.targets.gpu.as_ref().map(|g| g.to_string());
    // A held preemption gets a daemon-side limit too, so a killed valvectl cannot leave
    // the process frozen for longer than it asked for.
    let max_hold_ms = args
        .hold
        .map(|h| (h + Duration::from_secs(1)).as_millis() as u64);
    let data: PreemptReply = daemon_call(
        g.socket,
        &Request::Preempt {
            pid,
            gpu,
            max_hold_ms: if args.detach { None } else { max_hold_ms },
            confirm: true,
        },
    )?;
    refuse_if_running(g, pid, &data)?;
    let checked = freeze_words(&data);
    if args.detach {
        if g.json {
            let line = PidDetached {
                preempted: &data,
                resume_command: format!("valvectl resume --pid {pid}"),
            };
            writeln!(out, "{}", print::json(&line))?;
        } else {
            writeln!(
                out,
                "preempted pid {pid}: {} channel(s) on {} GPU(s), {checked}; it stays frozen \
                 until `valvectl resume --pid {pid}`",
                data.channels, data.gpus
            )?;
        }
        return Ok(());
    }
    if !g.json {
        writeln!(
            out,
            "preempted pid {pid}: {} channel(s) on {} GPU(s), {checked}{}",
            data.channels,
            data.gpus,
            match args.hold {
                Some(d) => format!(", holding for {d:?}"),
                None => "; Ctrl-C or SIGTERM resumes it".into(),
            }
        )?;
        out.flush()?;
    }
    let signal = signals.wait(args.hold);
    let resumed = resume_pid(g, pid)?;
    if g.json {
        let line = PidHeld {
            preempt: &data,
            resume: &resumed,
            ended_by: signal.map(|s| s.as_str()).unwrap_or("timer"),
        };
        writeln!(out, "{}", print::json(&line))?;
    } else {
        writeln!(out, "resumed pid {pid}")?;
    }
    Ok(())
}

/// The freeze's check in words, for the line that reports the preempt.
fn freeze_words(data: &PreemptReply) -> String {
    match &data.freeze {
        None if data.from_gate => "handed over frozen by the gate".into(),
        None => "freeze not checked (a daemon older than the check)".into(),
        Some(c) => match c.outcome {
            FreezeOutcome::Confirmed => format!(
                "frozen (RM reports all {} disabled, checked in {:.1} ms)",
                c.channels,
                c.after_us as f64 / 1e3
            ),
            _ => format!(
                "disabled, but the freeze is NOT confirmed: {}",
                c.reason.as_deref().unwrap_or("RM could not say")
            ),
        },
    }
}

/// A freeze RM reports incomplete (a channel still enabled): resumes what was disabled and
/// fails with [`EXIT_NOT_FROZEN`], so nothing is left half frozen.
fn refuse_if_running(g: Globals, pid: u32, data: &PreemptReply) -> Result<(), CliError> {
    let Some(c) = data
        .freeze
        .as_ref()
        .filter(|c| c.outcome == FreezeOutcome::Running)
    else {
        return Ok(());
    };
    let undone = match resume_pid(g, pid) {
        Ok(_) => "resumed its other channels".to_string(),
        Err(e) => format!("resuming it failed too ({e}): run `valvectl resume --pid {pid}`"),
    };
    Err(CliError::Daemon(
        EXIT_NOT_FROZEN,
        format!(
            "pid {pid} is NOT frozen: RM reports channel(s) {} still enabled after the disable \
             returned, so its work keeps running; {undone}. Check `valvectl doctor` and the \
             driver version",
            c.running.join(", ")
        ),
    ))
}

/// `preempt --detach --json` by handle.
#[derive(Serialize)]
struct Detached<'a> {
    disabled: &'a BatchReport,
    channels: usize,
    resume_command: &'a str,
}

/// `preempt --for --json` by handle: both steps and how the hold ended.
#[derive(Serialize)]
struct Held<'a> {
    channels: usize,
    gpus: usize,
    disable: &'a BatchReport,
    enable: &'a BatchReport,
    held_us: f64,
    ended_by: &'a str,
}

/// `preempt --pid --detach --json`.
#[derive(Serialize)]
struct PidDetached<'a> {
    preempted: &'a PreemptReply,
    resume_command: String,
}

/// `preempt --pid --json` after its hold.
#[derive(Serialize)]
struct PidHeld<'a> {
    preempt: &'a PreemptReply,
    resume: &'a ResumeReply,
    ended_by: &'a str,
}

/// Asks the daemon to resume `pid` at the end of a hold.
fn resume_pid(g: Globals, pid: u32) -> Result<ResumeReply, CliError> {
    match daemon_call(g.socket, &Request::Resume { pid }) {
        Ok(v) => Ok(v),
        // The daemon's own limit may have resumed it first.
        Err(CliError::Daemon(8, m)) if m.contains("not preempted") => Ok(ResumeReply {
            pid,
            note: Some("already resumed by the daemon".into()),
            ..ResumeReply::default()
        }),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write as _};

    use valve_daemon::protocol::{FreezeCheck, PROTOCOL_VERSION};

    use super::*;

    fn checked(outcome: FreezeOutcome, running: &[&str]) -> PreemptReply {
        PreemptReply {
            pid: 42,
            channels: 3,
            gpus: 1,
            freeze: Some(FreezeCheck {
                outcome,
                after_us: 2300,
                checked: 3,
                channels: 3,
                running: running.iter().map(|s| s.to_string()).collect(),
                reason: None,
            }),
            ..PreemptReply::default()
        }
    }

    #[test]
    fn a_confirmed_freeze_reads_frozen_and_an_unchecked_one_never_does() {
        let words = freeze_words(&checked(FreezeOutcome::Confirmed, &[]));
        assert!(
            words.starts_with("frozen (RM reports all 3 disabled"),
            "{words}"
        );
        let mut unconfirmed = checked(FreezeOutcome::Unconfirmed, &[]);
        unconfirmed.freeze.as_mut().unwrap().reason = Some("no diag object".into());
        let words = freeze_words(&unconfirmed);
        assert!(words.contains("NOT confirmed: no diag object"), "{words}");
        assert!(!freeze_words(&PreemptReply::default()).starts_with("frozen"));
    }

    #[test]
    fn a_freeze_rm_reports_running_is_resumed_and_exits_12() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("valve.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line).unwrap();
            let reply = r#"{"data":{"pid":42},"error":null}"#;
            s.write_all(format!("{reply}\n").as_bytes()).unwrap();
            line
        });
        let g = Globals {
            json: false,
            socket: &path,
        };
        let data = checked(FreezeOutcome::Running, &["c1d00010:5c000012"]);
        let e = refuse_if_running(g, 42, &data).unwrap_err();
        assert_eq!(e.exit_code(), EXIT_NOT_FROZEN);
        let msg = e.to_string();
        assert!(
            msg.contains("NOT frozen") && msg.contains("c1d00010:5c000012"),
            "{msg}"
        );
        assert!(msg.contains("resumed its other channels"), "{msg}");
        let got = server.join().unwrap();
        assert!(
            got.contains(r#""op":"resume""#),
            "{got} (v{PROTOCOL_VERSION})"
        );
        assert!(refuse_if_running(g, 42, &checked(FreezeOutcome::Confirmed, &[])).is_ok());
    }
}
