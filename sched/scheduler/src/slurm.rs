//! The Slurm adapter: reads nodes and the scheduler's jobs from Slurm's own CLIs (`sinfo --json`,
//! `squeue --json`), places a held job (`scontrol update nodelist=... comment=...`, `release`)
//! and evicts one (`scontrol requeuehold`). Slurm is the only store of job state.
//!
//! Written against Slurm 22.05 (Debian 12); what its CLIs do is recorded, with fixtures, in
//! `sched/scheduler/testdata/slurm-22.05/NOTES.md`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use serde::Deserialize;

use crate::cycle::{JobInfo, NodeInfo, Phase, Snapshot};
use crate::meta::{JobMeta, PREFIX};

/// Slurm's comment field holds at most this many bytes (job_mgr.c, `_test_strlen`).
pub const COMMENT_LIMIT: usize = 1024;

/// Why a Slurm command failed.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// slurmctld does not answer.
    #[error("slurmctld is not reachable ({0}); is it running, and is SLURM_CONF right?")]
    Unreachable(String),
    /// A command could not be started.
    #[error("cannot run {program}: {source} (install the Slurm client: scripts/setup-debian.sh)")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A command exited non-zero.
    #[error("`{command}` failed ({detail})")]
    Failed {
        /// The command line.
        command: String,
        /// Its exit status and what it printed ([`detail`]).
        detail: String,
    },
    /// JSON output that did not parse, or carried errors.
    #[error("unexpected output from {program}: {what}")]
    Output {
        /// The program.
        program: String,
        /// What was wrong.
        what: String,
    },
    /// The metadata would not fit the comment.
    #[error("the job's valve metadata is {0} bytes, over Slurm's {COMMENT_LIMIT}-byte comment limit: shorten the profile's name or use fewer curve points")]
    TooLong(usize),
}

impl SlurmError {
    /// Whether Slurm itself is down (retry later) rather than one command failing.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, SlurmError::Unreachable(_) | SlurmError::Spawn { .. })
    }
}

/// The Slurm CLIs, with an optional `SLURM_CONF`.
#[derive(Clone, Debug, Default)]
pub struct Slurm {
    /// `SLURM_CONF` for every command (`None`: the environment's).
    pub conf: Option<PathBuf>,
    /// Where the Slurm programs are (`None`: on `PATH`).
    pub bin_dir: Option<PathBuf>,
}

/// One job of `squeue --json` (the fields the scheduler reads).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct SqueueJob {
    /// The id.
    pub job_id: u64,
    /// PENDING, RUNNING, COMPLETING, ...
    pub job_state: String,
    /// Why it waits (JobHeldUser, Resources, ...).
    #[serde(default)]
    pub state_reason: String,
    /// The comment (Valve's metadata).
    #[serde(default)]
    pub comment: String,
    /// When it started (Unix s; 0 or a future estimate while pending).
    #[serde(default)]
    pub start_time: u64,
    /// Times it was requeued.
    #[serde(default)]
    pub restart_cnt: u32,
    /// The node it runs on.
    #[serde(default)]
    pub nodes: String,
}

#[derive(Deserialize)]
struct SqueueOut {
    #[serde(default)]
    errors: Vec<serde_json::Value>,
    #[serde(default)]
    jobs: Vec<SqueueJob>,
}

/// One node of `sinfo --json`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct SinfoNode {
    /// Its name.
    pub name: String,
    /// idle, mixed, allocated, down, ...
    pub state: String,
    /// DRAIN, NOT_RESPONDING, ...
    #[serde(default)]
    pub state_flags: Vec<String>,
    /// Why an operator took it out.
    #[serde(default)]
    pub reason: String,
}

#[derive(Deserialize)]
struct SinfoOut {
    #[serde(default)]
    errors: Vec<serde_json::Value>,
    #[serde(default)]
    nodes: Vec<SinfoNode>,
}

/// Parses `squeue --json`, refusing output that carries errors (22.05 exits 0 with an empty job
/// list and an error when slurmctld is down).
pub fn parse_squeue(text: &str) -> Result<Vec<SqueueJob>, SlurmError> {
    let out: SqueueOut = serde_json::from_str(text).map_err(|e| SlurmError::Output {
        program: "squeue --json".into(),
        what: e.to_string(),
    })?;
    match out.errors.first() {
        Some(e) => Err(SlurmError::Unreachable(json_error("squeue --json", e))),
        None => Ok(out.jobs),
    }
}

