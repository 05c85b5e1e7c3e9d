//! `valvectl`: the operator's command line over the library (list GPUs, preempt, resume, bench).
//! Parsing, output and exit codes live here; `main.rs` only calls [`run`].

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use serde_json::json;
use valve::controller::{BatchReport, ChannelTarget, Controller, PreemptMode};
use valve::driver::{DriverInfo, RmDriver};
use valve::gpu::{GpuInfo, GpuSelector};
use valve::stats::{summarize, Summary};
use valve::Signals;
use valve_daemon::protocol::Request;

use crate::client::daemon_call;
use crate::error::CliError;
use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

const EXIT_CODES: &str = "\
Exit codes:
  0    success (for `preempt`, also when the hold ends by Ctrl-C/SIGTERM: channels were resumed)
  1    other failure (I/O, unexpected driver answer)
  2    usage error (bad arguments)
  3    NVIDIA driver missing, or not the open kernel module
  4    permission denied on the NVIDIA device files
  5    the driver rejected the request (e.g. unknown client or channel handle); nothing was left disabled
  6    no such GPU
  7    the Valve daemon is not running (for ps, status, --pid, resume --all, gate)
  8    no such process, process has no GPU channels, or it started before the daemon
  9    BPF, the ioctl tracepoints or uprobes on libcuda are unavailable (daemon, gate start)
  130  `bench` interrupted (channels were resumed)

Handles are hexadecimal, with or without 0x (as RM prints them: c1d00042, 0x5c000020).
A process's client is the hRoot of its RM allocations; its channels are its *_CHANNEL_GPFIFO objects.

Examples:
  valvectl gpus
  valvectl preempt --gpu 0 --client c1d00042 --channel 5c000030,5c000031 --for 500ms
  valvectl preempt --target 0:c1d00042:5c000030 --target 1:c1d00042:5c000090 --detach
  valvectl resume  --target 0:c1d00042:5c000030 --target 1:c1d00042:5c000090
  valvectl bench   --gpu 0 --client c1d00042 --channel 5c000030 --cycles 300 --json
  sudo valvectl daemon --group valve --max-hold 30s      # discovery; see `valvectl ps`
  valvectl ps
  valvectl preempt --pid 4242 --for 2s                   # all of its GPUs, in parallel
  valvectl resume --all
  valvectl gate start --online 4242 --offline-label batch  # offline runs only while 4242 idles
  valvectl gate status; valvectl gate stop";

