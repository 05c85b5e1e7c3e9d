//! Placement: each pending job goes to the free GPUs where its predicted throughput is highest,
//! if that meets its SLA; otherwise it stays pending with the reason and the best it could get.
//!
//! Jobs are taken hardest first (highest SLA, then most GPUs, then submission order), so easy
//! jobs do not take the only GPUs a demanding one could use. Three passes share that rule and
//! differ in how far they search ([`PassKind`]):
//! - the fast pass (the default, `fast.rs`) walks an index of nodes by the idle time of their
//!   free GPUs (or, for a family of classes with many jobs, by a bound on that family's share) and stops
//!   after a bounded number of candidates per job;
//! - the exact pass (below) searches as far as the exhaustive one, but computes memory factors
//!   ([`cache`]) only where bounds ([`bound`]) do not show that a node cannot change the decision;
//! - the exhaustive pass (`reference.rs`), the reference both are measured against.
//!
//! The exact pass decides as the exhaustive one, decision for decision; the fast one may pick
//! other GPUs (`compare.rs` measures the harvest that costs).

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use crate::job::JobProfile;
use crate::predict::{MemoryModel, ModelParams, NodeModel, Prediction};

mod bound;
mod cache;
mod class_index;
pub mod compare;
mod family;
mod fast;
mod index;
mod reference;
mod search;

pub use fast::FastLimits;

use bound::{may_exceed, non_negative, with_overlap, Curve, Free, NodeSummary};
use cache::MemoryCache;
use search::{best_set, Hints};

/// Placement settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PlaceParams {
    /// The throughput model's settings.
    pub model: ModelParams,
    /// A job is placed only where its predicted share is at least `sla + margin` (headroom for
    /// the model's error).
    pub margin: f64,
    /// The most GPU sets evaluated per job and node (multi-GPU jobs); the search keeps the best
    /// found by then.
    pub max_combinations: usize,
    /// Which pass places the jobs.
    pub pass: PassKind,
}

impl Default for PlaceParams {
    fn default() -> Self {
        PlaceParams {
            model: ModelParams::default(),
            margin: 0.05,
            max_combinations: 256,
            pass: PassKind::Fast(FastLimits::default()),
        }
    }
}

/// Which placement pass runs (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PassKind {
    /// A bounded search per job over an index of nodes.
    Fast(FastLimits),
    /// The exhaustive pass's decisions, with bounds that skip nodes that cannot change them.
    Exact,
    /// The exhaustive pass.
    Reference,
}

impl PassKind {
    /// The pass called `name`: `fast`, `exact` or `reference`.
    pub fn parse(name: &str) -> Result<PassKind, String> {
        match name {
            "fast" => Ok(PassKind::Fast(FastLimits::default())),
            "exact" => Ok(PassKind::Exact),
            "reference" => Ok(PassKind::Reference),
            _ => Err(format!(
                "unknown pass {name:?}: use fast (the default), exact or reference"
            )),
        }
    }

    /// Its name, as [`PassKind::parse`] reads it.
    pub fn name(&self) -> &'static str {
        match self {
            PassKind::Fast(_) => "fast",
            PassKind::Exact => "exact",
            PassKind::Reference => "reference",
        }
    }
}

/// A job waiting for a place.
#[derive(Clone, Debug)]
pub struct PendingJob {
    /// The engine's id for it.
    pub id: String,
    /// Its profile.
    pub profile: Arc<JobProfile>,
    /// Jobs with equal `class` have equal profiles (the memory factor cache's key).
    pub class: u64,
    /// Its SLA: the share of throughput alone it must keep.
    pub sla: f64,
    /// Nodes it must not go to (it was evicted from them).
    pub avoid: Vec<String>,
    /// Lower is older.
    pub order: u64,
}

/// A node open to placement.
#[derive(Clone, Debug)]
pub struct NodeSlot {
    /// Its harvest, as the model reads it.
    pub model: NodeModel,
    /// Per GPU position: free for an offline job.
    pub free: Vec<bool>,
}

