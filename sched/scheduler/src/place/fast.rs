//! The fast placement pass: per job, a bounded search over the nodes most likely to serve it,
//! found through an index of nodes by the idle time of their free sets, kept up to date.
//!
//! A job walks the index of its size ([`NodeIndex`]) from the top and stops as the exhaustive
//! pass does (no later node can beat the best found, or meet the SLA), or earlier: once
//! `candidates` nodes met its SLA, or after `visits` nodes evaluated (`scan` looked at). A node
//! that a cheap bound on the job's memory factor rules out is not evaluated. The search may miss
//! a better node further down; the comparison with the exhaustive pass (`compare.rs`) measures
//! what that costs. A job left pending is told the best place among the nodes evaluated, not
//! over the whole cluster.

use std::collections::HashMap;

use serde::Serialize;

use super::bound::Curve;
use super::cache::MemoryCache;
use super::index::NodeIndex;
use super::search::{best_set, Hints};
use super::{order_jobs, Decision, NodeSlot, Outcome, Pending, PendingJob, PlaceParams, Placement};
use crate::predict::{MemoryModel, Prediction};

/// Nodes still looked at, once the index falls below a job's SLA with nothing found yet, to
/// name the best place it could get.
const REPORT_VISITS: usize = 4;

/// How far a job's search goes (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FastLimits {
    /// Nodes meeting the job's SLA after which the search takes the best of them.
    pub candidates: usize,
    /// Nodes evaluated at most per job.
    pub visits: usize,
    /// Nodes looked at most per job, those the cheap bound rules out included.
    pub scan: usize,
}

impl Default for FastLimits {
    fn default() -> Self {
        FastLimits {
            candidates: 32,
            visits: 512,
            scan: 4096,
        }
    }
}

/// Why a job's search ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// No later node could beat the best found or meet the SLA (as the exhaustive pass stops).
    Bound,
    /// `candidates` nodes met the SLA.
    Candidates,
    /// `visits` nodes were evaluated, or `scan` looked at.
    Visits,
    /// The index ran out.
    Exhausted,
    /// Nothing met the SLA, and the index fell below it.
    BelowSla,
    /// A job of the same class and SLA had found nothing: so did this one.
    Repeated,
}

/// Places `jobs` on `nodes` (see the module documentation), in the exhaustive pass's order and
/// with its rule for repeated jobs: a (class, SLA) that found nothing finds nothing later.
pub(super) fn place(
    jobs: &[PendingJob],
    nodes: &mut [NodeSlot],
    params: &PlaceParams,
    limits: FastLimits,
) -> Vec<Decision> {
    place_traced(jobs, nodes, params, limits).0
}

/// [`place`], with why each job's search ended (in the decisions' order).
pub(super) fn place_traced(
    jobs: &[PendingJob],
    nodes: &mut [NodeSlot],
    params: &PlaceParams,
    limits: FastLimits,
) -> (Vec<Decision>, Vec<Stop>) {
    let mut sizes: Vec<usize> = jobs.iter().map(|j| j.profile.gpus as usize).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut pass = Pass::new(nodes, params, limits, &sizes);
    let mut failed: HashMap<(u64, u64), Pending> = HashMap::new();
    let mut decisions = Vec::with_capacity(jobs.len());
    let mut stops = Vec::with_capacity(jobs.len());
    for job in order_jobs(jobs) {
        let key = (job.class, job.sla.to_bits());
        let outcome = match failed.get(&key) {
            Some(p) if job.avoid.is_empty() => {
                stops.push(Stop::Repeated);
                Outcome::Pending(p.clone())
            }
            _ => {
                let (o, stop) = pass.place_one(job);
                stops.push(stop);
                o
            }
        };
        if let (Outcome::Pending(p), true) = (&outcome, job.avoid.is_empty()) {
            failed.insert(key, p.clone());
        }
        decisions.push(Decision {
            job: job.id.clone(),
            outcome,
        });
    }
    (decisions, stops)
}

/// The state of one fast pass.
struct Pass<'a> {
    nodes: &'a mut [NodeSlot],
    params: &'a PlaceParams,
    limits: FastLimits,
    /// Free GPUs per node.
    free_count: Vec<usize>,
    index: NodeIndex,
    cache: MemoryCache,
    /// Per GPU position of the node being looked at: a bound on the job's share alone there.
    solo: Vec<f64>,
}

impl<'a> Pass<'a> {
    fn new(
        nodes: &'a mut [NodeSlot],
        params: &'a PlaceParams,
        limits: FastLimits,
        sizes: &[usize],
    ) -> Self {
        let free_count = nodes
            .iter()
            .map(|n| n.free.iter().filter(|&&f| f).count())
            .collect();
        let cache = MemoryCache::new(nodes.iter().map(|n| n.model.gpus.len()));
        let index = NodeIndex::new(nodes, sizes, &params.model);
        Pass {
            nodes,
            params,
            limits,
            free_count,
            index,
            cache,
            solo: Vec::new(),
        }
    }

