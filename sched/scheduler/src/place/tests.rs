use std::sync::Arc;

use super::*;
use crate::job::tests::{profile, GIB};
use crate::predict::tests::gpu;

fn job(id: &str, gpus: u32, sla: f64, order: u64) -> PendingJob {
    PendingJob {
        id: id.into(),
        profile: Arc::new(profile(gpus)),
        class: u64::from(gpus),
        sla,
        avoid: vec![],
        order,
    }
}

/// A node of `busy.len()` GPUs with 32 GiB left to offline each (memory factor 1).
fn node(name: &str, busy: &[f64], score: f64) -> NodeSlot {
    let gpus = busy
        .iter()
        .enumerate()
        .map(|(i, &b)| gpu(i as u32, b, 32 * GIB))
        .collect();
    NodeSlot {
        model: NodeModel::uniform(name, gpus, score, 600),
        free: vec![true; busy.len()],
    }
}

fn placed(d: &Decision) -> Option<(&str, &[u32])> {
    match &d.outcome {
        Outcome::Placed(p) => Some((&p.node, &p.gpus)),
        Outcome::Pending(_) => None,
    }
}

#[test]
fn a_job_goes_to_the_idlest_gpu_that_meets_its_sla() {
    let mut nodes = vec![node("a", &[0.5, 0.3], 1.0), node("b", &[0.1, 0.6], 1.0)];
    let d = place(&[job("1", 1, 0.8, 0)], &mut nodes, &PlaceParams::default());
    assert_eq!(placed(&d[0]), Some(("b", &[0][..])));
    assert!(!nodes[1].free[0] && nodes[1].free[1], "its GPU is taken");
    assert!(d[0]
        .to_string()
        .contains("placed on b GPUs [0]: predicted 0.90 of alone"));
}

#[test]
fn a_job_no_gpu_can_serve_stays_pending_with_the_best_it_could_get() {
    let mut nodes = vec![node("a", &[0.5], 1.0), node("b", &[0.3], 1.0)];
    let d = place(&[job("1", 1, 0.7, 0)], &mut nodes, &PlaceParams::default());
    match &d[0].outcome {
        Outcome::Pending(Pending::BelowSla { needed, best }) => {
            assert!((needed - 0.75).abs() < 1e-12, "SLA + margin");
            assert_eq!(best.node, "b");
            assert!((best.prediction.share - 0.7).abs() < 1e-12);
        }
        o => panic!("{o:?}"),
    }
    assert!(
        nodes.iter().all(|n| n.free.iter().all(|&f| f)),
        "nothing taken"
    );
    assert!(d[0].to_string().contains("needs 0.75 of alone"));
}

#[test]
fn demanding_jobs_choose_first_and_easy_ones_take_what_is_left() {
    // One good GPU and one poor one: the 0.85 job needs the good one, the 0.3 job fits either.
    let mut nodes = vec![node("a", &[0.05, 0.6], 1.0)];
    let jobs = [job("easy", 1, 0.3, 0), job("hard", 1, 0.85, 1)];
    let d = place(&jobs, &mut nodes, &PlaceParams::default());
    assert_eq!(d[0].job, "hard", "hardest first");
    assert_eq!(placed(&d[0]), Some(("a", &[0][..])));
    assert_eq!(placed(&d[1]), Some(("a", &[1][..])));
}

