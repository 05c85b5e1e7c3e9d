//! `valve-sim` (also run as `valve-scheduler simulate`): a simulated week of a large GPU cluster,
//! once per policy, over the same online load and offline arrivals; prints the results and targets.

use std::process::ExitCode;

use clap::{Parser, ValueEnum};

use valve_sim::cluster::{alibaba_multi_gpu_share, OnlineConfig, Shape};
use valve_sim::run::{Costs, Policy, SimConfig};
use valve_sim::{drift, report, simulate};

/// Exit code of bad arguments.
const EXIT_USAGE: u8 = 2;
/// Exit code of a missed target under `--check`.
const EXIT_TARGET: u8 = 4;

const AFTER_HELP: &str = "\
Exit codes: 0 ok, 1 other failure, 2 bad arguments, 4 a target was missed (with --check).
VALVE_LOG (default info) filters the progress lines on stderr.
`valve-scheduler simulate ARGS` runs this program with the same arguments.";

const LONG_ABOUT: &str = "\
What is simulated:

Simulates N nodes of GPUs for D days in 1-minute steps, with a scheduling pass every 5 minutes,
once per policy over the SAME online load and the SAME offline job arrivals (fixed seeds).

Online: each node's GPUs are split into online services (1 GPU, or 2, 4 or 8 GPUs for a share of
the GPUs); a multi-GPU service runs out of step (its ranks replay the trace from different
offsets) with probability --out-of-step-share, else in step (one busy series). Each service
replays the Azure LLM inference trace 2023 (code or conversation) at a load that follows an
ASSUMED daily cycle (the week-long trace was not obtainable; only its hour is), calibrated so the
cluster's mean online busy fraction is about 0.3. Memory left to offline shrinks with each
minute's peak online busy second (online KV).

Offline: jobs of five profile classes (7B and 13B continuous batching, a fixed-memory training
job, 34B on 2 GPUs, 70B on 4 GPUs), SLAs 0.3-0.7, work from Alibaba v2023 best-effort pod
lifetimes, Poisson arrivals offering --offered-load x the GPU time online leaves idle.

