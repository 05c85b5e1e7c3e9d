//! An offline job as the scheduler sees it: its profile (throughput alone and the memory-throughput
//! curve T(m), measured once) and its request (GPUs, throughput SLA as a fraction of alone).
//!
//! Profiles are JSON files stored with the job; `docs/cluster.md` ("Job profiles") shows one.

use serde::{Deserialize, Serialize};

/// The profile version this build writes and reads.
pub const PROFILE_VERSION: u32 = 1;

/// A job's throughput alone and its memory-throughput curve.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobProfile {
    /// Always [`PROFILE_VERSION`].
    pub version: u32,
    /// What the job is (a model and its settings), for people.
    pub name: String,
    /// What its throughput counts (tokens, samples); its progress reports use the same unit.
    pub units: String,
    /// GPUs it runs on in lockstep (tensor or pipeline parallel).
    pub gpus: u32,
    /// Throughput alone, on whole GPUs with all the memory it wants (units/s): T_alone.
    pub alone_per_s: f64,
    /// T(m): throughput alone with `memory_bytes` per GPU, ascending in memory. Below the first
    /// point the job cannot run; above the last it runs at the last point's rate.
    pub curve: Vec<CurvePoint>,
    /// Memory per GPU at which the job runs at full speed (R in the paper); by default the least
    /// memory at which the curve reaches 95% of its top.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_bytes: Option<u64>,
    /// Throughput lost per unit of relative memory deficit while memory dips below R (beta: the
    /// cost of the work a reclaim throws away). 0 for a job whose memory is never reclaimed.
    #[serde(default)]
    pub deficit_penalty: f64,
    /// What each interruption costs it beyond the time it is held (measured at profiling; 0
    /// where never measured).
    #[serde(default, skip_serializing_if = "InterruptCosts::is_zero")]
    pub costs: InterruptCosts,
    /// How and where it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<Measured>,
}

/// Work an offline job loses to interruptions, in seconds of its running time: a harvested GPU
/// that preempts it P times and reclaims G GiB from it per second leaves it
/// `P x preemption_s + G x reclaim_s_per_gib` less of each second than its idle share. Where
/// the profile measured reclaim episodes of several sizes and the node counts its episodes,
/// the reclaim term is E x lost(G / E) instead: E episodes per second, each losing what an
/// episode of that size lost when profiled (a small reclaim may only take cache slack, a large
/// one requeues most requests in flight).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct InterruptCosts {
    /// Per preemption by the gate: the pipeline refill and the work redone after a resume.
    #[serde(default)]
    pub preemption_s: f64,
    /// Per GiB the pool takes back: the requests requeued and recomputed.
    #[serde(default)]
    pub reclaim_s_per_gib: f64,
    /// Per reclaim episode, by its size, ascending (empty: the per-GiB cost applies).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reclaim_episodes: Vec<EpisodeCost>,
    /// Of each second the gate holds the job, the share it does not lose, because its host-side
    /// work (building the next batch, Python) goes on while its GPU work is held: 0 for a job
    /// bound by the GPU, which loses every held second. Measured by the preemption step.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub held_overlap: f64,
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

/// What one reclaim episode of a given size cost the job when profiled.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpisodeCost {
    /// Bytes the episode took back.
    pub reclaimed_bytes: u64,
    /// Seconds of the job's work it lost.
    pub lost_s: f64,
}

impl InterruptCosts {
    /// Nothing measured.
    pub fn is_zero(&self) -> bool {
        self.preemption_s == 0.0
            && self.reclaim_s_per_gib == 0.0
            && self.reclaim_episodes.is_empty()
            && self.held_overlap == 0.0
    }

    /// The share of each second lost at `preemptions_per_s`, `reclaimed_gib_per_s` and
    /// `episodes_per_s` reclaim episodes (0: not counted; the per-GiB cost applies).
    pub fn lost_share(
        &self,
        preemptions_per_s: f64,
        reclaimed_gib_per_s: f64,
        episodes_per_s: f64,
    ) -> f64 {
        let reclaims = if self.reclaim_episodes.is_empty() || episodes_per_s <= 0.0 {
            self.reclaim_s_per_gib * reclaimed_gib_per_s
        } else {
            let bytes = reclaimed_gib_per_s / episodes_per_s * GIB_F;
            episodes_per_s * self.episode_lost_s(bytes)
        };
        self.preemption_s * preemptions_per_s + reclaims
    }

