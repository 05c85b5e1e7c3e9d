//! `valvectl`'s command line: the clap root ([`Cli`], global flags, exit-code text), the
//! [`Command`] enum of subcommands, and [`run`], which parses and dispatches to `commands::*`.

use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use valve::controller::Controller;
use valve::driver::RmDriver;
use valve::Signals;
use valve_daemon::protocol::DEFAULT_SOCKET;

use crate::args::Globals;
use crate::commands::bench::{self, BenchArgs};
use crate::commands::daemon::{self, DaemonArgs};
use crate::commands::demo::{self, DemoArgs};
use crate::commands::doctor::{self, DoctorArgs};
use crate::commands::driver::{self, DriverArgs};
use crate::commands::gate::{self, GateArgs};
use crate::commands::gpus::{self, GpusArgs};
use crate::commands::pool::{self, PoolArgs};
use crate::commands::preempt::{self, PreemptArgs};
use crate::commands::profile::{self, ProfileArgs};
use crate::commands::ps::{self, PsArgs};
use crate::commands::resume::{self, ResumeArgs};
use crate::commands::status::{self, StatusArgs};
use crate::commands::test_load::{self, TestLoadArgs};
use crate::commands::top::{self, TopArgs};
use crate::error::CliError;

const EXIT_CODES: &str = "\
Exit codes:
  0    success (for `preempt`, also when the hold ends by Ctrl-C/SIGTERM: channels were resumed)
  1    other failure (I/O, unexpected driver answer)
  2    usage error (bad arguments)
  3    NVIDIA driver missing, or not the open kernel module
  4    permission denied on the NVIDIA device files
  5    the driver rejected the request (e.g. unknown client or channel handle); nothing was left disabled
  6    no such GPU
  7    the Valve daemon is not running (for ps, status, --pid, resume --all, gate, profile)
  8    no such process, process has no GPU channels, or it started before the daemon
  9    BPF, the ioctl tracepoints or uprobes on libcuda are unavailable (daemon, gate start)
  10   the process is a CUDA MPS client or server: Valve cannot freeze its work (preempt, gate start)
  11   valvectl and the daemon speak different protocol versions: upgrade the older one
  12   preempt: RM reports a channel still enabled after the disable: NOT frozen (the rest resumed)
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
  valvectl gate status; valvectl gate stop
  valvectl profile                                       # what this node leaves to offline work
  valvectl top                                           # live view per GPU; q quits";

/// Valve: freeze and release other processes' GPU channels on NVIDIA GPUs.
#[derive(Debug, Parser)]
#[command(name = "valvectl", version, about, after_help = EXIT_CODES)]
pub struct Cli {
    /// Print machine-readable JSON on stdout instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// The daemon's socket (for ps, status, --pid, resume --all, daemon).
    #[arg(long, global = true, env = "VALVE_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the GPUs: index, name, PCI address, device-file minor, RM device instance, UUID.
    Gpus(GpusArgs),
    /// Disable (and preempt) channels of other processes, hold, then resume them.
    ///
    /// By default the channels stay frozen until Ctrl-C, SIGTERM or `--for` elapses, and are
    /// always resumed before valvectl exits. `--detach` leaves them frozen instead and prints the
    /// `valvectl resume` command that releases them.
    Preempt(PreemptArgs),
    /// Enable channels (undo `preempt --detach`, or clean up after a crash).
    Resume(ResumeArgs),
    /// Run the discovery daemon (root): watches CUDA processes' RM objects with eBPF and serves
    /// ps/preempt --pid/resume over a Unix socket. Everything it disabled is resumed on exit, and
    /// re-enabled from its state file if a previous run died.
    Daemon(Box<DaemonArgs>),
    /// List the GPU processes the daemon knows: GPUs, client, TSGs, channels, state.
    Ps(PsArgs),
    /// Check what this node supports: driver (open module?), GSP, device-file exposure, root,
    /// BPF, and (root) channel control on a self-started CUDA test load, including whether the
    /// driver serialises preemption across GPUs (stock) or not (patched).
    Doctor(DoctorArgs),
    /// (internal) The CUDA test load `doctor` starts.
    #[command(hide = true)]
    TestLoad(TestLoadArgs),
    /// The daemon's state: uptime, events seen, what is preempted.
    Status(StatusArgs),
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
    Gate(GateArgs),
    /// Preempt and resume in a loop and print p50/p99/max of each step.
    Bench(BenchArgs),
    /// The one-line driver patch that lets RM lock only the target GPU for the disable control
    /// (docs/driver-patch.md): apply, check, emit it; read a built module's flags.
    Driver(DriverArgs),
    /// The GPU memory pool served by `valvectl daemon --pool` (docs/memory.md).
    Pool(PoolArgs),
    /// The node harvest profile the daemon measures: per GPU, how much of each window offline
    /// could not run, the memory left to it, how in step the GPUs' online work is, and the
    /// offline jobs' progress (docs/cluster.md). `--json`: the document a scheduler reads.
    Profile(ProfileArgs),
    /// Live view per GPU: who runs and who is frozen, freezes per second, pool (`q` quits).
    ///
    /// Refreshed from the daemon: per GPU its online and offline processes, running or frozen,
    /// freezes and releases per second, the disable call's time, harvested and frozen offline
    /// time, pool handles per process and reclaims. `--once` prints one frame for scripts.
    Top(TopArgs),
    /// Watch the gate freeze and release an offline job on an in-memory GPU (no GPU needed).
    ///
    /// Runs the daemon's own code over a simulated GPU with a simulated online server and
    /// offline job, and prints what `valvectl top --once` shows as they run; ends by itself.
    Demo(DemoArgs),
}

