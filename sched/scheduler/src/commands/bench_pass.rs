//! `valve-scheduler bench-pass`: times scheduling passes over a synthetic cluster and pending
//! queue, for several numbers of distinct job profiles.

use std::process::ExitCode;

use clap::Args;

use crate::error::{exit, usage};
use valve_scheduler::bench::time_pass;

/// Times one pass of placement (and the monitor) over random harvest documents.
///
/// Jobs of one profile class share memory factors, so the cost depends on how many distinct
/// profiles the queue holds; the run reports each `--classes` value separately.
#[derive(Args, Debug)]
pub struct BenchPassArgs {
    /// Nodes in the synthetic cluster.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
    /// Pending jobs.
    #[arg(long, default_value_t = 10_000)]
    pub pending: usize,
    /// Distinct job profiles among them (comma-separated list: one run each).
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    pub classes: Vec<usize>,
    /// Passes per configuration (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Random seed of the synthetic cluster.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Exit 4 if a configuration's median pass takes longer than this many milliseconds.
    #[arg(long)]
    pub max_ms: Option<f64>,
}

/// Runs the benchmark and prints one line (or JSON object) per configuration.
pub fn exec(a: &BenchPassArgs, json: bool) -> anyhow::Result<ExitCode> {
    if a.nodes == 0 || a.gpus == 0 || a.classes.contains(&0) {
        return Err(usage("--nodes, --gpus and --classes must be at least 1"));
    }
    let mut missed = false;
    let mut rows = Vec::new();
    for &c in &a.classes {
        let t = time_pass(a.nodes, a.gpus, a.pending, c, a.reps, a.seed);
        let mut sorted = t.pass_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        missed |= a.max_ms.is_some_and(|m| median > m);
        if !json {
            println!(
                "{} nodes x {} GPUs, {} pending jobs of {} profiles: placed {}, pass median {:.0} ms (min {:.0}, max {:.0})",
                t.nodes, t.gpus_per_node, t.pending, t.classes, t.placed, median, sorted[0], sorted[sorted.len() - 1]
            );
        }
        rows.push(serde_json::json!({"timing": t, "median_ms": median}));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    Ok(if missed {
        ExitCode::from(exit::TARGET)
    } else {
        ExitCode::SUCCESS
    })
}