    /// The best place among the nodes the job's search reaches, taken if it meets the SLA.
    fn place_one(&mut self, job: &PendingJob) -> (Outcome, Stop) {
        let k = job.profile.gpus as usize;
        let needed = job.sla + self.params.margin;
        let curve = Curve::new(&job.profile);
        let mut best: Option<(usize, Vec<usize>, Prediction)> = None;
        let (mut considered, mut evaluated, mut met, mut below) = (0, 0, 0, 0);
        let mut stop = Stop::Exhausted;
        for (scanned, (n, bound)) in self.index.walk(k).enumerate() {
            match &best {
                Some((_, _, b)) if bound <= b.share || bound < needed => {
                    stop = Stop::Bound;
                    break;
                }
                None if bound < needed => {
                    below += 1;
                    if below > REPORT_VISITS {
                        stop = Stop::BelowSla;
                        break;
                    }
                }
                _ => {}
            }
            if scanned >= self.limits.scan {
                stop = Stop::Visits;
                break;
            }
            let slot = &self.nodes[n];
            if job.avoid.iter().any(|a| a == &slot.model.name) {
                continue;
            }
            considered += 1;
            let floor = best.as_ref().map_or(-1.0, |(_, _, b)| b.share);
            if best.is_some() {
                let quick = quick_bound(&mut self.solo, slot, self.params, job, &curve, bound);
                if quick <= floor || quick < needed {
                    continue; // cannot beat the best found, or meet the SLA
                }
            }
            evaluated += 1;
            let ties_lose = best
                .as_ref()
                .is_some_and(|(bn, _, _)| self.free_count[n] >= self.free_count[*bn]);
            let c = match self.cache.find(n, job.class) {
                Some(c) => c,
                None => self.cache.insert(n, job.class),
            };
            let hints = Hints {
                curve: &curve,
                bounds: None,
                ties_lose,
            };
            let memory = self.cache.factors_mut(n, c);
            if let Some((set, pred)) = best_set(job, slot, memory, self.params, floor, &hints) {
                met += usize::from(pred.share >= needed);
                let better = best.as_ref().is_none_or(|(bn, _, bp)| {
                    pred.share > bp.share
                        || (pred.share == bp.share && self.free_count[n] < self.free_count[*bn])
                });
                if better {
                    best = Some((n, set, pred));
                }
            }
            if met >= self.limits.candidates {
                stop = Stop::Candidates;
                break;
            }
            if evaluated >= self.limits.visits {
                stop = Stop::Visits;
                break;
            }
        }
        let Some((n, set, prediction)) = best else {
            let gpus = job.profile.gpus;
            let pending = Pending::NoFreeGpus {
                gpus,
                nodes: considered,
            };
            return (Outcome::Pending(pending), stop);
        };
        (self.take(job, n, set, prediction), stop)
    }

    /// Gives `set` on node `n` to `job` if `prediction` meets its SLA, and moves the node in
    /// the indexes.
    fn take(
        &mut self,
        job: &PendingJob,
        n: usize,
        set: Vec<usize>,
        prediction: Prediction,
    ) -> Outcome {
        let needed = job.sla + self.params.margin;
        let slot = &self.nodes[n];
        let placement = Placement {
            node: slot.model.name.clone(),
            gpus: set.iter().map(|&p| slot.model.gpus[p].index).collect(),
            prediction,
        };
        if placement.prediction.share < needed {
            return Outcome::Pending(Pending::BelowSla {
                needed,
                best: placement,
            });
        }
        for &p in &set {
            self.nodes[n].free[p] = false;
        }
        self.free_count[n] -= set.len();
        self.index.update(n, &self.nodes[n], &self.params.model);
        Outcome::Placed(placement)
    }
}

/// At least `job`'s share on any k-GPU set of the free GPUs of `slot`: the k-th largest over
/// them of idle x the most its curve gives with the GPU's largest memory x speed (a set scores
/// at most its worst GPU alone), capped by the index's `bound`. `solo` is scratch space.
fn quick_bound(
    solo: &mut Vec<f64>,
    slot: &NodeSlot,
    params: &PlaceParams,
    job: &PendingJob,
    curve: &Curve,
    bound: f64,
) -> f64 {
    let k = job.profile.gpus as usize;
    let speed = slot.model.speed;
    if params.model.memory == MemoryModel::Ignore || speed.is_nan() || speed < 0.0 {
        return bound;
    }
    solo.clear();
    for (g, _) in slot.model.gpus.iter().zip(&slot.free).filter(|(_, &f)| f) {
        let top = g.memory_quantiles.last().copied().unwrap_or(0);
        solo.push((1.0 - g.busy) * curve.at_most(top) * speed);
    }
    if solo.iter().any(|x| x.is_nan()) || solo.len() < k.max(1) {
        return bound;
    }
    solo.sort_by(|a, b| b.total_cmp(a));
    solo[k.max(1) - 1].min(bound)
}
