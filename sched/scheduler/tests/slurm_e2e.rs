//! End to end on a real Slurm: 8 nodes (slurmctld + 8 slurmd), node agents serving recorded
//! harvest documents, 24 jobs submitted with `valve-scheduler submit`, the scheduler's loop
//! placing them, evicting the one that misses its SLA, and a restart that places nothing twice.
//!
//! Needs Debian's Slurm packages (scripts/setup-debian.sh); skips without them unless
//! VALVE_REQUIRE_SLURM=1 (CI), which makes that a failure.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::slurm::SlurmCluster;
use valve_harvest::{NodeHarvest, PairAlignment};

const BIN: &str = env!("CARGO_BIN_EXE_valve-scheduler");
const GIB: u64 = 1 << 30;

/// Child processes killed when the test ends, however it ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A recorded document: 8 GPUs, every one `busy`, 60 GiB left to offline, all pairs scoring
/// `score`.
fn harvest(busy: f64, score: f64) -> NodeHarvest {
    let gpus = (0..8)
        .map(|i| {
            valve_scheduler::bench::steady_gpu(i, busy, vec![60 * GIB; valve_harvest::QUANTILES])
        })
        .collect();
    let mut pairs = Vec::new();
    for window_s in [60, 600, 3600] {
        for a in 0..8 {
            for b in a + 1..8 {
                pairs.push(PairAlignment {
                    gpus: [a, b],
                    window_s,
                    overlap_fraction: busy * score,
                    union_fraction: busy,
                    score,
                });
            }
        }
    }
    NodeHarvest {
        version: valve_harvest::VERSION,
        node: "recorded".into(),
        generated_unix_ms: 0,
        source: "recorded".into(),
        gpus,
        pairs,
        jobs: vec![],
    }
}

/// A 1- or 2-GPU profile: 100 tokens/s alone, full speed from 16 GiB.
fn profile(gpus: u32) -> String {
    format!(
        r#"{{"version":1,"name":"e2e-{gpus}gpu","units":"tokens","gpus":{gpus},"alone_per_s":100.0,
        "curve":[{{"memory_bytes":{},"per_s":40.0}},{{"memory_bytes":{},"per_s":100.0}}],"deficit_penalty":0.3}}"#,
        4 * GIB,
        16 * GIB
    )
}

/// A job script that writes its GPUs down (whole, by a rename: the test reads the file as soon as
/// it exists) and reports `rate` tokens/s for `secs` seconds.
fn script(dir: &Path, rate: u32, secs: u32) -> String {
    format!(
        "echo \"$CUDA_VISIBLE_DEVICES\" > {d}/.cvd-$SLURM_JOB_ID && mv {d}/.cvd-$SLURM_JOB_ID {d}/cvd-$SLURM_JOB_ID; \
         s=$(date +%s%3N); \
         while [ $(( $(date +%s%3N) - s )) -lt {ms} ]; do \
         {BIN} report $(( ($(date +%s%3N) - s) * {rate} / 1000 )); sleep 0.5; done",
        d = dir.display(),
        ms = secs * 1000
    )
}

struct Setup {
    cluster: SlurmCluster,
    dir: PathBuf,
    agents_file: PathBuf,
    children: Children,
}

impl Setup {
    fn cmd(&self, program: &str) -> Command {
        let mut c = self.cluster.cmd(program);
        c.env("SLURM_CONF", self.cluster.conf());
        c
    }

