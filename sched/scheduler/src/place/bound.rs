//! Upper bounds on what a job can be predicted on a node's free GPUs, cheap enough to rule out
//! most nodes of a pass before any memory factor (about 20 curve look-ups per GPU) is computed.
//!
//! Each GPU's memory trace is summarised once per pass ([`Trace`]: the quantiles in a few runs of
//! neighbours, each run's largest value and weight), so that a bound on a job's memory factor
//! there costs [`GROUPS`] look-ups of its curve ([`Curve::factor_bound`]). Every bound is at least
//! the exact figure in floating point, with a slack far above its rounding error, so a node ruled
//! out could not have changed a decision.

use std::cmp::Ordering;

use crate::job::JobProfile;
use crate::predict::{MemoryModel, ModelParams, NodeModel};

/// Runs of neighbouring quantiles a memory trace is summarised by.
pub(super) const GROUPS: usize = 5;

/// Added to a memory factor's bound. The bound and the exact factor are sums of at most a few
/// dozen terms of magnitude at most 11 (a share in [0, 1], a penalty in [0, 10] x a deficit in
/// [0, 1]): their rounding errors are below 1e-12, so this slack covers them a thousandfold.
const SLACK: f64 = 1e-9;

/// Added to a bound's idle term where the job keeps part of its held time ([`with_overlap`]):
/// x + o (1 - x) and `predict_with`'s idle + overlap are a few operations on figures in [0, 1],
/// each off by at most an ulp (about 1e-16), so this covers their rounding ten thousandfold.
pub(super) const OVERLAP_SLACK: f64 = 1e-12;

/// The share of held time `job` keeps as `predict_with` counts it: its `costs.held_overlap`
/// clamped to [0, 1] where interruptions are modelled, else 0; 1 where it is not a number (no
/// bound then holds below the one of a job that keeps all its held time).
pub(super) fn held_overlap(job: &JobProfile, params: &ModelParams) -> f64 {
    if !params.interruptions {
        return 0.0;
    }
    let o = job.costs.held_overlap;
    if o.is_nan() {
        1.0
    } else {
        o.clamp(0.0, 1.0)
    }
}

/// At least `predict_with`'s idle + overlap - interrupted on a set whose idle time is at most
/// `idle`, for a job that keeps `o` (from [`held_overlap`]) of its held time: `idle` itself, bit
/// for bit, where o = 0; else x + o (1 - x) + [`OVERLAP_SLACK`] with x = `idle` at least 0.
///
/// Why: with the set's idle time i in [0, 1] (`predict_with` clamps it), overlap = o (1 - i) and
/// interrupted >= 0, so A = i + o (1 - i) - interrupted <= o + (1 - o) i, which grows with i
/// (1 - o >= 0): any x >= i gives at least A. Clamping x at 0 keeps that for a bound below 0 (i
/// is at least 0), and x above 1 gives o + (1 - o) x >= 1 >= A, so x is not clamped at 1 (and
/// NaN stays NaN). The figure is at most 1 + slack for x <= 1, so a product with a memory
/// factor in [0, 1] meets no clamp at 1 that the share does not.
pub(super) fn with_overlap(o: f64, idle: f64) -> f64 {
    if o > 0.0 {
        let x = non_negative(idle);
        x + o * (1.0 - x) + OVERLAP_SLACK
    } else {
        idle
    }
}

/// At least a job's share on any node of speed at most `speed` (>= 0, or NaN) where `bound` is
/// at least its share's idle time x speed with nothing held kept (a size index's key: its best
/// aligned set's idle time x the node's speed, at least 0), for a job that keeps `o` of its held
/// time: `bound` itself where o = 0, else o x speed + (1 - o) x `bound` (at least 0) and a
/// slack. By [`with_overlap`]'s step, a set of idle time i on a node of speed s <= `speed` gets
/// at most (o + (1 - o) i) x s <= o x `speed` + (1 - o) x `bound` (and 0 where s < 0).
pub(super) fn lift_bound(o: f64, bound: f64, speed: f64) -> f64 {
    if o > 0.0 {
        let s = speed.max(0.0);
        o * s + (1.0 - o) * non_negative(bound) + OVERLAP_SLACK * s.max(1.0)
    } else {
        bound
    }
}

/// The largest deficit penalty [`Curve::factor_bound`] bounds (profiles are validated to 10).
const MAX_PENALTY: f64 = 10.0;

/// A GPU's memory trace in [`GROUPS`] runs of neighbouring quantiles: each run's largest value
/// and its weight (twice its share of the trapezoid sum the memory factor averages over).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Trace {
    /// The largest quantile of each run.
    tops: [u64; GROUPS],
    /// Twice the trapezoid weight of each run's quantiles (1 at the ends, 2 between).
    weights: [u32; GROUPS],
    /// Steps between quantiles (the trapezoid sum's divisor).
    steps: u32,
    /// The smallest quantile ([`MemoryModel::StaticMin`] reads only it).
    first: u64,
}

