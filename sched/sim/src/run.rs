//! The simulation loop: minute by minute, every policy over the same online load and the same
//! offline arrivals; every [`PASS_EVERY_MIN`] minutes a scheduling pass through
//! [`valve_scheduler::cycle::plan`] (the code the Slurm adapter runs), whose placements and
//! evictions the simulated cluster then carries out.
//!
//! Ground truth per running job and minute (what the model does not see): the time all its GPUs
//! are idle (a product over its independent busy series), the worst of its GPUs' T(m)/T_alone at
//! this minute's memory, a preemption cost per online idle-to-busy transition, a per-job profile
//! error (optionally drifting over each run's minutes, [`super::drift`]), and reclaim losses
//! where memory falls below what the job held the minute before.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;
use valve_harvest::{JobProgress, NodeHarvest, Rate};
use valve_scheduler::bench::thread_cpu_ms;

use super::cluster::{Cell, Cluster, OnlineConfig};
use super::counts::{Metrics, SpeedCheck};
use super::docs::{Dir, Ring, Templates};
use super::drift::{self, LevelDrift};
use super::jobs::{self, Arrival, Class};
use valve_scheduler::cycle::{self, JobInfo, NodeInfo, Params, Phase, Report, Snapshot};
use valve_scheduler::meta::{JobMeta, PlacedOn};
use valve_scheduler::monitor::{Action, MonitorParams};
use valve_scheduler::place::Outcome;
use valve_scheduler::predict::{MemoryModel, ModelParams};

/// Simulated minutes between scheduling passes.
pub const PASS_EVERY_MIN: u32 = 5;
/// Minutes of progress an evicted or killed job loses (since its last checkpoint).
pub const ROLLBACK_MIN: u32 = 10;
/// Offline time lost per online idle-to-busy transition (the gate's preemption).
pub const PREEMPT_COST_S: f64 = 1.2e-3;

/// What preemption costs an offline job in the ground truth, beyond the time it is frozen.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Costs {
    /// Offline work lost per online idle-to-busy transition (s).
    pub preempt_s: f64,
    /// Share of offline's running time lost to the gate being there at all.
    pub gate_overhead: f64,
    /// Whether the jobs' profiles carry `preempt_s` as their measured `costs.preemption_s`
    /// (`profile-job --preempt-every` measured it), so the model's interruption term knows it.
    pub profiled: bool,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            preempt_s: PREEMPT_COST_S,
            gate_overhead: 0.0,
            profiled: false,
        }
    }
}
/// Unix time of simulated minute 0 (a Monday 00:00 in the simulated week).
pub const EPOCH_MS: u64 = 1_700_000_000_000;

/// What a policy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// No offline jobs.
    OnlineOnly,
    /// Placement by idle fraction alone (memory ignored, no alignment).
    IdleOnly,
    /// Random first-fit, no SLA check.
    Random,
    /// A static memory split: the least memory of the past hour, fixed.
    Static,
    /// Valve's model.
    Valve,
    /// Valve's placement fed with the next hour's documents.
    Oracle,
}

impl PolicyKind {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::OnlineOnly => "online-only",
            PolicyKind::IdleOnly => "idle-only",
            PolicyKind::Random => "random",
            PolicyKind::Static => "static",
            PolicyKind::Valve => "valve",
            PolicyKind::Oracle => "oracle",
        }
    }

    /// All of them, in the order the results list them.
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::OnlineOnly,
        PolicyKind::IdleOnly,
        PolicyKind::Random,
        PolicyKind::Static,
        PolicyKind::Valve,
        PolicyKind::Oracle,
    ];
}

/// A policy with its scheduler settings.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Its name (the kind, plus any operator settings: `valve:margin=0.1`).
    pub name: String,
    /// What it is.
    pub kind: PolicyKind,
    /// The scheduler's settings it runs `cycle::plan` with.
    pub params: Params,
}

/// A policy's settings as reported.
#[derive(Clone, Debug, Serialize)]
pub struct PolicySettings {
    /// The placement pass (`fast`, `exact` or `reference`).
    pub pass: &'static str,
    /// Placement margin over the SLA.
    pub margin: f64,
    /// How memory enters the prediction.
    pub memory: MemoryModel,
    /// Whether alignment admission is on.
    pub alignment: bool,
    /// Alignment threshold.
    pub align_threshold: f64,
    /// The model's window (s).
    pub model_window_s: u32,
    /// The monitor's settings.
    pub monitor: MonitorParams,
    /// Whether nodes' speed factors are learned (Valve's calibration).
    pub calibration: bool,
    /// Whether jobs' levels are learned and place requeued jobs (Valve's; `jobcal=0` turns it
    /// off).
    pub job_calibration: bool,
}

