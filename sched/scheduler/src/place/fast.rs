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

use super::bound::{
    held_overlap, largest, lift_bound, non_negative, with_overlap, Curve, GpuSummary, Trace,
};
use super::cache::MemoryCache;
use super::class_index::ClassIndex;
use super::family::{Families, SCALED_SLACK};
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
    let (decisions, stops, _) = place_scaled(jobs, nodes, params, limits, true);
    (decisions, stops)
}

/// [`place_traced`], with the scaled stop (`scaled_stop`) on or off, and how many searches it
/// ended.
fn place_scaled(
    jobs: &[PendingJob],
    nodes: &mut [NodeSlot],
    params: &PlaceParams,
    limits: FastLimits,
    scaled: bool,
) -> (Vec<Decision>, Vec<Stop>, usize) {
    let mut sizes: Vec<usize> = jobs.iter().map(|j| j.profile.gpus as usize).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let families = Families::new(jobs);
    let mut pass = Pass::new(nodes, params, limits, &sizes, families);
    pass.scaled = scaled;
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
    (decisions, stops, pass.scaled_stops)
}

/// Whether a member of scale `scale` (`family::scale`) walking its family's class index may
/// stop at a node of key `key`, with `best` the best share found: `scale` x `key` + `slack`
/// is at least its share on that node and on every one after it, so none can give it `best`.
/// (Below it, not at it: a tie on a node with fewer free GPUs would still win.)
fn scaled_stop(scale: f64, key: f64, slack: f64, best: f64) -> bool {
    scale < 1.0 && scale * key + slack < best
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
    /// Scratch for [`joint_bound`].
    sets: Vec<(f64, usize)>,
    /// Node positions by name, made for the first job with nodes to avoid.
    by_name: HashMap<String, usize>,
    /// [`SCALED_SLACK`] x the fastest node's speed (at least 1).
    slack: f64,
    /// The fastest node's speed (at least 1): a size index's key bounds a job that keeps part of
    /// its held time only with the speed of the node ([`lift_bound`]), and a walk's stop must
    /// hold for every node after it.
    fastest: f64,
    /// Whether members stop by their scale ([`scaled_stop`]), and how many did.
    scaled: bool,
    scaled_stops: usize,
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
        // `f64::max` passes over NaN, as a prediction's `speed.max(0.0)` does.
        let fastest = nodes.iter().map(|n| n.model.speed).fold(1.0, f64::max);
        Pass {
            slack: SCALED_SLACK * fastest,
            fastest,
            scaled: true,
            scaled_stops: 0,
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
            sets: Vec::new(),
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
        // The keys take the held overlap to be 0: lifted for the job's, with the fastest speed,
        // each is at least the share of its node and of every node after it (the lift grows with
        // the key).
        let o = held_overlap(&s.job.profile, &self.params.model);
        for (i, (n, bound)) in index.walk(s.job.profile.gpus as usize).enumerate() {
            scanned = i + 1;
            let bound = lift_bound(o, bound, self.fastest);
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
    /// family has one class; else the envelope's, with the job's own quick bound applied too,
    /// and stopping once the job's scale (`family::scale`) x the next key (+ slack) is below
    /// the best share found: no node further down can then give the job as much, nor tie it, so
    /// the best found is the one the unscaled stop would have ended with.
    fn walk_class(&mut self, s: &mut Search) -> Stop {
        let (family, scale) = self.families.member(s.job.class);
        let mut index = self
            .classes
            .remove(&family)
            .expect("the family has an index");
        let f = &self.families.all[family];
        let (profile, quick) = (f.profile.clone(), f.classes > 1);
        let curve = Curve::new(&profile);
        let k = s.job.profile.gpus as usize;
        // Memory ignored, a member's factors are the envelope's (1): no scale holds.
        let scale = match self.params.model.memory {
            MemoryModel::Ignore => 1.0,
            _ if !self.scaled => 1.0,
            _ => scale,
        };
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
            if let Some((_, _, b)) = &s.best {
                if scaled_stop(scale, bound, self.slack, b.share) {
                    self.scaled_stops += 1;
                    break Stop::Bound;
                }
            }
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
        // The size index's keys lifted for the held overlap of the family's index profile (the
        // largest of its members', `family::envelope`), in the same order.
        let o = held_overlap(&self.families.all[family].profile, &self.params.model);
        let fastest = self.fastest;
        let coarse = self
            .index
            .walk(s.job.profile.gpus as usize)
            .map(|(n, b)| (n, lift_bound(o, b, fastest)));
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
    /// (the figures in `solos`, per GPU that share and the factor, made first where `made` is
    /// false: once per node and index), capped by the size index's bound, and for a multi-GPU
    /// job where alignment counts, at most the best aligned set's share with those factors
    /// ([`joint_bound`]); `None` where the node lacks the GPUs. Exact factors, not the trace
    /// summary's bound, since a node's figures are made once while every job of the family meets
    /// the node by them: for a family of one class the key is the share the node's best GPU set
    /// can get alone (before interruptions), so walks stop after fewer nodes. Every idle term
    /// (the size index's cap through [`lift_bound`], the GPUs' and the sets' through
    /// [`with_overlap`]) counts the held time the index profile keeps: the envelope's is the
    /// largest of its members' (`family::envelope`), so the key bounds each member's share. The joint bound
    /// matters for sets: the k-th best GPU alone and the best aligned set by idle time bound
    /// memory and alignment apart, where a set must have both at once.
    fn class_bound(
        &mut self,
        n: usize,
        curve: &Curve,
        k: usize,
        solos: &mut [f64],
        made: &mut bool,
    ) -> Option<f64> {
        let slot = &self.nodes[n];
        let speed = slot.model.speed;
        let o = held_overlap(curve.profile(), &self.params.model);
        let cap = lift_bound(o, self.index.bound(n, k)?, speed);
        let mm = self.params.model.memory;
        if mm == MemoryModel::Ignore || speed.is_nan() || speed < 0.0 {
            return Some(cap);
        }
        let (solos, factors) = solos.split_at_mut(slot.free.len());
        if !*made {
            if self.gpus[n].is_empty() {
                self.gpus[n] = summarise(&slot.model);
            }
            let gpus = solos.iter_mut().zip(factors.iter_mut());
            for (((x, f), g), model) in gpus.zip(&self.gpus[n]).zip(&slot.model.gpus) {
                *f = memory_factor(curve.profile(), &model.memory_quantiles, mm);
                *x = curve.gpu_bound(g, *f, speed, mm, f64::NEG_INFINITY, o);
            }
            *made = true;
        }
        self.solo.clear();
        let free = solos.iter().zip(&slot.free).filter(|(_, &f)| f);
        self.solo.extend(free.map(|(&x, _)| x));
        let kth = kth_bound(&mut self.solo, k, cap);
        if k < 2 || !self.params.model.alignment {
            return Some(kth);
        }
        match joint_bound(slot, factors, k, o, &self.params.model, &mut self.sets) {
            Some(joint) => Some(kth.min(joint)),
            None => Some(kth),
        }
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
            top: largest(&g.memory_quantiles),
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
    let o = held_overlap(&job.profile, &params.model);
    solo.clear();
    for (g, _) in gpus.iter().zip(&slot.free).filter(|(_, &f)| f) {
        solo.push(gpu_bound(g, speed, curve, mm, bar, o));
    }
    kth_bound(solo, job.profile.gpus as usize, bar.cap)
}

/// One GPU's bound in [`quick_bound`], for a job that keeps `o` of its held time (its idle time
/// through [`with_overlap`]): NaN where its trace has no summary.
fn gpu_bound(g: &GpuSummary, speed: f64, curve: &Curve, mm: MemoryModel, bar: Bar, o: f64) -> f64 {
    let passes = |x: f64| x > bar.floor && x >= bar.needed;
    // At least the coarse figure (a curve gives at most 1, and at least 0): where it fails
    // `bar`, so does the coarse one, and the curve is not looked up.
    let idle_only = with_overlap(o, non_negative(g.idle)) * speed;
    if g.trace.is_some() && !passes(idle_only) {
        return idle_only;
    }
    let idle = with_overlap(o, g.idle);
    let coarse = idle * curve.at_most(g.top) * speed;
    match &g.trace {
        // Quantiles not ascending (the last is not the largest) or too few: no bound.
        None => f64::NAN,
        Some(t) if passes(coarse) => {
            let fine = idle * curve.factor_bound(t, mm) * speed;
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

/// Steps of [`joint_bound`]'s search before it gives up.
const JOINT_STEPS: usize = 4096;

/// The most a k-GPU job whose memory factors on `slot`'s GPUs are at most `factors`, and which
/// keeps `o` of its held time ([`held_overlap`]), can be predicted on an aligned set of its free
/// GPUs: the best over those sets of [`with_overlap`]`(o, the set's idle time)` (1 - its busiest
/// GPU's or pair's union busy share, clamped to [0, 1]) x its smallest factor (and 1) x speed,
/// which is at least `predict_with`'s share (its factor, idle time and overlap less what is
/// interrupted, is at most o + (1 - o) idle, `with_overlap`'s step; the figure is the idle time
/// itself where o = 0, bit for bit, the share with nothing lost) and 0 for a set not aligned. `None` where a figure is not a
/// number, the speed not finite or the search gives up; the speed is at least 0.
///
/// Branch and bound over the free GPUs by their own figure (the same of the GPU alone, at least
/// any set's with them, as the term grows with idle time): a branch ends where its set so far,
/// or its next GPU, cannot beat the best set found.
fn joint_bound(
    slot: &NodeSlot,
    factors: &[f64],
    k: usize,
    o: f64,
    params: &crate::predict::ModelParams,
    order: &mut Vec<(f64, usize)>,
) -> Option<f64> {
    let m = &slot.model;
    let speed = m.speed;
    if !speed.is_finite() {
        return None;
    }
    order.clear();
    for p in (0..slot.free.len()).filter(|&p| slot.free[p]) {
        let idle = with_overlap(o, (1.0 - m.gpus[p].busy).clamp(0.0, 1.0));
        let alone = idle * factors[p].min(1.0) * speed;
        if alone.is_nan() || factors[p].is_nan() {
            return None;
        }
        order.push((alone, p));
    }
    order.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut search = Joint {
        slot,
        params,
        factors,
        order,
        k,
        set: Vec::with_capacity(k),
        o,
        best: 0.0,
        steps: 0,
        odd: false,
    };
    search.descend(0, 1.0, 1.0);
    (!search.odd && search.steps <= JOINT_STEPS).then_some(search.best)
}

/// [`joint_bound`]'s search.
struct Joint<'a> {
    slot: &'a NodeSlot,
    params: &'a crate::predict::ModelParams,
    factors: &'a [f64],
    order: &'a [(f64, usize)],
    k: usize,
    set: Vec<usize>,
    /// The job's held overlap ([`held_overlap`]).
    o: f64,
    best: f64,
    steps: usize,
    /// Whether a pair's score or union was not a number.
    odd: bool,
}

impl Joint<'_> {
    /// Extends `set` (idle time `idle` before clamping, smallest factor `mem`) from `order[from..]`.
    fn descend(&mut self, from: usize, idle: f64, mem: f64) {
        let speed = self.slot.model.speed;
        if self.set.len() == self.k {
            let share = with_overlap(self.o, idle.clamp(0.0, 1.0)) * mem * speed;
            if share > self.best {
                self.best = share;
            }
            return;
        }
        if with_overlap(self.o, idle.clamp(0.0, 1.0)) * mem * speed <= self.best {
            return; // more GPUs only lower both
        }
        for i in from..self.order.len() {
            self.steps += 1;
            if self.steps > JOINT_STEPS || self.odd {
                return;
            }
            let (alone, p) = self.order[i];
            if alone <= self.best || self.order.len() - i < self.k - self.set.len() {
                return; // later GPUs are no better alone
            }
            let model = &self.slot.model;
            let mut next = idle.min(1.0 - model.gpus[p].busy);
            let mut aligned = true;
            for &q in &self.set {
                let (score, union) = (model.score(p, q, self.params), model.union(p, q));
                if score.is_nan() || union.is_nan() {
                    self.odd = true;
                    return;
                }
                aligned &= score >= self.params.align_threshold;
                next = next.min(1.0 - union);
            }
            if aligned {
                self.set.push(p);
                self.descend(i + 1, next, mem.min(self.factors[p]));
                self.set.pop();
            }
        }
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

    use super::super::class_index::FIGURES;
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
    fn a_class_bound_made_from_kept_gpu_figures_is_the_best_aligned_sets_share_and_bounds_every_set(
    ) {
        let mut rng = fastrand::Rng::with_seed(12);
        let params = PlaceParams::default();
        let (mut checked, mut sets, mut joints) = (0, 0, 0);
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
            let (mut kept, mut made) = (vec![f64::NAN; FIGURES * 8], false);
            // GPUs go one by one; the kept figures are made once, at the first bound.
            for p in std::iter::once(None).chain((0..8).map(Some)) {
                if let Some(p) = p {
                    pass.nodes[0].free[p] = false;
                    pass.index.update(0, &pass.nodes[0], &params.model);
                }
                let got = pass.class_bound(0, &s.curve, k, &mut kept, &mut made);
                let slot = &pass.nodes[0];
                // The held time the job keeps lifts every idle term (none where it is 0).
                let o = held_overlap(&profile, &params.model);
                let want = pass.index.bound(0, k).map(|cap| {
                    let cap = lift_bound(o, cap, slot.model.speed);
                    if slot.model.speed.is_nan() || slot.model.speed < 0.0 {
                        return cap;
                    }
                    let mut solo: Vec<f64> = (0..8)
                        .filter(|&p| slot.free[p])
                        .map(|p| {
                            let g = &slot.model.gpus[p];
                            let f =
                                memory_factor(&profile, &g.memory_quantiles, params.model.memory);
                            with_overlap(o, 1.0 - g.busy) * f * slot.model.speed
                        })
                        .collect();
                    kth_bound(&mut solo, k, cap)
                });
                let free: Vec<usize> = (0..8).filter(|&p| slot.free[p]).collect();
                // Multi-GPU sets where alignment counts: at most the best aligned set's share
                // with nothing lost to interruptions, the search's figure bit for bit.
                let mut quiet = params.model;
                quiet.interruptions = false;
                let mut best: f64 = 0.0;
                for set in subsets(&free, k) {
                    let share = predict(&profile, &slot.model, &set, &params.model).share;
                    assert!(
                        share <= got.unwrap().max(0.0),
                        "node {i}: {set:?} scores {share}"
                    );
                    let q = predict(&profile, &slot.model, &set, &quiet);
                    best = best.max(match o {
                        0.0 => q.share,
                        _ if !q.aligned => 0.0,
                        _ => with_overlap(o, q.idle) * q.memory * slot.model.speed,
                    });
                    sets += 1;
                }
                let speed = slot.model.speed;
                let joint = k >= 2 && speed >= 0.0 && speed.is_finite();
                joints += usize::from(joint && want.is_some_and(|w| best < w));
                let want = want.map(|w| if joint { w.min(best) } else { w });
                assert_eq!(
                    got.map(f64::to_bits),
                    want.map(f64::to_bits),
                    "node {i}, {p:?} taken"
                );
                checked += usize::from(got.is_some());
            }
        }
        assert!(
            checked > 500 && sets > 500 && joints > 100,
            "{checked} bounds compared, {sets} sets, {joints} below the solo bound"
        );
    }

    /// A family of levels of one random profile (some above alone at a point), as jobs of
    /// classes 0.., and the node's keys for them: per node, the class index's key (as the walk
    /// returns it) for the family's index profile, made the way the pass makes it.
    fn levels(rng: &mut fastrand::Rng) -> Vec<PendingJob> {
        let base = super::super::tests::random_profile(rng);
        (0..rng.u64(2..6))
            .map(|c| {
                let level = [0.05, 0.3, 0.6, 1.0, 1.3][rng.usize(0..5)] * (0.5 + rng.f64());
                let mut j = job_of(&Arc::new(base.at_level(level)));
                j.class = c;
                j
            })
            .collect()
    }

    fn random_params(rng: &mut fastrand::Rng) -> PlaceParams {
        let mut params = PlaceParams::default();
        params.model.memory = [
            MemoryModel::Trace,
            MemoryModel::Trace,
            MemoryModel::StaticMin,
        ][rng.usize(0..3)];
        params.model.alignment = rng.u8(0..4) > 0;
        params.model.interruptions = rng.bool();
        params
    }

    /// Per node: the class index's key for `jobs`' family (`None`: not placeable), as the walk
    /// meets it (`key_bits`), and the pass's slack.
    fn family_keys(
        nodes: &mut [NodeSlot],
        params: &PlaceParams,
        jobs: &[PendingJob],
    ) -> (Vec<Option<f64>>, f64, Families) {
        let k = jobs[0].profile.gpus as usize;
        let limits = FastLimits::default();
        let mut pass = Pass::new(nodes, params, limits, &[k], Families::new(jobs));
        let profile = pass.families.all[pass.families.of(0)].profile.clone();
        let curve = Curve::new(&profile);
        let keys = (0..pass.nodes.len())
            .map(|n| {
                let g = FIGURES * pass.nodes[n].free.len();
                let (mut kept, mut made) = (vec![f64::NAN; g], false);
                let key = pass.class_bound(n, &curve, k, &mut kept, &mut made)?;
                Some(f64::from_bits(super::super::index::key_bits(key)))
            })
            .collect();
        (keys, pass.slack, Families::new(jobs))
    }

    /// The member's best share over every k-set of the node's free GPUs (-inf: none).
    fn best_share(job: &PendingJob, slot: &NodeSlot, params: &PlaceParams) -> f64 {
        let free: Vec<usize> = (0..slot.free.len()).filter(|&p| slot.free[p]).collect();
        let sets = subsets(&free, job.profile.gpus as usize);
        let shares = sets
            .iter()
            .map(|set| predict(&job.profile, &slot.model, set, &params.model).share);
        shares.fold(f64::NEG_INFINITY, f64::max)
    }

    #[test]
    fn a_members_share_on_every_set_is_at_most_its_scale_times_the_envelopes_class_key() {
        let mut rng = fastrand::Rng::with_seed(13);
        let (mut scaled, mut tight, mut sets) = (0, 0, 0);
        for i in 0..400 {
            let mut nodes = vec![super::super::tests::random_node(&mut rng, "n", 8)];
            let params = random_params(&mut rng);
            let jobs = levels(&mut rng);
            let (keys, slack, families) = family_keys(&mut nodes, &params, &jobs);
            let Some(key) = keys[0] else { continue };
            for j in &jobs {
                let scale = families.member(j.class).1;
                let free: Vec<usize> = (0..8).filter(|&p| nodes[0].free[p]).collect();
                for set in subsets(&free, j.profile.gpus as usize) {
                    let share = predict(&j.profile, &nodes[0].model, &set, &params.model).share;
                    assert!(
                        share <= scale * key + slack,
                        "node {i}: {set:?} scores {share} > {scale} x {key}"
                    );
                    sets += 1;
                    scaled += usize::from(scale < 1.0);
                    tight += usize::from(scale < 1.0 && share > 0.9 * scale * key);
                }
            }
        }
        assert!(
            sets > 5000 && scaled > 2000 && tight > 100,
            "{sets} sets, {scaled} with a scale below 1, {tight} within 10% of the bound"
        );
    }

    #[test]
    fn the_scaled_stop_never_skips_a_node_whose_member_share_beats_the_best() {
        let mut rng = fastrand::Rng::with_seed(14);
        let (mut stops, mut sooner, mut nodes_saved) = (0, 0, 0);
        for _ in 0..150 {
            let params = random_params(&mut rng);
            let jobs = levels(&mut rng);
            let gpus = 8;
            let mut nodes: Vec<NodeSlot> = (0..rng.usize(2..30))
                .map(|n| super::super::tests::random_node(&mut rng, &format!("n{n}"), gpus))
                .collect();
            let (keys, slack, families) = family_keys(&mut nodes, &params, &jobs);
            // The walk's order: highest key first, lower positions first among equals.
            let mut order: Vec<usize> = (0..nodes.len()).filter(|&n| keys[n].is_some()).collect();
            order.sort_by(|&a, &b| {
                keys[b]
                    .unwrap()
                    .total_cmp(&keys[a].unwrap())
                    .then(a.cmp(&b))
            });
            for j in &jobs {
                let scale = families.member(j.class).1;
                let shares: Vec<f64> = order
                    .iter()
                    .map(|&n| best_share(j, &nodes[n], &params))
                    .collect();
                let mut best: Option<f64> = None;
                for (i, &n) in order.iter().enumerate() {
                    let key = keys[n].unwrap();
                    if let Some(b) = best {
                        if scaled_stop(scale, key, slack, b) {
                            let rest = shares[i..]
                                .iter()
                                .copied()
                                .fold(f64::NEG_INFINITY, f64::max);
                            assert!(rest < b, "{rest} on a node not looked at >= {b} found");
                            stops += 1;
                            // Where the unscaled stop would have come.
                            let unscaled = order[i..].iter().position(|&m| keys[m].unwrap() <= b);
                            let later = unscaled.unwrap_or(order.len() - i);
                            sooner += usize::from(later > 0);
                            nodes_saved += later;
                            break;
                        }
                        if key <= b {
                            break; // the unscaled stop
                        }
                    }
                    if shares[i] > best.unwrap_or(f64::NEG_INFINITY) {
                        best = Some(shares[i]);
                    }
                }
            }
        }
        assert!(
            stops > 50 && sooner > 20 && nodes_saved > 50,
            "{stops} scaled stops, {sooner} before the unscaled one, {nodes_saved} nodes saved"
        );
    }

    #[test]
    fn a_point_above_alone_is_counted_at_1_before_scaling_or_the_scaled_key_would_fail() {
        let base = crate::job::tests::profile(1);
        let members = [base.at_level(2.0), base.at_level(1.5), base.at_level(0.9)];
        let jobs: Vec<PendingJob> = members
            .iter()
            .enumerate()
            .map(|(c, p)| PendingJob {
                class: c as u64,
                ..job_of(&Arc::new(p.clone()))
            })
            .collect();
        let families = Families::new(&jobs);
        let envelope = &families.all[families.of(0)].profile;
        // A GPU with memory above the curve's last point all the time: every share is clamped
        // at 1 where it is above it.
        let q = [32 * crate::job::tests::GIB; 21];
        let factor = |p: &crate::job::JobProfile| memory_factor(p, &q, MemoryModel::Trace);
        let env = factor(envelope);
        assert_eq!(env, 1.0);
        let naive = |p: &crate::job::JobProfile| {
            let ratios = p.curve.iter().zip(&envelope.curve);
            let r = ratios.map(|(a, b)| a.per_s / p.alone_per_s / (b.per_s / envelope.alone_per_s));
            r.fold(0.0, f64::max)
        };
        // Level 1.5 against the envelope's 2: the ratio of the points (0.75) would not bound
        // its factor (1, clamped as the envelope's): no scale for it.
        assert!(factor(&members[1]) > naive(&members[1]) * env);
        assert_eq!(families.member(1).1, 1.0);
        // Level 0.9, below alone everywhere, in the same family: the envelope's points counted
        // at 1 give 0.9 (the points' ratios alone, 0.45, would not bound its 0.9).
        let own = factor(&members[2]);
        assert!(own > naive(&members[2]) * env, "{own}");
        let scale = families.member(2).1;
        assert!(
            (scale - 0.9).abs() < 1e-9 && own <= scale * env,
            "{scale} {own}"
        );
        // The envelope itself, and a curve of other points, get no scale.
        assert_eq!(families.member(0).1, 1.0);
        let mut other = members[2].clone();
        other.curve[0].memory_bytes += 1;
        assert_eq!(super::super::family::scale(&other, envelope), 1.0);
    }

    #[test]
    fn the_scaled_stop_decides_as_the_unscaled_one_on_families_of_levels() {
        let mut rng = fastrand::Rng::with_seed(15);
        let (mut scaled_stops, mut placed) = (0, 0);
        for seed in 0..300 {
            let mut params = random_params(&mut rng);
            if seed % 10 == 0 {
                params.model.memory = MemoryModel::Ignore;
            }
            let mut nodes: Vec<NodeSlot> = (0..rng.usize(5..40))
                .map(|n| super::super::tests::random_node(&mut rng, &format!("n{n}"), 8))
                .collect();
            // Traces in order: `best_gpu` orders GPUs by the curve at the last quantile (or the
            // factor, where cached), which bounds a GPU only where it is the largest; out of
            // order, the GPU it settles on depends on what earlier searches left cached, and
            // the scaled stop changes that.
            for g in nodes.iter_mut().flat_map(|n| n.model.gpus.iter_mut()) {
                g.memory_quantiles.sort_unstable();
            }
            let mut jobs = Vec::new();
            for f in 0..rng.u64(1..4) {
                for mut j in levels(&mut rng) {
                    j.class += 10 * f;
                    for _ in 0..rng.usize(1..30) {
                        let mut j = j.clone();
                        j.id = jobs.len().to_string();
                        j.sla = [0.05, 0.2, 0.4, 0.7][rng.usize(0..4)];
                        j.order = rng.u64(0..1000);
                        jobs.push(j);
                    }
                }
            }
            let limits = FastLimits::default();
            let (mut a, mut b) = (nodes.clone(), nodes);
            let (got, _, stops) = place_scaled(&jobs, &mut a, &params, limits, true);
            let (want, _, none) = place_scaled(&jobs, &mut b, &params, limits, false);
            assert_eq!(none, 0);
            assert_eq!(got, want, "seed {seed}");
            let free = |n: &[NodeSlot]| n.iter().map(|s| s.free.clone()).collect::<Vec<_>>();
            assert_eq!(free(&a), free(&b), "seed {seed}");
            if params.model.memory == MemoryModel::Ignore {
                assert_eq!(stops, 0, "seed {seed}: memory ignored, nothing scales");
            }
            scaled_stops += stops;
            placed += got
                .iter()
                .filter(|d| matches!(d.outcome, Outcome::Placed(_)))
                .count();
        }
        assert!(
            scaled_stops > 1000 && placed > 2000,
            "{scaled_stops} scaled stops, {placed} placed"
        );
    }
}
