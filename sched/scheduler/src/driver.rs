//! The scheduler's loop against a real engine: take a snapshot, fetch the nodes' documents, plan
//! ([`cycle::plan`]), carry the plan out, keep the monitor's memory in a state file; back off
//! while the engine is unreachable. Nothing is lost on a crash: every job lives in the engine.
//!
//! [`Engine`] is what the loop needs of an engine; [`SlurmEngine`] is Slurm's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cycle::{plan, Params, Plan, Snapshot};
use crate::meta::{JobMeta, PlacedOn};
use crate::monitor::{Action, Monitor};
use crate::place::Outcome;
use crate::slurm::{Slurm, SlurmError};

/// Nodes a job remembers to avoid; the oldest are forgotten first.
const MAX_AVOID: usize = 8;

/// An engine error, and whether the engine as a whole is down (then the loop backs off).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct EngineError {
    /// What failed.
    pub message: String,
    /// The engine is unreachable: retry the whole pass later.
    pub unreachable: bool,
}

impl From<SlurmError> for EngineError {
    fn from(e: SlurmError) -> Self {
        EngineError {
            unreachable: e.is_unreachable(),
            message: e.to_string(),
        }
    }
}

/// What the loop needs of a cluster engine.
pub trait Engine {
    /// Nodes and the scheduler's jobs.
    fn snapshot(&mut self) -> Result<Snapshot, EngineError>;
    /// Starts held job `id` where `meta.placed` says.
    fn place(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError>;
    /// Requeues running job `id` held, with `meta` (no placement, the node to avoid).
    fn evict(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError>;
}

/// Slurm as an [`Engine`].
pub struct SlurmEngine {
    /// The CLIs.
    pub slurm: Slurm,
    restarts: HashMap<String, u32>,
}

impl SlurmEngine {
    /// Slurm through `slurm`.
    pub fn new(slurm: Slurm) -> Self {
        SlurmEngine {
            slurm,
            restarts: HashMap::new(),
        }
    }
}

impl Engine for SlurmEngine {
    fn snapshot(&mut self) -> Result<Snapshot, EngineError> {
        let (snap, restarts) = self.slurm.snapshot()?;
        self.restarts = restarts;
        Ok(snap)
    }

    fn place(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError> {
        let node = &meta.placed.as_ref().expect("a placement").node;
        let restarted = self.restarts.get(id).is_some_and(|&r| r > 0);
        Ok(self.slurm.place(id, node, meta, restarted)?)
    }

    fn evict(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError> {
        Ok(self.slurm.evict(id, meta)?)
    }
}

/// What carrying out a plan did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Applied {
    /// Jobs started, with their node.
    pub placed: Vec<(String, String)>,
    /// Jobs evicted, with the node they left.
    pub evicted: Vec<(String, String)>,
    /// Jobs whose action failed, and why.
    pub failed: Vec<(String, String)>,
    /// The engine went away half-way: the rest waits for the next pass.
    pub unreachable: bool,
}

/// Carries out `plan` (made from `snap`) on `engine`; evicted jobs are forgotten by `monitor`.
pub fn apply(
    engine: &mut dyn Engine,
    snap: &Snapshot,
    plan: &Plan,
    monitor: &mut Monitor,
) -> Applied {
    let metas: HashMap<&str, &JobMeta> = snap
        .jobs
        .iter()
        .filter_map(|j| Some((j.id.as_str(), j.meta.as_ref().ok()?)))
        .collect();
    let mut out = Applied::default();
    let placements = plan.decisions.iter().filter_map(|d| match &d.outcome {
        Outcome::Placed(p) => Some((d.job.as_str(), p)),
        Outcome::Pending(_) => None,
    });
    for (id, p) in placements {
        let Some(&meta) = metas.get(id) else { continue };
        let mut m = meta.clone();
        m.placed = Some(PlacedOn {
            node: p.node.clone(),
            gpus: p.gpus.clone(),
        });
        if record(&mut out, id, engine.place(id, &m)) {
            out.placed.push((id.into(), p.node.clone()));
        }
        if out.unreachable {
            return out;
        }
    }
    for c in plan.checks.iter().filter(|c| c.action == Action::Evict) {
        let Some(&meta) = metas.get(c.job.as_str()) else {
            continue;
        };
        let m = evicted_meta(meta, &c.node);
        if record(&mut out, &c.job, engine.evict(&c.job, &m)) {
            monitor.forget(&c.job);
            out.evicted.push((c.job.clone(), c.node.clone()));
        }
        if out.unreachable {
            return out;
        }
    }
    out
}

/// Records a result; true if it succeeded.
fn record(out: &mut Applied, id: &str, r: Result<(), EngineError>) -> bool {
    match r {
        Ok(()) => true,
        Err(e) => {
            out.unreachable |= e.unreachable;
            out.failed.push((id.into(), e.message));
            false
        }
    }
}

/// A job's metadata after it is evicted from `node`.
pub fn evicted_meta(meta: &JobMeta, node: &str) -> JobMeta {
    let mut m = meta.clone();
    m.placed = None;
    m.evictions += 1;
    m.avoid.retain(|n| n != node);
    m.avoid.push(node.into());
    if m.avoid.len() > MAX_AVOID {
        m.avoid.remove(0);
    }
    m
}

/// The monitor's memory in a file, written whole (temp file + rename) after every pass.
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// The state at `path`.
    pub fn new(path: &Path) -> Self {
        StateFile { path: path.into() }
    }

    /// The saved monitor, or a fresh one where there is no file yet. A file that does not parse
    /// is an error that names the fix.
    pub fn load(&self) -> Result<Monitor, String> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                format!(
                    "state file {} is corrupt ({e}): remove it to start the SLA monitor afresh (no job is lost: Slurm holds every job; miss streaks restart)",
                    self.path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Monitor::default()),
            Err(e) => Err(format!("cannot read state file {}: {e}", self.path.display())),
        }
    }

