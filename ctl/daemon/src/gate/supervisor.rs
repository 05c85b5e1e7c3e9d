//! The daemon's side of `valvectl gate`: resolves online and offline processes (by pid or by
//! `VALVE_LABEL`), keeps the gate thread's offline channel set current, forwards busy/idle signals.
//!
//! [`ActiveGate`] never writes the state file itself: [`ActiveGate::refresh`] hands back a new
//! offline set as an [`OfflineUpdate`], which the daemon records in the state file *before* it
//! passes it on with [`ActiveGate::apply`], so a daemon killed while the gate holds offline frozen
//! is undone by its restart. If the gate thread dies, the daemon re-enables [`ActiveGate::records`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use valve::controller::Controller;
use valve::driver::RmDriver;
use valve::state::{reenable, DisabledRecord};
use valve_ebpf::Registry;

use super::policy::{GateConfig, HoldHistory};
use super::ports::{listening_ports, port_owners};
use super::runtime::{ChannelSet, GateHandle, GateInput, GateShared, ProbeState};
use crate::procfs::{alive, all_pids};
use crate::protocol::{ErrorCode, GateSpec, Reply, TraceReply};
use crate::workload::label_of;
use valve::IssueMode;
use valve_ebpf::WatchedPort;
use valve_protocol::control::SignalReply;
use valve_protocol::gate::GateStatus;

/// Starts a gate thread with the given tuning (the real one attaches uprobes and opens the
/// driver, which takes a quarter of a second; tests use the fake RM). It runs on a helper
/// thread, never on the daemon's loop (`core/gate_start.rs`).
pub type GateStarter = Arc<dyn Fn(GateConfig) -> Result<GateHandle, String> + Send + Sync>;

/// The longest the daemon waits for the gate thread to acknowledge its inputs.
pub const SYNC_WITHIN: Duration = Duration::from_secs(2);

/// The longest `gate start` waits, after its first sets are applied, for the probes of the
/// online processes it starts with (see `core/gate_start.rs`). Attaching one process's probes
/// registers a uprobe per libcuda entry point, each taking the write lock of every process that
/// maps libcuda: beside busy offline jobs a full set took 5.6-12.3 s (H100, H200), and under kept
/// watchers a new online process's probes came about 7 s after the start had answered
/// (hardware test, docs/results). 20 s covers those with room, and still answers if an attach hangs.
pub const PROBES_WITHIN: Duration = Duration::from_secs(20);

/// How often labels are looked up again in `/proc`.
const LABEL_RESCAN: Duration = Duration::from_secs(1);

/// The uprobe launch watcher reports idle->busy edges after this much silence; each carries its
/// gap, which is what the policy learns iteration gaps from.
pub const GATE_EDGE_GAP: Duration = Duration::from_micros(200);

/// A running gate as the daemon sees it.
pub struct ActiveGate {
    handle: GateHandle,
    spec: GateSpec,
    /// The offline channels last sent to the gate thread (and recorded in the state file).
    pub(crate) records: Vec<DisabledRecord>,
    online: BTreeSet<u32>,
    labels: BTreeMap<u32, Option<String>>,
    labels_scanned: Option<Instant>,
    /// Processes listening on the `--online-port`s (looked up with the labels), by port.
    port_owners: BTreeMap<u16, BTreeSet<u32>>,
    /// The gate thread's arrival count at the last refresh.
    arrivals_seen: u64,
    /// The ports whose arrivals the gate thread watches.
    ports: BTreeSet<WatchedPort>,
    ports_scanned: Option<Instant>,
}

/// Whether a refresh reads `/proc` again for labels and listening ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rescan {
    /// Now (a new gate, an operator's request).
    Now,
    /// If the last scan is a second old (the daemon's loop).
    IfDue,
    /// Not at all: a preemption's path, where a scan of every process costs milliseconds.
    Never,
}

/// A new offline channel set from [`ActiveGate::refresh`]: record it, then [`ActiveGate::apply`]
/// it.
#[must_use = "record the offline set in the state file, then apply it"]
pub struct OfflineUpdate(Vec<DisabledRecord>);

