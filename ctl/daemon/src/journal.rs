//! The daemon's journal of the RM events that built its registry, per live process, kept in
//! `/run/valve/` so that a restarted daemon still knows the processes started before it.
//!
//! A process is restored only if it still runs with the same start time (a reused pid never
//! inherits another process's handles). Writes are atomic and at most every `flush` interval.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use valve::error::{Error, Result};
use valve_ebpf::registry::Applied;
use valve_ebpf::{AllocEvent, FreeEvent, Registry, RmEvent, RmEventKind};
use valve_ioctl_bindings::{ClientHandle, ObjectHandle};

/// One registry-relevant event, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    /// true: alloc, false: free.
    alloc: bool,
    client: u32,
    parent: u32,
    object: u32,
    class: u32,
    extra: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct ProcessLog {
    /// Start time of the process (clock ticks since boot, /proc/<pid>/stat field 22).
    start_time: u64,
    events: Vec<Entry>,
}

/// How a process's start time is read (injected by tests).
pub type StartTimeFn = fn(u32) -> Option<u64>;

/// The start time of `pid` from `/proc/<pid>/stat`, or `None` if it does not run.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest begins with field 3 (state); field 22 is the 20th from there.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The journal file and its in-memory copy.
pub struct Journal {
    path: PathBuf,
    processes: BTreeMap<u32, ProcessLog>,
    start_time: StartTimeFn,
    dirty: bool,
    last_write: Option<Instant>,
}

impl Journal {
    /// The journal `<dir>/registry.json`, reading start times with `start_time`.
    pub fn in_dir(dir: &Path, start_time: StartTimeFn) -> Self {
        Journal {
            path: dir.join("registry.json"),
            processes: BTreeMap::new(),
            start_time,
            dirty: false,
            last_write: None,
        }
    }

    /// Loads the file and replays the events of processes that still run with the same start
    /// time into `registry`. Returns the restored pids; the others are dropped.
    pub fn restore(&mut self, registry: &mut Registry) -> Result<Vec<u32>> {
        let saved: BTreeMap<u32, ProcessLog> = match std::fs::read_to_string(&self.path) {
            Ok(text) => match serde_json::from_str(&text) {
                Ok(saved) => saved,
                // Only discovery of processes started before this run is lost: keep running.
                Err(e) => {
                    let aside = self.path.with_extension("json.corrupt");
                    let moved = std::fs::rename(&self.path, &aside);
                    tracing::error!(
                        "the registry journal {} did not parse ({e}); moved aside to {} ({}); \
                         processes started before this daemon are not discoverable until they \
                         restart",
                        self.path.display(),
                        aside.display(),
                        moved.map_or_else(|e| format!("failed: {e}"), |_| "done".into()),
                    );
                    BTreeMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                return Err(Error::Os {
                    op: format!("reading {}", self.path.display()),
                    source: e,
                })
            }
        };
        let mut restored = Vec::new();
        for (pid, log) in saved {
            if (self.start_time)(pid) != Some(log.start_time) {
                self.dirty = true;
                continue;
            }
            for e in &log.events {
                registry.apply(&e.to_event(pid));
            }
            restored.push(pid);
            self.processes.insert(pid, log);
        }
        Ok(restored)
    }

    /// Records an event the registry just applied (events that changed nothing are not kept;
    /// an exit drops the process).
    pub fn record(&mut self, ev: &RmEvent, applied: &Applied) {
        let entry = match (&ev.kind, applied) {
            (RmEventKind::Exit, _) | (_, Applied::ProcessRemoved { .. }) => {
                self.dirty |= self.processes.remove(&ev.pid).is_some();
                return;
            }
            (_, Applied::Ignored(_)) => return,
            (RmEventKind::Alloc(a), _) => Entry {
                alloc: true,
                client: a.client.0,
                parent: a.parent.0,
                object: a.object.0,
                class: a.class,
                extra: a.extra,
            },
            (RmEventKind::Free(f), _) => Entry {
                alloc: false,
                client: f.client.0,
                parent: f.parent.0,
                object: f.object.0,
                class: 0,
                extra: None,
            },
        };
        let start_time = self.start_time;
        let log = self.processes.entry(ev.pid).or_insert_with(|| ProcessLog {
            start_time: start_time(ev.pid).unwrap_or(0),
            events: Vec::new(),
        });
        log.events.push(entry);
        self.dirty = true;
    }

    /// Writes the journal if it changed and `min_interval` passed since the last write.
    pub fn flush_if_due(&mut self, now: Instant, min_interval: Duration) -> Result<()> {
        if self.dirty
            && self
                .last_write
                .is_none_or(|t| now.duration_since(t) >= min_interval)
        {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the journal now (temporary file, rename).
    pub fn flush(&mut self) -> Result<()> {
        let tmp = self.path.with_extension("json.tmp");
        let text = serde_json::to_string(&self.processes).expect("journal serialises");
        std::fs::write(&tmp, text)
            .and_then(|_| std::fs::rename(&tmp, &self.path))
            .map_err(|e| Error::Os {
                op: format!("writing {}", self.path.display()),
                source: e,
            })?;
        self.dirty = false;
        self.last_write = Some(Instant::now());
        Ok(())
    }
}

impl Entry {
    fn to_event(&self, pid: u32) -> RmEvent {
        let kind = if self.alloc {
            RmEventKind::Alloc(AllocEvent {
                client: ClientHandle(self.client),
                parent: ObjectHandle(self.parent),
                object: ObjectHandle(self.object),
                class: self.class,
                extra: self.extra,
                minor: 255,
                nvos64: true,
            })
        } else {
            RmEventKind::Free(FreeEvent {
                client: ClientHandle(self.client),
                parent: ObjectHandle(self.parent),
                object: ObjectHandle(self.object),
                minor: 255,
            })
        };
        RmEvent {
            ts_ns: 0,
            pid,
            tid: pid,
            kind,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_of_this_process_is_stable_and_missing_pids_have_none() {
        let me = std::process::id();
        let a = process_start_time(me).expect("this process runs");
        assert_eq!(process_start_time(me), Some(a));
        assert_eq!(process_start_time(4_190_000), None);
    }
}
