//! The node side of Valve's cluster scheduling (paper section 6): what a GPU node leaves to
//! offline work, measured by trackers and published as one small versioned document.
//!
//! - [`busy`]: busy intervals per GPU; busy fractions and cross-GPU alignment over windows.
//! - [`memory`]: memory left to offline per GPU; time-weighted mean and quantiles.
//! - [`events`]: preemptions, reclaimed bytes and reclaim episodes per GPU over windows.
//! - [`progress`]: offline jobs' own progress reports, as rates.
//! - [`doc`]: the document ([`NodeHarvest`], version 1) and its validation.
//! - [`Recorder`]: the trackers of one node, turned into a document on request.

pub mod busy;
pub mod doc;
pub mod events;
pub mod memory;
pub mod progress;

pub use busy::{BusyTracker, Overlap};
pub use doc::{
    DocError, GpuHarvest, GpuWindow, JobProgress, MemoryStats, NodeHarvest, PairAlignment, Rate,
    QUANTILES, VERSION,
};
pub use events::EventTracker;
pub use memory::MemoryTracker;

/// The windows a node reports by default: 1 min, 10 min, 1 h.
pub const DEFAULT_WINDOWS_S: [u32; 3] = [60, 600, 3600];

const NS: u64 = 1_000_000_000;

/// A GPU as the document names it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuInfo {
    /// Its index on the node.
    pub index: u32,
    /// Its name, where known.
    pub name: Option<String>,
    /// Its memory.
    pub memory_total_bytes: u64,
}

/// The trackers of one node.
#[derive(Clone, Debug)]
pub struct Recorder {
    node: String,
    gpus: Vec<GpuInfo>,
    windows_s: Vec<u32>,
    /// When offline could not run, per GPU (the gate's preempted time, or online busy time).
    pub blocked: BusyTracker,
    /// When online was busy, per GPU (for alignment).
    pub online: BusyTracker,
    /// Memory left to offline, per GPU.
    pub memory: MemoryTracker,
    /// The gate's preemptions of offline, per GPU.
    pub preemptions: EventTracker,
    /// Bytes the pool took back from offline, per GPU.
    pub reclaimed: EventTracker,
    /// Reclaim episodes (runs of reclaims in consecutive seconds), per GPU.
    pub reclaim_episodes: EventTracker,
}

impl Recorder {
    /// Trackers for `gpus` (positions in this list are the trackers' GPU numbers), starting at
    /// `now_ns`, reporting `windows_s` (history is kept for the longest).
    pub fn new(node: &str, gpus: Vec<GpuInfo>, windows_s: &[u32], now_ns: u64) -> Self {
        let mut windows_s: Vec<u32> = windows_s.iter().copied().filter(|&w| w > 0).collect();
        windows_s.sort_unstable();
        windows_s.dedup();
        let horizon = u64::from(windows_s.last().copied().unwrap_or(3600)) * NS;
        let n = gpus.len();
        Recorder {
            node: node.into(),
            gpus,
            windows_s,
            blocked: BusyTracker::new(n, now_ns, horizon),
            online: BusyTracker::new(n, now_ns, horizon).with_merge_gap(NS / 1000),
            memory: MemoryTracker::new(n, horizon),
            preemptions: EventTracker::new(n, horizon),
            reclaimed: EventTracker::new(n, horizon),
            reclaim_episodes: EventTracker::new(n, horizon),
        }
    }

    /// The windows reported.
    pub fn windows_s(&self) -> &[u32] {
        &self.windows_s
    }

