//! The SLA monitor: once per window it compares each running job's measured throughput (its own
//! progress reports, through the node's harvest document) with its SLA, and evicts a job that
//! missed it for N windows in a row, at most M evictions a minute.
//!
//! Hysteresis: a miss streak ends only when a window reaches the SLA plus a band, so a job that
//! hovers at its SLA is neither evicted for noise nor forgiven for one lucky window.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::calibrate::{Calibration, JobLevels};

/// Monitor settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MonitorParams {
    /// The window a job's throughput is judged over (one of the nodes' progress windows).
    pub window_s: u32,
    /// Windows missed in a row before a job is evicted.
    pub misses_to_evict: u32,
    /// A window at `sla + hysteresis` or above ends a miss streak.
    pub hysteresis: f64,
    /// Evictions allowed in any 60 s.
    pub max_evictions_per_min: u32,
    /// A window counts only if the job reported over at least this share of it.
    pub min_coverage: f64,
}

impl Default for MonitorParams {
    fn default() -> Self {
        MonitorParams {
            window_s: 600,
            misses_to_evict: 2,
            hysteresis: 0.05,
            max_evictions_per_min: 10,
            min_coverage: 0.9,
        }
    }
}

/// A running job, as the engine reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct RunningJob {
    /// The engine's id.
    pub id: String,
    /// Where it runs.
    pub node: String,
    /// Its SLA.
    pub sla: f64,
    /// Its throughput alone (units/s).
    pub alone_per_s: f64,
    /// When this run started (Unix ms); a requeued job starts a new run.
    pub started_unix_ms: u64,
}

/// A measured rate over the monitor's window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Units per second.
    pub per_s: f64,
    /// Seconds of the window the job reported over.
    pub covered_s: f64,
}

/// What the monitor concluded about one job this tick.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    /// The job.
    pub job: String,
    /// Its node.
    pub node: String,
    /// Measured throughput as a share of alone, where judged this tick.
    pub share: Option<f64>,
    /// Its SLA.
    pub sla: f64,
    /// Windows missed in a row.
    pub misses: u32,
    /// What to do.
    pub action: Action,
    /// Why, for people.
    pub note: String,
}

/// The monitor's action for a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Nothing.
    Keep,
    /// Evict (requeue) it.
    Evict,
    /// It should go, but the eviction cap is reached: next tick.
    EvictLater,
}

/// One run's record.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Watch {
    started_unix_ms: u64,
    misses: u32,
    last_judged_unix_ms: u64,
    last_share: Option<f64>,
}

/// The monitor's memory, kept in the scheduler's state file across restarts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Monitor {
    jobs: BTreeMap<String, Watch>,
    evictions_unix_ms: VecDeque<u64>,
    /// Each node's speed, learned from the windows the monitor judged (state files written
    /// before it existed start it afresh).
    #[serde(default)]
    pub calibration: Calibration,
    /// Each running or requeued job's level, learned from the same windows (with job
    /// calibration on).
    #[serde(default)]
    pub job_levels: JobLevels,
}

impl Monitor {
    /// Judges `running` at `now_unix_ms`; `measured(job)` is the job's rate over the monitor
    /// window, if its node reported one. Jobs no longer running are forgotten.
    pub fn tick(
        &mut self,
        now_unix_ms: u64,
        running: &[RunningJob],
        measured: impl Fn(&RunningJob) -> Option<Measured>,
        params: &MonitorParams,
    ) -> Vec<Check> {
        let ids: std::collections::HashSet<&str> = running.iter().map(|r| r.id.as_str()).collect();
        self.jobs.retain(|id, _| ids.contains(id.as_str()));
        while self
            .evictions_unix_ms
            .front()
            .is_some_and(|&t| now_unix_ms.saturating_sub(t) >= 60_000)
        {
            self.evictions_unix_ms.pop_front();
        }
        running
            .iter()
            .map(|r| self.check(now_unix_ms, r, measured(r), params))
            .collect()
    }

    fn check(&mut self, now: u64, r: &RunningJob, m: Option<Measured>, p: &MonitorParams) -> Check {
        let w = self.jobs.entry(r.id.clone()).or_default();
        if w.started_unix_ms != r.started_unix_ms {
            *w = Watch {
                started_unix_ms: r.started_unix_ms,
                ..Watch::default()
            };
        }
        let window_ms = u64::from(p.window_s) * 1000;
        let due = now.saturating_sub(w.last_judged_unix_ms) >= window_ms;
        let mut note = String::new();
        let mut share = None;
        if due {
            match m {
                None => note = "no progress reports from its node".into(),
                Some(m) if m.covered_s < p.min_coverage * f64::from(p.window_s) => {
                    note = format!(
                        "reports cover {:.0} of {} s: not judged yet",
                        m.covered_s, p.window_s
                    )
                }
                Some(m) => {
                    let s = m.per_s / r.alone_per_s;
                    share = Some(s);
                    w.last_judged_unix_ms = now;
                    w.last_share = Some(s);
                    if s < r.sla {
                        w.misses += 1;
                    } else if s >= r.sla + p.hysteresis {
                        w.misses = 0;
                    }
                    note = format!("measured {s:.2} of alone against SLA {:.2}", r.sla);
                }
            }
        }
        let misses = w.misses;
        let action = if misses < p.misses_to_evict {
            Action::Keep
        } else if self.evictions_unix_ms.len() < p.max_evictions_per_min as usize {
            self.evictions_unix_ms.push_back(now);
            note = format!("{note}; missed its SLA {misses} windows in a row: evict");
            Action::Evict
        } else {
            note = format!(
                "{note}; missed its SLA {misses} windows in a row, but {} evictions in the last minute is the cap",
                p.max_evictions_per_min
            );
            Action::EvictLater
        };
        Check {
            job: r.id.clone(),
            node: r.node.clone(),
            share,
            sla: r.sla,
            misses,
            action,
            note: note.trim_start_matches("; ").into(),
        }
    }

