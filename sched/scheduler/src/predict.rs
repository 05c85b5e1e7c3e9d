//! The throughput model of paper section 6: an offline job's throughput on harvested GPUs is its
//! throughput alone x the idle compute fraction x the memory factor x alignment admission.
//!
//! [`NodeModel`] is a node's harvest document reduced to what the model reads; [`predict`] is the
//! formula, with every factor kept for the explanation. `docs/cluster.md` derives each term.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use valve_harvest::{NodeHarvest, PairAlignment, QUANTILES};

use crate::job::{JobProfile, GIB_F};

/// The model's settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelParams {
    /// The trailing window the model reads (the longest one at most this long that is measured
    /// well enough, see `min_coverage`).
    pub window_s: u32,
    /// A window counts only if at least this share of it was measured.
    pub min_coverage: f64,
    /// A k-GPU job is admitted only on GPUs whose every pair scores at least this (overlap over
    /// union of online busy time).
    pub align_threshold: f64,
    /// GPUs busier than this count as busy when a pair's alignment is unknown.
    pub quiet_busy: f64,
    /// How memory enters the prediction (Valve's model: [`MemoryModel::Trace`]).
    pub memory: MemoryModel,
    /// Whether multi-GPU jobs need aligned GPUs, and pairs' union busy time bounds idle time
    /// (Valve's model: true).
    pub alignment: bool,
    /// Whether the time a job loses to each preemption and each GiB reclaimed (its profile's
    /// `costs`, times the node's rates) comes off its idle share (Valve's model: true).
    pub interruptions: bool,
}

/// How memory enters a prediction. Valve's model reads the node's memory trace; the others are
/// the baselines the simulator compares it with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryModel {
    /// The time average of T(m) over the memory trace, less the deficit penalty (paper eq. 2).
    Trace,
    /// Memory is not looked at (placement by idle fraction alone).
    Ignore,
    /// A static split: offline gets the least memory of the window, all the time, and loses
    /// nothing to reclaims (online bursts past it kill offline instead).
    StaticMin,
}

impl Default for ModelParams {
    fn default() -> Self {
        ModelParams {
            window_s: 3600,
            min_coverage: 0.5,
            align_threshold: 0.8,
            quiet_busy: 0.02,
            memory: MemoryModel::Trace,
            alignment: true,
            interruptions: true,
        }
    }
}

/// One GPU as the model sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuModel {
    /// Its index on the node.
    pub index: u32,
    /// Share of the window offline could not run.
    pub busy: f64,
    /// Memory left to offline: time-weighted quantiles 0%, 5%, ..., 100%.
    pub memory_quantiles: Vec<u64>,
    /// The gate's preemptions of offline per second.
    pub preemptions_per_s: f64,
    /// GiB the pool took back from offline per second.
    pub reclaimed_gib_per_s: f64,
    /// Reclaim episodes per second (0 where the document does not count them).
    pub reclaim_episodes_per_s: f64,
}

/// A node's harvest as the model reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeModel {
    /// The node's name.
    pub name: String,
    /// The window the figures come from.
    pub window_s: u32,
    /// Its GPUs.
    pub gpus: Vec<GpuModel>,
    /// Alignment score per pair of GPU positions (row-major, `None`: unknown).
    scores: Vec<Option<f64>>,
    /// Union busy fraction per pair of GPU positions.
    unions: Vec<Option<f64>>,
    /// The node's speed: its jobs' throughput over what their profiles' T_alone predicts
    /// (1.0: as profiled). Learned from running jobs ([`crate::calibrate`]); every prediction on
    /// the node is multiplied by it.
    pub speed: f64,
}