/// Valve: freeze and release other processes' GPU channels on NVIDIA GPUs.
#[derive(Debug, Parser)]
#[command(name = "valvectl", version, about, after_help = EXIT_CODES)]
pub struct Cli {
    /// Print machine-readable JSON on stdout instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// The daemon's socket (for ps, status, --pid, resume --all, daemon).
    #[arg(long, global = true, env = "VALVE_SOCKET", default_value = valve_daemon::protocol::DEFAULT_SOCKET)]
    pub socket: std::path::PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the GPUs: index, name, PCI address, device-file minor, RM device instance, UUID.
    Gpus,
    /// Disable (and preempt) channels of other processes, hold, then resume them.
    ///
    /// By default the channels stay frozen until Ctrl-C, SIGTERM or `--for` elapses, and are
    /// always resumed before valvectl exits. `--detach` leaves them frozen instead and prints the
    /// `valvectl resume` command that releases them.
    Preempt {
        #[command(flatten)]
        targets: TargetArgs,
        /// Hold for this long, then resume (e.g. 500ms, 2s, 1m). Default: until Ctrl-C/SIGTERM.
        #[arg(long = "for", value_name = "DURATION", value_parser = parse_duration, conflicts_with = "detach")]
        hold: Option<Duration>,
        /// Leave the channels disabled and exit; undo with `valvectl resume`.
        #[arg(long)]
        detach: bool,
        /// Only stop scheduling new work; running kernels keep running (no preemption).
        #[arg(long)]
        schedule_only: bool,
    },
    /// Enable channels (undo `preempt --detach`, or clean up after a crash).
    Resume {
        #[command(flatten)]
        targets: TargetArgs,
        /// Enable everything the daemon disabled (works from its state file if it is not running).
        #[arg(long, conflicts_with_all = ["pid", "gpu", "client", "channels", "targets"])]
        all: bool,
    },
    /// Run the discovery daemon (root): watches CUDA processes' RM objects with eBPF and serves
    /// ps/preempt --pid/resume over a Unix socket. Everything it disabled is resumed on exit, and
    /// re-enabled from its state file if a previous run died.
    Daemon {
        /// Directory of the state file (disabled.json).
        #[arg(long, default_value = valve_daemon::protocol::DEFAULT_STATE_DIR)]
        state_dir: std::path::PathBuf,
        /// Group whose members may use the socket besides root.
        #[arg(long)]
        group: Option<String>,
        /// Longest any preemption may last; longer ones are resumed by the daemon.
        #[arg(long, value_parser = parse_duration)]
        max_hold: Option<Duration>,
    },
    /// List the GPU processes the daemon knows: GPUs, client, TSGs, channels, state.
    Ps,
    /// Check what this node supports: driver (open module?), GSP, device-file exposure, root,
    /// BPF, and (root) channel control on a self-started CUDA test load, including whether the
    /// driver serialises preemption across GPUs (stock) or not (patched).
    Doctor,
    /// (internal) The CUDA test load `doctor` starts.
    #[command(hide = true)]
    TestLoad,
    /// The daemon's state: uptime, events seen, what is preempted.
    Status,
    /// Workload-aware gating (runs inside the daemon): offline processes run only while the
    /// online ones are idle.
    ///
    /// The daemon watches the online processes' kernel and graph launches with uprobes on
    /// libcuda (no change to them). On the first launch after an idle gap it preempts every
    /// offline process on all their GPUs at once; it resumes them once online has been idle for
    /// a cooldown of 2x the longest recent gap between its iterations, so one online request is
    /// preempted against at most once. A serving framework can also say `busy`/`idle` itself.
    /// Only processes named as offline are ever frozen; online ones never are. If the daemon
    /// dies, its restart re-enables offline.
    Gate {
        #[command(subcommand)]
        action: GateCommand,
    },
    /// Preempt and resume in a loop and print p50/p99/max of each step.
    Bench {
        #[command(flatten)]
        targets: TargetArgs,
        /// Preempt/resume cycles.
        #[arg(long, default_value_t = 100)]
        cycles: usize,
        /// How long each preemption is held.
        #[arg(long, value_parser = parse_duration, default_value = "1ms")]
        hold: Duration,
        /// Pause between cycles (the work runs during it).
        #[arg(long, value_parser = parse_duration, default_value = "5ms")]
        gap: Duration,
        /// Issue the GPUs one after another on one thread instead of one thread per GPU.
        #[arg(long)]
        serial: bool,
        /// Only stop scheduling new work (no preemption).
        #[arg(long)]
        schedule_only: bool,
    },
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

/// Which channels: one GPU and client with `--gpu/--client/--channel`, or any mix with `--target`.
#[derive(Debug, Args, Clone, Default)]
pub struct TargetArgs {
    /// A process discovered by the daemon: all of its channels (on --gpu only, if given).
    #[arg(long, conflicts_with_all = ["client", "channels", "targets"])]
    pub pid: Option<u32>,
    /// GPU: index from `valvectl gpus`, UUID (GPU-...) or PCI address.
    #[arg(long)]
    pub gpu: Option<GpuSelector>,
    /// The owning process's RM client handle (hex).
    #[arg(long, value_parser = parse_handle, requires = "gpu")]
    pub client: Option<u32>,
    /// Channel handles (hex), comma-separated or repeated.
    #[arg(long = "channel", value_parser = parse_handle, value_delimiter = ',', requires = "gpu")]
    pub channels: Vec<u32>,
    /// GPU:CLIENT:CHANNEL[,CHANNEL...]; repeat for several GPUs or clients.
    #[arg(long = "target", value_parser = parse_target, value_name = "GPU:CLIENT:CHANNELS")]
    pub targets: Vec<TargetSpec>,
}

/// One `--target` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetSpec {
    /// The GPU.
    pub gpu: GpuSelector,
    /// The client.
    pub client: u32,
    /// Its channels.
    pub channels: Vec<u32>,
}

/// Parses an RM handle: hexadecimal, optional 0x.
pub fn parse_handle(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let digits = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if digits.is_empty() || digits.len() > 8 {
        return Err(format!(
            "'{s}' is not an RM handle (8 hex digits at most, e.g. c1d00042)"
        ));
    }
    u32::from_str_radix(digits, 16)
        .map_err(|_| format!("'{s}' is not an RM handle: handles are hexadecimal, e.g. 5c000030"))
}

fn parse_target(s: &str) -> Result<TargetSpec, String> {
    // The GPU part may itself contain ':' (a PCI address), so split from the right.
    let mut parts = s.rsplitn(3, ':');
    let (Some(chans), Some(client), Some(gpu)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(format!(
            "'{s}' is not GPU:CLIENT:CHANNEL[,CHANNEL...] (e.g. 0:c1d00042:5c000030)"
        ));
    };
    let channels = chans
        .split(',')
        .map(parse_handle)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TargetSpec {
        gpu: gpu.parse()?,
        client: parse_handle(client)?,
        channels,
    })
}