fn config_of(spec: &GateSpec) -> Result<GateConfig, String> {
    let d = GateConfig::default();
    let us = |v: Option<u64>, default: Duration| v.map(Duration::from_micros).unwrap_or(default);
    let cfg = GateConfig {
        cooldown_floor: us(spec.cooldown_floor_us, d.cooldown_floor),
        cooldown_ceiling: us(spec.cooldown_ceiling_us, d.cooldown_ceiling),
        gap_factor: spec.gap_factor.unwrap_or(d.gap_factor),
        gap_memory: spec
            .gap_memory_ms
            .map(Duration::from_millis)
            .unwrap_or(d.gap_memory),
        delay_window: d.delay_window,
        fixed_cooldown: spec.fixed_cooldown_us.map(Duration::from_micros),
        hold_budget: spec.hold_budget_pct.map(|pct| pct / 100.0),
        arrivals: spec.arrivals.unwrap_or(true),
        waits: spec.waits.unwrap_or(true),
        arrival_busy_poll: spec.arrival_busy_poll.unwrap_or(false),
        realtime: match spec.realtime_priority {
            None => d.realtime,
            Some(0) => None,
            Some(p @ 1..=99) => Some(p),
            Some(p) => {
                return Err(format!(
                    "--realtime-priority must be 0 (off) or 1-99 (SCHED_FIFO), got {p}"
                ))
            }
        },
        issue: match spec.issue.as_deref() {
            None | Some("auto") => None,
            Some("serial") => Some(IssueMode::Serial),
            Some("parallel") => Some(IssueMode::Parallel),
            Some(other) => {
                return Err(format!(
                    "--issue must be auto, serial or parallel, got {other:?}"
                ))
            }
        },
    };
    if cfg.cooldown_floor > cfg.cooldown_ceiling {
        return Err(format!(
            "--cooldown-floor ({:?}) is above --cooldown-ceiling ({:?})",
            cfg.cooldown_floor, cfg.cooldown_ceiling
        ));
    }
    if cfg.arrival_busy_poll && !cfg.arrivals {
        return Err(
            "--arrival-busy-poll polls request arrivals, which this gate turns off \
             (--no-arrivals): drop one of the two"
                .into(),
        );
    }
    if cfg.gap_memory.is_zero() {
        return Err(
            "--gap-memory must be at least 1ms (the cooldown is learned from the gaps \
                    it remembers)"
                .into(),
        );
    }
    if !(cfg.gap_factor.is_finite() && cfg.gap_factor >= 1.0) {
        return Err(format!(
            "--gap-factor must be at least 1 (the cooldown must outlast one gap), got {}",
            cfg.gap_factor
        ));
    }
    if let Some(pct) = spec.hold_budget_pct {
        if !(pct.is_finite() && pct > 0.0 && pct <= 50.0) {
            return Err(format!(
                "--hold-budget must be more than 0% and at most 50% of online's idle time, got {pct}%"
            ));
        }
        if cfg.fixed_cooldown.is_some() {
            return Err(
                "--hold-budget adds to the learned cooldown, which a fixed cooldown \
                 (--fixed-cooldown, or the config's gate.fixed_cooldown) replaces: drop one"
                    .into(),
            );
        }
    }
    Ok(cfg)
}

/// Checks which processes a gate names; the error is the reply to `gate start`.
fn check_spec(spec: &GateSpec) -> Result<(), Reply> {
    let label_ok = |l: &Option<String>| l.as_deref().is_none_or(|s| !s.is_empty());
    if !label_ok(&spec.online_label) || !label_ok(&spec.offline_label) {
        return Err(Reply::fail(
            ErrorCode::BadRequest,
            "a label must not be empty",
        ));
    }
    if spec.online.is_empty() && spec.online_label.is_none() && spec.online_ports.is_empty() {
        return Err(Reply::fail(
            ErrorCode::BadRequest,
            "name the online service: --online PID[,PID...], --online-label LABEL or \
             --online-port PORT[,PORT...]",
        ));
    }
    if spec.online_ports.contains(&0) {
        return Err(Reply::fail(
            ErrorCode::BadRequest,
            "--online-port 0 is no port",
        ));
    }
    if spec.offline.is_empty() && spec.offline_label.is_none() {
        return Err(Reply::fail(
            ErrorCode::BadRequest,
            "name the offline processes: --offline PID[,PID...] or --offline-label LABEL \
             (nothing else is ever frozen)",
        ));
    }
    if let Some(p) = spec.online.iter().find(|p| spec.offline.contains(p)) {
        return Err(Reply::fail(
            ErrorCode::BadRequest,
            format!("pid {p} is named both online and offline"),
        ));
    }
    if spec.online_label.is_some() && spec.online_label == spec.offline_label {
        return Err(Reply::fail(
            ErrorCode::BadRequest,
            "the online and offline labels are the same",
        ));
    }
    for &pid in spec.online.iter().chain(&spec.offline) {
        if !alive(pid) {
            return Err(Reply::fail(
                ErrorCode::Process,
                format!("no such process: {pid}"),
            ));
        }
    }
    Ok(())
}