Policies: online-only, idle-only (placement by idle fraction), random (first-fit, no SLA check),
static (a static memory split), valve (Valve's model), oracle (Valve's placement fed with the
next hour and each job's true level). All but random place through the scheduler's own pass
(cycle::plan); all evict through its monitor. Operator variants: `valve:margin=0.1`,
`valve:monitor=3600`, `valve:misses=2`, `valve:align=0.7`, `valve:hysteresis=0.1`,
`valve:calibrate=0`, `valve:jobcal=0`, `valve:pass=exact` (the placement pass: fast, the
default, exact or reference).

Ground truth differs from the model on purpose (the model sees past windows; the truth is each
minute, with preemption costs, a per-job profile error and reclaim losses). The results list
every assumption; docs/results/2026-11-25-cluster-sim.md shows a run. Exit 4 with --check if a
target is missed.";

/// Simulates a large cluster for a week, once per scheduling policy (`--preset small`: a quick
/// one), with valve-scheduler's own placement pass and SLA monitor.
#[derive(Parser, Debug)]
#[command(name = "valve-sim", version, after_help = AFTER_HELP, after_long_help = LONG_ABOUT)]
pub struct SimulateArgs {
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
    /// A ready-made size instead of --nodes and --days: `small` is 50 nodes for one day, every
    /// policy (the utilisation table in well under a minute on 2 cores).
    #[arg(long, value_enum, conflicts_with_all = ["nodes", "days"])]
    pub preset: Option<Preset>,
    /// Nodes.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Simulated days.
    #[arg(long, default_value_t = 7.0)]
    pub days: f64,
    /// GPUs per node: a number, or `alibaba` (shapes sampled from the Alibaba v2023 node list).
    #[arg(long, default_value = "8")]
    pub shape: String,
    /// Policies to run, comma-separated (each over the same load and arrivals).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "online-only,idle-only,random,static,valve,oracle"
    )]
    pub policies: Vec<String>,
    /// Seed of the online layout and load.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seed of the offline arrivals (default: --seed).
    #[arg(long)]
    pub offline_seed: Option<u64>,
    /// Share of GPUs in multi-GPU online services, or `alibaba` (the share of latency-sensitive
    /// GPUs in multi-GPU pods of the Alibaba v2023 trace).
    #[arg(long, default_value = "0.5")]
    pub online_multi_gpu_share: String,
    /// Share of multi-GPU online services whose ranks run out of step (the paper saw 32%).
    #[arg(long, default_value_t = 0.32)]
    pub out_of_step_share: f64,
    /// Share of offline jobs on 2 or 4 GPUs.
    #[arg(long, default_value_t = 0.3)]
    pub offline_multi_gpu_share: f64,
    /// Offline arrivals' GPU-seconds alone over the GPU time online leaves idle.
    #[arg(long, default_value_t = 1.0)]
    pub offered_load: f64,
    /// The cluster's mean online busy fraction the load is calibrated to.
    #[arg(long, default_value_t = 0.3)]
    pub online_busy: f64,
    /// Jobs each (class, SLA) stream keeps waiting at most; later arrivals are turned away.
    /// Default: 50 per 1,000 nodes, at least 50 (arrivals grow with the cluster, and so does
    /// the backlog that keeps every kind of job waiting; a fixed 50 turned 81% of a 10,000-node
    /// cluster's arrivals away, the oracle's included).
    #[arg(long)]
    pub max_pending_per_stream: Option<usize>,
    /// Worker threads (default: the machine's CPUs).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Offline work the ground truth loses per online idle-to-busy transition, in ms. The model
    /// knows it only with --profiled-costs. The second H100 check measured 0 beyond the time held
    /// for training and continuous batching (docs/results/2026-11-25-h100-cluster-predict-2.md).
    #[arg(long, default_value_t = 1.2)]
    pub preempt_cost_ms: f64,
    /// The jobs' profiles carry --preempt-cost-ms as their measured preemption cost (as
    /// `profile-job --preempt-every` would have measured it), so Valve's model subtracts it.
    #[arg(long)]
    pub profiled_costs: bool,
    /// Share of offline's running time the ground truth loses to the gate being there (the model
    /// has no term for it; an idle gate cost training 12% on an H100 before the gate's probes
    /// were limited to online processes, nothing after).
    #[arg(long, default_value_t = 0.0)]
    pub gate_overhead: f64,
    /// Log-sd of the nodes' true speeds: each node runs every job at a speed drawn once
    /// (lognormal, clamped to [0.5, 1.5], from --seed); 0 keeps every node at 1.0. H100s of one
    /// model ran the same job 26-30% apart (docs/results/2026-11-25-h100-cluster-predict-3.md).
    #[arg(long, default_value_t = 0.0)]
    pub node_speed_sd: f64,
    /// Standard deviation of each job's true throughput relative to its profile (normal, drawn
    /// once per job, clamped to [-0.9, 1.0]). Profiles of one continuous-batching job on H200s
    /// were 0.6-1.5% off in three processes and 13-17% in a fourth
    /// (docs/results/2026-11-26-h200-cluster-predict-6.md).
    #[arg(long, default_value_t = valve_sim::jobs::PROFILE_ERROR_SD)]
    pub profile_error_sd: f64,
    /// Stationary standard deviation of the drift of each running job's true level around its
    /// static level (the one --profile-error-sd sets): a continuous-batching job's own
    /// throughput moves over minutes. Each run's level is multiplied by 1 + d, d a stationary
    /// AR(1) process (drawn afresh at each placement, 1 + d clamped to [0.5, 1.5]) with
    /// correlation time --level-drift-minutes; no policy, the oracle included, knows it. On an
    /// H100 one job's uninterrupted rate moved 0.7%-13.4% (highest-lowest over mean) within one
    /// 4-5 minute profile, and two 80-s phases of one process minutes apart differed by 10%.
    /// 0 (the default) turns it off; at most 0.3.
    #[arg(long, default_value_t = 0.0)]
    pub level_drift_sd: f64,
    /// Correlation time of that drift, in minutes: d keeps exp(-1/T) of itself from one minute
    /// to the next, so it wanders over about T minutes (the H100's rate moved within minutes).
    /// In [1, 1440].
    #[arg(long, default_value_t = drift::DEFAULT_MINUTES)]
    pub level_drift_minutes: f64,
    /// Valve does not learn the nodes' speed factors from its running jobs (the oracle still
    /// knows them).
    #[arg(long)]
    pub no_calibration: bool,
    /// Exit 4 if a target is missed.
    #[arg(long)]
    pub check: bool,
}

/// A ready-made simulation size (see `--preset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// 50 nodes, one day.
    Small,
}

impl Preset {
    /// Its nodes and days.
    fn size(self) -> (usize, f64) {
        match self {
            Preset::Small => (50, 1.0),
        }
    }
}

