//! Counts of events per GPU over trailing windows: the gate's preemptions of offline and the
//! bytes the pool reclaimed from offline, the two costs an offline job pays beyond busy time.
//!
//! Events are summed into one-second buckets, so an hour costs at most 3,600 entries per GPU.

use std::collections::VecDeque;

const BUCKET_NS: u64 = 1_000_000_000;

/// Per-GPU event amounts in one-second buckets.
#[derive(Clone, Debug)]
pub struct EventTracker {
    gpus: Vec<VecDeque<(u64, u64)>>,
    horizon_ns: u64,
}

impl EventTracker {
    /// A tracker for `gpus` GPUs keeping `horizon_ns` of history.
    pub fn new(gpus: usize, horizon_ns: u64) -> Self {
        EventTracker {
            gpus: vec![VecDeque::new(); gpus],
            horizon_ns,
        }
    }

    /// `amount` happened on `gpu` at `t_ns` (in time order, give or take a bucket).
    pub fn add(&mut self, gpu: usize, t_ns: u64, amount: u64) {
        let horizon = self.horizon_ns;
        let Some(g) = self.gpus.get_mut(gpu) else {
            return;
        };
        if amount == 0 {
            return;
        }
        let bucket = t_ns - t_ns % BUCKET_NS;
        match g.iter_mut().rev().find(|(b, _)| *b == bucket) {
            Some((_, sum)) => *sum = sum.saturating_add(amount),
            None => g.push_back((bucket, amount)),
        }
        let keep_from = t_ns.saturating_sub(horizon + BUCKET_NS);
        while g.front().is_some_and(|&(b, _)| b < keep_from) {
            g.pop_front();
        }
    }

    /// What happened on `gpu` in the trailing `window_ns` up to `now_ns` (whole buckets: a
    /// bucket counts when it starts inside the window).
    pub fn sum(&self, gpu: usize, now_ns: u64, window_ns: u64) -> u64 {
        let from = now_ns.saturating_sub(window_ns);
        self.gpus.get(gpu).map_or(0, |g| {
            g.iter()
                .rev()
                .take_while(|&&(b, _)| b >= from)
                .filter(|&&(b, _)| b <= now_ns)
                .map(|&(_, n)| n)
                .sum()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = BUCKET_NS;

    #[test]
    fn sums_what_fell_in_the_window_and_forgets_past_the_horizon() {
        let mut t = EventTracker::new(2, 60 * S);
        for k in 0..120 {
            t.add(0, k * S + S / 2, 1);
            t.add(0, k * S + S / 3, 2);
        }
        t.add(1, 5 * S, 7);
        assert_eq!(t.sum(0, 120 * S, 10 * S), 30, "10 buckets of 3");
        assert_eq!(t.sum(0, 120 * S, 60 * S), 180);
        assert_eq!(
            t.sum(0, 120 * S, 100 * S),
            61 * 3,
            "past the horizon is gone"
        );
        assert_eq!(t.sum(1, 120 * S, 60 * S), 0);
        assert_eq!(t.sum(1, 6 * S, 10 * S), 7);
        assert_eq!(t.sum(9, 6 * S, 10 * S), 0, "no such GPU");
        assert!(t.gpus[0].len() <= 62, "one entry per second");
    }
}