impl Policy {
    /// Parses `kind[:key=value...]` (keys: `margin`, `monitor` (window s), `misses`, `align`,
    /// `window` (model window s), `hysteresis`, `calibrate` (0: off), `jobcal` (0: jobs'
    /// levels not learned)) for a cluster of `nodes` nodes.
    pub fn parse(spec: &str, nodes: usize) -> Result<Policy, String> {
        let mut parts = spec.split(':');
        let kind_name = parts.next().unwrap_or_default().trim();
        let kind = PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == kind_name)
            .ok_or_else(|| {
                format!(
                    "unknown policy {kind_name:?}: use {}",
                    PolicyKind::ALL.map(|k| k.name()).join(", ")
                )
            })?;
        let mut params = base_params(kind, nodes);
        for opt in parts {
            let (k, v) = opt
                .split_once('=')
                .ok_or_else(|| format!("policy option {opt:?}: use key=value"))?;
            if k == "pass" {
                params.place.pass = valve_scheduler::place::PassKind::parse(v)?;
                continue;
            }
            let num: f64 = v
                .parse()
                .map_err(|_| format!("policy option {k}={v:?}: not a number"))?;
            match k {
                "margin" => params.place.margin = num,
                "monitor" => params.monitor.window_s = num as u32,
                "misses" => params.monitor.misses_to_evict = num as u32,
                "align" => params.place.model.align_threshold = num,
                "window" => params.place.model.window_s = num as u32,
                "hysteresis" => params.monitor.hysteresis = num,
                "calibrate" => params.calibration = num != 0.0,
                "jobcal" => params.job_calibration = num != 0.0,
                _ => {
                    return Err(format!(
                    "policy option {k:?}: use margin, monitor, misses, align, window, hysteresis, calibrate, jobcal or pass"
                ))
                }
            }
        }
        if ![60, 600, 3600].contains(&params.monitor.window_s) {
            return Err(format!(
                "policy {spec}: the monitor window must be one the nodes report: 60, 600 or 3600 s"
            ));
        }
        Ok(Policy {
            name: spec.trim().to_string(),
            kind,
            params,
        })
    }

    /// Its settings.
    pub fn settings(&self) -> PolicySettings {
        let p = &self.params;
        PolicySettings {
            pass: p.place.pass.name(),
            margin: p.place.margin,
            memory: p.place.model.memory,
            alignment: p.place.model.alignment,
            align_threshold: p.place.model.align_threshold,
            model_window_s: p.place.model.window_s,
            monitor: p.monitor,
            calibration: p.calibration,
            job_calibration: p.job_calibration,
        }
    }
}

/// The scheduler settings of each kind: Valve's defaults, with the monitor every policy shares
/// (the default 600 s window and 2 misses to evict, at most one eviction per 10 nodes a minute).
/// Only Valve learns nodes' speeds; the oracle is told them ([`PolicySim`]), the baselines
/// neither.
pub fn base_params(kind: PolicyKind, nodes: usize) -> Params {
    let mut p = Params {
        monitor: MonitorParams {
            max_evictions_per_min: (nodes / 10).max(1) as u32,
            ..MonitorParams::default()
        },
        calibration: kind == PolicyKind::Valve,
        job_calibration: kind == PolicyKind::Valve,
        ..Params::default()
    };
    match kind {
        PolicyKind::IdleOnly => {
            p.place.model = ModelParams {
                memory: MemoryModel::Ignore,
                alignment: false,
                interruptions: false,
                ..ModelParams::default()
            }
        }
        PolicyKind::Static => p.place.model.memory = MemoryModel::StaticMin,
        _ => {}
    }
    p
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The online side.
    pub online: OnlineConfig,
    /// Simulated minutes.
    pub minutes: u32,
    /// Share of offline jobs on 2 or 4 GPUs.
    pub offline_multi_gpu_share: f64,
    /// Offline arrivals' GPU-seconds alone over the GPU time online leaves idle.
    pub offered_load: f64,
    /// Jobs each (class, SLA) stream keeps waiting at most; later arrivals are turned away.
    pub max_pending_per_stream: usize,
    /// The policies, each run over the same load and arrivals.
    pub policies: Vec<Policy>,
    /// Worker threads.
    pub threads: usize,
    /// Seed of the offline arrivals and the random policy.
    pub seed: u64,
    /// What preemption costs offline in the ground truth (the model does not know it).
    pub costs: Costs,
    /// Log-sd of the nodes' true speeds (0: every node at speed 1.0).
    pub node_speed_sd: f64,
    /// Standard deviation of each job's true throughput relative to its profile.
    pub profile_error_sd: f64,
    /// Stationary sd of the drift of each run's level around its static level (0: none).
    pub level_drift_sd: f64,
    /// The drift's correlation time (minutes).
    pub level_drift_minutes: f64,
}

impl SimConfig {
    /// A small configuration for tests: `nodes` nodes of 8 GPUs for `minutes`.
    pub fn small(nodes: usize, minutes: u32, policies: &[&str]) -> SimConfig {
        SimConfig {
            online: OnlineConfig {
                nodes,
                ..OnlineConfig::default()
            },
            minutes,
            offline_multi_gpu_share: 0.3,
            offered_load: 1.0,
            max_pending_per_stream: 20,
            policies: policies
                .iter()
                .map(|p| Policy::parse(p, nodes).expect("valid policy"))
                .collect(),
            threads: 2,
            seed: 1,
            costs: Costs::default(),
            node_speed_sd: 0.0,
            profile_error_sd: super::jobs::PROFILE_ERROR_SD,
            level_drift_sd: 0.0,
            level_drift_minutes: drift::DEFAULT_MINUTES,
        }
    }
}

/// The world every policy shares.
pub struct World {
    /// The online side.
    pub cluster: Cluster,
    /// The offline profile classes.
    pub classes: Vec<Class>,
    /// The offline arrivals.
    pub arrivals: Vec<Arrival>,
    /// Simulated minutes.
    pub minutes: u32,
    node_index: HashMap<String, u32>,
    max_pending_per_stream: usize,
    /// The ground truth's preemption costs.
    pub costs: Costs,
    /// Each node's true speed (see [`super::cluster::node_speeds`]); all 1.0 by default.
    pub node_speed: Vec<f64>,
    /// The drift of each run's level ([`LevelDrift::OFF`] by default).
    pub level_drift: LevelDrift,
    /// The seed each run's drift generator is derived from ([`LevelDrift::rng`]).
    pub drift_seed: u64,
}

