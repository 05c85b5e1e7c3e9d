//! `valve-scheduler bench-pass`: times scheduling passes over a synthetic cluster (random harvest
//! documents and a queue of pending jobs of a few profile classes), each placement pass alike.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;
use valve_harvest::{GpuHarvest, GpuWindow, MemoryStats, NodeHarvest, PairAlignment, QUANTILES};

use crate::cycle::{plan, JobInfo, NodeInfo, Params, Phase, Report, Snapshot};
use crate::job::{CurvePoint, JobProfile, PROFILE_VERSION};
use crate::meta::JobMeta;
use crate::monitor::Monitor;
use crate::place::{Outcome, PassKind};

const GIB: u64 = 1 << 30;

/// What one timed pass did.
#[derive(Clone, Debug, Serialize)]
pub struct PassTiming {
    /// The placement pass (`fast`, `exact` or `reference`).
    pub pass: &'static str,
    /// Nodes in the cluster.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Pending jobs.
    pub pending: usize,
    /// Distinct job profiles among them.
    pub classes: usize,
    /// Jobs the timed pass was given: all pending, or the first of the pass's order (hardest
    /// first) where the run was limited.
    pub timed_jobs: usize,
    /// Jobs placed by the pass.
    pub placed: usize,
    /// Predicted harvest of its placements (share x GPUs, summed).
    pub harvest: f64,
    /// Wall time of the pass (ms), each repetition.
    pub pass_ms: Vec<f64>,
    /// CPU time of the pass's thread (ms), each repetition: what other load on the machine
    /// changes least.
    pub cpu_ms: Vec<f64>,
    /// The median of `pass_ms`, scaled by pending / timed jobs where the run was limited (an
    /// estimate of the whole pass).
    pub estimated_ms: f64,
    /// The process's peak resident memory after the pass (MiB; the most any pass so far used).
    pub peak_rss_mib: f64,
}