impl Trace {
    /// The summary of ascending `quantiles`; `None` if they are fewer than two or not ascending
    /// (such a GPU is never ruled out by a bound).
    pub(super) fn of(quantiles: &[u64]) -> Option<Trace> {
        let n = quantiles.len();
        if n < 2 || quantiles.windows(2).any(|w| w[0] > w[1]) {
            return None;
        }
        let (mut tops, mut weights) = ([0; GROUPS], [0; GROUPS]);
        for (i, &m) in quantiles.iter().enumerate() {
            let g = i * GROUPS / n;
            tops[g] = m; // ascending: a run's last value is its largest
            weights[g] += if i == 0 || i == n - 1 { 1 } else { 2 };
        }
        Some(Trace {
            tops,
            weights,
            steps: u32::try_from(n - 1).ok()?,
            first: quantiles[0],
        })
    }
}

/// A node's GPUs as bounds read them, side by side.
pub(super) struct NodeSummary {
    /// Per GPU position: its idle time (1 - busy), largest memory and trace summary.
    pub(super) gpus: Vec<GpuSummary>,
    /// The free GPUs, idlest first: no GPU after one can score more alone than that one's idle
    /// time.
    pub(super) by_idle: Vec<Free>,
    /// Whether a GPU's idle time or a pair's alignment score is not a number (then no bound
    /// rules the node out).
    pub(super) odd: bool,
}

/// A free GPU as the quick bound reads it.
#[derive(Clone, Copy)]
pub(super) struct Free {
    /// 1 - busy.
    pub(super) idle: f64,
    /// Its largest memory quantile.
    pub(super) top: u64,
    /// Its position on the node.
    pub(super) p: usize,
}

/// See [`NodeSummary`].
pub(super) struct GpuSummary {
    /// 1 - busy.
    pub(super) idle: f64,
    /// Its largest memory quantile (0 without any).
    pub(super) top: u64,
    /// Its trace's summary.
    pub(super) trace: Option<Trace>,
}

impl NodeSummary {
    /// The summary of `model`'s GPUs, of which those `free` are free.
    pub(super) fn new(model: &NodeModel, free: &[bool], params: &ModelParams) -> Self {
        let gpus: Vec<GpuSummary> = model
            .gpus
            .iter()
            .map(|g| GpuSummary {
                idle: 1.0 - g.busy,
                top: largest(&g.memory_quantiles),
                trace: Trace::of(&g.memory_quantiles),
            })
            .collect();
        let mut by_idle: Vec<Free> = (0..gpus.len())
            .filter(|&p| free[p])
            .map(|p| Free {
                idle: gpus[p].idle,
                top: gpus[p].top,
                p,
            })
            .collect();
        by_idle.sort_by(|a, b| b.idle.total_cmp(&a.idle));
        let n = gpus.len();
        let odd = gpus.iter().any(|g| g.idle.is_nan())
            || (0..n * n).any(|x| model.score(x / n, x % n, params).is_nan());
        NodeSummary { gpus, by_idle, odd }
    }

    /// Forgets the GPUs at `taken` (no longer free).
    pub(super) fn take(&mut self, taken: &[usize]) {
        self.by_idle.retain(|f| !taken.contains(&f.p));
    }
}

/// The largest of a GPU's memory quantiles (0 without any): the memory the curve is read at for
/// a bound on its factor. Not the last one: the harvest document's quantiles are ascending
/// (`NodeHarvest::validate` checks it on load), but a `NodeModel` made in code need not be, and
/// a bound read at a smaller quantile than the largest may be below the factor.
pub(super) fn largest(quantiles: &[u64]) -> u64 {
    quantiles.iter().copied().max().unwrap_or(0)
}

/// Whether `x` may exceed `floor`: it does, or either is not a number (`!(x <= floor)`).
pub(super) fn may_exceed(x: f64, floor: f64) -> bool {
    !matches!(
        x.partial_cmp(&floor),
        Some(Ordering::Less | Ordering::Equal)
    )
}

/// `x` if it is at least 0 or not a number, else 0 (unlike `f64::max`, NaN stays NaN).
pub(super) fn non_negative(x: f64) -> f64 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// A job's curve prepared for many look-ups in one pass.
pub(super) struct Curve<'a> {
    job: &'a JobProfile,
    /// `prefix[i]`: the most per_s / alone among the first `i` points (0 for none).
    prefix: Vec<f64>,
    /// [`Curve::at_most`] below the first point and from the last one on, where it is constant.
    below: f64,
    above: f64,
    /// R, as the memory factor reads it.
    required: f64,
    /// Whether the curve is strictly ascending in memory (else look-ups go to the profile's own
    /// methods, and no bound rules anything out).
    ascending: bool,
    /// Whether the bounds hold: ascending, finite figures, a penalty in [0, 10].
    bounded: bool,
}

