//! The fast pass measured against the exhaustive one on random clusters: the predicted harvest
//! each gives, whether any fast placement falls below its SLA, and where their decisions differ.
//!
//! Harvest is the sum over placed jobs of the predicted share x the GPUs it holds: GPU-equivalents
//! of throughput alone. A fast placement is checked afresh with the model (`predict`) on the
//! cluster as it was before the pass: its GPUs free and not given twice, its share at least the
//! SLA plus the margin.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use serde::Serialize;

use super::fast::{place_traced, FastLimits};
use super::{place, Decision, NodeSlot, Outcome, PassKind, PendingJob, PlaceParams};
use crate::predict::{predict, NodeModel};

/// What one cluster's comparison found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Comparison {
    /// Nodes and pending jobs.
    pub nodes: usize,
    /// Pending jobs.
    pub jobs: usize,
    /// Predicted harvest of the exhaustive pass and of the fast pass.
    pub reference_harvest: f64,
    /// See `reference_harvest`.
    pub fast_harvest: f64,
    /// Jobs each pass placed.
    pub reference_placed: usize,
    /// See `reference_placed`.
    pub fast_placed: usize,
    /// Fast placements that fail the fresh check (below SLA, GPUs not free or given twice).
    pub violations: Vec<String>,
    /// Jobs placed by both, on another node or GPUs.
    pub moved: usize,
    /// Of those, where the fast pass's predicted share is lower.
    pub moved_lower: usize,
    /// Jobs the exhaustive pass placed and the fast one left pending.
    pub only_reference: usize,
    /// Jobs the fast pass placed and the exhaustive one left pending.
    pub only_fast: usize,
    /// The first job (in the passes' order) the passes decide differently, if any: its id,
    /// the share each pass predicted for it (reference, then fast; 0 where left pending) and
    /// why the fast search ended there.
    pub first_difference: Option<(String, f64, f64, String)>,
    /// Per reason the fast search ended: the jobs it decided differently.
    pub differing_by_stop: BTreeMap<String, usize>,
}

impl Comparison {
    /// The share of the reference's harvest the fast pass gives up (negative: it harvests more).
    pub fn loss(&self) -> f64 {
        if self.reference_harvest > 0.0 {
            1.0 - self.fast_harvest / self.reference_harvest
        } else {
            0.0
        }
    }
}

/// Predicted harvest of `decisions` (see the module documentation).
pub fn harvest(decisions: &[Decision]) -> f64 {
    decisions
        .iter()
        .map(|d| match &d.outcome {
            Outcome::Placed(p) => p.prediction.share * p.gpus.len() as f64,
            Outcome::Pending(_) => 0.0,
        })
        .sum()
}

/// Runs the exhaustive pass and the fast pass with `limits` on copies of `nodes` and compares
/// them.
pub fn compare(
    jobs: &[PendingJob],
    nodes: &[NodeSlot],
    params: &PlaceParams,
    limits: FastLimits,
) -> Comparison {
    let reference = place(
        jobs,
        &mut nodes.to_vec(),
        &PlaceParams {
            pass: PassKind::Reference,
            ..*params
        },
    );
    let (got, stops) = place_traced(jobs, &mut nodes.to_vec(), params, limits);
    let mut c = Comparison {
        nodes: nodes.len(),
        jobs: jobs.len(),
        reference_harvest: harvest(&reference),
        fast_harvest: harvest(&got),
        reference_placed: placed(&reference),
        fast_placed: placed(&got),
        violations: check(jobs, nodes, params, &got),
        ..Comparison::default()
    };
    let theirs: HashMap<&str, &Outcome> = reference
        .iter()
        .map(|d| (d.job.as_str(), &d.outcome))
        .collect();
    for (d, stop) in got.iter().zip(stops) {
        let want = theirs.get(d.job.as_str()).copied();
        let differ = match (want, &d.outcome) {
            (Some(Outcome::Placed(a)), Outcome::Placed(b)) => {
                let moved = a.node != b.node || a.gpus != b.gpus;
                c.moved += usize::from(moved);
                c.moved_lower += usize::from(moved && b.prediction.share < a.prediction.share);
                moved
            }
            (Some(Outcome::Placed(_)), Outcome::Pending(_)) => {
                c.only_reference += 1;
                true
            }
            (Some(Outcome::Pending(_)), Outcome::Placed(_)) => {
                c.only_fast += 1;
                true
            }
            _ => false,
        };
        if !differ {
            continue;
        }
        let why = serde_json::to_value(stop)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        *c.differing_by_stop.entry(why.clone()).or_default() += 1;
        if c.first_difference.is_none() {
            let share = |o: Option<&Outcome>| match o {
                Some(Outcome::Placed(p)) => p.prediction.share,
                _ => 0.0,
            };
            let (a, b) = (share(want), share(Some(&d.outcome)));
            c.first_difference = Some((d.job.clone(), a, b, why));
        }
    }
    c
}

