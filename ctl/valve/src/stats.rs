//! Latency summaries (p50/p99/max) for benchmarks and the hardware tests, and the clock the
//! gate and the hardware tests share. Percentiles are nearest-rank: sorted[ceil(p*n)-1].

use std::time::Duration;

use serde::Serialize;

/// A summary of latency samples, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest sample.
    pub max_us: f64,
    /// Arithmetic mean.
    pub mean_us: f64,
}

/// Nearest-rank percentile of already sorted samples (`p` in 0..=1). Empty input gives 0.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarises durations.
pub fn summarize(samples: &[Duration]) -> Summary {
    let us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    summarize_us(&us)
}

/// Summarises samples given in microseconds.
pub fn summarize_us(samples: &[f64]) -> Summary {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    Summary {
        n,
        p50_us: percentile(&sorted, 0.50),
        p90_us: percentile(&sorted, 0.90),
        p99_us: percentile(&sorted, 0.99),
        max_us: sorted.last().copied().unwrap_or(0.0),
        mean_us: if n == 0 {
            0.0
        } else {
            sorted.iter().sum::<f64>() / n as f64
        },
    }
}

/// CLOCK_MONOTONIC in ns, the clock of the uprobe timestamps (`bpf_ktime_get_ns`).
pub fn monotonic_ns() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(ts) => ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64,
        Err(_) => 0,
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {:.0} us  p99 {:.0} us  max {:.0} us  (n={})",
            self.p50_us, self.p99_us, self.max_us, self.n
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        let sum = summarize_us(&s);
        assert_eq!(sum.p50_us, 50.0);
        assert_eq!(sum.p99_us, 99.0);
        assert_eq!(sum.max_us, 100.0);
        assert_eq!(sum.n, 100);
        assert!((sum.mean_us - 50.5).abs() < 1e-9);
        // One sample: every percentile is that sample.
        assert_eq!(summarize_us(&[7.0]).p99_us, 7.0);
        assert_eq!(summarize_us(&[]).n, 0);
    }

    #[test]
    fn unsorted_input_and_durations() {
        let d = [
            Duration::from_micros(300),
            Duration::from_micros(100),
            Duration::from_micros(200),
        ];
        let s = summarize(&d);
        assert_eq!(s.p50_us, 200.0);
        assert_eq!(s.max_us, 300.0);
    }
}
