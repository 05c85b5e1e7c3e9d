//! The local cluster an operator tries the scheduler on, as the quick start runs it: one
//! `slurm-local.sh start --harvest` gives Slurm nodes with an agent each, a held job is placed
//! by one pass and sees the GPUs it was given, and `stop` leaves no process behind.
//!
//! Needs Debian's Slurm packages (scripts/setup-debian.sh); skips without them unless
//! VALVE_REQUIRE_SLURM=1 (CI).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::slurm::{run_script, SlurmCluster};

const BIN: &str = env!("CARGO_BIN_EXE_valve-scheduler");
const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !matches!(
            s.rsplit(") ").next().and_then(|r| r.chars().next()),
            Some('Z' | 'X')
        )
    })
}

fn agent_pids(dir: &Path) -> Vec<u32> {
    ["gpu001", "gpu002"]
        .iter()
        .map(|n| {
            let f = dir.join(format!("run/agent-{n}.daemon.pid"));
            std::fs::read_to_string(&f).unwrap().trim().parse().unwrap()
        })
        .collect()
}

#[test]
fn start_with_agents_place_one_job_and_stop_cleanly() {
    let harvest = Path::new(EXAMPLES).join("node.json");
    let Some(cluster) = SlurmCluster::start_with_or_skip(2, 4, Some(&harvest)) else {
        return;
    };
    let dir = cluster.dir().to_path_buf();
    let agents = std::fs::read_to_string(dir.join("agents")).unwrap();
    assert_eq!(agents.lines().count(), 2, "{agents}");
    for line in agents.lines() {
        let (node, url) = line.split_once(' ').unwrap();
        let doc = valve_scheduler::agents::fetch(node, url, Duration::from_secs(5));
        assert_eq!(
            doc.unwrap().gpus.len(),
            4,
            "{node}'s agent replays the document"
        );
    }
    let submit = cluster
        .cmd(BIN)
        .arg("submit")
        .arg("--profile")
        .arg(Path::new(EXAMPLES).join("job.json"))
        .args(["--sla", "0.5", "--", "-o", "/dev/null", "--wrap"])
        .arg(format!(
            "echo $CUDA_VISIBLE_DEVICES > {}/cvd-$SLURM_JOB_ID; sleep 600",
            dir.display()
        ))
        .output()
        .unwrap();
    assert!(
        submit.status.success(),
        "{}",
        String::from_utf8_lossy(&submit.stderr)
    );
    let id = String::from_utf8(submit.stdout).unwrap().trim().to_string();
    let pass = cluster
        .cmd(BIN)
        .args(["run", "--once", "--agents"])
        .arg(dir.join("agents"))
        .arg("--state")
        .arg(dir.join("state.json"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&pass.stdout);
    assert!(
        pass.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&pass.stderr)
    );
    let placed = format!("job {id}: placed on gpu00");
    let line = out
        .lines()
        .find(|l| l.starts_with(&placed))
        .unwrap_or_else(|| panic!("{out}"));
    let gpus = line
        .split("GPUs [")
        .nth(1)
        .and_then(|r| r.split(']').next())
        .unwrap();
    // The TaskProlog gave the job the GPU the scheduler chose.
    let cvd = dir.join(format!("cvd-{id}"));
    let end = Instant::now() + Duration::from_secs(30);
    while !cvd.exists() {
        assert!(
            Instant::now() < end,
            "the job did not start\n{}",
            cluster.log_tail()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        std::fs::read_to_string(&cvd).unwrap().trim(),
        gpus.replace(' ', "")
    );

    let pids = agent_pids(&dir);
    let stop = run_script(&["stop".as_ref(), dir.as_os_str()]).unwrap();
    assert!(
        stop.status.success(),
        "{}",
        String::from_utf8_lossy(&stop.stderr)
    );
    for p in pids {
        assert!(!alive(p), "agent {p} outlived stop");
    }
    let squeue = cluster.cmd("squeue").output().unwrap();
    assert!(!squeue.status.success(), "slurmctld outlived stop");
}
