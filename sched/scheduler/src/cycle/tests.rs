use super::*;
use crate::job::tests::{profile, GIB};
use crate::monitor::Action;
use crate::place::Outcome;
use crate::testutil::doc;
use valve_harvest::{JobProgress, Rate};

const NOW: u64 = 10_000_000;

fn meta(sla: f64, placed: Option<(&str, &[u32])>) -> JobMeta {
    JobMeta {
        sla,
        profile: Some(profile(1)),
        placed: placed.map(|(n, g)| PlacedOn {
            node: n.into(),
            gpus: g.to_vec(),
        }),
        avoid: vec![],
        evictions: 0,
    }
}

fn job(id: &str, phase: Phase, meta: JobMeta) -> JobInfo {
    JobInfo {
        id: id.into(),
        phase,
        meta: Ok(meta),
        order: id.parse().unwrap_or(0),
    }
}

fn open(name: &str) -> NodeInfo {
    NodeInfo {
        name: name.into(),
        closed: None,
    }
}

fn reports(docs: Vec<NodeHarvest>, age_ms: u64) -> HashMap<String, Report> {
    docs.into_iter()
        .map(|d| {
            (
                d.node.clone(),
                Report {
                    doc: d,
                    received_unix_ms: NOW - age_ms,
                },
            )
        })
        .collect()
}

#[test]
fn held_jobs_fill_the_gpus_no_job_of_ours_holds() {
    let snap = Snapshot {
        nodes: vec![open("a")],
        jobs: vec![
            job("1", Phase::Running(0), meta(0.5, Some(("a", &[0])))),
            job("2", Phase::Released, meta(0.5, Some(("a", &[1])))),
            job("3", Phase::Held, meta(0.5, None)),
            job("4", Phase::Held, meta(0.5, None)),
        ],
    };
    let r = reports(vec![doc("a", 3, 0.2, 32 * GIB)], 0);
    let p = plan(NOW, &snap, &r, &mut Monitor::default(), &Params::default());
    let placed: Vec<_> = p
        .decisions
        .iter()
        .filter_map(|d| match &d.outcome {
            Outcome::Placed(pl) => Some((d.job.as_str(), pl.gpus.clone())),
            Outcome::Pending(_) => None,
        })
        .collect();
    assert_eq!(placed, [("3", vec![2])], "GPUs 0 and 1 are held; 4 waits");
    assert_eq!(p.checks.len(), 1, "the running job is watched");
}

#[test]
fn silent_closed_and_unreported_nodes_are_excluded_with_reasons() {
    let snap = Snapshot {
        nodes: vec![
            open("fresh"),
            open("stale"),
            open("unknown"),
            NodeInfo {
                name: "down".into(),
                closed: Some("down (not responding)".into()),
            },
        ],
        jobs: vec![job("1", Phase::Held, meta(0.5, None))],
    };
    let mut r = reports(
        vec![
            doc("fresh", 1, 0.9, 32 * GIB),
            doc("down", 1, 0.0, 32 * GIB),
        ],
        0,
    );
    r.extend(reports(vec![doc("stale", 1, 0.0, 32 * GIB)], 120_000));
    let p = plan(NOW, &snap, &r, &mut Monitor::default(), &Params::default());
    let why: HashMap<_, _> = p
        .excluded
        .iter()
        .map(|e| (e.node.as_str(), e.why.as_str()))
        .collect();
    assert!(why["stale"].contains("not reported for 120.0 s"), "{why:?}");
    assert!(why["unknown"].contains("no harvest document"));
    assert!(why["down"].contains("down (not responding)"));
    assert!(!why.contains_key("fresh"));
    // Only the busy fresh node is open: the job waits and says why.
    assert!(
        p.decisions[0].to_string().contains("best: fresh"),
        "{}",
        p.decisions[0]
    );
}

