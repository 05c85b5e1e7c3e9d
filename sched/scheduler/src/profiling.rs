//! Turning measurements of a job run at several memory caps into its profile: T_alone and the
//! memory-throughput curve T(m). `valve-scheduler profile-job` measures.

use crate::job::{CurvePoint, EpisodeCost, InterruptCosts, JobProfile, Measured, PROFILE_VERSION};

/// One measured step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Step {
    /// The cap in force (`None`: no cap: the job alone with all the memory it wants).
    pub cap_bytes: Option<u64>,
    /// What the job held at the end of the step (0: unknown).
    pub held_bytes: u64,
    /// Its throughput over the step (units/s).
    pub per_s: f64,
}

/// Puts the steps of a capped run on the level of a run started uncapped: the uncapped step
/// becomes `fresh_alone` and every capped step is scaled by `fresh_alone` over the capped run's
/// own uncapped rate, so the curve keeps its shape (`profile-job --fresh-alone`). Returns the
/// factor; `None` (steps unchanged) without an uncapped step or with a rate of 0.
pub fn rebase_on_fresh_alone(steps: &mut [Step], fresh_alone: f64) -> Option<f64> {
    let capped_run = steps.iter().rev().find(|s| s.cap_bytes.is_none())?.per_s;
    if !(capped_run > 0.0 && fresh_alone > 0.0) {
        return None;
    }
    let factor = fresh_alone / capped_run;
    for s in steps.iter_mut() {
        s.per_s = if s.cap_bytes.is_none() {
            fresh_alone
        } else {
            s.per_s * factor
        };
    }
    Some(factor)
}

/// What the profile says about itself.
#[derive(Clone, Debug)]
pub struct About {
    /// The job's name.
    pub name: String,
    /// Its unit of work.
    pub units: String,
    /// GPUs it runs on.
    pub gpus: u32,
    /// Where and when it was measured.
    pub measured: Measured,
    /// The deficit penalty to record (measured elsewhere, or stated).
    pub deficit_penalty: f64,
    /// What interruptions cost it ([`interrupt_cost_s`] from the profiling steps).
    pub costs: InterruptCosts,
}

/// Seconds of work lost per interruption: a step of `seconds` at `per_s`, against `alone_per_s`,
/// in which the job was held for `held_s` in all and interrupted `events` times (or, for
/// reclaims, lost `events` GiB). What the held time explains is not counted; never below 0.
pub fn interrupt_cost_s(
    alone_per_s: f64,
    per_s: f64,
    seconds: f64,
    held_s: f64,
    events: f64,
) -> Option<f64> {
    if !(alone_per_s > 0.0 && seconds > 0.0 && events > 0.0) {
        return None;
    }
    let ran_s = seconds * (per_s / alone_per_s);
    Some(((seconds - held_s - ran_s) / events).max(0.0))
}

/// What a preemption step says about the job: a step of `seconds` at `per_s` against
/// `alone_per_s`, held `held_s` in all over `events` preemptions. Returns `(held_overlap,
/// preemption_s)`: lost time short of the held time is host work that went on while held
/// (`held_overlap` = 1 - lost / held); lost time beyond it, per preemption, is `preemption_s`.
/// None where nothing was measured.
pub fn preemption_costs(
    alone_per_s: f64,
    per_s: f64,
    seconds: f64,
    held_s: f64,
    events: f64,
) -> Option<(f64, f64)> {
    if !(alone_per_s > 0.0 && seconds > 0.0 && events > 0.0) {
        return None;
    }
    let lost_s = seconds * (1.0 - per_s / alone_per_s);
    let overlap = if held_s > 0.0 {
        (1.0 - lost_s / held_s).clamp(0.0, 1.0)
    } else {
        0.0
    };
    Some((overlap, ((lost_s - held_s) / events).max(0.0)))
}

/// What one interrupted profiling step read, before [`costs_from`] decides what to keep.
#[derive(Clone, Debug, PartialEq)]
pub enum StepReading {
    /// The preemption step, as [`preemption_costs`] reads it.
    Preemption {
        /// Share of the held time not lost.
        held_overlap: f64,
        /// Seconds lost per preemption beyond the held time.
        preemption_s: f64,
        /// [`step_effect`] of the step.
        effect: f64,
    },
    /// One reclaim size's step.
    Reclaim {
        /// MiB per reclaim.
        mib: u64,
        /// Reclaims inside the measured seconds.
        episodes: f64,
        /// GiB they took back.
        gib: f64,
        /// Seconds of work the step lost, all reclaims together.
        lost_s: f64,
        /// [`step_effect`] of the step.
        effect: f64,
    },
}

impl StepReading {
    fn effect(&self) -> f64 {
        match self {
            StepReading::Preemption { effect, .. } | StepReading::Reclaim { effect, .. } => *effect,
        }
    }

