//! The exhaustive placement pass, kept as it was first written: the reference the exact pass must
//! match decision for decision (`tests.rs`) and the fast pass is measured against (`compare.rs`).

use std::collections::HashMap;

use super::bound::{held_overlap, largest, lift_bound, with_overlap};
use super::{Decision, NodeSlot, Outcome, Pending, PendingJob, PlaceParams, Placement};
use crate::predict::{memory_factor, predict_with, MemoryModel, NodeModel, Prediction};

/// Memory factors of the latest job classes per node, computed on first use. A few entries per
/// node and a linear look-up: jobs come in few classes, and hashing every (class, node) pair of a
/// large pass cost more than the factors themselves.
struct MemoryCache {
    per_node: Vec<Vec<(u64, Box<[f64]>)>>,
}

/// Classes remembered per node.
const CLASSES_PER_NODE: usize = 16;

impl MemoryCache {
    fn new(nodes: usize) -> Self {
        MemoryCache {
            per_node: vec![Vec::new(); nodes],
        }
    }

    fn has(&self, job: &PendingJob, node: usize) -> bool {
        self.per_node[node].iter().any(|(c, _)| *c == job.class)
    }

    /// The class's factors on `node`, NaN where not computed yet ([`factor`] fills them).
    fn get(&mut self, job: &PendingJob, node: usize, gpus: usize) -> &mut [f64] {
        let entries = &mut self.per_node[node];
        let i = match entries.iter().position(|(c, _)| *c == job.class) {
            Some(i) => i,
            None => {
                if entries.len() >= CLASSES_PER_NODE {
                    entries.remove(0);
                }
                entries.push((job.class, vec![f64::NAN; gpus].into_boxed_slice()));
                entries.len() - 1
            }
        };
        &mut entries[i].1
    }
}

/// The memory factor of `job` on GPU position `p`, computed once into `memory`.
fn factor(
    memory: &mut [f64],
    p: usize,
    job: &PendingJob,
    model: &NodeModel,
    mm: MemoryModel,
) -> f64 {
    if memory[p].is_nan() {
        memory[p] = memory_factor(&job.profile, &model.gpus[p].memory_quantiles, mm);
    }
    memory[p]
}

