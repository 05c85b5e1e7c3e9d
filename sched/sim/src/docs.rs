//! Harvest documents of the simulated nodes, built from the online load the way a node's agent
//! measures it: per GPU and window (1, 10, 60 min) the busy fraction and the time-weighted
//! quantiles of memory left to offline; per pair of GPUs the overlap and union of busy time and
//! their ratio (the alignment score).
//!
//! The online side is the same for every policy, so one set of documents per pass is built here
//! and each policy copies it and adds its own jobs' progress. The oracle's documents come from
//! the hour after the pass instead of the hour before.

use valve_harvest::{GpuHarvest, GpuWindow, MemoryStats, NodeHarvest, PairAlignment, QUANTILES};

use super::cluster::{Cell, Cluster};

/// Minutes of online cells kept: the hour before a pass, the hour after it and a block.
pub const RING: usize = 128;
/// The windows each document reports (minutes).
pub const WINDOWS_MIN: [usize; 3] = [1, 10, 60];
const GIB: f64 = (1u64 << 30) as f64;

/// The online cells of the minutes around now, column by column (a column: every series).
pub struct Ring {
    series: usize,
    cells: Vec<Cell>,
    /// The first minute not computed yet.
    next: i64,
}

impl Ring {
    /// An empty ring whose first minute will be `start`.
    pub fn new(series: usize, start: i64) -> Ring {
        Ring {
            series,
            cells: vec![Cell::default(); series * RING],
            next: start,
        }
    }

    /// Computes every minute before `upto` not computed yet (at most the last [`RING`]).
    pub fn fill(&mut self, cluster: &Cluster, upto: i64, threads: usize) {
        if upto <= self.next {
            return;
        }
        let from = self.next.max(upto - RING as i64);
        let s = self.series.max(1);
        let mut cols: Vec<(i64, &mut [Cell])> = Vec::new();
        let minute_of_slot = |slot: usize| -> Option<i64> {
            // The minute in [from, upto) whose slot this is.
            let base = from - from.rem_euclid(RING as i64) + slot as i64;
            let m = if base < from {
                base + RING as i64
            } else {
                base
            };
            (m < upto).then_some(m)
        };
        for (slot, col) in self.cells.chunks_mut(s).enumerate() {
            if let Some(m) = minute_of_slot(slot) {
                cols.push((m, col));
            }
        }
        let threads = threads.clamp(1, cols.len().max(1));
        if threads == 1 {
            for (m, col) in cols {
                fill_column(cluster, m, col);
            }
        } else {
            let per = cols.len().div_ceil(threads);
            std::thread::scope(|sc| {
                let mut rest = cols;
                while !rest.is_empty() {
                    let chunk: Vec<_> = rest.drain(..per.min(rest.len())).collect();
                    sc.spawn(move || {
                        for (m, col) in chunk {
                            fill_column(cluster, m, col);
                        }
                    });
                }
            });
        }
        self.next = upto;
    }

    /// Every series over `minute`, which must be one of the last [`RING`] computed.
    pub fn col(&self, minute: i64) -> &[Cell] {
        assert!(
            minute < self.next && minute >= self.next - RING as i64,
            "minute {minute} is not in the ring (up to {})",
            self.next
        );
        let slot = minute.rem_euclid(RING as i64) as usize;
        &self.cells[slot * self.series..(slot + 1) * self.series]
    }
}

fn fill_column(cluster: &Cluster, minute: i64, col: &mut [Cell]) {
    for (s, c) in col.iter_mut().enumerate() {
        *c = cluster.cell(s, minute);
    }
}

/// Which hour a document describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// The minutes before the pass (what a node's agent has measured).
    Past,
    /// The minutes after it (what will happen: the oracle).
    Future,
}

/// The minutes of a window of `w` minutes at pass minute `t`, nearest first: before `t` for
/// the past; from `t + 1` (when a job placed now starts) for the future.
pub fn window_minutes(t: i64, dir: Dir, w: usize) -> impl Iterator<Item = i64> {
    (0..w as i64).map(move |k| match dir {
        Dir::Past => t - 1 - k,
        Dir::Future => t + 1 + k,
    })
}

/// Pairs of distinct series on one node whose overlap must be summed.
struct SeriesPair {
    a: u32,
    b: u32,
}

/// One document per node, updated in place each pass.
pub struct Templates {
    /// The documents (no jobs), node by node.
    pub docs: Vec<NodeHarvest>,
    /// Per node: its pairs of distinct series, and per GPU pair (in document order, each
    /// window) the index of its series pair or `None` for two GPUs of one series.
    node_pairs: Vec<(Vec<SeriesPair>, Vec<Option<usize>>)>,
}

