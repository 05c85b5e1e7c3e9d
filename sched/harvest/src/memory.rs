//! Memory left to offline per GPU, sampled over time: time-weighted mean and quantiles over a
//! trailing window (the node's memory trace that the paper's memory factor averages over).
//!
//! A sample holds until the next one, so sampling on change and sampling on a clock both work.

use std::collections::VecDeque;

use crate::doc::{MemoryStats, QUANTILES};

/// Samples of every GPU of a node.
#[derive(Clone, Debug)]
pub struct MemoryTracker {
    gpus: Vec<VecDeque<(u64, u64)>>,
    horizon_ns: u64,
    max_samples: usize,
}

impl MemoryTracker {
    /// A tracker for `gpus` GPUs keeping `horizon_ns` of samples.
    pub fn new(gpus: usize, horizon_ns: u64) -> Self {
        MemoryTracker {
            gpus: vec![VecDeque::new(); gpus],
            horizon_ns,
            max_samples: 1 << 16,
        }
    }

    /// `gpu` had `bytes` left to offline from `t_ns` on (samples come in time order).
    pub fn sample(&mut self, gpu: usize, t_ns: u64, bytes: u64) {
        let (horizon, max) = (self.horizon_ns, self.max_samples);
        let Some(g) = self.gpus.get_mut(gpu) else {
            return;
        };
        if g.back().is_some_and(|&(_, b)| b == bytes) {
            return; // unchanged: the earlier sample still holds
        }
        g.push_back((t_ns, bytes));
        // Keep the newest sample at or before the horizon: it holds into the window.
        let keep_from = t_ns.saturating_sub(horizon);
        while g.len() > max || (g.len() > 1 && g[1].0 <= keep_from) {
            g.pop_front();
        }
    }

    /// The time-weighted summary of `gpu` over the trailing window up to `now_ns`; `None` before
    /// its first sample.
    pub fn stats(&self, gpu: usize, now_ns: u64, window_ns: u64) -> Option<MemoryStats> {
        let g = self.gpus.get(gpu)?;
        let from = now_ns.saturating_sub(window_ns);
        // Each sample's value weighted by how long it held inside [from, now].
        let mut weighted: Vec<(u64, u64)> = Vec::new();
        for (i, &(t, bytes)) in g.iter().enumerate() {
            let end = g.get(i + 1).map_or(now_ns, |n| n.0).min(now_ns);
            let start = t.max(from);
            if end > start {
                weighted.push((bytes, end - start));
            }
        }
        if weighted.is_empty() {
            // A single sample taken at `now_ns` exactly.
            let &(_, bytes) = g.back().filter(|(t, _)| *t <= now_ns)?;
            weighted.push((bytes, 1));
        }
        let samples = g.iter().filter(|(t, _)| *t >= from && *t <= now_ns).count() as u64;
        Some(summarise(&mut weighted, samples.max(1)))
    }
}

/// Mean and quantiles of `(value, weight)` pairs.
fn summarise(weighted: &mut [(u64, u64)], samples: u64) -> MemoryStats {
    weighted.sort_unstable();
    let total: u128 = weighted.iter().map(|&(_, w)| u128::from(w)).sum();
    let sum: u128 = weighted
        .iter()
        .map(|&(v, w)| u128::from(v) * u128::from(w))
        .sum();
    let mut quantiles = Vec::with_capacity(QUANTILES);
    let (mut i, mut below) = (0usize, 0u128);
    for k in 0..QUANTILES {
        // The smallest value whose cumulative weight reaches k/20 of the total.
        let target = (total * k as u128).div_ceil((QUANTILES - 1) as u128);
        while i + 1 < weighted.len() && below + u128::from(weighted[i].1) < target.max(1) {
            below += u128::from(weighted[i].1);
            i += 1;
        }
        quantiles.push(weighted[i].0);
    }
    if let Some(last) = quantiles.last_mut() {
        *last = weighted[weighted.len() - 1].0;
    }
    MemoryStats {
        samples,
        mean_bytes: u64::try_from(sum / total.max(1)).unwrap_or(u64::MAX),
        quantiles_bytes: quantiles,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn values_are_weighted_by_how_long_they_held() {
        let mut m = MemoryTracker::new(1, 3600 * S);
        m.sample(0, 0, 100);
        m.sample(0, 90 * S, 10);
        let s = m.stats(0, 100 * S, 100 * S).unwrap();
        assert_eq!(s.mean_bytes, 91, "100 for 90 s, 10 for 10 s");
        assert_eq!(s.quantiles_bytes.len(), QUANTILES);
        assert_eq!(s.quantiles_bytes[0], 10, "the minimum");
        assert_eq!(s.quantiles_bytes[2], 10, "10% of the time at 10");
        assert_eq!(s.quantiles_bytes[3], 100, "15%: above the dip");
        assert_eq!(s.quantiles_bytes[20], 100, "the maximum");
        assert_eq!(s.samples, 2);
    }

    #[test]
    fn a_sample_before_the_window_holds_into_it() {
        let mut m = MemoryTracker::new(1, 3600 * S);
        m.sample(0, 0, 7);
        let s = m.stats(0, 1000 * S, 60 * S).unwrap();
        assert_eq!(s.mean_bytes, 7);
        assert!(s.quantiles_bytes.iter().all(|&q| q == 7));
        assert_eq!(
            m.stats(0, 0, 60 * S).unwrap().mean_bytes,
            7,
            "sampled just now"
        );
        assert!(
            MemoryTracker::new(1, S).stats(0, 5, 5).is_none(),
            "no samples"
        );
        assert!(m.stats(3, 5, 5).is_none(), "no such GPU");
    }

    #[test]
    fn old_samples_go_but_the_one_holding_at_the_horizon_stays() {
        let mut m = MemoryTracker::new(1, 10 * S);
        for k in 0..100u64 {
            m.sample(0, k * S, k % 2);
        }
        assert!(m.gpus[0].len() <= 12, "{}", m.gpus[0].len());
        let s = m.stats(0, 100 * S, 10 * S).unwrap();
        assert_eq!(s.mean_bytes, 0, "half 0, half 1, floor of the mean");
        assert_eq!(s.quantiles_bytes[10], 0);
        assert_eq!(s.quantiles_bytes[11], 1);
    }
}
