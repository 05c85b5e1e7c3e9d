//! The simulated cluster's online side: nodes, their GPUs split into online services, and every
//! service's load minute by minute (busy time, memory left to offline, preemptions), replayed from
//! the Azure LLM trace under a daily cycle.
//!
//! A *series* is one busy-time sequence: all GPUs of an in-step multi-GPU service share one; each
//! rank of an out-of-step service, and each 1-GPU service, has its own. Within a minute, GPUs of
//! different series are independent.
//!
//! Assumptions (stated in `--help` and the results): the week-long Azure trace was not
//! obtainable, so a week tiles the one-hour 2023 trace (each series from its own offset) under a
//! daily sine (amplitude 0.8 for code, 0.4 for conversation, weekends at 0.7, each service shifted
//! by up to +-2 h); every GPU has 80 GiB whatever the Alibaba node's GPU model.

use std::sync::{Arc, OnceLock};

use serde::Serialize;

use super::trace::{daily, Kind, TraceTable};

/// Device memory of every simulated GPU.
pub const CAPACITY_GIB: f64 = 80.0;
/// Memory the node keeps back on every GPU.
pub const RESERVE_GIB: f64 = 4.0;
/// Share of what is left after weights and the reserve that online's KV cache can take in a burst.
pub const KV_SHARE: f64 = 0.8;
/// Weekend load relative to weekdays.
pub const WEEKEND: f64 = 0.7;
/// Each service's daily cycle is shifted by up to this much either way.
pub const PHASE_MAX_S: f64 = 2.0 * 3600.0;
/// Online weights per GPU: uniform in this range.
pub const WEIGHTS_GIB: [f64; 2] = [16.0, 32.0];
/// Each service's base load, relative to the calibrated cluster scale: uniform in this range.
pub const BASE_SPREAD: [f64; 2] = [0.3, 1.7];
/// Idle-to-busy transitions per minute at most (a GPU's gate cannot flip faster than this).
pub const TRANSITIONS_CAP_PER_MIN: f64 = 600.0;
/// Minutes in the week the load is calibrated over (whatever length is simulated).
const WEEK_MIN: i64 = 7 * 24 * 60;

const NODES_CSV: &str = include_str!("../../data/alibaba-gpu-v2023-nodes.csv");
const POD_MIX_CSV: &str = include_str!("../../data/alibaba-gpu-v2023-pod-mix.csv");
const CODE_PER_MIN: &str = include_str!("../../data/azure-llm-2023-code-per-minute.csv");
const CONV_PER_MIN: &str = include_str!("../../data/azure-llm-2023-conv-per-minute.csv");

/// The daily cycle's amplitude of a trace (an assumption: code completion follows the working
/// day more than conversation).
pub fn amplitude(kind: Kind) -> f64 {
    match kind {
        Kind::Code => 0.8,
        Kind::Conv => 0.4,
    }
}

/// How many GPUs each node has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// Every node has this many GPUs.
    Uniform(u32),
    /// Sampled from the Alibaba v2023 GPU node list by count.
    Alibaba,
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "alibaba" => Ok(Shape::Alibaba),
            n => match n.parse::<u32>() {
                Ok(k @ 1..=64) => Ok(Shape::Uniform(k)),
                _ => Err(format!(
                    "--shape {s:?}: give GPUs per node (1-64) or `alibaba`"
                )),
            },
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Uniform(n) => write!(f, "{n}"),
            Shape::Alibaba => f.write_str("alibaba"),
        }
    }
}

/// What the online side looks like.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OnlineConfig {
    /// Nodes.
    pub nodes: usize,
    /// GPUs per node.
    pub shape: Shape,
    /// Share of GPUs (in expectation) that belong to multi-GPU services.
    pub multi_gpu_share: f64,
    /// Share of multi-GPU services whose ranks run out of step.
    pub out_of_step_share: f64,
    /// The cluster's mean online busy fraction the base loads are calibrated to.
    pub target_busy: f64,
    /// Random seed of the layout and the services.
    pub seed: u64,
}

