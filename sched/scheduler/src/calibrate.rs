//! Per-node speed calibration: machines of one model ran the same job 26-30% apart, so each
//! node's measured over predicted throughput, relative to the cluster's, scales its predictions;
//! and per-job levels, for a job whose profile was measured off its usual level.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

/// Ratios kept per node (the last ones); the factor is their median. A window's ratio is noisy
/// (online load moves within the model's hour): with 15 the simulation's learned factors were
/// further from the true speeds than 1.0 was; with 45, closer.
pub const KEEP: usize = 45;
/// Samples a node needs before its factor is used (before that it is 1.0).
pub const MIN_SAMPLES: usize = 3;
/// Samples predicted below this share of alone are ignored: their ratio is mostly noise.
pub const MIN_PREDICTED_SHARE: f64 = 0.05;
/// The factor is clamped to this range: a node further off is broken, not slow.
pub const BOUNDS: [f64; 2] = [0.5, 1.5];

/// The learned speed of each node: measured over predicted throughput of the jobs that ran there
/// (the prediction without the node's speed factor), relative to the median node's, so that an
/// error of the model common to every node does not pass for a speed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The last [`KEEP`] usable ratios per node, oldest first.
    nodes: BTreeMap<String, VecDeque<f64>>,
}

/// One node's learned speed, as reported.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeSpeed {
    /// The node.
    pub node: String,
    /// The factor placement uses (1.0 until [`MIN_SAMPLES`] samples).
    pub factor: f64,
    /// Usable samples kept.
    pub samples: usize,
}

impl Calibration {
    /// Records one monitor window of a job on `node`: it ran `measured_per_s`, and the model
    /// (without the node's speed factor) predicted `predicted_per_s` for a job whose throughput
    /// alone is `alone_per_s`. Returns whether the sample was used: a prediction under
    /// [`MIN_PREDICTED_SHARE`] of alone, or a value that is not a finite number, is ignored.
    pub fn record(
        &mut self,
        node: &str,
        measured_per_s: f64,
        predicted_per_s: f64,
        alone_per_s: f64,
    ) -> bool {
        let sample = (measured_per_s, predicted_per_s, alone_per_s);
        push_ratio(&mut self.nodes, node, KEEP, sample)
    }

    /// The median of `node`'s kept ratios, with at least [`MIN_SAMPLES`] of them.
    fn median(&self, node: &str) -> Option<f64> {
        let ratios = self.nodes.get(node)?;
        (ratios.len() >= MIN_SAMPLES).then(|| median(ratios.iter().copied().collect()))
    }

    /// The reference every node is measured against: the median over the nodes with enough
    /// samples of their medians (1.0 where there are none). What all nodes share, the model's
    /// own error included, is no node's speed.
    pub fn reference(&self) -> f64 {
        let all: Vec<f64> = self.nodes.keys().filter_map(|n| self.median(n)).collect();
        if all.is_empty() {
            1.0
        } else {
            median(all)
        }
    }

    /// The speed factor of `node`: the median of its kept ratios over [`Calibration::reference`],
    /// clamped to [`BOUNDS`]; 1.0 with fewer than [`MIN_SAMPLES`] ratios. For many nodes at
    /// once, [`Calibration::factors`] computes the reference once.
    pub fn factor(&self, node: &str) -> f64 {
        self.median(node)
            .map_or(1.0, |m| relative(m, self.reference()))
    }

    /// The factor of every node with enough samples (the others' is 1.0).
    pub fn factors(&self) -> HashMap<String, f64> {
        let medians: Vec<(&String, f64)> = self
            .nodes
            .keys()
            .filter_map(|n| Some((n, self.median(n)?)))
            .collect();
        if medians.is_empty() {
            return HashMap::new();
        }
        let reference = median(medians.iter().map(|m| m.1).collect());
        medians
            .into_iter()
            .map(|(n, m)| (n.clone(), relative(m, reference)))
            .collect()
    }

    /// Usable samples kept for `node`.
    pub fn samples(&self, node: &str) -> usize {
        self.nodes.get(node).map_or(0, VecDeque::len)
    }

