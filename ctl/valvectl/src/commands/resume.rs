//! `valvectl resume`: enables channels, named by handle (through a controller), by pid, or all
//! the daemon disabled (through the daemon, or from its state file when it is not running).

use std::io::Write;

use clap::Args;
use serde_json::json;
use valve::controller::{Controller, PreemptMode};
use valve::driver::RmDriver;
use valve::state::{reenable, StateFile};
use valve_daemon::protocol::{Request, DEFAULT_STATE_DIR};
use valve_daemon::EXIT_NO_DAEMON;

use crate::args::{Globals, TargetArgs};
use crate::client::daemon_call;
use crate::error::CliError;
use crate::print;

/// The arguments of `valvectl resume`.
#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// Which channels.
    #[command(flatten)]
    pub targets: TargetArgs,
    /// Enable everything the daemon disabled (works from its state file if it is not running).
    #[arg(long, conflicts_with_all = ["pid", "gpu", "client", "channels", "targets"])]
    pub all: bool,
}

/// Enables channels named by handle.
pub fn exec<D: RmDriver>(
    args: &ResumeArgs,
    ctl: &Controller<D>,
    g: Globals,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let targets = &args.targets;
    targets.validate()?;
    let t = targets.resolve(&ctl.gpus())?;
    let plan = ctl.plan(&t, PreemptMode::Preempt)?;
    let rep = ctl.enable(&plan)?;
    if g.json {
        writeln!(
            out,
            "{}",
            json!({"enabled": rep, "channels": plan.channels()})
        )?;
    } else {
        writeln!(
            out,
            "enabled {} channel(s) on {} GPU(s)",
            plan.channels(),
            plan.gpus()
        )?;
        print::batch(out, "enable", &rep)?;
    }
    Ok(())
}

/// `resume --pid` and `resume --all`, through the daemon.
pub fn exec_daemon(args: &ResumeArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let req = if args.all {
        Request::ResumeAll
    } else {
        Request::Resume {
            pid: args.targets.pid.expect("dispatched on pid"),
        }
    };
    match daemon_call(g.socket, &req) {
        Ok(data) => {
            if g.json {
                writeln!(out, "{data}")?;
            } else {
                writeln!(out, "resumed: {data}")?;
            }
            Ok(())
        }
        Err(CliError::Daemon(code, _)) if args.all && code == EXIT_NO_DAEMON => {
            from_state_file(out)
        }
        Err(e) => Err(e),
    }
}

/// No daemon: re-enables what its state file records, directly.
fn from_state_file(out: &mut dyn Write) -> Result<(), CliError> {
    let state = StateFile::in_dir(std::path::Path::new(DEFAULT_STATE_DIR));
    let records = state.load()?;
    let ctl = Controller::open()?;
    let (n, failures) = reenable(&ctl, &records);
    if failures.is_empty() {
        state.save(&[])?;
    }
    writeln!(
        out,
        "daemon not running: re-enabled {n} channel(s) from {}{}",
        state.path().display(),
        if failures.is_empty() {
            String::new()
        } else {
            format!("; failures: {}", failures.join("; "))
        }
    )?;
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CliError::Daemon(5, failures.join("; ")))
    }
}