impl ActiveGate {
    /// Checks `spec` (the processes it names, its tuning); the error is the reply to `gate
    /// start`. `not_discoverable` names the reason an offline pid can never be gated (it started
    /// before the daemon), if it is one. Cheap: the daemon's loop calls it.
    pub fn check(
        spec: &GateSpec,
        not_discoverable: impl Fn(u32) -> Option<String>,
    ) -> Result<GateConfig, Reply> {
        check_spec(spec)?;
        if let Some(reason) = spec.offline.iter().find_map(|&p| not_discoverable(p)) {
            return Err(Reply::fail(ErrorCode::Process, reason));
        }
        config_of(spec).map_err(|e| Reply::fail(ErrorCode::BadRequest, e))
    }

    /// Starts a gate thread for a checked `spec` and looks its labels and ports up in /proc
    /// once. Slow (the starter attaches BPF programs): run it off the daemon's loop. The gate
    /// holds nothing until the daemon records and applies its first offline set.
    pub fn launch(spec: GateSpec, cfg: GateConfig, starter: &GateStarter) -> Result<Self, Reply> {
        let handle = starter(cfg)
            .map_err(|e| Reply::fail(ErrorCode::Bpf, format!("starting the gate: {e}")))?;
        let mut gate = ActiveGate {
            handle,
            spec,
            records: Vec::new(),
            online: BTreeSet::new(),
            labels: BTreeMap::new(),
            labels_scanned: None,
            port_owners: BTreeMap::new(),
            arrivals_seen: 0,
            ports: BTreeSet::new(),
            ports_scanned: None,
        };
        let t = Instant::now();
        gate.rescan_labels(t, Rescan::Now);
        tracing::info!(
            took_us = t.elapsed().as_micros() as u64,
            "gate start: labels and ports looked up"
        );
        Ok(gate)
    }

    /// The decision trace after sequence number `after`.
    pub fn trace(&self, after: u64, limit: usize) -> TraceReply {
        TraceReply {
            head: self.handle.status().trace_head,
            records: self
                .handle
                .trace(after, limit)
                .iter()
                .map(|r| r.entry())
                .collect(),
        }
    }

    /// What the gate thread shares: its status and its decision trace.
    pub fn shared(&self) -> std::sync::Arc<GateShared> {
        self.handle.shared()
    }

    /// The online processes the gate thread watches now.
    pub fn online(&self) -> &BTreeSet<u32> {
        &self.online
    }

    /// Whether the gate thread has ended.
    pub fn handle_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// The offline channels the gate may disable now (recorded in the state file).
    pub fn records(&self) -> &[DisabledRecord] {
        &self.records
    }

    /// Those of `pids` whose probes are in `state` now (a pid no longer online is in none).
    pub fn probes_in(&self, pids: &[u32], state: ProbeState) -> Vec<u32> {
        let probes = self.handle.probes();
        pids.iter()
            .copied()
            .filter(|p| probes.get(p) == Some(&state))
            .collect()
    }

    /// Offline pids named by pid that have no GPU channels yet.
    pub fn waiting(&self) -> Vec<u32> {
        self.spec
            .offline
            .iter()
            .copied()
            .filter(|p| !self.records.iter().any(|r| r.pid == *p))
            .collect()
    }

    /// The status `valvectl gate status` prints.
    pub fn status(&self) -> GateStatus {
        GateStatus {
            online_label: self.spec.online_label.clone(),
            offline_label: self.spec.offline_label.clone(),
            arrivals_on: self.spec.arrivals.unwrap_or(true),
            ..self.handle.status()
        }
    }

