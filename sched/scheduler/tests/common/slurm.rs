//! A throwaway local Slurm cluster for integration tests: one slurmctld and N slurmd ("gpu001"..)
//! on this machine, started by `scripts/slurm-local.sh` in a temporary directory and stopped on drop.
//!
//! ```ignore
//! let Some(cluster) = SlurmCluster::start_or_skip(8, 8) else { return };
//! let out = cluster.cmd("squeue").arg("--json").output().unwrap();
//! ```
//!
//! A test that fails should print [`SlurmCluster::log_tail`]. Without Slurm installed the tests skip,
//! unless `VALVE_REQUIRE_SLURM=1` (CI) makes that a failure: see [`SlurmCluster::required`].
#![allow(dead_code)] // each test binary uses a different part of this file

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Where the script puts its daemons' pid files, relative to the cluster's directory.
const RUN_DIR: &str = "run";
/// How many base ports `start` tries when another process holds one of the ports it picked.
const PORT_TRIES: usize = 5;
/// The longest `slurm-local.sh start` may wait for all nodes to be idle, in seconds.
const START_TIMEOUT_S: u32 = 60;

/// A running local Slurm cluster; dropping it stops every daemon and removes its directory.
pub struct SlurmCluster {
    dir: tempfile::TempDir,
    conf: PathBuf,
    nodes: usize,
    base_port: u16,
}

impl SlurmCluster {
    /// Starts a cluster of `nodes` nodes (gpu001..) with `gpus` GPUs each and `max(4, 2 * gpus)`
    /// CPUs each (so that GPUs, not CPUs, bound how many one-GPU jobs fit on a node), on a free
    /// random base port, and waits until every node is idle.
    /// Errs with "slurm is not installed: ..." when slurmctld is missing.
    pub fn start(nodes: usize, gpus: u32) -> Result<SlurmCluster, String> {
        SlurmCluster::start_with(nodes, gpus, None)
    }