/// A prediction with its factors.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    /// Predicted throughput as a share of alone (what the SLA is compared with).
    pub share: f64,
    /// Predicted throughput (units/s).
    pub per_s: f64,
    /// Idle compute fraction of the GPU set (1 - the busiest GPU's, or pair's union, busy share).
    pub idle: f64,
    /// The share of time the job loses to interruptions (its costs x the set's worst rates).
    pub interrupted: f64,
    /// The share of the held time (1 - idle) the job does not lose: its profile's
    /// `held_overlap` x (1 - idle), 0 where interruptions are not modelled.
    pub overlap: f64,
    /// Preemptions per second on the set's most preempted GPU.
    pub preemptions_per_s: f64,
    /// GiB reclaimed per second on the set's most reclaimed GPU.
    pub reclaimed_gib_per_s: f64,
    /// Reclaim episodes per second on the set's most reclaimed GPU (0: not counted).
    pub reclaim_episodes_per_s: f64,
    /// Memory factor of the GPU set (its worst GPU's).
    pub memory: f64,
    /// The lowest pairwise alignment score in the set (`None` for one GPU).
    pub min_alignment: Option<f64>,
    /// Whether the set passed alignment admission.
    pub aligned: bool,
    /// The window the node's figures come from.
    pub window_s: u32,
    /// The node's speed factor the share was multiplied by (1.0: none).
    pub speed: f64,
}

impl NodeModel {
    /// Reduces `doc` to the model's inputs over the window `params` asks for.
    pub fn from_doc(doc: &NodeHarvest, params: &ModelParams) -> NodeModel {
        let window_s = choose_window(doc, params);
        let gpus: Vec<GpuModel> = doc
            .gpus
            .iter()
            .map(|g| {
                let w = g.window(window_s);
                // Events per measured second (nothing was counted before the window's cover).
                let per_s = |n: f64| w.map_or(0.0, |w| n / w.covered_s.max(1.0));
                GpuModel {
                    index: g.index,
                    busy: w.map_or(1.0, |w| w.busy_fraction),
                    preemptions_per_s: per_s(w.map_or(0.0, |w| w.preemptions as f64)),
                    reclaimed_gib_per_s: per_s(w.map_or(0.0, |w| w.reclaimed_bytes as f64 / GIB_F)),
                    reclaim_episodes_per_s: per_s(w.map_or(0.0, |w| w.reclaim_episodes as f64)),
                    memory_quantiles: w
                        .map(|w| w.offline_memory.quantiles_bytes.clone())
                        .filter(|q| q.len() == QUANTILES)
                        .unwrap_or_else(|| vec![0; QUANTILES]),
                }
            })
            .collect();
        let n = gpus.len();
        let (mut scores, mut unions) = (vec![None; n * n], vec![None; n * n]);
        // `doc.pair` for every two positions, from one look at the pairs: the first of the
        // window's pairs with those GPUs, as `doc.pair` finds it.
        let mut first: HashMap<[u32; 2], &PairAlignment> = HashMap::new();
        for p in doc.pairs.iter().filter(|p| p.window_s == window_s) {
            first.entry(p.gpus).or_insert(p);
        }
        for a in 0..n {
            for b in 0..n {
                let (x, y) = (gpus[a].index, gpus[b].index);
                let p = first.get(&[x.min(y), x.max(y)]);
                scores[a * n + b] = p.map(|p| p.score);
                unions[a * n + b] = p.map(|p| p.union_fraction);
            }
        }
        NodeModel {
            name: doc.node.clone(),
            window_s,
            gpus,
            scores,
            unions,
            speed: 1.0,
        }
    }

    /// The same node with speed factor `speed` (see [`NodeModel::speed`]).
    pub fn with_speed(mut self, speed: f64) -> NodeModel {
        self.speed = speed;
        self
    }

    /// A node with `gpus` identical GPUs, all pairs scoring `score` (for tests and simulation).
    pub fn uniform(name: &str, gpus: Vec<GpuModel>, score: f64, window_s: u32) -> NodeModel {
        let n = gpus.len();
        let unions = (0..n * n)
            .map(|k| Some(gpus[k / n].busy.max(gpus[k % n].busy)))
            .collect();
        NodeModel {
            name: name.into(),
            window_s,
            gpus,
            scores: vec![Some(score); n * n],
            unions,
            speed: 1.0,
        }
    }

