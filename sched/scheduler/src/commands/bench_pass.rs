//! `valve-scheduler bench-pass`: times scheduling passes (fast and exhaustive side by side) over
//! synthetic clusters and queues of several sizes, or compares their decisions on random clusters.

use std::process::ExitCode;

use clap::Args;
use serde::Serialize;

use crate::error::{exit, usage};
use valve_scheduler::bench::{cluster, time_pass, Machine, PassTiming};
use valve_scheduler::place::compare::{compare, random_cluster_with, Comparison};
use valve_scheduler::place::{FastLimits, PassKind, PlaceParams};

/// Times one pass of placement (and the monitor) over random harvest documents.
///
/// Each configuration runs every pass of --passes over the same cluster and queue, so their
/// ratio is measured in one run. Jobs of one profile class share memory factors, so the cost
/// depends on how many distinct profiles the queue holds; each --classes value is a row.
#[derive(Args, Debug)]
pub struct BenchPassArgs {
    /// Nodes in the synthetic cluster (comma-separated list: one configuration each).
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    pub nodes: Vec<usize>,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
    /// Pending jobs (comma-separated list: one configuration each, with every --nodes).
    #[arg(long, value_delimiter = ',', default_value = "10000")]
    pub pending: Vec<usize>,
    /// Sweep 1,000, 10,000 and 100,000 jobs x 100, 1,000 and 10,000 nodes (replaces --nodes
    /// and --pending).
    #[arg(long)]
    pub sweep: bool,
    /// Distinct job profiles among them (comma-separated list: one run each).
    #[arg(long, value_delimiter = ',', default_value = "100,10000")]
    pub classes: Vec<usize>,
    /// Passes to time, comma-separated: fast, exact (the exhaustive pass's decisions with bounds
    /// that skip nodes), reference (the exhaustive pass).
    #[arg(long, value_delimiter = ',', default_value = "fast,reference", value_parser = PassKind::parse)]
    pub passes: Vec<PassKind>,
    /// Give the exact and reference passes only the first this many jobs of their order where
    /// the queue is longer, and scale their time to the whole queue (marked "estimated").
    #[arg(long)]
    pub reference_max_jobs: Option<usize>,
    /// The fast pass's search per job: nodes meeting the SLA after which it takes the best.
    #[arg(long, default_value_t = FastLimits::default().candidates)]
    pub candidates: usize,
    /// The fast pass's search per job: nodes evaluated at most.
    #[arg(long, default_value_t = FastLimits::default().visits)]
    pub visits: usize,
    /// The fast pass's search per job: nodes looked at most (the cheaply ruled out included).
    #[arg(long, default_value_t = FastLimits::default().scan)]
    pub scan: usize,
    /// The fast pass: families of job classes (profiles of one shape) at most with an index of
    /// their own at once (0: none; a family gets one once its jobs have looked at more nodes
    /// than it costs).
    #[arg(long, default_value_t = FastLimits::default().class_indexes)]
    pub class_indexes: usize,
    /// Passes per configuration (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Passes per configuration of the exact and reference passes (default: --reps).
    #[arg(long)]
    pub reference_reps: Option<usize>,
    /// Random seed of the synthetic cluster.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Exit 4 if a configuration's median fast pass takes longer than this many milliseconds.
    #[arg(long)]
    pub max_ms: Option<f64>,
    /// Instead of timing: compare the fast pass's decisions with the exhaustive pass's on this
    /// many random clusters of 100-1,000 nodes and 1,000-10,000 jobs (exit 4 if any placement
    /// is below its SLA or the harvest given up exceeds 1%).
    #[arg(long)]
    pub compare: Option<usize>,
    /// With --compare: profiles that keep part of the time the gate holds them
    /// (`costs.held_overlap` 0, 0, 0.3 and 1 by class), as measured profiles may.
    #[arg(long)]
    pub overlap: bool,
}

