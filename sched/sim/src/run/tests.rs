use std::sync::Arc;

use super::*;
use crate::jobs::{classes, SLAS};

const GIB: f32 = 1.0;

fn cell(b: f32, m: f32) -> Cell {
    Cell { b, m, tr: 0.0 }
}

/// Runs `policies` over a world of one node laid out as `layout`, under `load`, with one job
/// of class `class` (SLA `sla`) arriving at minute 0, for `minutes`.
fn one_job(
    layout: Vec<(u32, bool)>,
    load: impl Fn(usize, i64) -> Cell + Send + Sync + 'static,
    class: u8,
    sla: f64,
    minutes: u32,
    policies: &[&str],
) -> Vec<(Policy, Metrics)> {
    one_job_costing(
        Costs::default(),
        layout,
        load,
        class,
        sla,
        minutes,
        policies,
    )
}

/// [`one_job`] with the ground truth's preemption costs `costs`.
fn one_job_costing(
    costs: Costs,
    layout: Vec<(u32, bool)>,
    load: impl Fn(usize, i64) -> Cell + Send + Sync + 'static,
    class: u8,
    sla: f64,
    minutes: u32,
    policies: &[&str],
) -> Vec<(Policy, Metrics)> {
    let mut rng = fastrand::Rng::with_seed(4);
    let mut cluster = Cluster::assemble(&[layout], 0.3, &mut rng);
    cluster.custom = Some(Arc::new(load));
    let sla_index = SLAS
        .iter()
        .position(|&s| s == sla)
        .expect("an SLA of the list") as u8;
    let arrivals = vec![Arrival {
        minute: 0,
        class,
        sla: sla_index,
        work_s: 100.0 * 3600.0,
        error: 0.0,
    }];
    let world = World::new(cluster, classes(), arrivals, minutes, 10).with_costs(costs);
    let mut cfg = SimConfig::small(1, minutes, policies);
    cfg.threads = 1;
    run_world(&world, &cfg).policies
}

#[test]
fn the_truth_multiplies_independent_idle_time_and_charges_reclaims() {
    let c = classes();
    let seven_b = &c[0];
    let mut held = [f32::NAN, f32::NAN];
    // Two independent series, each busy half the minute: all idle a quarter of it.
    let m = truth(
        seven_b,
        &[cell(0.5, 40.0), cell(0.5, 40.0)],
        &mut held,
        None,
        0.0,
        &Costs::default(),
    );
    assert!(
        (m.all_idle - 0.25).abs() < 1e-9 && (m.share - 0.25).abs() < 1e-9,
        "{m:?}"
    );
    assert_eq!(held, [36.0, 36.0], "it holds at most R");
    // One series (an in-step pair): idle half the minute.
    let mut one = [f32::NAN];
    let m = truth(
        seven_b,
        &[cell(0.5, 40.0)],
        &mut one,
        None,
        0.0,
        &Costs::default(),
    );
    assert!((m.share - 0.5).abs() < 1e-9);
    // Memory falls from 36 to 24 GiB: T(24) = 0.7, and the reclaim costs 0.4 x 12/36.
    let m = truth(
        seven_b,
        &[cell(0.0, 24.0)],
        &mut one,
        None,
        0.0,
        &Costs::default(),
    );
    let want = 0.7 * (1.0 - 0.4 * 12.0 / 36.0);
    assert!((m.share - want).abs() < 1e-6, "{m:?} vs {want}");
    // Below the least memory it runs with: no work, and not counted as offline busy time.
    let m = truth(
        seven_b,
        &[cell(0.0, 10.0)],
        &mut one,
        None,
        0.0,
        &Costs::default(),
    );
    assert!(!m.runs && m.share == 0.0);
    // A static split of 30 GiB: T(30) whatever the memory above it; killed below it.
    let alloc = [30.0 * GIB];
    let m = truth(
        seven_b,
        &[cell(0.2, 50.0)],
        &mut one,
        Some(&alloc),
        0.1,
        &Costs::default(),
    );
    assert!((m.share - 0.8 * 0.84 * 1.1).abs() < 1e-6, "{m:?}");
    let m = truth(
        seven_b,
        &[cell(0.2, 29.0)],
        &mut one,
        Some(&alloc),
        0.0,
        &Costs::default(),
    );
    assert!(m.killed);
    // The gate's own cost and a costly preemption, as measured on an H100.
    let measured = Costs {
        preempt_s: 0.27,
        gate_overhead: 0.1,
        profiled: false,
    };
    let busy = Cell {
        b: 0.0,
        m: 40.0,
        tr: 20.0,
    };
    let mut one = [f32::NAN];
    let m = truth(seven_b, &[busy], &mut one, None, 0.0, &measured);
    assert!(
        (m.share - (1.0 - 0.27 * 20.0 / 60.0) * 0.9).abs() < 1e-6,
        "{m:?}"
    );
}