impl Cli {
    /// The global flags, for the commands.
    pub fn globals(&self) -> Globals<'_> {
        Globals {
            json: self.json,
            socket: &self.socket,
        }
    }
}

/// Entry point of the binary: parses, runs, prints errors, returns the exit code.
pub fn run() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    // The daemon sets up its own log (text or JSON, from its flags and config file).
    if !matches!(cli.command, Command::Daemon(_)) {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(crate::commands::daemon::stderr_is_terminal())
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("VALVE_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .try_init();
    }
    let json = cli.json;
    let result = Signals::install()
        .map_err(CliError::from)
        .and_then(|signals| dispatch(&cli, &signals));
    match result {
        Ok(()) => 0,
        Err(e) => {
            let code = e.exit_code();
            if !matches!(e, CliError::Reported(_)) {
                eprintln!("valvectl: error: {e}");
            }
            if json {
                #[derive(serde::Serialize)]
                struct Failure {
                    error: String,
                    exit_code: i32,
                }
                let failure = Failure {
                    error: e.to_string(),
                    exit_code: code,
                };
                println!("{}", crate::print::json(&failure));
            }
            code
        }
    }
}

/// Runs one command: through the daemon, in this process, or against the driver.
fn dispatch(cli: &Cli, signals: &Signals) -> Result<(), CliError> {
    let out = &mut std::io::stdout().lock();
    let g = cli.globals();
    match &cli.command {
        Command::Daemon(a) => daemon::exec(a, g, signals),
        Command::Ps(a) => ps::exec(a, g, out),
        Command::Status(a) => status::exec(a, g, out),
        Command::Gate(a) => gate::exec(a, g, out),
        Command::TestLoad(a) => test_load::exec(a),
        Command::Doctor(a) => doctor::exec(a, g, out),
        Command::Driver(a) => driver::exec(a, out),
        Command::Pool(a) => pool::exec(a, g, out),
        Command::Profile(a) => profile::exec(a, g, out),
        Command::Top(a) => top::exec(a, g, out, signals),
        Command::Demo(a) => demo::exec(a, g, out, signals),
        Command::Preempt(a) if a.targets.pid.is_some() => preempt::exec_pid(a, g, out, signals),
        Command::Resume(a) if a.targets.pid.is_some() || a.all => resume::exec_daemon(a, g, out),
        Command::Gpus(_) | Command::Preempt(_) | Command::Resume(_) | Command::Bench(_) => {
            let ctl = Controller::open()?;
            execute(cli, &ctl, out, Some(signals))
        }
    }
}