#[test]
fn multi_gpu_jobs_take_an_aligned_set_or_wait() {
    // GPU 0 runs out of step with GPUs 1 and 2.
    let mut a = node("a", &[0.1, 0.1, 0.1, 0.1], 0.9);
    a.model.set_pair(0, 1, 0.3, 0.2);
    a.model.set_pair(0, 2, 0.3, 0.2);
    let mut nodes = vec![a.clone()];
    let d = place(
        &[job("tp3", 3, 0.5, 0)],
        &mut nodes,
        &PlaceParams::default(),
    );
    assert_eq!(
        placed(&d[0]),
        Some(("a", &[1, 2, 3][..])),
        "the only aligned triple"
    );

    let mut nodes = vec![a];
    let d = place(
        &[job("tp2", 2, 0.8, 0), job("tp3", 3, 0.5, 1)],
        &mut nodes,
        &PlaceParams::default(),
    );
    assert_eq!(
        placed(&d[0]),
        Some(("a", &[0, 3][..])),
        "first aligned pair"
    );
    assert_eq!(
        d[1].outcome,
        Outcome::Pending(Pending::NoFreeGpus { gpus: 3, nodes: 0 })
    );

    let mut b = node("b", &[0.1, 0.1], 0.9);
    b.model.set_pair(0, 1, 0.3, 0.2);
    let d = place(&[job("tp2", 2, 0.5, 0)], &mut [b], &PlaceParams::default());
    match &d[0].outcome {
        Outcome::Pending(Pending::BelowSla { best, .. }) => {
            assert!(!best.prediction.aligned);
            assert_eq!(best.prediction.share, 0.0);
        }
        o => panic!("a misaligned pair is not admitted: {o:?}"),
    }
}

#[test]
fn evicted_jobs_avoid_the_node_they_left() {
    let mut nodes = vec![node("a", &[0.0], 1.0), node("b", &[0.1], 1.0)];
    let mut j = job("1", 1, 0.5, 0);
    j.avoid = vec!["a".into()];
    let d = place(&[j], &mut nodes, &PlaceParams::default());
    assert_eq!(placed(&d[0]), Some(("b", &[0][..])));
}

#[test]
fn an_avoided_name_rules_out_every_node_of_that_name_and_unknown_names_nothing() {
    for pass in ["fast", "exact", "reference"] {
        let params = PlaceParams {
            pass: PassKind::parse(pass).unwrap(),
            ..PlaceParams::default()
        };
        // Two nodes called "a" (names are not checked to differ), the idlest ones.
        let mut nodes = vec![
            node("a", &[0.0], 1.0),
            node("b", &[0.2], 1.0),
            node("a", &[0.1], 1.0),
        ];
        let mut j = job("1", 1, 0.5, 0);
        j.avoid = vec!["a".into(), "gone".into()];
        let d = place(&[j], &mut nodes, &params);
        assert_eq!(placed(&d[0]), Some(("b", &[0][..])), "{pass}");
        // With unique names, the avoided one is found by name among many.
        let mut nodes: Vec<NodeSlot> = (0..50)
            .map(|n| node(&format!("n{n}"), &[f64::from(n) / 100.0], 1.0))
            .collect();
        let mut j = job("2", 1, 0.5, 0);
        j.avoid = vec!["n0".into(), "n1".into()];
        let d = place(&[j], &mut nodes, &params);
        assert_eq!(placed(&d[0]), Some(("n2", &[0][..])), "{pass}");
    }
}

#[test]
fn full_nodes_leave_jobs_pending_and_equal_jobs_share_the_answer() {
    let mut nodes = vec![node("a", &[0.0], 1.0)];
    let jobs: Vec<_> = (0..3).map(|i| job(&i.to_string(), 1, 0.5, i)).collect();
    let d = place(&jobs, &mut nodes, &PlaceParams::default());
    assert_eq!(placed(&d[0]), Some(("a", &[0][..])));
    for x in &d[1..] {
        assert_eq!(
            x.outcome,
            Outcome::Pending(Pending::NoFreeGpus { gpus: 1, nodes: 0 })
        );
    }
}

#[test]
fn large_free_sets_are_chosen_greedily_but_still_aligned() {
    let mut a = node("a", &[0.1; 8], 0.9);
    a.model.set_pair(0, 1, 0.1, 0.2);
    let params = PlaceParams {
        max_combinations: 1,
        ..PlaceParams::default()
    };
    let mut nodes = vec![a];
    let d = place(&[job("1", 2, 0.5, 0)], &mut nodes, &params);
    let (_, gpus) = placed(&d[0]).unwrap();
    assert_eq!(gpus.len(), 2);
    assert_ne!(gpus, [0, 1]);
}