    /// Stops the gate thread (it enables offline) and returns its final status, and the hold's
    /// gaps between requests as it left them ([`Self::history_key`] names the service they belong
    /// to). If the thread had panicked, offline is re-enabled here.
    pub fn stop<D: RmDriver>(self, ctl: &Controller<D>) -> (GateStatus, HoldHistory) {
        let shared = self.handle.shared();
        let (status, panicked) = self.handle.stop();
        if let Some(e) = panicked {
            // Its Drop has run during the unwind; make sure anyway.
            let (_, failures) = reenable(ctl, &self.records);
            tracing::error!("{e}; re-enabled offline from the daemon, failures: {failures:?}");
        }
        (status, shared.hold_history())
    }

    /// Hands the gate the gaps between requests an earlier gate on the same service learned, so
    /// that its hold starts from them.
    pub fn seed_hold(&self, history: HoldHistory) {
        self.handle.send(GateInput::HoldHistory(history));
    }

    /// This gate's [`Self::history_key_of`].
    pub fn history_key(&self) -> String {
        Self::history_key_of(&self.spec)
    }

    /// The online service a gate serves, as far as its hold's history goes: its ports, label and
    /// pids as asked. A gate asked for the same ones serves the same traffic.
    pub fn history_key_of(spec: &GateSpec) -> String {
        let mut ports = spec.online_ports.clone();
        ports.sort_unstable();
        ports.dedup();
        let mut pids = spec.online.clone();
        pids.sort_unstable();
        pids.dedup();
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let ports: Vec<u32> = ports.into_iter().map(u32::from).collect();
        format!(
            "ports={} label={} pids={}",
            list(&ports),
            spec.online_label.as_deref().unwrap_or(""),
            list(&pids)
        )
    }

    /// Passes a busy (`true`) or idle signal of the serving framework to the gate thread.
    pub fn signal(&self, busy: bool) -> SignalReply {
        self.handle.send(if busy {
            GateInput::Busy
        } else {
            GateInput::Idle
        });
        SignalReply {
            signal: if busy { "busy" } else { "idle" }.into(),
            queued: false,
        }
    }

    /// Brings the gate thread's online set up to date and works out its offline channels from
    /// the registry (labels and ports are looked up again as `rescan` says). A process for
    /// which `by_hand` is true was preempted by the operator and is left alone. Returns the new
    /// offline set if it changed: record it, then [`ActiveGate::apply`] it.
    pub fn refresh(
        &mut self,
        now: Instant,
        rescan: Rescan,
        registry: &Registry,
        by_hand: impl Fn(u32) -> bool,
    ) -> Option<OfflineUpdate> {
        let rescan = self.owner_lookup(rescan);
        self.rescan_labels(now, rescan);
        let online: BTreeSet<u32> = self
            .spec
            .online
            .iter()
            .copied()
            .filter(|&p| alive(p))
            .chain(self.labelled(&self.spec.online_label))
            .chain(
                self.port_owners
                    .values()
                    .flatten()
                    .copied()
                    .filter(|&p| alive(p)),
            )
            .collect();
        // Online is never frozen, whatever its label; a pid preempted by hand stays the
        // operator's until `resume --pid`.
        let offline: BTreeSet<u32> = self
            .spec
            .offline
            .iter()
            .copied()
            .chain(self.labelled(&self.spec.offline_label))
            .filter(|p| !online.contains(p) && !by_hand(*p))
            .collect();
        let records = offline_records(&offline, registry);
        let online_changed = online != self.online;
        if online_changed {
            self.online = online.clone();
            self.handle.send(GateInput::Online(online));
        }
        // An online process that exited takes its ports along, whatever `rescan` says.
        let ports_rescan = if online_changed { Rescan::Now } else { rescan };
        if let Some(ports) = self.rescanned_ports(now, ports_rescan) {
            if ports != self.ports {
                self.ports = ports.clone();
                self.handle.send(GateInput::Ports(ports));
            }
        }
        if records != self.records {
            self.records = records.clone();
            return Some(OfflineUpdate(records));
        }
        None
    }

