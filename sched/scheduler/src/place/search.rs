//! The best free GPU set for a job on one node: one GPU by its own share, several by branch and
//! bound over the GPUs sorted by their share alone, with exact memory factors computed only
//! where a GPU (or an aligned set) could still beat the best share found on other nodes.

use super::bound::{held_overlap, largest, may_exceed, non_negative, with_overlap, Curve};
use super::{NodeSlot, PendingJob, PlaceParams};
use crate::predict::{memory_factor, predict_with, MemoryModel, NodeModel, Prediction};

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

/// What `best_set` may rely on beyond the node: the job's prepared curve; per GPU position, a
/// bound on its share alone (`None`: none known); and whether a set scoring just the floor
/// would lose the tie to the best found.
pub(super) struct Hints<'a> {
    pub(super) curve: &'a Curve<'a>,
    pub(super) bounds: Option<&'a [f64]>,
    pub(super) ties_lose: bool,
}

/// The free GPU set of the job's size with the highest predicted share on one node.
/// Sets whose every GPU alone scores no more than `floor` are not looked at (`None`).
///
/// Only the GPUs that may beat the floor alone get their factors computed: the others come
/// after them in the order by score alone, where the search never reaches. If the search finds
/// nothing above the floor, no aligned set scores above it (each scores at most its worst GPU
/// alone), so the greedy set (which needs every factor) is made only where it could still win
/// a tie, or the search ran out of budget.
pub(super) fn best_set(
    job: &PendingJob,
    slot: &NodeSlot,
    memory: &mut [f64],
    params: &PlaceParams,
    floor: f64,
    hints: &Hints,
) -> Option<(Vec<usize>, Prediction)> {
    let k = job.profile.gpus as usize;
    if k == 1 {
        return best_gpu(job, slot, memory, params, floor, hints);
    }
    let total = slot.free.iter().filter(|&&f| f).count();
    if let (Some(b), true) = (hints.bounds, hints.ties_lose) {
        if !set_may_beat(
            slot,
            params,
            b,
            floor,
            k,
            held_overlap(&job.profile, &params.model),
        ) {
            return None;
        }
    }
    let may = |p: usize| slot.free[p] && hints.bounds.is_none_or(|b| may_exceed(b[p], floor));
    let free = by_solo(job, slot, memory, params, may);
    let memory_ro: &[f64] = memory;
    let o = held_overlap(&job.profile, &params.model);
    let solo =
        |p: usize| with_overlap(o, 1.0 - slot.model.gpus[p].busy) * memory_ro[p] * slot.model.speed;
    // No set beats its worst GPU alone, and the k-th best GPU is the best any set can do.
    if total < k || free.len() < k || solo(free[k - 1]) <= floor {
        return None;
    }
    let eval = |set: &[usize]| eval_set(job, slot, memory_ro, params, set);
    let mut search = SetSearch {
        slot,
        params,
        solo: &solo,
        eval: &eval,
        best: None,
        floor,
        budget: params.max_combinations,
        total,
    };
    search.descend(&free, k, 0, &mut Vec::with_capacity(k));
    if search.best.is_some() || (hints.bounds.is_some() && search.budget > 0 && hints.ties_lose) {
        return search.best;
    }
    // No aligned set: the best GPUs, to show what stood in the way.
    let free = by_solo(job, slot, memory, params, |p| slot.free[p]);
    let set = greedy_set(&free, k, slot, params)?;
    let pred = eval_set(job, slot, memory, params, &set);
    Some((set, pred))
}