/// Runs one parsed command against a controller (`gpus`, `preempt`, `resume`, `bench` by
/// handle); tests pass one over the fake RM.
pub fn execute<D: RmDriver>(
    cli: &Cli,
    ctl: &Controller<D>,
    out: &mut dyn Write,
    signals: Option<&Signals>,
) -> Result<(), CliError> {
    let g = cli.globals();
    match &cli.command {
        Command::Gpus(a) => gpus::exec(a, ctl, g, out),
        Command::Preempt(a) => preempt::exec(a, ctl, g, out, signals),
        Command::Resume(a) => resume::exec(a, ctl, g, out),
        Command::Bench(a) => bench::exec(a, ctl, g, out, signals),
        Command::Daemon(_)
        | Command::Ps(_)
        | Command::Status(_)
        | Command::Gate(_)
        | Command::Doctor(_)
        | Command::Driver(_)
        | Command::Pool(_)
        | Command::Profile(_)
        | Command::Top(_)
        | Command::Demo(_)
        | Command::TestLoad(_) => Err(CliError::Usage(
            "this command does not run against a controller".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use valve::fake::FakeRm;
    use valve_daemon::protocol::{GateSpec, Request};
    use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("valvectl").chain(args.iter().copied()))
    }

    /// The request `valvectl ARGS` sends for a `gate` subcommand.
    fn gate_request(args: &[&str]) -> Result<Request, CliError> {
        let cli = parse(args).unwrap();
        let Command::Gate(GateArgs { action }) = &cli.command else {
            panic!("{cli:?}")
        };
        gate::request(action)
    }

    /// The spec a `gate start` with ARGS sends.
    fn gate_spec(args: &[&str]) -> GateSpec {
        match gate_request(args).unwrap() {
            Request::GateStart(spec) => *spec,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn gate_start_needs_both_sides() {
        let request = gate_request;
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
    }

    #[test]
    fn gate_start_carries_its_tuning() {
        let spec = gate_spec(&[
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
            "--gap-memory",
            "90s",
        ]);
        assert_eq!(spec.online, vec![10, 11]);
        assert!(spec.offline.is_empty());
        assert_eq!(spec.offline_label.as_deref(), Some("batch"));
        assert_eq!(spec.fixed_cooldown_us, Some(0));
        assert_eq!(spec.cooldown_floor_us, Some(2_000));
        assert_eq!(spec.cooldown_ceiling_us, Some(200_000));
        assert_eq!(spec.gap_factor, Some(2.0));
        assert_eq!(spec.gap_memory_ms, Some(90_000));
        assert_eq!(
            spec.realtime_priority,
            Some(10),
            "SCHED_FIFO 10 unless told"
        );
        assert_eq!(spec.hold_budget_pct, None, "no hold unless told");
    }

    #[test]
    fn gate_start_takes_a_hold_budget_in_range() {
        // A hold budget, with or without the sign; not with a fixed cooldown, nor out of range.
        let hold = |pct: &str, extra: &[&str]| {
            let mut args = vec!["gate", "start", "--online", "10", "--offline", "5"];
            args.extend_from_slice(&["--hold-budget", pct]);
            args.extend_from_slice(extra);
            let cli = parse(&args).map_err(|e| e.to_string())?;
            let Command::Gate(GateArgs { action }) = &cli.command else {
                panic!()
            };
            match gate::request(action).map_err(|e| e.to_string())? {
                Request::GateStart(spec) => Ok::<_, String>(spec.hold_budget_pct),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(hold("10%", &[]), Ok(Some(10.0)));
        assert_eq!(hold("2.5", &[]), Ok(Some(2.5)));
        assert!(hold("60%", &[]).unwrap_err().contains("at most 50%"));
        assert!(hold("ten", &[]).unwrap_err().contains("not a percentage"));
        assert!(hold("10%", &["--fixed-cooldown", "5ms"])
            .unwrap_err()
            .contains("drop one"));
    }

    #[test]
    fn gate_start_by_port_and_the_other_gate_requests() {
        let request = gate_request;
        // The service by port, arrivals off, serial issue; the trace request.
        let spec = gate_spec(&[
            "gate",
            "start",
            "--online-port",
            "8000,8001",
            "--offline",
            "5",
            "--no-arrivals",
            "--no-waits",
            "--issue",
            "serial",
        ]);
        assert_eq!(spec.online_ports, vec![8000, 8001]);
        assert_eq!(spec.arrivals, Some(false));
        assert_eq!(spec.waits, Some(false));
        assert_eq!(spec.issue.as_deref(), Some("serial"));
        assert!(spec.online.is_empty());
        let zero = request(&["gate", "start", "--online-port", "0", "--offline", "5"]).unwrap_err();
        assert_eq!(zero.exit_code(), 2);
        assert!(parse(&[
            "gate",
            "start",
            "--online",
            "1",
            "--offline",
            "2",
            "--issue",
            "x"
        ])
        .is_err());
        assert_eq!(
            request(&["gate", "trace", "--after", "7"]).unwrap(),
            Request::GateTrace {
                after: 7,
                limit: None
            }
        );
        for (sub, req) in [
            ("stop", Request::GateStop),
            ("status", Request::GateStatus),
            ("busy", Request::OnlineBusy),
            ("idle", Request::OnlineIdle),
        ] {
            assert_eq!(request(&["gate", sub]).unwrap(), req);
        }
    }

    #[test]
    fn clap_rejects_incomplete_target_sets() {
        let incomplete = parse(&["preempt", "--gpu", "0", "--client", "c1"]).unwrap();
        let Command::Preempt(PreemptArgs { targets, .. }) = &incomplete.command else {
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

    /// The codes of the help's exit code list, in its order.
    fn listed_exit_codes() -> Vec<i32> {
        EXIT_CODES
            .lines()
            .skip_while(|l| !l.starts_with("Exit codes"))
            .skip(1)
            .take_while(|l| !l.trim().is_empty())
            .map(|l| {
                let code = l.split_whitespace().next().unwrap_or_default();
                code.parse()
                    .unwrap_or_else(|_| panic!("not an exit code line: {l:?}"))
            })
            .collect()
    }

    #[test]
    fn each_exit_code_is_listed_once_with_the_daemons_errors_among_them() {
        let codes = listed_exit_codes();
        let mut distinct = codes.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            codes.len(),
            "a code listed twice: {codes:?}"
        );
        use valve_daemon::protocol::ErrorCode;
        for kind in [
            ErrorCode::Rm,
            ErrorCode::NoSuchGpu,
            ErrorCode::NoDaemon,
            ErrorCode::Process,
            ErrorCode::Bpf,
            ErrorCode::MpsProcess,
            ErrorCode::VersionMismatch,
        ] {
            assert!(
                codes.contains(&kind.exit_code()),
                "{kind:?} ends with exit code {}, which the help does not list",
                kind.exit_code()
            );
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
