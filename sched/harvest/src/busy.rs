//! Busy time per GPU as merged intervals: the share of a trailing window a GPU was busy, and how
//! much two GPUs' busy time overlaps (the alignment score of paper section 6).
//!
//! Times are nanoseconds on one monotonic clock. Intervals closer than `merge_gap_ns` merge, and
//! at most `max_intervals` are kept per GPU (the oldest go first, which shortens what is covered).

use std::collections::VecDeque;

/// Busy intervals of one GPU.
#[derive(Clone, Debug)]
struct IntervalLog {
    /// Closed intervals, oldest first, disjoint and ascending.
    closed: VecDeque<(u64, u64)>,
    /// The start of a busy period still going on.
    open: Option<u64>,
    /// Measurement covers time from here on.
    since_ns: u64,
}

/// Busy intervals of every GPU of a node.
#[derive(Clone, Debug)]
pub struct BusyTracker {
    gpus: Vec<IntervalLog>,
    horizon_ns: u64,
    merge_gap_ns: u64,
    max_intervals: usize,
}

/// Overlap of two GPUs' busy time over a window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overlap {
    /// Both busy, share of the measured time.
    pub overlap: f64,
    /// Either busy, share of the measured time.
    pub union: f64,
    /// Overlap over union; 1 where neither was busy.
    pub score: f64,
}

impl BusyTracker {
    /// A tracker for `gpus` GPUs, measuring from `now_ns`, keeping `horizon_ns` of history.
    pub fn new(gpus: usize, now_ns: u64, horizon_ns: u64) -> Self {
        BusyTracker {
            gpus: vec![
                IntervalLog {
                    closed: VecDeque::new(),
                    open: None,
                    since_ns: now_ns,
                };
                gpus
            ],
            horizon_ns,
            merge_gap_ns: 0,
            max_intervals: 1 << 18,
        }
    }

    /// Merges intervals separated by less than `gap_ns` (launch-driven busy periods come in
    /// bursts a few microseconds apart).
    pub fn with_merge_gap(mut self, gap_ns: u64) -> Self {
        self.merge_gap_ns = gap_ns;
        self
    }

    /// Keeps at most `max` intervals per GPU.
    pub fn with_max_intervals(mut self, max: usize) -> Self {
        self.max_intervals = max.max(1);
        self
    }

    /// GPUs tracked.
    pub fn gpus(&self) -> usize {
        self.gpus.len()
    }

    /// `gpu` became busy at `t_ns` (no effect if it already is, or for an unknown GPU).
    pub fn start(&mut self, gpu: usize, t_ns: u64) {
        if let Some(g) = self.gpus.get_mut(gpu) {
            g.open.get_or_insert(t_ns);
        }
    }

    /// `gpu` became idle at `t_ns` (no effect if it was not busy).
    pub fn end(&mut self, gpu: usize, t_ns: u64) {
        let Some(start) = self.gpus.get_mut(gpu).and_then(|g| g.open.take()) else {
            return;
        };
        self.add(gpu, start, t_ns);
    }

    /// `gpu` was busy over `[start_ns, end_ns)`. Intervals must come in order of their start;
    /// one that starts before the latest one's end is merged into it.
    pub fn add(&mut self, gpu: usize, start_ns: u64, end_ns: u64) {
        let (gap, max, horizon) = (self.merge_gap_ns, self.max_intervals, self.horizon_ns);
        let Some(g) = self.gpus.get_mut(gpu) else {
            return;
        };
        if end_ns <= start_ns {
            return;
        }
        match g.closed.back_mut() {
            Some(last) if start_ns <= last.1.saturating_add(gap) => last.1 = last.1.max(end_ns),
            _ => g.closed.push_back((start_ns, end_ns)),
        }
        let keep_from = end_ns.saturating_sub(horizon);
        while g.closed.len() > max || g.closed.front().is_some_and(|f| f.1 < keep_from) {
            if let Some((_, e)) = g.closed.pop_front() {
                g.since_ns = g.since_ns.max(e);
            }
        }
        g.since_ns = g.since_ns.max(keep_from);
    }

    /// `gpu` was busy over `[start_ns, end_ns)`, in any order: the interval merges with every
    /// one it overlaps or comes within the merge gap of, wherever they are. For busy time pooled
    /// from several sources whose intervals close out of order (online processes sharing a GPU).
    /// Time before what the tracker measures is left out.
    pub fn insert(&mut self, gpu: usize, start_ns: u64, end_ns: u64) {
        let gap = self.merge_gap_ns;
        let Some(g) = self.gpus.get(gpu) else {
            return;
        };
        let start_ns = start_ns.max(g.since_ns);
        if end_ns <= start_ns {
            return;
        }
        if g.closed.back().is_none_or(|last| start_ns >= last.0) {
            // At or after the latest start: what `add` does.
            return self.add(gpu, start_ns, end_ns);
        }
        let g = &mut self.gpus[gpu];
        // Closed intervals are disjoint and ascending, so their ends ascend too.
        let first = g
            .closed
            .partition_point(|i| i.1.saturating_add(gap) < start_ns);
        let past = g
            .closed
            .partition_point(|i| i.0 <= end_ns.saturating_add(gap));
        let (mut s, mut e) = (start_ns, end_ns);
        if first < past {
            s = s.min(g.closed[first].0);
            e = e.max(g.closed[past - 1].1);
            g.closed.drain(first..past);
        }
        g.closed.insert(first, (s, e));
        while g.closed.len() > self.max_intervals {
            if let Some((_, end)) = g.closed.pop_front() {
                g.since_ns = g.since_ns.max(end);
            }
        }
    }

