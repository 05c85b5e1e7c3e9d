//! The node harvest document, version 1: what one node leaves to offline work, per GPU and per
//! window, in the form the daemon serves (`GET /v1/harvest`) and a cluster scheduler reads.
//!
//! Every figure is measured over a trailing window that ends when the document was made.
//! `docs/cluster.md` ("The node harvest document") explains each field.

use serde::{Deserialize, Serialize};

/// The document version this crate writes and reads.
pub const VERSION: u32 = 1;

/// Memory quantiles per window: 0%, 5%, ..., 100% (time-weighted).
pub const QUANTILES: usize = 21;

/// What one node leaves to offline work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeHarvest {
    /// Always [`VERSION`]; a reader refuses others.
    pub version: u32,
    /// The node's name as the cluster knows it (Slurm's NodeName).
    pub node: String,
    /// When the document was made (Unix time, milliseconds).
    pub generated_unix_ms: u64,
    /// Who measured it: `daemon` (live), `recorded` (replayed from a file), `simulated`.
    pub source: String,
    /// One entry per GPU.
    pub gpus: Vec<GpuHarvest>,
    /// Cross-GPU alignment of online busy time, per pair of GPUs and window.
    #[serde(default)]
    pub pairs: Vec<PairAlignment>,
    /// Offline jobs on this node that report progress.
    #[serde(default)]
    pub jobs: Vec<JobProgress>,
}

/// One GPU's harvest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuHarvest {
    /// The GPU's index on the node (CUDA/NVML order).
    pub index: u32,
    /// The device's name, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Device memory.
    pub memory_total_bytes: u64,
    /// The trailing windows, shortest first.
    pub windows: Vec<GpuWindow>,
}

/// One GPU over one trailing window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuWindow {
    /// The window's length.
    pub window_s: u32,
    /// How much of it was measured (less than `window_s` after a daemon start).
    pub covered_s: f64,
    /// The share of the measured time in which offline could not run on this GPU (the gate held
    /// it preempted, or, with no gate, online was busy).
    pub busy_fraction: f64,
    /// How many times the gate preempted offline on this GPU in the window (each costs offline
    /// more than the time it is held: the job profile's `preemption_cost_s`). 0 where unknown.
    #[serde(default)]
    pub preemptions: u64,
    /// Bytes the pool took back from offline on this GPU in the window (reclaimed work is
    /// redone: the job profile's `reclaim_cost_s_per_gib`). 0 where unknown.
    #[serde(default)]
    pub reclaimed_bytes: u64,
    /// Reclaim episodes in the window: runs of reclaims one second apart or closer, each one
    /// online burst. `reclaimed_bytes` over this is the size of a typical episode, which sets
    /// how much in-flight offline work one episode throws away (the job profile's
    /// `costs.reclaim_episodes`). 0 where unknown.
    #[serde(default)]
    pub reclaim_episodes: u64,
    /// Memory left to offline on this GPU over the window.
    pub offline_memory: MemoryStats,
}

/// A time-weighted summary of one quantity over a window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Samples that fell in the window.
    pub samples: u64,
    /// Time-weighted mean.
    pub mean_bytes: u64,
    /// Time-weighted quantiles 0%, 5%, ..., 100% ([`QUANTILES`] values, ascending).
    pub quantiles_bytes: Vec<u64>,
}

/// How much two GPUs' online busy time coincides over a window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairAlignment {
    /// The two GPU indices, lower first.
    pub gpus: [u32; 2],
    /// The window's length.
    pub window_s: u32,
    /// Share of the measured time in which both were busy.
    pub overlap_fraction: f64,
    /// Share of the measured time in which either was busy.
    pub union_fraction: f64,
    /// Overlap over union (1 where neither was busy): the paper's alignment score.
    pub score: f64,
}

/// An offline job's progress as it reported it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobProgress {
    /// The job's id (Slurm's job id).
    pub job: String,
    /// Work done so far, in the job's own units (tokens, samples).
    pub units_total: f64,
    /// When it last reported (Unix ms).
    pub last_report_unix_ms: u64,
    /// Its rate over each trailing window.
    pub rates: Vec<Rate>,
}

/// A rate over one trailing window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rate {
    /// The window's length.
    pub window_s: u32,
    /// Units per second over the measured part of the window.
    pub per_s: f64,
    /// How much of the window had reports (less for a job that started inside it).
    pub covered_s: f64,
}

