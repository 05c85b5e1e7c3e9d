//! Arguments several subcommands share: how to reach Slurm and the node agents, and the model's,
//! placement's and monitor's settings (turned into [`Params`]).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::error::usage;
use valve_scheduler::agents::{parse_agents_file, Agents, DEFAULT_URL};
use valve_scheduler::cycle::Params;
use valve_scheduler::job::JobProfile;
use valve_scheduler::meta::ClassedProfile;
use valve_scheduler::monitor::MonitorParams;
use valve_scheduler::place::PlaceParams;
use valve_scheduler::predict::ModelParams;
use valve_scheduler::slurm::Slurm;

/// A duration such as `10s`, `500ms`, `2m`.
pub fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("'{s}' is not a duration (e.g. 10s, 500ms, 2m): {e}"))
}

/// Where Slurm and the node agents are.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Slurm's configuration (sets SLURM_CONF for every Slurm command; default: the environment's).
    #[arg(long, env = "SLURM_CONF")]
    pub slurm_conf: Option<PathBuf>,
    /// Directory of the Slurm programs (default: PATH).
    #[arg(long)]
    pub slurm_bin: Option<PathBuf>,
    /// Where each node's harvest document is; `{node}` becomes the node's name. The Valve daemon
    /// serves it on its metrics address (`valvectl daemon --metrics-addr 0.0.0.0:9401`).
    #[arg(long, default_value = DEFAULT_URL)]
    pub agent_url: String,
    /// A file of `NODE URL` lines for nodes whose agent is elsewhere than --agent-url says.
    #[arg(long)]
    pub agents: Option<PathBuf>,
    /// How long one agent may take to answer.
    #[arg(long, default_value = "2s", value_parser = duration)]
    pub agent_timeout: Duration,
}

impl EngineArgs {
    /// The Slurm CLIs.
    pub fn slurm(&self) -> Slurm {
        Slurm {
            conf: self.slurm_conf.clone(),
            bin_dir: self.slurm_bin.clone(),
        }
    }

    /// The node agents.
    pub fn agents(&self) -> anyhow::Result<Agents> {
        let overrides = match &self.agents {
            None => Default::default(),
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| usage(format!("cannot read --agents {}: {e}", p.display())))?;
                parse_agents_file(&text)
                    .map_err(|e| usage(format!("--agents {}: {e}", p.display())))?
            }
        };
        if !self.agent_url.contains("{node}") && overrides.is_empty() {
            return Err(usage(format!(
                "--agent-url {:?} has no {{node}}: every node would be asked the same address",
                self.agent_url
            )));
        }
        Ok(Agents::new(&self.agent_url, overrides, self.agent_timeout))
    }
}

/// The model's, placement's and monitor's settings.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Place a job only where its predicted share of alone is at least SLA + MARGIN.
    #[arg(long, default_value_t = 0.05)]
    pub margin: f64,
    /// A multi-GPU job needs every pair of its GPUs to score at least this (overlap over union
    /// of online busy time).
    #[arg(long, default_value_t = 0.8)]
    pub align_threshold: f64,
    /// The trailing window of the nodes' documents the model reads (the longest one at most this
    /// long that is at least half measured).
    #[arg(long, default_value = "1h", value_parser = duration)]
    pub model_window: Duration,
    /// The window a running job's throughput is judged over (one of the agents' rate windows).
    #[arg(long, default_value = "10m", value_parser = duration)]
    pub monitor_window: Duration,
    /// Windows missed in a row before a job is evicted (with 3, jobs hovering just under their
    /// SLA ran for hours in the simulation: docs/results/2026-11-25-cluster-sim.md).
    #[arg(long, default_value_t = 2)]
    pub misses: u32,
    /// A window at SLA + HYSTERESIS or above ends a miss streak.
    #[arg(long, default_value_t = 0.05)]
    pub hysteresis: f64,
    /// Evictions allowed in any minute.
    #[arg(long, default_value_t = 10)]
    pub max_evictions_per_min: u32,
    /// A node whose agent has not answered for this long gets no new jobs.
    #[arg(long, default_value = "60s", value_parser = duration)]
    pub node_timeout: Duration,
    /// A profile assumed for jobs submitted without one (without it such jobs are refused). Pick
    /// a conservative one: a low throughput alone and a steep memory curve.
    #[arg(long)]
    pub default_profile: Option<PathBuf>,
    /// Do not learn each node's speed factor from its running jobs: every node is predicted at
    /// its jobs' profiled T_alone. By default a node's factor is the median of measured over
    /// predicted throughput of its last 45 judged windows, over the median node's, used after 3
    /// windows, within [0.5, 1.5] (docs/cluster.md, "The model").
    #[arg(long)]
    pub no_calibration: bool,
    /// Do not learn each job's level: by default a job whose judged windows ran at 0.9 or less of
    /// what the model predicted (with its node's speed; the median of its last 15, after 3) is
    /// placed again at that level, so that a profile measured too high costs one eviction, not
    /// one per placement (docs/cluster.md, "The model").
    #[arg(long)]
    pub no_job_calibration: bool,
}

impl ModelArgs {
    /// The scheduler's parameters, checked.
    pub fn params(&self) -> anyhow::Result<Params> {
        for (name, v) in [("--margin", self.margin), ("--hysteresis", self.hysteresis)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(usage(format!("{name} {v} must be in [0, 1]")));
            }
        }
        if !(0.0..=1.0).contains(&self.align_threshold) {
            return Err(usage("--align-threshold must be in [0, 1]"));
        }
        if self.misses == 0 {
            return Err(usage("--misses must be at least 1"));
        }
        let secs = |d: Duration, name: &str| -> anyhow::Result<u32> {
            let s = d.as_secs();
            if s == 0 || s > u64::from(u32::MAX) {
                return Err(usage(format!("{name} must be at least 1s")));
            }
            Ok(s as u32)
        };
        let default_profile = match &self.default_profile {
            None => None,
            Some(p) => Some(ClassedProfile::new(read_profile(p)?)),
        };
        Ok(Params {
            place: PlaceParams {
                model: ModelParams {
                    window_s: secs(self.model_window, "--model-window")?,
                    align_threshold: self.align_threshold,
                    ..ModelParams::default()
                },
                margin: self.margin,
                ..PlaceParams::default()
            },
            monitor: MonitorParams {
                window_s: secs(self.monitor_window, "--monitor-window")?,
                misses_to_evict: self.misses,
                hysteresis: self.hysteresis,
                max_evictions_per_min: self.max_evictions_per_min,
                ..MonitorParams::default()
            },
            node_timeout_ms: self.node_timeout.as_millis() as u64,
            default_profile,
            calibration: !self.no_calibration,
            job_calibration: !self.no_job_calibration,
            ..Params::default()
        })
    }
}

/// Reads and validates a job profile file.
pub fn read_profile(path: &std::path::Path) -> anyhow::Result<JobProfile> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| usage(format!("cannot read profile {}: {e}", path.display())))?;
    JobProfile::from_json(&text).map_err(|e| usage(format!("{}: {e}", path.display())))
}