    /// Every node with samples, with its factor (for reports).
    pub fn speeds(&self) -> Vec<NodeSpeed> {
        let factors = self.factors();
        self.nodes
            .iter()
            .map(|(node, r)| NodeSpeed {
                node: node.clone(),
                factor: factors.get(node).copied().unwrap_or(1.0),
                samples: r.len(),
            })
            .collect()
    }
}

/// A node's median ratio over the reference, clamped to [`BOUNDS`].
fn relative(median: f64, reference: f64) -> f64 {
    if reference > 0.0 {
        (median / reference).clamp(BOUNDS[0], BOUNDS[1])
    } else {
        1.0
    }
}

/// Ratios kept per job for its level (the last ones).
pub const JOB_KEEP: usize = 15;
/// A job's level is applied only where it is this far below 1 or further. Applying every level
/// cost 8% more evictions in the simulation with profile errors of sd 0.03 (a level above 1 placed
/// the job where it then missed); applying only these cost none there and cut evictions 18-31%
/// at sd 0.15 (docs/results/2026-11-26-cluster-sim-profile-error.md).
pub const JOB_LEVEL_DEADBAND: f64 = 0.1;

/// Each job's level: its measured over predicted throughput, the prediction including its node's
/// speed factor. One profiling process in four of a continuous-batching job on H200s ran 13-17%
/// below the job's level elsewhere; a job placed on such a profile misses its SLA wherever it
/// goes, and its level is what places it right after the first eviction.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobLevels {
    /// The last [`JOB_KEEP`] usable ratios per job, oldest first.
    jobs: BTreeMap<String, VecDeque<f64>>,
}

impl JobLevels {
    /// Records one judged window of `job` (the same rules as [`Calibration::record`]). Returns
    /// whether the sample was used.
    pub fn record(
        &mut self,
        job: &str,
        measured_per_s: f64,
        predicted_per_s: f64,
        alone_per_s: f64,
    ) -> bool {
        let sample = (measured_per_s, predicted_per_s, alone_per_s);
        push_ratio(&mut self.jobs, job, JOB_KEEP, sample)
    }

    /// `job`'s level: the median of its kept ratios, clamped to [`BOUNDS`]; `None` with fewer
    /// than [`MIN_SAMPLES`].
    pub fn factor(&self, job: &str) -> Option<f64> {
        let r = self.jobs.get(job)?;
        (r.len() >= MIN_SAMPLES)
            .then(|| median(r.iter().copied().collect()).clamp(BOUNDS[0], BOUNDS[1]))
    }

    /// `job`'s level where it is at least [`JOB_LEVEL_DEADBAND`] below 1: what placement applies.
    pub fn applied(&self, job: &str) -> Option<f64> {
        self.factor(job).filter(|&f| f <= 1.0 - JOB_LEVEL_DEADBAND)
    }

    /// Forgets every job `keep` does not name (jobs that left the engine).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.jobs.retain(|j, _| keep(j));
    }

    /// Jobs with samples.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether no job has samples.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }
}

/// Appends `measured / predicted` of `sample` (measured, predicted, alone per second) to `key`'s
/// last `keep` ratios, if [`usable`]; returns whether it was.
fn push_ratio(
    ratios: &mut BTreeMap<String, VecDeque<f64>>,
    key: &str,
    keep: usize,
    (measured, predicted, alone): (f64, f64, f64),
) -> bool {
    if !usable(measured, predicted, alone) {
        return false;
    }
    let kept = ratios.entry(key.to_string()).or_default();
    if kept.len() >= keep {
        kept.pop_front();
    }
    kept.push_back(measured / predicted);
    true
}

