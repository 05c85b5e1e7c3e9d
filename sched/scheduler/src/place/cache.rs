//! A pass's memory-factor cache: per node, the factors of the latest [`CLASSES_PER_NODE`] job
//! classes (computed on first use) and a bound on what each class can still get there.
//!
//! Whether a node remembers a job's class decides whether the quick bound is consulted there
//! (`Pass::visit`), so the cache keeps its first-in first-out rule exactly: the oldest class is
//! forgotten first, and a hit does not refresh a class.

/// Classes remembered per node.
pub(super) const CLASSES_PER_NODE: usize = 16;

/// See the module documentation. An entry is a node and a slot of its ring.
pub(super) struct MemoryCache {
    /// Per node: its GPUs.
    gpus: Vec<usize>,
    /// Per node: where its slots' factors start in `factors`.
    start: Vec<usize>,
    /// Per node: its classes, a ring whose oldest entry is at `head`.
    classes: Vec<[u64; CLASSES_PER_NODE]>,
    /// Per node: the ring's oldest slot.
    head: Vec<usize>,
    /// Per node: entries in the ring.
    len: Vec<usize>,
    /// Per node, slot and GPU position: the class's memory factor (NaN: not computed yet).
    factors: Vec<f64>,
    /// Per node and slot: at least the k-th best share the class's k-GPU job can be predicted on
    /// the node's free GPUs (NaN: unknown). Free GPUs only get fewer in a pass, so it stays one.
    ceilings: Vec<f64>,
}

impl MemoryCache {
    /// An empty cache for nodes of `gpus` GPUs each.
    pub(super) fn new(gpus: impl Iterator<Item = usize>) -> Self {
        let gpus: Vec<usize> = gpus.collect();
        let mut start = Vec::with_capacity(gpus.len());
        let mut total = 0;
        for &g in &gpus {
            start.push(total);
            total += g * CLASSES_PER_NODE;
        }
        let nodes = gpus.len();
        MemoryCache {
            gpus,
            start,
            classes: vec![[0; CLASSES_PER_NODE]; nodes],
            head: vec![0; nodes],
            len: vec![0; nodes],
            factors: vec![f64::NAN; total],
            ceilings: vec![f64::NAN; nodes * CLASSES_PER_NODE],
        }
    }

    /// The slot of `class` on `node`, if it is remembered.
    pub(super) fn find(&self, node: usize, class: u64) -> Option<usize> {
        // The ring fills slots 0, 1, ... before its head first moves: the first `len` are taken.
        let taken = &self.classes[node][..self.len[node]];
        taken.iter().position(|&c| c == class)
    }

    /// Remembers `class` on `node` (not remembered yet), forgetting the oldest class if the node
    /// remembers as many as it can. Returns its slot, with no factor computed.
    pub(super) fn insert(&mut self, node: usize, class: u64) -> usize {
        let slot = if self.len[node] < CLASSES_PER_NODE {
            self.len[node] += 1;
            (self.head[node] + self.len[node] - 1) % CLASSES_PER_NODE
        } else {
            let oldest = self.head[node];
            self.head[node] = (oldest + 1) % CLASSES_PER_NODE;
            oldest
        };
        self.classes[node][slot] = class;
        self.factors_mut(node, slot).fill(f64::NAN);
        self.ceilings[node * CLASSES_PER_NODE + slot] = f64::NAN;
        slot
    }

    /// The factors of the class in `slot` on `node`, per GPU position (NaN: not computed yet).
    pub(super) fn factors_mut(&mut self, node: usize, slot: usize) -> &mut [f64] {
        let g = self.gpus[node];
        let at = self.start[node] + slot * g;
        &mut self.factors[at..at + g]
    }

    /// See [`MemoryCache::ceilings`].
    pub(super) fn ceiling(&self, node: usize, slot: usize) -> f64 {
        self.ceilings[node * CLASSES_PER_NODE + slot]
    }

    /// Lowers the ceiling of the class in `slot` on `node` to `c` (a NaN is ignored).
    pub(super) fn lower_ceiling(&mut self, node: usize, slot: usize, c: f64) {
        let x = &mut self.ceilings[node * CLASSES_PER_NODE + slot];
        if !c.is_nan() && super::bound::may_exceed(*x, c) {
            *x = c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_class_is_forgotten_first_and_a_hit_does_not_refresh_it() {
        let mut c = MemoryCache::new([2, 3].into_iter());
        for class in 0..CLASSES_PER_NODE as u64 {
            let s = c.insert(1, class);
            c.factors_mut(1, s).fill(class as f64);
        }
        assert_eq!(c.find(0, 0), None, "per node");
        assert!(c.find(1, 0).is_some(), "a hit");
        c.insert(1, 100);
        assert_eq!(c.find(1, 0), None, "the oldest goes, hit or not");
        let s = c.find(1, 1).unwrap();
        assert_eq!(c.factors_mut(1, s), [1.0; 3]);
        let s = c.find(1, 100).unwrap();
        assert!(c.factors_mut(1, s).iter().all(|f| f.is_nan()));
        c.lower_ceiling(1, s, 0.5);
        c.lower_ceiling(1, s, 0.7);
        c.lower_ceiling(1, s, f64::NAN);
        assert_eq!(c.ceiling(1, s), 0.5);
    }
}