/// Where a job goes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Placement {
    /// The node.
    pub node: String,
    /// GPU indices on the node.
    pub gpus: Vec<u32>,
    /// What the model predicts there.
    pub prediction: Prediction,
}

/// Why a job stays pending.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Pending {
    /// No node had enough free GPUs.
    NoFreeGpus {
        /// GPUs it needs.
        gpus: u32,
        /// Nodes considered.
        nodes: usize,
    },
    /// Every free GPU set fell short of the SLA; the best one is named.
    BelowSla {
        /// The SLA plus the margin.
        needed: f64,
        /// The best place found.
        best: Placement,
    },
}

/// A decision for one job.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Placed here.
    Placed(Placement),
    /// Left pending.
    Pending(Pending),
}

/// The decision for a job, with the job's id.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// The job.
    pub job: String,
    /// What was decided.
    pub outcome: Outcome,
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.outcome {
            Outcome::Placed(p) => write!(
                f,
                "job {}: placed on {} GPUs {:?}: predicted {}",
                self.job, p.node, p.gpus, p.prediction
            ),
            Outcome::Pending(Pending::NoFreeGpus { gpus, nodes }) => write!(
                f,
                "job {}: pending: none of {nodes} open nodes has {gpus} free GPU(s)",
                self.job
            ),
            Outcome::Pending(Pending::BelowSla { needed, best }) => write!(
                f,
                "job {}: pending: no free GPUs meet its SLA (needs {needed:.2} of alone); best: {} GPUs {:?}, predicted {}",
                self.job, best.node, best.gpus, best.prediction
            ),
        }
    }
}

/// Places `jobs` on `nodes` with the pass `params.pass` names, marking the GPUs it gives away as
/// taken. Returns one decision per job, in the order the jobs were considered.
pub fn place(jobs: &[PendingJob], nodes: &mut [NodeSlot], params: &PlaceParams) -> Vec<Decision> {
    match params.pass {
        PassKind::Fast(limits) => fast::place(jobs, nodes, params, limits),
        PassKind::Exact => place_exact(jobs, nodes, params),
        PassKind::Reference => reference::place(jobs, nodes, params),
    }
}

/// The jobs in the order every pass considers them: highest SLA, then most GPUs, then oldest.
fn order_jobs(jobs: &[PendingJob]) -> Vec<&PendingJob> {
    let mut order: Vec<&PendingJob> = jobs.iter().collect();
    order.sort_by(|a, b| {
        b.sla
            .total_cmp(&a.sla)
            .then(b.profile.gpus.cmp(&a.profile.gpus))
            .then(a.order.cmp(&b.order))
    });
    order
}

/// The exact pass (see the module documentation).
fn place_exact(jobs: &[PendingJob], nodes: &mut [NodeSlot], params: &PlaceParams) -> Vec<Decision> {
    let mut pass = Pass::new(nodes, params);
    // A (class, SLA) job that found nothing, without nodes to avoid: the same job after it finds
    // nothing either, since nodes only fill up during a pass.
    let mut failed: HashMap<(u64, u64), Pending> = HashMap::new();
    let mut decisions = Vec::with_capacity(jobs.len());
    for job in order_jobs(jobs) {
        let key = (job.class, job.sla.to_bits());
        let outcome = match failed.get(&key) {
            Some(p) if job.avoid.is_empty() => Outcome::Pending(p.clone()),
            _ => pass.place_one(job),
        };
        if let (Outcome::Pending(p), true) = (&outcome, job.avoid.is_empty()) {
            failed.insert(key, p.clone());
        }
        decisions.push(Decision {
            job: job.id.clone(),
            outcome,
        });
    }
    decisions
}