    /// Takes `pid` out of the gate's hands for a manual preempt, without waiting for the gate
    /// thread; returns whether the gate held all of `channels` disabled (they are the caller's
    /// now). See [`GateHandle::claim`].
    pub fn claim(&self, pid: u32, channels: &ChannelSet) -> bool {
        self.handle.claim(pid, channels)
    }

    /// Tells the gate thread that these channels come back from a manual preempt disabled.
    pub fn adopt(&self, records: Vec<DisabledRecord>) {
        self.handle.send(GateInput::Adopt(records));
    }

    /// Sends a recorded offline set to the gate thread.
    pub fn apply(&self, update: OfflineUpdate) {
        self.handle.send(GateInput::Offline(update.0));
    }

    /// Waits (up to [`SYNC_WITHIN`]) until the gate thread has applied every input sent so far.
    pub fn sync(&self) {
        let _ = self.sync_later().recv_timeout(SYNC_WITHIN);
    }

    /// Asks the gate thread to say when it has applied every input sent so far, without waiting:
    /// the receiver gets a message then (or is disconnected if the thread has ended).
    pub fn sync_later(&self) -> Receiver<()> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.send(GateInput::Sync(tx));
        rx
    }

    /// Whether this refresh must look the listeners up now: an arrival came on an
    /// `--online-port` none of whose known listeners is alive (a server restarted on it), so the
    /// new server is named online, and probed, before its first request is done rather than at
    /// the next scan (up to [`LABEL_RESCAN`] later).
    fn owner_lookup(&mut self, rescan: Rescan) -> Rescan {
        let seen = self.handle.shared().arrivals_taken();
        if seen == self.arrivals_seen {
            return rescan;
        }
        self.arrivals_seen = seen;
        let unknown = self.spec.online_ports.iter().find(|port| {
            !self
                .port_owners
                .get(port)
                .is_some_and(|o| o.iter().any(|&p| alive(p)))
        });
        match unknown {
            Some(port) => {
                tracing::info!(
                    "an arrival on port {port}, whose listener is unknown: looking it up"
                );
                Rescan::Now
            }
            None => rescan,
        }
    }

    fn rescan_labels(&mut self, now: Instant, rescan: Rescan) {
        let rescan = due(rescan, self.labels_scanned, now);
        let by_label = self.spec.online_label.is_some() || self.spec.offline_label.is_some();
        if rescan && (by_label || !self.spec.online_ports.is_empty()) {
            let pids = all_pids();
            let live: BTreeSet<u32> = pids.iter().copied().collect();
            if by_label {
                self.labels.retain(|p, _| live.contains(p));
                for &p in &pids {
                    self.labels.entry(p).or_insert_with(|| label_of(p));
                }
            }
            let proc_root = std::path::Path::new("/proc");
            self.port_owners = self
                .spec
                .online_ports
                .iter()
                .map(|&port| {
                    (
                        port,
                        port_owners(proc_root, port, &pids).into_iter().collect(),
                    )
                })
                .collect();
            self.labels_scanned = Some(now);
        }
    }

    /// The ports to watch for arrivals, looked up again on the label cadence (`None`: not due).
    /// `--online-port`s count in every network namespace; the ports the online processes
    /// listen on count in theirs.
    fn rescanned_ports(&mut self, now: Instant, rescan: Rescan) -> Option<BTreeSet<WatchedPort>> {
        if !self.spec.arrivals.unwrap_or(true) {
            return None;
        }
        if !due(rescan, self.ports_scanned, now) {
            return None;
        }
        self.ports_scanned = Some(now);
        let proc_root = std::path::Path::new("/proc");
        let named = self
            .spec
            .online_ports
            .iter()
            .map(|&port| WatchedPort { port, netns: 0 });
        let listened = self
            .online
            .iter()
            .flat_map(|&pid| listening_ports(proc_root, pid));
        Some(named.chain(listened).collect())
    }

    fn labelled(&self, label: &Option<String>) -> Vec<u32> {
        match label {
            Some(l) => self
                .labels
                .iter()
                .filter(|(_, v)| v.as_ref() == Some(l))
                .map(|(p, _)| *p)
                .collect(),
            None => Vec::new(),
        }
    }
}