    fn name(&self) -> String {
        match self {
            StepReading::Preemption { .. } => "the preemption step".into(),
            StepReading::Reclaim { mib, .. } => format!("the {mib}-MiB reclaim step"),
        }
    }
}

/// How far an interrupted step's rate `per_s` is from what it would be if the interruptions
/// cost exactly their held time `held_s` of `seconds` and nothing more, at the baseline
/// `base_per_s`: |per_s - expected| / expected. `None` where nothing was measured.
pub fn step_effect(base_per_s: f64, per_s: f64, seconds: f64, held_s: f64) -> Option<f64> {
    let expected = base_per_s * (1.0 - held_s / seconds);
    (expected > 0.0 && seconds > 0.0 && per_s > 0.0).then(|| (per_s - expected).abs() / expected)
}

/// The interruption costs from the steps' readings. A step whose [`step_effect`] is no larger
/// than `noise` (how far the job's uninterrupted rate moved while profiled) measured nothing the
/// job's own drift could not make, so its costs are left at 0 and a note says so; `None` keeps
/// every reading. Reclaim costs: seconds lost per GiB over the kept sizes, and per episode by
/// size.
pub fn costs_from(readings: &[StepReading], noise: Option<f64>) -> (InterruptCosts, Vec<String>) {
    let mut costs = InterruptCosts::default();
    let mut notes = Vec::new();
    let (mut lost_all, mut gib_all) = (0.0, 0.0);
    for r in readings {
        if let Some(n) = noise.filter(|&n| r.effect() <= n) {
            notes.push(format!(
                "{} moved the job's rate {:.1}%, inside the {:.1}% its uninterrupted rate moved: \
                 no cost charged for it",
                r.name(),
                100.0 * r.effect(),
                100.0 * n
            ));
            continue;
        }
        match *r {
            StepReading::Preemption {
                held_overlap,
                preemption_s,
                ..
            } => (costs.held_overlap, costs.preemption_s) = (held_overlap, preemption_s),
            StepReading::Reclaim {
                episodes,
                gib,
                lost_s,
                ..
            } => {
                (lost_all, gib_all) = (lost_all + lost_s, gib_all + gib);
                if episodes > 0.0 && gib > 0.0 {
                    costs.reclaim_episodes.push(EpisodeCost {
                        reclaimed_bytes: (gib / episodes * f64::from(1u32 << 30)) as u64,
                        lost_s: lost_s / episodes,
                    });
                }
            }
        }
    }
    costs.reclaim_s_per_gib = if gib_all > 0.0 {
        lost_all / gib_all
    } else {
        0.0
    };
    costs.reclaim_episodes.sort_by_key(|p| p.reclaimed_bytes);
    costs.reclaim_episodes.dedup_by_key(|p| p.reclaimed_bytes);
    (costs, notes)
}