#[test]
fn bad_or_missing_profiles_are_refused_unless_a_default_is_stated() {
    let mut no_profile = meta(0.5, None);
    no_profile.profile = None;
    let snap = Snapshot {
        nodes: vec![open("a")],
        jobs: vec![
            job("1", Phase::Held, no_profile),
            JobInfo {
                id: "2".into(),
                phase: Phase::Held,
                meta: Err(MetaError::Malformed("eof".into())),
                order: 2,
            },
        ],
    };
    let r = reports(vec![doc("a", 2, 0.0, 32 * GIB)], 0);
    let p = plan(NOW, &snap, &r, &mut Monitor::default(), &Params::default());
    assert_eq!(p.refused.len(), 2);
    assert!(p.refused[0].why.contains("--default-profile"));
    assert!(p.refused[1].why.contains("not valid JSON"));
    assert!(p.decisions.is_empty());

    let params = Params {
        default_profile: Some(ClassedProfile::new(profile(1))),
        ..Params::default()
    };
    let p = plan(NOW, &snap, &r, &mut Monitor::default(), &params);
    assert_eq!(p.refused.len(), 1, "the malformed one still is");
    assert!(matches!(p.decisions[0].outcome, Outcome::Placed(_)));
}

#[test]
fn running_jobs_are_judged_by_their_nodes_reports_and_evicted() {
    let snap = Snapshot {
        nodes: vec![open("a")],
        jobs: vec![job(
            "7",
            Phase::Running(NOW - 3_600_000),
            meta(0.8, Some(("a", &[0]))),
        )],
    };
    let mut d = doc("a", 1, 0.5, 32 * GIB);
    d.jobs.push(JobProgress {
        job: "7".into(),
        units_total: 1e6,
        last_report_unix_ms: NOW,
        rates: vec![Rate {
            window_s: 60,
            per_s: 50.0,
            covered_s: 60.0,
        }],
    });
    let params = Params {
        monitor: MonitorParams {
            window_s: 60,
            misses_to_evict: 2,
            ..MonitorParams::default()
        },
        ..Params::default()
    };
    let mut mon = Monitor::default();
    let r = reports(vec![d.clone()], 0);
    let first = plan(NOW, &snap, &r, &mut mon, &params);
    assert_eq!(first.checks[0].action, Action::Keep);
    assert_eq!(first.checks[0].share, Some(0.5));
    let r = reports(vec![d], 0);
    let second = plan(NOW + 60_000, &snap, &r, &mut mon, &params);
    // The report is 60 s old by then but within the node timeout.
    assert_eq!(second.checks[0].action, Action::Evict);
}

#[test]
fn a_job_on_a_silent_node_is_kept_and_not_judged() {
    let snap = Snapshot {
        nodes: vec![open("a")],
        jobs: vec![job("7", Phase::Running(0), meta(0.8, Some(("a", &[0]))))],
    };
    let r = reports(vec![doc("a", 1, 0.5, 32 * GIB)], 600_000);
    let p = plan(NOW, &snap, &r, &mut Monitor::default(), &Params::default());
    assert_eq!(p.checks[0].action, Action::Keep);
    assert!(p.checks[0].note.contains("no progress reports"));
    assert_eq!(p.excluded.len(), 1);
}

/// A document of 2 GPUs on which job `id` runs on GPU 0 at `per_s`.
fn running_doc(node: &str, id: &str, per_s: f64) -> NodeHarvest {
    let mut d = doc(node, 2, 0.2, 32 * GIB);
    d.jobs.push(JobProgress {
        job: id.into(),
        units_total: 1e6,
        last_report_unix_ms: NOW,
        rates: vec![Rate {
            window_s: 60,
            per_s,
            covered_s: 60.0,
        }],
    });
    d
}

/// A job running on GPU 0 of `slow` at 60 of its 100 units/s alone (the model says 80), jobs
/// on `fast` and `ref` running as predicted, and (with `held`) a held job with SLA 0.7 that
/// must avoid `fast` and `ref`; the documents arrive at `now`.
fn slow_node_snapshot(held: bool, now: u64) -> (Snapshot, HashMap<String, Report>) {
    let running = |id: &str, node: &str| {
        job(
            id,
            Phase::Running(NOW - 3_600_000),
            meta(0.3, Some((node, &[0]))),
        )
    };
    let mut jobs = vec![
        running("7", "slow"),
        running("5", "fast"),
        running("6", "ref"),
    ];
    if held {
        let mut m = meta(0.7, None);
        m.avoid = vec!["fast".into(), "ref".into()];
        jobs.push(job("8", Phase::Held, m));
    }
    let snap = Snapshot {
        nodes: vec![open("slow"), open("fast"), open("ref")],
        jobs,
    };
    let docs = vec![
        running_doc("slow", "7", 60.0),
        running_doc("fast", "5", 80.0),
        running_doc("ref", "6", 80.0),
    ];
    let mut r = reports(docs, 0);
    for rep in r.values_mut() {
        rep.received_unix_ms = now;
    }
    (snap, r)
}