impl Default for OnlineConfig {
    fn default() -> Self {
        OnlineConfig {
            nodes: 1000,
            shape: Shape::Uniform(8),
            multi_gpu_share: 0.5,
            out_of_step_share: 0.32,
            target_busy: 0.3,
            seed: 1,
        }
    }
}

/// One online service.
#[derive(Clone, Debug, PartialEq)]
pub struct Service {
    /// Its node.
    pub node: u32,
    /// The trace it replays.
    pub kind: Kind,
    /// GPUs it spans.
    pub gpus: u32,
    /// Whether its ranks share one busy series (always true for one GPU).
    pub in_step: bool,
    /// Its base load relative to the cluster scale.
    pub base: f64,
    /// Shift of its daily cycle (s).
    pub phase_s: f64,
    /// Its weights per GPU (GiB).
    pub weights_gib: f64,
}

/// One busy series.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Its service.
    pub service: u32,
    /// Its offset into the trace (minutes).
    pub offset: u32,
    /// GPUs that follow it.
    pub gpus: u32,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    /// Its node.
    pub node: u32,
    /// Its index on the node.
    pub index: u32,
    /// Its online service.
    pub service: u32,
    /// Its busy series.
    pub series: u32,
}

/// One node.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Its name.
    pub name: String,
    /// Its first GPU in [`Cluster::gpus`].
    pub first_gpu: u32,
    /// Its GPUs.
    pub gpus: u32,
}

/// One series over one minute.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cell {
    /// Online busy fraction.
    pub b: f32,
    /// Memory left to offline (GiB).
    pub m: f32,
    /// Online idle-to-busy transitions (offline is preempted at each).
    pub tr: f32,
}

/// A custom load for tests: `(series, minute) -> Cell`.
pub type CustomLoad = Arc<dyn Fn(usize, i64) -> Cell + Send + Sync>;

/// The online side of the cluster.
#[derive(Clone)]
pub struct Cluster {
    /// Nodes.
    pub nodes: Vec<Node>,
    /// GPUs, node by node.
    pub gpus: Vec<Gpu>,
    /// Online services.
    pub services: Vec<Service>,
    /// Busy series, node by node.
    pub series: Vec<Series>,
    /// The calibrated load scale: a service's load is `scale x base x daily(t)`.
    pub scale: f64,
    /// The mean online busy fraction over a week, estimated from a sample at calibration.
    pub estimated_busy: f64,
    /// Replaces the trace (tests).
    pub custom: Option<CustomLoad>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("nodes", &self.nodes.len())
            .field("gpus", &self.gpus.len())
            .field("services", &self.services.len())
            .field("series", &self.series.len())
            .field("scale", &self.scale)
            .finish()
    }
}

/// One service of a node's layout: (GPUs, in step).
pub type ServiceShape = (u32, bool);

/// The trace tables and per-minute request counts, built once.
struct Traces {
    tables: [TraceTable; 2],
    requests_per_min: [Vec<f64>; 2],
}

fn traces() -> &'static Traces {
    static T: OnceLock<Traces> = OnceLock::new();
    T.get_or_init(|| Traces {
        tables: [TraceTable::load(Kind::Code), TraceTable::load(Kind::Conv)],
        requests_per_min: [parse_requests(CODE_PER_MIN), parse_requests(CONV_PER_MIN)],
    })
}

fn parse_requests(text: &str) -> Vec<f64> {
    text.lines()
        .skip(1)
        .filter_map(|l| l.split(',').nth(1)?.trim().parse().ok())
        .collect()
}

fn kind_index(kind: Kind) -> usize {
    match kind {
        Kind::Code => 0,
        Kind::Conv => 1,
    }
}

/// Node speeds clamped to this range (what the scheduler's calibration may learn).
pub const SPEED_BOUNDS: [f64; 2] = [0.5, 1.5];

