//! `valvectl gate start|stop|status|busy|idle`: workload-aware gating, which runs inside the
//! daemon; these subcommands only send it requests and print its answers.

use std::io::Write;
use std::time::Duration;

use clap::{Args, Subcommand};
use valve_daemon::protocol::{GateSpec, Request};

use crate::args::{parse_duration, Globals};
use crate::client::daemon_call;
use crate::error::CliError;
use crate::print;

/// The arguments of `valvectl gate`: one of its subcommands.
#[derive(Debug, Args)]
pub struct GateArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: GateCommand,
}

/// `valvectl gate ...`.
#[derive(Debug, Subcommand)]
pub enum GateCommand {
    /// Start gating (returns at once; the gate runs in the daemon until `gate stop`).
    ///
    /// Labels are the `VALVE_LABEL` environment variable of a process (e.g. `VALVE_LABEL=batch
    /// python train.py`); labelled processes that start later are picked up within a second.
    #[command(after_help = "Examples:
  valvectl gate start --online 4242 --offline 5151,5252
  valvectl gate start --online-label serving --offline-label batch
  valvectl gate start --online 4242 --offline 5151 --cooldown-floor 2ms --cooldown-ceiling 100ms")]
    Start {
        /// Online (latency-critical) processes by pid.
        #[arg(long, value_delimiter = ',', value_name = "PID")]
        online: Vec<u32>,
        /// Online processes by label (VALVE_LABEL in their environment).
        #[arg(long, value_name = "LABEL")]
        online_label: Option<String>,
        /// Offline (preemptible) processes by pid; they must have started after the daemon.
        #[arg(long, value_delimiter = ',', value_name = "PID")]
        offline: Vec<u32>,
        /// Offline processes by label (VALVE_LABEL in their environment).
        #[arg(long, value_name = "LABEL")]
        offline_label: Option<String>,
        /// The shortest cooldown before offline is resumed.
        #[arg(long, value_parser = parse_duration, default_value = "1ms", value_name = "DURATION")]
        cooldown_floor: Duration,
        /// The longest cooldown; also the one used until a first online request has been seen
        /// to end, and gaps this long count as "between requests".
        #[arg(long, value_parser = parse_duration, default_value = "200ms", value_name = "DURATION")]
        cooldown_ceiling: Duration,
        /// Cooldown = this factor x the longest recent gap between online iterations.
        #[arg(long, default_value_t = 2.0, value_name = "FACTOR")]
        gap_factor: f64,
        /// Use this cooldown instead of learning it (0ms: preempt on every burst of launches
        /// and resume at once; for comparison, it hurts online latency).
        #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
        fixed_cooldown: Option<Duration>,
    },
    /// Stop gating; offline is resumed. Prints the final counts.
    Stop,
    /// What the gate has done: preemptions, resumes, cooldown, latencies.
    Status,
    /// For a serving framework: a request is in flight (preempt now, hold until `idle`).
    Busy,
    /// For a serving framework: no request is in flight (resume offline now).
    Idle,
}

/// The request a `gate` subcommand sends; `start` must name both sides.
pub fn request(action: &GateCommand) -> Result<Request, CliError> {
    let us = |d: &Duration| d.as_micros() as u64;
    Ok(match action {
        GateCommand::Start {
            online,
            online_label,
            offline,
            offline_label,
            cooldown_floor,
            cooldown_ceiling,
            gap_factor,
            fixed_cooldown,
        } => {
            if online.is_empty() && online_label.is_none() {
                return Err(CliError::Usage(
                    "name the online processes: --online PID[,PID...] or --online-label LABEL"
                        .into(),
                ));
            }
            if offline.is_empty() && offline_label.is_none() {
                return Err(CliError::Usage(
                    "name the offline processes: --offline PID[,PID...] or --offline-label LABEL \
                     (nothing else is ever frozen)"
                        .into(),
                ));
            }
            Request::GateStart(GateSpec {
                online: online.clone(),
                online_label: online_label.clone(),
                offline: offline.clone(),
                offline_label: offline_label.clone(),
                cooldown_floor_us: Some(us(cooldown_floor)),
                cooldown_ceiling_us: Some(us(cooldown_ceiling)),
                gap_factor: Some(*gap_factor),
                fixed_cooldown_us: fixed_cooldown.as_ref().map(us),
            })
        }
        GateCommand::Stop => Request::GateStop,
        GateCommand::Status => Request::GateStatus,
        GateCommand::Busy => Request::OnlineBusy,
        GateCommand::Idle => Request::OnlineIdle,
    })
}

/// Sends the subcommand's request to the daemon and prints the answer.
pub fn exec(args: &GateArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let action = &args.action;
    let data = daemon_call(g.socket, &request(action)?)?;
    if g.json {
        writeln!(out, "{data}")?;
    } else if matches!(action, GateCommand::Busy | GateCommand::Idle) {
        writeln!(
            out,
            "sent: online {}",
            data["signal"].as_str().unwrap_or("")
        )?;
    } else {
        print::gate_status(out, &data)?;
    }
    Ok(())
}