    /// The GPUs tracked.
    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    /// The document at `now_ns` (monotonic) = `unix_ms` (wall clock), with `jobs`' progress.
    pub fn document(&self, now_ns: u64, unix_ms: u64, jobs: Vec<JobProgress>) -> NodeHarvest {
        let gpus = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuHarvest {
                index: g.index,
                name: g.name.clone(),
                memory_total_bytes: g.memory_total_bytes,
                windows: self
                    .windows_s
                    .iter()
                    .map(|&w| self.window(i, now_ns, w))
                    .collect(),
            })
            .collect();
        let mut pairs = Vec::new();
        for &w in &self.windows_s {
            for a in 0..self.gpus.len() {
                for b in a + 1..self.gpus.len() {
                    if let Some(o) = self.online.overlap(a, b, now_ns, u64::from(w) * NS) {
                        let (ia, ib) = (self.gpus[a].index, self.gpus[b].index);
                        pairs.push(PairAlignment {
                            gpus: [ia.min(ib), ia.max(ib)],
                            window_s: w,
                            overlap_fraction: o.overlap,
                            union_fraction: o.union,
                            score: o.score,
                        });
                    }
                }
            }
        }
        NodeHarvest {
            version: VERSION,
            node: self.node.clone(),
            generated_unix_ms: unix_ms,
            source: "daemon".into(),
            gpus,
            pairs,
            jobs,
        }
    }

    fn window(&self, gpu: usize, now_ns: u64, window_s: u32) -> GpuWindow {
        let w = u64::from(window_s) * NS;
        let memory_total = self.gpus[gpu].memory_total_bytes;
        GpuWindow {
            window_s,
            covered_s: self.blocked.covered_ns(gpu, now_ns, w) as f64 / NS as f64,
            busy_fraction: self.blocked.busy_fraction(gpu, now_ns, w),
            preemptions: self.preemptions.sum(gpu, now_ns, w),
            reclaimed_bytes: self.reclaimed.sum(gpu, now_ns, w),
            reclaim_episodes: self.reclaim_episodes.sum(gpu, now_ns, w),
            offline_memory: self.memory.stats(gpu, now_ns, w).unwrap_or(MemoryStats {
                samples: 0,
                mean_bytes: memory_total,
                quantiles_bytes: vec![memory_total; QUANTILES],
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorder_makes_a_valid_document_of_what_it_saw() {
        let gpus = (0..3)
            .map(|i| GpuInfo {
                index: i,
                name: Some("H100".into()),
                memory_total_bytes: 80 << 30,
            })
            .collect();
        let mut r = Recorder::new("n1", gpus, &[600, 60, 60, 0], 0);
        assert_eq!(r.windows_s(), &[60, 600]);
        for k in 0..60u64 {
            let s = k * NS;
            r.blocked.add(0, s, s + NS / 4);
            r.online.add(0, s, s + NS / 4);
            r.online.add(1, s, s + NS / 4);
            r.online.add(2, s + NS / 2, s + NS * 3 / 4);
        }
        r.preemptions.add(0, 59 * NS, 3);
        r.reclaimed.add(1, 10 * NS, 1 << 30);
        r.reclaim_episodes.add(1, 10 * NS, 1);
        r.memory.sample(1, 0, 40 << 30);
        r.memory.sample(1, 30 * NS, 20 << 30);
        let doc = r.document(60 * NS, 123, vec![]);
        doc.validate().unwrap();
        let back = NodeHarvest::from_json(&serde_json::to_string(&doc).unwrap()).unwrap();
        let w = back.gpu(0).unwrap().window(60).unwrap();
        assert!((w.busy_fraction - 0.25).abs() < 1e-9);
        assert_eq!(w.covered_s, 60.0);
        assert_eq!(w.preemptions, 3);
        assert_eq!(
            back.gpu(1).unwrap().window(60).unwrap().reclaimed_bytes,
            1 << 30
        );
        assert_eq!(back.gpu(1).unwrap().window(60).unwrap().reclaim_episodes, 1);
        assert_eq!(back.pair(0, 1, 60).unwrap().score, 1.0);
        assert_eq!(back.pair(0, 2, 600).unwrap().score, 0.0);
        assert_eq!(back.pairs.len(), 6, "3 pairs x 2 windows");
        let m = &back.gpu(1).unwrap().window(60).unwrap().offline_memory;
        assert_eq!(m.mean_bytes, 30 << 30);
        assert_eq!(m.quantiles_bytes[0], 20 << 30);
        let unsampled = &back.gpu(2).unwrap().window(60).unwrap().offline_memory;
        assert_eq!(unsampled.mean_bytes, 80 << 30, "no pool: all memory");
        assert_eq!(unsampled.samples, 0);
    }
}