/// The state of one placement pass.
struct Pass<'a> {
    nodes: &'a mut [NodeSlot],
    params: &'a PlaceParams,
    /// Free GPUs per node.
    free_count: Vec<usize>,
    /// The most idle time any GPU of the node has: no job can be predicted more there.
    bound: Vec<f64>,
    /// Node positions, highest bound first.
    by_bound: Vec<usize>,
    /// Per node, over all its GPUs: the most idle time and the largest memory (the quick
    /// bound's first step).
    tops: Vec<(f64, u64)>,
    /// Per node: its GPUs' memory traces summarised, for bounds.
    summaries: Vec<NodeSummary>,
    cache: MemoryCache,
    /// Per GPU position of the node last ruled on: a bound on its share alone (-inf where not
    /// looked at: it cannot beat the floor).
    bounds: Vec<f64>,
    /// The fastest node's speed (at least 1): a job that keeps part of its held time gets at
    /// most its held overlap x that more than `bound` says on a later node
    /// ([`bound::lift_bound`]).
    fastest: f64,
}

impl<'a> Pass<'a> {
    fn new(nodes: &'a mut [NodeSlot], params: &'a PlaceParams) -> Self {
        let free_count: Vec<usize> = nodes
            .iter()
            .map(|n| n.free.iter().filter(|&&f| f).count())
            .collect();
        let bound: Vec<f64> = nodes
            .iter()
            .map(|n| {
                n.model
                    .gpus
                    .iter()
                    .map(|g| 1.0 - g.busy)
                    .fold(0.0, f64::max)
                    * n.model.speed
            })
            .collect();
        let mut by_bound: Vec<usize> = (0..nodes.len()).collect();
        by_bound.sort_by(|&a, &b| bound[b].total_cmp(&bound[a]));
        // The same folds, in the same order, as the quick bound's first step.
        let tops = nodes
            .iter()
            .map(|n| {
                n.model.gpus.iter().fold((0.0f64, 0u64), |(i, m), g| {
                    let top = bound::largest(&g.memory_quantiles);
                    (i.max(1.0 - g.busy), m.max(top))
                })
            })
            .collect();
        let summaries = nodes
            .iter()
            .map(|n| NodeSummary::new(&n.model, &n.free, &params.model))
            .collect();
        let cache = MemoryCache::new(nodes.iter().map(|n| n.model.gpus.len()));
        let fastest = nodes.iter().map(|n| n.model.speed).fold(1.0, f64::max);
        Pass {
            fastest,
            nodes,
            params,
            free_count,
            bound,
            by_bound,
            tops,
            summaries,
            cache,
            bounds: Vec::new(),
        }
    }

    /// The best place for one job, taken if it meets the SLA. Nodes are visited from the idlest
    /// down; the search stops where no later node could beat the best found, or (once one was
    /// found) meet the SLA. Nodes that cannot change the best found are not evaluated
    /// ([`Pass::visit`]).
    fn place_one(&mut self, job: &PendingJob) -> Outcome {
        let k = job.profile.gpus as usize;
        let needed = job.sla + self.params.margin;
        let curve = Curve::new(&job.profile);
        let mut best: Option<(usize, Vec<usize>, Prediction)> = None;
        let mut considered = 0;
        let o = bound::held_overlap(&job.profile, &self.params.model);
        for i in 0..self.by_bound.len() {
            let n = self.by_bound[i];
            if let Some((_, _, b)) = &best {
                let bound = bound::lift_bound(o, self.bound[n], self.fastest);
                if bound <= b.share || bound < needed {
                    break;
                }
            }
            if self.free_count[n] < k || job.avoid.iter().any(|a| a == &self.nodes[n].model.name) {
                continue;
            }
            considered += 1;
            let floor = best.as_ref().map(|(_, _, b)| b.share);
            let Some((slot, marked)) = self.visit(job, &curve, n, floor, needed) else {
                continue;
            };
            let hints = Hints {
                curve: &curve,
                bounds: marked.then_some(&self.bounds[..]),
                ties_lose: best
                    .as_ref()
                    .is_some_and(|(bn, _, _)| self.free_count[n] >= self.free_count[*bn]),
            };
            let memory = self.cache.factors_mut(n, slot);
            let floor = floor.unwrap_or(-1.0);
            let Some((set, pred)) =
                best_set(job, &self.nodes[n], memory, self.params, floor, &hints)
            else {
                continue;
            };
            let better = best.as_ref().is_none_or(|(bn, _, bp)| {
                pred.share > bp.share
                    || (pred.share == bp.share && self.free_count[n] < self.free_count[*bn])
            });
            if better {
                best = Some((n, set, pred));
            }
        }
        let Some((n, set, prediction)) = best else {
            return Outcome::Pending(Pending::NoFreeGpus {
                gpus: job.profile.gpus,
                nodes: considered,
            });
        };
        self.take(job, n, set, prediction)
    }