    /// Forgets a job (after it was evicted).
    pub fn forget(&mut self, job: &str) {
        self.jobs.remove(job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One-minute windows, three misses to evict (the tests' own settings, not the defaults).
    fn three() -> MonitorParams {
        MonitorParams {
            window_s: 60,
            misses_to_evict: 3,
            ..MonitorParams::default()
        }
    }

    fn run(id: &str, sla: f64) -> RunningJob {
        RunningJob {
            id: id.into(),
            node: "n1".into(),
            sla,
            alone_per_s: 100.0,
            started_unix_ms: 5,
        }
    }

    fn rate(per_s: f64) -> Option<Measured> {
        Some(Measured {
            per_s,
            covered_s: 60.0,
        })
    }

    /// Ticks once a minute with the given measured rates; returns the actions.
    fn ticks(m: &mut Monitor, job: &RunningJob, rates: &[f64], p: &MonitorParams) -> Vec<Action> {
        rates
            .iter()
            .enumerate()
            .map(|(k, &x)| {
                let now = 60_000 * (k as u64 + 1);
                m.tick(now, std::slice::from_ref(job), |_| rate(x), p)[0].action
            })
            .collect()
    }

    #[test]
    fn a_job_that_misses_three_windows_in_a_row_is_evicted() {
        let mut m = Monitor::default();
        let acts = ticks(
            &mut m,
            &run("1", 0.8),
            &[70.0, 70.0, 90.0, 70.0, 70.0, 70.0],
            &three(),
        );
        use Action::*;
        assert_eq!(
            acts,
            [Keep, Keep, Keep, Keep, Keep, Evict],
            "a good window resets the streak"
        );
    }

    #[test]
    fn hovering_at_the_sla_neither_evicts_nor_forgives() {
        let mut m = Monitor::default();
        // 79 misses, 82 is inside the band (0.80..0.85): the streak stays.
        let acts = ticks(
            &mut m,
            &run("1", 0.8),
            &[79.0, 82.0, 79.0, 82.0, 79.0],
            &three(),
        );
        assert_eq!(acts.last(), Some(&Action::Evict));
        let mut m = Monitor::default();
        let acts = ticks(
            &mut m,
            &run("1", 0.8),
            &[79.0, 86.0, 79.0, 86.0, 79.0],
            &three(),
        );
        assert!(
            acts.iter().all(|a| *a == Action::Keep),
            "above the band forgives"
        );
    }

    #[test]
    fn evictions_are_capped_per_minute() {
        let p = MonitorParams {
            misses_to_evict: 1,
            max_evictions_per_min: 2,
            ..three()
        };
        let jobs: Vec<_> = (0..3).map(|i| run(&i.to_string(), 0.8)).collect();
        let mut m = Monitor::default();
        let c = m.tick(60_000, &jobs, |_| rate(10.0), &p);
        let acts: Vec<_> = c.iter().map(|c| c.action).collect();
        assert_eq!(acts, [Action::Evict, Action::Evict, Action::EvictLater]);
        assert!(c[2].note.contains("cap"), "{}", c[2].note);
        // 30 s later: still capped, and not judged again (no new window).
        let c = m.tick(90_000, &jobs[2..], |_| rate(10.0), &p);
        assert_eq!((c[0].action, c[0].share), (Action::EvictLater, None));
        let c = m.tick(120_000, &jobs[2..], |_| rate(10.0), &p);
        assert_eq!(c[0].action, Action::Evict, "a minute after the first two");
    }

    #[test]
    fn short_or_missing_reports_are_not_judged() {
        let mut m = Monitor::default();
        let j = run("1", 0.8);
        let p = MonitorParams {
            misses_to_evict: 1,
            ..three()
        };
        let c = m.tick(60_000, std::slice::from_ref(&j), |_| None, &p);
        assert_eq!((c[0].action, c[0].misses), (Action::Keep, 0));
        assert!(c[0].note.contains("no progress reports"));
        let short = Measured {
            per_s: 1.0,
            covered_s: 20.0,
        };
        let c = m.tick(60_000, std::slice::from_ref(&j), |_| Some(short), &p);
        assert_eq!(c[0].action, Action::Keep);
        assert!(c[0].note.contains("not judged yet"));
    }

    #[test]
    fn a_requeued_run_starts_a_fresh_streak_and_state_survives_serialisation() {
        let p = three();
        let mut m = Monitor::default();
        let mut j = run("1", 0.8);
        ticks(&mut m, &j, &[10.0, 10.0], &p);
        let mut back: Monitor = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        let c = back.tick(180_000, std::slice::from_ref(&j), |_| rate(10.0), &p);
        assert_eq!(
            c[0].action,
            Action::Evict,
            "the streak survived the restart"
        );
        j.started_unix_ms = 200_000;
        let c = back.tick(300_000, std::slice::from_ref(&j), |_| rate(10.0), &p);
        assert_eq!((c[0].misses, c[0].action), (1, Action::Keep), "a new run");
        back.tick(360_000, &[], |_| None, &p);
        assert!(back.jobs.is_empty(), "finished jobs are forgotten");
    }
}