/// Each of `nodes` nodes' true speed: how fast every job runs there relative to its profile (on
/// H100s of one model the same job ran 26-30% apart). Lognormal with log-sd `sd`, clamped to
/// [`SPEED_BOUNDS`], drawn from `seed`; all exactly 1.0 when `sd` is 0.
pub fn node_speeds(nodes: usize, sd: f64, seed: u64) -> Vec<f64> {
    if sd == 0.0 {
        return vec![1.0; nodes];
    }
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5BEE_D5EE_u64);
    (0..nodes)
        .map(|_| {
            (sd * super::jobs::normal(&mut rng))
                .exp()
                .clamp(SPEED_BOUNDS[0], SPEED_BOUNDS[1])
        })
        .collect()
}

impl Cluster {
    /// A random cluster of `cfg`, its load calibrated to `cfg.target_busy`.
    pub fn build(cfg: &OnlineConfig) -> Cluster {
        let mut rng = fastrand::Rng::with_seed(cfg.seed ^ 0x05EE_D0C1_u64);
        let shapes = node_shapes(cfg.shape, cfg.nodes, &mut rng);
        let layout: Vec<Vec<ServiceShape>> = shapes
            .iter()
            .map(|&n| split_node(n, cfg.multi_gpu_share, cfg.out_of_step_share, &mut rng))
            .collect();
        Cluster::assemble(&layout, cfg.target_busy, &mut rng)
    }

    /// A cluster of the given layout (per node, its services in GPU order), with random kinds,
    /// loads, phases, weights and offsets, calibrated to `target_busy`.
    pub fn assemble(
        layout: &[Vec<ServiceShape>],
        target_busy: f64,
        rng: &mut fastrand::Rng,
    ) -> Cluster {
        let t = traces();
        let mut c = Cluster {
            nodes: Vec::new(),
            gpus: Vec::new(),
            services: Vec::new(),
            series: Vec::new(),
            scale: 1.0,
            estimated_busy: 0.0,
            custom: None,
        };
        for (n, services) in layout.iter().enumerate() {
            let first_gpu = c.gpus.len() as u32;
            let mut index = 0;
            for &(gpus, in_step) in services {
                let kind = if rng.bool() { Kind::Code } else { Kind::Conv };
                let sv = c.services.len() as u32;
                let in_step = gpus == 1 || in_step;
                c.services.push(Service {
                    node: n as u32,
                    kind,
                    gpus,
                    in_step,
                    base: uniform(rng, BASE_SPREAD),
                    phase_s: uniform(rng, [-PHASE_MAX_S, PHASE_MAX_S]),
                    weights_gib: uniform(rng, WEIGHTS_GIB),
                });
                let minutes = t.tables[kind_index(kind)].minutes() as u32;
                let mut series = 0;
                for r in 0..gpus {
                    if r == 0 || !in_step {
                        series = c.series.len() as u32;
                        c.series.push(Series {
                            service: sv,
                            offset: rng.u32(0..minutes),
                            gpus: if in_step { gpus } else { 1 },
                        });
                    }
                    c.gpus.push(Gpu {
                        node: n as u32,
                        index,
                        service: sv,
                        series,
                    });
                    index += 1;
                }
            }
            c.nodes.push(Node {
                name: format!("node{n:04}"),
                first_gpu,
                gpus: index,
            });
        }
        c.calibrate(target_busy);
        c
    }

