//! The audit trail: one record per preempt, resume, gate start/stop, refused caller and config
//! load, with the caller's uid and pid (SO_PEERCRED) and the targets, as a `tracing` event
//! (target `valve_audit`) and, if configured, a JSON line appended to a file.
//!
//! Records are written after the request was answered, never on the way to a disable.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use serde_json::{json, Value};

use crate::protocol::{Reply, Request};

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
    pub targets: Value,
    /// `ok` or `error`.
    pub outcome: &'static str,
    /// The error's exit code and message, if it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
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
    pub fn event_of(req: &Request) -> Option<(&'static str, Value)> {
        Some(match req {
            Request::Preempt {
                pid,
                gpu,
                max_hold_ms,
            } => (
                "preempt",
                json!({"pid": pid, "gpu": gpu, "max_hold_ms": max_hold_ms}),
            ),
            Request::Resume { pid } => ("resume", json!({"pid": pid})),
            Request::ResumeAll => ("resume_all", json!({})),
            Request::GateStart(spec) => ("gate_start", json!(spec)),
            Request::GateStop => ("gate_stop", json!({})),
            Request::Ps
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
    pub fn served(&self, caller: Caller, event: Option<(&'static str, Value)>, reply: &Reply) {
        if let Some((event, mut targets)) = event {
            if event == "resume_all" {
                targets = json!({"pids": reply.data.get("resumed")});
            }
            self.record(event, caller, targets, reply);
        }
    }

    /// Records one event with the reply that ended it.
    pub fn record(&self, event: &'static str, caller: Caller, targets: Value, reply: &Reply) {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.write(&AuditRecord {
            ts,
            event,
            caller,
            targets,
            outcome: if reply.error.is_none() { "ok" } else { "error" },
            error: reply
                .error
                .as_ref()
                .map(|e| json!({"code": e.code, "message": e.message})),
        });
    }

    fn write(&self, r: &AuditRecord) {
        let line = serde_json::to_string(r).expect("audit records serialise");
        tracing::info!(
            target: "valve_audit",
            event = r.event,
            uid = r.caller.uid,
            pid = r.caller.pid,
            targets = %r.targets,
            outcome = r.outcome,
            error = r.error.as_ref().map(|e| e.to_string()),
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
        };
        let served = |req: &Request, reply: &Reply| {
            audit.served(caller, Audit::event_of(req), reply);
        };
        served(&preempt, &Reply::ok(json!({"pid": 77})));
        served(&Request::Status, &Reply::ok(json!({})));
        served(
            &Request::Resume { pid: 78 },
            &Reply::err(8, "process 78 is not preempted"),
        );
        served(&Request::ResumeAll, &Reply::ok(json!({"resumed": [77]})));
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