#[test]
fn a_node_whose_jobs_run_slower_than_predicted_gets_a_speed_factor_after_three_windows() {
    let params = Params {
        monitor: MonitorParams {
            window_s: 60,
            ..MonitorParams::default()
        },
        ..Params::default()
    };
    let mut mon = Monitor::default();
    for k in 0..3 {
        let (snap, r) = slow_node_snapshot(false, NOW + k * 60_000);
        let p = plan(NOW + k * 60_000, &snap, &r, &mut mon, &params);
        assert_eq!(p.checks[0].share, Some(0.6));
        assert!(p.speeds.is_empty(), "not used before 3 windows: {k}");
    }
    assert!((mon.calibration.factor("slow") - 0.75).abs() < 1e-12);
    assert_eq!(mon.calibration.factor("fast"), 1.0, "as predicted");
    assert_eq!(
        mon.calibration.factor("elsewhere"),
        1.0,
        "no jobs ran there"
    );
    let (snap, r) = slow_node_snapshot(true, NOW + 180_000);
    let mut held = mon.clone();
    let p = plan(NOW + 180_000, &snap, &r, &mut held, &params);
    assert_eq!(p.speeds.len(), 1);
    assert_eq!(
        (p.speeds[0].node.as_str(), p.speeds[0].samples),
        ("slow", 3)
    );
    // 0.8 x 0.75 = 0.6 on slow falls short of 0.7 + 0.05.
    let d = p.decisions[0].to_string();
    assert!(
        matches!(p.decisions[0].outcome, Outcome::Pending(_)) && d.contains("x speed 0.75"),
        "{d}"
    );
    // The window judged this pass calibrates against the prediction without the factor.
    assert!((held.calibration.factor("slow") - 0.75).abs() < 1e-9);

    let off = Params {
        calibration: false,
        ..params
    };
    let p = plan(NOW + 180_000, &snap, &r, &mut mon.clone(), &off);
    assert!(p.speeds.is_empty());
    assert!(
        matches!(&p.decisions[0].outcome, Outcome::Placed(pl) if pl.node == "slow" && pl.prediction.speed == 1.0),
        "without calibration the model still says 0.8: {}",
        p.decisions[0]
    );
}

#[test]
fn known_speeds_take_the_place_of_learned_ones() {
    let (snap, r) = slow_node_snapshot(true, NOW);
    let params = Params {
        known_speeds: [("slow".to_string(), 1.25)].into_iter().collect(),
        ..Params::default()
    };
    let mut mon = Monitor::default();
    for _ in 0..3 {
        mon.calibration.record("slow", 10.0, 100.0, 100.0);
    }
    let p = plan(NOW, &snap, &r, &mut mon, &params);
    match &p.decisions[0].outcome {
        Outcome::Placed(pl) => assert!((pl.prediction.share - 1.0).abs() < 1e-12, "{pl:?}"),
        o => panic!("{o:?}"),
    }
}

#[test]
fn a_job_that_ran_below_its_profile_is_placed_again_at_its_learned_level() {
    let params = Params {
        monitor: MonitorParams {
            window_s: 60,
            ..MonitorParams::default()
        },
        calibration: false,
        job_calibration: true,
        ..Params::default()
    };
    let mut mon = Monitor::default();
    for k in 0..3 {
        let (snap, r) = slow_node_snapshot(false, NOW + k * 60_000);
        plan(NOW + k * 60_000, &snap, &r, &mut mon, &params);
    }
    // Job 7 made 60 where the model said 80, on a node of speed 1.
    assert_eq!(mon.job_levels.factor("7"), Some(0.75));
    assert_eq!(mon.job_levels.factor("5"), Some(1.0), "as predicted");

    // Requeued with SLA 0.7: 0.8 x 0.75 = 0.6 is short of 0.7 + 0.05 on every node.
    let (mut snap, r) = slow_node_snapshot(false, NOW + 180_000);
    snap.jobs.retain(|j| j.id != "7");
    snap.jobs.push(job("7", Phase::Held, meta(0.7, None)));
    let p = plan(NOW + 180_000, &snap, &r, &mut mon.clone(), &params);
    assert!(
        matches!(p.decisions[0].outcome, Outcome::Pending(_)),
        "{}",
        p.decisions[0]
    );
    assert_eq!(
        p.levels,
        [JobLevel {
            job: "7".into(),
            level: 0.75
        }]
    );
    let off = Params {
        job_calibration: false,
        ..params.clone()
    };
    let p = plan(NOW + 180_000, &snap, &r, &mut mon.clone(), &off);
    assert!(
        matches!(p.decisions[0].outcome, Outcome::Placed(_)),
        "without job levels the profile says 0.8: {}",
        p.decisions[0]
    );

    // Levels of jobs that left the engine are forgotten.
    snap.jobs.retain(|j| j.id != "6");
    plan(NOW + 240_000, &snap, &r, &mut mon, &params);
    assert_eq!(mon.job_levels.factor("6"), None);
    assert_eq!(mon.job_levels.factor("7"), Some(0.75));
}