    /// Gives `set` on node `n` to `job` if `prediction` meets its SLA.
    fn take(
        &mut self,
        job: &PendingJob,
        n: usize,
        set: Vec<usize>,
        prediction: Prediction,
    ) -> Outcome {
        let needed = job.sla + self.params.margin;
        let slot = &mut self.nodes[n];
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
            slot.free[p] = false;
        }
        self.summaries[n].take(&set);
        self.free_count[n] -= set.len();
        if self.free_count[n] == 0 {
            self.by_bound.retain(|&x| x != n); // full: no later job needs to look at it
        }
        Outcome::Placed(placement)
    }

    /// Whether `job` is to be evaluated on node `n`, given the best share found so far
    /// (`floor`; `None`: nothing found yet): the cache slot of its class to evaluate it with,
    /// and whether `self.bounds` holds its GPUs' bounds.
    ///
    /// The class is remembered on the node exactly where the reference pass remembered it
    /// (always while nothing is found; then where it was remembered already or the quick bound
    /// exceeds the bar), since that decides whether the quick bound is consulted for the next
    /// job of the class. A node that passes is still not evaluated where a bound shows that it
    /// has fewer than k free GPUs whose share alone beats the floor: `best_set` would return
    /// nothing there.
    fn visit(
        &mut self,
        job: &PendingJob,
        curve: &Curve,
        n: usize,
        floor: Option<f64>,
        needed: f64,
    ) -> Option<(usize, bool)> {
        let slot = match self.cache.find(n, job.class) {
            Some(s) => s,
            None => {
                if let Some(f) = floor {
                    let bar = f.max(needed - 1e-12);
                    if !self.quick_pass(curve, n, bar) {
                        return None; // cannot beat the best found, or meet the SLA
                    }
                }
                self.cache.insert(n, job.class)
            }
        };
        let Some(f) = floor else {
            return Some((slot, false));
        };
        match self.cannot_beat(job, curve, n, slot, f) {
            Verdict::Skip => None,
            Verdict::Evaluate => Some((slot, false)),
            Verdict::EvaluateWithBounds => Some((slot, true)),
        }
    }

    /// Whether the quick bound (`quick_bound`) exceeds `bar` on node `n`, with fewer look-ups
    /// where the node's speed is a finite number >= 0: the same first step, then the free GPUs
    /// idlest first, stopping at the first whose idle x curve x speed exceeds the bar (the bound
    /// is their largest, or 0 if larger, times the speed) or whose idle x speed does not (the
    /// curve is at most 1, so no later GPU can).
    fn quick_pass(&self, curve: &Curve, n: usize, bar: f64) -> bool {
        let slot = &self.nodes[n];
        let speed = slot.model.speed;
        if !(speed >= 0.0 && speed.is_finite()) {
            return may_exceed(
                quick_bound(curve, slot, self.tops[n], self.params, bar),
                bar,
            );
        }
        let o = bound::held_overlap(curve.profile(), &self.params.model);
        let ignore = self.params.model.memory == MemoryModel::Ignore;
        if !ignore {
            let (idle, memory) = self.tops[n];
            if with_overlap(o, idle) * curve.at_most(memory) * speed <= bar {
                return false;
            }
        }
        if 0.0 * speed > bar {
            return true;
        }
        let summary = &self.summaries[n];
        for g in &summary.by_idle {
            // The idle term grows with idle time: GPUs idlest first are the highest first.
            let idle = with_overlap(o, g.idle);
            let top = if ignore { 1.0 } else { curve.at_most(g.top) };
            if idle * top * speed > bar {
                return true;
            }
            if idle * speed <= bar {
                return false;
            }
        }
        false
    }

    /// Whether fewer than k free GPUs of node `n` can score more than `floor` alone (so that
    /// `best_set` returns nothing): by the ceiling cached for the class, else GPU by GPU, idlest
    /// first ([`Curve::gpu_bound`]; exact where the factor is cached), until the GPUs' idle time
    /// alone rules out the rest. A node ruled out gets `floor` as its ceiling.
    fn cannot_beat(
        &mut self,
        job: &PendingJob,
        curve: &Curve,
        n: usize,
        slot: usize,
        floor: f64,
    ) -> Verdict {
        if self.cache.ceiling(n, slot) <= floor {
            return Verdict::Skip;
        }
        let speed = self.nodes[n].model.speed;
        let summary = &self.summaries[n];
        let k = job.profile.gpus as usize;
        if !(speed >= 0.0 && speed.is_finite()) || summary.odd || k == 0 {
            return Verdict::Evaluate;
        }
        let mm = self.params.model.memory;
        let memory = self.cache.factors_mut(n, slot);
        self.bounds.clear();
        self.bounds.resize(summary.gpus.len(), f64::NEG_INFINITY);
        let mut above = 0;
        let o = bound::held_overlap(&job.profile, &self.params.model);
        for &Free { idle, p, .. } in &summary.by_idle {
            if with_overlap(o, non_negative(idle)) * speed <= floor {
                break; // a factor is at most 1: no GPU from here on scores more
            }
            let u = curve.gpu_bound(&summary.gpus[p], memory[p], speed, mm, floor, o);
            if may_exceed(u, floor) {
                if k == 1 {
                    return Verdict::Evaluate;
                }
                self.bounds[p] = u;
                above += 1;
            }
        }
        if above >= k {
            return Verdict::EvaluateWithBounds;
        }
        self.cache.lower_ceiling(n, slot, floor);
        Verdict::Skip
    }
}