/// Per-series figures over the windows.
#[derive(Clone)]
struct SeriesStats {
    busy: [f64; 3],
    /// Online idle-to-busy transitions (the gate's preemptions) in each window.
    preemptions: [f64; 3],
    mean: [f64; 3],
    q: [[u64; QUANTILES]; 3],
}

impl Templates {
    /// The documents' structure for `cluster`.
    pub fn new(cluster: &Cluster) -> Templates {
        let mut docs = Vec::new();
        let mut node_pairs = Vec::new();
        for (n, node) in cluster.nodes.iter().enumerate() {
            let gpus = cluster.node_gpus(n);
            let windows = WINDOWS_MIN
                .iter()
                .map(|&w| GpuWindow {
                    window_s: (w * 60) as u32,
                    covered_s: (w * 60) as f64,
                    busy_fraction: 0.0,
                    preemptions: 0,
                    reclaimed_bytes: 0,
                    reclaim_episodes: 0,
                    offline_memory: MemoryStats {
                        samples: w as u64,
                        mean_bytes: 0,
                        quantiles_bytes: vec![0; QUANTILES],
                    },
                })
                .collect::<Vec<_>>();
            let mut spairs: Vec<SeriesPair> = Vec::new();
            let mut gpair_index = Vec::new();
            let mut pairs = Vec::new();
            for &w in &WINDOWS_MIN {
                for a in 0..gpus.len() {
                    for b in a + 1..gpus.len() {
                        let (sa, sb) = (gpus[a].series, gpus[b].series);
                        let idx = (sa != sb).then(|| {
                            let (lo, hi) = (sa.min(sb), sa.max(sb));
                            spairs
                                .iter()
                                .position(|p| p.a == lo && p.b == hi)
                                .unwrap_or_else(|| {
                                    spairs.push(SeriesPair { a: lo, b: hi });
                                    spairs.len() - 1
                                })
                        });
                        gpair_index.push(idx);
                        pairs.push(PairAlignment {
                            gpus: [gpus[a].index, gpus[b].index],
                            window_s: (w * 60) as u32,
                            overlap_fraction: 0.0,
                            union_fraction: 0.0,
                            score: 1.0,
                        });
                    }
                }
            }
            node_pairs.push((spairs, gpair_index));
            docs.push(NodeHarvest {
                version: valve_harvest::VERSION,
                node: node.name.clone(),
                generated_unix_ms: 0,
                source: "simulated".into(),
                gpus: gpus
                    .iter()
                    .map(|g| GpuHarvest {
                        index: g.index,
                        name: Some("simulated 80 GiB".into()),
                        memory_total_bytes: (super::cluster::CAPACITY_GIB * GIB) as u64,
                        windows: windows.clone(),
                    })
                    .collect(),
                pairs,
                jobs: Vec::new(),
            });
        }
        Templates { docs, node_pairs }
    }

    /// Updates every document to pass minute `t`, looking `dir`, from `ring`.
    pub fn update(
        &mut self,
        cluster: &Cluster,
        ring: &Ring,
        t: i64,
        dir: Dir,
        unix_ms: u64,
        threads: usize,
    ) {
        let n = self.docs.len();
        let threads = threads.clamp(1, n.max(1));
        let per = n.div_ceil(threads).max(1);
        let cols: Vec<&[Cell]> = window_minutes(t, dir, WINDOWS_MIN[2])
            .map(|m| ring.col(m))
            .collect();
        let cols = &cols;
        std::thread::scope(|sc| {
            for (k, (docs, pairs)) in self
                .docs
                .chunks_mut(per)
                .zip(self.node_pairs.chunks(per))
                .enumerate()
            {
                let first = k * per;
                sc.spawn(move || {
                    for (i, (doc, np)) in docs.iter_mut().zip(pairs).enumerate() {
                        update_node(cluster, first + i, doc, np, cols, unix_ms);
                    }
                });
            }
        });
    }
}