/// Whether a window's figures can be a sample: finite, a positive alone, and a prediction of at
/// least [`MIN_PREDICTED_SHARE`] of alone.
fn usable(measured_per_s: f64, predicted_per_s: f64, alone_per_s: f64) -> bool {
    measured_per_s.is_finite()
        && predicted_per_s.is_finite()
        && alone_per_s.is_finite()
        && alone_per_s > 0.0
        && measured_per_s >= 0.0
        && predicted_per_s >= MIN_PREDICTED_SHARE * alone_per_s
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three nodes whose jobs run as predicted (the reference), and `node` with `ratios`.
    fn fed(node: &str, ratios: &[f64]) -> Calibration {
        let mut c = Calibration::default();
        for r in ["r1", "r2", "r3"] {
            for _ in 0..MIN_SAMPLES {
                assert!(c.record(r, 50.0, 50.0, 100.0));
            }
        }
        for &r in ratios {
            assert!(c.record(node, 50.0 * r, 50.0, 100.0));
        }
        c
    }

    #[test]
    fn a_node_is_used_only_after_the_minimum_samples() {
        let c = fed("slow", &[0.78, 0.78]);
        assert_eq!(c.factor("slow"), 1.0, "two samples are not enough");
        assert!(!c.factors().contains_key("slow"));
        let c = fed("slow", &[0.78, 0.78, 0.78]);
        assert!((c.factor("slow") - 0.78).abs() < 1e-12);
        assert_eq!(c.factors()["slow"], c.factor("slow"));
        assert_eq!(c.factor("unknown"), 1.0);
        assert_eq!(Calibration::default().factor("x"), 1.0);
    }

    #[test]
    fn the_factor_is_clamped() {
        assert_eq!(fed("broken", &[0.1, 0.1, 0.1]).factor("broken"), 0.5);
        assert_eq!(fed("odd", &[3.0, 3.0, 3.0]).factor("odd"), 1.5);
    }

    #[test]
    fn an_error_every_node_shares_is_no_nodes_speed() {
        let mut c = Calibration::default();
        for (node, ratio) in [("a", 1.1), ("b", 1.1), ("c", 1.1), ("slow", 0.88)] {
            for _ in 0..MIN_SAMPLES {
                c.record(node, 100.0 * ratio, 100.0, 100.0);
            }
        }
        assert!((c.reference() - 1.1).abs() < 1e-12);
        assert!((c.factor("a") - 1.0).abs() < 1e-12);
        assert!((c.factor("slow") - 0.8).abs() < 1e-12);
    }

    #[test]
    fn the_median_ignores_outliers_and_old_samples_are_forgotten() {
        let c = fed("n", &[0.8, 0.0, 0.82, 5.0, 0.79]);
        assert!((c.factor("n") - 0.8).abs() < 1e-12, "{}", c.factor("n"));
        let mut ratios = vec![1.2; KEEP];
        ratios.extend([0.7; KEEP]);
        let c = fed("n", &ratios);
        assert_eq!(c.samples("n"), KEEP);
        assert!((c.factor("n") - 0.7).abs() < 1e-12, "the node changed");
    }

    #[test]
    fn tiny_predictions_and_non_numbers_are_ignored() {
        let mut c = Calibration::default();
        assert!(!c.record("n", 1.0, 4.9, 100.0), "under 5% of alone");
        assert!(!c.record("n", f64::NAN, 50.0, 100.0));
        assert!(!c.record("n", 40.0, f64::INFINITY, 100.0));
        assert!(!c.record("n", 40.0, 50.0, 0.0));
        assert_eq!(c.samples("n"), 0);
        assert_eq!(c.factor("n"), 1.0);
        assert!(c.record("n", 4.0, 5.0, 100.0), "5% is enough");
    }

    #[test]
    fn a_jobs_level_is_its_median_ratio_after_the_minimum_samples() {
        let mut l = JobLevels::default();
        assert!(l.record("j", 85.0, 100.0, 200.0));
        assert!(l.record("j", 80.0, 100.0, 200.0));
        assert_eq!(l.factor("j"), None, "two samples are not enough");
        assert!(l.record("j", 90.0, 100.0, 200.0));
        assert_eq!(l.factor("j"), Some(0.85));
        assert!(!l.record("j", 1.0, 1.0, 200.0), "under 5% of alone");
        for _ in 0..JOB_KEEP {
            l.record("j", 10.0, 100.0, 200.0);
        }
        assert_eq!(l.factor("j"), Some(BOUNDS[0]), "old samples go; clamped");
        l.record("k", 50.0, 50.0, 100.0);
        l.retain(|j| j == "k");
        assert_eq!((l.len(), l.factor("j")), (1, None));
        let back: JobLevels = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
    }

    #[test]
    fn it_survives_serialisation() {
        let c = fed("a", &[0.8, 0.9, 1.0]);
        let back: Calibration = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        let a = back.speeds().into_iter().find(|s| s.node == "a").unwrap();
        assert_eq!((a.factor, a.samples), (0.9, 3));
    }
}
