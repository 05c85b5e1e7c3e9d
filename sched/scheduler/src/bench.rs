//! `valve-scheduler bench-pass`: times one scheduling pass over a synthetic cluster (random
//! harvest documents and a queue of pending jobs of a few profile classes), as issue 28 asks.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;
use valve_harvest::{GpuHarvest, GpuWindow, MemoryStats, NodeHarvest, PairAlignment, QUANTILES};

use crate::cycle::{plan, JobInfo, NodeInfo, Params, Phase, Report, Snapshot};
use crate::job::{CurvePoint, JobProfile, PROFILE_VERSION};
use crate::meta::JobMeta;
use crate::monitor::Monitor;
use crate::place::Outcome;

const GIB: u64 = 1 << 30;

/// What one timed pass did.
#[derive(Clone, Debug, Serialize)]
pub struct PassTiming {
    /// Nodes in the cluster.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Pending jobs.
    pub pending: usize,
    /// Distinct job profiles among them.
    pub classes: usize,
    /// Jobs placed by the pass.
    pub placed: usize,
    /// Wall time of the pass (ms), each repetition.
    pub pass_ms: Vec<f64>,
}

/// A GPU that was `busy` over each of the windows 60 s, 10 min and 1 h, with memory left to
/// offline at the ascending `quantiles`.
pub fn steady_gpu(index: u32, busy: f64, quantiles: Vec<u64>) -> GpuHarvest {
    GpuHarvest {
        index,
        name: None,
        memory_total_bytes: 80 * GIB,
        windows: [60u32, 600, 3600]
            .iter()
            .map(|&w| GpuWindow {
                window_s: w,
                covered_s: f64::from(w),
                busy_fraction: busy,
                preemptions: 0,
                reclaimed_bytes: 0,
                reclaim_episodes: 0,
                offline_memory: MemoryStats {
                    samples: 60,
                    mean_bytes: quantiles[quantiles.len() / 2],
                    quantiles_bytes: quantiles.clone(),
                },
            })
            .collect(),
    }
}

/// A random harvest document for a node of `gpus` GPUs.
pub fn random_doc(rng: &mut fastrand::Rng, name: &str, gpus: u32, now_ms: u64) -> NodeHarvest {
    let gpu = |i: u32, rng: &mut fastrand::Rng| {
        let busy = rng.f64() * 0.8;
        let base = (8 + rng.u64(0..56)) * GIB;
        let mut q: Vec<u64> = (0..QUANTILES)
            .map(|_| base - rng.u64(0..base / 2))
            .collect();
        q.sort_unstable();
        steady_gpu(i, busy, q)
    };
    let gpus_v: Vec<GpuHarvest> = (0..gpus).map(|i| gpu(i, rng)).collect();
    let mut pairs = Vec::new();
    for w in [60u32, 600, 3600] {
        for a in 0..gpus {
            for b in a + 1..gpus {
                let score = if rng.f64() < 0.3 {
                    rng.f64() * 0.5
                } else {
                    0.8 + rng.f64() * 0.2
                };
                pairs.push(PairAlignment {
                    gpus: [a, b],
                    window_s: w,
                    overlap_fraction: 0.1,
                    union_fraction: 0.2,
                    score,
                });
            }
        }
    }
    NodeHarvest {
        version: valve_harvest::VERSION,
        node: name.into(),
        generated_unix_ms: now_ms,
        source: "simulated".into(),
        gpus: gpus_v,
        pairs,
        jobs: vec![],
    }
}

/// One of `classes` job profiles: different sizes, GPU counts and memory needs.
pub fn class_profile(class: usize) -> JobProfile {
    let gpus = [1, 1, 1, 2, 4][class % 5];
    let need = (4 + (class as u64 * 7) % 28) * GIB;
    JobProfile {
        version: PROFILE_VERSION,
        name: format!("class-{class}"),
        units: "tokens".into(),
        gpus,
        alone_per_s: 1000.0 + class as f64,
        curve: vec![
            CurvePoint {
                memory_bytes: need / 4,
                per_s: 300.0,
            },
            CurvePoint {
                memory_bytes: need / 2,
                per_s: 700.0,
            },
            CurvePoint {
                memory_bytes: need,
                per_s: 1000.0 + class as f64,
            },
        ],
        required_bytes: None,
        deficit_penalty: 0.3,
        costs: crate::job::InterruptCosts::default(),
        measured: None,
    }
}

/// Times `reps` passes over `nodes` x `gpus` GPUs and `pending` jobs of `classes` profiles.
pub fn time_pass(
    nodes: usize,
    gpus: u32,
    pending: usize,
    classes: usize,
    reps: usize,
    seed: u64,
) -> PassTiming {
    let mut rng = fastrand::Rng::with_seed(seed);
    let now = 1_000_000_000;
    let mut snap = Snapshot::default();
    let mut reports = HashMap::new();
    for n in 0..nodes {
        let name = format!("node{n:05}");
        snap.nodes.push(NodeInfo {
            name: name.clone(),
            closed: None,
        });
        let doc = random_doc(&mut rng, &name, gpus, now);
        reports.insert(
            name,
            Report {
                doc,
                received_unix_ms: now,
            },
        );
    }
    let profiles: Vec<JobProfile> = (0..classes.max(1)).map(class_profile).collect();
    for j in 0..pending {
        let meta = JobMeta {
            sla: [0.3, 0.5, 0.6, 0.7][j % 4],
            profile: Some(profiles[rng.usize(0..profiles.len())].clone()),
            placed: None,
            avoid: vec![],
            evictions: 0,
        };
        snap.jobs.push(JobInfo {
            id: j.to_string(),
            phase: Phase::Held,
            meta: Ok(meta),
            order: j as u64,
        });
    }
    let params = Params::default();
    let mut pass_ms = Vec::new();
    let mut placed = 0;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let p = plan(now, &snap, &reports, &mut Monitor::default(), &params);
        pass_ms.push(t.elapsed().as_secs_f64() * 1e3);
        placed = p
            .decisions
            .iter()
            .filter(|d| matches!(d.outcome, Outcome::Placed(_)))
            .count();
    }
    PassTiming {
        nodes,
        gpus_per_node: gpus,
        pending,
        classes,
        placed,
        pass_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_synthetic_pass_places_jobs_and_times_each_repetition() {
        let t = time_pass(10, 8, 200, 5, 2, 1);
        assert_eq!(t.pass_ms.len(), 2);
        assert!(t.placed > 0 && t.placed <= 80, "{t:?}");
    }
}