impl<'a> Curve<'a> {
    /// Prepares `job`'s curve.
    pub(super) fn new(job: &'a JobProfile) -> Self {
        let c = &job.curve;
        let ascending =
            !c.is_empty() && c.windows(2).all(|p| p[0].memory_bytes < p[1].memory_bytes);
        let finite = job.alone_per_s.is_finite()
            && job.alone_per_s > 0.0
            && c.iter().all(|p| p.per_s.is_finite())
            && (0.0..=MAX_PENALTY).contains(&job.deficit_penalty);
        let mut prefix = Vec::with_capacity(c.len() + 1);
        let mut top: f64 = 0.0;
        prefix.push(top);
        for p in c {
            // The same fold, in the same order, as `JobProfile::share_at_most`.
            top = top.max(p.per_s / job.alone_per_s);
            prefix.push(top);
        }
        let mut curve = Curve {
            job,
            prefix,
            below: 0.0,
            above: 0.0,
            required: job.required().max(1) as f64,
            ascending,
            bounded: ascending && finite,
        };
        if ascending {
            let (first, last) = (c[0].memory_bytes, c[c.len() - 1].memory_bytes);
            curve.below = curve.look_up(first.saturating_sub(1));
            curve.above = curve.look_up(last);
        }
        curve
    }

    /// `job.share_at_most(m)`, bit for bit. Below the first point and from the last one on it is
    /// constant (the same arithmetic on the same figures), so those are looked up once.
    pub(super) fn at_most(&self, m: u64) -> f64 {
        let c = &self.job.curve;
        if !self.ascending {
            self.job.share_at_most(m)
        } else if m >= c[c.len() - 1].memory_bytes {
            self.above
        } else if m < c[0].memory_bytes {
            self.below
        } else {
            self.look_up(m)
        }
    }

    /// [`Curve::at_most`] on an ascending curve: the points at or below `m` are the first
    /// `partition_point` ones, whose fold `prefix` holds. Between two points, T(m)/T_alone is
    /// `JobProfile::memory_share`'s arithmetic, reusing the one search.
    fn look_up(&self, m: u64) -> f64 {
        let c = &self.job.curve;
        let i = c.partition_point(|p| p.memory_bytes <= m);
        let share = match (i.checked_sub(1), c.get(i)) {
            (Some(h), Some(b)) => {
                let a = c[h];
                let t = (m - a.memory_bytes) as f64 / (b.memory_bytes - a.memory_bytes) as f64;
                ((a.per_s + (b.per_s - a.per_s) * t) / self.job.alone_per_s).clamp(0.0, 1.0)
            }
            _ => self.job.memory_share(m),
        };
        self.prefix[i].max(share).min(1.0)
    }

    /// At least the job's memory factor under `model` on a GPU whose trace's summary is `t`
    /// (NaN where the curve is not bounded).
    ///
    /// Trace: the factor is a weighted mean over the quantiles q of T(q)/T_alone - penalty x
    /// deficit(q). Within a run, T(q)/T_alone <= the most the curve gives at or below the run's
    /// top, and deficit(q) >= deficit(top) (both monotone in floating point too, up to an ulp of
    /// the interpolation), so each run contributes at most its weight x that at its top.
    pub(super) fn factor_bound(&self, t: &Trace, model: MemoryModel) -> f64 {
        if !self.bounded {
            return f64::NAN;
        }
        let sum = match model {
            MemoryModel::Ignore => return 1.0,
            MemoryModel::StaticMin => self.at_most(t.first),
            MemoryModel::Trace => {
                let penalty = self.job.deficit_penalty;
                let mut sum = 0.0;
                for (&m, &w) in t.tops.iter().zip(&t.weights) {
                    if w > 0 {
                        let deficit = (self.required - m as f64).max(0.0) / self.required;
                        sum += f64::from(w) * (self.at_most(m) - penalty * deficit);
                    }
                }
                sum / (2.0 * f64::from(t.steps))
            }
        };
        (sum + SLACK).clamp(0.0, 1.0)
    }