/// Runs the benchmark and prints one line (or JSON object) per configuration.
pub fn exec(a: &BenchPassArgs, json: bool) -> anyhow::Result<ExitCode> {
    if a.nodes.contains(&0) || a.gpus == 0 || a.classes.contains(&0) || a.passes.is_empty() {
        return Err(usage(
            "--nodes, --gpus and --classes must be at least 1, and --passes must name a pass",
        ));
    }
    if a.reps == 0 || a.reference_reps == Some(0) {
        return Err(usage("--reps and --reference-reps must be at least 1"));
    }
    if a.candidates == 0 || a.visits == 0 || a.scan == 0 {
        return Err(usage(
            "--candidates, --visits and --scan must be at least 1",
        ));
    }
    let limits = FastLimits {
        candidates: a.candidates,
        visits: a.visits,
        scan: a.scan,
        class_indexes: a.class_indexes,
    };
    if let Some(n) = a.compare {
        return run_compare(n, a.seed, limits, a.overlap, json);
    }
    let sizes: Vec<(usize, usize)> = if a.sweep {
        let s = [1_000, 10_000, 100_000];
        s.iter()
            .flat_map(|&j| [100, 1_000, 10_000].map(|n| (j, n)))
            .collect()
    } else {
        a.pending
            .iter()
            .flat_map(|&j| a.nodes.iter().map(move |&n| (j, n)))
            .collect()
    };
    let machine = Machine::now();
    if !json {
        println!(
            "machine: {} ({}, {} cores), load {}",
            machine.host, machine.cpu, machine.cores, machine.load
        );
    }
    let mut rows = Vec::new();
    let mut missed = false;
    for &(pending, nodes) in &sizes {
        for &classes in &a.classes {
            let c = cluster(nodes, a.gpus, pending, classes, a.seed);
            let timings: Vec<PassTiming> = a
                .passes
                .iter()
                .map(|&p| {
                    let p = match p {
                        PassKind::Fast(_) => PassKind::Fast(limits),
                        other => other,
                    };
                    let slow = !matches!(p, PassKind::Fast(_));
                    let cap = slow.then_some(a.reference_max_jobs).flatten();
                    let reps = if slow { a.reference_reps } else { None };
                    time_pass(&c, p, reps.unwrap_or(a.reps), cap)
                })
                .collect();
            let row = Row::new(timings);
            missed |= a.max_ms.is_some_and(|m| row.fast_ms.is_some_and(|f| f > m));
            if !json {
                row.print();
            }
            rows.push(row);
        }
    }
    if json {
        let out = serde_json::json!({"machine": machine, "rows": rows, "after": Machine::now()});
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(if missed {
        ExitCode::from(exit::TARGET)
    } else {
        ExitCode::SUCCESS
    })
}

/// One configuration: every pass's timing, and the reference's time over the fast pass's.
#[derive(Serialize)]
struct Row {
    timings: Vec<PassTiming>,
    /// The fast pass's median (ms), if it ran.
    fast_ms: Option<f64>,
    /// The reference's (estimated where limited) time over the fast pass's median.
    ratio: Option<f64>,
    /// Whether the reference's time is an estimate from a limited run.
    ratio_estimated: bool,
}

impl Row {
    fn new(timings: Vec<PassTiming>) -> Row {
        let find = |name: &str| timings.iter().find(|t| t.pass == name);
        let fast_ms = find("fast").map(median);
        let reference = find("reference");
        Row {
            fast_ms,
            ratio: fast_ms.zip(reference).map(|(f, r)| r.estimated_ms / f),
            ratio_estimated: reference.is_some_and(|r| r.timed_jobs < r.pending),
            timings,
        }
    }

    fn print(&self) {
        for t in &self.timings {
            let timed = if t.timed_jobs < t.pending {
                format!(
                    "; first {} jobs only: whole pass estimated {:.0} ms",
                    t.timed_jobs, t.estimated_ms
                )
            } else {
                String::new()
            };
            println!(
                "{:>9}: {} nodes x {} GPUs, {} pending jobs of {} profiles: placed {}, harvest {:.0}, pass median {:.0} ms (min {:.0}, max {:.0}; CPU {:.0} ms){timed}, peak RSS {:.0} MiB",
                t.pass, t.nodes, t.gpus_per_node, t.pending, t.classes, t.placed, t.harvest,
                median(t), min(t), max(t), cpu_median(t), t.peak_rss_mib
            );
        }
        if let Some(r) = self.ratio {
            let est = if self.ratio_estimated {
                " (estimated)"
            } else {
                ""
            };
            println!("    reference / fast: {r:.1}x{est}");
        }
    }
}

fn sorted(t: &PassTiming) -> Vec<f64> {
    let mut s = t.pass_ms.clone();
    s.sort_by(f64::total_cmp);
    s
}

fn median(t: &PassTiming) -> f64 {
    let s = sorted(t);
    s[s.len() / 2]
}

fn cpu_median(t: &PassTiming) -> f64 {
    let mut s = t.cpu_ms.clone();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn min(t: &PassTiming) -> f64 {
    sorted(t)[0]
}

fn max(t: &PassTiming) -> f64 {
    sorted(t)[t.pass_ms.len() - 1]
}

/// Compares the passes on `n` random clusters (see `--compare`) and prints what it found.
fn run_compare(
    n: usize,
    seed: u64,
    limits: FastLimits,
    overlap: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    if n == 0 {
        return Err(usage("--compare needs at least 1 cluster"));
    }
    let params = PlaceParams::default();
    let mut all: Vec<Comparison> = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let mut rng = fastrand::Rng::with_seed(seed.wrapping_mul(1_000_003).wrapping_add(i));
        let nodes = rng.usize(100..=1000);
        let jobs = nodes * rng.usize(2..=10);
        let classes = [10, 100, 1000][rng.usize(0..3)];
        let (queue, slots) = random_cluster_with(rng.u64(..), nodes, jobs, classes, overlap);
        all.push(compare(&queue, &slots, &params, limits));
    }
    let summary = CompareSummary::of(&all);
    if json {
        let out = serde_json::json!({"summary": summary, "clusters": all});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        summary.print();
    }
    let ok = summary.violations == 0 && summary.total_loss <= 0.01;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(exit::TARGET)
    })
}

