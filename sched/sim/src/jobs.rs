//! Offline jobs of the simulation: profile classes (the same `JobProfile` the scheduler reads),
//! their work from Alibaba best-effort pod lifetimes, and Poisson arrivals offering a chosen
//! multiple of the GPU time online leaves idle.

use serde::Serialize;

use valve_scheduler::job::{CurvePoint, JobProfile, PROFILE_VERSION};
use valve_scheduler::meta::ClassedProfile;

const POD_MIX_CSV: &str = include_str!("../../data/alibaba-gpu-v2023-pod-mix.csv");

const GIB: u64 = 1 << 30;

/// A job's work is at least this many seconds alone.
pub const MIN_WORK_S: f64 = 600.0;
/// ... and at most this many.
pub const MAX_WORK_S: f64 = 48.0 * 3600.0;
/// The SLAs jobs ask for (uniformly).
pub const SLAS: [f64; 5] = [0.3, 0.4, 0.5, 0.6, 0.7];
/// Standard deviation of a job's true throughput relative to its profile (drawn once per job),
/// unless `simulate --profile-error-sd` says otherwise.
pub const PROFILE_ERROR_SD: f64 = 0.03;
/// A drawn profile error is clamped to this range (a job at 10% of its profile is broken).
pub const PROFILE_ERROR_BOUNDS: [f64; 2] = [-0.9, 1.0];

/// What offline work arrives: the load offered to the idle GPUs and the profiles' error.
#[derive(Clone, Copy, Debug)]
pub struct Offer {
    /// GPUs idle on average (what the load is a share of).
    pub idle_gpus: f64,
    /// GPU-seconds alone offered per idle GPU-second.
    pub load: f64,
    /// Minutes of arrivals.
    pub minutes: u32,
    /// Standard deviation of each job's true throughput relative to its profile.
    pub profile_error_sd: f64,
    /// Seed.
    pub seed: u64,
}

/// One profile class.
#[derive(Clone, Debug)]
pub struct Class {
    /// Its profile with the scheduler's class key.
    pub profile: ClassedProfile,
    /// R: full-speed memory per GPU (GiB).
    pub required_gib: f64,
    /// Whether it has 2 or more GPUs.
    pub multi: bool,
}

impl Class {
    /// T(m)/T_alone at `gib` per GPU.
    pub fn share(&self, gib: f32) -> f64 {
        self.profile
            .profile
            .memory_share((f64::from(gib.max(0.0)) * GIB as f64) as u64)
    }

    /// GPUs it runs on.
    pub fn gpus(&self) -> u32 {
        self.profile.profile.gpus
    }
}

fn profile(
    name: &str,
    units: &str,
    gpus: u32,
    alone: f64,
    curve: &[(u64, f64)],
    penalty: f64,
) -> JobProfile {
    JobProfile {
        version: PROFILE_VERSION,
        name: name.into(),
        units: units.into(),
        gpus,
        alone_per_s: alone,
        curve: curve
            .iter()
            .map(|&(gib, share)| CurvePoint {
                memory_bytes: gib * GIB,
                per_s: share * alone,
            })
            .collect(),
        required_bytes: None,
        deficit_penalty: penalty,
        costs: valve_scheduler::job::InterruptCosts::default(),
        measured: None,
    }
}

/// The profile classes: memory on the curve is all the memory offline gets on that GPU, weights
/// included; shapes are concave between the least memory a job runs with and full speed.
/// The first three take one GPU, the last two several.
pub fn classes() -> Vec<Class> {
    let profiles = [
        profile(
            "7B fp16, continuous batching, 1 GPU",
            "tokens",
            1,
            2400.0,
            &[
                (16, 0.35),
                (20, 0.55),
                (24, 0.70),
                (28, 0.80),
                (32, 0.88),
                (36, 0.95),
                (40, 1.0),
            ],
            0.4,
        ),
        profile(
            "13B fp16, continuous batching, 1 GPU",
            "tokens",
            1,
            1300.0,
            &[
                (28, 0.40),
                (32, 0.62),
                (36, 0.78),
                (40, 0.89),
                (44, 0.96),
                (48, 1.0),
            ],
            0.4,
        ),
        profile(
            "training, fixed 20 GiB, 1 GPU",
            "samples",
            1,
            50.0,
            &[(20, 1.0)],
            2.0,
        ),
        profile(
            "34B int8, continuous batching, TP 2",
            "tokens",
            2,
            900.0,
            &[
                (24, 0.40),
                (28, 0.60),
                (32, 0.75),
                (36, 0.87),
                (40, 0.95),
                (44, 1.0),
            ],
            0.5,
        ),
        profile(
            "70B int8, continuous batching, TP 4",
            "tokens",
            4,
            700.0,
            &[
                (24, 0.35),
                (28, 0.55),
                (32, 0.72),
                (36, 0.85),
                (40, 0.94),
                (44, 1.0),
            ],
            0.5,
        ),
    ];
    profiles
        .into_iter()
        .map(|p| {
            p.validate().expect("the simulator's profiles are valid");
            let required_gib = p.required() as f64 / GIB as f64;
            let multi = p.gpus > 1;
            Class {
                profile: ClassedProfile::new(p),
                required_gib,
                multi,
            }
        })
        .collect()
}