    /// The profile the curve is of.
    pub(super) fn profile(&self) -> &'a JobProfile {
        self.job
    }

    /// At least the share `best_set` ranks `gpu` by alone, [`with_overlap`]`(o, 1 - busy)` x
    /// factor x speed, on a node of `speed` >= 0, for a job that keeps `o` of its held time
    /// ([`held_overlap`]); NaN where no bound is known. Exact where the factor is `known` (not
    /// NaN). Else first that idle term x the most the curve gives at the GPU's largest memory (a
    /// mean of the curve over the trace is at most its top), and only if that exceeds `floor`
    /// the trace's bound ([`Curve::factor_bound`]).
    pub(super) fn gpu_bound(
        &self,
        gpu: &GpuSummary,
        known: f64,
        speed: f64,
        model: MemoryModel,
        floor: f64,
        o: f64,
    ) -> f64 {
        if !known.is_nan() {
            return with_overlap(o, gpu.idle) * known * speed; // the exact figure
        }
        let (true, Some(t)) = (self.bounded, &gpu.trace) else {
            return f64::NAN;
        };
        let idle = with_overlap(o, non_negative(gpu.idle));
        let top = match model {
            MemoryModel::Ignore => 1.0,
            _ => (self.at_most(gpu.top) + SLACK).min(1.0),
        };
        let coarse = idle * top * speed;
        if coarse <= floor {
            return coarse;
        }
        coarse.min(idle * self.factor_bound(t, model) * speed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::tests::{profile, GIB};
    use crate::job::CurvePoint;
    use crate::predict::memory_factor;

    fn random_curve(rng: &mut fastrand::Rng) -> JobProfile {
        let mut job = profile(1);
        let mut m = 0;
        job.curve = (0..rng.usize(1..6))
            .map(|_| {
                m += rng.u64(1..20) * GIB / 2;
                CurvePoint {
                    memory_bytes: m,
                    per_s: rng.f64() * 150.0,
                }
            })
            .collect();
        job.deficit_penalty = [0.0, 0.3, 1.0, 10.0][rng.usize(0..4)];
        job.required_bytes = rng.bool().then(|| rng.u64(1..40) * GIB / 2);
        job.costs.held_overlap = [0.0, 0.0, 0.3, 1.0][rng.usize(0..4)];
        job
    }

    fn random_quantiles(rng: &mut fastrand::Rng, n: usize) -> Vec<u64> {
        let base = rng.u64(0..60) * GIB;
        let mut q: Vec<u64> = (0..n)
            .map(|_| match rng.u8(0..3) {
                0 => base,
                _ => rng.u64(0..=base + GIB),
            })
            .collect();
        q.sort_unstable();
        q
    }

    #[test]
    fn at_most_is_the_profiles_own_look_up_bit_for_bit() {
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..2000 {
            let job = random_curve(&mut rng);
            let c = Curve::new(&job);
            let points = job.curve.iter().map(|p| p.memory_bytes);
            let edges = points.flat_map(|m| [m - 1, m, m + 1]);
            for m in edges
                .chain((0..20).map(|_| rng.u64(0..70 * GIB)))
                .chain([0])
            {
                assert_eq!(
                    c.at_most(m).to_bits(),
                    job.share_at_most(m).to_bits(),
                    "{m} {job:?}"
                );
            }
        }
    }

    #[test]
    fn factor_bounds_hold_on_random_curves_and_traces() {
        let mut rng = fastrand::Rng::with_seed(4);
        for _ in 0..5000 {
            let job = random_curve(&mut rng);
            let c = Curve::new(&job);
            let n = [2, 3, 7, 21][rng.usize(0..4)];
            let q = random_quantiles(&mut rng, n);
            let t = Trace::of(&q).unwrap();
            let gpu = GpuSummary {
                idle: rng.f64(),
                top: q[q.len() - 1],
                trace: Some(t),
            };
            for model in [
                MemoryModel::Trace,
                MemoryModel::StaticMin,
                MemoryModel::Ignore,
            ] {
                let exact = memory_factor(&job, &q, model);
                assert!(c.factor_bound(&t, model) >= exact, "{q:?} {job:?}");
                // `predict_with`'s share alone with nothing lost: idle time and the held time
                // the job keeps, x factor x speed.
                let o = job.costs.held_overlap;
                let solo = (gpu.idle + o * (1.0 - gpu.idle)) * exact * 1.1;
                for floor in [-1.0, 0.0, 0.3, 0.9] {
                    let b = c.gpu_bound(&gpu, f64::NAN, 1.1, model, floor, o);
                    assert!(b >= solo, "{q:?} {job:?}");
                }
                let known = c.gpu_bound(&gpu, exact, 1.1, model, 0.0, o);
                assert!(known >= solo, "exact");
                if o == 0.0 {
                    assert_eq!(known, solo, "exact");
                }
            }
        }
    }

    #[test]
    fn traces_that_cannot_be_summarised_are_never_bounded() {
        assert_eq!(Trace::of(&[GIB]), None);
        assert_eq!(Trace::of(&[2 * GIB, GIB]), None);
        let t = Trace::of(&[GIB; 21]).unwrap();
        assert_eq!(t.weights.iter().sum::<u32>(), 40, "twice 20 steps");
        let mut job = profile(1);
        job.curve.swap(0, 1);
        assert!(Curve::new(&job)
            .factor_bound(&t, MemoryModel::Trace)
            .is_nan());
    }
}