    /// Sets the start of the busy period going on now on `gpu` (`None`: none), replacing any. It
    /// counts from the end of the latest closed interval at the earliest, so no time is counted
    /// twice. For a provisional period that a later [`BusyTracker::set_open`] may take back.
    pub fn set_open(&mut self, gpu: usize, start_ns: Option<u64>) {
        if let Some(g) = self.gpus.get_mut(gpu) {
            let after = g
                .closed
                .back()
                .map_or(g.since_ns, |last| last.1.max(g.since_ns));
            g.open = start_ns.map(|s| s.max(after));
        }
    }

    /// Seconds of the trailing `window_ns` up to `now_ns` that are measured on `gpu`.
    pub fn covered_ns(&self, gpu: usize, now_ns: u64, window_ns: u64) -> u64 {
        self.gpus.get(gpu).map_or(0, |g| {
            now_ns.saturating_sub(g.since_ns.max(now_ns.saturating_sub(window_ns)))
        })
    }

    /// The share of the measured part of the trailing window that `gpu` was busy (0 where
    /// nothing is measured).
    pub fn busy_fraction(&self, gpu: usize, now_ns: u64, window_ns: u64) -> f64 {
        let Some(g) = self.gpus.get(gpu) else {
            return 0.0;
        };
        let from = g.since_ns.max(now_ns.saturating_sub(window_ns));
        let span = now_ns.saturating_sub(from);
        if span == 0 {
            return 0.0;
        }
        let busy: u64 = clipped(g, from, now_ns).map(|(s, e)| e - s).sum();
        (busy as f64 / span as f64).clamp(0.0, 1.0)
    }

    /// How `a`'s and `b`'s busy time overlapped over the trailing window (measured where both
    /// were measured).
    pub fn overlap(&self, a: usize, b: usize, now_ns: u64, window_ns: u64) -> Option<Overlap> {
        let (ga, gb) = (self.gpus.get(a)?, self.gpus.get(b)?);
        let from = ga
            .since_ns
            .max(gb.since_ns)
            .max(now_ns.saturating_sub(window_ns));
        let span = now_ns.saturating_sub(from);
        if span == 0 {
            return None;
        }
        let xs: Vec<(u64, u64)> = clipped(ga, from, now_ns).collect();
        let ys: Vec<(u64, u64)> = clipped(gb, from, now_ns).collect();
        let both = intersection_ns(&xs, &ys);
        let total: u64 = xs.iter().chain(&ys).map(|(s, e)| e - s).sum();
        let either = total - both;
        let f = |x: u64| (x as f64 / span as f64).clamp(0.0, 1.0);
        Some(Overlap {
            overlap: f(both),
            union: f(either),
            score: if either == 0 {
                1.0
            } else {
                both as f64 / either as f64
            },
        })
    }
}

/// `g`'s busy intervals (the open one up to `to`) clipped to `[from, to)`.
fn clipped(g: &IntervalLog, from: u64, to: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
    g.closed
        .iter()
        .copied()
        .chain(g.open.map(|s| (s, to.max(s))))
        .filter_map(move |(s, e)| {
            let (s, e) = (s.max(from), e.min(to));
            (s < e).then_some((s, e))
        })
}