    /// Sets the alignment of GPU positions `a` and `b` (both orders).
    pub fn set_pair(&mut self, a: usize, b: usize, score: f64, union: f64) {
        let n = self.gpus.len();
        for (x, y) in [(a, b), (b, a)] {
            self.scores[x * n + y] = Some(score);
            self.unions[x * n + y] = Some(union);
        }
    }

    /// The alignment score of GPU positions `a` and `b`; unknown pairs of two quiet GPUs count as
    /// aligned, other unknown pairs as not.
    pub fn score(&self, a: usize, b: usize, params: &ModelParams) -> f64 {
        let n = self.gpus.len();
        self.scores[a * n + b].unwrap_or_else(|| {
            let quiet = |g: &GpuModel| g.busy <= params.quiet_busy;
            if quiet(&self.gpus[a]) && quiet(&self.gpus[b]) {
                1.0
            } else {
                0.0
            }
        })
    }

    /// The union busy fraction of GPU positions `a` and `b` (unknown: the busier one's).
    pub(crate) fn union(&self, a: usize, b: usize) -> f64 {
        let n = self.gpus.len();
        self.unions[a * n + b].unwrap_or(self.gpus[a].busy.max(self.gpus[b].busy))
    }
}

/// The longest window at most `params.window_s` long whose measured part is at least
/// `min_coverage` of it; else the best-measured one.
fn choose_window(doc: &NodeHarvest, params: &ModelParams) -> u32 {
    let Some(g) = doc.gpus.first() else {
        return params.window_s;
    };
    let mut ws: Vec<_> = g
        .windows
        .iter()
        .filter(|w| w.window_s <= params.window_s)
        .collect();
    ws.sort_by_key(|w| std::cmp::Reverse(w.window_s));
    ws.iter()
        .find(|w| w.covered_s >= params.min_coverage * f64::from(w.window_s))
        .or_else(|| ws.iter().max_by(|a, b| a.covered_s.total_cmp(&b.covered_s)))
        .map_or(params.window_s, |w| w.window_s)
}

/// The memory factor of `job` on one GPU whose memory left to offline has `quantiles`, as
/// `model` reads it.
pub fn memory_factor(job: &JobProfile, quantiles: &[u64], model: MemoryModel) -> f64 {
    match model {
        MemoryModel::Trace => trace_memory_factor(job, quantiles),
        MemoryModel::Ignore => 1.0,
        MemoryModel::StaticMin => quantiles.first().map_or(0.0, |&m| job.memory_share(m)),
    }
}

/// [`JobProfile::memory_share`] over a trace's quantiles, which ascend: where the curve ascends
/// in memory too, the points at or below each quantile are counted on from the last quantile's
/// count, not searched for afresh (the same count, so the same share, bit for bit).
struct Points<'a> {
    job: &'a JobProfile,
    /// Whether the curve's points ascend in memory (else each share is searched for).
    ascending: bool,
    /// The last memory looked up and how many points lie at or below it.
    last: u64,
    below: usize,
}

impl<'a> Points<'a> {
    fn new(job: &'a JobProfile) -> Self {
        let c = &job.curve;
        Points {
            job,
            ascending: c.windows(2).all(|w| w[0].memory_bytes <= w[1].memory_bytes),
            last: 0,
            below: 0,
        }
    }

    fn share(&mut self, m: u64) -> f64 {
        if !self.ascending {
            return self.job.memory_share(m);
        }
        if m < self.last {
            self.below = 0; // quantiles out of order: count from the start
        }
        let c = &self.job.curve;
        while self.below < c.len() && c[self.below].memory_bytes <= m {
            self.below += 1;
        }
        self.last = m;
        self.job.share_below(m, self.below)
    }
}

