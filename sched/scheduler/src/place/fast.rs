//! The fast placement pass: per job, a bounded search over the nodes most likely to serve it,
//! found through an index of nodes by the idle time of their free sets, kept up to date.
//!
//! A job walks the index of its size ([`NodeIndex`]) from the top and stops as the exhaustive
//! pass does (no later node can beat the best found, or meet the SLA), or earlier: once
//! `candidates` nodes met its SLA, or after `visits` nodes evaluated (`scan` looked at). A node
//! that a cheap bound on the job's memory factor rules out is not evaluated. The search may miss
//! a better node further down; the comparison with the exhaustive pass (`compare.rs`) measures
//! what that costs. A job left pending is told the best place among the nodes evaluated, not
//! over the whole cluster. A family of job classes (profiles of one shape, [`Families`]: a
//! class alone, or a profile at its learned levels) whose jobs have looked at more nodes than its
//! own index costs walks that instead ([`ClassIndex`]): nodes by a bound on the family's share
//! that counts memory, so the walk meets the nodes that can serve it first and stops sooner.

use std::collections::HashMap;

use serde::Serialize;

use super::bound::{non_negative, Curve, GpuSummary, Trace};
use super::cache::MemoryCache;
use super::class_index::ClassIndex;
use super::family::Families;
use super::index::NodeIndex;
use super::search::{best_set, Hints};
use super::{order_jobs, Decision, NodeSlot, Outcome, Pending, PendingJob, PlaceParams, Placement};
use crate::predict::{memory_factor, MemoryModel, Prediction};

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
    /// Families of job classes at most with an index of their own at once (0: none).
    pub class_indexes: usize,
}