#[test]
fn policies_parse_with_operator_settings() {
    let p = Policy::parse("valve:margin=0.1:monitor=3600", 1000).unwrap();
    assert_eq!(p.kind, PolicyKind::Valve);
    assert_eq!(p.params.place.margin, 0.1);
    assert_eq!(p.params.monitor.window_s, 3600);
    assert_eq!(
        p.params.monitor.max_evictions_per_min, 100,
        "1 per 10 nodes"
    );
    assert_eq!(
        p.params.monitor.misses_to_evict, 2,
        "the scheduler's default"
    );
    let idle = Policy::parse("idle-only", 5).unwrap();
    assert_eq!(idle.params.place.model.memory, MemoryModel::Ignore);
    assert!(!idle.params.place.model.alignment);
    assert_eq!(idle.params.monitor.max_evictions_per_min, 1);
    assert_eq!(
        Policy::parse("static", 5)
            .unwrap()
            .params
            .place
            .model
            .memory,
        MemoryModel::StaticMin
    );
    assert!(Policy::parse("best", 5)
        .unwrap_err()
        .contains("unknown policy"));
    assert!(Policy::parse("valve:monitor=120", 5)
        .unwrap_err()
        .contains("60, 600 or 3600"));
    assert!(Policy::parse("valve:speed=2", 5).is_err());
    let exact = Policy::parse("valve:pass=exact", 5).unwrap();
    assert_eq!(
        exact.params.place.pass,
        valve_scheduler::place::PassKind::Exact
    );
    assert!(Policy::parse("valve:pass=quick", 5)
        .unwrap_err()
        .contains("fast (the default), exact or reference"));
}

#[test]
fn online_only_runs_no_offline_work() {
    let cfg = SimConfig::small(3, 120, &["online-only", "valve"]);
    let r = crate::simulate(&cfg, "test", "given");
    let online = &r.policies[0];
    assert_eq!(online.offline_busy, 0.0);
    assert_eq!(online.harvested_gpu_h, 0.0);
    assert_eq!(online.counts.placements, 0);
    assert!(online.online_busy > 0.05 && online.online_busy < 0.8);
    assert!(r.policies[1].counts.placements > 0, "valve does place jobs");
    assert_eq!(
        r.policies[1].online_busy, online.online_busy,
        "one online load"
    );
}

#[test]
fn the_same_seed_gives_the_same_results_and_no_gpu_is_overbooked() {
    let all = [
        "online-only",
        "idle-only",
        "random",
        "static",
        "valve",
        "oracle",
    ];
    let run = || {
        let cfg = SimConfig::small(4, 240, &all);
        crate::simulate(&cfg, "test", "given")
    };
    let (a, b) = (run(), run());
    for (x, y) in a.policies.iter().zip(&b.policies) {
        assert_eq!(
            serde_json::to_string(&x.counts).unwrap(),
            serde_json::to_string(&y.counts).unwrap(),
            "{}",
            x.name
        );
        assert_eq!(x.counts.pred, y.counts.pred);
        assert_eq!(x.counts.conflicts, 0, "{}: a GPU given twice", x.name);
        assert!(
            x.counts.max_gpu_utilisation <= 1.0 + 1e-6,
            "{}: a GPU busier than 1: {}",
            x.name,
            x.counts.max_gpu_utilisation
        );
        assert!(x.utilisation <= 1.0);
        assert!(x.counts.placements >= x.counts.first_starts);
    }
    let placed: u64 = a.policies.iter().map(|p| p.counts.placements).sum();
    assert!(placed > 0, "jobs ran");
    let mut other = SimConfig::small(4, 240, &["random"]);
    other.seed = 2;
    let c = crate::simulate(&other, "test", "given");
    assert_ne!(
        c.policies[0].counts.arrived, a.policies[2].counts.arrived,
        "another seed, other arrivals"
    );
}