/// The reason `plan` gives for pending job `id`.
fn waiting_why(p: &Plan, id: &str) -> String {
    let w = p.waiting.iter().find(|w| w.job == id);
    w.map(|w| w.why.clone())
        .unwrap_or_else(|| panic!("{id} is not waiting: {p:?}"))
}

#[test]
fn a_job_that_finds_every_open_node_full_is_told_so_with_the_count() {
    // Three one-GPU nodes, each GPU held by a running job of ours.
    let nodes = ["a", "b", "c"];
    let mut jobs: Vec<JobInfo> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            job(
                &(i + 1).to_string(),
                Phase::Running(0),
                meta(0.5, Some((n, &[0]))),
            )
        })
        .collect();
    jobs.push(job("9", Phase::Held, meta(0.5, None)));
    let snap = Snapshot {
        nodes: nodes.iter().map(|n| open(n)).collect(),
        jobs,
    };
    let r = reports(nodes.iter().map(|n| doc(n, 1, 0.0, 32 * GIB)).collect(), 0);
    let p = plan(NOW, &snap, &r, &mut Monitor::default(), &Params::default());
    assert_eq!(
        waiting_why(&p, "9"),
        "all 3 open node(s) are full: none has 1 free GPU(s)"
    );
    assert_eq!(p.waiting.len(), 1, "placed and running jobs do not wait");
}

#[test]
fn a_waiting_job_counts_full_avoided_and_closed_nodes_apart() {
    // "a" is full, "b" is free but the job was evicted from it, "c" is down.
    let mut evicted = meta(0.5, None);
    evicted.avoid = vec!["b".into()];
    let snap = Snapshot {
        nodes: vec![
            open("a"),
            open("b"),
            NodeInfo {
                name: "c".into(),
                closed: Some("down".into()),
            },
        ],
        jobs: vec![
            job("1", Phase::Running(0), meta(0.5, Some(("a", &[0])))),
            job("2", Phase::Held, evicted),
        ],
    };
    let docs = vec![doc("a", 1, 0.0, 32 * GIB), doc("b", 1, 0.0, 32 * GIB)];
    let p = plan(
        NOW,
        &snap,
        &reports(docs, 0),
        &mut Monitor::default(),
        &Params::default(),
    );
    assert_eq!(
        waiting_why(&p, "2"),
        "of 2 open node(s): 1 full (fewer than 1 free GPU(s)), 1 it was evicted from"
    );
    // With no open node at all, the job points at the exclusions.
    let closed = Snapshot {
        nodes: vec![NodeInfo {
            name: "c".into(),
            closed: Some("down".into()),
        }],
        jobs: vec![job("3", Phase::Held, meta(0.5, None))],
    };
    let p = plan(
        NOW,
        &closed,
        &HashMap::new(),
        &mut Monitor::default(),
        &Params::default(),
    );
    assert_eq!(
        waiting_why(&p, "3"),
        "no node is open to placement (1 excluded: see their reasons)"
    );
}

#[test]
fn a_silent_node_keeps_its_cause_while_its_age_grows() {
    let snap = Snapshot {
        nodes: vec![open("quiet")],
        jobs: vec![],
    };
    let r = reports(vec![doc("quiet", 1, 0.0, 32 * GIB)], 0);
    let params = Params::default();
    let later = |ms| plan(NOW + ms, &snap, &r, &mut Monitor::default(), &params).excluded;
    let (a, b) = (later(61_000), later(95_000));
    assert_ne!(a[0].why, b[0].why, "the age is in the words");
    assert_eq!(a[0].cause, b[0].cause, "but not in the cause");
    assert!(plan(NOW, &snap, &r, &mut Monitor::default(), &params)
        .excluded
        .is_empty());
}