/// What [`Pass::cannot_beat`] found.
enum Verdict {
    /// The node cannot change the job's best place.
    Skip,
    /// It may.
    Evaluate,
    /// It may; `Pass::bounds` holds a bound on each GPU's share alone (multi-GPU jobs).
    EvaluateWithBounds,
}

/// The reference pass's quick bound, bit for bit, from the node's precomputed `tops` and the
/// job's prepared curve: idle x the most the curve gives with the GPU's largest memory, on any
/// free GPU. The node's idlest GPU with its largest memory bounds that in one curve look-up,
/// tried first.
fn quick_bound(
    curve: &Curve,
    slot: &NodeSlot,
    tops: (f64, u64),
    params: &PlaceParams,
    bar: f64,
) -> f64 {
    let speed = slot.model.speed;
    let o = bound::held_overlap(curve.profile(), &params.model);
    if params.model.memory != MemoryModel::Ignore {
        let (idle, memory) = tops;
        let coarse = with_overlap(o, idle) * curve.at_most(memory) * speed;
        if coarse <= bar {
            return coarse;
        }
    }
    let mut bound: f64 = 0.0;
    for (g, &free) in slot.model.gpus.iter().zip(&slot.free) {
        if free {
            let memory = match params.model.memory {
                MemoryModel::Ignore => 1.0,
                _ => curve.at_most(bound::largest(&g.memory_quantiles)),
            };
            bound = bound.max(with_overlap(o, 1.0 - g.busy) * memory);
        }
    }
    bound * speed
}

#[cfg(test)]
mod tests;
