use super::*;
use crate::job::tests::profile;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/slurm-22.05");

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{name}")).unwrap()
}

#[test]
fn squeue_fixtures_parse_into_phases() {
    let jobs = parse_squeue(&fixture("squeue-held-running-requeued.json")).unwrap();
    let by_id: HashMap<u64, &SqueueJob> = jobs.iter().map(|j| (j.job_id, j)).collect();
    assert_eq!(phase(by_id[&1]), Some(Phase::Held));
    assert_eq!(by_id[&2].nodes, "gpu003");
    assert_eq!(
        phase(by_id[&2]),
        Some(Phase::Running(by_id[&2].start_time * 1000))
    );
    assert_eq!(phase(by_id[&3]), Some(Phase::Held), "requeued held");
    assert_eq!(by_id[&3].restart_cnt, 1);
    assert!(by_id[&4].comment.is_empty(), "not ours");

    let full = parse_squeue(&fixture("squeue-gpu-full-pending-resources.json")).unwrap();
    assert!(full
        .iter()
        .any(|j| j.state_reason == "Resources" && phase(j) == Some(Phase::Released)));
}

#[test]
fn only_jobs_with_a_valve_comment_are_ours_and_bad_ones_carry_their_error() {
    let jobs = parse_squeue(&fixture("squeue-held-running-requeued.json")).unwrap();
    let ours = our_jobs(&jobs);
    // The fixture's comments are Valve-prefixed but have no profile: valid metadata.
    assert_eq!(ours.len(), 3, "job 4 has no comment");
    assert!(ours.iter().all(|j| j.meta.is_ok()));
    let mut odd = jobs[0].clone();
    odd.comment = "valve:{\"sla\":7}".into();
    let ours = our_jobs(&[odd]);
    assert!(ours[0]
        .meta
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("(0, 1]"));
}

#[test]
fn a_controller_that_is_down_is_an_error_not_an_empty_cluster() {
    let e = parse_squeue(&fixture("squeue-controller-down.json")).unwrap_err();
    assert!(e.is_unreachable(), "{e}");
    assert!(
        e.to_string().contains("`squeue --json` reported: Failed while looking for jobs, Unspecified error, errno -1, in slurm_load_jobs"),
        "{e}"
    );
    assert!(matches!(
        parse_squeue("{not json").unwrap_err(),
        SlurmError::Output { .. }
    ));
}

#[test]
fn drained_down_and_failing_nodes_are_closed_with_their_reason() {
    let nodes = parse_sinfo(&fixture("sinfo-8-nodes-drained-down.json")).unwrap();
    let closed: HashMap<&str, Option<String>> = nodes
        .iter()
        .map(|n| (n.name.as_str(), node_closed(n)))
        .collect();
    assert_eq!(closed["gpu001"], None);
    assert_eq!(closed["gpu003"], None, "mixed: running jobs, still open");
    assert!(closed["gpu006"].as_deref().unwrap().contains("drain"));
    assert!(closed["gpu007"].as_deref().unwrap().contains("drained"));
    assert!(closed["gpu008"].as_deref().unwrap().starts_with("down"));
}

#[test]
fn metadata_over_the_comment_limit_is_refused_before_slurm_sees_it() {
    let mut p = profile(1);
    p.name = "x".repeat(COMMENT_LIMIT);
    let meta = JobMeta {
        sla: 0.5,
        profile: Some(p),
        placed: None,
        avoid: vec![],
        evictions: 0,
    };
    let e = checked_comment(&meta).unwrap_err();
    assert!(e.to_string().contains("1024-byte"), "{e}");
    let small = JobMeta {
        profile: Some(profile(1)),
        ..meta
    };
    assert!(checked_comment(&small).unwrap().len() < COMMENT_LIMIT);
}

#[test]
fn a_missing_slurm_binary_is_named() {
    let s = Slurm {
        conf: None,
        bin_dir: Some("/nonexistent/slurm/bin".into()),
    };
    let e = s.snapshot().unwrap_err();
    assert!(
        e.is_unreachable(),
        "retried later, like a controller that is down: {e}"
    );
    assert!(e.to_string().contains("scripts/setup-debian.sh"), "{e}");
}

fn output(code: i32, stdout: &str, stderr: &str) -> std::process::Output {
    use std::os::unix::process::ExitStatusExt;
    std::process::Output {
        status: std::process::ExitStatus::from_raw(code << 8),
        stdout: stdout.as_bytes().to_vec(),
        stderr: stderr.as_bytes().to_vec(),
    }
}

#[test]
fn a_failed_command_is_described_by_its_status_and_what_it_said() {
    // scontrol ping with slurmctld down: stdout only, under a banner.
    let down = "Slurmctld(primary) at ctl1 is DOWN\n*****\n** RESTORE SLURMCTLD DAEMON TO SERVICE **\n*****\n";
    assert_eq!(
        detail(&output(1, down, "")),
        "exit status 1: Slurmctld(primary) at ctl1 is DOWN"
    );
    assert_eq!(
        detail(&output(
            1,
            "ignored",
            "sbatch: error: Batch job submission failed\n"
        )),
        "exit status 1: sbatch: error: Batch job submission failed"
    );
    assert_eq!(
        detail(&output(2, "", "\n")),
        "exit status 2, nothing printed"
    );
    let long = "x".repeat(1000);
    assert!(detail(&output(1, "", &long)).len() < 450);
}