/// The probability of each class when `multi_share` of jobs take several GPUs: one-GPU classes
/// share the rest equally, multi-GPU classes share `multi_share` equally.
pub fn class_mix(classes: &[Class], multi_share: f64) -> Vec<f64> {
    let n_multi = classes.iter().filter(|c| c.multi).count().max(1) as f64;
    let n_single = classes.iter().filter(|c| !c.multi).count().max(1) as f64;
    classes
        .iter()
        .map(|c| {
            if c.multi {
                multi_share / n_multi
            } else {
                (1.0 - multi_share) / n_single
            }
        })
        .collect()
}

/// A job's work (seconds alone): a lognormal fitted to Alibaba best-effort GPU pod lifetimes,
/// clamped to [`MIN_WORK_S`, `MAX_WORK_S`].
#[derive(Clone, Debug, Serialize)]
pub struct WorkDist {
    /// Mean of ln(work).
    pub mu: f64,
    /// Standard deviation of ln(work).
    pub sigma: f64,
    /// Median before clamping (s).
    pub p50_s: f64,
    /// 90th percentile before clamping (s).
    pub p90_s: f64,
    /// Mean after clamping (s).
    pub mean_s: f64,
    /// How it was derived.
    pub how: String,
}

const Z90: f64 = 1.281_551_565_545;