/// Parses `sinfo --json`, as [`parse_squeue`].
pub fn parse_sinfo(text: &str) -> Result<Vec<SinfoNode>, SlurmError> {
    let out: SinfoOut = serde_json::from_str(text).map_err(|e| SlurmError::Output {
        program: "sinfo --json".into(),
        what: e.to_string(),
    })?;
    match out.errors.first() {
        Some(e) => Err(SlurmError::Unreachable(json_error("sinfo --json", e))),
        None => Ok(out.nodes),
    }
}

/// An entry of a `--json` output's `errors` as words. Slurm 22.05 writes
/// `{"description", "error", "error_number", "source"}` (squeue) or `{"error", "errno"}` (sinfo).
fn json_error(program: &str, e: &serde_json::Value) -> String {
    let field = |k: &str| {
        e.get(k).filter(|v| !v.is_null()).map(|v| match v.as_str() {
            Some(s) => s.to_string(),
            None => v.to_string(),
        })
    };
    let mut words: Vec<String> = ["description", "error"]
        .iter()
        .filter_map(|k| field(k))
        .collect();
    if let Some(n) = field("error_number").or_else(|| field("errno")) {
        words.push(format!("errno {n}"));
    }
    if let Some(src) = field("source") {
        words.push(format!("in {src}"));
    }
    if words.is_empty() {
        return format!("`{program}` reported {e}");
    }
    format!("`{program}` reported: {}", words.join(", "))
}

/// Why Slurm will not run jobs on a node, if it will not.
pub fn node_closed(n: &SinfoNode) -> Option<String> {
    const BAD_FLAGS: [&str; 6] = [
        "DRAIN",
        "DOWN",
        "FAIL",
        "MAINTENANCE",
        "NOT_RESPONDING",
        "POWERED_DOWN",
    ];
    let bad_state = !matches!(
        n.state.as_str(),
        "idle" | "mixed" | "allocated" | "completing"
    );
    let flags: Vec<&str> = n
        .state_flags
        .iter()
        .map(String::as_str)
        .filter(|f| BAD_FLAGS.contains(f))
        .collect();
    if !bad_state && flags.is_empty() {
        return None;
    }
    let mut why = n.state.clone();
    for f in flags {
        why = format!("{why}+{}", f.to_lowercase());
    }
    if !n.reason.is_empty() {
        why = format!("{why} ({})", n.reason);
    }
    Some(why)
}

/// The phase of one of our jobs, or `None` for jobs the scheduler has nothing to do with now
/// (finished, failed, cancelled).
pub fn phase(j: &SqueueJob) -> Option<Phase> {
    match j.job_state.as_str() {
        "PENDING" if j.state_reason.starts_with("JobHeld") => Some(Phase::Held),
        "PENDING" | "CONFIGURING" | "COMPLETING" => Some(Phase::Released),
        "RUNNING" => Some(Phase::Running(j.start_time * 1000)),
        _ => None,
    }
}

/// The scheduler's jobs among `jobs` (those whose comment is Valve's).
pub fn our_jobs(jobs: &[SqueueJob]) -> Vec<JobInfo> {
    jobs.iter()
        .filter_map(|j| {
            let meta = JobMeta::from_comment(&j.comment)?;
            Some(JobInfo {
                id: j.job_id.to_string(),
                phase: phase(j)?,
                meta,
                order: j.job_id,
            })
        })
        .collect()
}

impl Slurm {
    fn command(&self, program: &str) -> Command {
        let mut c = match &self.bin_dir {
            Some(d) => Command::new(d.join(program)),
            None => Command::new(program),
        };
        if let Some(conf) = &self.conf {
            c.env("SLURM_CONF", conf);
        }
        c
    }

