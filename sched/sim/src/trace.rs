//! Online load for the simulator from the Azure LLM inference trace (2023, code and conversation):
//! per-minute busy fractions and per-minute peaks of a service at any load level, from the trace's
//! per-second tokens, and the daily cycle the week is built with.
//!
//! Only the one-hour 2023 traces could be obtained (`sched/data/README.md`), so a week tiles the
//! hour, each service from its own offset, under a stated daily cycle.

/// Which Azure trace a service replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Code completion: on/off bursts.
    Code,
    /// Conversation: smooth.
    Conv,
}

const CODE: &str = include_str!("../../data/azure-llm-2023-code-per-second-hour0.csv");
const CONV: &str = include_str!("../../data/azure-llm-2023-conv-per-second-hour0.csv");

/// GPU time per prompt token relative to a generated token (prefill is batched and cheap per
/// token; decoding pays per step).
const PREFILL_WEIGHT: f64 = 0.05;

/// Load levels of the tables: 2^(i/8 - 6) for i in 0..LEVELS, 1/64 .. about 16 x the mean.
const LEVELS: usize = 80;

/// Per-minute busy statistics of one trace at every tabulated load level.
pub struct TraceTable {
    /// Whole minutes in the (tiled) trace.
    minutes: usize,
    /// `mean[m * LEVELS + i]`: mean busy fraction over minute `m` at level `i`.
    mean: Vec<f32>,
    /// `peak[m * LEVELS + i]`: the busiest second of minute `m` at level `i`.
    peak: Vec<f32>,
    /// Mean requests per second of the trace.
    pub requests_per_s: f64,
}

fn level(i: usize) -> f64 {
    2f64.powf(i as f64 / 8.0 - 6.0)
}

impl TraceTable {
    /// The table of one of the embedded traces.
    pub fn load(kind: Kind) -> TraceTable {
        let text = match kind {
            Kind::Code => CODE,
            Kind::Conv => CONV,
        };
        let (work, requests) = parse(text);
        TraceTable::from_work(&work, requests)
    }

    /// The table of a per-second work series (mean 1 after normalising).
    pub fn from_work(work: &[f64], requests_per_s: f64) -> TraceTable {
        let mean_work = work.iter().sum::<f64>() / work.len().max(1) as f64;
        let norm: Vec<f64> = work.iter().map(|w| w / mean_work.max(1e-12)).collect();
        let minutes = (norm.len() / 60).max(1);
        let mut mean = vec![0f32; minutes * LEVELS];
        let mut peak = vec![0f32; minutes * LEVELS];
        for m in 0..minutes {
            let secs = &norm[m * 60..((m + 1) * 60).min(norm.len())];
            for i in 0..LEVELS {
                let x = level(i);
                let busy = secs.iter().map(|w| (x * w).min(1.0));
                let (sum, max) = busy.fold((0.0, 0.0f64), |(s, mx), b| (s + b, mx.max(b)));
                mean[m * LEVELS + i] = (sum / secs.len() as f64) as f32;
                peak[m * LEVELS + i] = max as f32;
            }
        }
        TraceTable {
            minutes,
            mean,
            peak,
            requests_per_s,
        }
    }

    /// Minutes before the trace repeats.
    pub fn minutes(&self) -> usize {
        self.minutes
    }

    /// (mean busy, peak busy) of trace minute `minute` (taken modulo the trace) at load `x`
    /// (x = 1: the trace's mean work fills the GPU).
    pub fn at(&self, minute: usize, x: f64) -> (f64, f64) {
        let m = minute % self.minutes;
        let pos = ((x.max(1e-9).log2() + 6.0) * 8.0).clamp(0.0, (LEVELS - 1) as f64);
        let (i, t) = (pos.floor() as usize, pos.fract());
        let j = (i + 1).min(LEVELS - 1);
        let lerp = |v: &[f32]| {
            let (a, b) = (f64::from(v[m * LEVELS + i]), f64::from(v[m * LEVELS + j]));
            a + (b - a) * t
        };
        let scale = if x < level(0) { x / level(0) } else { 1.0 };
        (lerp(&self.mean) * scale, lerp(&self.peak) * scale)
    }
}

/// The per-second work series (generated tokens + weighted prompt tokens) and the mean request
/// rate of a trace CSV (`second,requests,context_tokens,generated_tokens`).
fn parse(text: &str) -> (Vec<f64>, f64) {
    let mut work = Vec::new();
    let mut requests = 0.0;
    for line in text.lines().skip(1) {
        let f: Vec<f64> = line
            .split(',')
            .filter_map(|x| x.trim().parse().ok())
            .collect();
        if f.len() == 4 {
            requests += f[1];
            work.push(f[3] + PREFILL_WEIGHT * f[2]);
        }
    }
    let n = work.len().max(1) as f64;
    (work, requests / n)
}

/// The daily cycle a week is built with (assumed: the week-long trace was not obtainable):
/// a sine with its peak at 14:00, trough at 02:00, `amplitude` of the mean, and weekends at
/// `weekend` of weekdays. Mean over a weekday is 1.
pub fn daily(t_s: f64, amplitude: f64, weekend: f64) -> f64 {
    let day = (t_s / 86_400.0).floor() as i64;
    let hour = (t_s / 3600.0).rem_euclid(24.0);
    let phase = (hour - 8.0) / 24.0 * std::f64::consts::TAU;
    let w = if day.rem_euclid(7) >= 5 { weekend } else { 1.0 };
    (1.0 + amplitude * phase.sin()).max(0.0) * w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_traces_load_and_scale() {
        for kind in [Kind::Code, Kind::Conv] {
            let t = TraceTable::load(kind);
            assert!(t.minutes() >= 55, "{kind:?}: {}", t.minutes());
            assert!(t.requests_per_s > 1.0);
            // At load 0.3 the mean over the trace is near 0.3 (less where bursts saturate).
            let mean: f64 =
                (0..t.minutes()).map(|m| t.at(m, 0.3).0).sum::<f64>() / t.minutes() as f64;
            assert!(mean > 0.15 && mean < 0.31, "{kind:?}: {mean}");
            let (b, p) = t.at(7, 0.3);
            assert!(p >= b, "a peak is at least the mean");
            assert_eq!(t.at(7, 0.0).0, 0.0);
            let busiest = |x| (0..t.minutes()).map(|m| t.at(m, x).0).sum::<f64>();
            assert!(busiest(100.0) > busiest(1.0), "more load, more busy time");
        }
    }

    #[test]
    fn code_is_burstier_than_conversation() {
        let burst = |k| {
            let t = TraceTable::load(k);
            (0..t.minutes()).map(|m| t.at(m, 0.3).1).sum::<f64>() / t.minutes() as f64
        };
        assert!(burst(Kind::Code) > burst(Kind::Conv));
    }

    #[test]
    fn the_daily_cycle_peaks_in_the_afternoon_and_rests_at_weekends() {
        let h = 3600.0;
        assert!((daily(14.0 * h, 0.5, 0.6) - 1.5).abs() < 1e-9);
        assert!((daily(2.0 * h, 0.5, 0.6) - 0.5).abs() < 1e-9);
        assert!(
            (daily(5.0 * 86_400.0 + 14.0 * h, 0.5, 0.6) - 0.9).abs() < 1e-9,
            "Saturday"
        );
        let mean: f64 = (0..24).map(|k| daily(k as f64 * h, 0.5, 0.6)).sum::<f64>() / 24.0;
        assert!((mean - 1.0).abs() < 1e-9);
    }
}
