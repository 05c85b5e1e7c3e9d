//! One job class's index for the fast pass: nodes by a bound on that class's share (idle time,
//! alignment and the memory its curve gets), refreshed lazily when a node's free GPUs change.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::index::{key_bits, Key};

/// See the module documentation. A node's bound only falls as its GPUs are given away, so a key
/// made before is still an upper bound: the walk takes the highest entry below its cursor and,
/// where the node changed since its key was made (versions differ), makes it afresh and puts it
/// back at its new, lower place, to be met again further down. Each node keeps a figure per GPU
/// for the bound's maker (`fresh`), so that a bound made afresh need not repeat the work that
/// does not depend on which GPUs are free.
pub(super) struct ClassIndex {
    set: BTreeSet<Key>,
    /// Per node: its key's bits and the node's version when the key was made, if it is in.
    keys: Vec<Option<(u64, u32)>>,
    /// Per node: where its GPUs' figures start in `figures`.
    start: Vec<usize>,
    /// Per node and GPU: what `fresh` keeps there.
    figures: Vec<f64>,
    /// Per node: whether `fresh` has made its figures.
    made: Vec<bool>,
}

/// Makes node `n`'s bound (`None`: not placeable) from the figures it keeps per GPU, making them
/// first where the flag is false (and setting it).
pub(super) trait Fresh: FnMut(usize, &mut [f64], &mut bool) -> Option<f64> {}
impl<F: FnMut(usize, &mut [f64], &mut bool) -> Option<f64>> Fresh for F {}

impl ClassIndex {
    /// The index of nodes of `gpus` GPUs each, node `n` with its bound from `fresh`, made at
    /// version `versions[n]`.
    pub(super) fn new(gpus: &[usize], versions: &[u32], mut fresh: impl Fresh) -> Self {
        let mut start = Vec::with_capacity(gpus.len());
        let mut total = 0;
        for &g in gpus {
            start.push(total);
            total += g;
        }
        let mut index = ClassIndex {
            set: BTreeSet::new(),
            keys: vec![None; gpus.len()],
            start,
            figures: vec![f64::NAN; total],
            made: vec![false; gpus.len()],
        };
        for (n, &version) in versions.iter().enumerate().take(gpus.len()) {
            index.put(n, version, &mut fresh);
        }
        index
    }

    fn put(&mut self, n: usize, version: u32, fresh: &mut impl Fresh) {
        let end = self.start.get(n + 1).copied().unwrap_or(self.figures.len());
        let bound = fresh(n, &mut self.figures[self.start[n]..end], &mut self.made[n]);
        self.keys[n] = bound.map(|b| {
            let bits = key_bits(b);
            self.set.insert((bits, Reverse(n as u32)));
            (bits, version)
        });
    }

    /// The highest up-to-date entry below `cursor` (from the top where `None`): its node, bound
    /// and key (the next call's cursor). Entries of nodes whose version moved are made afresh
    /// with `fresh` on the way.
    pub(super) fn next_below(
        &mut self,
        cursor: Option<Key>,
        versions: &[u32],
        mut fresh: impl Fresh,
    ) -> Option<(usize, f64, Key)> {
        loop {
            let key = match cursor {
                Some(c) => *self.set.range(..c).next_back()?,
                None => *self.set.iter().next_back()?,
            };
            let n = key.1 .0 as usize;
            let (bits, made) = self.keys[n].expect("an entry has a key");
            if made == versions[n] {
                return Some((n, f64::from_bits(bits), key));
            }
            self.set.remove(&key);
            self.put(n, versions[n], &mut fresh);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks the whole index from the top.
    fn walk(index: &mut ClassIndex, versions: &[u32], bounds: &[Option<f64>]) -> Vec<usize> {
        let (mut cursor, mut out) = (None, Vec::new());
        while let Some((n, b, key)) =
            index.next_below(cursor, versions, |n, _: &mut [f64], _: &mut bool| bounds[n])
        {
            assert_eq!(Some(b), bounds[n], "node {n} is met with its current bound");
            out.push(n);
            cursor = Some(key);
        }
        out
    }

    #[test]
    fn a_walk_meets_nodes_by_their_current_bound_after_some_fell() {
        let mut bounds = [Some(0.9), Some(0.5), None, Some(0.7), Some(0.5)];
        let mut versions = vec![0; bounds.len()];
        let mut index = ClassIndex::new(&[1; 5], &versions, |n, _: &mut [f64], _: &mut bool| {
            bounds[n]
        });
        assert_eq!(walk(&mut index, &versions, &bounds), [0, 3, 1, 4]);
        // Node 0 falls below node 1 and node 3 leaves; node 4 is stale, with the same bound.
        bounds[0] = Some(0.4);
        bounds[3] = None;
        for n in [0, 3, 4] {
            versions[n] += 1;
        }
        assert_eq!(walk(&mut index, &versions, &bounds), [1, 4, 0]);
        // Every node's bound is up to date now, with no version moved: the same walk again.
        assert_eq!(walk(&mut index, &versions, &bounds), [1, 4, 0]);
    }

    #[test]
    fn a_stale_node_found_in_the_middle_of_a_walk_is_met_again_further_down() {
        let mut bounds = [Some(0.8), Some(0.6), Some(0.3)];
        let mut versions = vec![0; 3];
        let mut index = ClassIndex::new(&[1; 3], &versions, |n, _: &mut [f64], _: &mut bool| {
            bounds[n]
        });
        let (first, _, key) = index
            .next_below(None, &versions, |n, _: &mut [f64], _: &mut bool| bounds[n])
            .unwrap();
        assert_eq!(first, 0);
        // Node 1 changes after the walk passed node 0, and falls below node 2.
        bounds[1] = Some(0.2);
        versions[1] += 1;
        let mut cursor = Some(key);
        let mut rest = Vec::new();
        while let Some((n, _, k)) =
            index.next_below(cursor, &versions, |n, _: &mut [f64], _: &mut bool| {
                bounds[n]
            })
        {
            rest.push(n);
            cursor = Some(k);
        }
        assert_eq!(rest, [2, 1]);
    }
}