/// Two out-of-step ranks that take turns: each busy 30% of the time, never together.
fn taking_turns(s: usize, minute: i64) -> Cell {
    let b = if (minute + s as i64) % 2 == 0 {
        0.6
    } else {
        0.0
    };
    cell(b, 60.0)
}

#[test]
fn a_profiled_preemption_cost_keeps_valve_off_a_gpu_that_flips_often() {
    // Busy a fifth of each minute in 30 short bursts: 0.8 idle, but at 1 s lost per preemption
    // half of each minute goes to interruptions.
    let flipping = |_: usize, _: i64| Cell {
        b: 0.2,
        m: 40.0,
        tr: 30.0,
    };
    let costs = Costs {
        preempt_s: 1.0,
        gate_overhead: 0.0,
        profiled: false,
    };
    let blind = one_job_costing(costs, vec![(1, true)], flipping, 0, 0.7, 20, &["valve"]);
    assert_eq!(blind[0].1.placements, 1, "the model does not know the cost");
    let profiled = Costs {
        profiled: true,
        ..costs
    };
    let r = one_job_costing(profiled, vec![(1, true)], flipping, 0, 0.7, 20, &["valve"]);
    assert_eq!(
        r[0].1.placements, 0,
        "0.8 idle - 0.5 interrupted is below 0.7"
    );
}

#[test]
fn idle_only_places_a_two_gpu_job_on_an_out_of_step_pair_where_valve_does_not() {
    let r = one_job(
        vec![(2, false)],
        taking_turns,
        3,
        0.5,
        20,
        &["idle-only", "valve"],
    );
    let (idle, valve) = (&r[0].1, &r[1].1);
    assert_eq!(idle.placements, 1);
    assert_eq!(idle.placements_out_of_step, 1);
    assert_eq!(valve.placements, 0, "alignment admission refuses the pair");
    assert_eq!(valve.pending_below_sla_last, 1);
    // In step, the same load on one series: Valve places it too.
    let r = one_job(vec![(2, true)], taking_turns, 3, 0.5, 20, &["valve"]);
    assert_eq!(r[0].1.placements, 1);
}

#[test]
fn an_out_of_step_job_misses_its_sla_and_is_evicted() {
    // Idle-only predicts 0.7 (each GPU idle 70%), but both are idle together only 40% of the
    // time: a 0.5 SLA is missed every window, and the monitor evicts after three.
    let r = one_job(vec![(2, false)], taking_turns, 3, 0.5, 150, &["idle-only"]);
    let m = &r[0].1;
    assert!(m.evictions >= 1, "{m:?}");
    assert_eq!(
        m.pending_end, 1,
        "requeued, and the only node is to be avoided"
    );
}

#[test]
fn a_static_split_job_is_killed_when_online_takes_its_memory() {
    // 40 GiB left to offline, until online needs all but 10 GiB at minute 100.
    let dip = |_s: usize, minute: i64| {
        cell(
            0.1,
            if (100..103).contains(&minute) {
                10.0
            } else {
                40.0
            },
        )
    };
    let r = one_job(vec![(1, true)], dip, 0, 0.3, 130, &["static", "valve"]);
    let (st, valve) = (&r[0].1, &r[1].1);
    assert_eq!(st.placements, 1);
    assert_eq!(st.kills, 1, "{st:?}");
    assert!(st.lost_gpu_h > 0.0, "the last 10 minutes are lost");
    assert_eq!(st.pending_end, 1);
    assert_eq!(valve.kills, 0, "Valve's job is reclaimed, not killed");
    assert_eq!(valve.running_end, 1);
}

#[test]
fn the_oracle_places_by_the_hour_to_come() {
    // Plenty of memory until minute 20, then online needs almost all of it.
    let cliff = |_s: usize, minute: i64| cell(0.1, if minute < 20 { 40.0 } else { 12.0 });
    let r = one_job(vec![(1, true)], cliff, 0, 0.5, 10, &["valve", "oracle"]);
    assert_eq!(r[0].1.placements, 1, "the past hour looked fine");
    assert_eq!(r[1].1.placements, 0, "the next hour will not be");
}

