//! One job class's index for the fast pass: nodes by a bound on that class's share (idle time,
//! alignment and the memory its curve gets), refreshed lazily when a node's free GPUs change.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::index::{key_bits, Key};

/// See the module documentation. A node's bound only falls as its GPUs are given away, so a key
/// made before is still an upper bound: the walk takes the highest entry below its cursor and,
/// where the node changed since its key was made (versions differ), makes it afresh and puts it
/// back at its new, lower place, to be met again further down. A bound made afresh is kept at
/// most the key it replaces (a maker whose search gives up may return a looser one), so a key
/// never rises and a node put back is always below the cursor. The index starts from the size
/// index's keys (idle time and alignment alone, at least the class's bound), in their order, and
/// a node gets the class's own bound the first time a walk meets it: nodes no walk reaches cost
/// no curve look-up. Each node keeps [`FIGURES`] figures per GPU for the bound's maker (`fresh`),
/// so that a bound made afresh need not repeat the work that does not depend on which GPUs are
/// free.
pub(super) struct ClassIndex {
    set: BTreeSet<Key>,
    /// Per node, if it is in: its key's bits, the node's version when the key was made, and
    /// whether the key is the class's bound (else the size index's, at least as high).
    keys: Vec<Option<Entry>>,
    /// Per node: its GPUs.
    gpus: Vec<u32>,
    /// Per node: where its GPUs' figures start in `figures`, once a walk has met it (`u32::MAX`
    /// before: a node never met takes no room).
    start: Vec<u32>,
    /// Per node met: [`FIGURES`] per GPU, what `fresh` keeps there.
    figures: Vec<f64>,
    /// Per node: whether `fresh` has made its figures.
    made: Vec<bool>,
}

/// Figures kept per node and GPU for [`Fresh`].
pub(super) const FIGURES: usize = 2;

/// A node's entry in a [`ClassIndex`].
#[derive(Clone, Copy)]
struct Entry {
    bits: u64,
    version: u32,
    exact: bool,
}

/// Makes node `n`'s bound (`None`: not placeable) from the figures it keeps per GPU, making them
/// first where the flag is false (and setting it).
pub(super) trait Fresh: FnMut(usize, &mut [f64], &mut bool) -> Option<f64> {}
impl<F: FnMut(usize, &mut [f64], &mut bool) -> Option<f64>> Fresh for F {}

impl ClassIndex {
    /// The index of nodes of `gpus` GPUs each, at versions `versions`, from `coarse`: each node
    /// that may be placed on with at least the class's bound (a node left out is never met).
    /// Reuses the buffers of `spare`, an index no longer needed, if given (at 10,000 nodes they
    /// are large enough that the allocator hands fresh ones back to the kernel and gets them
    /// again, zeroed page by page).
    pub(super) fn new(
        gpus: &[usize],
        versions: &[u32],
        coarse: impl IntoIterator<Item = (usize, f64)>,
        spare: Option<ClassIndex>,
    ) -> Self {
        let mut index = spare.unwrap_or_else(|| ClassIndex {
            set: BTreeSet::new(),
            keys: Vec::new(),
            gpus: Vec::new(),
            start: Vec::new(),
            figures: Vec::new(),
            made: Vec::new(),
        });
        let nodes = gpus.len();
        index.keys.clear();
        index.keys.resize(nodes, None);
        index.gpus.clear();
        index.gpus.extend(gpus.iter().map(|&g| g as u32));
        index.start.clear();
        index.start.resize(nodes, u32::MAX);
        index.figures.clear();
        index.made.clear();
        index.made.resize(nodes, false);
        let keys = &mut index.keys;
        let entries: Vec<Key> = coarse
            .into_iter()
            .filter(|&(n, _)| n < nodes)
            .map(|(n, b)| {
                let bits = key_bits(b);
                keys[n] = Some(Entry {
                    bits,
                    version: versions[n],
                    exact: false,
                });
                (bits, Reverse(n as u32))
            })
            .collect();
        index.set = entries.into_iter().collect();
        index
    }

    /// Node `n`'s bound from `fresh`.
    fn make(&mut self, n: usize, fresh: &mut impl Fresh) -> Option<f64> {
        if self.start[n] == u32::MAX {
            self.start[n] = u32::try_from(self.figures.len()).expect("figures fit in u32");
            let g = self.gpus[n] as usize;
            self.figures
                .resize(self.figures.len() + FIGURES * g, f64::NAN);
        }
        let at = self.start[n] as usize;
        let g = FIGURES * self.gpus[n] as usize;
        fresh(n, &mut self.figures[at..at + g], &mut self.made[n])
    }