/// Whether a scan last done at `last` is to be done again at `now`.
fn due(rescan: Rescan, last: Option<Instant>, now: Instant) -> bool {
    match rescan {
        Rescan::Now => true,
        Rescan::IfDue => last.is_none_or(|t| now.duration_since(t) >= LABEL_RESCAN),
        Rescan::Never => false,
    }
}

/// Every channel of the given processes, per process and GPU, from the registry.
fn offline_records(offline: &BTreeSet<u32>, registry: &Registry) -> Vec<DisabledRecord> {
    let mut records = Vec::new();
    for &pid in offline {
        for v in registry.gpus(pid) {
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
    records
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_s_service_is_its_online_ports_pids_and_label_as_asked() {
        let spec = |ports: Vec<u16>, pids: Vec<u32>, label: Option<&str>| GateSpec {
            online_ports: ports,
            online: pids,
            online_label: label.map(str::to_string),
            ..GateSpec::default()
        };
        let a = ActiveGate::history_key_of(&spec(vec![8001, 8000, 8000], vec![], None));
        assert_eq!(
            a,
            ActiveGate::history_key_of(&spec(vec![8000, 8001], vec![], None))
        );
        assert_ne!(
            a,
            ActiveGate::history_key_of(&spec(vec![8000], vec![], None))
        );
        assert_ne!(
            a,
            ActiveGate::history_key_of(&spec(vec![8000, 8001], vec![7], None))
        );
        assert_ne!(
            a,
            ActiveGate::history_key_of(&spec(vec![8000, 8001], vec![], Some("x")))
        );
    }

    #[test]
    fn a_preemptions_refresh_never_scans_proc_even_when_a_scan_is_due() {
        let now = Instant::now();
        let stale = now.checked_sub(2 * LABEL_RESCAN);
        assert!(due(Rescan::IfDue, stale, now) && due(Rescan::IfDue, None, now));
        assert!(!due(Rescan::IfDue, Some(now), now));
        assert!(!due(Rescan::Never, stale, now) && !due(Rescan::Never, None, now));
        assert!(due(Rescan::Now, Some(now), now));
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
        let bad = GateSpec {
            gap_memory_ms: Some(0),
            ..GateSpec::default()
        };
        assert!(config_of(&bad).unwrap_err().contains("--gap-memory"));
        let memory = |ms| {
            config_of(&GateSpec {
                gap_memory_ms: ms,
                ..GateSpec::default()
            })
            .unwrap()
            .gap_memory
        };
        assert_eq!(
            memory(None),
            Duration::from_secs(60),
            "a minute unless told"
        );
        assert_eq!(memory(Some(5_000)), Duration::from_secs(5));
        let ok = GateSpec {
            fixed_cooldown_us: Some(0),
            ..GateSpec::default()
        };
        assert_eq!(config_of(&ok).unwrap().fixed_cooldown, Some(Duration::ZERO));
        let hold = |pct, fixed| {
            config_of(&GateSpec {
                hold_budget_pct: Some(pct),
                fixed_cooldown_us: fixed,
                ..GateSpec::default()
            })
        };
        assert_eq!(hold(10.0, None).unwrap().hold_budget, Some(0.1));
        for bad in [0.0, -5.0, 51.0, f64::NAN] {
            assert!(
                hold(bad, None).unwrap_err().contains("at most 50%"),
                "{bad}"
            );
        }
        assert!(hold(10.0, Some(0)).unwrap_err().contains("drop one"));
        let rt = |p: Option<u8>| {
            config_of(&GateSpec {
                realtime_priority: p,
                ..GateSpec::default()
            })
        };
        assert_eq!(rt(None).unwrap().realtime, Some(10), "on by default");
        assert_eq!(rt(Some(0)).unwrap().realtime, None, "0 turns it off");
        assert_eq!(rt(Some(42)).unwrap().realtime, Some(42));
        assert!(rt(Some(100)).unwrap_err().contains("1-99"));
        let spin = |arrivals| {
            config_of(&GateSpec {
                arrivals: Some(arrivals),
                arrival_busy_poll: Some(true),
                ..GateSpec::default()
            })
        };
        assert!(spin(true).unwrap().arrival_busy_poll);
        assert!(spin(false).unwrap_err().contains("--no-arrivals"));
    }
}