    /// Sets `scale` so the estimated mean busy fraction over a week is `target`.
    fn calibrate(&mut self, target: f64) {
        let (mut lo, mut hi) = (1e-3f64, 50.0f64);
        for _ in 0..24 {
            let mid = (lo * hi).sqrt();
            self.scale = mid;
            if self.sample_busy() < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        self.scale = (lo * hi).sqrt();
        self.estimated_busy = self.sample_busy();
    }

    /// The mean busy fraction over GPUs and a sample of a week's minutes (every 61st; at most
    /// about 600 series, evenly spaced).
    fn sample_busy(&self) -> f64 {
        let step = (self.series.len() / 600).max(1);
        let (mut sum, mut weight) = (0.0, 0.0);
        for s in (0..self.series.len()).step_by(step) {
            let g = f64::from(self.series[s].gpus);
            for minute in (0..WEEK_MIN).step_by(61) {
                sum += g * f64::from(self.cell(s, minute).b);
                weight += g;
            }
        }
        sum / weight.max(1.0)
    }

    /// The load of `service` at `minute` (1 = the trace's mean work fills the GPU).
    pub fn load(&self, service: &Service, minute: i64) -> f64 {
        let t_s = minute as f64 * 60.0 + 30.0;
        self.scale * service.base * daily(t_s + service.phase_s, amplitude(service.kind), WEEKEND)
    }

    /// Series `s` over `minute` (minute 0 starts the simulated Monday; earlier minutes are the
    /// history the nodes had measured before it).
    pub fn cell(&self, s: usize, minute: i64) -> Cell {
        if let Some(f) = &self.custom {
            return f(s, minute);
        }
        let t = traces();
        let se = &self.series[s];
        let sv = &self.services[se.service as usize];
        let k = kind_index(sv.kind);
        let table = &t.tables[k];
        let tm = (minute + i64::from(se.offset)).rem_euclid(table.minutes() as i64) as usize;
        let x = self.load(sv, minute);
        let (b, peak) = table.at(tm, x);
        let free = (CAPACITY_GIB - sv.weights_gib - RESERVE_GIB).max(0.0);
        let m = free * (1.0 - KV_SHARE * peak.clamp(0.0, 1.0));
        let req = &t.requests_per_min[k];
        let requests = req.get(tm).copied().unwrap_or(0.0);
        let tr = (x * requests * (1.0 - b)).clamp(0.0, TRANSITIONS_CAP_PER_MIN);
        Cell {
            b: b.clamp(0.0, 1.0) as f32,
            m: m as f32,
            tr: tr as f32,
        }
    }

    /// The GPUs of `node`.
    pub fn node_gpus(&self, node: usize) -> &[Gpu] {
        let n = &self.nodes[node];
        &self.gpus[n.first_gpu as usize..(n.first_gpu + n.gpus) as usize]
    }

    /// What the layout came out as.
    pub fn summary(&self) -> ClusterSummary {
        let gpus = self.gpus.len();
        let multi: u32 = self
            .services
            .iter()
            .filter(|s| s.gpus > 1)
            .map(|s| s.gpus)
            .sum();
        let oos: u32 = self
            .services
            .iter()
            .filter(|s| s.gpus > 1 && !s.in_step)
            .map(|s| s.gpus)
            .sum();
        let multi_services = self.services.iter().filter(|s| s.gpus > 1).count();
        let oos_services = self
            .services
            .iter()
            .filter(|s| s.gpus > 1 && !s.in_step)
            .count();
        let mut shapes = std::collections::BTreeMap::new();
        for n in &self.nodes {
            *shapes.entry(n.gpus).or_insert(0usize) += 1;
        }
        ClusterSummary {
            nodes: self.nodes.len(),
            gpus,
            services: self.services.len(),
            series: self.series.len(),
            node_shapes: shapes.into_iter().collect(),
            multi_gpu_services: multi_services,
            multi_gpu_share_by_gpu: f64::from(multi) / gpus.max(1) as f64,
            out_of_step_services: oos_services,
            out_of_step_share_of_multi_services: oos_services as f64 / multi_services.max(1) as f64,
            out_of_step_share_by_gpu: f64::from(oos) / gpus.max(1) as f64,
            load_scale: self.scale,
        }
    }
}

/// The cluster's layout as it came out.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterSummary {
    /// Nodes.
    pub nodes: usize,
    /// GPUs.
    pub gpus: usize,
    /// Online services.
    pub services: usize,
    /// Busy series.
    pub series: usize,
    /// (GPUs per node, nodes).
    pub node_shapes: Vec<(u32, usize)>,
    /// Services of more than one GPU.
    pub multi_gpu_services: usize,
    /// Share of GPUs in them.
    pub multi_gpu_share_by_gpu: f64,
    /// Of them, out of step.
    pub out_of_step_services: usize,
    /// Their share of the multi-GPU services.
    pub out_of_step_share_of_multi_services: f64,
    /// Share of all GPUs in out-of-step services.
    pub out_of_step_share_by_gpu: f64,
    /// The calibrated load scale.
    pub load_scale: f64,
}