/// Fits the work distribution: a lognormal per row (BE,1 and BE,frac: mu = ln p50, sigma =
/// (ln p90 - ln p50) / z90), their mixture weighted by pods, and one lognormal through the
/// mixture's p50 and p90.
pub fn work_distribution() -> WorkDist {
    let mut rows = Vec::new();
    for line in POD_MIX_CSV.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() >= 6 && f[0] == "BE" && (f[1] == "1" || f[1] == "frac") {
            let pods: f64 = f[2].parse().unwrap_or(0.0);
            let p50: f64 = f[4].parse().unwrap_or(1.0);
            let p90: f64 = f[5].parse().unwrap_or(1.0);
            rows.push((f[1].to_string(), pods, p50, p90));
        }
    }
    let total: f64 = rows.iter().map(|r| r.1).sum();
    let parts: Vec<(f64, f64, f64)> = rows
        .iter()
        .map(|(_, pods, p50, p90)| (pods / total, p50.ln(), (p90 / p50).ln() / Z90))
        .collect();
    let cdf = |x: f64| -> f64 {
        parts
            .iter()
            .map(|&(w, mu, s)| w * normal_cdf((x.ln() - mu) / s.max(1e-9)))
            .sum()
    };
    let quantile = |q: f64| -> f64 {
        let (mut lo, mut hi) = (1e-3f64, 1e9f64);
        for _ in 0..200 {
            let mid = (lo * hi).sqrt();
            if cdf(mid) < q {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        (lo * hi).sqrt()
    };
    let (p50, p90) = (quantile(0.5), quantile(0.9));
    let mu = p50.ln();
    let sigma = (p90 / p50).ln() / Z90;
    // E[clamp(exp(mu + sigma z))] by the midpoint rule over z.
    let (steps, span) = (40_000, 9.0);
    let dz = 2.0 * span / f64::from(steps);
    let mean_s: f64 = (0..steps)
        .map(|i| {
            let z = -span + (f64::from(i) + 0.5) * dz;
            let x = (mu + sigma * z).exp().clamp(MIN_WORK_S, MAX_WORK_S);
            x * (-z * z / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt() * dz
        })
        .sum();
    let how = format!(
        "alibaba-gpu-v2023-pod-mix.csv rows {}: a lognormal per row through its p50/p90, mixed by pods, and one lognormal through the mixture's p50 {p50:.0} s and p90 {p90:.0} s (mu {mu:.3}, sigma {sigma:.3}); clamped to [{MIN_WORK_S:.0} s, {MAX_WORK_S:.0} s]: mean {mean_s:.0} s",
        rows.iter()
            .map(|(g, pods, p50, p90)| format!("BE,{g} ({pods} pods, p50 {p50} s, p90 {p90} s)"))
            .collect::<Vec<_>>()
            .join(" and ")
    );
    WorkDist {
        mu,
        sigma,
        p50_s: p50,
        p90_s: p90,
        mean_s,
        how,
    }
}

/// The standard normal CDF (Abramowitz and Stegun 7.1.26, error under 1.5e-7).
pub fn normal_cdf(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = 1.0 - poly * (-x * x).exp();
    if z >= 0.0 {
        0.5 * (1.0 + erf)
    } else {
        0.5 * (1.0 - erf)
    }
}

/// A standard normal draw (Box-Muller).
pub fn normal(rng: &mut fastrand::Rng) -> f64 {
    let u = rng.f64().max(1e-300);
    let v = rng.f64();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

/// One offline job as submitted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arrival {
    /// The minute it is submitted.
    pub minute: u32,
    /// Its profile class (index into [`classes`]).
    pub class: u8,
    /// Index of its SLA in [`SLAS`].
    pub sla: u8,
    /// Its work (seconds alone).
    pub work_s: f64,
    /// Its true throughput relative to its profile, minus 1.
    pub error: f64,
}

impl Arrival {
    /// Its SLA.
    pub fn sla(&self) -> f64 {
        SLAS[usize::from(self.sla)]
    }

    /// Its stream (class x SLA): backlogs are capped per stream.
    pub fn stream(&self) -> usize {
        usize::from(self.class) * SLAS.len() + usize::from(self.sla)
    }
}

/// How the arrivals were made.
#[derive(Clone, Debug, Serialize)]
pub struct ArrivalSummary {
    /// Jobs per minute.
    pub rate_per_min: f64,
    /// GPU time online leaves idle that the rate was set against (GPUs).
    pub idle_gpus: f64,
    /// Offered load: the arrivals' GPU-seconds alone over the idle GPU-seconds.
    pub offered_load: f64,
    /// Mean GPUs per job.
    pub mean_gpus: f64,
    /// Jobs that arrived.
    pub count: usize,
    /// Share of them on several GPUs.
    pub multi_gpu_share: f64,
}

/// Poisson arrivals over `offer.minutes` offering `offer.load` x `offer.idle_gpus` GPU-seconds
/// alone per second; each job's class from `mix`, SLA uniform, work from `work`, profile error
/// normal with sd `offer.profile_error_sd` (clamped to [`PROFILE_ERROR_BOUNDS`]).
pub fn arrivals(
    classes: &[Class],
    mix: &[f64],
    work: &WorkDist,
    offer: Offer,
) -> (Vec<Arrival>, ArrivalSummary) {
    let Offer {
        idle_gpus,
        load: offered_load,
        minutes,
        profile_error_sd,
        seed,
    } = offer;
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x00FF_11E5_u64);
    let mean_gpus: f64 = classes
        .iter()
        .zip(mix)
        .map(|(c, p)| f64::from(c.gpus()) * p)
        .sum();
    let rate_per_s = offered_load * idle_gpus / (mean_gpus * work.mean_s).max(1e-9);
    let mut out = Vec::new();
    let end = f64::from(minutes) * 60.0;
    let mut t = 0.0;
    if rate_per_s > 0.0 {
        loop {
            t += -(1.0 - rng.f64()).ln() / rate_per_s;
            if t >= end {
                break;
            }
            let mut u = rng.f64();
            let mut class = mix.len() - 1;
            for (i, p) in mix.iter().enumerate() {
                if u < *p {
                    class = i;
                    break;
                }
                u -= p;
            }
            let z = normal(&mut rng);
            out.push(Arrival {
                minute: (t / 60.0) as u32,
                class: class as u8,
                sla: rng.u8(0..SLAS.len() as u8),
                work_s: (work.mu + work.sigma * z)
                    .exp()
                    .clamp(MIN_WORK_S, MAX_WORK_S),
                error: (profile_error_sd * normal(&mut rng))
                    .clamp(PROFILE_ERROR_BOUNDS[0], PROFILE_ERROR_BOUNDS[1]),
            });
        }
    }
    let multi = out
        .iter()
        .filter(|a| classes[usize::from(a.class)].multi)
        .count();
    let summary = ArrivalSummary {
        rate_per_min: rate_per_s * 60.0,
        idle_gpus,
        offered_load,
        mean_gpus,
        count: out.len(),
        multi_gpu_share: multi as f64 / out.len().max(1) as f64,
    };
    (out, summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_valid_concave_and_as_described() {
        let c = classes();
        assert_eq!(
            c.iter().map(|c| c.gpus()).collect::<Vec<_>>(),
            [1, 1, 1, 2, 4]
        );
        assert_eq!(c[0].share(15.9), 0.0, "7B cannot run below 16 GiB");
        assert_eq!(c[1].profile.profile.minimum(), 28 * GIB);
        assert_eq!(c[2].share(19.0), 0.0);
        assert_eq!(c[2].share(20.0), 1.0);
        assert_eq!(c[2].required_gib, 20.0);
        for k in [0, 1, 3, 4] {
            let p = &c[k].profile.profile;
            let slopes: Vec<f64> = p
                .curve
                .windows(2)
                .map(|w| (w[1].per_s - w[0].per_s) / (w[1].memory_bytes - w[0].memory_bytes) as f64)
                .collect();
            assert!(
                slopes.windows(2).all(|s| s[1] <= s[0] + 1e-12),
                "{}",
                p.name
            );
        }
        let mix = class_mix(&c, 0.3);
        assert!((mix.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((mix[3] + mix[4] - 0.3).abs() < 1e-12);
    }

    #[test]
    fn work_follows_the_alibaba_best_effort_lifetimes() {
        let w = work_distribution();
        // The mixture's median lies between the two rows' medians (195 s and 388 s).
        assert!(w.p50_s > 195.0 && w.p50_s < 388.0, "{w:?}");
        assert!(w.p90_s > 1000.0 && w.p90_s < 8142.0, "{w:?}");
        assert!(w.mean_s > MIN_WORK_S && w.mean_s < MAX_WORK_S);
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(Z90) - 0.9).abs() < 1e-6);
    }

    #[test]
    fn profile_errors_have_the_asked_spread_and_none_when_asked() {
        let c = classes();
        let mix = class_mix(&c, 0.3);
        let w = work_distribution();
        let offer = |sd| Offer {
            idle_gpus: 100.0,
            load: 1.0,
            minutes: 2 * 1440,
            profile_error_sd: sd,
            seed: 3,
        };
        let (exact, _) = arrivals(&c, &mix, &w, offer(0.0));
        assert!(exact.iter().all(|a| a.error == 0.0));
        let (wide, _) = arrivals(&c, &mix, &w, offer(0.15));
        let n = wide.len() as f64;
        let mean = wide.iter().map(|a| a.error).sum::<f64>() / n;
        let sd = (wide.iter().map(|a| (a.error - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(
            n > 500.0 && mean.abs() < 0.02 && (sd - 0.15).abs() < 0.02,
            "{n} {mean} {sd}"
        );
        let b = PROFILE_ERROR_BOUNDS;
        assert!(wide.iter().all(|a| a.error >= b[0] && a.error <= b[1]));
    }

    #[test]
    fn arrivals_offer_the_asked_load() {
        let c = classes();
        let mix = class_mix(&c, 0.3);
        let w = work_distribution();
        let offer = Offer {
            idle_gpus: 100.0,
            load: 1.0,
            minutes: 7 * 1440,
            profile_error_sd: PROFILE_ERROR_SD,
            seed: 3,
        };
        let (a, s) = arrivals(&c, &mix, &w, offer);
        let offered: f64 = a
            .iter()
            .map(|a| a.work_s * f64::from(c[usize::from(a.class)].gpus()))
            .sum();
        let ratio = offered / (100.0 * 7.0 * 86_400.0);
        assert!((ratio - 1.0).abs() < 0.25, "{ratio} {s:?}");
        assert!((s.multi_gpu_share - 0.3).abs() < 0.05);
        assert!(a.windows(2).all(|p| p[0].minute <= p[1].minute));
        assert!(a
            .iter()
            .all(|a| a.work_s >= MIN_WORK_S && a.work_s <= MAX_WORK_S));
    }
}
