//! The fast pass's index: per job size k, the nodes with k free GPUs, ordered by the most a k-GPU
//! set of them could be predicted before memory and interruptions, kept up to date as GPUs go.
//!
//! A set's predicted share is at most its idle time (1 - the busiest GPU's busy share, or a
//! pair's union busy share) x the node's speed, and it is 0 unless the set is aligned. The bound
//! of a node for size k is the best of that over its aligned free sets (the k-th largest idle
//! time where alignment is off, or where too many sets would have to be looked at).
//!
//! That holds where the job keeps none of the time the gate holds it. One that keeps o of it
//! (`costs.held_overlap`, with interruptions modelled) gets up to o + (1 - o) idle: the keys do
//! not depend on the job, so a walk lifts them for its job (`bound::lift_bound`, with the
//! fastest node's speed, so that a key still bounds every node after it).

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::NodeSlot;
use crate::predict::ModelParams;

/// Steps of the search for a node's best aligned set before it settles for the plain bound.
const MAX_STEPS: usize = 4096;

/// A node's place in an index: its bound's bits (non-negative, so they order as the bound does)
/// and, among equal bounds, lower positions first when walked from the top.
pub(super) type Key = (u64, Reverse<u32>);

/// See the module documentation.
#[derive(Default)]
pub(super) struct NodeIndex {
    /// Per job size k (position k - 1), if some job of the pass has that size: the nodes with at
    /// least k free GPUs, by bound.
    sizes: Vec<Option<BTreeSet<Key>>>,
    /// Per node and size: its key there, if it is in that index.
    keys: Vec<Vec<Option<u64>>>,
}

/// `x` as an index orders it: numbers below 0 and NaN as 0.
pub(super) fn key_bits(x: f64) -> u64 {
    if x > 0.0 {
        x.to_bits()
    } else {
        0
    }
}

impl NodeIndex {
    /// The index of `nodes` for the job sizes in `sizes` (each at least 1).
    pub(super) fn new(nodes: &[NodeSlot], sizes: &[usize], params: &ModelParams) -> Self {
        let widest = nodes.iter().map(|n| n.free.len()).max().unwrap_or(0);
        let mut index = NodeIndex {
            sizes: vec![None; widest],
            keys: vec![vec![None; widest]; nodes.len()],
        };
        for &k in sizes {
            if let Some(s) = index.sizes.get_mut(k.max(1) - 1) {
                *s = Some(BTreeSet::new());
            }
        }
        for (n, slot) in nodes.iter().enumerate() {
            index.update(n, slot, params);
        }
        index
    }

    /// The nodes for size k, highest bound first, with their bound.
    pub(super) fn walk(&self, k: usize) -> impl Iterator<Item = (usize, f64)> + '_ {
        let set = self.sizes.get(k.max(1) - 1).and_then(Option::as_ref);
        set.into_iter()
            .flat_map(|s| s.iter().rev())
            .map(|&(bits, Reverse(n))| (n as usize, f64::from_bits(bits)))
    }

    /// Node `n`'s bound for size k, if it is in that index (it has k free GPUs).
    pub(super) fn bound(&self, n: usize, k: usize) -> Option<f64> {
        let key = *self.keys.get(n)?.get(k.max(1) - 1)?;
        key.map(f64::from_bits)
    }

    /// How many nodes the index of size k holds.
    pub(super) fn len(&self, k: usize) -> usize {
        let set = self.sizes.get(k.max(1) - 1).and_then(Option::as_ref);
        set.map_or(0, BTreeSet::len)
    }

    /// Puts node `n` where its free GPUs now place it.
    pub(super) fn update(&mut self, n: usize, slot: &NodeSlot, params: &ModelParams) {
        let at = Reverse(n as u32);
        let free: Vec<usize> = (0..slot.free.len()).filter(|&p| slot.free[p]).collect();
        for (k1, set) in self.sizes.iter_mut().enumerate() {
            let Some(set) = set else { continue };
            if let Some(old) = self.keys[n][k1].take() {
                set.remove(&(old, at));
            }
            if free.len() > k1 {
                let key = key_bits(set_bound(slot, &free, k1 + 1, params));
                set.insert((key, at));
                self.keys[n][k1] = Some(key);
            }
        }
    }
}