    /// Seconds lost to one episode of `bytes`: linear between the measured sizes (and from 0 at
    /// 0 bytes); beyond the largest, in proportion to its cost per byte.
    pub fn episode_lost_s(&self, bytes: f64) -> f64 {
        let mut prev = (0.0, 0.0);
        for p in &self.reclaim_episodes {
            let x = p.reclaimed_bytes as f64;
            if bytes <= x {
                let t = (bytes - prev.0) / (x - prev.0);
                return prev.1 + (p.lost_s - prev.1) * t;
            }
            prev = (x, p.lost_s);
        }
        if prev.0 > 0.0 {
            prev.1 * bytes / prev.0
        } else {
            0.0
        }
    }
}

/// Bytes in a GiB, for rates in GiB per second.
pub(crate) const GIB_F: f64 = (1u64 << 30) as f64;

/// One point of T(m).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Memory per GPU.
    pub memory_bytes: u64,
    /// Throughput alone with that memory (units/s).
    pub per_s: f64,
}

/// Where a profile came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// The GPU's name.
    pub device: String,
    /// When (Unix ms).
    pub unix_ms: u64,
    /// Seconds of running per memory size.
    pub seconds_per_point: f64,
    /// How far the alone step's two halves differed, |first - second| / their mean: the noise
    /// of a rate measured over half of it (absent in profiles made before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alone_spread: Option<f64>,
    /// Every uninterrupted rate the profile measured, in order: T_alone's step, then the step
    /// after each interrupted one. How far they differ is how far the job's own level moved
    /// while it was profiled, which no prediction from this profile can beat (empty in profiles
    /// made before it was recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uninterrupted_per_s: Vec<f64>,
    /// The capped run's own uncapped rate, where T_alone was measured in a second run started
    /// uncapped (`profile-job --fresh-alone`); the curve's points were scaled by T_alone over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capped_run_alone_per_s: Option<f64>,
    /// The interruption costs as the profiling steps read them, where some were not charged
    /// because the step's effect lay inside [`Measured::uninterrupted_spread`] (`profile-job
    /// --keep-costs-within-noise` charges them all). Absent where every reading was charged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub costs_as_read: Option<InterruptCosts>,
}

impl Measured {
    /// (highest - lowest) / mean of [`Measured::uninterrupted_per_s`]; `None` with fewer than
    /// two rates or a mean of 0.
    pub fn uninterrupted_spread(&self) -> Option<f64> {
        spread_of(&self.uninterrupted_per_s)
    }
}

/// (highest - lowest) / mean of `rates`; `None` with fewer than two rates or a mean of 0.
pub fn spread_of(rates: &[f64]) -> Option<f64> {
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    let (lo, hi) = rates.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
        (lo.min(x), hi.max(x))
    });
    (rates.len() >= 2 && mean > 0.0).then(|| (hi - lo) / mean)
}

/// Why a profile or request was refused.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum JobError {
    /// Not JSON of this shape.
    #[error("job profile is not valid JSON of the expected shape: {0} (`valve-scheduler profile-job --help` shows how to make one)")]
    Malformed(String),
    /// Another version.
    #[error(
        "job profile version {0} is not supported (this build reads version {PROFILE_VERSION})"
    )]
    Version(u32),
    /// A field out of range.
    #[error("job profile {name:?}: {what}")]
    Invalid {
        /// The profile's name.
        name: String,
        /// What is wrong.
        what: String,
    },
    /// The SLA is not a fraction.
    #[error("throughput SLA {0} is outside (0, 1]: give the share of the job's throughput alone it must keep, e.g. 0.8")]
    Sla(f64),
}

impl JobProfile {
    /// This profile with its measured rates at `level` times what was profiled; T_alone stays,
    /// since an SLA is a share of it. A job's learned level places it ([`crate::cycle`]), and the
    /// simulator's oracle knows each job's true level this way.
    pub fn at_level(&self, level: f64) -> JobProfile {
        let mut q = self.clone();
        for point in &mut q.curve {
            point.per_s *= level;
        }
        q
    }