impl World {
    /// The world of `cluster` with `arrivals`.
    pub fn new(
        cluster: Cluster,
        classes: Vec<Class>,
        arrivals: Vec<Arrival>,
        minutes: u32,
        max_pending_per_stream: usize,
    ) -> World {
        let cluster_nodes = cluster.nodes.len();
        let node_index = cluster
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i as u32))
            .collect();
        World {
            cluster,
            classes,
            arrivals,
            minutes,
            node_index,
            max_pending_per_stream,
            costs: Costs::default(),
            node_speed: vec![1.0; cluster_nodes],
            level_drift: LevelDrift::OFF,
            drift_seed: 0,
        }
    }

    /// The same world with each run's level drifting as `drift`, its generators derived from
    /// `seed`.
    pub fn with_level_drift(mut self, drift: LevelDrift, seed: u64) -> World {
        self.level_drift = drift;
        self.drift_seed = seed;
        self
    }

    /// The same world with each node's true speed drawn with log-sd `sd` from `seed`.
    pub fn with_node_speeds(mut self, sd: f64, seed: u64) -> World {
        self.node_speed = super::cluster::node_speeds(self.cluster.nodes.len(), sd, seed);
        self
    }

    /// The same world with the ground truth's preemption costs `costs` (and, if they were
    /// profiled, in every class's profile).
    pub fn with_costs(mut self, costs: Costs) -> World {
        self.costs = costs;
        if costs.profiled {
            for c in &mut self.classes {
                std::sync::Arc::make_mut(&mut c.profile.profile)
                    .costs
                    .preemption_s = costs.preempt_s;
            }
        }
        self
    }
}

/// One offline job in one policy's run.
struct Job {
    arrival: u32,
    progress_s: f64,
    first_start: Option<u32>,
    /// Its position in the snapshot.
    snap: Option<usize>,
    pending: bool,
    /// Nodes it was evicted from.
    avoid: Vec<u32>,
    run: Option<Run>,
}

/// One run of a job on a GPU set.
struct Run {
    node: u32,
    gpus: Vec<u32>,
    /// Distinct busy series of its GPUs.
    series: Vec<u32>,
    /// Its first minute.
    start: u32,
    minutes: u32,
    predicted: Option<f64>,
    /// Memory held per series the minute before (GiB; NaN before the first minute).
    held: Vec<f32>,
    /// Static split: memory per series, fixed at placement.
    alloc: Option<Vec<f32>>,
    /// Shares of the last 60 minutes, by minute of the run modulo 60.
    recent: [f32; 60],
    hour_sum: f64,
    out_of_step: bool,
    /// Its level's drift this minute (`d`: the level is x (1 + d); 0 without drift).
    drift: f64,
    /// Its own generator of the drift ([`LevelDrift::rng`]).
    drift_rng: fastrand::Rng,
}

impl Run {
    /// The ground truth of this run's next minute for a job of `class` whose static error is
    /// `error`, with the minute's cells `col`, in world `w`: its drift moves first.
    fn minute(
        &mut self,
        w: &World,
        class: &Class,
        error: f64,
        col: &[Cell],
    ) -> (Minute, [Cell; 8]) {
        self.drift = w.level_drift.step(self.drift, &mut self.drift_rng);
        let mut cells = [Cell::default(); 8];
        for (c, &s) in cells.iter_mut().zip(&self.series) {
            *c = col[s as usize];
        }
        let n = self.series.len();
        let mt = truth(
            class,
            &cells[..n],
            &mut self.held,
            self.alloc.as_deref(),
            drift::with_drift(error, self.drift),
            &w.costs,
        )
        .at_speed(w.node_speed[self.node as usize]);
        (mt, cells)
    }
}

/// One minute of a running job, as it truly went.
#[derive(Clone, Copy, Debug, PartialEq)]
#[must_use]
pub struct Minute {
    /// Throughput as a share of alone.
    pub share: f64,
    /// Share of the minute all its GPUs were idle.
    pub all_idle: f64,
    /// Whether its memory let it run at all.
    pub runs: bool,
    /// Whether online took memory a static split had given it (the job dies).
    pub killed: bool,
}

impl Minute {
    /// The same minute on a node of true speed `speed` (its jobs run that much faster than their
    /// profiles say; 1.0 leaves the minute exactly as it was).
    pub fn at_speed(self, speed: f64) -> Minute {
        Minute {
            share: self.share * speed,
            ..self
        }
    }
}

/// The ground truth of one minute for a job of `class` on GPUs whose distinct series have
/// `cells`; `held` is the memory it held per series the minute before (NaN at its start) and is
/// updated; `alloc` is a static split's fixed memory per series. The node's speed multiplies it
/// ([`Minute::at_speed`]).
pub fn truth(
    class: &Class,
    cells: &[Cell],
    held: &mut [f32],
    alloc: Option<&[f32]>,
    error: f64,
    costs: &Costs,
) -> Minute {
    let r = class.required_gib as f32;
    let penalty = class.profile.profile.deficit_penalty;
    let (mut idle, mut transitions, mut mem, mut loss) = (1.0f64, 0.0f64, 1.0f64, 0.0f64);
    let mut killed = false;
    for (i, c) in cells.iter().enumerate() {
        idle *= 1.0 - f64::from(c.b);
        transitions += f64::from(c.tr);
        match alloc {
            Some(a) => {
                killed |= c.m < a[i];
                mem = mem.min(class.share(a[i]));
            }
            None => {
                mem = mem.min(class.share(c.m));
                let h = held[i];
                if !h.is_nan() && c.m < h {
                    loss = loss.max(penalty * f64::from(h - c.m) / f64::from(r.max(1e-3)));
                }
                held[i] = c.m.min(r);
            }
        }
    }
    if killed {
        return Minute {
            share: 0.0,
            all_idle: idle,
            runs: false,
            killed: true,
        };
    }
    let overhead = (costs.preempt_s * transitions / 60.0).min(1.0);
    let share = (idle
        * mem
        * (1.0 - overhead)
        * (1.0 - costs.gate_overhead)
        * (1.0 + error)
        * (1.0 - loss.min(1.0)))
    .clamp(0.0, 1.0);
    Minute {
        share,
        all_idle: idle,
        runs: mem > 0.0,
        killed: false,
    }
}