/// Places `jobs` on `nodes`, marking the GPUs it gives away as taken. Returns one decision per
/// job, in the order the jobs were considered.
pub fn place(jobs: &[PendingJob], nodes: &mut [NodeSlot], params: &PlaceParams) -> Vec<Decision> {
    let mut order: Vec<&PendingJob> = jobs.iter().collect();
    order.sort_by(|a, b| {
        b.sla
            .total_cmp(&a.sla)
            .then(b.profile.gpus.cmp(&a.profile.gpus))
            .then(a.order.cmp(&b.order))
    });
    let mut pass = Pass::new(nodes, params);
    // A (class, SLA) job that found nothing, without nodes to avoid: the same job after it finds
    // nothing either, since nodes only fill up during a pass.
    let mut failed: HashMap<(u64, u64), Pending> = HashMap::new();
    let mut decisions = Vec::with_capacity(jobs.len());
    for job in order {
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
    /// The fastest node's speed (at least 1): a job that keeps part of its held time gets at
    /// most its held overlap x that more than `bound` says on a later node ([`lift_bound`]).
    fastest: f64,
    cache: MemoryCache,
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
        let cache = MemoryCache::new(nodes.len());
        let fastest = nodes.iter().map(|n| n.model.speed).fold(1.0, f64::max);
        Pass {
            fastest,
            nodes,
            params,
            free_count,
            bound,
            by_bound,
            cache,
        }
    }

    /// The best place for one job, taken if it meets the SLA. Nodes are visited from the idlest
    /// down; the search stops where no later node could beat the best found, or (once one was
    /// found) meet the SLA.
    fn place_one(&mut self, job: &PendingJob) -> Outcome {
        let k = job.profile.gpus as usize;
        let needed = job.sla + self.params.margin;
        let mut best: Option<(usize, Vec<usize>, Prediction)> = None;
        let mut considered = 0;
        let o = held_overlap(&job.profile, &self.params.model);
        for i in 0..self.by_bound.len() {
            let n = self.by_bound[i];
            if let Some((_, _, b)) = &best {
                let bound = lift_bound(o, self.bound[n], self.fastest);
                if bound <= b.share || bound < needed {
                    break;
                }
            }
            let slot = &self.nodes[n];
            if self.free_count[n] < k || job.avoid.iter().any(|a| a == &slot.model.name) {
                continue;
            }
            considered += 1;
            let floor = best.as_ref().map_or(-1.0, |(_, _, b)| b.share);
            if best.is_some()
                && !self.cache.has(job, n)
                && quick_bound(job, slot, self.params, floor.max(needed - 1e-12))
                    <= floor.max(needed - 1e-12)
            {
                continue; // cannot beat the best found, or meet the SLA
            }
            let memory = self.cache.get(job, n, slot.model.gpus.len());
            let Some((set, pred)) = best_set(job, slot, memory, self.params, floor) else {
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
        self.free_count[n] -= set.len();
        if self.free_count[n] == 0 {
            self.by_bound.retain(|&x| x != n); // full: no later job needs to look at it
        }
        Outcome::Placed(placement)
    }
}

/// The free GPU set of the job's size with the highest predicted share on one node.
/// A cheap bound on the job's predicted share on any free GPU of the node: idle x the most the
/// curve gives with the GPU's largest memory. The node's idlest GPU with its largest memory
/// bounds that in one curve lookup, tried first.
fn quick_bound(job: &PendingJob, slot: &NodeSlot, params: &PlaceParams, bar: f64) -> f64 {
    let speed = slot.model.speed;
    let o = held_overlap(&job.profile, &params.model);
    if params.model.memory != MemoryModel::Ignore {
        let (idle, memory) = slot.model.gpus.iter().fold((0.0f64, 0u64), |(i, m), g| {
            let top = largest(&g.memory_quantiles);
            (i.max(1.0 - g.busy), m.max(top))
        });
        let coarse = with_overlap(o, idle) * job.profile.share_at_most(memory) * speed;
        if coarse <= bar {
            return coarse;
        }
    }
    let mut bound: f64 = 0.0;
    for (g, &free) in slot.model.gpus.iter().zip(&slot.free) {
        if free {
            let memory = match params.model.memory {
                MemoryModel::Ignore => 1.0,
                _ => job.profile.share_at_most(largest(&g.memory_quantiles)),
            };
            bound = bound.max(with_overlap(o, 1.0 - g.busy) * memory);
        }
    }
    bound * speed
}

/// Sets whose every GPU alone scores no more than `floor` are not looked at (`None`).
fn best_set(
    job: &PendingJob,
    slot: &NodeSlot,
    memory: &mut [f64],
    params: &PlaceParams,
    floor: f64,
) -> Option<(Vec<usize>, Prediction)> {
    let k = job.profile.gpus as usize;
    let mm = params.model.memory;
    if k == 1 {
        return best_gpu(job, slot, memory, params, floor);
    }
    let mut free: Vec<usize> = (0..slot.free.len()).filter(|&p| slot.free[p]).collect();
    for &p in &free {
        factor(memory, p, job, &slot.model, mm);
    }
    let memory: &[f64] = memory;
    let o = held_overlap(&job.profile, &params.model);
    let solo =
        |p: usize| with_overlap(o, 1.0 - slot.model.gpus[p].busy) * memory[p] * slot.model.speed;
    free.sort_by(|&a, &b| solo(b).total_cmp(&solo(a)));
    // No set beats its worst GPU alone, and the k-th best GPU is the best any set can do.
    if free.len() < k || solo(free[k - 1]) <= floor {
        return None;
    }
    let eval = |set: &[usize]| {
        let mut m = [0.0; 64];
        for (x, &p) in m.iter_mut().zip(set) {
            *x = memory[p];
        }
        predict_with(
            &job.profile,
            &slot.model,
            set,
            &m[..set.len()],
            &params.model,
        )
    };
    let mut search = SetSearch {
        slot,
        params,
        solo: &solo,
        eval: &eval,
        best: None,
        floor,
        budget: params.max_combinations,
    };
    search.descend(&free, k, 0, &mut Vec::with_capacity(k));
    search.best.or_else(|| {
        // No aligned set: the best GPUs, to show what stood in the way.
        let set = greedy_set(&free, k, slot, params)?;
        let pred = eval(&set);
        Some((set, pred))
    })
}

/// One GPU: its own idle x memory is the prediction. GPUs are tried in order of a cheap bound
/// (idle x the curve at their largest memory), and exact factors computed only while a GPU
/// could still beat the best one.
fn best_gpu(
    job: &PendingJob,
    slot: &NodeSlot,
    memory: &mut [f64],
    params: &PlaceParams,
    floor: f64,
) -> Option<(Vec<usize>, Prediction)> {
    let mm = params.model.memory;
    let o = held_overlap(&job.profile, &params.model);
    let mut order: Vec<(f64, usize)> = (0..slot.free.len())
        .filter(|&p| slot.free[p])
        .map(|p| {
            let g = &slot.model.gpus[p];
            let top = match mm {
                MemoryModel::Ignore => 1.0,
                _ if !memory[p].is_nan() => memory[p],
                _ => job.profile.share_at_most(largest(&g.memory_quantiles)),
            };
            (with_overlap(o, 1.0 - g.busy) * top * slot.model.speed, p)
        })
        .collect();
    order.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut best: Option<(usize, f64)> = None;
    for (bound, p) in order {
        let bar = best.map_or(floor, |(_, s)| s.max(floor));
        if bound <= bar && best.is_some() {
            break;
        }
        let share = with_overlap(o, 1.0 - slot.model.gpus[p].busy)
            * factor(memory, p, job, &slot.model, mm)
            * slot.model.speed;
        if best.is_none_or(|(_, s)| share > s) {
            best = Some((p, share));
        }
    }
    let (p, share) = best?;
    if share <= floor {
        return None;
    }
    let pred = predict_with(
        &job.profile,
        &slot.model,
        &[p],
        &memory[p..=p],
        &params.model,
    );
    Some((vec![p], pred))
}

/// Branch and bound over the free GPUs (sorted best alone first): a branch ends where its newest
/// GPU alone cannot beat the best set found, or where a pair of it breaks alignment.
struct SetSearch<'a> {
    slot: &'a NodeSlot,
    params: &'a PlaceParams,
    solo: &'a dyn Fn(usize) -> f64,
    eval: &'a dyn Fn(&[usize]) -> Prediction,
    best: Option<(Vec<usize>, Prediction)>,
    floor: f64,
    /// Sets still to evaluate before the search settles for what it has.
    budget: usize,
}

impl SetSearch<'_> {
    fn descend(&mut self, free: &[usize], k: usize, start: usize, cur: &mut Vec<usize>) {
        if cur.len() == k {
            self.budget = self.budget.saturating_sub(1);
            let pred = (self.eval)(cur);
            let bar = self.best.as_ref().map_or(self.floor, |(_, b)| b.share);
            if pred.share > bar && pred.aligned {
                self.best = Some((cur.clone(), pred));
            }
            return;
        }
        for i in start..free.len() {
            if free.len() - i < k - cur.len() || self.budget == 0 {
                return;
            }
            let bar = self.best.as_ref().map_or(self.floor, |(_, b)| b.share);
            if (self.solo)(free[i]) <= bar {
                return; // later GPUs are worse still
            }
            let p = free[i];
            let aligned = !self.params.model.alignment
                || cur.iter().all(|&q| {
                    self.slot.model.score(p, q, &self.params.model)
                        >= self.params.model.align_threshold
                });
            if aligned {
                cur.push(p);
                self.descend(free, k, i + 1, cur);
                cur.pop();
            }
        }
    }
}

/// Best GPUs first, skipping any that would break alignment with those already chosen.
fn greedy_set(
    free: &[usize],
    k: usize,
    slot: &NodeSlot,
    params: &PlaceParams,
) -> Option<Vec<usize>> {
    let mut set: Vec<usize> = Vec::with_capacity(k);
    for &p in free {
        let fits = !params.model.alignment
            || set
                .iter()
                .all(|&q| slot.model.score(p, q, &params.model) >= params.model.align_threshold);
        if fits {
            set.push(p);
            if set.len() == k {
                return Some(set);
            }
        }
    }
    (free.len() >= k).then(|| free[..k].to_vec())
}