/// One node's document from `cols` (the window's minutes, nearest first).
fn update_node(
    cluster: &Cluster,
    node: usize,
    doc: &mut NodeHarvest,
    (spairs, gpair_index): &(Vec<SeriesPair>, Vec<Option<usize>>),
    cols: &[&[Cell]],
    unix_ms: u64,
) {
    doc.generated_unix_ms = unix_ms;
    let gpus = cluster.node_gpus(node);
    // The node's series are contiguous: from the first GPU's to the last GPU's.
    let s0 = gpus.iter().map(|g| g.series).min().unwrap_or(0) as usize;
    let s1 = gpus.iter().map(|g| g.series).max().map_or(0, |s| s + 1) as usize;
    let mut stats: Vec<SeriesStats> = Vec::with_capacity(s1 - s0);
    let mut values: Vec<f32> = Vec::with_capacity(cols.len());
    for s in s0..s1 {
        let mut st = SeriesStats {
            busy: [0.0; 3],
            preemptions: [0.0; 3],
            mean: [0.0; 3],
            q: [[0; QUANTILES]; 3],
        };
        values.clear();
        let (mut busy, mut preemptions) = (0.0, 0.0);
        let mut wi = 0;
        for (k, col) in cols.iter().enumerate() {
            busy += f64::from(col[s].b);
            preemptions += f64::from(col[s].tr);
            values.push(col[s].m);
            if k + 1 == WINDOWS_MIN[wi] {
                st.busy[wi] = busy / (k + 1) as f64;
                st.preemptions[wi] = preemptions;
                let (mean, q) = quantiles(&values);
                st.mean[wi] = mean;
                st.q[wi] = q;
                wi += 1;
            }
        }
        stats.push(st);
    }
    for (g, gd) in gpus.iter().zip(doc.gpus.iter_mut()) {
        let st = &stats[g.series as usize - s0];
        for (wi, w) in gd.windows.iter_mut().enumerate() {
            w.busy_fraction = st.busy[wi].clamp(0.0, 1.0);
            w.preemptions = st.preemptions[wi].round() as u64;
            w.offline_memory.mean_bytes = st.mean[wi] as u64;
            w.offline_memory.quantiles_bytes.copy_from_slice(&st.q[wi]);
        }
    }
    // Overlap and union of each pair of distinct series, independent within a minute.
    let mut sums = vec![[[0.0f64; 2]; 3]; spairs.len()];
    for (pi, p) in spairs.iter().enumerate() {
        let (mut ov, mut un) = (0.0, 0.0);
        let mut wi = 0;
        for (k, col) in cols.iter().enumerate() {
            let (x, y) = (
                f64::from(col[p.a as usize].b),
                f64::from(col[p.b as usize].b),
            );
            ov += x * y;
            un += x + y - x * y;
            if k + 1 == WINDOWS_MIN[wi] {
                sums[pi][wi] = [ov / (k + 1) as f64, un / (k + 1) as f64];
                wi += 1;
            }
        }
    }
    let per_window = doc.pairs.len() / WINDOWS_MIN.len();
    for (i, pair) in doc.pairs.iter_mut().enumerate() {
        let wi = i / per_window.max(1);
        let (ov, un) = match gpair_index[i] {
            Some(pi) => (sums[pi][wi][0], sums[pi][wi][1]),
            None => {
                // Two GPUs of one in-step series: both busy exactly when either is.
                let g = gpus
                    .iter()
                    .find(|g| g.index == pair.gpus[0])
                    .expect("pair GPUs are the node's");
                let b = stats[g.series as usize - s0].busy[wi];
                (b, b)
            }
        };
        pair.overlap_fraction = ov.clamp(0.0, 1.0);
        pair.union_fraction = un.clamp(0.0, 1.0);
        pair.score = if un > 0.0 {
            (ov / un).clamp(0.0, 1.0)
        } else {
            1.0
        };
    }
}