/// The comparisons summed up.
#[derive(Serialize)]
struct CompareSummary {
    clusters: usize,
    /// Harvest given up over all clusters together.
    total_loss: f64,
    /// Per-cluster loss: min, median, 90th and 99th percentile, max.
    loss_quantiles: [f64; 5],
    violations: usize,
    placed_reference: usize,
    placed_fast: usize,
    moved: usize,
    moved_lower: usize,
    only_reference: usize,
    only_fast: usize,
    clusters_identical: usize,
    differing_by_stop: std::collections::BTreeMap<String, usize>,
    first_difference_by_stop: std::collections::BTreeMap<String, usize>,
}

impl CompareSummary {
    fn of(all: &[Comparison]) -> CompareSummary {
        let mut losses: Vec<f64> = all.iter().map(Comparison::loss).collect();
        losses.sort_by(f64::total_cmp);
        let q = |p: f64| losses[((losses.len() - 1) as f64 * p).round() as usize];
        let sum = |f: fn(&Comparison) -> usize| all.iter().map(f).sum::<usize>();
        let (want, got): (f64, f64) = all
            .iter()
            .map(|c| (c.reference_harvest, c.fast_harvest))
            .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
        let mut by_stop = std::collections::BTreeMap::new();
        let mut first = std::collections::BTreeMap::new();
        for c in all {
            for (k, v) in &c.differing_by_stop {
                *by_stop.entry(k.clone()).or_insert(0) += v;
            }
            if let Some((_, _, _, why)) = &c.first_difference {
                *first.entry(why.clone()).or_insert(0) += 1;
            }
        }
        CompareSummary {
            clusters: all.len(),
            total_loss: if want > 0.0 { 1.0 - got / want } else { 0.0 },
            loss_quantiles: [q(0.0), q(0.5), q(0.9), q(0.99), q(1.0)],
            violations: sum(|c| c.violations.len()),
            placed_reference: sum(|c| c.reference_placed),
            placed_fast: sum(|c| c.fast_placed),
            moved: sum(|c| c.moved),
            moved_lower: sum(|c| c.moved_lower),
            only_reference: sum(|c| c.only_reference),
            only_fast: sum(|c| c.only_fast),
            clusters_identical: all.iter().filter(|c| c.first_difference.is_none()).count(),
            differing_by_stop: by_stop,
            first_difference_by_stop: first,
        }
    }

    fn print(&self) {
        let pct = |x: f64| format!("{:.3}%", x * 100.0);
        println!(
            "{} random clusters: harvest given up {} in all; per cluster min {}, median {}, p90 {}, p99 {}, max {} (negative: the fast pass harvests more)",
            self.clusters, pct(self.total_loss), pct(self.loss_quantiles[0]), pct(self.loss_quantiles[1]),
            pct(self.loss_quantiles[2]), pct(self.loss_quantiles[3]), pct(self.loss_quantiles[4])
        );
        println!(
            "placements below their SLA or on GPUs not free: {}",
            self.violations
        );
        println!(
            "jobs placed: reference {}, fast {}; {} clusters decided identically",
            self.placed_reference, self.placed_fast, self.clusters_identical
        );
        println!(
            "decisions that differ: {} placed elsewhere ({} at a lower predicted share), {} placed by the reference only, {} by the fast pass only",
            self.moved, self.moved_lower, self.only_reference, self.only_fast
        );
        println!(
            "why the fast search ended where decisions differ: {:?}; at each cluster's first difference: {:?}",
            self.differing_by_stop, self.first_difference_by_stop
        );
    }
}