fn placed(decisions: &[Decision]) -> usize {
    decisions
        .iter()
        .filter(|d| matches!(d.outcome, Outcome::Placed(_)))
        .count()
}

/// The fast placements that fail the fresh check (see the module documentation), each named.
fn check(
    jobs: &[PendingJob],
    nodes: &[NodeSlot],
    params: &PlaceParams,
    decisions: &[Decision],
) -> Vec<String> {
    let by_id: HashMap<&str, &PendingJob> = jobs.iter().map(|j| (j.id.as_str(), j)).collect();
    let by_name: HashMap<&str, &NodeSlot> =
        nodes.iter().map(|n| (n.model.name.as_str(), n)).collect();
    let mut taken: HashSet<(&str, u32)> = HashSet::new();
    let mut bad = Vec::new();
    for d in decisions {
        let Outcome::Placed(p) = &d.outcome else {
            continue;
        };
        let (Some(job), Some(slot)) = (by_id.get(d.job.as_str()), by_name.get(p.node.as_str()))
        else {
            bad.push(format!("job {}: unknown job or node {}", d.job, p.node));
            continue;
        };
        let positions: Option<Vec<usize>> = p
            .gpus
            .iter()
            .map(|&g| slot.model.gpus.iter().position(|m| m.index == g))
            .collect();
        let Some(positions) = positions else {
            bad.push(format!("job {}: no such GPU on {}", d.job, p.node));
            continue;
        };
        for &q in &positions {
            let gpu = slot.model.gpus[q].index;
            if !slot.free[q] || !taken.insert((p.node.as_str(), gpu)) {
                bad.push(format!("job {}: GPU {gpu} of {} not free", d.job, p.node));
            }
        }
        let share = predict(&job.profile, &slot.model, &positions, &params.model).share;
        if share < job.sla + params.margin || positions.len() != job.profile.gpus as usize {
            bad.push(format!(
                "job {}: {share:.4} of alone on {} is below its SLA {} + margin {}",
                d.job, p.node, job.sla, params.margin
            ));
        }
    }
    bad
}

/// A random cluster of `nodes` nodes of 8 GPUs and a queue of `jobs` jobs of `classes` profiles,
/// as the pass benchmark draws them, with some GPUs already taken and some nodes faster or
/// slower than profiled.
pub fn random_cluster(
    seed: u64,
    nodes: usize,
    jobs: usize,
    classes: usize,
) -> (Vec<PendingJob>, Vec<NodeSlot>) {
    random_cluster_with(seed, nodes, jobs, classes, false)
}

