//! The audit trail: one record per preempt, resume, gate start/stop, refused caller and config
//! load, with the caller's uid and pid (SO_PEERCRED) and the targets, as a `tracing` event
//! (target `valve_audit`) and, if configured, a JSON line appended to a file.
//!
//! Records are written after the request was answered, never on the way to a disable.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::protocol::{Data, GateSpec, Reply, Request};
use serde::Serialize;

/// Who asked: the peer's credentials from SO_PEERCRED, or the daemon itself (hold limits,
/// shutdown, the configured gate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Caller {
    /// User id (0 for the daemon itself).
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Process id (the daemon's own for its own actions).
    pub pid: i32,
}

impl Caller {
    /// The daemon acting on its own (hold limit, shutdown, configured gate).
    pub fn daemon() -> Self {
        Caller {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            pid: std::process::id() as i32,
        }
    }
}

/// One audit record.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AuditRecord {
    /// Unix time, seconds.
    pub ts: f64,
    /// What happened: `preempt`, `resume`, `resume_all`, `gate_start`, `gate_stop`,
    /// `hold_limit_resume`, `shutdown_resume`, `refused`, `config`.
    pub event: &'static str,
    /// Who asked.
    pub caller: Caller,
    /// What it was aimed at (pids, GPU, labels; the config's path and digest).
    pub targets: Targets,
    /// `ok` or `error`.
    pub outcome: &'static str,
    /// The error's exit code and message, if it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<AuditError>,
}

/// What an audited event was aimed at.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Targets {
    /// A preempt's process, GPU and hold limit.
    Preempt {
        /// The process.
        pid: u32,
        /// The GPU selector, if one was given.
        gpu: Option<String>,
        /// The hold limit asked for.
        max_hold_ms: Option<u64>,
    },
    /// One process.
    Pid {
        /// The process.
        pid: u32,
    },
    /// Several processes (those a resume-all resumed; none when it failed).
    Pids {
        /// The processes.
        pids: Option<Vec<u32>>,
    },
    /// What a gate start asked for.
    Gate(Box<GateSpec>),
    /// The settings the daemon started with (its config file, with a digest of its text).
    Config(serde_json::Value),
    /// Nothing in particular (`{}`).
    Nothing {},
}

/// A failed event's exit code and message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AuditError {
    /// The exit code.
    pub code: i32,
    /// The message.
    pub message: String,
}

/// Where audit records go.
pub struct Audit {
    file: Option<(PathBuf, Mutex<File>)>,
}

impl Audit {
    /// Records go to the log only.
    pub fn log_only() -> Self {
        Audit { file: None }
    }

    /// Records also go, one JSON line each, to `path` (appended; created mode 0640).
    pub fn to_file(path: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .open(path)?;
        Ok(Audit {
            file: Some((path.to_path_buf(), Mutex::new(f))),
        })
    }

    /// The audit event of a request, if it is one that changes something (`None` for
    /// `ps`, `status`, `gate status`, busy/idle signals).
    pub fn event_of(req: &Request) -> Option<(&'static str, Targets)> {
        Some(match req {
            Request::Preempt {
                pid,
                gpu,
                max_hold_ms,
                ..
            } => (
                "preempt",
                Targets::Preempt {
                    pid: *pid,
                    gpu: gpu.clone(),
                    max_hold_ms: *max_hold_ms,
                },
            ),
            Request::Resume { pid } => ("resume", Targets::Pid { pid: *pid }),
            Request::ResumeAll => ("resume_all", Targets::Nothing {}),
            Request::GateStart(spec) => ("gate_start", Targets::Gate(spec.clone())),
            Request::GateStop => ("gate_stop", Targets::Nothing {}),
            Request::Hello { .. }
            | Request::Ps
            | Request::Status
            | Request::GateStatus
            | Request::GateTrace { .. }
            | Request::Harvest
            | Request::OnlineBusy
            | Request::OnlineIdle => return None,
        })
    }

    /// Records a served request, given its [`Audit::event_of`] (taken before the request was
    /// handed over); `None` records nothing.
    pub fn served(&self, caller: Caller, event: Option<(&'static str, Targets)>, reply: &Reply) {
        if let Some((event, mut targets)) = event {
            if event == "resume_all" {
                let pids = match &reply.data {
                    Some(Data::ResumeAll(r)) => Some(r.resumed.clone()),
                    _ => None,
                };
                targets = Targets::Pids { pids };
            }
            self.record(event, caller, targets, reply);
        }
    }

    /// Records one event with the reply that ended it.
    pub fn record(&self, event: &'static str, caller: Caller, targets: Targets, reply: &Reply) {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.write(&AuditRecord {
            ts,
            event,
            caller,
            targets,
            outcome: if reply.error.is_none() { "ok" } else { "error" },
            error: reply.error.as_ref().map(|e| AuditError {
                code: e.code,
                message: e.message.clone(),
            }),
        });
    }

    fn write(&self, r: &AuditRecord) {
        let line = serde_json::to_string(r).expect("audit records serialise");
        tracing::info!(
            target: "valve_audit",
            event = r.event,
            uid = r.caller.uid,
            pid = r.caller.pid,
            targets = %serde_json::to_string(&r.targets).unwrap_or_default(),
            outcome = r.outcome,
            error = r.error.as_ref().map(|e| format!("{} (exit code {})", e.message, e.code)),
            "audit"
        );
        if let Some((path, f)) = &self.file {
            let mut f = f.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Err(e) = writeln!(f, "{line}") {
                tracing::error!("writing the audit log {}: {e}", path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ErrorCode, PreemptReply, ResumeAllReply};
    use serde_json::{json, Value};

    #[test]
    fn records_name_the_caller_the_targets_and_the_outcome() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit/audit.jsonl");
        let audit = Audit::to_file(&path).unwrap();
        let caller = Caller {
            uid: 1000,
            gid: 1000,
            pid: 4242,
        };
        let preempt = Request::Preempt {
            pid: 77,
            gpu: Some("1".into()),
            max_hold_ms: Some(500),
            confirm: false,
        };
        let served = |req: &Request, reply: &Reply| {
            audit.served(caller, Audit::event_of(req), reply);
        };
        served(
            &preempt,
            &Reply::ok(PreemptReply {
                pid: 77,
                ..PreemptReply::default()
            }),
        );
        served(&Request::Status, &Reply::empty());
        served(
            &Request::Resume { pid: 78 },
            &Reply::fail(ErrorCode::Process, "process 78 is not preempted"),
        );
        served(
            &Request::ResumeAll,
            &Reply::ok(ResumeAllReply { resumed: vec![77] }),
        );
        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "status is not audited: {lines:?}");
        assert_eq!(lines[0]["event"], "preempt");
        assert_eq!(lines[0]["caller"]["uid"], 1000);
        assert_eq!(lines[0]["caller"]["pid"], 4242);
        assert_eq!(lines[0]["targets"]["pid"], 77);
        assert_eq!(lines[0]["targets"]["gpu"], "1");
        assert_eq!(lines[0]["outcome"], "ok");
        assert_eq!(lines[1]["outcome"], "error");
        assert_eq!(lines[1]["error"]["code"], 8);
        assert_eq!(lines[2]["targets"]["pids"], json!([77]));
    }
}