/// Whether some aligned set of `k` GPUs could score more than `floor`: each of its GPUs' bound
/// alone exceeds it, and so does each pair's idle time (1 - their union busy time, through
/// [`with_overlap`] for a job that keeps `o` of its held time) x speed.
/// A set that scores more than the floor is such a set (it scores at most each of its GPUs
/// alone and each pair's idle time), so without one nothing but a tie at the floor can come
/// of the node. Gives up (true) after a few thousand steps.
fn set_may_beat(
    slot: &NodeSlot,
    params: &PlaceParams,
    bounds: &[f64],
    floor: f64,
    k: usize,
    o: f64,
) -> bool {
    let m = &params.model;
    let speed = slot.model.speed;
    let fits = |p: usize, q: usize| {
        if !m.alignment {
            return true; // pairs neither admit nor bound a set
        }
        let cap = with_overlap(o, non_negative(1.0 - slot.model.union(p, q))) * speed;
        slot.model.score(p, q, m) >= m.align_threshold && may_exceed(cap, floor)
    };
    let may: Vec<usize> = (0..bounds.len())
        .filter(|&p| may_exceed(bounds[p], floor))
        .collect();
    let mut steps = 0;
    clique(&may, k, &mut Vec::with_capacity(k), &fits, &mut steps)
}

/// Whether `cur` extends by `k - cur.len()` of `cand` to a set whose pairs all `fit`; true once
/// `steps` passes a limit.
fn clique(
    cand: &[usize],
    k: usize,
    cur: &mut Vec<usize>,
    fits: &dyn Fn(usize, usize) -> bool,
    steps: &mut usize,
) -> bool {
    if cur.len() == k {
        return true;
    }
    for (i, &p) in cand.iter().enumerate() {
        *steps += 1;
        if *steps > 4096 || cand.len() - i < k - cur.len() {
            return *steps > 4096;
        }
        if cur.iter().all(|&q| fits(p, q)) {
            cur.push(p);
            if clique(&cand[i + 1..], k, cur, fits, steps) {
                return true;
            }
            cur.pop();
        }
    }
    false
}

/// The free GPU positions `pick` selects, with their factors computed, best alone first.
fn by_solo(
    job: &PendingJob,
    slot: &NodeSlot,
    memory: &mut [f64],
    params: &PlaceParams,
    pick: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let mut free: Vec<usize> = (0..slot.free.len()).filter(|&p| pick(p)).collect();
    for &p in &free {
        factor(memory, p, job, &slot.model, params.model.memory);
    }
    let o = held_overlap(&job.profile, &params.model);
    let solo =
        |p: usize| with_overlap(o, 1.0 - slot.model.gpus[p].busy) * memory[p] * slot.model.speed;
    free.sort_by(|&a, &b| solo(b).total_cmp(&solo(a)));
    free
}

/// The prediction for `set`, whose factors are in `memory`.
fn eval_set(
    job: &PendingJob,
    slot: &NodeSlot,
    memory: &[f64],
    params: &PlaceParams,
    set: &[usize],
) -> Prediction {
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
}

/// One GPU: its own idle x memory is the prediction (the idle term through [`with_overlap`] for
/// a job that keeps part of its held time; interruptions lost are not counted in the ranking).
/// GPUs are tried in order of a cheap bound (that term x the curve at their largest memory),
/// and exact factors computed only while a GPU
/// could still beat the best one (and, once one was tried, only for GPUs a bound did not rule
/// out: a GPU at most the floor changes nothing the result depends on).
fn best_gpu(
    job: &PendingJob,
    slot: &NodeSlot,
    memory: &mut [f64],
    params: &PlaceParams,
    floor: f64,
    hints: &Hints,
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
                _ => hints.curve.at_most(largest(&g.memory_quantiles)),
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
        if best.is_some() && hints.bounds.is_some_and(|b| b[p] <= floor) {
            continue;
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
    /// Free GPUs. Those given to `descend` may be fewer: the best alone, followed by ones that
    /// score no more than the floor alone.
    total: usize,
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
        for i in start..self.total {
            if self.total - i < k - cur.len() || self.budget == 0 {
                return;
            }
            let bar = self.best.as_ref().map_or(self.floor, |(_, b)| b.share);
            if i >= free.len() || (self.solo)(free[i]) <= bar {
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