    /// `valve-scheduler submit`; the job id.
    fn submit(&self, profile: Option<&Path>, sla: &str, script: &str) -> String {
        let mut c = self.cmd(BIN);
        c.arg("submit").args(["--sla", sla]);
        match profile {
            Some(p) => c.arg("--profile").arg(p),
            None => c.arg("--no-profile"),
        };
        let out = c
            .args(["--", "--wrap", script, "-o", "/dev/null"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "submit: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    fn scheduler(&self, log: &str) -> Child {
        self.cmd(BIN)
            .arg("run")
            .arg("--agents")
            .arg(&self.agents_file)
            .args([
                "--agent-url",
                "http://127.0.0.1:1/{node}",
                "--interval",
                "1s",
            ])
            // Time after a job's last report counts as time without progress, so a window
            // reads up to one report interval (0.5 s here, more on a loaded 2-core CI machine)
            // short. Over 4 s that was 12% or more, past the demanding jobs' margin (0.95 of
            // alone against an SLA of 0.85), and one was evicted now and then. Over 10 s: 5%.
            .args([
                "--monitor-window",
                "10s",
                "--misses",
                "2",
                "--node-timeout",
                "30s",
            ])
            .arg("--state")
            .arg(self.dir.join("state.json"))
            .stdout(std::fs::File::create(self.dir.join(log)).unwrap())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap()
    }

    /// Our jobs as squeue shows them: id -> (state, node, gpus from the comment, metadata).
    fn jobs(&self) -> BTreeMap<String, (String, String, Vec<u32>, serde_json::Value)> {
        let out = self.cmd("squeue").arg("--json").output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut m = BTreeMap::new();
        for j in v["jobs"].as_array().unwrap() {
            let c = j["comment"].as_str().unwrap_or("");
            let Some(meta) = c.strip_prefix("valve:") else {
                continue;
            };
            let meta: serde_json::Value = serde_json::from_str(meta).unwrap();
            let gpus = meta["placed"]["gpus"]
                .as_array()
                .map(|a| a.iter().map(|x| x.as_u64().unwrap() as u32).collect())
                .unwrap_or_default();
            m.insert(
                j["job_id"].to_string(),
                (
                    j["job_state"].as_str().unwrap().to_string(),
                    j["nodes"].as_str().unwrap_or("").to_string(),
                    gpus,
                    meta,
                ),
            );
        }
        m
    }

    fn wait_for(&self, what: &str, secs: u64, mut ok: impl FnMut(&Self) -> bool) {
        let end = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < end {
            if ok(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!(
            "timed out waiting for {what}\njobs: {:#?}\n{}\nscheduler log:\n{}",
            self.jobs(),
            self.cluster.log_tail(),
            std::fs::read_to_string(self.dir.join("scheduler.log")).unwrap_or_default()
        );
    }
}

/// Starts the cluster, installs the TaskProlog, writes the recorded documents and starts agents
/// for gpu001..gpu006 (gpu007's agent is silent, gpu008 is drained).
fn setup() -> Option<Setup> {
    let cluster = SlurmCluster::start_or_skip(8, 8)?;
    let dir = cluster.dir().to_path_buf();
    let prolog = dir.join("taskprolog.sh");
    std::fs::write(
        &prolog,
        format!(
            "#!/bin/sh\nexec {BIN} task-prolog --progress-dir {}/progress --per-node\n",
            dir.display()
        ),
    )
    .unwrap();
    Command::new("chmod")
        .arg("+x")
        .arg(&prolog)
        .status()
        .unwrap();
    let mut conf = std::fs::read_to_string(cluster.conf()).unwrap();
    conf.push_str(&format!("TaskProlog={}\n", prolog.display()));
    std::fs::write(cluster.conf(), conf).unwrap();
    let s = |c: &mut Command| assert!(c.status().unwrap().success());
    s(cluster
        .cmd("scontrol")
        .env("SLURM_CONF", cluster.conf())
        .arg("reconfigure"));
    s(cluster
        .cmd("scontrol")
        .env("SLURM_CONF", cluster.conf())
        .args(["update", "nodename=gpu008", "state=drain", "reason=e2e"]));
    let docs = [
        (0.05, 1.0),
        (0.05, 1.0),
        (0.4, 1.0),
        (0.4, 1.0),
        (0.85, 1.0),
        (0.3, 0.2),
    ];
    let mut agents = String::new();
    let mut children = Vec::new();
    for (i, (busy, score)) in docs.iter().enumerate() {
        let node = format!("gpu{:03}", i + 1);
        let h = dir.join(format!("harvest-{node}.json"));
        std::fs::write(&h, serde_json::to_string(&harvest(*busy, *score)).unwrap()).unwrap();
        let port = free_port();
        children.push(
            Command::new(BIN)
                .args(["agent", "--node", &node, "--rate-windows", "10s,60s"])
                .arg("--harvest")
                .arg(&h)
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .arg("--progress-dir")
                .arg(dir.join("progress").join(&node))
                .spawn()
                .unwrap(),
        );
        agents.push_str(&format!("{node} http://127.0.0.1:{port}/v1/harvest\n"));
    }
    agents.push_str(&format!(
        "gpu007 http://127.0.0.1:{}/v1/harvest\n",
        free_port()
    ));
    let agents_file = dir.join("agents");
    std::fs::write(&agents_file, agents).unwrap();
    for (name, gpus) in [("p1.json", 1), ("p2.json", 2)] {
        std::fs::write(dir.join(name), profile(gpus)).unwrap();
    }
    Some(Setup {
        cluster,
        dir,
        agents_file,
        children: Children(children),
    })
}

/// No GPU of any node is given to two running or released jobs.
fn assert_no_gpu_shared(jobs: &BTreeMap<String, (String, String, Vec<u32>, serde_json::Value)>) {
    let mut seen: HashMap<(String, u32), String> = HashMap::new();
    for (id, (state, _, gpus, meta)) in jobs {
        if state != "RUNNING" {
            continue;
        }
        let node = meta["placed"]["node"].as_str().unwrap().to_string();
        for g in gpus {
            if let Some(other) = seen.insert((node.clone(), *g), id.clone()) {
                panic!("GPU {g} of {node} given to {other} and {id}");
            }
        }
    }
}

#[test]
fn offline_jobs_are_placed_by_sla_evicted_when_they_miss_it_and_survive_a_restart() {
    let Some(mut t) = setup() else { return };
    let (p1, p2) = (t.dir.join("p1.json"), t.dir.join("p2.json"));
    let d = t.dir.clone();
    let demanding: Vec<String> = (0..6)
        .map(|_| t.submit(Some(&p1), "0.85", &script(&d, 95, 600)))
        .collect();
    let pairs: Vec<String> = (0..4)
        .map(|_| t.submit(Some(&p2), "0.6", &script(&d, 95, 600)))
        .collect();
    let easy: Vec<String> = (0..8)
        .map(|_| t.submit(Some(&p1), "0.5", &script(&d, 95, 600)))
        .collect();
    let impossible: Vec<String> = (0..2)
        .map(|_| t.submit(Some(&p1), "0.95", &script(&d, 95, 600)))
        .collect();
    let unprofiled = t.submit(None, "0.5", &script(&d, 95, 600));
    let slow = t.submit(Some(&p1), "0.5", &script(&d, 10, 600));
    // A bad SLA never reaches Slurm.
    let bad = t
        .cmd(BIN)
        .args(["submit", "--sla", "1.5", "--profile"])
        .arg(&p1)
        .args(["--", "--wrap", "true"])
        .output()
        .unwrap();
    assert_eq!(
        bad.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(String::from_utf8_lossy(&bad.stderr).contains("(0, 1]"));
    assert_eq!(t.jobs().len(), 22);

    let sched = t.scheduler("scheduler.log");
    t.children.0.push(sched);
    let placeable = demanding.len() + pairs.len() + easy.len() + 1;
    t.wait_for("the placeable jobs to run", 90, |t| {
        t.jobs().values().filter(|j| j.0 == "RUNNING").count() >= placeable
    });
    let jobs = t.jobs();
    assert_no_gpu_shared(&jobs);
    let node_of = |id: &String| jobs[id].1.clone();
    for id in &demanding {
        assert!(
            ["gpu001", "gpu002"].contains(&node_of(id).as_str()),
            "0.85 needs an idle node: {id} on {}",
            node_of(id)
        );
    }
    for id in &pairs {
        assert_eq!(jobs[id].2.len(), 2);
        assert!(
            ["gpu001", "gpu002"].contains(&node_of(id).as_str()),
            "2-GPU job {id} on {}: gpu006 is out of step",
            node_of(id)
        );
    }
    for id in easy.iter().chain([&slow]) {
        assert!(
            !["gpu005", "gpu007", "gpu008"].contains(&node_of(id).as_str()),
            "{id} on {}",
            node_of(id)
        );
    }
    for id in impossible.iter().chain([&unprofiled]) {
        assert_eq!(jobs[id].0, "PENDING", "{id}");
    }
    // Each job sees the GPUs the scheduler chose.
    for (id, (state, _, gpus, _)) in &jobs {
        if state == "RUNNING" {
            let want: Vec<String> = gpus.iter().map(u32::to_string).collect();
            t.wait_for("the job's GPU file", 20, |t| {
                t.dir.join(format!("cvd-{id}")).exists()
            });
            let got = std::fs::read_to_string(t.dir.join(format!("cvd-{id}"))).unwrap();
            assert_eq!(got.trim(), want.join(","), "job {id}");
        }
    }

    // The slow job misses 0.5 at 0.1 of alone: evicted, and placed again elsewhere.
    let first = node_of(&slow);
    t.wait_for("the slow job's eviction and new placement", 90, |t| {
        let j = t.jobs();
        let (state, node, _, meta) = &j[&slow];
        state == "RUNNING" && node != &first && meta["evictions"] == 1
    });
    assert_eq!(t.jobs()[&slow].3["avoid"][0], first.as_str());
    // It would keep missing wherever it goes; it has shown what it had to.
    assert!(t.cmd("scancel").arg(&slow).status().unwrap().success());

    let explain = t
        .cmd(BIN)
        .arg("explain")
        .arg(&impossible[0])
        .arg(&unprofiled)
        .arg("--agents")
        .arg(&t.agents_file)
        .args(["--agent-url", "http://127.0.0.1:1/{node}"])
        .arg("--state")
        .arg(t.dir.join("state.json"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&explain.stdout);
    assert!(
        text.contains("no free GPUs meet its SLA (needs 1.00 of alone)"),
        "{text}"
    );
    assert!(text.contains("--default-profile"), "{text}");

    // A restart: stop the scheduler, submit while it is down, start it again.
    let mut sched = t.children.0.pop().unwrap();
    Command::new("kill")
        .arg(sched.id().to_string())
        .status()
        .unwrap();
    assert!(
        sched.wait().unwrap().success(),
        "SIGTERM ends the loop cleanly"
    );
    // Running jobs and how often each was evicted so far (the slow job's eviction may have
    // moved others as well): none of that may change across the restart.
    let before: BTreeMap<String, serde_json::Value> = t
        .jobs()
        .iter()
        .filter(|(_, j)| j.0 == "RUNNING")
        .map(|(id, j)| (id.clone(), j.3["evictions"].clone()))
        .collect();
    let late = t.submit(Some(&p1), "0.3", &script(&d, 95, 600));
    t.children.0.push(t.scheduler("scheduler-2.log"));
    t.wait_for("the job submitted while the scheduler was down", 60, |t| {
        t.jobs()[&late].0 == "RUNNING"
    });
    std::thread::sleep(Duration::from_secs(3));
    let after = t.jobs();
    assert_no_gpu_shared(&after);
    for (id, evictions) in &before {
        assert_eq!(
            after[id].0, "RUNNING",
            "{id} kept running through the restart"
        );
        assert_eq!(
            &after[id].3["evictions"], evictions,
            "{id} was not placed again"
        );
    }
    let out = t
        .cmd("scancel")
        .arg("--full")
        .args(after.keys())
        .output()
        .unwrap();
    assert!(out.status.success());
    for log in ["scheduler.log", "scheduler-2.log"] {
        let text = std::fs::read_to_string(t.dir.join(log)).unwrap_or_default();
        eprintln!("--- {log}\n{text}");
    }
    // The loop's log names each excluded node and each waiting job with its reason, once.
    let log = std::fs::read_to_string(t.dir.join("scheduler.log")).unwrap();
    let lines = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        lines("node gpu007: excluded: no harvest document from its agent yet; its agent: GET"),
        1,
        "{log}"
    );
    assert_eq!(
        lines("node gpu008: excluded: the engine reports it"),
        1,
        "{log}"
    );
    for id in &impossible {
        let needle = format!("job {id}: pending: no free GPUs meet its SLA");
        assert!(lines(&needle) >= 1, "{needle}\n{log}");
    }
    assert_eq!(lines(&format!("job {unprofiled}: refused:")), 1, "{log}");
}