/// Paper eq. 2: the time average of T(m)/T_alone over the quantiles, less `deficit_penalty` x
/// the mean relative deficit below R.
fn trace_memory_factor(job: &JobProfile, quantiles: &[u64]) -> f64 {
    let required = job.required().max(1) as f64;
    let (mut share, mut deficit) = (0.0, 0.0);
    let mut prev: Option<(f64, f64)> = None;
    let mut last_m = None;
    let mut points = Points::new(job);
    for &m in quantiles {
        let (s, d) = match (last_m, prev) {
            (Some(lm), Some(p)) if lm == m => p, // a steady trace repeats its quantiles
            _ => (points.share(m), (required - m as f64).max(0.0) / required),
        };
        last_m = Some(m);
        if let Some((ps, pd)) = prev {
            // Each step between neighbouring quantiles holds an equal share of the time.
            share += (ps + s) / 2.0;
            deficit += (pd + d) / 2.0;
        }
        prev = Some((s, d));
    }
    let steps = quantiles.len().saturating_sub(1).max(1) as f64;
    if quantiles.len() == 1 {
        let (s, d) = prev.unwrap_or((0.0, 1.0));
        return (s - job.deficit_penalty * d).clamp(0.0, 1.0);
    }
    (share / steps - job.deficit_penalty * deficit / steps).clamp(0.0, 1.0)
}

/// Predicts `job` on the GPUs at `positions` of `node`, each with memory factor `memory[i]`
/// (from [`memory_factor`], cached by the caller).
pub fn predict_with(
    job: &JobProfile,
    node: &NodeModel,
    positions: &[usize],
    memory: &[f64],
    params: &ModelParams,
) -> Prediction {
    let mut idle: f64 = 1.0;
    let mut mem: f64 = 1.0;
    let (mut preemptions, mut reclaimed, mut episodes) = (0.0f64, 0.0f64, 0.0f64);
    let mut lost: f64 = 0.0;
    let mut min_alignment: Option<f64> = None;
    for (k, &a) in positions.iter().enumerate() {
        let g = &node.gpus[a];
        idle = idle.min(1.0 - g.busy);
        mem = mem.min(memory[k]);
        preemptions = preemptions.max(g.preemptions_per_s);
        if g.reclaimed_gib_per_s > reclaimed {
            (reclaimed, episodes) = (g.reclaimed_gib_per_s, g.reclaim_episodes_per_s);
        }
        // A job in lockstep waits for its slowest GPU: the most interrupted one sets its loss.
        lost = lost.max(job.costs.lost_share(
            g.preemptions_per_s,
            g.reclaimed_gib_per_s,
            g.reclaim_episodes_per_s,
        ));
        if !params.alignment {
            continue;
        }
        for &b in &positions[k + 1..] {
            let s = node.score(a, b, params);
            min_alignment = Some(min_alignment.map_or(s, |m: f64| m.min(s)));
            idle = idle.min(1.0 - node.union(a, b));
        }
    }
    let idle = idle.clamp(0.0, 1.0);
    // A job whose host work goes on while the gate holds it loses only part of the held time.
    let overlap = if params.interruptions {
        job.costs.held_overlap.clamp(0.0, 1.0) * (1.0 - idle)
    } else {
        0.0
    };
    let interrupted = if params.interruptions {
        lost.clamp(0.0, idle + overlap)
    } else {
        0.0
    };
    let aligned = min_alignment.is_none_or(|s| s >= params.align_threshold);
    // The node's speed scales the whole share: in [0, speed], so that a fast node may predict
    // more than alone and `share / speed` gives back the share before it.
    let speed = node.speed.max(0.0);
    let share = if aligned {
        ((idle + overlap - interrupted) * mem).clamp(0.0, 1.0) * speed
    } else {
        0.0
    };
    Prediction {
        share,
        per_s: share * job.alone_per_s,
        idle,
        interrupted,
        overlap,
        preemptions_per_s: preemptions,
        reclaimed_gib_per_s: reclaimed,
        reclaim_episodes_per_s: episodes,
        memory: mem,
        min_alignment,
        aligned,
        window_s: node.window_s,
        speed,
    }
}