#[test]
fn valve_learns_a_slow_nodes_speed_and_the_oracle_knows_it() {
    let mut rng = fastrand::Rng::with_seed(4);
    let mut cluster = Cluster::assemble(
        &[vec![(1, true)], vec![(1, true)], vec![(1, true)]],
        0.3,
        &mut rng,
    );
    cluster.custom = Some(Arc::new(|_s: usize, _m: i64| cell(0.0, 40.0)));
    let job = Arrival {
        minute: 0,
        class: 0,
        sla: 0,
        work_s: 100.0 * 3600.0,
        error: 0.0,
    };
    let minutes = 120;
    let mut world = World::new(cluster, classes(), vec![job; 3], minutes, 10);
    world.node_speed = vec![0.6, 1.0, 1.0];
    let mut cfg = SimConfig::small(3, minutes, &["valve", "valve:calibrate=0", "oracle"]);
    cfg.threads = 1;
    let r = run_world(&world, &cfg).policies;
    let learned = r[0].1.speeds.as_ref().expect("valve learns speeds");
    assert_eq!((learned.nodes, learned.calibrated), (3, 3), "{learned:?}");
    assert!(learned.mean_abs_err < 0.01, "{learned:?}");
    assert!((learned.mean_abs_err_uncalibrated - 0.4 / 3.0).abs() < 1e-12);
    assert!(r[1].1.speeds.is_none(), "calibration off");
    // The first hour of the job on the slow node: the oracle knew it runs at 0.6, Valve did
    // not yet.
    let on_slow = |m: &Metrics| {
        m.pred
            .iter()
            .find(|&&(_, t)| (t - 0.6).abs() < 1e-6)
            .map(|&(p, _)| p)
    };
    assert_eq!(on_slow(&r[1].1), Some(1.0));
    assert!(
        (on_slow(&r[2].1).unwrap() - 0.6).abs() < 1e-6,
        "{:?}",
        r[2].1.pred
    );
}

#[test]
fn node_speeds_are_one_without_spread_and_clamped_and_repeatable_with_it() {
    assert!(crate::cluster::node_speeds(50, 0.0, 7)
        .iter()
        .all(|&s| s == 1.0));
    let a = crate::cluster::node_speeds(500, 0.5, 7);
    assert_eq!(a, crate::cluster::node_speeds(500, 0.5, 7));
    assert!(a.iter().all(|&s| (0.5..=1.5).contains(&s)));
    assert!(
        a.contains(&0.5) && a.contains(&1.5),
        "a wide spread is clamped"
    );
    assert_ne!(a, crate::cluster::node_speeds(500, 0.5, 8));
}

#[test]
fn the_oracle_knows_a_jobs_level_and_leaves_a_job_that_would_miss_waiting() {
    // An idle node with memory to spare; the job truly runs at 0.4 of its profile, SLA 0.5.
    let mut rng = fastrand::Rng::with_seed(4);
    let mut cluster = Cluster::assemble(&[vec![(1, true)]], 0.3, &mut rng);
    cluster.custom = Some(Arc::new(|_s: usize, _m: i64| cell(0.0, 40.0)));
    let sla = SLAS.iter().position(|&s| s == 0.5).unwrap() as u8;
    let job = Arrival {
        minute: 0,
        class: 0,
        sla,
        work_s: 100.0 * 3600.0,
        error: -0.6,
    };
    let minutes = 180;
    let world = World::new(cluster, classes(), vec![job], minutes, 10);
    let mut cfg = SimConfig::small(1, minutes, &["valve", "oracle"]);
    cfg.threads = 1;
    let r = run_world(&world, &cfg).policies;
    let (valve, oracle) = (&r[0].1, &r[1].1);
    assert!(valve.placements >= 1 && valve.evictions >= 1, "{valve:?}");
    assert!(
        valve.harvested_gpu_h > 0.0,
        "its runs' work counts as harvest"
    );
    assert_eq!(valve.harvested_met_gpu_h, 0.0, "none of it within SLA");
    assert_eq!(oracle.placements, 0, "the oracle knows it would miss");
    assert_eq!(oracle.harvested_gpu_h, 0.0);
}