/// Why a harvest document was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DocError {
    /// Not JSON of this shape.
    #[error("not a harvest document: {0}")]
    Malformed(String),
    /// Another version.
    #[error("harvest document version {found} is not supported (this build reads version {VERSION}): upgrade the daemon or the scheduler so both speak version {VERSION}")]
    Version {
        /// The version found.
        found: u32,
    },
    /// A field out of its range.
    #[error("harvest document of node {node:?}: {what}")]
    Invalid {
        /// The node it claims to describe.
        node: String,
        /// What is wrong.
        what: String,
    },
}

impl NodeHarvest {
    /// Parses and validates a document.
    pub fn from_json(text: &str) -> Result<Self, DocError> {
        let raw: serde_json::Value =
            serde_json::from_str(text).map_err(|e| DocError::Malformed(e.to_string()))?;
        let found = raw.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
        if found != u64::from(VERSION) {
            return Err(DocError::Version {
                found: u32::try_from(found).unwrap_or(u32::MAX),
            });
        }
        let doc: NodeHarvest =
            serde_json::from_value(raw).map_err(|e| DocError::Malformed(e.to_string()))?;
        doc.validate()?;
        Ok(doc)
    }

    /// Checks every range: fractions in [0, 1], windows covered no more than their length,
    /// quantiles complete and ascending, pairs naming GPUs of this node.
    pub fn validate(&self) -> Result<(), DocError> {
        let bad = |what: String| DocError::Invalid {
            node: self.node.clone(),
            what,
        };
        if self.version != VERSION {
            return Err(DocError::Version {
                found: self.version,
            });
        }
        if self.node.is_empty() {
            return Err(bad("the node name is empty".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for g in &self.gpus {
            if !seen.insert(g.index) {
                return Err(bad(format!("GPU {} is listed twice", g.index)));
            }
            for w in &g.windows {
                check_window(w).map_err(|e| bad(format!("GPU {}: {e}", g.index)))?;
            }
        }
        for p in &self.pairs {
            if p.gpus[0] >= p.gpus[1] || !seen.contains(&p.gpus[0]) || !seen.contains(&p.gpus[1]) {
                return Err(bad(format!(
                    "pair {:?} must name two different GPUs of this node, lower first",
                    p.gpus
                )));
            }
            for (name, v) in [
                ("overlap_fraction", p.overlap_fraction),
                ("union_fraction", p.union_fraction),
                ("score", p.score),
            ] {
                check_fraction(name, v).map_err(|e| bad(format!("pair {:?}: {e}", p.gpus)))?;
            }
        }
        for j in &self.jobs {
            if !j.units_total.is_finite() || j.rates.iter().any(|r| !r.per_s.is_finite()) {
                return Err(bad(format!("job {}: a rate is not a number", j.job)));
            }
        }
        Ok(())
    }

    /// One GPU's entry.
    pub fn gpu(&self, index: u32) -> Option<&GpuHarvest> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// The alignment of two GPUs over the window of `window_s` (any order of the two).
    pub fn pair(&self, a: u32, b: u32, window_s: u32) -> Option<&PairAlignment> {
        let key = [a.min(b), a.max(b)];
        self.pairs
            .iter()
            .find(|p| p.gpus == key && p.window_s == window_s)
    }

    /// A job's progress.
    pub fn job(&self, id: &str) -> Option<&JobProgress> {
        self.jobs.iter().find(|j| j.job == id)
    }
}

impl GpuHarvest {
    /// The window of exactly `window_s`, or else the longest one shorter than it, or else the
    /// shortest one.
    pub fn window(&self, window_s: u32) -> Option<&GpuWindow> {
        self.windows
            .iter()
            .filter(|w| w.window_s <= window_s)
            .max_by_key(|w| w.window_s)
            .or_else(|| self.windows.iter().min_by_key(|w| w.window_s))
    }
}

impl JobProgress {
    /// The rate over the window of `window_s`, if reported.
    pub fn rate(&self, window_s: u32) -> Option<&Rate> {
        self.rates.iter().find(|r| r.window_s == window_s)
    }
}

fn check_fraction(name: &str, v: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(format!("{name} = {v} is outside [0, 1]"))
    }
}

fn check_window(w: &GpuWindow) -> Result<(), String> {
    if w.window_s == 0 {
        return Err("a window of 0 s".into());
    }
    if !(w.covered_s >= 0.0 && w.covered_s <= f64::from(w.window_s) * 1.001 + 1.0) {
        return Err(format!(
            "window {} s claims {} s covered",
            w.window_s, w.covered_s
        ));
    }
    check_fraction("busy_fraction", w.busy_fraction)
        .map_err(|e| format!("window {} s: {e}", w.window_s))?;
    let q = &w.offline_memory.quantiles_bytes;
    if !q.is_empty() && q.len() != QUANTILES {
        return Err(format!(
            "window {} s has {} memory quantiles, not {QUANTILES}",
            w.window_s,
            q.len()
        ));
    }
    if q.windows(2).any(|p| p[0] > p[1]) {
        return Err(format!(
            "window {} s: memory quantiles are not ascending",
            w.window_s
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(window_s: u32, busy: f64) -> GpuWindow {
        GpuWindow {
            window_s,
            covered_s: f64::from(window_s),
            busy_fraction: busy,
            preemptions: 0,
            reclaimed_bytes: 0,
            reclaim_episodes: 0,
            offline_memory: MemoryStats {
                samples: 3,
                mean_bytes: 10,
                quantiles_bytes: (0..QUANTILES as u64).collect(),
            },
        }
    }

    pub(crate) fn sample() -> NodeHarvest {
        NodeHarvest {
            version: VERSION,
            node: "gpu001".into(),
            generated_unix_ms: 1,
            source: "recorded".into(),
            gpus: (0..2)
                .map(|i| GpuHarvest {
                    index: i,
                    name: None,
                    memory_total_bytes: 80 << 30,
                    windows: vec![window(60, 0.3), window(600, 0.4)],
                })
                .collect(),
            pairs: vec![PairAlignment {
                gpus: [0, 1],
                window_s: 600,
                overlap_fraction: 0.3,
                union_fraction: 0.4,
                score: 0.75,
            }],
            jobs: vec![],
        }
    }

    #[test]
    fn a_document_round_trips_and_finds_its_parts() {
        let doc = sample();
        let back = NodeHarvest::from_json(&serde_json::to_string(&doc).unwrap()).unwrap();
        assert_eq!(back, doc);
        assert_eq!(back.pair(1, 0, 600).unwrap().score, 0.75);
        assert!(back.pair(0, 1, 60).is_none());
        let g = back.gpu(1).unwrap();
        assert_eq!(g.window(600).unwrap().busy_fraction, 0.4);
        assert_eq!(g.window(3600).unwrap().window_s, 600, "longest not above");
        assert_eq!(g.window(10).unwrap().window_s, 60, "else the shortest");
    }

    #[test]
    fn another_version_is_refused_by_name() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v["version"] = 2.into();
        let e = NodeHarvest::from_json(&v.to_string()).unwrap_err();
        assert_eq!(e, DocError::Version { found: 2 });
        assert!(e.to_string().contains("reads version 1"));
        let e = NodeHarvest::from_json("{\"node\":1}").unwrap_err();
        assert_eq!(e, DocError::Version { found: 0 });
        assert!(matches!(
            NodeHarvest::from_json("not json").unwrap_err(),
            DocError::Malformed(_)
        ));
    }

    #[test]
    fn out_of_range_fields_are_named() {
        let mut d = sample();
        d.gpus[0].windows[1].busy_fraction = 1.5;
        let e = d.validate().unwrap_err().to_string();
        assert!(
            e.contains("GPU 0") && e.contains("busy_fraction = 1.5"),
            "{e}"
        );

        let mut d = sample();
        d.gpus[1].windows[0]
            .offline_memory
            .quantiles_bytes
            .reverse();
        assert!(d
            .validate()
            .unwrap_err()
            .to_string()
            .contains("not ascending"));

        let mut d = sample();
        d.gpus[1].windows[0].offline_memory.quantiles_bytes.pop();
        assert!(d
            .validate()
            .unwrap_err()
            .to_string()
            .contains("20 memory quantiles"));

        let mut d = sample();
        d.pairs[0].gpus = [0, 7];
        assert!(d
            .validate()
            .unwrap_err()
            .to_string()
            .contains("two different GPUs"));

        let mut d = sample();
        d.gpus[1].index = 0;
        assert!(d
            .validate()
            .unwrap_err()
            .to_string()
            .contains("listed twice"));

        let mut d = sample();
        d.gpus[0].windows[0].covered_s = 1000.0;
        assert!(d.validate().unwrap_err().to_string().contains("covered"));
    }
}