/// One policy's simulation.
struct PolicySim<'w> {
    w: &'w World,
    policy: Policy,
    next_arrival: usize,
    jobs: Vec<Option<Job>>,
    free_slots: Vec<u32>,
    by_arrival: HashMap<u32, u32>,
    pending: Vec<u32>,
    running: Vec<u32>,
    /// Per GPU: the job slot holding it, or `u32::MAX`.
    owner: Vec<u32>,
    snap: Snapshot,
    /// Per snapshot entry: its job slot.
    snap_owner: Vec<u32>,
    reports: HashMap<String, Report>,
    monitor: valve_scheduler::monitor::Monitor,
    stream_pending: Vec<usize>,
    rng: fastrand::Rng,
    m: Metrics,
}

const NONE: u32 = u32::MAX;

impl<'w> PolicySim<'w> {
    fn new(w: &'w World, mut policy: Policy, seed: u64) -> Self {
        if policy.kind == PolicyKind::Oracle && w.node_speed.iter().any(|&s| s != 1.0) {
            // The oracle knows each node's true speed, as it knows the next hour.
            policy.params.known_speeds = w
                .cluster
                .nodes
                .iter()
                .zip(&w.node_speed)
                .map(|(n, &s)| (n.name.clone(), s))
                .collect();
        }
        let snap = Snapshot {
            nodes: w
                .cluster
                .nodes
                .iter()
                .map(|n| NodeInfo {
                    name: n.name.clone(),
                    closed: None,
                })
                .collect(),
            jobs: Vec::new(),
        };
        let classes = w.classes.len();
        PolicySim {
            w,
            m: Metrics::new(classes),
            policy,
            next_arrival: 0,
            jobs: Vec::new(),
            free_slots: Vec::new(),
            by_arrival: HashMap::new(),
            pending: Vec::new(),
            running: Vec::new(),
            owner: vec![NONE; w.cluster.gpus.len()],
            snap,
            snap_owner: Vec::new(),
            reports: HashMap::new(),
            monitor: valve_scheduler::monitor::Monitor::default(),
            stream_pending: vec![0; classes * jobs::SLAS.len()],
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    fn job(&self, slot: u32) -> &Job {
        self.jobs[slot as usize].as_ref().expect("live job")
    }

    fn job_mut(&mut self, slot: u32) -> &mut Job {
        self.jobs[slot as usize].as_mut().expect("live job")
    }

    fn arrival(&self, slot: u32) -> &'w Arrival {
        &self.w.arrivals[self.job(slot).arrival as usize]
    }

    fn class(&self, slot: u32) -> &'w Class {
        &self.w.classes[usize::from(self.arrival(slot).class)]
    }

    /// Whether pending jobs go in the snapshot (all but random, which places them itself).
    fn pending_in_snapshot(&self) -> bool {
        self.policy.kind != PolicyKind::Random
    }

    fn snap_insert(&mut self, slot: u32, phase: Phase, placed: Option<PlacedOn>) {
        let a = *self.arrival(slot);
        let class = self.class(slot);
        // The oracle knows each job's true level, as it knows the hour to come; to 0.01, so that
        // jobs of one class share a few profiles and the pass's per-profile caches still work.
        // Only the static level: a run's drift (`--level-drift-sd`, [`super::drift`]) is
        // unpredictable noise that no policy, the oracle included, is told.
        let level = ((1.0 + a.error) * 100.0).round() / 100.0;
        let profile = if self.policy.kind == PolicyKind::Oracle && level != 1.0 {
            class.profile.profile.at_level(level)
        } else {
            (*class.profile.profile).clone()
        };
        let info = JobInfo {
            id: a_id(self.job(slot).arrival),
            phase,
            meta: Ok(JobMeta {
                sla: a.sla(),
                profile: Some(profile),
                placed,
                avoid: Vec::new(),
                evictions: 0,
            }),
            order: u64::from(self.job(slot).arrival),
        };
        self.snap.jobs.push(info);
        self.snap_owner.push(slot);
        let pos = self.snap.jobs.len() - 1;
        self.job_mut(slot).snap = Some(pos);
    }

    fn snap_remove(&mut self, slot: u32) {
        let Some(pos) = self.job_mut(slot).snap.take() else {
            return;
        };
        self.snap.jobs.swap_remove(pos);
        self.snap_owner.swap_remove(pos);
        if pos < self.snap_owner.len() {
            let moved = self.snap_owner[pos];
            self.job_mut(moved).snap = Some(pos);
        }
    }

    fn snap_meta(&mut self, slot: u32) -> Option<(&mut Phase, &mut JobMeta)> {
        let pos = self.job(slot).snap?;
        let info = &mut self.snap.jobs[pos];
        match &mut info.meta {
            Ok(m) => Some((&mut info.phase, m)),
            Err(_) => None,
        }
    }