/// A random small cluster and queue, with settings drawn to reach every path of the pass:
/// repeated and many (> 16) profile classes, SLAs no GPU meets, evicted jobs, multi-GPU jobs on
/// out-of-step pairs, a binding combination budget, interruptions, node speeds, every memory model.
fn random_instance(seed: u64) -> (Vec<PendingJob>, Vec<NodeSlot>, PlaceParams) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let shape = [1, 2, 4, 8, 8, 16][rng.usize(0..6)];
    let nodes: Vec<NodeSlot> = (0..rng.usize(1..25))
        .map(|n| random_node(&mut rng, &format!("n{n}"), shape))
        .collect();
    let profiles: Vec<Arc<crate::job::JobProfile>> = (0..[1, 3, 40][rng.usize(0..3)])
        .map(|_| Arc::new(random_profile(&mut rng)))
        .collect();
    let jobs = (0..rng.usize(1..60))
        .map(|j| {
            let class = rng.usize(0..profiles.len());
            PendingJob {
                id: j.to_string(),
                profile: profiles[class].clone(),
                class: class as u64,
                sla: [0.2, 0.4, 0.5, 0.7, 0.9][rng.usize(0..5)],
                avoid: match rng.u8(0..8) {
                    0 => vec![format!("n{}", rng.usize(0..nodes.len()))],
                    _ => vec![],
                },
                order: rng.u64(0..1000),
            }
        })
        .collect();
    let mut params = PlaceParams {
        margin: [0.0, 0.05, 0.1][rng.usize(0..3)],
        max_combinations: [256, 256, 1, 5][rng.usize(0..4)],
        pass: PassKind::Exact,
        ..PlaceParams::default()
    };
    params.model.memory = [
        MemoryModel::Trace,
        MemoryModel::Trace,
        MemoryModel::Ignore,
        MemoryModel::StaticMin,
    ][rng.usize(0..4)];
    params.model.alignment = rng.u8(0..4) > 0;
    params.model.interruptions = rng.bool();
    (jobs, nodes, params)
}

pub(super) fn random_node(rng: &mut fastrand::Rng, name: &str, gpus: usize) -> NodeSlot {
    let gpu = |i: usize, rng: &mut fastrand::Rng| {
        let base = rng.u64(1..64) * GIB;
        let mut q: Vec<u64> = (0..21)
            .map(|_| match rng.u8(0..4) {
                0 => base,
                _ => base - rng.u64(0..base),
            })
            .collect();
        q.sort_unstable();
        match rng.u8(0..30) {
            0 => q.reverse(), // not ascending: never bounded
            1 => q.truncate(1),
            _ => {}
        }
        let busy = match rng.u8(0..50) {
            0 => 1.2, // not from a document, but a model may say so
            _ => [0.0, 0.05, 1.0, rng.f64(), rng.f64() * 0.5][rng.usize(0..5)],
        };
        let mut g = gpu(i as u32, busy, 0);
        g.memory_quantiles = q;
        if rng.u8(0..4) == 0 {
            g.preemptions_per_s = rng.f64();
            g.reclaimed_gib_per_s = rng.f64() * 0.2;
            g.reclaim_episodes_per_s = rng.f64() * 0.1;
        }
        g
    };
    let gs: Vec<_> = (0..gpus).map(|i| gpu(i, rng)).collect();
    let mut model = NodeModel::uniform(name, gs, 0.9, 600);
    for a in 0..gpus {
        for b in a + 1..gpus {
            if rng.u8(0..3) == 0 {
                model.set_pair(a, b, rng.f64(), rng.f64());
            }
        }
    }
    let speed = [1.0, 1.0, 0.0, -1.0, 0.7 + rng.f64() * 0.6][rng.usize(0..5)];
    NodeSlot {
        model: model.with_speed(speed),
        free: (0..gpus).map(|_| rng.u8(0..5) > 0).collect(),
    }
}