/// The time-weighted mean and quantiles (0%, 5%, ..., 100%) of equally long samples, as
/// `valve_harvest::MemoryTracker` computes them: quantile k is the smallest value whose
/// cumulative weight reaches k/20 of the total; the last is the maximum.
pub fn quantiles(values: &[f32]) -> (f64, [u64; QUANTILES]) {
    let mut v: Vec<u64> = values
        .iter()
        .map(|&m| (f64::from(m) * GIB) as u64)
        .collect();
    v.sort_unstable();
    let n = v.len();
    let mut q = [0u64; QUANTILES];
    if n == 0 {
        return (0.0, q);
    }
    for (k, x) in q.iter_mut().enumerate() {
        let target = (n * k).div_ceil(QUANTILES - 1).max(1);
        *x = v[target - 1];
    }
    q[QUANTILES - 1] = v[n - 1];
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    (mean, q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::OnlineConfig;
    use std::sync::Arc;

    #[test]
    fn quantiles_match_the_memory_tracker() {
        let mut rng = fastrand::Rng::with_seed(9);
        for n in [1usize, 7, 10, 60] {
            let values: Vec<f32> = (0..n).map(|_| rng.f32() * 60.0).collect();
            let (mean, q) = quantiles(&values);
            let mut t = valve_harvest::MemoryTracker::new(1, 1 << 50);
            let s = 1_000_000_000u64;
            for (k, &m) in values.iter().enumerate() {
                t.sample(0, k as u64 * 60 * s, (f64::from(m) * GIB) as u64);
            }
            let st = t.stats(0, n as u64 * 60 * s, n as u64 * 60 * s).unwrap();
            assert_eq!(st.quantiles_bytes, q.to_vec(), "n = {n}");
            assert!((st.mean_bytes as f64 - mean).abs() < 2.0, "n = {n}");
        }
    }

    /// One node of four GPUs: an in-step 2-GPU service (series 0) and an out-of-step one (series
    /// 1 and 2), under a custom load where series 1 and 2 alternate being busy.
    fn node_with_both() -> Cluster {
        let mut rng = fastrand::Rng::with_seed(1);
        let mut c = Cluster::assemble(&[vec![(2, true), (2, false)]], 0.3, &mut rng);
        c.custom = Some(Arc::new(|s, minute| Cell {
            b: match s {
                0 => 0.3,
                _ if (minute + s as i64) % 2 == 0 => 0.6,
                _ => 0.0,
            },
            m: 40.0,
            tr: if s == 0 { 3.0 } else { 0.0 },
        }));
        c
    }

    #[test]
    fn an_out_of_step_pair_scores_below_an_in_step_pair() {
        let c = node_with_both();
        assert_eq!(c.series.len(), 3);
        let mut ring = Ring::new(c.series.len(), -60);
        ring.fill(&c, 62, 2);
        let mut t = Templates::new(&c);
        t.update(&c, &ring, 0, Dir::Past, 0, 2);
        let doc = &t.docs[0];
        doc.validate().unwrap();
        let in_step = doc.pair(0, 1, 3600).unwrap();
        let out = doc.pair(2, 3, 3600).unwrap();
        let across = doc.pair(0, 2, 3600).unwrap();
        assert_eq!(in_step.score, 1.0);
        assert!((in_step.union_fraction - 0.3).abs() < 1e-6);
        assert_eq!(out.score, 0.0, "never busy together");
        assert!((out.union_fraction - 0.6).abs() < 1e-6, "{out:?}");
        assert!(across.score > 0.0 && across.score < 0.5, "{across:?}");
        let w = doc.gpu(2).unwrap().window(3600).unwrap();
        assert!((w.busy_fraction - 0.3).abs() < 1e-6);
        assert_eq!(w.preemptions, 0, "series 1 never flips in this load");
        let w0 = doc.gpu(0).unwrap().window(3600).unwrap();
        assert_eq!(w0.preemptions, 180, "3 transitions a minute for an hour");
        assert_eq!(w.offline_memory.quantiles_bytes[0], 40 << 30);
        // A real trace: the out-of-step ranks still score below the in-step pair.
        let mut real = node_with_both();
        real.custom = None;
        let mut ring = Ring::new(real.series.len(), -60);
        ring.fill(&real, 62, 1);
        t.update(&real, &ring, 0, Dir::Past, 0, 1);
        let doc = &t.docs[0];
        assert_eq!(doc.pair(0, 1, 3600).unwrap().score, 1.0);
        assert!(doc.pair(2, 3, 3600).unwrap().score < 0.8);
    }

    #[test]
    fn the_future_document_is_the_past_one_an_hour_later() {
        let c = Cluster::build(&OnlineConfig {
            nodes: 3,
            ..OnlineConfig::default()
        });
        let mut ring = Ring::new(c.series.len(), -60);
        ring.fill(&c, 66, 2);
        let (mut past, mut future) = (Templates::new(&c), Templates::new(&c));
        future.update(&c, &ring, 0, Dir::Future, 0, 2);
        past.update(&c, &ring, 61, Dir::Past, 0, 2);
        // The same minutes summed in another order: equal up to rounding.
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        for (p, f) in past.docs.iter().zip(&future.docs) {
            for (gp, gf) in p.gpus.iter().zip(&f.gpus) {
                let (wp, wf) = (&gp.windows[2], &gf.windows[2]);
                assert_eq!(wp.offline_memory, wf.offline_memory, "the hour [1, 61)");
                assert!(close(wp.busy_fraction, wf.busy_fraction));
            }
            let hour = |d: &NodeHarvest| -> Vec<PairAlignment> {
                d.pairs
                    .iter()
                    .filter(|x| x.window_s == 3600)
                    .cloned()
                    .collect()
            };
            for (a, b) in hour(p).iter().zip(&hour(f)) {
                assert_eq!(a.gpus, b.gpus);
                assert!(close(a.score, b.score) && close(a.union_fraction, b.union_fraction));
            }
        }
        // ... and differs from what was measured before the pass.
        past.update(&c, &ring, 0, Dir::Past, 0, 2);
        assert_ne!(
            past.docs[0].gpus[0].windows[2],
            future.docs[0].gpus[0].windows[2]
        );
    }
}