/// Total length of the intersection of two ascending lists of disjoint intervals.
fn intersection_ns(xs: &[(u64, u64)], ys: &[(u64, u64)]) -> u64 {
    let (mut i, mut j, mut total) = (0, 0, 0);
    while i < xs.len() && j < ys.len() {
        let (s, e) = (xs[i].0.max(ys[j].0), xs[i].1.min(ys[j].1));
        if s < e {
            total += e - s;
        }
        if xs[i].1 < ys[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn busy_fraction_counts_closed_and_open_intervals_inside_the_window() {
        let mut t = BusyTracker::new(2, 0, 3600 * S);
        t.add(0, 10 * S, 20 * S);
        t.start(0, 90 * S);
        assert_eq!(
            t.busy_fraction(0, 100 * S, 100 * S),
            0.2,
            "10 s closed + 10 s open"
        );
        assert_eq!(
            t.busy_fraction(0, 100 * S, 50 * S),
            0.2,
            "only the open one inside"
        );
        t.end(0, 95 * S);
        assert_eq!(t.busy_fraction(0, 100 * S, 10 * S), 0.5);
        assert_eq!(t.busy_fraction(1, 100 * S, 10 * S), 0.0);
        assert_eq!(t.busy_fraction(7, 100 * S, 10 * S), 0.0, "unknown GPU");
    }

    #[test]
    fn a_young_tracker_measures_only_since_it_started() {
        let mut t = BusyTracker::new(1, 100 * S, 3600 * S);
        t.add(0, 100 * S, 105 * S);
        assert_eq!(t.covered_ns(0, 110 * S, 60 * S), 10 * S);
        assert_eq!(t.busy_fraction(0, 110 * S, 60 * S), 0.5);
    }

    #[test]
    fn aligned_gpus_score_one_and_alternating_ones_zero() {
        let mut t = BusyTracker::new(3, 0, 3600 * S);
        for k in 0..10 {
            let s = k * 10 * S;
            t.add(0, s, s + 5 * S);
            t.add(1, s, s + 5 * S);
            t.add(2, s + 5 * S, s + 10 * S);
        }
        let same = t.overlap(0, 1, 100 * S, 100 * S).unwrap();
        assert_eq!(
            same,
            Overlap {
                overlap: 0.5,
                union: 0.5,
                score: 1.0
            }
        );
        let apart = t.overlap(0, 2, 100 * S, 100 * S).unwrap();
        assert_eq!(apart.score, 0.0);
        assert_eq!(apart.union, 1.0);
    }

    #[test]
    fn partial_overlap_scores_overlap_over_union() {
        let mut t = BusyTracker::new(2, 0, 3600 * S);
        t.add(0, 0, 6 * S);
        t.add(1, 3 * S, 9 * S);
        let o = t.overlap(0, 1, 10 * S, 10 * S).unwrap();
        assert!((o.score - 3.0 / 9.0).abs() < 1e-12, "{o:?}");
        assert!((o.overlap - 0.3).abs() < 1e-12);
        let idle = BusyTracker::new(2, 0, S)
            .overlap(0, 1, 5 * S, 5 * S)
            .unwrap();
        assert_eq!(idle.score, 1.0, "neither busy: aligned");
    }

    #[test]
    fn intervals_inserted_out_of_order_merge_where_they_belong() {
        let mut t = BusyTracker::new(1, 10, 3600 * S).with_merge_gap(5);
        t.insert(0, 100, 200);
        t.insert(0, 400, 500);
        t.insert(0, 50, 60); // before both
        t.insert(0, 300, 310); // between, touching neither
        assert_eq!(
            t.gpus[0].closed,
            [(50, 60), (100, 200), (300, 310), (400, 500)]
        );
        t.insert(0, 150, 303); // joins (100, 200) and (300, 310)
        assert_eq!(t.gpus[0].closed, [(50, 60), (100, 310), (400, 500)]);
        t.insert(0, 62, 398); // within the merge gap of all three
        assert_eq!(t.gpus[0].closed, [(50, 500)]);
        t.insert(0, 0, 20); // before the tracker measured: only 10..20 counts
        assert_eq!(t.gpus[0].closed, [(10, 20), (50, 500)]);
        t.insert(0, 0, 5);
        assert_eq!(t.gpus[0].closed.len(), 2, "entirely before: dropped");
        t.insert(0, 600, 700);
        assert_eq!(
            t.gpus[0].closed.back(),
            Some(&(600, 700)),
            "in order: appended"
        );
        assert_eq!(
            t.busy_fraction(0, 1010, 1000),
            (10 + 450 + 100) as f64 / 1000.0
        );
    }

    #[test]
    fn an_open_period_never_counts_time_twice_and_can_be_taken_back() {
        let mut t = BusyTracker::new(2, 0, 3600 * S);
        t.add(0, 0, 60 * S);
        t.set_open(0, Some(30 * S));
        assert_eq!(
            t.busy_fraction(0, 100 * S, 100 * S),
            1.0,
            "counted from 60 s on"
        );
        t.set_open(0, None);
        assert_eq!(t.busy_fraction(0, 100 * S, 100 * S), 0.6);
        t.add(1, 0, 10 * S);
        t.set_open(0, Some(90 * S));
        t.set_open(1, Some(90 * S));
        let o = t.overlap(0, 1, 100 * S, 100 * S).unwrap();
        assert!((o.overlap - 0.2).abs() < 1e-12, "{o:?}");
        t.set_open(7, Some(1));
    }

    #[test]
    fn near_intervals_merge_and_history_is_bounded() {
        let mut t = BusyTracker::new(1, 0, 100 * S)
            .with_merge_gap(1_000)
            .with_max_intervals(4);
        t.add(0, 0, 10);
        t.add(0, 500, 600);
        assert_eq!(t.gpus[0].closed.len(), 1, "500 ns apart: merged");
        for k in 1..10 {
            t.add(0, k * S, k * S + 1);
        }
        assert_eq!(t.gpus[0].closed.len(), 4);
        assert!(
            t.covered_ns(0, 10 * S, 100 * S) < 10 * S,
            "dropping the oldest shortens what is covered"
        );
        t.add(0, 500 * S, 501 * S);
        assert_eq!(t.gpus[0].closed.len(), 1, "older than the horizon: gone");
        assert_eq!(t.covered_ns(0, 501 * S, 1000 * S), 100 * S);
    }
}