    /// Takes in the arrivals up to minute `t`, as far as their streams' backlogs allow.
    fn admit(&mut self, t: u32) {
        while let Some(a) = self.w.arrivals.get(self.next_arrival) {
            if a.minute > t {
                break;
            }
            let id = self.next_arrival as u32;
            self.next_arrival += 1;
            self.m.arrived += 1;
            if self.stream_pending[a.stream()] >= self.w.max_pending_per_stream {
                self.m.turned_away += 1;
                continue;
            }
            self.stream_pending[a.stream()] += 1;
            self.m.admitted += 1;
            let job = Job {
                arrival: id,
                progress_s: 0.0,
                first_start: None,
                snap: None,
                pending: true,
                avoid: Vec::new(),
                run: None,
            };
            let slot = match self.free_slots.pop() {
                Some(s) => {
                    self.jobs[s as usize] = Some(job);
                    s
                }
                None => {
                    self.jobs.push(Some(job));
                    (self.jobs.len() - 1) as u32
                }
            };
            self.by_arrival.insert(id, slot);
            self.pending.push(slot);
            if self.pending_in_snapshot() {
                self.snap_insert(slot, Phase::Held, None);
            }
        }
    }

    /// Copies the online part of the documents from `tpl` and adds the jobs' progress.
    fn fill_reports(&mut self, t: u32, tpl: &Templates) {
        let now = unix_ms(t);
        if self.reports.is_empty() {
            for d in &tpl.docs {
                self.reports.insert(
                    d.node.clone(),
                    Report {
                        doc: d.clone(),
                        received_unix_ms: now,
                    },
                );
            }
        }
        for d in &tpl.docs {
            let r = self.reports.get_mut(&d.node).expect("a report per node");
            copy_doc(&mut r.doc, d);
            r.received_unix_ms = now;
            r.doc.jobs.clear();
        }
        for &slot in &self.running {
            let job = self.job(slot);
            let run = job.run.as_ref().expect("running");
            if run.minutes == 0 {
                continue;
            }
            let alone = self.class(slot).profile.profile.alone_per_s;
            let rates = [1u32, 10, 60]
                .iter()
                .map(|&w| {
                    let n = w.min(run.minutes);
                    let sum: f64 = (0..n)
                        .map(|k| f64::from(run.recent[((run.minutes - 1 - k) % 60) as usize]))
                        .sum();
                    Rate {
                        window_s: w * 60,
                        per_s: sum / f64::from(n) * alone,
                        covered_s: f64::from(n * 60),
                    }
                })
                .collect();
            let progress = JobProgress {
                job: a_id(job.arrival),
                units_total: job.progress_s * alone,
                last_report_unix_ms: now,
                rates,
            };
            let name = &self.w.cluster.nodes[run.node as usize].name;
            self.reports
                .get_mut(name)
                .expect("a report per node")
                .doc
                .jobs
                .push(progress);
        }
    }

    /// One scheduling pass at minute `t`.
    fn pass(&mut self, t: u32, ring: &Ring, past: Option<&Templates>, future: Option<&Templates>) {
        if self.policy.kind == PolicyKind::OnlineOnly {
            return;
        }
        self.admit(t);
        let tpl = match self.policy.kind {
            PolicyKind::Oracle => future,
            _ => past,
        }
        .expect("templates are built for every policy that needs them");
        self.fill_reports(t, tpl);
        let (started, cpu) = (Instant::now(), thread_cpu_ms());
        let plan = cycle::plan(
            unix_ms(t),
            &self.snap,
            &self.reports,
            &mut self.monitor,
            &self.policy.params,
        );
        self.m.pass_ms.push(started.elapsed().as_secs_f64() * 1e3);
        self.m.pass_cpu_s += (thread_cpu_ms() - cpu) / 1e3;
        let (mut no_gpus, mut below) = (0u64, 0u64);
        for d in &plan.decisions {
            match &d.outcome {
                Outcome::Placed(p) => {
                    let slot = self.slot_of(&d.job);
                    let node = self.w.node_index[&p.node];
                    self.start(slot, node, &p.gpus, Some(p.prediction.share), t, ring);
                }
                Outcome::Pending(valve_scheduler::place::Pending::NoFreeGpus { .. }) => {
                    no_gpus += 1
                }
                Outcome::Pending(valve_scheduler::place::Pending::BelowSla { .. }) => below += 1,
            }
        }
        self.m.pending_no_free_gpus_last = no_gpus;
        self.m.pending_below_sla_last = below;
        self.m.refused += plan.refused.len() as u64;
        if self.policy.kind == PolicyKind::Random {
            self.random_place(t, ring);
        }
        for c in &plan.checks {
            if c.action == Action::Evict {
                let slot = self.slot_of(&c.job);
                self.evict(slot, false);
            }
        }
        let jobs = &self.jobs;
        self.pending
            .retain(|&s| jobs[s as usize].as_ref().is_some_and(|j| j.pending));
        self.running
            .retain(|&s| jobs[s as usize].as_ref().is_some_and(|j| j.run.is_some()));
    }

    fn slot_of(&self, id: &str) -> u32 {
        let a: u32 = id.parse().expect("the simulator's job ids are numbers");
        self.by_arrival[&a]
    }

