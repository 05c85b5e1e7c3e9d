//! The daemon's side of `valvectl gate`: resolves online and offline processes (by pid or by
//! `VALVE_LABEL`), keeps the gate thread's offline channel set current and recorded, forwards
//! busy/idle signals, and re-enables offline itself if the gate thread ever dies.
//!
//! The offline set is written to the state file *before* the gate thread learns of it, so a
//! daemon killed while the gate holds offline frozen is undone by its restart.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::json;
use valve::driver::RmDriver;
use valve::state::{reenable, DisabledRecord};

use super::runtime::GateHandle;
use super::{GateConfig, GateInput};
use crate::core::{alive, DaemonCore, EXIT_BPF, EXIT_PROCESS};
use crate::protocol::{GateSpec, Reply};

/// The environment variable that labels a process for `--online-label` / `--offline-label`.
pub const LABEL_VAR: &str = "VALVE_LABEL";

/// Starts a gate thread with the given tuning (the real one attaches uprobes and opens the
/// driver; tests use the fake RM).
pub type GateStarter = Box<dyn Fn(GateConfig) -> Result<GateHandle, String> + Send>;

/// How often labels are looked up again in `/proc`.
const LABEL_RESCAN: Duration = Duration::from_secs(1);

/// A running gate as the daemon sees it.
pub(crate) struct ActiveGate {
    handle: GateHandle,
    spec: GateSpec,
    /// The offline channels last sent to the gate thread (and recorded in the state file).
    pub(crate) records: Vec<DisabledRecord>,
    online: BTreeSet<u32>,
    labels: BTreeMap<u32, Option<String>>,
    labels_scanned: Option<Instant>,
}

impl ActiveGate {
    /// Whether the gate thread has ended.
    pub(crate) fn handle_finished(&self) -> bool {
        self.handle.is_finished()
    }
}