/// The most a `k`-GPU set of the `free` positions of `slot` could be predicted (see the module
/// documentation); 0 where no set is aligned.
fn set_bound(slot: &NodeSlot, free: &[usize], k: usize, params: &ModelParams) -> f64 {
    let model = &slot.model;
    let speed = model.speed;
    let idle = |p: usize| 1.0 - model.gpus[p].busy;
    let mut by_idle = free.to_vec();
    by_idle.sort_by(|&a, &b| idle(b).total_cmp(&idle(a)));
    let plain = idle(by_idle[k - 1]) * speed;
    if !params.alignment || k == 1 || speed.is_nan() || speed < 0.0 || plain.is_nan() {
        return plain;
    }
    let mut search = Search {
        slot,
        params,
        by_idle: &by_idle,
        k,
        best: 0.0,
        steps: 0,
    };
    search.descend(0, &mut Vec::with_capacity(k), f64::INFINITY);
    if search.steps > MAX_STEPS {
        return plain;
    }
    search.best * speed
}

/// Branch and bound over aligned sets, GPUs idlest first: a branch ends where its idle time
/// cannot beat the best set found.
struct Search<'a> {
    slot: &'a NodeSlot,
    params: &'a ModelParams,
    by_idle: &'a [usize],
    k: usize,
    best: f64,
    steps: usize,
}

impl Search<'_> {
    fn descend(&mut self, start: usize, cur: &mut Vec<usize>, idle: f64) {
        if cur.len() == self.k {
            self.best = self.best.max(idle);
            return;
        }
        let model = &self.slot.model;
        for i in start..self.by_idle.len() {
            self.steps += 1;
            if self.steps > MAX_STEPS || self.by_idle.len() - i < self.k - cur.len() {
                return;
            }
            let p = self.by_idle[i];
            let mut next = idle.min(1.0 - model.gpus[p].busy);
            if next <= self.best {
                return; // later GPUs are less idle still
            }
            let mut aligned = true;
            for &q in cur.iter() {
                aligned &= model.score(p, q, self.params) >= self.params.align_threshold;
                next = next.min(1.0 - model.union(p, q));
            }
            if aligned && next > self.best {
                cur.push(p);
                self.descend(i + 1, cur, next);
                cur.pop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::tests::gpu;
    use crate::predict::{predict, NodeModel};

    fn slot(busy: &[f64]) -> NodeSlot {
        let gpus = busy
            .iter()
            .enumerate()
            .map(|(i, &b)| gpu(i as u32, b, 32 << 30))
            .collect();
        NodeSlot {
            model: NodeModel::uniform("a", gpus, 0.9, 600),
            free: vec![true; busy.len()],
        }
    }

    #[test]
    fn a_nodes_bound_is_its_best_aligned_sets_idle_time() {
        let mut s = slot(&[0.1, 0.2, 0.3, 0.4]);
        let params = ModelParams::default();
        let free = [0, 1, 2, 3];
        assert!((set_bound(&s, &free, 1, &params) - 0.9).abs() < 1e-12);
        assert!((set_bound(&s, &free, 2, &params) - 0.8).abs() < 1e-12);
        // Pairs {0, 1} and {1, 2} out of step: the best pair is {0, 2}, and its union busy time
        // counts.
        s.model.set_pair(0, 1, 0.1, 0.2);
        s.model.set_pair(1, 2, 0.1, 0.3);
        s.model.set_pair(0, 2, 0.9, 0.35);
        assert!((set_bound(&s, &free, 2, &params) - 0.65).abs() < 1e-12);
        let no_align = ModelParams {
            alignment: false,
            ..params
        };
        assert!((set_bound(&s, &free, 2, &no_align) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn the_bound_is_at_least_every_sets_prediction_and_follows_taken_gpus() {
        let mut rng = fastrand::Rng::with_seed(7);
        let params = ModelParams::default();
        for _ in 0..200 {
            let busy: Vec<f64> = (0..6).map(|_| rng.f64()).collect();
            let mut s = slot(&busy);
            for a in 0..6 {
                for b in a + 1..6 {
                    s.model
                        .set_pair(a, b, rng.f64(), rng.f64().max(busy[a]).max(busy[b]));
                }
            }
            let free: Vec<usize> = (0..6).collect();
            for mask in 1u32..64 {
                let set: Vec<usize> = (0..6).filter(|p| mask & (1 << p) != 0).collect();
                let share = predict(&crate::job::tests::profile(1), &s.model, &set, &params);
                assert!(share.share <= set_bound(&s, &free, set.len(), &params) + 1e-12);
            }
        }
        let mut s = slot(&[0.1, 0.5]);
        let mut index = NodeIndex::new(std::slice::from_ref(&s), &[1, 2], &params);
        assert_eq!(index.walk(2).count(), 1);
        s.free[0] = false;
        index.update(0, &s, &params);
        assert_eq!(index.walk(2).count(), 0, "one GPU left");
        let (_, b) = index.walk(1).next().unwrap();
        assert!((b - 0.5).abs() < 1e-12);
    }
}