fn uniform(rng: &mut fastrand::Rng, [lo, hi]: [f64; 2]) -> f64 {
    lo + (hi - lo) * rng.f64()
}

/// GPUs per node for `nodes` nodes.
fn node_shapes(shape: Shape, nodes: usize, rng: &mut fastrand::Rng) -> Vec<u32> {
    match shape {
        Shape::Uniform(n) => vec![n; nodes],
        Shape::Alibaba => {
            let rows = alibaba_node_shapes();
            let total: u64 = rows.iter().map(|r| r.1).sum();
            (0..nodes)
                .map(|_| {
                    let mut k = rng.u64(0..total);
                    for &(gpus, count) in &rows {
                        if k < count {
                            return gpus;
                        }
                        k -= count;
                    }
                    rows[0].0
                })
                .collect()
        }
    }
}

/// (GPUs per node, nodes) of the Alibaba v2023 GPU node list, over all GPU models.
pub fn alibaba_node_shapes() -> Vec<(u32, u64)> {
    let mut by: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
    for line in NODES_CSV.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if let (Some(Ok(g)), Some(Ok(c))) = (
            f.first().map(|x| x.trim().parse::<u32>()),
            f.get(2).map(|x| x.trim().parse::<u64>()),
        ) {
            *by.entry(g).or_default() += c;
        }
    }
    by.into_iter().rev().collect()
}

/// Splits a node of `n` GPUs into online services: each GPU is drawn into a multi-GPU service
/// with probability `share`; that count is made even (up or down at random, so the share holds
/// in expectation) and cut into services of 2, 4 or 8 GPUs; the rest are 1-GPU services. The
/// services are placed on the node in random order.
pub fn split_node(
    n: u32,
    share: f64,
    out_of_step: f64,
    rng: &mut fastrand::Rng,
) -> Vec<ServiceShape> {
    let mut c = (0..n).filter(|_| rng.f64() < share).count() as u32;
    if c % 2 == 1 {
        if rng.bool() && c < n {
            c += 1;
        } else {
            c -= 1;
        }
    }
    let mut services = Vec::new();
    let mut left = c;
    while left >= 2 {
        let sizes: Vec<u32> = [2, 4, 8].into_iter().filter(|&s| s <= left).collect();
        let s = sizes[rng.usize(0..sizes.len())];
        services.push((s, rng.f64() >= out_of_step));
        left -= s;
    }
    services.extend((0..n - c).map(|_| (1, true)));
    rng.shuffle(&mut services);
    services
}