    /// Random first-fit: pending jobs oldest first, nodes in a random order, the first node
    /// with enough free GPUs takes the job on its first free GPUs. No SLA check.
    fn random_place(&mut self, t: u32, ring: &Ring) {
        let nodes = &self.w.cluster.nodes;
        let mut order: Vec<u32> = (0..nodes.len() as u32).collect();
        self.rng.shuffle(&mut order);
        let mut free: Vec<u32> = nodes
            .iter()
            .map(|n| {
                (n.first_gpu..n.first_gpu + n.gpus)
                    .filter(|&g| self.owner[g as usize] == NONE)
                    .count() as u32
            })
            .collect();
        let most = nodes.iter().map(|n| n.gpus).max().unwrap_or(0) as usize;
        // Nodes with at least k free GPUs, per k.
        let mut with = vec![0usize; most + 1];
        for &f in &free {
            for x in with.iter_mut().take(f as usize + 1).skip(1) {
                *x += 1;
            }
        }
        let mut pending = self.pending.clone();
        pending.sort_by_key(|&s| self.job(s).arrival);
        for slot in pending {
            let k = self.class(slot).gpus() as usize;
            if k > most || with[k] == 0 {
                continue;
            }
            let avoid = &self.job(slot).avoid;
            let Some(&n) = order
                .iter()
                .find(|&&n| free[n as usize] as usize >= k && !avoid.contains(&n))
            else {
                continue;
            };
            let node = &nodes[n as usize];
            let gpus: Vec<u32> = (0..node.gpus)
                .filter(|&i| self.owner[(node.first_gpu + i) as usize] == NONE)
                .take(k)
                .collect();
            let before = free[n as usize] as usize;
            free[n as usize] -= k as u32;
            for x in with.iter_mut().take(before + 1).skip(before - k + 1) {
                *x -= 1;
            }
            self.start(slot, n, &gpus, None, t, ring);
        }
    }

    /// Starts `slot` on `gpus` (indices on `node`) at minute `t + 1`.
    fn start(
        &mut self,
        slot: u32,
        node: u32,
        gpus: &[u32],
        predicted: Option<f64>,
        t: u32,
        ring: &Ring,
    ) {
        let n = &self.w.cluster.nodes[node as usize];
        let global: Vec<u32> = gpus.iter().map(|&i| n.first_gpu + i).collect();
        if global.iter().any(|&g| self.owner[g as usize] != NONE) {
            self.m.conflicts += 1;
            return;
        }
        for &g in &global {
            self.owner[g as usize] = slot;
        }
        let mut series: Vec<u32> = Vec::with_capacity(global.len());
        for &g in &global {
            let s = self.w.cluster.gpus[g as usize].series;
            if !series.contains(&s) {
                series.push(s);
            }
        }
        let class = self.class(slot);
        let alloc = (self.policy.kind == PolicyKind::Static).then(|| {
            series
                .iter()
                .map(|&s| {
                    let least = (1..=60)
                        .map(|k| ring.col(i64::from(t) - k)[s as usize].m)
                        .fold(f32::INFINITY, f32::min);
                    least.min(class.required_gib as f32)
                })
                .collect()
        });
        let out_of_step = series.len() > 1;
        let mut drift_rng = LevelDrift::rng(self.w.drift_seed, self.job(slot).arrival, t + 1);
        let drift = self.w.level_drift.start(&mut drift_rng);
        let stream = self.arrival(slot).stream();
        let arrival_minute = self.arrival(slot).minute;
        let k = series.len();
        let job = self.job_mut(slot);
        job.pending = false;
        let first = job.first_start.is_none();
        if first {
            job.first_start = Some(t + 1);
        }
        job.run = Some(Run {
            node,
            gpus: global,
            series,
            start: t + 1,
            minutes: 0,
            predicted,
            held: vec![f32::NAN; k],
            alloc,
            recent: [0.0; 60],
            hour_sum: 0.0,
            out_of_step,
            drift,
            drift_rng,
        });
        if first {
            self.m.first_starts += 1;
            self.m.queue_delay_min_sum += f64::from(t + 1 - arrival_minute);
        }
        self.m.placements += 1;
        if out_of_step {
            self.m.placements_out_of_step += 1;
        }
        self.stream_pending[stream] -= 1;
        self.running.push(slot);
        let placed = PlacedOn {
            node: n.name.clone(),
            gpus: gpus.to_vec(),
        };
        let phase = Phase::Running(unix_ms(t + 1));
        if self.job(slot).snap.is_none() {
            self.snap_insert(slot, phase, Some(placed));
        } else if let Some((ph, meta)) = self.snap_meta(slot) {
            *ph = phase;
            meta.placed = Some(placed);
        }
    }

    /// Ends `slot`'s run and requeues it (pending again, avoiding its node, the last
    /// [`ROLLBACK_MIN`] minutes of progress lost).
    fn evict(&mut self, slot: u32, killed: bool) {
        let arrival = self.job(slot).arrival;
        let k = f64::from(self.class(slot).gpus());
        let stream = self.arrival(slot).stream();
        let Some(run) = self.job_mut(slot).run.take() else {
            return;
        };
        for &g in &run.gpus {
            self.owner[g as usize] = NONE;
        }
        let partial = run.minutes % 60;
        if partial >= 10 {
            let mean = run.hour_sum / f64::from(partial);
            self.m.partial_hours_evicted += 1;
            self.m.partial_hours_evicted_met += u64::from(mean >= self.arrival(slot).sla());
        }
        let back = ROLLBACK_MIN.min(run.minutes);
        let lost: f64 = (0..back)
            .map(|i| f64::from(run.recent[((run.minutes - 1 - i) % 60) as usize]) * 60.0)
            .sum();
        let job = self.job_mut(slot);
        let lost = lost.min(job.progress_s);
        job.progress_s -= lost;
        job.pending = true;
        self.m.lost_gpu_h += k * lost / 3600.0;
        if killed {
            self.m.kills += 1;
        } else {
            self.m.evictions += 1;
        }
        self.job_mut(slot).avoid.push(run.node);
        self.stream_pending[stream] += 1;
        self.pending.push(slot);
        let node_name = self.w.cluster.nodes[run.node as usize].name.clone();
        if self.pending_in_snapshot() {
            if let Some((ph, meta)) = self.snap_meta(slot) {
                *ph = Phase::Held;
                meta.placed = None;
                meta.avoid.push(node_name);
                meta.evictions += 1;
            }
        } else {
            self.snap_remove(slot);
        }
        self.monitor.forget(&a_id(arrival));
    }