/// `VALVE_LABEL` of a process, from its environment at exec (root can read any).
pub fn process_label(pid: u32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{LABEL_VAR}=");
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

fn config_of(spec: &GateSpec) -> Result<GateConfig, String> {
    let d = GateConfig::default();
    let us = |v: Option<u64>, default: Duration| v.map(Duration::from_micros).unwrap_or(default);
    let cfg = GateConfig {
        cooldown_floor: us(spec.cooldown_floor_us, d.cooldown_floor),
        cooldown_ceiling: us(spec.cooldown_ceiling_us, d.cooldown_ceiling),
        gap_factor: spec.gap_factor.unwrap_or(d.gap_factor),
        gap_window: d.gap_window,
        fixed_cooldown: spec.fixed_cooldown_us.map(Duration::from_micros),
    };
    if cfg.cooldown_floor > cfg.cooldown_ceiling {
        return Err(format!(
            "--cooldown-floor ({:?}) is above --cooldown-ceiling ({:?})",
            cfg.cooldown_floor, cfg.cooldown_ceiling
        ));
    }
    if !(cfg.gap_factor.is_finite() && cfg.gap_factor >= 1.0) {
        return Err(format!(
            "--gap-factor must be at least 1 (the cooldown must outlast one gap), got {}",
            cfg.gap_factor
        ));
    }
    Ok(cfg)
}

impl<D: RmDriver> DaemonCore<D> {
    /// Sets how gate threads are started (without one, `gate start` is refused).
    pub fn set_gate_starter(&mut self, starter: GateStarter) {
        self.gate_starter = Some(starter);
    }

    pub(crate) fn gate_start(&mut self, spec: GateSpec) -> Reply {
        if self.gate.is_some() {
            return Reply::err(
                1,
                "a gate is already running (see `valvectl gate status`); stop it first with \
                 `valvectl gate stop`",
            );
        }
        let label_ok = |l: &Option<String>| l.as_deref().is_none_or(|s| !s.is_empty());
        if !label_ok(&spec.online_label) || !label_ok(&spec.offline_label) {
            return Reply::err(2, "a label must not be empty");
        }
        if spec.online.is_empty() && spec.online_label.is_none() {
            return Reply::err(
                2,
                "name the online processes: --online PID[,PID...] or --online-label LABEL",
            );
        }
        if spec.offline.is_empty() && spec.offline_label.is_none() {
            return Reply::err(
                2,
                "name the offline processes: --offline PID[,PID...] or --offline-label LABEL \
                 (nothing else is ever frozen)",
            );
        }
        if let Some(p) = spec.online.iter().find(|p| spec.offline.contains(p)) {
            return Reply::err(2, format!("pid {p} is named both online and offline"));
        }
        if spec.online_label.is_some() && spec.online_label == spec.offline_label {
            return Reply::err(2, "the online and offline labels are the same");
        }
        for &pid in spec.online.iter().chain(&spec.offline) {
            if !alive(pid) {
                return Reply::err(EXIT_PROCESS, format!("no such process: {pid}"));
            }
        }
        if let Some(&pid) = spec.offline.iter().find(|p| self.pre_existing.contains(p)) {
            return Reply::err(EXIT_PROCESS, self.no_channels_reason(pid));
        }
        let cfg = match config_of(&spec) {
            Ok(c) => c,
            Err(e) => return Reply::err(2, e),
        };
        let Some(starter) = &self.gate_starter else {
            return Reply::err(1, "this daemon cannot run a gate");
        };
        let handle = match starter(cfg) {
            Ok(h) => h,
            Err(e) => return Reply::err(EXIT_BPF, format!("starting the gate: {e}")),
        };
        self.gate = Some(ActiveGate {
            handle,
            spec,
            records: Vec::new(),
            online: BTreeSet::new(),
            labels: BTreeMap::new(),
            labels_scanned: None,
        });
        // The reply must show the sets the gate thread works with, not a status from before it
        // applied them.
        self.sync_gate();
        let status = self.gate_status();
        let waiting: Vec<u32> = self
            .gate
            .as_ref()
            .map(|g| {
                g.spec
                    .offline
                    .iter()
                    .copied()
                    .filter(|p| !g.records.iter().any(|r| r.pid == *p))
                    .collect()
            })
            .unwrap_or_default();
        let mut data = status.data;
        if !waiting.is_empty() {
            data["note"] = json!(format!(
                "offline pid(s) {waiting:?} have no GPU channels yet; they are gated as soon as \
                 they create them"
            ));
        }
        Reply::ok(data)
    }

    pub(crate) fn gate_status(&self) -> Reply {
        match &self.gate {
            Some(g) => {
                let mut v = json!(g.handle.status());
                v["online_label"] = json!(g.spec.online_label);
                v["offline_label"] = json!(g.spec.offline_label);
                Reply::ok(v)
            }
            None => Reply::ok(json!({"running": false})),
        }
    }

    /// Stops the gate (its thread enables offline) and drops its records.
    pub fn gate_stop(&mut self) -> Reply {
        let Some(g) = self.gate.take() else {
            return Reply::err(
                1,
                "no gate is running (start one with `valvectl gate start`)",
            );
        };
        let (status, panicked) = g.handle.stop();
        if let Some(e) = panicked {
            // Its Drop has run during the unwind; make sure anyway.
            let (_, failures) = reenable(&self.ctl, &g.records);
            tracing::error!("{e}; re-enabled offline from the daemon, failures: {failures:?}");
        }
        if let Err(e) = self.save() {
            tracing::error!("updating the state file: {e}");
        }
        Reply::ok(json!(status))
    }

    pub(crate) fn gate_signal(&mut self, busy: bool) -> Reply {
        match &self.gate {
            Some(g) => {
                g.handle.send(if busy {
                    GateInput::Busy
                } else {
                    GateInput::Idle
                });
                Reply::ok(json!({"signal": if busy { "busy" } else { "idle" }}))
            }
            None => Reply::err(
                1,
                "no gate is running: start one with `valvectl gate start` before sending \
                 busy/idle signals",
            ),
        }
    }

    /// Brings the gate thread's online and offline sets up to date (labels are looked up again
    /// at most once a second unless `force`), and notices a gate thread that died.
    pub fn refresh_gate(&mut self, now: Instant, force: bool) {
        let Some(g) = self.gate.as_mut() else { return };
        if g.handle_finished() {
            let records = std::mem::take(&mut g.records);
            self.gate = None;
            let (n, failures) = reenable(&self.ctl, &records);
            tracing::error!(
                "the gate thread ended unexpectedly; re-enabled {n} offline channel(s), \
                 failures: {failures:?}"
            );
            if let Err(e) = self.save() {
                tracing::error!("updating the state file: {e}");
            }
            return;
        }
        let rescan = force
            || g.labels_scanned
                .is_none_or(|t| now.duration_since(t) >= LABEL_RESCAN);
        if rescan && (g.spec.online_label.is_some() || g.spec.offline_label.is_some()) {
            let pids = all_pids();
            let live: BTreeSet<u32> = pids.iter().copied().collect();
            g.labels.retain(|p, _| live.contains(p));
            for p in pids {
                g.labels.entry(p).or_insert_with(|| process_label(p));
            }
            g.labels_scanned = Some(now);
        }
        let labelled = |label: &Option<String>| -> Vec<u32> {
            match label {
                Some(l) => g
                    .labels
                    .iter()
                    .filter(|(_, v)| v.as_ref() == Some(l))
                    .map(|(p, _)| *p)
                    .collect(),
                None => Vec::new(),
            }
        };
        let online: BTreeSet<u32> = g
            .spec
            .online
            .iter()
            .copied()
            .filter(|&p| alive(p))
            .chain(labelled(&g.spec.online_label))
            .collect();
        // Online is never frozen, whatever its label; a pid preempted by hand stays the
        // operator's until `resume --pid`.
        let offline: BTreeSet<u32> = g
            .spec
            .offline
            .iter()
            .copied()
            .chain(labelled(&g.spec.offline_label))
            .filter(|p| !online.contains(p) && !self.preempted.contains_key(p))
            .collect();
        let mut records = Vec::new();
        for &pid in &offline {
            for v in self.registry.gpus(pid) {
                let Some(inst) = v.device_instance else {
                    continue;
                };
                let channels: Vec<u32> = v.channels().map(|c| c.handle.0).collect();
                if !channels.is_empty() {
                    records.push(DisabledRecord {
                        pid,
                        device_instance: inst,
                        client: v.client.0,
                        channels,
                    });
                }
            }
        }
        if online != g.online {
            g.online = online.clone();
            g.handle.send(GateInput::Online(online));
        }
        if records != g.records {
            g.records = records.clone();
            // Recorded before the gate thread may disable them.
            if let Err(e) = self.save() {
                tracing::error!("recording the gate's offline channels: {e}");
            }
            if let Some(g) = &self.gate {
                g.handle.send(GateInput::Offline(records));
            }
        }
    }

    /// Tells the gate thread the current sets and waits until it has applied them (so that a
    /// manual preempt/resume of a gated process does not race with the gate's own enable).
    pub(crate) fn sync_gate(&mut self) {
        self.refresh_gate(Instant::now(), true);
        if let Some(g) = &self.gate {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            g.handle.send(GateInput::Sync(tx));
            let _ = rx.recv_timeout(Duration::from_secs(2));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_come_from_the_environment() {
        // This test process has no label unless the environment gives it one.
        let me = std::process::id();
        assert_eq!(
            process_label(me),
            std::env::var(LABEL_VAR).ok(),
            "reads /proc/self/environ"
        );
        assert_eq!(process_label(u32::MAX), None);
    }

    #[test]
    fn tuning_is_validated() {
        let bad = GateSpec {
            cooldown_floor_us: Some(5_000),
            cooldown_ceiling_us: Some(1_000),
            ..GateSpec::default()
        };
        assert!(config_of(&bad).unwrap_err().contains("above"));
        let bad = GateSpec {
            gap_factor: Some(0.5),
            ..GateSpec::default()
        };
        assert!(config_of(&bad).unwrap_err().contains("at least 1"));
        let ok = GateSpec {
            fixed_cooldown_us: Some(0),
            ..GateSpec::default()
        };
        assert_eq!(config_of(&ok).unwrap().fixed_cooldown, Some(Duration::ZERO));
    }
}