/// The share of latency-sensitive GPUs in multi-GPU pods of the Alibaba v2023 trace, with how it
/// was computed: over LS pods that request whole GPUs, GPUs in pods of more than one GPU over all
/// their GPUs (pods x GPUs per pod). Fractional-GPU LS pods (a share of one GPU each; their
/// shares are not in the extract) and CPU-only pods are left out.
pub fn alibaba_multi_gpu_share() -> (f64, String) {
    let (mut total, mut multi) = (0u64, 0u64);
    let mut terms = Vec::new();
    for line in POD_MIX_CSV.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 3 || f[0] != "LS" {
            continue;
        }
        let (Ok(gpus), Ok(pods)) = (f[1].parse::<u64>(), f[2].parse::<u64>()) else {
            continue;
        };
        if gpus == 0 {
            continue;
        }
        total += gpus * pods;
        if gpus > 1 {
            multi += gpus * pods;
        }
        terms.push(format!("{pods}x{gpus}"));
    }
    let share = multi as f64 / total.max(1) as f64;
    let how = format!(
        "alibaba-gpu-v2023-pod-mix.csv, LS pods requesting whole GPUs: {} = {total} GPUs, of which {multi} in pods of 2, 4 or 8 GPUs: {:.2}% (fractional-GPU and CPU-only LS pods left out)",
        terms.join(" + "),
        share * 100.0
    );
    (share, how)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(nodes: usize, share: f64, oos: f64) -> Cluster {
        Cluster::build(&OnlineConfig {
            nodes,
            multi_gpu_share: share,
            out_of_step_share: oos,
            ..OnlineConfig::default()
        })
    }

    #[test]
    fn the_layout_follows_the_shares_and_the_load_is_calibrated() {
        let c = small(100, 0.5, 0.32);
        let s = c.summary();
        assert_eq!(s.gpus, 800);
        assert!(
            (s.multi_gpu_share_by_gpu - 0.5).abs() < 0.05,
            "{}",
            s.multi_gpu_share_by_gpu
        );
        assert!(
            (s.out_of_step_share_of_multi_services - 0.32).abs() < 0.1,
            "{s:?}"
        );
        assert!(
            (c.estimated_busy - 0.3).abs() < 0.01,
            "{}",
            c.estimated_busy
        );
        // Every in-step service has one series; out-of-step ranks one each.
        for g in &c.gpus {
            let sv = &c.services[g.service as usize];
            let se = &c.series[g.series as usize];
            assert_eq!(se.service, g.service);
            assert_eq!(se.gpus, if sv.in_step { sv.gpus } else { 1 });
        }
        let none = small(20, 0.0, 0.32).summary();
        assert_eq!((none.multi_gpu_services, none.series), (0, 160));
    }

    #[test]
    fn memory_left_to_offline_shrinks_with_online_peaks() {
        let c = small(10, 0.5, 0.32);
        for s in 0..c.series.len() {
            let sv = &c.services[c.series[s].service as usize];
            let free = CAPACITY_GIB - sv.weights_gib - RESERVE_GIB;
            for minute in [-60, 0, 600, 5000] {
                let cell = c.cell(s, minute);
                assert!((0.0..=1.0).contains(&cell.b));
                let m = f64::from(cell.m);
                assert!(
                    m <= free + 1e-3 && m >= free * (1.0 - KV_SHARE) - 1e-3,
                    "{m}"
                );
                assert!(cell.tr >= 0.0 && f64::from(cell.tr) <= TRANSITIONS_CAP_PER_MIN);
            }
        }
    }

    #[test]
    fn alibaba_shapes_and_the_multi_gpu_share_come_from_the_extracts() {
        let rows = alibaba_node_shapes();
        assert_eq!(rows.iter().map(|r| r.1).sum::<u64>(), 1213);
        assert_eq!(rows[0], (8, 617));
        let (share, how) = alibaba_multi_gpu_share();
        // 15x2 + 14x4 + 23x8 = 270 of 3200 + 270 = 3470 GPUs.
        assert!((share - 270.0 / 3470.0).abs() < 1e-12, "{share} {how}");
        assert!(how.contains("3470"), "{how}");
        let c = Cluster::build(&OnlineConfig {
            nodes: 100,
            shape: Shape::Alibaba,
            ..OnlineConfig::default()
        });
        assert!(c.nodes.iter().all(|n| [1, 2, 4, 8].contains(&n.gpus)));
        assert!(c.summary().node_shapes.len() >= 2);
        assert_eq!("alibaba".parse::<Shape>(), Ok(Shape::Alibaba));
        assert_eq!("8".parse::<Shape>(), Ok(Shape::Uniform(8)));
        assert!("x".parse::<Shape>().is_err());
    }
}