    /// A job that did its work leaves.
    fn finish(&mut self, slot: u32) {
        if let Some(run) = self.job_mut(slot).run.take() {
            for &g in &run.gpus {
                self.owner[g as usize] = NONE;
            }
        }
        self.snap_remove(slot);
        let arrival = self.job(slot).arrival;
        self.monitor.forget(&a_id(arrival));
        self.by_arrival.remove(&arrival);
        self.jobs[slot as usize] = None;
        self.free_slots.push(slot);
        self.m.finished += 1;
    }

    /// Minute `t` of every running job.
    fn step(&mut self, t: u32, col: &[Cell]) {
        if self.policy.kind == PolicyKind::OnlineOnly {
            return;
        }
        let mut killed = Vec::new();
        let mut done = Vec::new();
        let w = self.w;
        for &slot in &self.running {
            let job = self.jobs[slot as usize].as_mut().expect("live job");
            let a = &w.arrivals[job.arrival as usize];
            let class = &w.classes[usize::from(a.class)];
            let Some(run) = job.run.as_mut() else {
                continue; // evicted this pass
            };
            if run.start > t {
                continue;
            }
            let (mt, cells) = run.minute(w, class, a.error, col);
            let n = run.series.len();
            if mt.killed {
                killed.push(slot);
                continue;
            }
            let k = f64::from(class.gpus());
            let m = &mut self.m;
            m.held_gpu_min += k;
            m.harvested_gpu_h += k * mt.share / 60.0;
            if mt.runs {
                m.offline_busy_gpu_min += k * mt.all_idle;
                for c in &cells[..n] {
                    m.max_gpu_utilisation = m.max_gpu_utilisation.max(f64::from(c.b) + mt.all_idle);
                }
            }
            run.recent[(run.minutes % 60) as usize] = mt.share as f32;
            run.minutes += 1;
            run.hour_sum += mt.share;
            if run.minutes % 60 == 0 {
                let mean = run.hour_sum / 60.0;
                m.job_hour(a, mean, run.out_of_step, t, run.minutes == 60);
                if mean >= a.sla() {
                    m.harvested_met_gpu_h += k * mean;
                }
                if run.minutes == 60 {
                    if let Some(p) = run.predicted {
                        m.pred.push((p as f32, mean as f32));
                    }
                }
                run.hour_sum = 0.0;
            }
            job.progress_s += mt.share * 60.0;
            if job.progress_s >= a.work_s {
                done.push(slot);
            }
        }
        for slot in killed {
            self.evict(slot, true);
        }
        for slot in done {
            self.finish(slot);
        }
        let jobs = &self.jobs;
        self.running
            .retain(|&s| jobs[s as usize].as_ref().is_some_and(|j| j.run.is_some()));
    }

    /// Final counts.
    fn close(mut self) -> Metrics {
        self.m.pending_end = self.pending.len() as u64;
        self.m.running_end = self.running.len() as u64;
        if self.policy.params.calibration {
            self.m.speeds = Some(self.speed_check());
        }
        self.m
    }

    /// The learned speed factors against the true ones.
    fn speed_check(&self) -> SpeedCheck {
        let cal = &self.monitor.calibration;
        let factors = cal.factors();
        let nodes = &self.w.cluster.nodes;
        let n = nodes.len().max(1) as f64;
        let (mut pairs, mut err, mut err0) = (Vec::new(), 0.0, 0.0);
        for (node, &truth) in nodes.iter().zip(&self.w.node_speed) {
            let factor = factors.get(&node.name).copied().unwrap_or(1.0);
            if cal.samples(&node.name) >= valve_scheduler::calibrate::MIN_SAMPLES {
                pairs.push((factor, truth));
            }
            err += (factor - truth).abs();
            err0 += (1.0 - truth).abs();
        }
        let k = pairs.len() as f64;
        let mean_factor = (k > 0.0).then(|| pairs.iter().map(|p| p.0).sum::<f64>() / k);
        SpeedCheck {
            nodes: nodes.len(),
            calibrated: pairs.len(),
            mean_abs_err: err / n,
            mean_abs_err_uncalibrated: err0 / n,
            mean_factor,
            correlation: correlation(&pairs),
        }
    }
}

/// Pearson correlation of the pairs (`None` with fewer than 2 or where a side does not vary).
fn correlation(pairs: &[(f64, f64)]) -> Option<f64> {
    let n = pairs.len() as f64;
    if pairs.len() < 2 {
        return None;
    }
    let (sx, sy) = pairs
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for &(x, y) in pairs {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
        syy += (y - my) * (y - my);
    }
    (sxx > 0.0 && syy > 0.0).then(|| sxy / (sxx * syy).sqrt())
}

fn a_id(arrival: u32) -> String {
    arrival.to_string()
}

fn unix_ms(t: u32) -> u64 {
    EPOCH_MS + u64::from(t) * 60_000
}