/// Parses `500ms`, `2s`, `1.5s`, `100us`, `1m`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (e.g. 500ms, 2s, 100us)"))?;
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        u => {
            return Err(format!(
                "unknown unit '{u}' in '{s}': use ns, us, ms, s, m or h"
            ))
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || !(0.0..=7.0 * 86400.0).contains(&secs) {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl TargetArgs {
    /// Checks the combinations clap cannot express.
    pub fn validate(&self) -> Result<(), CliError> {
        if self.pid.is_none()
            && self.gpu.is_some()
            && (self.client.is_none() || self.channels.is_empty())
        {
            return Err(CliError::Usage(
                "--gpu needs --client and --channel (or use --pid with the daemon)".into(),
            ));
        }
        Ok(())
    }

    /// Resolves GPUs and handles into channel targets.
    pub fn resolve(&self, gpus: &[GpuInfo]) -> Result<Vec<ChannelTarget>, CliError> {
        let mut out = Vec::new();
        let mut add = |gpu: &GpuSelector, client: u32, channels: &[u32]| -> Result<(), CliError> {
            let gpu = gpu.resolve(gpus)?;
            out.extend(channels.iter().map(|&c| ChannelTarget {
                gpu,
                client: ClientHandle(client),
                channel: ChannelHandle(c),
            }));
            Ok(())
        };
        if let (Some(gpu), Some(client)) = (&self.gpu, self.client) {
            add(gpu, client, &self.channels)?;
        }
        for t in &self.targets {
            add(&t.gpu, t.client, &t.channels)?;
        }
        if out.is_empty() {
            return Err(CliError::Usage(
                "name the channels: --gpu G --client C --channel CH[,CH...], or --target G:C:CH[,CH...]"
                    .into(),
            ));
        }
        Ok(out)
    }

    fn as_command_line(&self, gpus: &[GpuInfo], targets: &[ChannelTarget]) -> String {
        let mut by: std::collections::BTreeMap<(usize, u32), Vec<u32>> = Default::default();
        for t in targets {
            by.entry((t.gpu, t.client.0)).or_default().push(t.channel.0);
        }
        by.iter()
            .map(|((g, c), chans)| {
                let id = gpus
                    .get(*g)
                    .map(|g| g.pci_bus_id.clone())
                    .unwrap_or(g.to_string());
                let list: Vec<String> = chans.iter().map(|c| format!("{c:x}")).collect();
                format!("--target {id}:{c:x}:{}", list.join(","))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Entry point of the binary: parses, runs, prints errors, returns the exit code.
pub fn run() -> i32 {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VALVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let json = cli.json;
    let result = Signals::install()
        .map_err(CliError::from)
        .and_then(|signals| dispatch(&cli, &signals));
    match result {
        Ok(()) => 0,
        Err(e) => {
            let code = e.exit_code();
            eprintln!("valvectl: error: {e}");
            if json {
                println!("{}", json!({"error": e.to_string(), "exit_code": code}));
            }
            code
        }
    }
}

fn dispatch(cli: &Cli, signals: &Signals) -> Result<(), CliError> {
    let out = &mut std::io::stdout().lock();
    match &cli.command {
        Command::Daemon {
            state_dir,
            group,
            max_hold,
        } => valve_daemon::run(
            &valve_daemon::DaemonConfig {
                socket: cli.socket.clone(),
                state_dir: state_dir.clone(),
                group: group.clone(),
                max_hold: *max_hold,
            },
            signals,
        )
        .map_err(|e| CliError::Daemon(e.code, e.message)),
        Command::Ps | Command::Status | Command::Gate { .. } => client_command(cli, out, signals),
        Command::TestLoad => match crate::doctor::test_load() {
            0 => Ok(()),
            code => Err(CliError::Daemon(code, "the CUDA test load failed".into())),
        },
        Command::Doctor => {
            let exe = std::env::current_exe().map_err(CliError::Io)?;
            let findings = crate::doctor::run(&exe);
            if cli.json {
                writeln!(out, "{}", json!({"findings": findings}))?;
            } else {
                for f in &findings {
                    let tag = match f.status {
                        crate::doctor::Status::Ok => "ok  ",
                        crate::doctor::Status::Warn => "WARN",
                        crate::doctor::Status::Fail => "FAIL",
                        crate::doctor::Status::Skip => "skip",
                    };
                    writeln!(out, "[{tag}] {:<16} {}", f.check, f.detail)?;
                }
            }
            if findings
                .iter()
                .any(|f| f.status == crate::doctor::Status::Fail)
            {
                Err(CliError::Daemon(
                    1,
                    "doctor found problems (FAIL lines above)".into(),
                ))
            } else {
                Ok(())
            }
        }
        Command::Preempt { targets, .. } if targets.pid.is_some() => {
            client_command(cli, out, signals)
        }
        Command::Resume { targets, all } if targets.pid.is_some() || *all => {
            client_command(cli, out, signals)
        }
        _ => {
            let ctl = Controller::open()?;
            execute(cli, &ctl, out, Some(signals))
        }
    }
}

fn gate_request(action: &GateCommand) -> Result<Request, CliError> {
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
            Request::GateStart(valve_daemon::protocol::GateSpec {
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

/// The gate's status as a few human lines.
fn print_gate_status(out: &mut dyn Write, v: &serde_json::Value) -> std::io::Result<()> {
    if v["running"] != true {
        writeln!(out, "gate: not running")?;
        if v.get("preemptions").is_none() {
            return Ok(());
        }
    } else {
        let who = |pids: &serde_json::Value, label: &serde_json::Value| {
            let mut s = pids.to_string();
            if let Some(l) = label.as_str() {
                s.push_str(&format!(" (label {l})"));
            }
            s
        };
        writeln!(
            out,
            "gate: running; offline {}{}",
            if v["preempted"] == true {
                "PREEMPTED"
            } else {
                "running"
            },
            if v["pinned"] == true {
                " (held by a busy signal)"
            } else {
                ""
            }
        )?;
        writeln!(
            out,
            "online pids {}; offline pids {}: {} channel(s) on {} GPU(s)",
            who(&v["online_pids"], &v["online_label"]),
            who(&v["offline_pids"], &v["offline_label"]),
            v["offline_channels"],
            v["offline_gpus"]
        )?;
    }
    let f = |k: &str, p: &str| v[k][p].as_f64().unwrap_or(0.0);
    writeln!(
        out,
        "preemptions {}, resumes {}, online edges {}, offline preempted {:.2} s in all; cooldown now {:.2} ms",
        v["preemptions"],
        v["resumes"],
        v["edges"],
        v["preempted_s"].as_f64().unwrap_or(0.0),
        v["cooldown_us"].as_f64().unwrap_or(0.0) / 1e3
    )?;
    writeln!(
        out,
        "disable p50/p99 {:.0}/{:.0} us, enable {:.0}/{:.0} us, online launch -> offline stopped {:.0}/{:.0} us",
        f("disable_us", "p50_us"),
        f("disable_us", "p99_us"),
        f("enable_us", "p50_us"),
        f("enable_us", "p99_us"),
        f("edge_to_disable_us", "p50_us"),
        f("edge_to_disable_us", "p99_us")
    )?;
    if let Some(e) = v["last_error"].as_str() {
        writeln!(out, "errors {}, latest: {e}", v["errors"])?;
    }
    if let Some(n) = v["note"].as_str() {
        writeln!(out, "note: {n}")?;
    }
    Ok(())
}

/// Commands served by the daemon.
fn client_command(cli: &Cli, out: &mut dyn Write, signals: &Signals) -> Result<(), CliError> {
    match &cli.command {
        Command::Gate { action } => {
            let data = daemon_call(&cli.socket, &gate_request(action)?)?;
            if cli.json {
                writeln!(out, "{data}")?;
            } else if matches!(action, GateCommand::Busy | GateCommand::Idle) {
                writeln!(
                    out,
                    "sent: online {}",
                    data["signal"].as_str().unwrap_or("")
                )?;
            } else {
                print_gate_status(out, &data)?;
            }
            Ok(())
        }
        Command::Ps => {
            let data = daemon_call(&cli.socket, &Request::Ps)?;
            if cli.json {
                writeln!(out, "{data}")?;
                return Ok(());
            }
            writeln!(
                out,
                "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} STATE",
                "PID", "COMM", "GPU", "CLIENT", "TSGS", "CHANNELS"
            )?;
            for p in data["processes"].as_array().into_iter().flatten() {
                // serde_json values ignore width specifiers: format them as strings first.
                let pid = p["pid"].to_string();
                if p["discoverable"] == false {
                    writeln!(
                        out,
                        "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} {}",
                        pid,
                        p["comm"].as_str().unwrap_or(""),
                        "-",
                        "-",
                        "-",
                        "-",
                        p["note"].as_str().unwrap_or("")
                    )?;
                    continue;
                }
                let state = if p["preempted"] == true {
                    "PREEMPTED"
                } else {
                    "running"
                };
                for g in p["gpus"].as_array().into_iter().flatten() {
                    let gpu = g["gpu"]
                        .as_u64()
                        .map(|i| i.to_string())
                        .unwrap_or("?".into());
                    writeln!(
                        out,
                        "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} {state}",
                        pid,
                        p["comm"].as_str().unwrap_or(""),
                        gpu,
                        g["client"].as_str().unwrap_or(""),
                        g["tsgs"].as_array().map(|t| t.len()).unwrap_or(0),
                        g["channels"].to_string()
                    )?;
                }
            }
            Ok(())
        }
        Command::Status => {
            let data = daemon_call(&cli.socket, &Request::Status)?;
            if cli.json {
                writeln!(out, "{data}")?;
            } else {
                writeln!(out, "daemon up {:.0} s, {} RM events seen, {} GPU process(es) known, preempted pids: {}, max hold: {}",
                    data["uptime_s"].as_f64().unwrap_or(0.0), data["events"], data["processes"], data["preempted"],
                    data["max_hold_ms"].as_u64().map(|m| format!("{m} ms")).unwrap_or("none".into()))?;
                writeln!(
                    out,
                    "state file: {}",
                    data["state_file"].as_str().unwrap_or("")
                )?;
            }
            Ok(())
        }
        Command::Preempt {
            targets,
            hold,
            detach,
            schedule_only,
        } => {
            if *schedule_only {
                return Err(CliError::Usage(
                    "--schedule-only is not available with --pid".into(),
                ));
            }
            let pid = targets.pid.expect("dispatched on pid");
            let gpu = targets.gpu.as_ref().map(|g| g.to_string());
            // A held preemption gets a daemon-side limit too, so a killed valvectl cannot leave
            // the process frozen for longer than it asked for.
            let max_hold_ms = hold.map(|h| (h + Duration::from_secs(1)).as_millis() as u64);
            let data = daemon_call(
                &cli.socket,
                &Request::Preempt {
                    pid,
                    gpu,
                    max_hold_ms: if *detach { None } else { max_hold_ms },
                },
            )?;
            if *detach {
                if cli.json {
                    writeln!(
                        out,
                        "{}",
                        json!({"preempted": data, "resume_command": format!("valvectl resume --pid {pid}")})
                    )?;
                } else {
                    writeln!(out, "preempted pid {pid}: {} channel(s) on {} GPU(s); it stays frozen until `valvectl resume --pid {pid}`", data["channels"], data["gpus"])?;
                }
                return Ok(());
            }
            if !cli.json {
                writeln!(
                    out,
                    "preempted pid {pid}: {} channel(s) on {} GPU(s){}",
                    data["channels"],
                    data["gpus"],
                    match hold {
                        Some(d) => format!(", holding for {d:?}"),
                        None => "; Ctrl-C or SIGTERM resumes it".into(),
                    }
                )?;
                out.flush()?;
            }
            let signal = signals.wait(*hold);
            let resumed = daemon_call(&cli.socket, &Request::Resume { pid });
            let resumed = match resumed {
                Ok(v) => v,
                // The daemon's own limit may have resumed it first.
                Err(CliError::Daemon(8, m)) if m.contains("not preempted") => {
                    json!({"note": "already resumed by the daemon"})
                }
                Err(e) => return Err(e),
            };
            if cli.json {
                writeln!(
                    out,
                    "{}",
                    json!({"preempt": data, "resume": resumed, "ended_by": signal.map(|s| s.as_str()).unwrap_or("timer")})
                )?;
            } else {
                writeln!(out, "resumed pid {pid}")?;
            }
            Ok(())
        }
        Command::Resume { targets, all } => {
            let req = if *all {
                Request::ResumeAll
            } else {
                Request::Resume {
                    pid: targets.pid.expect("dispatched on pid"),
                }
            };
            match daemon_call(&cli.socket, &req) {
                Ok(data) => {
                    if cli.json {
                        writeln!(out, "{data}")?;
                    } else {
                        writeln!(out, "resumed: {data}")?;
                    }
                    Ok(())
                }
                Err(CliError::Daemon(code, _)) if *all && code == valve_daemon::EXIT_NO_DAEMON => {
                    // No daemon: re-enable from its state file directly.
                    let state = valve::state::StateFile::in_dir(std::path::Path::new(
                        valve_daemon::protocol::DEFAULT_STATE_DIR,
                    ));
                    let records = state.load()?;
                    let ctl = Controller::open()?;
                    let (n, failures) = valve::state::reenable(&ctl, &records);
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
                Err(e) => Err(e),
            }
        }
        _ => unreachable!("only daemon-served commands come here"),
    }
}

fn print_batch(out: &mut dyn Write, what: &str, rep: &BatchReport) -> std::io::Result<()> {
    for g in &rep.gpus {
        writeln!(
            out,
            "  {what} GPU {}: {} channel(s), ioctl {:.0} us (started +{:.0} us)",
            g.gpu,
            g.channels,
            g.ioctl.as_secs_f64() * 1e6,
            g.start_offset.as_secs_f64() * 1e6
        )?;
    }
    writeln!(
        out,
        "  {what} total: {:.0} us",
        rep.wall.as_secs_f64() * 1e6
    )
}

/// Runs one parsed command against a controller.
pub fn execute<D: RmDriver>(
    cli: &Cli,
    ctl: &Controller<D>,
    out: &mut dyn Write,
    signals: Option<&Signals>,
) -> Result<(), CliError> {
    let gpus = ctl.gpus();
    match &cli.command {
        Command::Gpus => {
            if cli.json {
                let driver = DriverInfo::read().ok();
                writeln!(out, "{}", json!({"driver": driver, "gpus": gpus}))?;
            } else {
                if let Ok(d) = DriverInfo::read() {
                    writeln!(
                        out,
                        "driver {} ({})",
                        d.version,
                        if d.open_module {
                            "open kernel module"
                        } else {
                            "proprietary"
                        }
                    )?;
                }
                writeln!(
                    out,
                    "{:<4} {:<28} {:<13} {:<6} {:<12} UUID",
                    "IDX", "NAME", "PCI BUS ID", "MINOR", "RM-INSTANCE"
                )?;
                for g in &gpus {
                    writeln!(
                        out,
                        "{:<4} {:<28} {:<13} {:<6} {:<12} {}",
                        g.index, g.name, g.pci_bus_id, g.minor, g.device_instance, g.uuid
                    )?;
                }
            }
            Ok(())
        }
        Command::Daemon { .. }
        | Command::Ps
        | Command::Status
        | Command::Gate { .. }
        | Command::Doctor
        | Command::TestLoad => Err(CliError::Usage(
            "this command does not run against a controller".into(),
        )),
        Command::Preempt {
            targets,
            hold,
            detach,
            schedule_only,
        } => {
            targets.validate()?;
            let t = targets.resolve(&gpus)?;
            let mode = if *schedule_only {
                PreemptMode::ScheduleOnly
            } else {
                PreemptMode::Preempt
            };
            let plan = ctl.plan(&t, mode)?;
            let guard = ctl.disable(&plan)?;
            if *detach {
                let rep = guard.keep_disabled();
                let undo = format!("valvectl resume {}", targets.as_command_line(&gpus, &t));
                if cli.json {
                    writeln!(
                        out,
                        "{}",
                        json!({"disabled": rep, "channels": plan.channels(), "resume_command": undo})
                    )?;
                } else {
                    writeln!(
                        out,
                        "disabled {} channel(s) on {} GPU(s); they stay frozen until you run:",
                        plan.channels(),
                        plan.gpus()
                    )?;
                    writeln!(out, "  {undo}")?;
                    print_batch(out, "disable", &rep)?;
                }
                return Ok(());
            }
            let disable_rep = guard.disable_report().clone();
            if !cli.json {
                writeln!(
                    out,
                    "disabled {} channel(s) on {} GPU(s){}",
                    plan.channels(),
                    plan.gpus(),
                    match hold {
                        Some(d) => format!(", holding for {d:?}"),
                        None => "; Ctrl-C or SIGTERM resumes them".into(),
                    }
                )?;
                out.flush()?;
            }
            let held_from = Instant::now();
            let signal = match (signals, hold) {
                (Some(s), h) => s.wait(*h),
                (None, Some(h)) => {
                    std::thread::sleep(*h);
                    None
                }
                (None, None) => None,
            };
            let held = held_from.elapsed();
            let enable_rep = guard.enable()?;
            if cli.json {
                writeln!(
                    out,
                    "{}",
                    json!({
                        "channels": plan.channels(), "gpus": plan.gpus(),
                        "disable": disable_rep, "enable": enable_rep,
                        "held_us": held.as_secs_f64() * 1e6,
                        "ended_by": signal.map(|s| s.as_str()).unwrap_or("timer"),
                    })
                )?;
            } else {
                print_batch(out, "disable", &disable_rep)?;
                writeln!(
                    out,
                    "resumed after {:.1} ms{}",
                    held.as_secs_f64() * 1e3,
                    signal.map(|s| format!(" ({s})")).unwrap_or_default()
                )?;
                print_batch(out, "enable", &enable_rep)?;
            }
            Ok(())
        }
        Command::Resume { targets, .. } => {
            targets.validate()?;
            let t = targets.resolve(&gpus)?;
            let plan = ctl.plan(&t, PreemptMode::Preempt)?;
            let rep = ctl.enable(&plan)?;
            if cli.json {
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
                print_batch(out, "enable", &rep)?;
            }
            Ok(())
        }
        Command::Bench {
            targets,
            cycles,
            hold,
            gap,
            serial,
            schedule_only,
        } => {
            targets.validate()?;
            if targets.pid.is_some() {
                return Err(CliError::Usage(
                    "bench takes explicit handles, not --pid".into(),
                ));
            }
            let t = targets.resolve(&gpus)?;
            let mode = if *schedule_only {
                PreemptMode::ScheduleOnly
            } else {
                PreemptMode::Preempt
            };
            let plan = ctl.plan(&t, mode)?;
            let mut disable_wall = Vec::with_capacity(*cycles);
            let mut enable_wall = Vec::with_capacity(*cycles);
            let mut per_gpu: std::collections::BTreeMap<usize, (Vec<Duration>, Vec<Duration>)> =
                Default::default();
            let mut interrupted = None;
            for _ in 0..*cycles {
                let guard = if *serial {
                    ctl.disable_serial(&plan)?
                } else {
                    ctl.disable(&plan)?
                };
                std::thread::sleep(*hold);
                let d = guard.disable_report().clone();
                let e = guard.enable()?;
                disable_wall.push(d.wall);
                enable_wall.push(e.wall);
                for g in &d.gpus {
                    per_gpu.entry(g.gpu).or_default().0.push(g.ioctl);
                }
                for g in &e.gpus {
                    per_gpu.entry(g.gpu).or_default().1.push(g.ioctl);
                }
                if let Some(s) = signals.and_then(|s| s.pending()) {
                    interrupted = Some(s);
                    break;
                }
                std::thread::sleep(*gap);
            }
            let sd = summarize(&disable_wall);
            let se = summarize(&enable_wall);
            let per: Vec<(usize, Summary, Summary)> = per_gpu
                .iter()
                .map(|(g, (d, e))| (*g, summarize(d), summarize(e)))
                .collect();
            if cli.json {
                let per_json: Vec<_> = per
                    .iter()
                    .map(|(g, d, e)| json!({"gpu": g, "name": gpus[*g].name, "disable_ioctl": d, "enable_ioctl": e}))
                    .collect();
                writeln!(
                    out,
                    "{}",
                    json!({
                        "channels": plan.channels(), "gpus": plan.gpus(), "serial": serial,
                        "mode": plan.mode(), "cycles": disable_wall.len(),
                        "disable_wall": sd, "enable_wall": se, "per_gpu": per_json,
                    })
                )?;
            } else {
                writeln!(
                    out,
                    "{} cycles, {} channel(s) on {} GPU(s), {}",
                    disable_wall.len(),
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
            match interrupted {
                Some(s) => Err(CliError::Interrupted(s)),
                None => Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use valve::fake::FakeRm;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("valvectl").chain(args.iter().copied()))
    }

    #[test]
    fn handles_durations_and_targets_parse() {
        assert_eq!(parse_handle("c1d00042"), Ok(0xc1d0_0042));
        assert_eq!(parse_handle("0x5C000030"), Ok(0x5c00_0030));
        assert!(parse_handle("xyz").unwrap_err().contains("hexadecimal"));
        assert!(parse_handle("123456789").is_err());
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("100us"), Ok(Duration::from_micros(100)));
        assert!(parse_duration("5 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        let t = parse_target("0000:18:00.0:c1d00042:5c000030,5c000031").unwrap();
        assert_eq!(t.gpu, GpuSelector::PciBusId("0000:18:00.0".into()));
        assert_eq!(t.client, 0xc1d0_0042);
        assert_eq!(t.channels, vec![0x5c00_0030, 0x5c00_0031]);
        assert!(parse_target("0:c1d00042").is_err());
    }

    #[test]
    fn gate_start_needs_both_sides_and_carries_its_tuning() {
        let request = |args: &[&str]| {
            let cli = parse(args).unwrap();
            let Command::Gate { action } = &cli.command else {
                panic!("{cli:?}")
            };
            gate_request(action)
        };
        let missing = request(&["gate", "start", "--online", "1"]).unwrap_err();
        assert_eq!(missing.exit_code(), 2);
        assert!(
            missing
                .to_string()
                .contains("--offline PID[,PID...] or --offline-label LABEL"),
            "{missing}"
        );
        let missing = request(&["gate", "start", "--offline", "1"]).unwrap_err();
        assert!(missing.to_string().contains("--online-label"), "{missing}");
        assert!(request(&[
            "gate",
            "start",
            "--online-label",
            "a",
            "--offline-label",
            "b"
        ])
        .is_ok());
        let cli = parse(&[
            "gate",
            "start",
            "--online",
            "10,11",
            "--offline-label",
            "batch",
            "--fixed-cooldown",
            "0ms",
            "--cooldown-floor",
            "2ms",
        ])
        .unwrap();
        let Command::Gate { action } = &cli.command else {
            panic!("{cli:?}")
        };
        let Request::GateStart(spec) = gate_request(action).unwrap() else {
            panic!()
        };
        assert_eq!(spec.online, vec![10, 11]);
        assert!(spec.offline.is_empty());
        assert_eq!(spec.offline_label.as_deref(), Some("batch"));
        assert_eq!(spec.fixed_cooldown_us, Some(0));
        assert_eq!(spec.cooldown_floor_us, Some(2_000));
        assert_eq!(spec.cooldown_ceiling_us, Some(200_000));
        assert_eq!(spec.gap_factor, Some(2.0));
        for (sub, req) in [
            ("stop", Request::GateStop),
            ("status", Request::GateStatus),
            ("busy", Request::OnlineBusy),
            ("idle", Request::OnlineIdle),
        ] {
            let cli = parse(&["gate", sub]).unwrap();
            let Command::Gate { action } = &cli.command else {
                panic!()
            };
            assert_eq!(gate_request(action).unwrap(), req);
        }
    }

    #[test]
    fn gate_status_prints_what_an_operator_needs() {
        let v = serde_json::json!({"running": true, "preempted": true, "pinned": false,
            "online_pids": [10], "online_label": null, "offline_pids": [20, 21],
            "offline_label": "batch", "offline_channels": 40, "offline_gpus": 2,
            "preemptions": 7, "resumes": 6, "edges": 90, "preempted_s": 1.5, "cooldown_us": 4200.0,
            "disable_us": {"p50_us": 650.0, "p99_us": 700.0},
            "enable_us": {"p50_us": 400.0, "p99_us": 450.0},
            "edge_to_disable_us": {"p50_us": 700.0, "p99_us": 800.0}, "errors": 0,
            "last_error": null});
        let mut out = Vec::new();
        print_gate_status(&mut out, &v).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("offline PREEMPTED"), "{text}");
        assert!(
            text.contains("[20,21] (label batch): 40 channel(s) on 2 GPU(s)"),
            "{text}"
        );
        assert!(text.contains("preemptions 7, resumes 6"), "{text}");
        assert!(text.contains("cooldown now 4.20 ms"), "{text}");
        assert!(text.contains("stopped 700/800 us"), "{text}");
        let mut out = Vec::new();
        print_gate_status(&mut out, &serde_json::json!({"running": false})).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "gate: not running\n");
    }

    #[test]
    fn clap_rejects_incomplete_target_sets() {
        let incomplete = parse(&["preempt", "--gpu", "0", "--client", "c1"]).unwrap();
        let Command::Preempt { targets, .. } = &incomplete.command else {
            panic!()
        };
        assert!(targets
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--gpu needs --client and --channel"));
        assert!(parse(&["preempt", "--pid", "7", "--client", "c1"]).is_err());
        assert!(parse(&["resume", "--all", "--pid", "7"]).is_err());
        assert!(parse(&["preempt", "--pid", "7", "--gpu", "1", "--for", "1s"]).is_ok());
        assert!(parse(&["preempt", "--client", "c1", "--channel", "5"]).is_err());
        assert!(parse(&[
            "preempt",
            "--gpu",
            "0",
            "--client",
            "c1",
            "--channel",
            "5",
            "--for",
            "1s",
            "--detach"
        ])
        .is_err());
        let cli = parse(&[
            "--json",
            "bench",
            "--gpu",
            "0",
            "--client",
            "c1",
            "--channel",
            "5,6",
            "--cycles",
            "3",
        ])
        .unwrap();
        assert!(cli.json);
        Cli::command_for_tests().debug_assert();
    }

    impl Cli {
        fn command_for_tests() -> clap::Command {
            <Cli as clap::CommandFactory>::command()
        }
    }

    #[test]
    fn help_documents_exit_codes() {
        let help = Cli::command_for_tests().render_long_help().to_string();
        for needle in [
            "Exit codes",
            "3    NVIDIA driver missing",
            "--json",
            "hexadecimal",
        ] {
            assert!(help.contains(needle), "help lacks {needle}");
        }
    }

    fn host_with_process() -> (Controller<FakeRm>, Vec<String>) {
        let ctl = Controller::with_driver(FakeRm::host(2)).unwrap();
        let inst = ctl.gpus()[0].device_instance;
        let chans: Vec<ChannelHandle> = (0..3).map(|i| ChannelHandle(0x5c00_0030 + i)).collect();
        ctl.driver()
            .add_channels(ClientHandle(0xc1d0_0042), inst, &chans);
        (
            ctl,
            vec![
                "--gpu".into(),
                "0".into(),
                "--client".into(),
                "c1d00042".into(),
                "--channel".into(),
                "5c000030,5c000031,5c000032".into(),
            ],
        )
    }

    fn exec(ctl: &Controller<FakeRm>, args: &[String]) -> (Result<(), CliError>, String) {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let cli = parse(&argv).unwrap();
        let mut out = Vec::new();
        let r = execute(&cli, ctl, &mut out, None);
        (r, String::from_utf8(out).unwrap())
    }

    #[test]
    fn preempt_holds_then_resumes_and_detach_leaves_disabled() {
        let (ctl, t) = host_with_process();
        let mut args = vec!["preempt".to_string()];
        args.extend(t.clone());
        args.extend(["--for".into(), "1ms".into()]);
        let (r, out) = exec(&ctl, &args);
        r.unwrap();
        assert!(out.contains("disabled 3 channel(s) on 1 GPU(s)"), "{out}");
        assert!(ctl.driver().disabled().is_empty());

        let mut args = vec!["preempt".to_string(), "--detach".into()];
        args.extend(t.clone());
        let (r, out) = exec(&ctl, &args);
        r.unwrap();
        assert_eq!(ctl.driver().disabled().len(), 3);
        let undo = out
            .lines()
            .find(|l| l.trim_start().starts_with("valvectl resume"))
            .unwrap();
        // The printed command really undoes it.
        let undo_args: Vec<String> = undo.split_whitespace().skip(1).map(String::from).collect();
        let (r, _) = exec(&ctl, &undo_args);
        r.unwrap();
        assert!(ctl.driver().disabled().is_empty());
    }

    #[test]
    fn bad_handles_and_gpus_give_named_errors_and_exit_codes() {
        let (ctl, _) = host_with_process();
        let args: Vec<String> = [
            "preempt",
            "--gpu",
            "0",
            "--client",
            "c1d00042",
            "--channel",
            "5c0000ff",
            "--for",
            "1ms",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (r, _) = exec(&ctl, &args);
        let e = r.unwrap_err();
        assert_eq!(e.exit_code(), 5);
        assert!(e.to_string().contains("NV_ERR_INVALID_CHANNEL"), "{e}");
        assert!(ctl.driver().disabled().is_empty());

        let args: Vec<String> = ["preempt", "--gpu", "0", "--client", "c1d00042"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let e = exec(&ctl, &args).0.unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(
            e.to_string().contains("--gpu needs --client and --channel"),
            "{e}"
        );

        let args: Vec<String> = ["resume", "--gpu", "9", "--client", "1", "--channel", "2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let e = exec(&ctl, &args).0.unwrap_err();
        assert_eq!(e.exit_code(), 6);
        assert!(e.to_string().contains("no GPU matches '9'"));
    }

    #[test]
    fn gpus_json_and_bench_json() {
        let (ctl, t) = host_with_process();
        let (r, out) = exec(&ctl, &["--json".into(), "gpus".into()]);
        r.unwrap();
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["gpus"].as_array().unwrap().len(), 2);
        assert!(v["gpus"][0]["uuid"].as_str().unwrap().starts_with("GPU-"));

        let mut args = vec![
            "--json".to_string(),
            "bench".into(),
            "--cycles".into(),
            "4".into(),
            "--hold".into(),
            "0".into(),
            "--gap".into(),
            "0".into(),
        ];
        args.extend(t);
        let (r, out) = exec(&ctl, &args);
        r.unwrap();
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["cycles"], 4);
        assert_eq!(v["disable_wall"]["n"], 4);
        assert!(ctl.driver().disabled().is_empty());
    }
}