impl Default for FastLimits {
    fn default() -> Self {
        FastLimits {
            candidates: 32,
            visits: 512,
            scan: 4096,
            class_indexes: 256,
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
    let families = Families::new(jobs);
    let mut pass = Pass::new(nodes, params, limits, &sizes, families);
    let mut failed: HashMap<(u64, u64), Pending> = HashMap::new();
    let mut decisions = Vec::with_capacity(jobs.len());
    let mut stops = Vec::with_capacity(jobs.len());
    let mut left = vec![0usize; pass.families.all.len()];
    for job in jobs {
        left[pass.families.of(job.class)] += 1;
    }
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
        let family = pass.families.of(job.class);
        left[family] -= 1;
        if left[family] == 0 {
            pass.forget_family(family);
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
    /// Per node: how many times its GPUs were given away in this pass (class indexes compare it).
    versions: Vec<u32>,
    index: NodeIndex,
    /// Per job class with an index of its own: the index.
    classes: HashMap<usize, ClassIndex>,
    /// The jobs' classes by shape: a class index serves a family ([`Families`]).
    families: Families,
    /// The index of a family none of whose jobs is left, whose buffers the next one reuses.
    spare: Option<ClassIndex>,
    /// Per family: nodes its jobs looked at in the index of their size so far.
    scanned: HashMap<usize, usize>,
    cache: MemoryCache,
    /// Per node and GPU position: its idle time, largest memory and trace summary, for the
    /// quick bound; made the first time the node is bounded (empty before).
    gpus: Vec<Vec<GpuSummary>>,
    /// Per GPU position of the node being looked at: a bound on the job's share alone there.
    solo: Vec<f64>,
    /// Node positions by name, made for the first job with nodes to avoid.
    by_name: HashMap<String, usize>,
}

/// How far one job's search has got.
struct Search<'j> {
    job: &'j PendingJob,
    curve: Curve<'j>,
    /// The positions of the nodes the job avoids (its names looked up once, not per node met).
    avoid: Vec<usize>,
    /// The SLA with the margin.
    needed: f64,
    best: Option<(usize, Vec<usize>, Prediction)>,
    considered: usize,
    evaluated: usize,
    met: usize,
    below: usize,
}

impl<'a> Pass<'a> {
    fn new(
        nodes: &'a mut [NodeSlot],
        params: &'a PlaceParams,
        limits: FastLimits,
        sizes: &[usize],
        families: Families,
    ) -> Self {
        let free_count = nodes
            .iter()
            .map(|n| n.free.iter().filter(|&&f| f).count())
            .collect();
        let cache = MemoryCache::new(nodes.iter().map(|n| n.model.gpus.len()));
        let index = NodeIndex::new(nodes, sizes, &params.model);
        let gpus = nodes.iter().map(|_| Vec::new()).collect();
        Pass {
            versions: vec![0; nodes.len()],
            nodes,
            params,
            limits,
            free_count,
            index,
            classes: HashMap::new(),
            families,
            spare: None,
            scanned: HashMap::new(),
            cache,
            gpus,
            solo: Vec::new(),
            by_name: HashMap::new(),
        }
    }

    /// The positions of the nodes `job` avoids.
    fn avoided(&mut self, job: &PendingJob) -> Vec<usize> {
        if job.avoid.is_empty() {
            return Vec::new();
        }
        if self.by_name.is_empty() {
            let names = self.nodes.iter().enumerate();
            self.by_name = names.map(|(n, s)| (s.model.name.clone(), n)).collect();
        }
        if self.by_name.len() < self.nodes.len() {
            // Nodes of one name: every one of them is avoided, as by name.
            let names = self.nodes.iter().enumerate();
            let mut avoid = names.filter(|(_, s)| job.avoid.contains(&s.model.name));
            return avoid.by_ref().map(|(n, _)| n).collect();
        }
        let by_name = &self.by_name;
        job.avoid
            .iter()
            .filter_map(|a| by_name.get(a).copied())
            .collect()
    }

    /// The best place among the nodes the job's search reaches, taken if it meets the SLA.
    fn place_one(&mut self, job: &PendingJob) -> (Outcome, Stop) {
        let mut s = Search {
            job,
            curve: Curve::new(&job.profile),
            avoid: self.avoided(job),
            needed: job.sla + self.params.margin,
            best: None,
            considered: 0,
            evaluated: 0,
            met: 0,
            below: 0,
        };
        let stop = if self.class_index(&s) {
            self.walk_class(&mut s)
        } else {
            self.walk_size(&mut s)
        };
        let Some((n, set, prediction)) = s.best else {
            let gpus = job.profile.gpus;
            let pending = Pending::NoFreeGpus {
                gpus,
                nodes: s.considered,
            };
            return (Outcome::Pending(pending), stop);
        };
        (self.take(job, n, set, prediction), stop)
    }

    /// Walks the index of the job's size, by idle time.
    fn walk_size(&mut self, s: &mut Search) -> Stop {
        let index = std::mem::take(&mut self.index);
        let mut stop = Stop::Exhausted;
        let mut scanned = 0;
        for (i, (n, bound)) in index.walk(s.job.profile.gpus as usize).enumerate() {
            scanned = i + 1;
            if let Some(st) = self.visit(s, i, n, bound, true) {
                stop = st;
                break;
            }
        }
        self.index = index;
        let family = self.families.of(s.job.class);
        *self.scanned.entry(family).or_default() += scanned;
        stop
    }

    /// Walks the index of the job's family, by the family's bound: the class's own where the
    /// family has one class; else the envelope's, with the job's own quick bound applied too.
    fn walk_class(&mut self, s: &mut Search) -> Stop {
        let family = self.families.of(s.job.class);
        let mut index = self
            .classes
            .remove(&family)
            .expect("the family has an index");
        let f = &self.families.all[family];
        let (profile, quick) = (f.profile.clone(), f.classes > 1);
        let curve = Curve::new(&profile);
        let k = s.job.profile.gpus as usize;
        let (mut cursor, mut i) = (None, 0);
        let stop = loop {
            let versions = std::mem::take(&mut self.versions);
            let fresh = |n, x: &mut [f64], m: &mut bool| self.class_bound(n, &curve, k, x, m);
            let next = index.next_below(cursor, &versions, fresh);
            self.versions = versions;
            let Some((n, bound, key)) = next else {
                break Stop::Exhausted;
            };
            cursor = Some(key);
            if let Some(st) = self.visit(s, i, n, bound, quick) {
                break st;
            }
            i += 1;
        };
        self.classes.insert(family, index);
        stop
    }

    /// Whether the job walks an index of its family's own, made here once the family's jobs
    /// have looked at more nodes than that costs (the nodes of their size), while fewer than
    /// `limits.class_indexes` families have one.
    fn class_index(&mut self, s: &Search) -> bool {
        let family = self.families.of(s.job.class);
        if self.classes.contains_key(&family) {
            return true;
        }
        let nodes = self.index.len(s.job.profile.gpus as usize);
        let looked = self.scanned.get(&family).copied().unwrap_or(0);
        if self.classes.len() >= self.limits.class_indexes || looked <= nodes {
            return false;
        }
        let gpus: Vec<usize> = self.nodes.iter().map(|n| n.free.len()).collect();
        let coarse = self.index.walk(s.job.profile.gpus as usize);
        let index = ClassIndex::new(&gpus, &self.versions, coarse, self.spare.take());
        self.classes.insert(family, index);
        true
    }

    /// Drops the index of a family none of whose jobs are left.
    fn forget_family(&mut self, family: usize) {
        if let Some(index) = self.classes.remove(&family) {
            self.spare = Some(index);
        }
    }

    /// At least the share of a k-GPU job of `curve` on any set of node `n`'s free GPUs: the
    /// k-th largest over them of each GPU's share alone with the curve's exact memory factor
    /// (the figures in `solos`, made first where `made` is false: once per node and index),
    /// capped by the size index's bound; `None` where the node lacks the GPUs. Exact factors,
    /// not the trace summary's bound, since a node's figures are made once while every job of
    /// the family meets the node by them: for a family of one class the key is the share the
    /// node's best GPU set can get alone, so walks stop after fewer nodes.
    fn class_bound(
        &mut self,
        n: usize,
        curve: &Curve,
        k: usize,
        solos: &mut [f64],
        made: &mut bool,
    ) -> Option<f64> {
        let cap = self.index.bound(n, k)?;
        let slot = &self.nodes[n];
        let speed = slot.model.speed;
        let mm = self.params.model.memory;
        if mm == MemoryModel::Ignore || speed.is_nan() || speed < 0.0 {
            return Some(cap);
        }
        if !*made {
            if self.gpus[n].is_empty() {
                self.gpus[n] = summarise(&slot.model);
            }
            let gpus = solos.iter_mut().zip(&self.gpus[n]).zip(&slot.model.gpus);
            for ((x, g), model) in gpus {
                let factor = memory_factor(curve.profile(), &model.memory_quantiles, mm);
                *x = curve.gpu_bound(g, factor, speed, mm, f64::NEG_INFINITY);
            }
            *made = true;
        }
        self.solo.clear();
        let free = solos.iter().zip(&slot.free).filter(|(_, &f)| f);
        self.solo.extend(free.map(|(&x, _)| x));
        Some(kth_bound(&mut self.solo, k, cap))
    }

    /// [`quick_bound`] for node `n` (its GPUs summarised the first time).
    fn quick(&mut self, n: usize, s: &Search, bar: Bar) -> f64 {
        if self.gpus[n].is_empty() {
            self.gpus[n] = summarise(&self.nodes[n].model);
        }
        let (slot, gpus) = (&self.nodes[n], &self.gpus[n]);
        quick_bound(
            &mut self.solo,
            slot,
            gpus,
            self.params,
            s.job,
            &s.curve,
            bar,
        )
    }

    /// Looks at node `n`, the `scanned`-th of the walk with the walk's `bound` on it: the
    /// reason to stop there, if any. `quick`: whether the bound may be tightened first.
    fn visit(
        &mut self,
        s: &mut Search,
        scanned: usize,
        n: usize,
        bound: f64,
        quick: bool,
    ) -> Option<Stop> {
        match &s.best {
            Some((_, _, b)) if bound <= b.share || bound < s.needed => return Some(Stop::Bound),
            None if bound < s.needed => {
                s.below += 1;
                if s.below > REPORT_VISITS {
                    return Some(Stop::BelowSla);
                }
            }
            _ => {}
        }
        if scanned >= self.limits.scan {
            return Some(Stop::Visits);
        }
        if s.avoid.contains(&n) {
            return None;
        }
        s.considered += 1;
        let floor = s.best.as_ref().map_or(-1.0, |(_, _, b)| b.share);
        if quick && s.best.is_some() {
            let bar = Bar {
                floor,
                needed: s.needed,
                cap: bound,
            };
            let q = self.quick(n, s, bar);
            if q <= floor || q < s.needed {
                return None; // cannot beat the best found, or meet the SLA
            }
        }
        self.evaluate(s, n, floor);
        if s.met >= self.limits.candidates {
            return Some(Stop::Candidates);
        }
        (s.evaluated >= self.limits.visits).then_some(Stop::Visits)
    }

    /// Node `n`'s best set for the job above `floor`, kept if it beats the best found.
    fn evaluate(&mut self, s: &mut Search, n: usize, floor: f64) {
        s.evaluated += 1;
        let ties_lose = s
            .best
            .as_ref()
            .is_some_and(|(bn, _, _)| self.free_count[n] >= self.free_count[*bn]);
        let c = match self.cache.find(n, s.job.class) {
            Some(c) => c,
            None => self.cache.insert(n, s.job.class),
        };
        let hints = Hints {
            curve: &s.curve,
            bounds: None,
            ties_lose,
        };
        let memory = self.cache.factors_mut(n, c);
        let slot = &self.nodes[n];
        let Some((set, pred)) = best_set(s.job, slot, memory, self.params, floor, &hints) else {
            return;
        };
        s.met += usize::from(pred.share >= s.needed);
        let better = s.best.as_ref().is_none_or(|(bn, _, bp)| {
            pred.share > bp.share
                || (pred.share == bp.share && self.free_count[n] < self.free_count[*bn])
        });
        if better {
            s.best = Some((n, set, pred));
        }
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
        self.versions[n] += 1;
        self.index.update(n, &self.nodes[n], &self.params.model);
        Outcome::Placed(placement)
    }
}

/// The per-GPU figures of `model` the quick bound reads.
fn summarise(model: &crate::predict::NodeModel) -> Vec<GpuSummary> {
    model
        .gpus
        .iter()
        .map(|g| GpuSummary {
            idle: 1.0 - g.busy,
            top: g.memory_quantiles.last().copied().unwrap_or(0),
            trace: Trace::of(&g.memory_quantiles),
        })
        .collect()
}

/// What a node must pass to be evaluated: a share above `floor` (the best found) and at least
/// `needed` (the SLA with its margin); `cap` is the index's bound on the node.
#[derive(Clone, Copy)]
struct Bar {
    floor: f64,
    needed: f64,
    cap: f64,
}

/// At least `job`'s share on any k-GPU set of the free GPUs of `slot`: the k-th largest over
/// them of a bound on the GPU's share alone (a set scores at most its worst GPU alone), capped
/// by the index's bound `bar.cap`. A GPU's bound is idle x the most its curve gives with the GPU's
/// largest memory x speed, tightened with its trace's summary ([`Curve::factor_bound`]) where
/// that alone would still pass `bar`; a GPU whose trace has no summary leaves the node unbounded
/// (`bar.cap`). `gpus` summarises the node's GPUs; `solo` is scratch.
fn quick_bound(
    solo: &mut Vec<f64>,
    slot: &NodeSlot,
    gpus: &[GpuSummary],
    params: &PlaceParams,
    job: &PendingJob,
    curve: &Curve,
    bar: Bar,
) -> f64 {
    let speed = slot.model.speed;
    let mm = params.model.memory;
    if mm == MemoryModel::Ignore || speed.is_nan() || speed < 0.0 {
        return bar.cap;
    }
    solo.clear();
    for (g, _) in gpus.iter().zip(&slot.free).filter(|(_, &f)| f) {
        solo.push(gpu_bound(g, speed, curve, mm, bar));
    }
    kth_bound(solo, job.profile.gpus as usize, bar.cap)
}

/// One GPU's bound in [`quick_bound`]: NaN where its trace has no summary.
fn gpu_bound(g: &GpuSummary, speed: f64, curve: &Curve, mm: MemoryModel, bar: Bar) -> f64 {
    let passes = |x: f64| x > bar.floor && x >= bar.needed;
    // At least the coarse figure (a curve gives at most 1, and at least 0): where it fails
    // `bar`, so does the coarse one, and the curve is not looked up.
    let idle_only = non_negative(g.idle) * speed;
    if g.trace.is_some() && !passes(idle_only) {
        return idle_only;
    }
    let coarse = g.idle * curve.at_most(g.top) * speed;
    match &g.trace {
        // Quantiles not ascending (the last is not the largest) or too few: no bound.
        None => f64::NAN,
        Some(t) if passes(coarse) => {
            let fine = g.idle * curve.factor_bound(t, mm) * speed;
            // NaN (the curve is not bounded) keeps the coarse figure.
            if fine < coarse {
                fine
            } else {
                coarse
            }
        }
        Some(_) => coarse,
    }
}

/// The k-th largest of the free GPUs' bounds `solo` (reordered), at most `cap`; `cap` where one
/// is NaN or there are fewer than k.
fn kth_bound(solo: &mut [f64], k: usize, cap: f64) -> f64 {
    if solo.iter().any(|x| x.is_nan()) || solo.len() < k.max(1) {
        return cap;
    }
    let (_, kth, _) = solo.select_nth_unstable_by(k.max(1) - 1, |a, b| b.total_cmp(a));
    kth.min(cap)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::predict::predict;

    /// A job of class 0 with no SLA, for bounds checks.
    fn job_of(profile: &Arc<crate::job::JobProfile>) -> PendingJob {
        PendingJob {
            id: "j".into(),
            class: 0,
            sla: 0.0,
            avoid: vec![],
            order: 0,
            profile: profile.clone(),
        }
    }

    /// Every set's share, over the free GPUs of random nodes and random jobs.
    fn subsets(free: &[usize], k: usize) -> Vec<Vec<usize>> {
        let n = free.len();
        (0u32..1 << n)
            .filter(|m| m.count_ones() as usize == k)
            .map(|m| {
                (0..n)
                    .filter(|i| m & (1 << i) != 0)
                    .map(|i| free[i])
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_quick_bound_is_at_least_every_sets_share_and_the_trace_tightens_it() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (mut tighter, mut sets, mut skips) = (0, 0, 0);
        for i in 0..300 {
            let slot = super::super::tests::random_node(&mut rng, "n", [1, 2, 4, 8][i % 4]);
            let profile = Arc::new(super::super::tests::random_profile(&mut rng));
            let params = PlaceParams::default();
            let job = job_of(&profile);
            let curve = Curve::new(&profile);
            let gpus = summarise(&slot.model);
            let open = Bar {
                floor: -1.0,
                needed: -1.0,
                cap: f64::INFINITY,
            };
            // Above every share: the trace is never consulted.
            let coarse_only = Bar {
                needed: 2.0,
                ..open
            };
            let mut solo = Vec::new();
            let quick = quick_bound(&mut solo, &slot, &gpus, &params, &job, &curve, open);
            let coarse = quick_bound(&mut solo, &slot, &gpus, &params, &job, &curve, coarse_only);
            tighter += usize::from(quick < coarse);
            // A node the pass skips at a random bar has no set that passes it.
            let bar = Bar {
                floor: rng.f64() - 0.2,
                needed: rng.f64(),
                cap: 1.0 + rng.f64(),
            };
            let at_bar = quick_bound(&mut solo, &slot, &gpus, &params, &job, &curve, bar);
            let skipped = at_bar <= bar.floor || at_bar < bar.needed;
            let free: Vec<usize> = (0..slot.free.len()).filter(|&p| slot.free[p]).collect();
            for set in subsets(&free, profile.gpus as usize) {
                let share = predict(&profile, &slot.model, &set, &params.model).share;
                // A GPU busier than the whole time bounds below 0, where no share goes.
                assert!(
                    share <= quick.max(0.0),
                    "node {i}: {set:?} scores {share} > {quick} (coarse {coarse})"
                );
                let passes = share > bar.floor && share >= bar.needed;
                assert!(
                    !(skipped && passes),
                    "node {i}: {set:?} ({share}) skipped at {at_bar}"
                );
                sets += 1;
                skips += usize::from(skipped);
            }
        }
        assert!(
            tighter > 10 && sets > 100 && skips > 10,
            "{tighter} tighter, {sets} sets, {skips} skipped"
        );
    }
    #[test]
    fn a_class_bound_made_from_kept_gpu_figures_is_the_exact_solo_bound_and_bounds_every_set() {
        let mut rng = fastrand::Rng::with_seed(12);
        let params = PlaceParams::default();
        let (mut checked, mut sets) = (0, 0);
        for i in 0..200 {
            let mut nodes = vec![super::super::tests::random_node(&mut rng, "n", 8)];
            let profile = Arc::new(super::super::tests::random_profile(&mut rng));
            let k = profile.gpus as usize;
            let job = job_of(&profile);
            let limits = FastLimits::default();
            let families = Families::new(std::slice::from_ref(&job));
            let mut pass = Pass::new(&mut nodes, &params, limits, &[k], families);
            let s = Search {
                job: &job,
                curve: Curve::new(&profile),
                avoid: Vec::new(),
                needed: 0.0,
                best: None,
                considered: 0,
                evaluated: 0,
                met: 0,
                below: 0,
            };
            let (mut kept, mut made) = (vec![f64::NAN; 8], false);
            // GPUs go one by one; the kept figures are made once, at the first bound.
            for p in std::iter::once(None).chain((0..8).map(Some)) {
                if let Some(p) = p {
                    pass.nodes[0].free[p] = false;
                    pass.index.update(0, &pass.nodes[0], &params.model);
                }
                let got = pass.class_bound(0, &s.curve, k, &mut kept, &mut made);
                let slot = &pass.nodes[0];
                let want = pass.index.bound(0, k).map(|cap| {
                    if slot.model.speed.is_nan() || slot.model.speed < 0.0 {
                        return cap;
                    }
                    let mut solo: Vec<f64> = (0..8)
                        .filter(|&p| slot.free[p])
                        .map(|p| {
                            let g = &slot.model.gpus[p];
                            let f =
                                memory_factor(&profile, &g.memory_quantiles, params.model.memory);
                            (1.0 - g.busy) * f * slot.model.speed
                        })
                        .collect();
                    kth_bound(&mut solo, k, cap)
                });
                let free: Vec<usize> = (0..8).filter(|&p| slot.free[p]).collect();
                for set in subsets(&free, k) {
                    let share = predict(&profile, &slot.model, &set, &params.model).share;
                    assert!(
                        share <= got.unwrap().max(0.0),
                        "node {i}: {set:?} scores {share}"
                    );
                    sets += 1;
                }
                assert_eq!(
                    got.map(f64::to_bits),
                    want.map(f64::to_bits),
                    "node {i}, {p:?} taken"
                );
                checked += usize::from(got.is_some());
            }
        }
        assert!(
            checked > 500 && sets > 500,
            "{checked} bounds compared, {sets} sets"
        );
    }
}