/// [`random_cluster`], and where `overlap` is set, profiles that keep part of the time the gate
/// holds them (`costs.held_overlap` 0, 0, 0.3 and 1 by class, as measured profiles may): the
/// same cluster and queue otherwise.
pub fn random_cluster_with(
    seed: u64,
    nodes: usize,
    jobs: usize,
    classes: usize,
    overlap: bool,
) -> (Vec<PendingJob>, Vec<NodeSlot>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let params = PlaceParams::default();
    let taken = rng.f64() * 0.5;
    let slots = (0..nodes)
        .map(|n| {
            let doc = crate::bench::random_doc(&mut rng, &format!("node{n:05}"), 8, 0);
            let speed = if rng.bool() {
                1.0
            } else {
                0.8 + rng.f64() * 0.4
            };
            let model = NodeModel::from_doc(&doc, &params.model).with_speed(speed);
            let free = (0..model.gpus.len()).map(|_| rng.f64() >= taken).collect();
            NodeSlot { model, free }
        })
        .collect();
    let profiles: Vec<_> = (0..classes.max(1))
        .map(|c| {
            let mut p = crate::bench::class_profile(c);
            if overlap {
                p.costs.held_overlap = [0.0, 0.0, 0.3, 1.0][c % 4];
            }
            Arc::new(p)
        })
        .collect();
    let queue = (0..jobs)
        .map(|j| {
            let class = rng.usize(0..profiles.len());
            PendingJob {
                id: j.to_string(),
                profile: profiles[class].clone(),
                class: class as u64,
                sla: [0.3, 0.5, 0.6, 0.7][rng.usize(0..4)],
                avoid: vec![],
                order: j as u64,
            }
        })
        .collect();
    (queue, slots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::place::FastLimits;

    /// Small clusters, with the fast pass's limits at their defaults and tight enough to bind,
    /// each with and without the job classes' own indexes: no placement below its SLA, and at
    /// most 1% of the reference's harvest given up in all.
    #[test]
    fn the_fast_pass_keeps_the_sla_and_nearly_all_the_harvest_on_small_random_clusters() {
        let tight = FastLimits {
            candidates: 2,
            visits: 4,
            scan: 8,
            class_indexes: 0,
        };
        let no_class = FastLimits {
            class_indexes: 0,
            ..FastLimits::default()
        };
        let tight_class = FastLimits {
            class_indexes: 8,
            ..tight
        };
        let (mut want, mut got, mut moved, mut by_class) = (0.0, 0.0, 0, 0);
        for seed in 0..300 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let (nodes, jobs) = (rng.usize(5..40), rng.usize(10..300));
            let (queue, slots) = random_cluster(seed, nodes, jobs, [1, 5, 40][rng.usize(0..3)]);
            let mut harvests = Vec::new();
            for fast in [FastLimits::default(), no_class, tight, tight_class] {
                let c = compare(&queue, &slots, &PlaceParams::default(), fast);
                assert!(c.violations.is_empty(), "seed {seed}: {:?}", c.violations);
                (want, got) = (want + c.reference_harvest, got + c.fast_harvest);
                moved += c.moved + c.only_reference + c.only_fast;
                harvests.push(c.fast_harvest);
            }
            by_class += usize::from(harvests[0] != harvests[1] || harvests[2] != harvests[3]);
        }
        let loss = 1.0 - got / want;
        assert!(loss <= 0.01, "gave up {:.2}% of the harvest", loss * 100.0);
        assert!(moved > 0, "the tight limits change decisions");
        assert!(by_class > 0, "the classes' own indexes change decisions");
    }

    #[test]
    fn a_placement_below_its_sla_or_on_a_taken_gpu_is_reported() {
        let (queue, slots) = random_cluster(3, 4, 20, 2);
        let params = PlaceParams::default();
        let mut d = place(&queue, &mut slots.clone(), &params);
        let Some(i) = d
            .iter()
            .position(|x| matches!(x.outcome, Outcome::Placed(_)))
        else {
            panic!("nothing placed");
        };
        assert!(check(&queue, &slots, &params, &d).is_empty());
        let twice = d[i].clone();
        d.push(twice);
        assert!(check(&queue, &slots, &params, &d)[0].contains("not free"));
        d.pop();
        let strict = PlaceParams {
            margin: 0.9,
            ..params
        };
        assert!(check(&queue, &slots, &strict, &d)[0].contains("below its SLA"));
    }
}