pub(super) fn random_profile(rng: &mut fastrand::Rng) -> crate::job::JobProfile {
    let mut p = profile([1, 1, 2, 3, 4][rng.usize(0..5)]);
    let mut m = 0;
    p.curve = (0..rng.usize(1..5))
        .map(|_| {
            m += rng.u64(1..16) * GIB;
            crate::job::CurvePoint {
                memory_bytes: m,
                per_s: rng.f64() * 110.0,
            }
        })
        .collect();
    p.deficit_penalty = [0.0, 0.3, 1.0][rng.usize(0..3)];
    p.costs.preemption_s = [0.0, 0.0, 0.1][rng.usize(0..3)];
    p.costs.reclaim_s_per_gib = [0.0, 0.5][rng.usize(0..2)];
    // Measured profiles keep part of the held time (`profiling::preemption_costs`).
    p.costs.held_overlap = [0.0, 0.0, 0.3, 1.0][rng.usize(0..4)];
    p
}

#[test]
fn the_pass_decides_as_the_reference_pass_on_random_instances() {
    let (mut placed, mut below, mut none) = (0, 0, 0);
    for seed in 0..400 {
        let (jobs, nodes, params) = random_instance(seed);
        let (mut a, mut b) = (nodes.clone(), nodes);
        let got = place(&jobs, &mut a, &params);
        let want = super::reference::place(&jobs, &mut b, &params);
        assert_eq!(got, want, "seed {seed}");
        let free = |n: &[NodeSlot]| n.iter().map(|s| s.free.clone()).collect::<Vec<_>>();
        assert_eq!(free(&a), free(&b), "seed {seed}");
        for d in &got {
            match d.outcome {
                Outcome::Placed(_) => placed += 1,
                Outcome::Pending(Pending::BelowSla { .. }) => below += 1,
                Outcome::Pending(Pending::NoFreeGpus { .. }) => none += 1,
            }
        }
    }
    // The instances reach every outcome, many times.
    assert!(
        placed > 1000 && below > 1000 && none > 100,
        "{placed} {below} {none}"
    );
}

/// The benchmark's own cluster and queue (`valve-scheduler bench-pass`), at full size: slow in a
/// debug build, so run it with `cargo test --release -- --ignored`.
#[test]
#[ignore]
fn the_pass_decides_as_the_reference_pass_on_the_benchmarks_queue() {
    for classes in [1, 100, 10_000] {
        let mut rng = fastrand::Rng::with_seed(1);
        let params = PlaceParams {
            pass: PassKind::Exact,
            ..PlaceParams::default()
        };
        let nodes: Vec<NodeSlot> = (0..1000)
            .map(|n| {
                let doc = crate::bench::random_doc(&mut rng, &format!("node{n:05}"), 8, 0);
                let model = NodeModel::from_doc(&doc, &params.model);
                let free = vec![true; model.gpus.len()];
                NodeSlot { model, free }
            })
            .collect();
        let profiles: Vec<_> = (0..classes)
            .map(|c| Arc::new(crate::bench::class_profile(c)))
            .collect();
        let jobs: Vec<PendingJob> = (0..10_000)
            .map(|j| {
                let class = rng.usize(0..classes);
                PendingJob {
                    id: j.to_string(),
                    profile: profiles[class].clone(),
                    class: class as u64,
                    sla: [0.3, 0.5, 0.6, 0.7][j % 4],
                    avoid: vec![],
                    order: j as u64,
                }
            })
            .collect();
        let (mut a, mut b) = (nodes.clone(), nodes);
        let got = place(&jobs, &mut a, &params);
        assert_eq!(
            got,
            super::reference::place(&jobs, &mut b, &params),
            "{classes} classes"
        );
    }
}

/// The best share `job` can be predicted anywhere on `nodes`, by brute force over every free
/// aligned set of every node it does not avoid (0 where none).
fn best_anywhere(job: &PendingJob, nodes: &[NodeSlot], params: &PlaceParams) -> f64 {
    let k = job.profile.gpus as usize;
    let mut best: f64 = 0.0;
    for slot in nodes {
        if job.avoid.contains(&slot.model.name) {
            continue;
        }
        let free: Vec<usize> = (0..slot.free.len()).filter(|&p| slot.free[p]).collect();
        let n = free.len();
        for m in 0u32..1 << n {
            if m.count_ones() as usize != k {
                continue;
            }
            let set: Vec<usize> = (0..n)
                .filter(|i| m & (1 << i) != 0)
                .map(|i| free[i])
                .collect();
            let p = crate::predict::predict(&job.profile, &slot.model, &set, &params.model);
            if p.aligned && p.share > best {
                best = p.share;
            }
        }
    }
    best
}