/// A synthetic cluster and queue: the engine's snapshot and the nodes' documents.
pub struct Cluster {
    /// Nodes in the cluster.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus: u32,
    /// Distinct profiles in the queue.
    pub classes: usize,
    snap: Snapshot,
    reports: HashMap<String, Report>,
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

const NOW_MS: u64 = 1_000_000_000;

/// `nodes` x `gpus` GPUs with random documents and `pending` held jobs of `classes` profiles.
pub fn cluster(nodes: usize, gpus: u32, pending: usize, classes: usize, seed: u64) -> Cluster {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut snap = Snapshot::default();
    let mut reports = HashMap::new();
    for n in 0..nodes {
        let name = format!("node{n:05}");
        snap.nodes.push(NodeInfo {
            name: name.clone(),
            closed: None,
        });
        let doc = random_doc(&mut rng, &name, gpus, NOW_MS);
        reports.insert(
            name,
            Report {
                doc,
                received_unix_ms: NOW_MS,
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
    Cluster {
        nodes,
        gpus,
        classes,
        snap,
        reports,
    }
}

/// The first `n` jobs of `snap` in the order a pass considers them (highest SLA, most GPUs,
/// oldest first): the jobs a pass limited to `n` would have decided first.
fn first_jobs(snap: &Snapshot, n: usize) -> Snapshot {
    let key = |j: &JobInfo| match &j.meta {
        Ok(m) => (m.sla, m.profile.as_ref().map_or(0, |p| p.gpus)),
        Err(_) => (0.0, 0),
    };
    let mut jobs = snap.jobs.clone();
    jobs.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0)
            .then(kb.1.cmp(&ka.1))
            .then(a.order.cmp(&b.order))
    });
    jobs.truncate(n);
    Snapshot {
        nodes: snap.nodes.clone(),
        jobs,
    }
}

/// Times `reps` passes of `pass` over `cluster` (the whole of `cycle::plan`). With `max_jobs`
/// below the queue's length, each pass is given only the first `max_jobs` jobs of its order
/// and `estimated_ms` scales the time to the whole queue.
pub fn time_pass(
    cluster: &Cluster,
    pass: PassKind,
    reps: usize,
    max_jobs: Option<usize>,
) -> PassTiming {
    let pending = cluster.snap.jobs.len();
    let limited = max_jobs.filter(|&m| m < pending);
    let snap = match limited {
        Some(m) => first_jobs(&cluster.snap, m),
        None => cluster.snap.clone(),
    };
    let mut params = Params::default();
    params.place.pass = pass;
    let (mut pass_ms, mut cpu_ms) = (Vec::new(), Vec::new());
    let (mut placed, mut harvest) = (0, 0.0);
    for _ in 0..reps.max(1) {
        let (t, c) = (Instant::now(), thread_cpu_ms());
        let p = plan(
            NOW_MS,
            &snap,
            &cluster.reports,
            &mut Monitor::default(),
            &params,
        );
        pass_ms.push(t.elapsed().as_secs_f64() * 1e3);
        cpu_ms.push(thread_cpu_ms() - c);
        placed = p
            .decisions
            .iter()
            .filter(|d| matches!(d.outcome, Outcome::Placed(_)))
            .count();
        harvest = crate::place::compare::harvest(&p.decisions);
    }
    let mut sorted = pass_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let timed_jobs = snap.jobs.len();
    PassTiming {
        pass: pass.name(),
        nodes: cluster.nodes,
        gpus_per_node: cluster.gpus,
        pending,
        classes: cluster.classes,
        timed_jobs,
        placed,
        harvest,
        pass_ms,
        cpu_ms,
        estimated_ms: median * pending as f64 / timed_jobs.max(1) as f64,
        peak_rss_mib: peak_rss_mib(),
    }
}

/// CPU time this thread has used (ms); NaN if it cannot be read.
pub fn thread_cpu_ms() -> f64 {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(f64::NAN, |t| {
        t.tv_sec() as f64 * 1e3 + t.tv_nsec() as f64 / 1e6
    })
}

/// The process's peak resident memory so far (MiB), from getrusage; NaN if it cannot be read.
pub fn peak_rss_mib() -> f64 {
    use nix::sys::resource::{getrusage, UsageWho};
    // Linux reports ru_maxrss in KiB.
    getrusage(UsageWho::RUSAGE_SELF).map_or(f64::NAN, |u| u.max_rss() as f64 / 1024.0)
}

/// The machine a benchmark ran on: host name (/proc/sys/kernel/hostname), CPU model, the cores
/// the process may use and the load.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Host name.
    pub host: String,
    /// The first CPU's model name (/proc/cpuinfo).
    pub cpu: String,
    /// Cores available to the process.
    pub cores: usize,
    /// The load averages over 1, 5 and 15 minutes when this was read (/proc/loadavg).
    pub load: String,
}

impl Machine {
    /// This machine, now.
    pub fn now() -> Machine {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let load = std::fs::read_to_string("/proc/loadavg")
            .map(|t| t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|_| "unknown".into());
        Machine {
            host,
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            load,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_synthetic_pass_places_jobs_and_times_each_repetition() {
        let c = cluster(10, 8, 200, 5, 1);
        for pass in ["fast", "exact", "reference"] {
            let t = time_pass(&c, PassKind::parse(pass).unwrap(), 2, None);
            assert_eq!(t.pass_ms.len(), 2);
            assert!(t.placed > 0 && t.placed <= 80, "{t:?}");
            assert_eq!(t.timed_jobs, 200);
        }
    }

    #[test]
    fn a_limited_pass_takes_the_hardest_jobs_first_and_scales_its_time() {
        let c = cluster(10, 8, 200, 5, 1);
        let t = time_pass(&c, PassKind::Reference, 1, Some(50));
        assert_eq!((t.timed_jobs, t.pending), (50, 200));
        assert!((t.estimated_ms - t.pass_ms[0] * 4.0).abs() < 1e-9);
        let first = first_jobs(&c.snap, 50);
        let sla = |j: &JobInfo| j.meta.as_ref().map_or(0.0, |m| m.sla);
        assert!(
            first.jobs.iter().all(|j| sla(j) == 0.7),
            "a quarter are at 0.7"
        );
        assert!(peak_rss_mib() > 0.0);
    }
}