    /// Parses and validates a profile.
    pub fn from_json(text: &str) -> Result<Self, JobError> {
        let raw: serde_json::Value =
            serde_json::from_str(text).map_err(|e| JobError::Malformed(e.to_string()))?;
        let v = raw.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
        if v != u64::from(PROFILE_VERSION) {
            return Err(JobError::Version(u32::try_from(v).unwrap_or(u32::MAX)));
        }
        let p: JobProfile =
            serde_json::from_value(raw).map_err(|e| JobError::Malformed(e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// Checks the ranges: a positive throughput alone, at least one curve point, memory strictly
    /// ascending, rates finite and not above alone by more than measurement noise.
    pub fn validate(&self) -> Result<(), JobError> {
        let bad = |what: String| JobError::Invalid {
            name: self.name.clone(),
            what,
        };
        if self.version != PROFILE_VERSION {
            return Err(JobError::Version(self.version));
        }
        if !(self.alone_per_s.is_finite() && self.alone_per_s > 0.0) {
            return Err(bad(format!(
                "alone_per_s = {} must be a positive throughput",
                self.alone_per_s
            )));
        }
        if self.gpus == 0 || self.gpus > 64 {
            return Err(bad(format!("gpus = {} must be 1..=64", self.gpus)));
        }
        if self.curve.is_empty() {
            return Err(bad("the memory-throughput curve has no points".into()));
        }
        if self
            .curve
            .windows(2)
            .any(|p| p[0].memory_bytes >= p[1].memory_bytes)
        {
            return Err(bad("curve memory_bytes must be strictly ascending".into()));
        }
        for p in &self.curve {
            if !(p.per_s.is_finite() && p.per_s >= 0.0 && p.per_s <= self.alone_per_s * 1.5) {
                return Err(bad(format!(
                    "curve point at {} bytes has per_s = {} (must be in [0, 1.5 x alone_per_s])",
                    p.memory_bytes, p.per_s
                )));
            }
        }
        if self
            .costs
            .reclaim_episodes
            .windows(2)
            .any(|p| p[0].reclaimed_bytes >= p[1].reclaimed_bytes)
            || self
                .costs
                .reclaim_episodes
                .first()
                .is_some_and(|p| p.reclaimed_bytes == 0)
        {
            return Err(bad(
                "costs.reclaim_episodes reclaimed_bytes must be positive and strictly ascending"
                    .into(),
            ));
        }
        let episodes = self
            .costs
            .reclaim_episodes
            .iter()
            .map(|p| ("costs.reclaim_episodes lost_s", p.lost_s));
        for (name, v) in [
            ("costs.preemption_s", self.costs.preemption_s),
            ("costs.reclaim_s_per_gib", self.costs.reclaim_s_per_gib),
        ]
        .into_iter()
        .chain(episodes)
        {
            if !(v.is_finite() && (0.0..=600.0).contains(&v)) {
                return Err(bad(format!("{name} = {v} must be in [0, 600] seconds")));
            }
        }
        if !(self.costs.held_overlap.is_finite() && (0.0..=1.0).contains(&self.costs.held_overlap))
        {
            return Err(bad(format!(
                "costs.held_overlap = {} must be a share in [0, 1]",
                self.costs.held_overlap
            )));
        }
        if !(self.deficit_penalty.is_finite() && (0.0..=10.0).contains(&self.deficit_penalty)) {
            return Err(bad(format!(
                "deficit_penalty = {} must be in [0, 10]",
                self.deficit_penalty
            )));
        }
        Ok(())
    }

    /// T(m)/T_alone for `memory_bytes` per GPU: 0 below the curve's first point, linear between
    /// points, flat after the last.
    pub fn memory_share(&self, memory_bytes: u64) -> f64 {
        let i = self
            .curve
            .partition_point(|p| p.memory_bytes <= memory_bytes);
        self.share_below(memory_bytes, i)
    }

    /// [`JobProfile::memory_share`] of `memory_bytes`, given `i`: how many curve points lie at
    /// or below it (as the binary search finds them where the curve ascends in memory).
    pub(crate) fn share_below(&self, memory_bytes: u64, i: usize) -> f64 {
        let c = &self.curve;
        let per_s = if memory_bytes < c[0].memory_bytes {
            0.0
        } else {
            match c.get(i) {
                None => c[c.len() - 1].per_s,
                Some(b) => {
                    let a = c[i - 1];
                    let t = (memory_bytes - a.memory_bytes) as f64
                        / (b.memory_bytes - a.memory_bytes) as f64;
                    a.per_s + (b.per_s - a.per_s) * t
                }
            }
        };
        (per_s / self.alone_per_s).clamp(0.0, 1.0)
    }

    /// The most T(m')/T_alone for any m' <= `memory_bytes`: a bound on what the job can do with
    /// at most that much memory (the curve need not be monotone).
    pub fn share_at_most(&self, memory_bytes: u64) -> f64 {
        let top = self
            .curve
            .iter()
            .take_while(|p| p.memory_bytes <= memory_bytes)
            .map(|p| p.per_s / self.alone_per_s)
            .fold(0.0, f64::max);
        top.max(self.memory_share(memory_bytes)).min(1.0)
    }

    /// R: the memory per GPU at which the job runs at full speed.
    pub fn required(&self) -> u64 {
        self.required_bytes.unwrap_or_else(|| {
            let top = self.curve.iter().map(|p| p.per_s).fold(0.0, f64::max);
            self.curve
                .iter()
                .find(|p| p.per_s >= 0.95 * top)
                .map_or(0, |p| p.memory_bytes)
        })
    }

    /// The least memory per GPU it can run with.
    pub fn minimum(&self) -> u64 {
        self.curve[0].memory_bytes
    }
}

/// Checks a throughput SLA: a share of throughput alone in (0, 1].
pub fn check_sla(sla: f64) -> Result<f64, JobError> {
    if sla.is_finite() && sla > 0.0 && sla <= 1.0 {
        Ok(sla)
    } else {
        Err(JobError::Sla(sla))
    }
}

#[cfg(test)]
pub(crate) mod tests {

    #[test]
    fn the_uninterrupted_spread_is_how_far_the_jobs_level_moved_while_profiled() {
        let m = |r: &[f64]| Measured {
            device: "test".into(),
            unix_ms: 0,
            seconds_per_point: 30.0,
            alone_spread: None,
            uninterrupted_per_s: r.to_vec(),
            capped_run_alone_per_s: None,
            costs_as_read: None,
        };
        // The fourth H200 check's run 5: T_alone 1,092, then 1,486 after the reclaim step.
        let s = m(&[1092.0, 1486.0]).uninterrupted_spread().unwrap();
        assert!((s - 394.0 / 1289.0).abs() < 1e-12, "{s}");
        assert_eq!(m(&[1000.0]).uninterrupted_spread(), None, "one rate");
        assert_eq!(m(&[]).uninterrupted_spread(), None);
        assert_eq!(m(&[0.0, 0.0]).uninterrupted_spread(), None, "mean 0");
        let old = r#"{"device":"d","unix_ms":1,"seconds_per_point":20.0}"#;
        let parsed: Measured = serde_json::from_str(old).unwrap();
        assert!(
            parsed.uninterrupted_per_s.is_empty(),
            "older profiles still read"
        );
        assert!(!serde_json::to_string(&parsed)
            .unwrap()
            .contains("uninterrupted"));
    }
    use super::*;

    pub(crate) const GIB: u64 = 1 << 30;

    fn episodes(points: &[(u64, f64)]) -> InterruptCosts {
        InterruptCosts {
            reclaim_s_per_gib: 0.5,
            reclaim_episodes: points
                .iter()
                .map(|&(gib, lost_s)| EpisodeCost {
                    reclaimed_bytes: gib * GIB,
                    lost_s,
                })
                .collect(),
            ..InterruptCosts::default()
        }
    }

    #[test]
    fn a_reclaim_episode_costs_what_one_of_its_size_cost_when_profiled() {
        // Profiled: 1 GiB took only cache slack (0 s), 6 GiB requeued most requests (2 s).
        let c = episodes(&[(1, 0.0), (6, 2.0)]);
        assert_eq!(c.episode_lost_s(0.5 * GIB as f64), 0.0);
        assert!((c.episode_lost_s(3.5 * GIB as f64) - 1.0).abs() < 1e-12);
        assert!(
            (c.episode_lost_s(12.0 * GIB as f64) - 4.0).abs() < 1e-12,
            "beyond: in proportion"
        );
        // One 6 GiB episode every 20 s: 0.1 of each second; the per-GiB cost would say 0.15.
        let share = c.lost_share(0.0, 0.3, 0.05);
        assert!((share - 0.1).abs() < 1e-12, "{share}");
        // Episodes not counted (an older document): the per-GiB cost.
        assert!((c.lost_share(0.0, 0.3, 0.0) - 0.15).abs() < 1e-12);
        // No episode costs profiled (an older profile): the per-GiB cost too.
        assert!((episodes(&[]).lost_share(0.0, 0.3, 0.05) - 0.15).abs() < 1e-12);
    }

    #[test]
    fn episode_costs_must_ascend_by_size_and_stay_in_range() {
        let mut p = profile(1);
        p.costs = episodes(&[(1, 0.0), (6, 2.0)]);
        p.validate().unwrap();
        p.costs = episodes(&[(6, 2.0), (1, 0.0)]);
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("strictly ascending"));
        p.costs = episodes(&[(0, 0.0)]);
        assert!(p.validate().is_err());
        p.costs = episodes(&[(1, 1000.0)]);
        assert!(p.validate().unwrap_err().to_string().contains("[0, 600]"));
        let json = serde_json::to_string(&episodes(&[(1, 0.25)])).unwrap();
        assert!(
            json.contains(
                "\"reclaim_episodes\":[{\"reclaimed_bytes\":1073741824,\"lost_s\":0.25}]"
            ),
            "{json}"
        );
    }

    /// 100 units/s alone; needs 4 GiB to run, full speed at 16 GiB.
    pub(crate) fn profile(gpus: u32) -> JobProfile {
        JobProfile {
            version: PROFILE_VERSION,
            name: "llama-7b cb".into(),
            units: "tokens".into(),
            gpus,
            alone_per_s: 100.0,
            curve: vec![
                CurvePoint {
                    memory_bytes: 4 * GIB,
                    per_s: 40.0,
                },
                CurvePoint {
                    memory_bytes: 8 * GIB,
                    per_s: 70.0,
                },
                CurvePoint {
                    memory_bytes: 16 * GIB,
                    per_s: 100.0,
                },
            ],
            required_bytes: None,
            deficit_penalty: 0.5,
            costs: InterruptCosts::default(),
            measured: None,
        }
    }

    #[test]
    fn the_curve_interpolates_and_is_flat_outside() {
        let p = profile(1);
        assert_eq!(
            p.memory_share(2 * GIB),
            0.0,
            "below the first point: cannot run"
        );
        assert_eq!(p.memory_share(4 * GIB), 0.4);
        assert!((p.memory_share(6 * GIB) - 0.55).abs() < 1e-12);
        assert_eq!(p.memory_share(12 * GIB), 0.85);
        assert_eq!(p.memory_share(64 * GIB), 1.0);
        assert_eq!(p.share_at_most(12 * GIB), 0.85);
        let mut dip = p.clone();
        dip.curve[2].per_s = 60.0;
        assert_eq!(
            dip.share_at_most(64 * GIB),
            0.7,
            "the best point below, not the last"
        );
        assert_eq!(p.required(), 16 * GIB);
        assert_eq!(p.minimum(), 4 * GIB);
        let mut q = p.clone();
        q.required_bytes = Some(9 * GIB);
        assert_eq!(q.required(), 9 * GIB, "stated R wins");
    }

    #[test]
    fn profiles_round_trip_and_bad_ones_are_named() {
        let p = profile(2);
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(JobProfile::from_json(&text).unwrap(), p);
        assert_eq!(
            JobProfile::from_json(r#"{"version":3}"#).unwrap_err(),
            JobError::Version(3)
        );
        let mut q = p.clone();
        q.curve.swap(0, 1);
        assert!(q.validate().unwrap_err().to_string().contains("ascending"));
        let mut q = p.clone();
        q.alone_per_s = 0.0;
        assert!(q
            .validate()
            .unwrap_err()
            .to_string()
            .contains("alone_per_s"));
        let mut q = p.clone();
        q.curve.clear();
        assert!(q.validate().unwrap_err().to_string().contains("no points"));
        let mut q = p.clone();
        q.costs.held_overlap = 0.12;
        let text = serde_json::to_string(&q).unwrap();
        assert!(text.contains(r#""held_overlap":0.12"#), "{text}");
        assert_eq!(JobProfile::from_json(&text).unwrap(), q);
        q.costs.held_overlap = 1.5;
        assert!(q
            .validate()
            .unwrap_err()
            .to_string()
            .contains("held_overlap = 1.5"));
        let mut q = p;
        q.curve[1].per_s = f64::NAN;
        assert!(q
            .validate()
            .unwrap_err()
            .to_string()
            .contains("per_s = NaN"));
        assert!(matches!(
            JobProfile::from_json("{").unwrap_err(),
            JobError::Malformed(_)
        ));
    }

    #[test]
    fn an_sla_is_a_share_of_alone() {
        assert_eq!(check_sla(0.8), Ok(0.8));
        assert_eq!(check_sla(1.0), Ok(1.0));
        for bad in [0.0, -0.1, 1.01, f64::NAN] {
            assert!(check_sla(bad).unwrap_err().to_string().contains("(0, 1]"));
        }
    }
}