/// Predicts `job` on the GPUs at `positions` of `node`.
pub fn predict(
    job: &JobProfile,
    node: &NodeModel,
    positions: &[usize],
    params: &ModelParams,
) -> Prediction {
    let memory: Vec<f64> = positions
        .iter()
        .map(|&p| memory_factor(job, &node.gpus[p].memory_quantiles, params.memory))
        .collect();
    predict_with(job, node, positions, &memory, params)
}

impl Prediction {
    /// The predicted share before the node's speed factor (what a calibration compares the
    /// measured share with).
    pub fn unscaled_share(&self) -> f64 {
        if self.speed > 0.0 {
            self.share / self.speed
        } else {
            0.0
        }
    }
}

impl std::fmt::Display for Prediction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.2} of alone = idle {:.2}", self.share, self.idle)?;
        if self.overlap > 0.0 {
            write!(f, " + held time not lost {:.2}", self.overlap)?;
        }
        if self.interrupted > 0.0 {
            write!(
                f,
                " - interruptions {:.2} ({:.2} preemptions/s, {:.3} GiB/s reclaimed",
                self.interrupted, self.preemptions_per_s, self.reclaimed_gib_per_s
            )?;
            if self.reclaim_episodes_per_s > 0.0 {
                write!(f, " in {:.3} episodes/s", self.reclaim_episodes_per_s)?;
            }
            write!(f, ")")?;
        }
        write!(f, " x memory {:.2}", self.memory)?;
        match self.min_alignment {
            None => write!(f, " (one GPU)"),
            Some(s) if self.aligned => write!(f, " x aligned (worst pair {s:.2})"),
            Some(s) => write!(f, " x not aligned (worst pair {s:.2})"),
        }?;
        if self.speed != 1.0 {
            write!(f, " x speed {:.2}", self.speed)?;
        }
        write!(f, " over {} s", self.window_s)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::job::tests::{profile, GIB};

    #[test]
    fn a_models_pairs_are_the_documents_own_look_ups_with_repeats_and_gaps() {
        let mut rng = fastrand::Rng::with_seed(41);
        let mut found = 0;
        for i in 0..300 {
            let gpus = [1, 2, 4, 8][i % 4];
            let mut doc = crate::bench::random_doc(&mut rng, "n", gpus, 0);
            // Some pairs lost, some repeated with other figures, GPU indices shuffled or repeated.
            doc.pairs.retain(|_| rng.u8(0..6) != 0);
            for _ in 0..rng.usize(0..4) {
                if let Some(p) = doc.pairs.get(rng.usize(0..doc.pairs.len().max(1))) {
                    let mut q = p.clone();
                    q.score = rng.f64();
                    q.union_fraction = rng.f64();
                    doc.pairs.push(q);
                }
            }
            rng.shuffle(&mut doc.pairs);
            if rng.bool() {
                let g = rng.usize(0..doc.gpus.len());
                doc.gpus[g].index = doc.gpus[rng.usize(0..doc.gpus.len())].index;
            }
            let m = NodeModel::from_doc(&doc, &ModelParams::default());
            let n = m.gpus.len();
            for a in 0..n {
                for b in 0..n {
                    let p = doc.pair(m.gpus[a].index, m.gpus[b].index, m.window_s);
                    assert_eq!(m.scores[a * n + b], p.map(|p| p.score), "doc {i}");
                    assert_eq!(m.unions[a * n + b], p.map(|p| p.union_fraction));
                    found += usize::from(p.is_some());
                }
            }
        }
        assert!(found > 1000, "{found} pairs found");
    }

    pub(crate) fn gpu(index: u32, busy: f64, memory: u64) -> GpuModel {
        GpuModel {
            index,
            busy,
            memory_quantiles: vec![memory; QUANTILES],
            preemptions_per_s: 0.0,
            reclaimed_gib_per_s: 0.0,
            reclaim_episodes_per_s: 0.0,
        }
    }

    #[test]
    fn preemptions_and_reclaims_come_off_the_idle_share_at_the_jobs_measured_costs() {
        let mut busy = gpu(0, 0.3, 16 * GIB);
        busy.preemptions_per_s = 0.5;
        busy.reclaimed_gib_per_s = 0.1;
        let node = NodeModel::uniform("n", vec![busy], 1.0, 600);
        let mut job = profile(1);
        let free = predict(&job, &node, &[0], &ModelParams::default());
        assert_eq!(
            (free.interrupted, free.share),
            (0.0, 0.7),
            "no costs measured"
        );
        job.costs = crate::job::InterruptCosts {
            preemption_s: 0.2,
            reclaim_s_per_gib: 1.0,
            ..Default::default()
        };
        let p = predict(&job, &node, &[0], &ModelParams::default());
        // 0.5/s x 0.2 s + 0.1 GiB/s x 1 s/GiB = 0.2 of each second.
        assert!((p.interrupted - 0.2).abs() < 1e-12, "{p:?}");
        assert!((p.share - 0.5).abs() < 1e-12, "{p:?}");
        assert!(
            p.to_string()
                .contains("- interruptions 0.20 (0.50 preemptions/s"),
            "{p}"
        );
        let off = ModelParams {
            interruptions: false,
            ..ModelParams::default()
        };
        assert_eq!(
            predict(&job, &node, &[0], &off).share,
            0.7,
            "a baseline may ignore them"
        );
        job.costs.preemption_s = 10.0;
        assert_eq!(
            predict(&job, &node, &[0], &ModelParams::default()).share,
            0.0,
            "never below 0"
        );
    }

    #[test]
    fn held_time_the_job_does_not_lose_goes_back_into_its_share() {
        let node = NodeModel::uniform("n", vec![gpu(0, 0.4, 16 * GIB)], 1.0, 600);
        let mut job = profile(1);
        job.costs.held_overlap = 0.25;
        let p = predict(&job, &node, &[0], &ModelParams::default());
        // Idle 0.6, and a quarter of the 0.4 held comes back: 0.7.
        assert!((p.overlap - 0.1).abs() < 1e-12, "{p:?}");
        assert!((p.share - 0.7).abs() < 1e-12, "{p:?}");
        assert!(
            p.to_string()
                .contains("idle 0.60 + held time not lost 0.10"),
            "{p}"
        );
        let off = ModelParams {
            interruptions: false,
            ..ModelParams::default()
        };
        let base = predict(&job, &node, &[0], &off);
        assert_eq!(
            (base.overlap, base.share),
            (0.0, 0.6),
            "placement by idle fraction alone ignores it"
        );
        job.costs.held_overlap = 3.0;
        assert_eq!(
            predict(&job, &node, &[0], &ModelParams::default()).share,
            1.0,
            "never more than the whole GPU"
        );
    }

    #[test]
    fn the_nodes_speed_scales_the_share_within_zero_and_the_speed() {
        let node = NodeModel::uniform("n", vec![gpu(0, 0.3, 8 * GIB)], 1.0, 600);
        let job = profile(1);
        let params = ModelParams::default();
        let base = predict(&job, &node, &[0], &params);
        assert_eq!(base.speed, 1.0);
        assert!(!base.to_string().contains("speed"), "{base}");
        let slow = predict(&job, &node.clone().with_speed(0.78), &[0], &params);
        assert!((slow.share - base.share * 0.78).abs() < 1e-12, "{slow:?}");
        assert!((slow.per_s - base.per_s * 0.78).abs() < 1e-9);
        assert!((slow.unscaled_share() - base.share).abs() < 1e-12);
        assert!(
            slow.to_string().contains(" x speed 0.78 over 600 s"),
            "{slow}"
        );
        let quiet = NodeModel::uniform("q", vec![gpu(0, 0.0, 32 * GIB)], 1.0, 600);
        let fast = predict(&job, &quiet.with_speed(1.3), &[0], &params);
        assert!(
            (fast.share - 1.3).abs() < 1e-12,
            "above alone on a fast node: {fast:?}"
        );
        let broken = predict(&job, &node.with_speed(-1.0), &[0], &params);
        assert_eq!(broken.share, 0.0, "never below 0");
    }

    #[test]
    fn a_documents_counts_become_rates_over_the_measured_time() {
        let mut doc = crate::testutil::doc("n", 1, 0.2, 8 * GIB);
        let w = doc.gpus[0]
            .windows
            .iter_mut()
            .find(|w| w.window_s == 600)
            .unwrap();
        w.covered_s = 300.0;
        w.preemptions = 150;
        w.reclaimed_bytes = 30 * GIB;
        let params = ModelParams {
            window_s: 600,
            ..ModelParams::default()
        };
        let m = NodeModel::from_doc(&doc, &params);
        assert_eq!(
            m.gpus[0].preemptions_per_s, 0.5,
            "150 over the 300 s measured"
        );
        assert_eq!(m.gpus[0].reclaimed_gib_per_s, 0.1);
    }

    #[test]
    fn a_steady_gpu_predicts_alone_times_idle_times_the_curve() {
        let node = NodeModel::uniform("n", vec![gpu(0, 0.3, 8 * GIB)], 1.0, 600);
        let p = predict(&profile(1), &node, &[0], &ModelParams::default());
        // T(8 GiB) = 0.7; deficit (16-8)/16 = 0.5 at penalty 0.5.
        assert!((p.memory - 0.45).abs() < 1e-12, "{p:?}");
        assert!((p.share - 0.7 * 0.45).abs() < 1e-12);
        assert!((p.per_s - 31.5).abs() < 1e-9);
        assert!(p.aligned && p.min_alignment.is_none());
        assert!(
            p.to_string()
                .contains("of alone = idle 0.70 x memory 0.45 (one GPU) over 600 s"),
            "{p}"
        );
    }

    #[test]
    fn counting_points_on_from_the_last_quantile_gives_the_searched_share_bit_for_bit() {
        let mut rng = fastrand::Rng::with_seed(41);
        let mut checked = 0;
        for _ in 0..2000 {
            let mut job = profile(1);
            // Points on a coarse grid (ties common), ascending or, one time in five, not.
            let n = rng.usize(1..6);
            let mut mem: Vec<u64> = (0..n).map(|_| rng.u64(0..8) * GIB).collect();
            if rng.u8(0..5) != 0 {
                mem.sort_unstable();
            }
            job.curve = mem
                .iter()
                .map(|&m| crate::job::CurvePoint {
                    memory_bytes: m,
                    per_s: rng.f64() * 1500.0,
                })
                .collect();
            let mut points = Points::new(&job);
            // Mostly ascending lookups, on and between the points, some out of order.
            let mut m = 0;
            for _ in 0..30 {
                m = match rng.u8(0..6) {
                    0 => rng.u64(0..9 * GIB),
                    1 => m,
                    _ => m + rng.u64(0..GIB),
                };
                let got = points.share(m);
                assert_eq!(got.to_bits(), job.memory_share(m).to_bits(), "{m} {job:?}");
                checked += 1;
            }
        }
        assert!(checked > 50_000);
    }

    #[test]
    fn the_memory_factor_averages_the_curve_over_the_trace() {
        let mut job = profile(1);
        job.deficit_penalty = 0.0;
        // Half the time 16 GiB, half 4 GiB: the quantile steps straddle the jump once.
        let q: Vec<u64> = (0..QUANTILES)
            .map(|k| if k < 10 { 4 * GIB } else { 16 * GIB })
            .collect();
        let m = memory_factor(&job, &q, MemoryModel::Trace);
        assert!(
            (m - (9.0 * 0.4 + 0.7 + 10.0 * 1.0) / 20.0).abs() < 1e-12,
            "{m}"
        );
        job.deficit_penalty = 1.0;
        let with_penalty = memory_factor(&job, &q, MemoryModel::Trace);
        assert!(
            with_penalty < m,
            "dips below R cost more than the curve alone"
        );
        assert_eq!(
            memory_factor(&job, &[GIB; QUANTILES], MemoryModel::Trace),
            0.0,
            "cannot run"
        );
        assert_eq!(memory_factor(&job, &q, MemoryModel::Ignore), 1.0);
        assert_eq!(
            memory_factor(&job, &q, MemoryModel::StaticMin),
            0.4,
            "the dip, always"
        );
    }

    #[test]
    fn a_multi_gpu_job_is_admitted_only_where_every_pair_aligns() {
        let params = ModelParams::default();
        let gpus = (0..4).map(|i| gpu(i, 0.2, 32 * GIB)).collect();
        let mut node = NodeModel::uniform("n", gpus, 0.9, 600);
        node.set_pair(1, 3, 0.4, 0.35);
        let ok = predict(&profile(2), &node, &[0, 1], &params);
        assert!(ok.aligned && (ok.share - 0.8).abs() < 1e-12, "{ok:?}");
        let bad = predict(&profile(3), &node, &[0, 1, 3], &params);
        assert!(!bad.aligned);
        assert_eq!(bad.share, 0.0);
        assert_eq!(bad.min_alignment, Some(0.4));
        assert!(
            (bad.idle - 0.65).abs() < 1e-12,
            "the pair's union bounds idle"
        );
        assert!(bad.to_string().contains("not aligned (worst pair 0.40)"));
        let blind = ModelParams {
            alignment: false,
            ..params
        };
        let p = predict(&profile(3), &node, &[0, 1, 3], &blind);
        assert!(
            p.aligned && (p.share - 0.8).abs() < 1e-12,
            "idle fraction alone: {p:?}"
        );
    }

    #[test]
    fn unknown_pairs_align_only_between_quiet_gpus() {
        let params = ModelParams::default();
        let doc = valve_harvest::NodeHarvest {
            version: 1,
            node: "n".into(),
            generated_unix_ms: 0,
            source: "test".into(),
            gpus: [0.0, 0.01, 0.5]
                .iter()
                .enumerate()
                .map(|(i, &busy)| valve_harvest::GpuHarvest {
                    index: i as u32,
                    name: None,
                    memory_total_bytes: 80 * GIB,
                    windows: vec![valve_harvest::GpuWindow {
                        window_s: 600,
                        covered_s: 600.0,
                        busy_fraction: busy,
                        preemptions: 0,
                        reclaimed_bytes: 0,
                        reclaim_episodes: 0,
                        offline_memory: valve_harvest::MemoryStats {
                            samples: 1,
                            mean_bytes: 40 * GIB,
                            quantiles_bytes: vec![40 * GIB; QUANTILES],
                        },
                    }],
                })
                .collect(),
            pairs: vec![],
            jobs: vec![],
        };
        let node = NodeModel::from_doc(&doc, &params);
        assert_eq!(
            node.window_s, 600,
            "the only window, though shorter than asked"
        );
        assert_eq!(node.score(0, 1, &params), 1.0);
        assert_eq!(node.score(0, 2, &params), 0.0);
    }

    #[test]
    fn the_window_is_the_longest_one_measured_well_enough() {
        let params = ModelParams::default();
        let mut doc = crate::testutil::doc("n", 1, 0.2, 40 * GIB);
        let w = &mut doc.gpus[0].windows;
        assert_eq!(
            w.iter().map(|w| w.window_s).collect::<Vec<_>>(),
            [60, 600, 3600]
        );
        w[2].covered_s = 1000.0; // a young daemon: the hour is under half measured
        assert_eq!(choose_window(&doc, &params), 600);
        let mut short = params;
        short.window_s = 60;
        assert_eq!(choose_window(&doc, &short), 60);
    }
}