/// Copies the online figures of `src` into `dst` (same structure) without allocating.
fn copy_doc(dst: &mut NodeHarvest, src: &NodeHarvest) {
    dst.generated_unix_ms = src.generated_unix_ms;
    for (d, s) in dst.gpus.iter_mut().zip(&src.gpus) {
        for (dw, sw) in d.windows.iter_mut().zip(&s.windows) {
            dw.window_s = sw.window_s;
            dw.covered_s = sw.covered_s;
            dw.busy_fraction = sw.busy_fraction;
            dw.offline_memory.samples = sw.offline_memory.samples;
            dw.offline_memory.mean_bytes = sw.offline_memory.mean_bytes;
            dw.offline_memory
                .quantiles_bytes
                .copy_from_slice(&sw.offline_memory.quantiles_bytes);
        }
    }
    dst.pairs.clone_from(&src.pairs);
}

/// Upper bounds (GiB) of the bins of [`RunOutcome::memory_hist`]; the last bin is open.
pub const MEMORY_BINS_GIB: [f32; 5] = [16.0, 20.0, 28.0, 40.0, f32::INFINITY];

/// Everything a run measured.
pub struct RunOutcome {
    /// Per policy, in the order asked.
    pub policies: Vec<(Policy, Metrics)>,
    /// Online busy GPU-minutes (the same for every policy).
    pub online_busy_gpu_min: f64,
    /// Wall time of the work every policy shares: the online load and the documents (s).
    pub shared_s: f64,
    /// GPU-minutes by memory left to offline, per bin of [`MEMORY_BINS_GIB`].
    pub memory_hist: [f64; 5],
    /// GPU-minutes simulated.
    pub gpu_minutes: f64,
}

/// Runs every policy of `cfg` over `world`.
pub fn run_world(world: &World, cfg: &SimConfig) -> RunOutcome {
    let c = &world.cluster;
    let threads = cfg.threads.max(1);
    let mut sims: Vec<(usize, PolicySim)> = cfg
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                i,
                PolicySim::new(world, p.clone(), cfg.seed ^ (0xA11CE + i as u64)),
            )
        })
        .collect();
    // The costliest first, so the threads finish each block together.
    sims.sort_by_key(|(_, s)| s.policy.kind == PolicyKind::OnlineOnly);
    let needs = |dir: Dir| {
        cfg.policies.iter().any(|p| match p.kind {
            PolicyKind::OnlineOnly => false,
            PolicyKind::Oracle => dir == Dir::Future,
            _ => dir == Dir::Past,
        })
    };
    let mut past = needs(Dir::Past).then(|| Templates::new(c));
    let mut future = needs(Dir::Future).then(|| Templates::new(c));
    let mut ring = Ring::new(c.series.len(), -62);
    let series_gpus: Vec<f64> = c.series.iter().map(|s| f64::from(s.gpus)).collect();
    let mut online = 0.0;
    let mut memory_hist = [0.0; 5];
    let wall = Instant::now();
    let mut shared_s = 0.0;
    let mut t = 0u32;
    while t < world.minutes {
        let shared = Instant::now();
        let end = (t + PASS_EVERY_MIN).min(world.minutes);
        ring.fill(c, i64::from(t) + 61 + i64::from(PASS_EVERY_MIN), threads);
        for minute in t..end {
            for (cell, g) in ring.col(i64::from(minute)).iter().zip(&series_gpus) {
                online += f64::from(cell.b) * g;
                let bin = MEMORY_BINS_GIB
                    .iter()
                    .position(|&hi| cell.m < hi)
                    .unwrap_or(MEMORY_BINS_GIB.len() - 1);
                memory_hist[bin] += g;
            }
        }
        if t > 0 && t % 1440 == 0 {
            tracing::info!(
                day = t / 1440,
                wall_s = wall.elapsed().as_secs_f64().round(),
                "simulated"
            );
        }
        if let Some(p) = past.as_mut() {
            p.update(c, &ring, i64::from(t), Dir::Past, unix_ms(t), threads);
        }
        if let Some(f) = future.as_mut() {
            f.update(c, &ring, i64::from(t), Dir::Future, unix_ms(t), threads);
        }
        shared_s += shared.elapsed().as_secs_f64();
        let next = AtomicUsize::new(0);
        let slots: Vec<Mutex<&mut PolicySim>> =
            sims.iter_mut().map(|(_, s)| Mutex::new(s)).collect();
        let (ring_ref, past_ref, future_ref) = (&ring, past.as_ref(), future.as_ref());
        std::thread::scope(|sc| {
            for _ in 0..threads.min(slots.len()) {
                sc.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(slot) = slots.get(i) else { break };
                    let mut s = slot.lock().expect("no panics while held");
                    let (work, cpu) = (Instant::now(), thread_cpu_ms());
                    s.pass(t, ring_ref, past_ref, future_ref);
                    for minute in t..end {
                        s.step(minute, ring_ref.col(i64::from(minute)));
                    }
                    s.m.work_s += work.elapsed().as_secs_f64();
                    s.m.work_cpu_s += (thread_cpu_ms() - cpu) / 1e3;
                });
            }
        });
        t = end;
    }
    let gpu_minutes = c.gpus.len() as f64 * f64::from(world.minutes);
    sims.sort_by_key(|(i, _)| *i);
    RunOutcome {
        policies: sims
            .into_iter()
            .map(|(_, s)| (s.policy.clone(), s.close()))
            .collect(),
        online_busy_gpu_min: online,
        shared_s,
        memory_hist,
        gpu_minutes,
    }
}

#[cfg(test)]
mod tests;