/// One job at a time on random instances with held overlap (nothing lost to interruptions, so
/// that a set's share is its idle time and overlap x memory x speed, which both passes rank GPUs
/// by): wherever some set meets the SLA, both passes place the job at the best share over every
/// set of the cluster. A bound that takes the overlap to be 0 stops before a node whose held
/// time the job keeps.
#[test]
fn one_job_goes_to_the_best_set_of_the_cluster_with_held_overlap() {
    let (mut checked, mut overlapped) = (0, 0);
    for seed in 0..1000 {
        let (jobs, nodes, mut params) = random_instance(seed);
        params.max_combinations = 1 << 20;
        params.model.interruptions = seed % 4 != 0;
        let mut job = order_jobs(&jobs)[0].clone();
        let mut p = (*job.profile).clone();
        p.costs.preemption_s = 0.0;
        p.costs.reclaim_s_per_gib = 0.0;
        if seed % 2 == 0 {
            p.costs.held_overlap = [0.3, 1.0, 0.7][(seed / 2 % 3) as usize];
        }
        overlapped += usize::from(p.costs.held_overlap > 0.0 && params.model.interruptions);
        job.profile = Arc::new(p);
        let jobs = [job];
        let want = best_anywhere(&jobs[0], &nodes, &params);
        if want < jobs[0].sla + params.margin {
            continue;
        }
        for pass in [
            PassKind::Fast(FastLimits::default()),
            PassKind::Exact,
            PassKind::Reference,
        ] {
            let params = PlaceParams { pass, ..params };
            let d = place(&jobs, &mut nodes.clone(), &params);
            let got = match &d[0].outcome {
                Outcome::Placed(p) => p.prediction.share,
                Outcome::Pending(_) => 0.0,
            };
            assert!(
                (got - want).abs() <= 1e-12,
                "seed {seed} {pass:?}: placed at {got}, the cluster's best set gets {want}"
            );
        }
        checked += 1;
    }
    assert!(checked > 100 && overlapped > 30, "{checked} {overlapped}");
}

/// A job that keeps 0.8 of its held time: on node a (idle 0.9, speed 1) it gets 0.98, on node b
/// (idle 0.5, speed 1.3) (0.5 + 0.8 x 0.5) x 1.3 = 1.17. A bound that takes the overlap to be 0
/// puts b at 0.65 and stops at a; every pass must place the job on b. With interruptions not
/// modelled there is no overlap, and a (0.9) beats b (0.65).
#[test]
fn a_job_that_keeps_its_held_time_goes_where_its_share_with_the_overlap_is_highest() {
    let mut p = profile(1);
    p.costs.held_overlap = 0.8;
    let mut one = job("1", 1, 0.5, 0);
    one.profile = Arc::new(p);
    let nodes = vec![
        node("a", &[0.1], 1.0),
        NodeSlot {
            model: node("b", &[0.5], 1.0).model.with_speed(1.3),
            free: vec![true],
        },
    ];
    for pass in [
        PassKind::Fast(FastLimits::default()),
        PassKind::Exact,
        PassKind::Reference,
    ] {
        let mut params = PlaceParams {
            pass,
            ..PlaceParams::default()
        };
        let d = place(std::slice::from_ref(&one), &mut nodes.clone(), &params);
        assert_eq!(placed(&d[0]), Some(("b", &[0][..])), "{pass:?}: {}", d[0]);
        let Outcome::Placed(at) = &d[0].outcome else {
            unreachable!()
        };
        assert!(
            (at.prediction.share - 1.17).abs() < 1e-12,
            "{pass:?}: {}",
            d[0]
        );
        params.model.interruptions = false;
        let d = place(std::slice::from_ref(&one), &mut nodes.clone(), &params);
        assert_eq!(placed(&d[0]), Some(("a", &[0][..])), "{pass:?}: {}", d[0]);
    }
}