/// `r` as JSON without what depends on the machine (wall and pass times) or on `cfg`'s drift
/// correlation time.
fn comparable(r: &crate::report::Results) -> serde_json::Value {
    let mut v = serde_json::to_value(r).unwrap();
    v["wall_s"] = serde_json::Value::Null;
    v["shared_s"] = serde_json::Value::Null;
    v["config"]["level_drift_minutes"] = serde_json::Value::Null;
    for p in v["policies"].as_array_mut().unwrap() {
        p["pass_ms_median"] = serde_json::Value::Null;
        p["pass_ms_max"] = serde_json::Value::Null;
        p["pass_s_total"] = serde_json::Value::Null;
        p["work_s"] = serde_json::Value::Null;
        p["work_cpu_s"] = serde_json::Value::Null;
        p["pass_cpu_s_total"] = serde_json::Value::Null;
    }
    v
}

#[test]
fn level_drift_is_recorded_and_changes_nothing_when_off() {
    let base = SimConfig::small(3, 600, &["valve"]);
    let plain = crate::simulate(&base, "test", "given");
    assert_eq!(plain.config.level_drift_sd, 0.0);
    assert_eq!(plain.config.level_drift_minutes, 10.0);
    assert!(plain.policies[0].counts.job_hours > 0, "jobs ran");
    let off = SimConfig {
        level_drift_minutes: 30.0,
        ..base.clone()
    };
    let off = crate::simulate(&off, "test", "given");
    assert_eq!(comparable(&off), comparable(&plain), "sd 0 changes nothing");
    assert!(!crate::report::render(&off).contains("drifts"));
    let on = SimConfig {
        level_drift_sd: 0.1,
        level_drift_minutes: 5.0,
        ..base
    };
    let (a, b) = (
        crate::simulate(&on, "test", "given"),
        crate::simulate(&on, "test", "given"),
    );
    assert_eq!(comparable(&a), comparable(&b), "repeatable");
    assert_eq!(
        (a.config.level_drift_sd, a.config.level_drift_minutes),
        (0.1, 5.0)
    );
    assert!(a.assumptions.iter().any(|s| s.contains("drifts")));
    assert!(crate::report::render(&a).contains("sd 0.1, correlation time 5 min"));
    let (pa, pp) = (&a.policies[0], &plain.policies[0]);
    assert_eq!(pa.counts.arrived, pp.counts.arrived, "the same arrivals");
    assert_ne!(
        pa.harvested_gpu_h, pp.harvested_gpu_h,
        "the drift moved the truth"
    );
}

#[test]
fn a_runs_drift_moves_its_minutes_around_its_static_level() {
    // One job alone on an idle node with all the memory it needs: every minute's share is its
    // level, 1 + error without drift.
    let mut rng = fastrand::Rng::with_seed(4);
    let mut cluster = Cluster::assemble(&[vec![(1, true)]], 0.3, &mut rng);
    cluster.custom = Some(Arc::new(|_s: usize, _m: i64| cell(0.0, 60.0)));
    let job = Arrival {
        minute: 0,
        class: 0,
        sla: 0,
        work_s: 100.0 * 3600.0,
        error: -0.2,
    };
    let minutes = 600;
    let run = |sd: f64| {
        let world = World::new(cluster.clone(), classes(), vec![job], minutes, 10)
            .with_level_drift(LevelDrift::new(sd, 10.0), 9);
        let mut cfg = SimConfig::small(1, minutes, &["oracle"]);
        cfg.threads = 1;
        run_world(&world, &cfg).policies.remove(0).1
    };
    let still = run(0.0);
    let hours = still.job_hours as f64;
    assert!(hours >= 9.0, "{still:?}");
    assert!((still.harvested_gpu_h - 0.8 * (minutes - 1) as f64 / 60.0).abs() < 1e-9);
    let moving = run(0.1);
    assert_eq!(
        moving.placements, 1,
        "the oracle placed it on its static level"
    );
    let mean = moving.harvested_gpu_h / ((minutes - 1) as f64 / 60.0);
    assert!(
        (mean - 0.8).abs() < 0.05 && mean != 0.8,
        "drift averages out: {mean}"
    );
}