    /// The lock file beside the state file. It is not the state file itself: that is
    /// replaced by a rename on every save, and a lock on the old file would guard nothing.
    pub fn lock_path(&self) -> PathBuf {
        let mut name = self.path.file_name().unwrap_or_default().to_os_string();
        name.push(".lock");
        self.path.with_file_name(name)
    }

    /// Takes the state for this process alone, or says which process has it. The holder's pid
    /// is written into the lock file for the next one's error.
    pub fn lock(&self) -> Result<StateLock, LockError> {
        use nix::fcntl::{Flock, FlockArg};
        use std::io::{Read, Seek, Write};
        let lock = self.lock_path();
        let io = |source: std::io::Error| LockError::Io {
            state: self.path.clone(),
            lock: lock.clone(),
            source,
        };
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        // std opens files close-on-exec: the Slurm commands the loop runs do not inherit the
        // lock, so none of them can keep it after the scheduler dies.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock)
            .map_err(io)?;
        let mut held = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(held) => held,
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(LockError::Held {
                    state: self.path.clone(),
                    lock,
                    pid: text.trim().parse().ok(),
                });
            }
            Err((_, errno)) => return Err(io(errno.into())),
        };
        held.set_len(0).map_err(io)?;
        held.rewind().map_err(io)?;
        writeln!(held, "{}", std::process::id()).map_err(io)?;
        Ok(StateLock {
            _lock: held,
            path: lock,
        })
    }

    /// Saves `monitor`.
    pub fn save(&self, monitor: &Monitor) -> Result<(), String> {
        let err =
            |e: std::io::Error| format!("cannot write state file {}: {e}", self.path.display());
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let tmp = self.path.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec(monitor).expect("monitor serialises"),
        )
        .map_err(err)?;
        std::fs::rename(&tmp, &self.path).map_err(err)
    }
}

/// Why a scheduler could not take its state file for itself.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the lock.
    #[error("{}", held_message(.state, .lock, .pid))]
    Held {
        /// The state file.
        state: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The holder's pid, as it wrote it in the lock file (`None`: not written yet).
        pid: Option<u32>,
    },
    /// The lock file could not be opened or locked.
    #[error("cannot lock state file {} ({}): {source}; check that the directory exists and is writable, or choose another --state", .state.display(), .lock.display())]
    Io {
        /// The state file.
        state: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

fn held_message(state: &Path, lock: &Path, pid: &Option<u32>) -> String {
    let (holder, kill) = match pid {
        Some(p) => (format!("pid {p}"), format!("kill {p}")),
        None => ("its pid is not recorded yet".into(), "kill it".into()),
    };
    format!(
        "state file {} is in use by another valve-scheduler ({holder}, lock {}): two schedulers on one state would place the same jobs. Stop that one ({kill}, or `systemctl stop` its unit), or give this one its own --state",
        state.display(),
        lock.display()
    )
}

/// An exclusive `flock` on a state file's lock file (`STATE.lock`), held for as long as the
/// value lives. The kernel drops it when the process exits, however it exits (SIGKILL
/// included), so a lock never outlives its scheduler; the file itself stays (removing it would
/// let two processes lock two different files of one name).
#[derive(Debug)]
pub struct StateLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
    /// The lock file.
    pub path: PathBuf,
}

/// Back-off while the engine is unreachable: 1 s, doubling, at most `max`.
pub fn backoff(failures: u32, max: Duration) -> Duration {
    Duration::from_secs(1u64 << failures.min(16)).min(max)
}

/// One pass: snapshot, documents, plan, apply. Errors only when the snapshot failed.
///
/// `clock` gives the time (Unix ms). It is read after the snapshot and the agents' answers,
/// which can block for long (a slurmctld that is slow or going down; silent agents, each
/// after its timeout): every node that answered in this pass is stamped with that time and is
/// fresh, whatever the pass waited for before; one that did not is as old as its last answer
/// really is.
pub fn pass(
    engine: &mut dyn Engine,
    agents: &mut crate::agents::Agents,
    monitor: &mut Monitor,
    params: &Params,
    clock: &dyn Fn() -> u64,
    dry_run: bool,
) -> Result<(Snapshot, Plan, Applied), EngineError> {
    let snap = engine.snapshot()?;
    let names: Vec<String> = snap
        .nodes
        .iter()
        .filter(|n| n.closed.is_none())
        .map(|n| n.name.clone())
        .collect();
    let now = agents.refresh(&names, clock);
    let p = plan(now, &snap, &agents.reports, monitor, params);
    let applied = if dry_run {
        Applied::default()
    } else {
        apply(engine, &snap, &p, monitor)
    };
    Ok((snap, p, applied))
}

#[cfg(test)]
mod tests;