    /// The highest up-to-date entry below `cursor` (from the top where `None`): its node, bound
    /// and key (the next call's cursor). Entries of nodes whose version moved, or that have only
    /// the coarse bound, are made afresh with `fresh` on the way; one whose bound is the same
    /// keeps its place.
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
            let e = self.keys[n].expect("an entry has a key");
            if e.exact && e.version == versions[n] {
                return Some((n, f64::from_bits(e.bits), key));
            }
            // The key made before bounds the node still (its GPUs only went), so the new one is
            // kept at most that: a bound whose search gave up is never above one that did not.
            let bits = self.make(n, &mut fresh).map(|b| key_bits(b).min(e.bits));
            self.keys[n] = bits.map(|bits| Entry {
                bits,
                version: versions[n],
                exact: true,
            });
            if bits == Some(e.bits) {
                return Some((n, f64::from_bits(e.bits), key));
            }
            self.set.remove(&key);
            if let Some(bits) = bits {
                self.set.insert((bits, Reverse(n as u32)));
            }
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
        let mut index = ClassIndex::new(&[1; 5], &versions, (0..5).map(|n| (n, 1.0)), None);
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
        let mut index = ClassIndex::new(&[1; 3], &versions, [(0, 0.8), (1, 0.9), (2, 0.3)], None);
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

    #[test]
    fn a_bound_made_afresh_above_the_key_it_replaces_keeps_that_key() {
        let mut bounds = [Some(0.8), Some(0.6), Some(0.3)];
        let mut versions = vec![0; 3];
        let coarse = (0..3).map(|n| (n, 1.0));
        let mut index = ClassIndex::new(&[1; 3], &versions, coarse, None);
        assert_eq!(walk(&mut index, &versions, &bounds), [0, 1, 2]);
        // Node 1's maker gives up and answers looser than before: it keeps 0.6.
        bounds[1] = Some(0.9);
        versions[1] += 1;
        let (mut cursor, mut met) = (None, Vec::new());
        while let Some((n, b, key)) =
            index.next_below(cursor, &versions, |n, _: &mut [f64], _: &mut bool| {
                bounds[n]
            })
        {
            met.push((n, b));
            cursor = Some(key);
        }
        assert_eq!(met, [(0, 0.8), (1, 0.6), (2, 0.3)]);
    }

    /// The nodes by their current bound, highest first (lower positions first among equals), as
    /// an index made from scratch would walk them.
    fn from_scratch(bounds: &[Option<f64>]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..bounds.len()).filter(|&n| bounds[n].is_some()).collect();
        order.sort_by(|&a, &b| {
            let key = |n: usize| key_bits(bounds[n].unwrap());
            key(b).cmp(&key(a)).then(a.cmp(&b))
        });
        order
    }

    #[test]
    fn a_lazily_kept_index_walks_as_one_made_from_scratch_after_random_updates() {
        let mut rng = fastrand::Rng::with_seed(21);
        let (mut made_fresh, mut spare) = (0, None);
        for _ in 0..200 {
            let nodes = rng.usize(1..40);
            // Few levels, so that ties are common.
            let level = |rng: &mut fastrand::Rng| f64::from(rng.u8(0..6)) / 5.0;
            let mut bounds: Vec<Option<f64>> = Vec::new();
            for _ in 0..nodes {
                let b = level(&mut rng);
                bounds.push((rng.u8(0..8) != 0).then_some(b));
            }
            let mut versions = vec![0u32; nodes];
            // Coarse bounds at least the real ones, some equal; nodes without a bound may be in.
            let coarse: Vec<(usize, f64)> = (0..nodes)
                .filter_map(|n| match bounds[n] {
                    Some(b) => Some((n, if rng.bool() { b } else { b + level(&mut rng) })),
                    None => rng.bool().then_some((n, level(&mut rng))),
                })
                .collect();
            // Every other index reuses the last one's buffers.
            let old = spare.take().filter(|_| rng.bool());
            let mut index = ClassIndex::new(&vec![1; nodes], &versions, coarse, old);
            for _ in 0..20 {
                // A walk of random length, cut short as a job's search is.
                let want = from_scratch(&bounds);
                let len = rng.usize(0..=want.len() + 1);
                let (mut cursor, mut got) = (None, Vec::new());
                while got.len() < len {
                    let fresh = |n: usize, _: &mut [f64], _: &mut bool| {
                        made_fresh += 1;
                        bounds[n]
                    };
                    let Some((n, b, key)) = index.next_below(cursor, &versions, fresh) else {
                        break;
                    };
                    assert_eq!(Some(b), bounds[n]);
                    got.push(n);
                    cursor = Some(key);
                }
                assert_eq!(got, want[..len.min(want.len())], "bounds {bounds:?}");
                // Some nodes lose GPUs: their bounds fall, stay or go; their versions move.
                for n in 0..nodes {
                    if rng.u8(0..4) == 0 {
                        versions[n] += 1;
                        bounds[n] = match (bounds[n], rng.u8(0..4)) {
                            (Some(_), 0) => None,
                            (Some(b), 1) => Some(b * rng.f64()),
                            (b, _) => b,
                        };
                    }
                }
            }
            spare = Some(index);
        }
        assert!(made_fresh > 1000, "{made_fresh} bounds made");
    }
}