    /// Runs `program args`, returning its stdout.
    fn run(&self, program: &str, args: &[&str]) -> Result<String, SlurmError> {
        let out = self
            .command(program)
            .args(args)
            .output()
            .map_err(|source| SlurmError::Spawn {
                program: program.into(),
                source,
            })?;
        if !out.status.success() {
            let command = format!("{program} {}", args.join(" "));
            let detail = detail(&out);
            if String::from_utf8_lossy(&out.stderr).contains("Unable to contact slurm controller") {
                return Err(SlurmError::Unreachable(format!("`{command}`: {detail}")));
            }
            return Err(SlurmError::Failed { command, detail });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Fails fast (milliseconds, where other commands wait ~10 s) when slurmctld is down.
    pub fn ping(&self) -> Result<(), SlurmError> {
        let out = self.run("scontrol", &["ping"]);
        match out {
            Ok(text) if text.contains("is UP") => Ok(()),
            Ok(text) => Err(SlurmError::Unreachable(format!(
                "`scontrol ping` printed {:?}",
                said(text.as_bytes())
            ))),
            Err(SlurmError::Failed { command, detail }) => {
                Err(SlurmError::Unreachable(format!("`{command}`: {detail}")))
            }
            Err(e) => Err(e),
        }
    }

    /// Nodes and the scheduler's jobs, plus each job's restart count.
    pub fn snapshot(&self) -> Result<(Snapshot, HashMap<String, u32>), SlurmError> {
        self.ping()?;
        let nodes = parse_sinfo(&self.run("sinfo", &["--json"])?)?;
        let jobs = parse_squeue(&self.run("squeue", &["--json"])?)?;
        let restarts = jobs
            .iter()
            .map(|j| (j.job_id.to_string(), j.restart_cnt))
            .collect();
        let snap = Snapshot {
            nodes: nodes
                .iter()
                .map(|n| NodeInfo {
                    name: n.name.clone(),
                    closed: node_closed(n),
                })
                .collect(),
            jobs: our_jobs(&jobs),
        };
        Ok((snap, restarts))
    }

    /// Places held job `id` on `node` with `meta` (its placement in it) and releases it. A job
    /// requeued before gets a start time of now+1 s: Slurm otherwise holds a requeued job back
    /// for its credential lifetime (121 s).
    pub fn place(
        &self,
        id: &str,
        node: &str,
        meta: &JobMeta,
        restarted: bool,
    ) -> Result<(), SlurmError> {
        let comment = checked_comment(meta)?;
        let mut args = vec![
            "update".to_string(),
            format!("jobid={id}"),
            format!("nodelist={node}"),
            format!("comment={comment}"),
        ];
        if restarted {
            args.push("starttime=now+1".into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run("scontrol", &args)?;
        self.run("scontrol", &["release", id])?;
        Ok(())
    }

    /// Requeues running job `id` held, then records `meta` (no placement, the node to avoid)
    /// and clears the node it was bound to.
    pub fn evict(&self, id: &str, meta: &JobMeta) -> Result<(), SlurmError> {
        let comment = checked_comment(meta)?;
        self.run("scontrol", &["requeuehold", id])?;
        let c = format!("comment={comment}");
        self.run(
            "scontrol",
            &["update", &format!("jobid={id}"), "nodelist=", &c],
        )?;
        Ok(())
    }

    /// Submits a held job with `meta` as its comment; `sbatch_args` are passed on (a script or
    /// `--wrap`). Returns the job id.
    pub fn submit(&self, meta: &JobMeta, sbatch_args: &[String]) -> Result<String, SlurmError> {
        let comment = checked_comment(meta)?;
        let mut args = vec![
            "--parsable".to_string(),
            "--hold".into(),
            "--requeue".into(),
            format!("--comment={comment}"),
        ];
        args.extend(sbatch_args.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.run("sbatch", &args)?;
        // --parsable prints "ID" or "ID;CLUSTER".
        Ok(out.trim().split(';').next().unwrap_or("").to_string())
    }

    /// The comment of job `id` (`squeue -h -j ID -o %k`: the text form honours -j).
    pub fn comment(&self, id: &str) -> Result<String, SlurmError> {
        Ok(self
            .run("squeue", &["-h", "-j", id, "-o", "%k"])?
            .trim_end_matches('\n')
            .to_string())
    }
}

/// A failed command's exit status and what it said: its stderr, or its stdout where stderr is
/// empty (`scontrol ping` reports a down slurmctld on stdout, with exit status 1).
pub fn detail(out: &std::process::Output) -> String {
    let status = match out.status.code() {
        Some(c) => format!("exit status {c}"),
        None => format!("ended by {}", out.status),
    };
    let mut text = said(&out.stderr);
    if text.is_empty() {
        text = said(&out.stdout);
    }
    if text.is_empty() {
        format!("{status}, nothing printed")
    } else {
        format!("{status}: {text}")
    }
}

/// Output as one line: its non-empty lines joined, banner lines of `*` left out, at most 400
/// characters.
fn said(bytes: &[u8]) -> String {
    const MAX: usize = 400;
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('*'))
        .collect();
    let one = lines.join("; ");
    match one.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &one[..cut]),
        None => one,
    }
}

/// `meta` as a comment, refused if Slurm would refuse it.
fn checked_comment(meta: &JobMeta) -> Result<String, SlurmError> {
    let c = meta.to_comment();
    debug_assert!(c.starts_with(PREFIX));
    if c.len() > COMMENT_LIMIT {
        return Err(SlurmError::TooLong(c.len()));
    }
    Ok(c)
}

#[cfg(test)]
mod tests;
