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