/// A bad argument, with the message that names it and its exit code.
#[derive(Debug)]
struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// An error of bad arguments (exit code 2).
fn usage(msg: impl Into<String>) -> anyhow::Error {
    Usage(msg.into()).into()
}

/// Parses the command line, runs the simulation, maps errors to exit codes.
fn main() -> ExitCode {
    let args = SimulateArgs::parse();
    // Progress (a line per simulated day) goes to stderr, filtered by VALVE_LOG as the
    // scheduler's logs are; colour only on a terminal.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VALVE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match exec(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("valve-sim: {e:#}");
            ExitCode::from(if e.is::<Usage>() { EXIT_USAGE } else { 1 })
        }
    }
}

/// Runs the simulation and prints the results.
fn exec(a: &SimulateArgs) -> anyhow::Result<ExitCode> {
    let (cfg, source) = config(a)?;
    let command = std::env::args()
        .map(|s| if s.contains(' ') { format!("'{s}'") } else { s })
        .collect::<Vec<_>>()
        .join(" ");
    let results = simulate(&cfg, &command, &source);
    let text = serde_json::to_string_pretty(&results)?;
    if let Some(path) = &a.out {
        std::fs::write(path, &text)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    if a.json {
        println!("{text}");
    } else {
        print!("{}", report::render(&results));
    }
    let missed = results.targets.iter().any(|t| t.pass != Some(true));
    Ok(if a.check && missed {
        ExitCode::from(EXIT_TARGET)
    } else {
        ExitCode::SUCCESS
    })
}

/// The backlog cap per stream when none is given: 50 per 1,000 nodes, at least 50.
fn default_backlog(nodes: usize) -> usize {
    (50 * nodes).div_ceil(1000).max(50)
}

/// The flags checked and turned into a simulation (the preset, if any, sets nodes and days),
/// with where the online multi-GPU share came from (`given`, or the trace it was read from).
fn config(a: &SimulateArgs) -> anyhow::Result<(SimConfig, String)> {
    let (nodes, days) = a.preset.map_or((a.nodes, a.days), Preset::size);
    let shape: Shape = a.shape.parse().map_err(usage)?;
    let (multi, source) = match a.online_multi_gpu_share.as_str() {
        "alibaba" => alibaba_multi_gpu_share(),
        s => match s.parse::<f64>() {
            Ok(f) if (0.0..=1.0).contains(&f) => (f, "given".to_string()),
            _ => {
                return Err(usage(format!(
                    "--online-multi-gpu-share {s:?}: give a share in [0, 1] or `alibaba`"
                )))
            }
        },
    };
    check_ranges(a)?;
    let mut policies = a
        .policies
        .iter()
        .map(|p| Policy::parse(p, nodes))
        .collect::<Result<Vec<_>, _>>()
        .map_err(usage)?;
    if a.no_calibration {
        for p in &mut policies {
            p.params.calibration = false;
        }
    }
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let sim = SimConfig {
        online: OnlineConfig {
            nodes,
            shape,
            multi_gpu_share: multi,
            out_of_step_share: a.out_of_step_share,
            target_busy: a.online_busy,
            seed: a.seed,
        },
        minutes: (days * 1440.0).round().max(1.0) as u32,
        offline_multi_gpu_share: a.offline_multi_gpu_share,
        offered_load: a.offered_load,
        max_pending_per_stream: a
            .max_pending_per_stream
            .unwrap_or_else(|| default_backlog(nodes))
            .max(1),
        policies,
        threads: threads.max(1),
        seed: a.offline_seed.unwrap_or(a.seed),
        costs: Costs {
            preempt_s: a.preempt_cost_ms / 1000.0,
            gate_overhead: a.gate_overhead,
            profiled: a.profiled_costs,
        },
        node_speed_sd: a.node_speed_sd,
        profile_error_sd: a.profile_error_sd,
        level_drift_sd: a.level_drift_sd,
        level_drift_minutes: a.level_drift_minutes,
    };
    Ok((sim, source))
}

/// Refuses flag values out of range, each with a named error.
fn check_ranges(a: &SimulateArgs) -> anyhow::Result<()> {
    for (name, v) in [
        ("--out-of-step-share", a.out_of_step_share),
        ("--offline-multi-gpu-share", a.offline_multi_gpu_share),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(usage(format!("{name} {v}: give a share in [0, 1]")));
        }
    }
    if a.nodes == 0 || !(a.days > 0.0 && a.days <= 60.0) {
        return Err(usage("--nodes must be at least 1 and --days in (0, 60]"));
    }
    if !(a.offered_load >= 0.0 && a.offered_load <= 10.0) {
        return Err(usage("--offered-load must be in [0, 10]"));
    }
    if !(a.online_busy > 0.0 && a.online_busy < 1.0) {
        return Err(usage("--online-busy must be in (0, 1)"));
    }
    let costs_ok =
        (0.0..60_000.0).contains(&a.preempt_cost_ms) && (0.0..1.0).contains(&a.gate_overhead);
    if !costs_ok {
        return Err(usage(
            "--preempt-cost-ms must be in [0, 60000) and --gate-overhead in [0, 1)",
        ));
    }
    if !(0.0..=1.0).contains(&a.node_speed_sd) {
        return Err(usage(format!(
            "--node-speed-sd {}: give a log-sd in [0, 1] (0: every node at speed 1.0)",
            a.node_speed_sd
        )));
    }
    if !(0.0..=0.5).contains(&a.profile_error_sd) {
        return Err(usage(format!(
            "--profile-error-sd {}: give a standard deviation in [0, 0.5] (0: every profile exact)",
            a.profile_error_sd
        )));
    }
    drift::check(a.level_drift_sd, a.level_drift_minutes).map_err(usage)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{check_ranges, config, Preset, SimulateArgs};
    use valve_sim::{report, simulate};

    /// `check_ranges`'s message for `simulate` with `flags`, or `None` if they pass.
    fn refusal(flags: &[&str]) -> Option<String> {
        let cli =
            SimulateArgs::try_parse_from(std::iter::once("simulate").chain(flags.iter().copied()))
                .expect("flags parse");
        check_ranges(&cli).err().map(|e| e.to_string())
    }

    #[test]
    fn the_backlog_grows_with_the_cluster_unless_given() {
        let cap = |flags: &[&str]| {
            let cli = SimulateArgs::try_parse_from(
                std::iter::once("simulate").chain(flags.iter().copied()),
            )
            .expect("flags parse");
            config(&cli)
                .expect("a valid simulation")
                .0
                .max_pending_per_stream
        };
        assert_eq!(cap(&["--nodes", "100"]), 50);
        assert_eq!(cap(&["--nodes", "1000"]), 50);
        assert_eq!(cap(&["--nodes", "10000"]), 500);
        assert_eq!(
            cap(&["--nodes", "10000", "--max-pending-per-stream", "50"]),
            50
        );
    }

    #[test]
    fn the_small_preset_prints_the_utilisation_table_of_every_policy() {
        let cli = SimulateArgs::try_parse_from(["simulate", "--preset", "small"]).unwrap();
        assert_eq!(cli.preset, Some(Preset::Small));
        let (mut cfg, source) = config(&cli).unwrap();
        assert_eq!(cfg.online.nodes, 50);
        assert_eq!(cfg.minutes, 1440);
        assert!(
            SimulateArgs::try_parse_from(["simulate", "--preset", "small", "--nodes", "3"])
                .is_err()
        );
        // The same run, smaller, so that a debug build finishes it in seconds.
        cfg.online.nodes = 3;
        cfg.minutes = 60;
        let r = simulate(&cfg, "test", &source);
        let table = report::render(&r);
        assert!(table.contains("| policy | online busy |"), "{table}");
        for p in [
            "online-only",
            "idle-only",
            "random",
            "static",
            "valve",
            "oracle",
        ] {
            assert!(table.contains(&format!("| {p} |")), "{p}: {table}");
        }
    }

    #[test]
    fn level_drift_is_off_by_default_and_refused_out_of_range() {
        let cli = SimulateArgs::try_parse_from(["simulate"]).unwrap();
        assert_eq!(cli.level_drift_sd, 0.0);
        assert_eq!(cli.level_drift_minutes, 10.0);
        assert_eq!(refusal(&[]), None);
        assert_eq!(
            refusal(&["--level-drift-sd", "0.05", "--level-drift-minutes", "30"]),
            None
        );
        let e = refusal(&["--level-drift-sd", "0.4"]).expect("refused");
        assert!(
            e.contains("--level-drift-sd 0.4") && e.contains("[0, 0.3]"),
            "{e}"
        );
        let e = refusal(&["--level-drift-sd=-0.1"]).expect("refused");
        assert!(e.contains("--level-drift-sd -0.1"), "{e}");
        let e = refusal(&["--level-drift-minutes", "0.5"]).expect("refused");
        assert!(
            e.contains("--level-drift-minutes 0.5") && e.contains("[1, 1440]"),
            "{e}"
        );
        assert!(refusal(&["--level-drift-minutes", "2000"]).is_some());
    }
}