    /// [`SlurmCluster::start`], and with `harvest` a node agent per node replaying it
    /// (`slurm-local.sh start --harvest`: DIR/agents lists them, jobs get the TaskProlog).
    pub fn start_with(
        nodes: usize,
        gpus: u32,
        harvest: Option<&Path>,
    ) -> Result<SlurmCluster, String> {
        if !installed() {
            return Err("slurm is not installed: no slurmctld/slurmd/sinfo \
                        (run scripts/setup-debian.sh)"
                .to_string());
        }
        let mut last_err = String::new();
        for _ in 0..PORT_TRIES {
            let ports = if harvest.is_some() { 2 * nodes } else { nodes };
            let base_port = free_base_port(ports)?;
            let dir = tempfile::Builder::new()
                .prefix("valve-slurm-")
                .tempdir()
                .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
            let cpus = (2 * gpus).max(4);
            let numbers = [nodes.to_string(), gpus.to_string(), cpus.to_string()];
            let ports_and_wait = [base_port.to_string(), START_TIMEOUT_S.to_string()];
            let mut args: Vec<&std::ffi::OsStr> = vec!["start".as_ref(), dir.path().as_os_str()];
            for (flag, value) in ["--nodes", "--gpus", "--cpus", "--base-port", "--timeout"]
                .iter()
                .zip(numbers.iter().chain(&ports_and_wait))
            {
                args.push(std::ffi::OsStr::new(flag));
                args.push(std::ffi::OsStr::new(value));
            }
            if let Some(h) = harvest {
                args.push(std::ffi::OsStr::new("--harvest"));
                args.push(h.as_os_str());
            }
            let out = run_script(&args)?;
            if out.status.success() {
                let conf = dir.path().join("slurm.conf");
                return Ok(SlurmCluster {
                    dir,
                    conf,
                    nodes,
                    base_port,
                });
            }
            last_err = format!(
                "slurm-local.sh start failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
            // Another process took one of our ports between the check and the start: retry.
            if !last_err.contains("is in use") {
                break;
            }
        }
        Err(last_err)
    }

    /// Like [`SlurmCluster::start`], but returns `None` (after saying so on stderr) when Slurm is
    /// not installed and not [`required`](SlurmCluster::required); panics on any other failure.
    pub fn start_or_skip(nodes: usize, gpus: u32) -> Option<SlurmCluster> {
        SlurmCluster::start_with_or_skip(nodes, gpus, None)
    }

    /// [`SlurmCluster::start_with`], skipping as [`SlurmCluster::start_or_skip`] does.
    pub fn start_with_or_skip(
        nodes: usize,
        gpus: u32,
        harvest: Option<&Path>,
    ) -> Option<SlurmCluster> {
        match SlurmCluster::start_with(nodes, gpus, harvest) {
            Ok(cluster) => Some(cluster),
            Err(e) if e.starts_with("slurm is not installed") && !SlurmCluster::required() => {
                eprintln!("skipped: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// True when `VALVE_REQUIRE_SLURM=1` (CI sets it): then a missing Slurm fails the tests
    /// instead of skipping them.
    pub fn required() -> bool {
        std::env::var("VALVE_REQUIRE_SLURM").is_ok_and(|v| v == "1")
    }

    /// The cluster's slurm.conf, to pass as `SLURM_CONF`.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// The cluster's directory: configuration, state, spool, logs and pid files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// slurmctld's port; slurmd of node i (1-based) listens on `base_port() + i`.
    pub fn base_port(&self) -> u16 {
        self.base_port
    }

    /// The node names, "gpu001", "gpu002", ...
    pub fn nodes(&self) -> Vec<String> {
        (1..=self.nodes).map(|i| format!("gpu{i:03}")).collect()
    }

    /// A command for a Slurm program (`squeue`, `sbatch`, `scontrol`, ...) talking to this
    /// cluster: `SLURM_CONF` is set to [`SlurmCluster::conf`].
    pub fn cmd(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("SLURM_CONF", &self.conf);
        cmd
    }

    /// The last lines of the slurmctld log and of each slurmd log, to print when a test fails.
    pub fn log_tail(&self) -> String {
        let log = self.dir.path().join("log");
        let mut out = tail(&log.join("slurmctld.log"), 30);
        for node in self.nodes() {
            out.push_str(&tail(&log.join(format!("slurmd-{node}.log")), 8));
        }
        out
    }

    /// SIGKILLs every process named in the pid files and everything below them (slurmstepd and
    /// the jobs hang below the supervisor): the fallback when `stop` fails.
    fn kill_by_pid_files(&self) {
        let Ok(entries) = std::fs::read_dir(self.dir.path().join(RUN_DIR)) else {
            return;
        };
        let mut pids: Vec<u32> = entries
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|e| e == "pid"))
            .filter_map(|path| std::fs::read_to_string(path).ok()?.trim().parse().ok())
            .collect();
        let parents = parent_pids();
        let mut i = 0;
        while i < pids.len() {
            let parent = pids[i];
            let children = parents.iter().filter(|&&(_, ppid)| ppid == parent);
            let new: Vec<u32> = children
                .map(|&(pid, _)| pid)
                .filter(|p| !pids.contains(p))
                .collect();
            pids.extend(new);
            i += 1;
        }
        if !pids.is_empty() {
            let args: Vec<String> = pids.iter().map(u32::to_string).collect();
            let _ = Command::new("kill").arg("-KILL").args(args).output();
        }
    }
}

/// (pid, parent pid) of every process, from /proc.
fn parent_pids() -> Vec<(u32, u32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parse = |stat: String| {
        let pid = stat.split(' ').next()?.parse().ok()?;
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        let ppid = stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()?;
        Some((pid, ppid))
    };
    entries
        .flatten()
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
        .filter_map(parse)
        .collect()
}

impl Drop for SlurmCluster {
    /// Stops the cluster with `slurm-local.sh stop`; if that fails, kills by the pid files.
    fn drop(&mut self) {
        let stopped = run_script(&["stop".as_ref(), self.dir.path().as_os_str()]);
        match stopped {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                eprintln!(
                    "slurm-local.sh stop failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                self.kill_by_pid_files();
            }
            Err(e) => {
                eprintln!("{e}");
                self.kill_by_pid_files();
            }
        }
    }
}

/// `scripts/slurm-local.sh`, found from this crate's directory (sched/scheduler).
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/slurm-local.sh")
}

/// Runs `bash scripts/slurm-local.sh ARGS` and returns its output. Its agents (`--harvest`)
/// run this build's valve-scheduler.
pub fn run_script(args: &[&std::ffi::OsStr]) -> Result<Output, String> {
    let script = script();
    Command::new("bash")
        .arg(&script)
        .args(args)
        .env("VALVE_SCHEDULER", env!("CARGO_BIN_EXE_valve-scheduler"))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))
}

/// True if slurmctld, slurmd and sinfo can be found where the script looks for them.
fn installed() -> bool {
    let in_path = |name: &str| {
        let sbin = ["/usr/sbin", "/usr/local/sbin", "/usr/bin", "/usr/local/bin"];
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain(sbin.iter().map(PathBuf::from))
            .any(|dir| dir.join(name).is_file())
    };
    in_path("slurmctld") && in_path("slurmd") && in_path("sinfo")
}

/// A random base port in 20000..40000 such that base..=base+nodes are all free to bind.
fn free_base_port(nodes: usize) -> Result<u16, String> {
    let span = u16::try_from(nodes).map_err(|_| format!("too many nodes: {nodes}"))?;
    for _ in 0..50 {
        let base = 20000 + (random() % 20000) as u16;
        if (base..=base + span).all(|port| TcpListener::bind(("0.0.0.0", port)).is_ok()) {
            return Ok(base);
        }
    }
    Err(format!(
        "found no {} free ports in a row in 20000..40000",
        nodes + 1
    ))
}

/// A random number from std alone: `RandomState` is seeded randomly per instance.
fn random() -> u64 {
    RandomState::new().build_hasher().finish()
}

/// The last `lines` lines of a log file, under a header naming it; empty if there is no file.
fn tail(path: &Path, lines: usize) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    let start = all.len().saturating_sub(lines);
    format!("--- {}\n{}\n", path.display(), all[start..].join("\n"))
}