/// The profile from `steps`. A step's memory is what the job held (the cap where that is
/// unknown); steps at equal memory are averaged. T_alone is the uncapped step's rate, or the
/// best rate where no step ran uncapped.
pub fn build(about: &About, steps: &[Step]) -> Result<JobProfile, String> {
    let mut pts: Vec<(u64, f64)> = steps
        .iter()
        .filter_map(|s| {
            let m = if s.held_bytes > 0 {
                s.held_bytes
            } else {
                s.cap_bytes?
            };
            Some((m, s.per_s))
        })
        .collect();
    if pts.is_empty() {
        return Err(
            "no step measured any memory: is the job a pool client (offline, VALVE_LABEL)?".into(),
        );
    }
    pts.sort_by_key(|p| p.0);
    let mut curve: Vec<CurvePoint> = Vec::new();
    let mut run: Vec<f64> = Vec::new();
    for (i, &(m, r)) in pts.iter().enumerate() {
        run.push(r);
        if pts.get(i + 1).is_none_or(|n| n.0 != m) {
            let per_s = run.iter().sum::<f64>() / run.len() as f64;
            curve.push(CurvePoint {
                memory_bytes: m,
                per_s,
            });
            run.clear();
        }
    }
    let alone = steps
        .iter()
        .filter(|s| s.cap_bytes.is_none())
        .map(|s| s.per_s)
        .fold(None, |a: Option<f64>, r| Some(a.map_or(r, |a| a.max(r))))
        .unwrap_or_else(|| curve.iter().map(|p| p.per_s).fold(0.0, f64::max));
    let profile = JobProfile {
        version: PROFILE_VERSION,
        name: about.name.clone(),
        units: about.units.clone(),
        gpus: about.gpus,
        alone_per_s: alone,
        curve,
        required_bytes: None,
        deficit_penalty: about.deficit_penalty,
        costs: about.costs.clone(),
        measured: Some(about.measured.clone()),
    };
    profile.validate().map_err(|e| e.to_string())?;
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn about() -> About {
        About {
            name: "cb".into(),
            units: "tokens".into(),
            gpus: 1,
            measured: Measured {
                device: "test".into(),
                unix_ms: 0,
                seconds_per_point: 20.0,
                alone_spread: None,
                uninterrupted_per_s: Vec::new(),
                capped_run_alone_per_s: None,
                costs_as_read: None,
            },
            deficit_penalty: 0.2,
            costs: InterruptCosts::default(),
        }
    }

    #[test]
    fn a_capped_run_is_put_on_the_level_of_the_run_started_uncapped() {
        // Figures of the sixth H200 check's first run: a capped run read 1,535 at 8 GiB and
        // 1,522 uncapped; another process of the job read 1,741.
        let step = |cap: Option<u64>, per_s| Step {
            cap_bytes: cap,
            held_bytes: 0,
            per_s,
        };
        let mut steps = vec![step(Some(8 * GIB), 1535.0), step(None, 1522.0)];
        let f = rebase_on_fresh_alone(&mut steps, 1741.0).unwrap();
        assert!((f - 1741.0 / 1522.0).abs() < 1e-12, "{f}");
        assert_eq!(steps[1].per_s, 1741.0);
        assert!((steps[0].per_s - 1535.0 * f).abs() < 1e-9, "{:?}", steps[0]);
        // The profile built from them has the fresh run's T_alone and the capped run's shape.
        let mut s2 = steps.clone();
        s2[0].held_bytes = 8 * GIB;
        s2[1].held_bytes = 12 * GIB;
        let p = build(&about(), &s2).unwrap();
        assert_eq!(p.alone_per_s, 1741.0);
        assert!((p.curve[0].per_s / p.curve[1].per_s - 1535.0 / 1522.0).abs() < 1e-12);

        let mut none = vec![step(Some(GIB), 10.0)];
        assert_eq!(
            rebase_on_fresh_alone(&mut none, 5.0),
            None,
            "no uncapped step"
        );
        assert_eq!(none[0].per_s, 10.0, "left as it was");
        let mut zero = vec![step(None, 0.0)];
        assert_eq!(rebase_on_fresh_alone(&mut zero, 5.0), None, "a rate of 0");
    }

    /// The seventh check's run G (H100): uninterrupted 1,678, 1,723, then 1,504 tokens/s; the
    /// preemption step (20 holds of 500 ms in 20 s) read 807.3 against a baseline of 1,700.7, the
    /// 2-GiB reclaim step 1,474.5 against 1,613.7.
    fn run_g() -> Vec<StepReading> {
        let (base_p, per_p) = (1700.7, 807.3);
        let (overlap, pre) = preemption_costs(base_p, per_p, 20.0, 10.0, 20.0).unwrap();
        let (base_r, per_r) = (1613.7, 1474.5);
        vec![
            StepReading::Preemption {
                held_overlap: overlap,
                preemption_s: pre,
                effect: step_effect(base_p, per_p, 20.0, 10.0).unwrap(),
            },
            StepReading::Reclaim {
                mib: 2048,
                episodes: 5.0,
                gib: 10.0,
                lost_s: interrupt_cost_s(base_r, per_r, 20.0, 0.0, 1.0).unwrap(),
                effect: step_effect(base_r, per_r, 20.0, 0.0).unwrap(),
            },
        ]
    }

    #[test]
    fn a_step_inside_the_jobs_own_spread_charges_nothing() {
        let g = run_g();
        let effects: Vec<f64> = g.iter().map(StepReading::effect).collect();
        assert!((effects[0] - 0.0506).abs() < 5e-4, "{effects:?}");
        assert!((effects[1] - 0.0863).abs() < 5e-4, "{effects:?}");
        let noise = crate::job::spread_of(&[1678.2, 1723.2, 1504.3]).unwrap();
        assert!((noise - 0.134).abs() < 1e-3, "{noise}");

        let (kept, notes) = costs_from(&g, Some(noise));
        assert!(kept.is_zero(), "{kept:?}");
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[1].contains("2048-MiB reclaim step"), "{notes:?}");

        // As read, the same steps charge what the profile of run G charged.
        let (read, none) = costs_from(&g, None);
        assert!(none.is_empty());
        assert!((read.preemption_s - 0.0253).abs() < 5e-4, "{read:?}");
        assert!((read.reclaim_s_per_gib - 0.1726).abs() < 5e-4, "{read:?}");
        assert_eq!(read.reclaim_episodes.len(), 1);
        assert_eq!(read.reclaim_episodes[0].reclaimed_bytes, 2 * GIB);

        // The sixth check's run D: the preemption step lost 0.95 s beyond its held time (9.5%
        // of the step) while the job's level moved 1.4%: charged.
        let d = [StepReading::Preemption {
            held_overlap: 0.0,
            preemption_s: 0.0476,
            effect: step_effect(1896.3, 1896.3 * (1.0 - 10.95 / 20.0), 20.0, 10.0).unwrap(),
        }];
        let (kept, notes) = costs_from(&d, Some(0.014));
        assert_eq!(kept.preemption_s, 0.0476, "{notes:?}");
        assert!(notes.is_empty());
    }

    #[test]
    fn an_interruption_costs_what_the_held_time_does_not_explain() {
        // 20 s, held 2 s in all over 20 preemptions, ran at 80% of alone: 2 s lost beyond the
        // 2 s held, 0.1 s per preemption.
        let c = interrupt_cost_s(100.0, 80.0, 20.0, 2.0, 20.0).unwrap();
        assert!((c - 0.1).abs() < 1e-12, "{c}");
        assert_eq!(
            interrupt_cost_s(100.0, 95.0, 20.0, 2.0, 20.0),
            Some(0.0),
            "noise above alone"
        );
        assert_eq!(
            interrupt_cost_s(100.0, 80.0, 20.0, 2.0, 0.0),
            None,
            "nothing happened"
        );
    }

    #[test]
    fn a_preemption_step_splits_lost_time_into_held_time_not_lost_and_a_cost_per_preemption() {
        // 30 s, held 15 s in all over 30 preemptions. A job bound by the GPU loses the 15 s.
        let (overlap, cost) = preemption_costs(100.0, 50.0, 30.0, 15.0, 30.0).unwrap();
        assert_eq!((overlap, cost), (0.0, 0.0));
        // One that ran at 56% of alone lost 13.2 s: 12% of the held time went on on the host.
        let (overlap, cost) = preemption_costs(100.0, 56.0, 30.0, 15.0, 30.0).unwrap();
        assert!(
            (overlap - 0.12).abs() < 1e-12 && cost == 0.0,
            "{overlap} {cost}"
        );
        // One that ran at 40% lost 18 s: 3 s beyond the held time, 0.1 s per preemption.
        let (overlap, cost) = preemption_costs(100.0, 40.0, 30.0, 15.0, 30.0).unwrap();
        assert!(
            overlap == 0.0 && (cost - 0.1).abs() < 1e-12,
            "{overlap} {cost}"
        );
        assert_eq!(
            preemption_costs(100.0, 120.0, 30.0, 15.0, 30.0),
            Some((1.0, 0.0)),
            "noise above alone: nothing lost"
        );
        assert_eq!(
            preemption_costs(100.0, 50.0, 30.0, 15.0, 0.0),
            None,
            "nothing happened"
        );
    }

    #[test]
    fn steps_become_a_curve_by_the_memory_actually_held() {
        let steps = [
            Step {
                cap_bytes: Some(2 * GIB),
                held_bytes: 2 * GIB,
                per_s: 300.0,
            },
            Step {
                cap_bytes: Some(4 * GIB),
                held_bytes: 4 * GIB,
                per_s: 500.0,
            },
            // Capped above what it wants: it held 5 GiB either way.
            Step {
                cap_bytes: Some(8 * GIB),
                held_bytes: 5 * GIB,
                per_s: 590.0,
            },
            Step {
                cap_bytes: None,
                held_bytes: 5 * GIB,
                per_s: 610.0,
            },
        ];
        let p = build(&about(), &steps).unwrap();
        assert_eq!(p.alone_per_s, 610.0);
        let mem: Vec<u64> = p.curve.iter().map(|c| c.memory_bytes).collect();
        assert_eq!(mem, [2 * GIB, 4 * GIB, 5 * GIB]);
        assert_eq!(p.curve[2].per_s, 600.0, "equal memory: averaged");
        assert_eq!(p.deficit_penalty, 0.2);
    }

    #[test]
    fn without_an_uncapped_step_the_best_rate_is_alone_and_empty_runs_are_refused() {
        let steps = [Step {
            cap_bytes: Some(GIB),
            held_bytes: 0,
            per_s: 100.0,
        }];
        assert_eq!(build(&about(), &steps).unwrap().alone_per_s, 100.0);
        let e = build(
            &about(),
            &[Step {
                cap_bytes: None,
                held_bytes: 0,
                per_s: 1.0,
            }],
        )
        .unwrap_err();
        assert!(e.contains("pool client"), "{e}");
        let e = build(
            &about(),
            &[Step {
                cap_bytes: Some(GIB),
                held_bytes: 0,
                per_s: 0.0,
            }],
        )
        .unwrap_err();
        assert!(e.contains("alone_per_s"), "{e}");
    }
}
