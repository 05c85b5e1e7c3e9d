//! `valvectl gate start|stop|status|trace|busy|idle`: workload-aware gating, which runs inside
//! the daemon; these subcommands only send it requests and print its answers.

use std::io::Write;
use std::time::Duration;

use clap::{Args, Subcommand};
use valve_daemon::protocol::{GateReply, GateSpec, Request, TraceReply};
use valve_protocol::control::SignalReply;

use crate::args::{parse_duration, parse_percent, Globals};
use crate::client::{daemon_call, daemon_call_within};
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
    ///
    /// Offline is preempted when a request's data reaches the online service (a BPF program on
    /// the socket receive path sees it on the service's listening ports; it only observes), and
    /// when an online process launches GPU work after idling (uprobes on libcuda). Either way it
    /// is resumed once online has been idle for the cooldown.
    #[command(after_help = "Examples:
  valvectl gate start --online-port 8000 --offline-label batch     # a server on port 8000
  valvectl gate start --online 4242 --offline 5151,5252           # its listening ports too
  valvectl gate start --online-label serving --offline-label batch
  valvectl gate start --online 4242 --offline 5151 --no-arrivals  # launch edges only
  valvectl gate start --online-port 8000 --offline-label batch --realtime-priority 0  # no SCHED_FIFO
  valvectl gate start --online 4242 --offline 5151 --cooldown-floor 2ms --cooldown-ceiling 100ms
  valvectl gate start --online-port 8000 --offline-label batch --hold-budget 10%  # bursty arrivals")]
    Start(Box<StartArgs>),
    /// Stop gating; offline is resumed. Prints the final counts.
    Stop,
    /// What the gate has done: preemptions, resumes, cooldown, latencies.
    Status,
    /// Every decision with its timestamps: arrival and launch edges, busy/idle signals,
    /// disables, cooldowns and enables (CLOCK_MONOTONIC ns); `--json` prints JSON lines.
    #[command(after_help = "Examples:
  valvectl gate trace                      # what is kept (the last 65536 records)
  valvectl --json gate trace --follow > gate-trace.jsonl
  valvectl --json gate trace --after 1200")]
    Trace {
        /// Only records after this sequence number.
        #[arg(long, default_value_t = 0, value_name = "SEQ")]
        after: u64,
        /// Keep polling for new records (every 100 ms) until interrupted.
        #[arg(long)]
        follow: bool,
    },
    /// For a serving framework: a request is in flight (preempt now, hold until `idle`).
    Busy,
    /// For a serving framework: no request is in flight (resume offline now).
    Idle,
}

/// `valvectl gate start`'s arguments.
#[derive(Debug, Args)]
pub struct StartArgs {
    /// Online (latency-critical) processes by pid; the TCP ports they listen on count as
    /// the service's ports.
    #[arg(long, value_delimiter = ',', value_name = "PID")]
    online: Vec<u32>,
    /// Online processes by label (VALVE_LABEL in their environment); their listening ports
    /// count too.
    #[arg(long, value_name = "LABEL")]
    online_label: Option<String>,
    /// The online service by the TCP port it listens on (any network namespace); the
    /// processes listening on it are online.
    #[arg(long, value_delimiter = ',', value_name = "PORT")]
    online_port: Vec<u16>,
    /// Do not preempt on request arrivals, only on GPU launch edges.
    #[arg(long)]
    no_arrivals: bool,
    /// Ignore online threads waiting for their GPU work (launch gaps alone decide when online
    /// is idle, as the gate did before it watched waits; for comparison).
    #[arg(long)]
    no_waits: bool,
    /// How several offline GPUs are issued: auto measures serial against parallel once on
    /// the offline channels (the stock driver serialises them, so serial wins there).
    #[arg(long, value_enum, default_value_t = IssueArg::Auto, value_name = "MODE")]
    issue: IssueArg,
    /// SCHED_FIFO priority (1-99) of the gate thread and the threads that carry arrival and
    /// launch edges to it; 0 keeps them on the normal scheduler. Under EEVDF a woken normal
    /// thread can wait ~4 ms for a busy CPU, which would land on an online request.
    #[arg(long, default_value_t = 10, value_name = "PRIORITY",
          value_parser = clap::value_parser!(u8).range(0..=99))]
    realtime_priority: u8,
    /// While offline runs, the gate thread spins on the arrival program's counters and its
    /// inputs instead of sleeping, at the cost of one CPU then (it runs on the normal
    /// scheduler). For hosts where waking an idle CPU takes milliseconds (VMs whose vCPUs
    /// halt): there a sleeping thread can miss the request's first kernel.
    #[arg(long, conflicts_with = "no_arrivals")]
    arrival_busy_poll: bool,
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
    /// How long a gap between online iterations counts as recent: a rare long host pause
    /// keeps the cooldown above it this long [default: the daemon's gate.gap_memory, else 60s]
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    gap_memory: Option<Duration>,
    /// Use this cooldown instead of learning it (0ms: preempt on every burst of launches
    /// and resume at once; for comparison, it hurts online latency).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    fixed_cooldown: Option<Duration>,
    /// Hold offline frozen past the cooldown so that arrivals likely soon find it off the
    /// GPU already, giving up at most this share of online's idle time (e.g. 10%). The hold
    /// is the longest that would have cost that share over the last 256 gaps between
    /// requests: with bursty arrivals it catches many at a small cost, with evenly random
    /// ones about the budget's share. Shown in `gate status` once 8 gaps are seen. It is
    /// worth what it has seen (about 20 minutes of bursty traffic): a gate started again for
    /// the same --online-port/--online/--online-label starts from the gaps the last one
    /// learned (kept 24 h in the daemon's state directory, gate-hold-history.json).
    #[arg(long, value_parser = parse_percent, value_name = "PERCENT")]
    hold_budget: Option<f64>,
}

/// `--issue`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IssueArg {
    /// Measure once on the offline channels and keep the faster.
    Auto,
    /// One GPU after another.
    Serial,
    /// All GPUs at once on persistent per-GPU threads.
    Parallel,
}

/// The request a `gate` subcommand sends; `start` must name both sides.
pub fn request(action: &GateCommand) -> Result<Request, CliError> {
    let us = |d: &Duration| d.as_micros() as u64;
    Ok(match action {
        GateCommand::Start(start) => {
            let StartArgs {
                online,
                online_label,
                online_port,
                no_arrivals,
                no_waits,
                issue,
                realtime_priority,
                arrival_busy_poll,
                offline,
                offline_label,
                cooldown_floor,
                cooldown_ceiling,
                gap_factor,
                gap_memory,
                fixed_cooldown,
                hold_budget,
            } = start.as_ref();
            if hold_budget.is_some() && fixed_cooldown.is_some() {
                return Err(CliError::Usage(
                    "--hold-budget adds to the learned cooldown, which --fixed-cooldown replaces: \
                     drop one of the two"
                        .into(),
                ));
            }
            if online.is_empty() && online_label.is_none() && online_port.is_empty() {
                return Err(CliError::Usage(
                    "name the online service: --online PID[,PID...], --online-label LABEL or \
                     --online-port PORT[,PORT...]"
                        .into(),
                ));
            }
            if online_port.contains(&0) {
                return Err(CliError::Usage("--online-port 0 is no port".into()));
            }
            if offline.is_empty() && offline_label.is_none() {
                return Err(CliError::Usage(
                    "name the offline processes: --offline PID[,PID...] or --offline-label LABEL \
                     (nothing else is ever frozen)"
                        .into(),
                ));
            }
            Request::GateStart(Box::new(GateSpec {
                online: online.clone(),
                online_label: online_label.clone(),
                offline: offline.clone(),
                offline_label: offline_label.clone(),
                cooldown_floor_us: Some(us(cooldown_floor)),
                cooldown_ceiling_us: Some(us(cooldown_ceiling)),
                gap_factor: Some(*gap_factor),
                gap_memory_ms: gap_memory.map(|d| d.as_millis() as u64),
                fixed_cooldown_us: fixed_cooldown.as_ref().map(us),
                hold_budget_pct: *hold_budget,
                online_ports: online_port.clone(),
                arrivals: Some(!no_arrivals),
                waits: Some(!no_waits),
                realtime_priority: Some(*realtime_priority),
                arrival_busy_poll: Some(*arrival_busy_poll),
                issue: Some(
                    match issue {
                        IssueArg::Auto => "auto",
                        IssueArg::Serial => "serial",
                        IssueArg::Parallel => "parallel",
                    }
                    .into(),
                ),
            }))
        }
        GateCommand::Stop => Request::GateStop,
        GateCommand::Status => Request::GateStatus,
        GateCommand::Trace { after, .. } => Request::GateTrace {
            after: *after,
            limit: None,
        },
        GateCommand::Busy => Request::OnlineBusy,
        GateCommand::Idle => Request::OnlineIdle,
    })
}

/// How long `gate start` waits for its answer: the daemon answers once the gate's libcuda
/// probes are attached (seconds beside busy jobs), then once its online processes' probes are
/// (up to 20 s more, `PROBES_WITHIN`), so the usual 10 s would give up on a start that succeeds.
const START_REPLY_WITHIN: Duration = Duration::from_secs(60);

/// Sends the subcommand's request to the daemon and prints the answer.
pub fn exec(args: &GateArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let action = &args.action;
    if let GateCommand::Trace { after, follow } = action {
        return trace(g, *after, *follow, out);
    }
    let req = request(action)?;
    if matches!(action, GateCommand::Busy | GateCommand::Idle) {
        let data: SignalReply = daemon_call(g.socket, &req)?;
        if g.json {
            writeln!(out, "{}", print::json(&data))?;
        } else {
            writeln!(out, "sent: online {}", data.signal)?;
        }
        return Ok(());
    }
    let data: GateReply = if matches!(req, Request::GateStart(_)) {
        daemon_call_within(g.socket, &req, START_REPLY_WITHIN)?
    } else {
        daemon_call(g.socket, &req)?
    };
    if g.json {
        writeln!(out, "{}", print::json(&data))?;
    } else {
        print::gate_status(out, &data)?;
    }
    Ok(())
}

/// `gate trace`: prints the records after `after`, and with `follow` keeps polling.
fn trace(g: Globals, mut after: u64, follow: bool, out: &mut dyn Write) -> Result<(), CliError> {
    loop {
        let req = Request::GateTrace { after, limit: None };
        let data: TraceReply = daemon_call(g.socket, &req)?;
        for r in &data.records {
            if g.json {
                writeln!(out, "{}", print::json(r))?;
            } else {
                writeln!(out, "{}", print::trace_line(r))?;
            }
            after = after.max(r.seq);
        }
        out.flush()?;
        if !follow {
            return Ok(());
        }
        // Records dropped from the ring between two polls show as a gap in `seq`.
        std::thread::sleep(Duration::from_millis(100));
    }
}
