//! `valvectl daemon`: one per node, root. Owns Valve's RM client, the eBPF watcher and the
//! registry of every CUDA process's channels, and serves pid-based preempt/resume over a socket.
//!
//! Everything it disables is written to `/run/valve/disabled.json` *before* the disable, so a
//! restarted daemon re-enables it (a SIGKILLed daemon must not leave a job frozen); the events
//! that built the registry are journaled there too, so a restart still knows running processes. `DaemonCore`
//! holds the logic and is tested with the fake RM; `run` adds the socket, BPF and signals.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use valve::controller::{ChannelTarget, Controller, PreemptMode, PreemptPlan};
use valve::driver::{NvDriver, RmDriver};
use valve::gpu::GpuSelector;
use valve::state::{reenable, DisabledRecord, StateFile};
use valve::Signals;
use valve_ebpf::{Registry, RmEvent, RmEventKind, WatchConfig, Watcher};

use crate::gate::supervisor::{self as gate, GateStarter};
use crate::journal::{process_start_time, Journal, StartTimeFn};
use crate::protocol::{Reply, Request};

/// Exit code: the daemon is not running.
pub const EXIT_NO_DAEMON: i32 = 7;
/// Exit code: no such process, no GPU channels, or not discoverable.
pub const EXIT_PROCESS: i32 = 8;
/// Exit code: BPF or the ioctl tracepoints are unavailable.
pub const EXIT_BPF: i32 = 9;
/// Exit code: RM refused (as in the CLI).
pub const EXIT_RM: i32 = 5;

pub(crate) struct Preempted {
    records: Vec<DisabledRecord>,
    plan: PreemptPlan,
    since: Instant,
    deadline: Option<Instant>,
}

/// The daemon's state and request handling, independent of sockets and BPF.
pub struct DaemonCore<D: RmDriver> {
    pub(crate) ctl: Controller<D>,
    pub(crate) registry: Registry,
    pub(crate) preempted: BTreeMap<u32, Preempted>,
    pub(crate) pre_existing: BTreeSet<u32>,
    state: StateFile,
    journal: Journal,
    max_hold: Option<Duration>,
    started: Instant,
    events: u64,
    /// Channels re-enabled from a previous run's state file at start.
    pub recovered: usize,
    /// Records of the previous run that could not be re-enabled.
    pub recovery_failures: Vec<String>,
    /// Processes whose registry entries were restored from the journal at start.
    pub restored: Vec<u32>,
    pub(crate) gate: Option<gate::ActiveGate>,
    pub(crate) gate_starter: Option<GateStarter>,
}

pub(crate) fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

pub(crate) fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Processes that have an NVIDIA device file open now (other than this one): at daemon start,
/// these are the ones whose RM objects the watcher never saw.
pub fn nvidia_users() -> BTreeSet<u32> {
    let me = std::process::id();
    let mut out = BTreeSet::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
            continue;
        };
        if fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .map(|t| t.to_string_lossy().starts_with("/dev/nvidia"))
                .unwrap_or(false)
        }) {
            out.insert(pid);
        }
    }
    out
}

impl<D: RmDriver> DaemonCore<D> {
    /// Sets up the core and re-enables whatever a previous run left recorded as disabled.
    pub fn new(
        ctl: Controller<D>,
        state: StateFile,
        max_hold: Option<Duration>,
        pre_existing: BTreeSet<u32>,
    ) -> valve::error::Result<Self> {
        Self::with_start_time(ctl, state, max_hold, pre_existing, process_start_time)
    }

    /// [`DaemonCore::new`] with the way process start times are read (for tests).
    pub fn with_start_time(
        ctl: Controller<D>,
        state: StateFile,
        max_hold: Option<Duration>,
        mut pre_existing: BTreeSet<u32>,
        start_time: StartTimeFn,
    ) -> valve::error::Result<Self> {
        let leftover = state.load()?;
        let (recovered, recovery_failures) = reenable(&ctl, &leftover);
        state.save(&[])?;
        let dir = state
            .path()
            .parent()
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let mut journal = Journal::in_dir(&dir, start_time);
        let mut registry = Registry::new();
        let restored = journal.restore(&mut registry)?;
        for pid in &restored {
            pre_existing.remove(pid);
        }
        Ok(DaemonCore {
            ctl,
            registry,
            preempted: BTreeMap::new(),
            pre_existing,
            state,
            journal,
            max_hold,
            started: Instant::now(),
            events: 0,
            recovered,
            recovery_failures,
            restored,
            gate: None,
            gate_starter: None,
        })
    }

    /// Writes the journal now (at shutdown).
    pub fn flush_journal(&mut self) -> valve::error::Result<()> {
        self.journal.flush()
    }

    /// The controller.
    pub fn controller(&self) -> &Controller<D> {
        &self.ctl
    }

    pub(crate) fn save(&self) -> valve::error::Result<()> {
        // What the gate may disable counts too: a restart must not leave it frozen.
        let all: Vec<DisabledRecord> = self
            .preempted
            .values()
            .flat_map(|p| p.records.iter().cloned())
            .chain(self.gate.iter().flat_map(|g| g.records.iter().cloned()))
            .collect();
        self.state.save(&all)
    }

    /// Folds one watcher event into the registry.
    pub fn on_event(&mut self, ev: &RmEvent) {
        self.events += 1;
        let applied = self.registry.apply(ev);
        self.journal.record(ev, &applied);
        if ev.kind == RmEventKind::Exit {
            self.pre_existing.remove(&ev.pid);
            // Its channels are gone with it: nothing left to re-enable.
            if self.preempted.remove(&ev.pid).is_some() {
                if let Err(e) = self.save() {
                    tracing::error!("updating the state file: {e}");
                }
            }
        }
    }

    /// Resumes preemptions whose hold limit has passed; returns their pids.
    pub fn expire(&mut self, now: Instant) -> Vec<u32> {
        if let Err(e) = self.journal.flush_if_due(now, Duration::from_millis(500)) {
            tracing::error!("writing the registry journal: {e}");
        }
        let due: Vec<u32> = self
            .preempted
            .iter()
            .filter(|(_, p)| p.deadline.is_some_and(|d| d <= now))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in &due {
            let r = self.resume(*pid);
            if let Some(e) = r.error {
                tracing::error!("resuming pid {pid} at its hold limit: {}", e.message);
            } else {
                tracing::warn!("pid {pid} reached its maximum hold and was resumed");
            }
        }
        due
    }

    /// Answers one request.
    pub fn handle(&mut self, req: Request) -> Reply {
        match req {
            Request::Ps => self.ps(),
            Request::Status => Reply::ok(json!({
                "uptime_s": self.started.elapsed().as_secs_f64(),
                "events": self.events,
                "processes": self.registry.processes().len(),
                "preempted": self.preempted.keys().collect::<Vec<_>>(),
                "max_hold_ms": self.max_hold.map(|d| d.as_millis() as u64),
                "state_file": self.state.path(),
                "recovered_at_start": self.recovered,
                "recovery_failures": self.recovery_failures,
                "restored_from_journal": self.restored,
                "gpus": self.ctl.gpus(),
                "gate": self.gate_status().data,
            })),
            Request::Preempt {
                pid,
                gpu,
                max_hold_ms,
            } => self.preempt(pid, gpu.as_deref(), max_hold_ms.map(Duration::from_millis)),
            Request::Resume { pid } => {
                let r = self.resume(pid);
                // Back under the gate, if it names the process (applied before the reply, so a
                // gate that holds offline preempted has re-frozen it by then).
                self.sync_gate();
                r
            }
            Request::ResumeAll => self.resume_all(),
            Request::GateStart(spec) => self.gate_start(spec),
            Request::GateStop => self.gate_stop(),
            Request::GateStatus => self.gate_status(),
            Request::OnlineBusy => self.gate_signal(true),
            Request::OnlineIdle => self.gate_signal(false),
        }
    }

    fn ps(&self) -> Reply {
        let gpus = self.ctl.gpus();
        let mut procs = Vec::new();
        for pid in self.registry.processes() {
            let views: Vec<_> = self
                .registry
                .gpus(pid)
                .into_iter()
                .filter(|v| v.channels().next().is_some())
                .map(|v| {
                    let index = v
                        .device_instance
                        .and_then(|i| gpus.iter().find(|g| g.device_instance == i))
                        .map(|g| g.index);
                    json!({
                        "gpu": index,
                        "device_instance": v.device_instance,
                        "client": format!("{:#x}", v.client.0),
                        "tsgs": v.tsgs.iter().map(|t| json!({
                            "handle": format!("{:#x}", t.handle.0),
                            "channels": t.channels.iter().map(|c| format!("{:#x}", c.handle.0)).collect::<Vec<_>>(),
                            "compute": t.has_compute(),
                        })).collect::<Vec<_>>(),
                        "channels": v.channels().count(),
                    })
                })
                .collect();
            if views.is_empty() {
                continue;
            }
            procs.push(json!({
                "pid": pid, "comm": comm(pid), "discoverable": true,
                "preempted": self.preempted.contains_key(&pid), "gpus": views,
            }));
        }
        for &pid in &self.pre_existing {
            if alive(pid) {
                procs.push(json!({
                    "pid": pid, "comm": comm(pid), "discoverable": false,
                    "note": "not discoverable: started before the daemon",
                }));
            }
        }
        Reply::ok(json!({ "processes": procs }))
    }

    pub(crate) fn no_channels_reason(&self, pid: u32) -> String {
        if !alive(pid) {
            format!("no such process: {pid}")
        } else if self.pre_existing.contains(&pid) {
            format!(
                "process {pid} ({}) is not discoverable: it started before the daemon, so its GPU \
                 channels were never observed; restart it while the daemon runs",
                comm(pid)
            )
        } else {
            format!(
                "process {pid} ({}) has no GPU channels: it has not created a CUDA context \
                 since the daemon started (see `valvectl ps`)",
                comm(pid)
            )
        }
    }

    fn preempt(&mut self, pid: u32, gpu: Option<&str>, hold: Option<Duration>) -> Reply {
        if self.preempted.contains_key(&pid) {
            return Reply::ok(json!({"pid": pid, "already_preempted": true}));
        }
        let gpus = self.ctl.gpus();
        let want = match gpu.map(|s| s.parse::<GpuSelector>()) {
            None => None,
            Some(Ok(sel)) => match sel.resolve(&gpus) {
                Ok(i) => Some(gpus[i].device_instance),
                Err(e) => return Reply::err(6, e.to_string()),
            },
            Some(Err(e)) => return Reply::err(2, e),
        };
        let mut targets = Vec::new();
        let mut records = Vec::new();
        for v in self.registry.gpus(pid) {
            let Some(inst) = v.device_instance else {
                continue;
            };
            if want.is_some_and(|w| w != inst) {
                continue;
            }
            let Some(g) = gpus.iter().find(|g| g.device_instance == inst) else {
                continue;
            };
            let chans: Vec<u32> = v.channels().map(|c| c.handle.0).collect();
            if chans.is_empty() {
                continue;
            }
            targets.extend(chans.iter().map(|&c| ChannelTarget {
                gpu: g.index,
                client: v.client,
                channel: valve_ioctl_bindings::ChannelHandle(c),
            }));
            records.push(DisabledRecord {
                pid,
                device_instance: inst,
                client: v.client.0,
                channels: chans,
            });
        }
        if targets.is_empty() {
            let mut msg = self.no_channels_reason(pid);
            if want.is_some() && !self.registry.gpus(pid).is_empty() {
                msg = format!(
                    "process {pid} has no GPU channels on GPU {}",
                    gpu.unwrap_or("")
                );
            }
            return Reply::err(EXIT_PROCESS, msg);
        }
        let plan = match self.ctl.plan(&targets, PreemptMode::Preempt) {
            Ok(p) => p,
            Err(e) => return Reply::err(EXIT_RM, e.to_string()),
        };
        let limit = match (hold, self.max_hold) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // Record first: if the daemon dies right after the disable, a restart re-enables.
        self.preempted.insert(
            pid,
            Preempted {
                records,
                plan,
                since: Instant::now(),
                deadline: limit.map(|l| Instant::now() + l),
            },
        );
        if let Err(e) = self.save() {
            self.preempted.remove(&pid);
            return Reply::err(1, format!("not preempting: cannot record it ({e})"));
        }
        // A gated process is the operator's from now on: the gate must not enable it again.
        self.sync_gate();
        let outcome = {
            let p = self.preempted.get(&pid).expect("inserted");
            self.ctl
                .disable(&p.plan)
                .map(|g| (g.keep_disabled(), p.plan.channels(), p.plan.gpus()))
                .map_err(|e| e.to_string())
        };
        match outcome {
            Ok((report, channels, gpus_n)) => Reply::ok(json!({
                "pid": pid, "channels": channels, "gpus": gpus_n, "disable": report,
                "max_hold_ms": limit.map(|l| l.as_millis() as u64),
            })),
            Err(message) => {
                self.preempted.remove(&pid);
                let _ = self.save();
                Reply::err(EXIT_RM, message)
            }
        }
    }

    fn resume(&mut self, pid: u32) -> Reply {
        let Some(p) = self.preempted.remove(&pid) else {
            return Reply::err(
                EXIT_PROCESS,
                format!("process {pid} is not preempted by this daemon (see `valvectl status`)"),
            );
        };
        let held = p.since.elapsed();
        let result = self.ctl.enable(&p.plan);
        let gone = result.as_ref().err().is_some_and(|e| {
            matches!(
                e.rm_status(),
                Some(valve_ioctl_bindings::NV_ERR_INVALID_CLIENT)
                    | Some(valve_ioctl_bindings::NV_ERR_INVALID_CHANNEL)
            )
        });
        match result {
            Ok(report) => {
                let _ = self.save();
                Reply::ok(
                    json!({"pid": pid, "enable": report, "held_ms": held.as_secs_f64() * 1e3}),
                )
            }
            Err(_) if gone => {
                let _ = self.save();
                Reply::ok(
                    json!({"pid": pid, "note": "the process's channels are gone (it exited)"}),
                )
            }
            Err(e) => {
                // Keep it recorded so that a retry or a restart re-enables it.
                self.preempted.insert(pid, p);
                Reply::err(EXIT_RM, e.to_string())
            }
        }
    }

    /// Resumes everything this daemon disabled.
    pub fn resume_all(&mut self) -> Reply {
        let pids: Vec<u32> = self.preempted.keys().copied().collect();
        let mut failures = Vec::new();
        for pid in &pids {
            if let Some(e) = self.resume(*pid).error {
                failures.push(e.message);
            }
        }
        if failures.is_empty() {
            Reply::ok(json!({"resumed": pids}))
        } else {
            Reply::err(EXIT_RM, failures.join("; "))
        }
    }
}

/// How the daemon is started.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// The socket path.
    pub socket: PathBuf,
    /// Where `disabled.json` lives.
    pub state_dir: PathBuf,
    /// A group whose members may use the socket (besides root).
    pub group: Option<String>,
    /// The longest any preemption may last.
    pub max_hold: Option<Duration>,
}

/// Failure to start or run the daemon, with its exit code.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct DaemonError {
    /// Exit code.
    pub code: i32,
    /// What and how to fix it.
    pub message: String,
}

fn derr(code: i32, message: impl Into<String>) -> DaemonError {
    DaemonError {
        code,
        message: message.into(),
    }
}

fn peer_allowed(stream: &UnixStream, gid: Option<u32>) -> bool {
    let Ok(cred) = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
    else {
        return false;
    };
    if cred.uid() == 0 {
        return true;
    }
    let Some(gid) = gid else { return false };
    if cred.gid() == gid {
        return true;
    }
    // Supplementary groups of the peer process.
    std::fs::read_to_string(format!("/proc/{}/status", cred.pid()))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Groups:"))
                .map(|l| l.split_whitespace().skip(1).any(|g| g.parse() == Ok(gid)))
        })
        .unwrap_or(false)
}

fn serve_one<D: RmDriver>(core: &mut DaemonCore<D>, stream: UnixStream, gid: Option<u32>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let reply = if !peer_allowed(&stream, gid) {
        Reply::err(
            4,
            "permission denied: only root or the daemon's --group may use Valve",
        )
    } else {
        let mut line = String::new();
        match BufReader::new(stream).read_line(&mut line) {
            Ok(_) => match serde_json::from_str::<Request>(&line) {
                Ok(req) => core.handle(req),
                Err(e) => Reply::err(2, format!("bad request: {e}")),
            },
            Err(e) => Reply::err(1, format!("reading the request: {e}")),
        }
    };
    let mut out = serde_json::to_string(&reply).expect("replies serialise");
    out.push('\n');
    let _ = writer.write_all(out.as_bytes());
}

/// The uprobe launch watcher reports idle->busy edges after this much silence; each carries its
/// gap, which is what the policy learns iteration gaps from.
pub const GATE_EDGE_GAP: Duration = Duration::from_micros(200);

/// Starts the real gate thread: its own RM client, uprobes on libcuda's launch entry points.
fn real_gate_starter(
    cfg: crate::gate::GateConfig,
) -> Result<crate::gate::runtime::GateHandle, String> {
    crate::gate::runtime::spawn(cfg, |tx| {
        let library = valve_ebpf::find_libcuda().ok_or(
            "libcuda.so.1 not found (ldconfig -p, /usr/local/nvidia/lib64, /usr/lib/x86_64-linux-gnu): \
             the gate watches online launches with uprobes on it",
        )?;
        let watcher = valve_ebpf::LaunchWatcher::start_with(
            valve_ebpf::LaunchConfig {
                library,
                pids: Vec::new(),
                filter: true,
                edge_gap: GATE_EDGE_GAP,
            },
            move |e| {
                let _ = tx.send(crate::gate::GateInput::Edge(e));
            },
        )
        .map_err(|e| format!("attaching uprobes to libcuda: {e}"))?;
        let ctl = Controller::<NvDriver>::open().map_err(|e| format!("opening the driver: {e}"))?;
        Ok((ctl, watcher))
    })
}

/// Runs the daemon until SIGINT/SIGTERM/SIGHUP; resumes everything before returning.
pub fn run(cfg: &DaemonConfig, signals: &Signals) -> Result<(), DaemonError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(derr(
            4,
            "the daemon must run as root (it loads BPF programs and owns /run/valve): sudo valvectl daemon",
        ));
    }
    let gid = match &cfg.group {
        None => None,
        Some(name) => match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => Some(g.gid.as_raw()),
            _ => return Err(derr(2, format!("no such group: {name}"))),
        },
    };
    if crate::protocol::call(&cfg.socket, &Request::Status, Duration::from_secs(1)).is_ok() {
        return Err(derr(
            1,
            format!("another daemon already serves {}", cfg.socket.display()),
        ));
    }
    let ctl = Controller::<NvDriver>::open().map_err(|e| {
        let message = format!("opening the driver: {e}");
        derr(e.exit_code(), message)
    })?;
    std::fs::create_dir_all(&cfg.state_dir)
        .map_err(|e| derr(1, format!("creating {}: {e}", cfg.state_dir.display())))?;
    let pre_existing = nvidia_users();
    // Batched delivery keeps the consumer wake-up (~2 us) off every RM call of every CUDA
    // process; the registry then lags the ioctls by at most 2 ms.
    let watcher = Watcher::start(WatchConfig {
        batched_delivery: true,
        poll_interval: Duration::from_millis(2),
        ..WatchConfig::default()
    })
    .map_err(|e| derr(EXIT_BPF, format!("starting the eBPF watcher: {e}")))?;
    let mut core = DaemonCore::new(
        ctl,
        StateFile::in_dir(&cfg.state_dir),
        cfg.max_hold,
        pre_existing,
    )
    .map_err(|e| derr(1, format!("recovering state: {e}")))?;
    if !core.restored.is_empty() {
        tracing::warn!(
            "restored {} running process(es) from the registry journal",
            core.restored.len()
        );
    }
    if core.recovered > 0 || !core.recovery_failures.is_empty() {
        tracing::warn!(
            "re-enabled {} channel(s) a previous daemon had disabled; failures: {:?}",
            core.recovered,
            core.recovery_failures
        );
    }
    let _ = std::fs::remove_file(&cfg.socket);
    if let Some(dir) = cfg.socket.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let listener = UnixListener::bind(&cfg.socket)
        .map_err(|e| derr(1, format!("listening on {}: {e}", cfg.socket.display())))?;
    let mode = if gid.is_some() { 0o660 } else { 0o600 };
    let _ = std::fs::set_permissions(&cfg.socket, std::fs::Permissions::from_mode(mode));
    if let Some(g) = gid {
        let _ = nix::unistd::chown(&cfg.socket, None, Some(nix::unistd::Gid::from_raw(g)));
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| derr(1, format!("socket: {e}")))?;
    eprintln!(
        "valvectl daemon: watching RM ioctls, {} GPU(s), {} process(es) started before the daemon, socket {}",
        core.controller().gpus().len(),
        core.pre_existing.len(),
        cfg.socket.display()
    );
    core.set_gate_starter(Box::new(real_gate_starter));
    let result = loop {
        while let Some(ev) = watcher.poll(Duration::ZERO) {
            core.on_event(&ev);
        }
        core.expire(Instant::now());
        core.refresh_gate(Instant::now(), false);
        if !watcher.is_alive() {
            break Err(derr(
                EXIT_BPF,
                "the eBPF watcher stopped; exiting so the service restarts",
            ));
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                // Events that arrived before the request must be in the registry.
                while let Some(ev) = watcher.poll(Duration::ZERO) {
                    core.on_event(&ev);
                }
                serve_one(&mut core, stream, gid);
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!("accept: {e}"),
        }
        let mut fds = [nix::poll::PollFd::new(
            listener.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5u8));
        if let Some(sig) = signals.pending() {
            eprintln!("valvectl daemon: {sig}: resuming everything and exiting");
            break Ok(());
        }
    };
    if core.gate.is_some() {
        let _ = core.gate_stop();
    }
    let r = core.resume_all();
    if let Err(e) = core.flush_journal() {
        tracing::error!("writing the registry journal: {e}");
    }
    let _ = std::fs::remove_file(&cfg.socket);
    drop(watcher);
    match (result, r.error) {
        (Err(e), _) => Err(e),
        (Ok(()), Some(e)) => Err(derr(e.code, e.message)),
        (Ok(()), None) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use valve::fake::FakeRm;
    use valve_ebpf::{AllocEvent, FreeEvent};
    use valve_ioctl_bindings::{self as b, ChannelHandle, ClientHandle, ObjectHandle};

    fn alloc(
        pid: u32,
        client: u32,
        parent: u32,
        object: u32,
        class: u32,
        extra: Option<u32>,
    ) -> RmEvent {
        RmEvent {
            ts_ns: 0,
            pid,
            tid: pid,
            kind: RmEventKind::Alloc(AllocEvent {
                client: ClientHandle(client),
                parent: ObjectHandle(parent),
                object: ObjectHandle(object),
                class,
                extra,
                minor: 255,
                nvos64: true,
            }),
        }
    }

    /// A CUDA-13-like process on the given device instances: client, device per GPU, one TSG
    /// of `n` channels per GPU. Returns its events and registers its channels with the fake RM.
    fn cuda_process(rm: &FakeRm, pid: u32, client: u32, instances: &[u32], n: u32) -> Vec<RmEvent> {
        let mut ev = vec![alloc(pid, 0, 0, client, b::NV01_ROOT_CLIENT, None)];
        for (k, &inst) in instances.iter().enumerate() {
            let base = 0x5c00_0000 + 0x100 * k as u32;
            let (dev, tsg) = (base + 1, base + 2);
            ev.push(alloc(
                pid,
                client,
                client,
                dev,
                b::NV01_DEVICE_0,
                Some(inst),
            ));
            ev.push(alloc(
                pid,
                client,
                dev,
                tsg,
                b::KEPLER_CHANNEL_GROUP_A,
                None,
            ));
            let chans: Vec<ChannelHandle> =
                (0..n).map(|i| ChannelHandle(base + 0x10 + i)).collect();
            for c in &chans {
                ev.push(alloc(
                    pid,
                    client,
                    tsg,
                    c.0,
                    b::HOPPER_CHANNEL_GPFIFO_A,
                    None,
                ));
                ev.push(alloc(
                    pid,
                    client,
                    c.0,
                    c.0 + 0x80,
                    b::HOPPER_COMPUTE_A,
                    None,
                ));
            }
            rm.add_channels(ClientHandle(client), inst, &chans);
        }
        ev
    }

    /// Every test pid "runs" and was started at tick 42.
    fn always_running(_: u32) -> Option<u64> {
        Some(42)
    }

    fn started_later(_: u32) -> Option<u64> {
        Some(43)
    }

    fn core(rm: &Arc<FakeRm>, dir: &Path, max_hold: Option<Duration>) -> DaemonCore<Arc<FakeRm>> {
        core_with(rm, dir, max_hold, always_running)
    }

    fn core_with(
        rm: &Arc<FakeRm>,
        dir: &Path,
        max_hold: Option<Duration>,
        start_time: StartTimeFn,
    ) -> DaemonCore<Arc<FakeRm>> {
        let ctl = Controller::with_driver(rm.clone()).unwrap();
        DaemonCore::with_start_time(
            ctl,
            StateFile::in_dir(dir),
            max_hold,
            BTreeSet::new(),
            start_time,
        )
        .unwrap()
    }

    #[test]
    fn a_restarted_daemon_still_knows_running_processes_but_not_reused_pids() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let mut first = core(&rm, dir.path(), None);
        for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 4) {
            first.on_event(&e);
        }
        first.flush_journal().unwrap();
        drop(first);
        // Same pid, same start time: restored, and preempt --pid works on it.
        let mut second = core(&rm, dir.path(), None);
        assert_eq!(second.restored, vec![PID_A]);
        let r = second.handle(Request::Preempt {
            pid: PID_A,
            gpu: None,
            max_hold_ms: None,
        });
        assert_eq!(r.data["channels"], 4, "{r:?}");
        assert!(second
            .handle(Request::Resume { pid: PID_A })
            .error
            .is_none());
        second.flush_journal().unwrap();
        drop(second);
        // The pid now belongs to a process started later: nothing is inherited.
        let mut third = core_with(&rm, dir.path(), None, started_later);
        assert!(third.restored.is_empty());
        let r = third.handle(Request::Preempt {
            pid: PID_A,
            gpu: None,
            max_hold_ms: None,
        });
        assert_eq!(r.error.unwrap().code, EXIT_PROCESS);
        assert!(rm.disabled().is_empty());
    }

    #[test]
    fn the_journal_forgets_exited_processes() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let mut first = core(&rm, dir.path(), None);
        for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 2) {
            first.on_event(&e);
        }
        first.on_event(&RmEvent {
            ts_ns: 0,
            pid: PID_A,
            tid: PID_A,
            kind: RmEventKind::Exit,
        });
        first.flush_journal().unwrap();
        drop(first);
        assert!(core(&rm, dir.path(), None).restored.is_empty());
    }

    const PID_A: u32 = 4_000_001;
    const PID_B: u32 = 4_000_002;

    #[test]
    fn preempt_and_resume_by_pid_on_all_its_gpus() {
        let rm = Arc::new(FakeRm::host(2));
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(&rm, dir.path(), None);
        let insts: Vec<u32> = c
            .controller()
            .gpus()
            .iter()
            .map(|g| g.device_instance)
            .collect();
        for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &insts, 5) {
            c.on_event(&e);
        }
        // Same object handles, other client, first GPU only: must not be touched.
        for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &insts[..1], 5) {
            c.on_event(&e);
        }
        let r = c.handle(Request::Preempt {
            pid: PID_A,
            gpu: None,
            max_hold_ms: None,
        });
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.data["channels"], 10);
        assert_eq!(r.data["gpus"], 2);
        let disabled = rm.disabled();
        assert_eq!(disabled.len(), 10);
        assert!(disabled.iter().all(|(cl, _)| cl.0 == 0xc1d0_0010));
        let recorded = StateFile::in_dir(dir.path()).load().unwrap();
        assert_eq!(recorded.len(), 2);
        assert!(recorded
            .iter()
            .all(|r| r.pid == PID_A && r.channels.len() == 5));

        let ps = c.handle(Request::Ps).data;
        let a = ps["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == PID_A)
            .unwrap();
        assert_eq!(a["preempted"], true);
        assert_eq!(a["gpus"].as_array().unwrap().len(), 2);

        let r = c.handle(Request::Resume { pid: PID_A });
        assert!(r.error.is_none(), "{r:?}");
        assert!(rm.disabled().is_empty());
        assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
        assert_eq!(
            c.handle(Request::Resume { pid: PID_A }).error.unwrap().code,
            EXIT_PROCESS
        );
    }

    #[test]
    fn gpu_filter_and_process_errors() {
        let rm = Arc::new(FakeRm::host(2));
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(&rm, dir.path(), None);
        let gpus = c.controller().gpus();
        let insts: Vec<u32> = gpus.iter().map(|g| g.device_instance).collect();
        for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &insts[..1], 3) {
            c.on_event(&e);
        }
        let idx_of_second = gpus
            .iter()
            .find(|g| g.device_instance == insts[1])
            .unwrap()
            .index;
        let r = c.handle(Request::Preempt {
            pid: PID_A,
            gpu: Some(idx_of_second.to_string()),
            max_hold_ms: None,
        });
        assert_eq!(r.error.unwrap().code, EXIT_PROCESS);
        assert!(rm.disabled().is_empty());
        let r = c.handle(Request::Preempt {
            pid: PID_A,
            gpu: Some("9".into()),
            max_hold_ms: None,
        });
        assert_eq!(r.error.unwrap().code, 6);

        let r = c.handle(Request::Preempt {
            pid: 4_100_000,
            gpu: None,
            max_hold_ms: None,
        });
        assert!(r.error.unwrap().message.contains("no such process"));
        let me = std::process::id();
        let r = c.handle(Request::Preempt {
            pid: me,
            gpu: None,
            max_hold_ms: None,
        });
        assert!(r.error.unwrap().message.contains("has no GPU channels"));
        c.pre_existing.insert(me);
        let r = c.handle(Request::Preempt {
            pid: me,
            gpu: None,
            max_hold_ms: None,
        });
        let e = r.error.unwrap();
        assert_eq!(e.code, EXIT_PROCESS);
        assert!(
            e.message.contains("started before the daemon"),
            "{}",
            e.message
        );
        let ps = c.handle(Request::Ps).data;
        assert!(ps["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == me && p["discoverable"] == false));
    }

    #[test]
    fn a_restarted_daemon_reenables_what_a_dead_one_left_disabled() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let mut first = core(&rm, dir.path(), None);
        for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 4) {
            first.on_event(&e);
        }
        assert!(first
            .handle(Request::Preempt {
                pid: PID_A,
                gpu: None,
                max_hold_ms: None
            })
            .error
            .is_none());
        assert_eq!(rm.disabled().len(), 4);
        // The daemon dies without resuming (as with SIGKILL): no Drop logic runs for it.
        std::mem::forget(first);
        let second = core(&rm, dir.path(), None);
        assert_eq!(second.recovered, 4);
        assert!(rm.disabled().is_empty());
        assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
    }

    #[test]
    fn hold_limit_and_process_exit() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(&rm, dir.path(), Some(Duration::from_secs(3600)));
        for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 2) {
            c.on_event(&e);
        }
        for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &[0], 2) {
            c.on_event(&e);
        }
        // The request's limit is shorter than the daemon's: it wins.
        let r = c.handle(Request::Preempt {
            pid: PID_A,
            gpu: None,
            max_hold_ms: Some(0),
        });
        assert_eq!(r.data["max_hold_ms"], 0);
        assert!(c
            .handle(Request::Preempt {
                pid: PID_B,
                gpu: None,
                max_hold_ms: None
            })
            .error
            .is_none());
        assert_eq!(rm.disabled().len(), 4);
        assert_eq!(
            c.expire(Instant::now() + Duration::from_millis(1)),
            vec![PID_A]
        );
        assert_eq!(rm.disabled().len(), 2);
        // B exits while preempted: its record goes (its channels died with it).
        c.on_event(&RmEvent {
            ts_ns: 0,
            pid: PID_B,
            tid: PID_B,
            kind: RmEventKind::Exit,
        });
        assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
        assert_eq!(
            c.handle(Request::Resume { pid: PID_B }).error.unwrap().code,
            EXIT_PROCESS
        );
        // A freed client takes its channels out of the registry.
        c.on_event(&RmEvent {
            ts_ns: 0,
            pid: PID_A,
            tid: PID_A,
            kind: RmEventKind::Free(FreeEvent {
                client: ClientHandle(0xc1d0_0010),
                parent: ObjectHandle(0),
                object: ObjectHandle(0xc1d0_0010),
                minor: 255,
            }),
        });
        let r = c.handle(Request::Preempt {
            pid: PID_A,
            gpu: None,
            max_hold_ms: None,
        });
        assert_eq!(r.error.unwrap().code, EXIT_PROCESS);
    }

    #[test]
    fn resume_all_resumes_every_pid() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let mut c = core(&rm, dir.path(), None);
        for (pid, cl) in [(PID_A, 0xc1d0_0010), (PID_B, 0xc1d0_0020)] {
            for e in cuda_process(&rm, pid, cl, &[0], 3) {
                c.on_event(&e);
            }
            assert!(c
                .handle(Request::Preempt {
                    pid,
                    gpu: None,
                    max_hold_ms: None
                })
                .error
                .is_none());
        }
        assert_eq!(rm.disabled().len(), 6);
        let r = c.handle(Request::ResumeAll);
        assert!(r.error.is_none());
        assert!(rm.disabled().is_empty());
    }

    /// A launch source that reports nothing, or panics when asked (a gate thread that dies).
    struct QuietLaunches {
        panic: bool,
    }

    impl crate::gate::LaunchSource for QuietLaunches {
        fn watch(&mut self, _pid: u32) -> Result<(), String> {
            Ok(())
        }
        fn unwatch(&mut self, _pid: u32) {}
        fn last_launch_ns(&self, _pid: u32) -> u64 {
            assert!(!self.panic, "launch source failed");
            0
        }
    }

    type EdgeSender =
        Arc<std::sync::Mutex<Option<std::sync::mpsc::Sender<crate::gate::GateInput>>>>;

    fn fake_starter(rm: &Arc<FakeRm>, panic: bool) -> (gate::GateStarter, EdgeSender) {
        let rm = rm.clone();
        let edges: EdgeSender = Default::default();
        let edges2 = edges.clone();
        let starter = Box::new(move |cfg| {
            let (rm, edges) = (rm.clone(), edges2.clone());
            crate::gate::runtime::spawn(cfg, move |tx| {
                *edges.lock().unwrap() = Some(tx);
                let ctl = Controller::with_driver(rm).map_err(|e| e.to_string())?;
                Ok((ctl, QuietLaunches { panic }))
            })
        });
        (starter, edges)
    }

    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !cond() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "timed out waiting: {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A daemon core with a fake gate starter and this test process as a CUDA process with 4
    /// channels on GPU 0 (offline candidates must be alive).
    fn gated_core(
        rm: &Arc<FakeRm>,
        dir: &Path,
        panic: bool,
    ) -> (DaemonCore<Arc<FakeRm>>, EdgeSender, u32) {
        let mut c = core(rm, dir, None);
        let (starter, edges) = fake_starter(rm, panic);
        c.set_gate_starter(starter);
        let me = std::process::id();
        for e in cuda_process(rm, me, 0xc1d0_0010, &[0], 4) {
            c.on_event(&e);
        }
        (c, edges, me)
    }

    fn gate_spec(online: u32, offline: u32) -> Request {
        Request::GateStart(crate::protocol::GateSpec {
            online: vec![online],
            offline: vec![offline],
            ..Default::default()
        })
    }

    #[test]
    fn the_gate_freezes_only_offline_and_records_it_first() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        // Offline: this test process; online: pid 1 (both alive). Another process with the
        // same object handles must never be touched.
        let (mut c, _, me) = gated_core(&rm, dir.path(), false);
        for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &[0], 4) {
            c.on_event(&e);
        }
        // Bad specs are refused with their exit codes, and nothing starts.
        let code = |r: Reply| r.error.map(|e| e.code);
        let only_online = Request::GateStart(crate::protocol::GateSpec {
            online: vec![1],
            ..Default::default()
        });
        assert_eq!(code(c.handle(only_online)), Some(2));
        assert_eq!(code(c.handle(gate_spec(1, 1))), Some(2));
        assert_eq!(code(c.handle(gate_spec(1, 4_199_999))), Some(EXIT_PROCESS));
        assert_eq!(code(c.handle(Request::GateStop)), Some(1));
        assert_eq!(code(c.handle(Request::OnlineBusy)), Some(1));
        assert_eq!(c.handle(Request::GateStatus).data["running"], false);

        let r = c.handle(gate_spec(1, me));
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.data["offline_channels"], 4);
        assert_eq!(
            code(c.handle(gate_spec(1, me))),
            Some(1),
            "one gate at a time"
        );
        let recorded = StateFile::in_dir(dir.path()).load().unwrap();
        assert!(recorded
            .iter()
            .any(|r| r.pid == me && r.channels.len() == 4));
        assert!(rm.disabled().is_empty(), "recorded, not yet disabled");

        assert!(c.handle(Request::OnlineBusy).error.is_none());
        wait_for("busy disables", || rm.disabled().len() == 4);
        assert!(rm.disabled().iter().all(|(cl, _)| cl.0 == 0xc1d0_0010));
        assert!(c.handle(Request::OnlineIdle).error.is_none());
        wait_for("idle enables", || rm.disabled().is_empty());

        // A manual preempt of a gated process is the operator's: the gate's resume leaves it.
        assert!(c.handle(Request::OnlineBusy).error.is_none());
        wait_for("busy disables", || rm.disabled().len() == 4);
        let r = c.handle(Request::Preempt {
            pid: me,
            gpu: None,
            max_hold_ms: None,
        });
        assert!(r.error.is_none(), "{r:?}");
        assert!(c.handle(Request::OnlineIdle).error.is_none());
        let st = c.handle(Request::GateStatus).data;
        wait_for("the gate resumed", || {
            c.handle(Request::GateStatus).data["resumes"] == 2
        });
        assert_eq!(st["offline_channels"], 0);
        assert_eq!(rm.disabled().len(), 4, "still held by the manual preempt");
        assert!(c.handle(Request::Resume { pid: me }).error.is_none());
        assert!(rm.disabled().is_empty());
        assert_eq!(c.handle(Request::GateStatus).data["offline_channels"], 4);

        // Status shows the gate; stop resumes and clears the records.
        assert!(c.handle(Request::OnlineBusy).error.is_none());
        wait_for("busy disables", || rm.disabled().len() == 4);
        assert_eq!(c.handle(Request::Status).data["gate"]["running"], true);
        let r = c.handle(Request::GateStop);
        assert!(r.error.is_none());
        assert_eq!(r.data["running"], false);
        assert_eq!(r.data["preemptions"], 3);
        assert!(rm.disabled().is_empty());
        assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
    }

    #[test]
    fn offline_by_label_includes_labelled_processes_only_and_never_online_ones() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let (mut c, _, me) = gated_core(&rm, dir.path(), false);
        // A labelled CUDA process (a real child, so /proc has its environment) and this
        // unlabelled one, which the registry also lists with channels.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env(crate::gate::LABEL_VAR, "batch")
            .spawn()
            .unwrap();
        let kid = child.id();
        for e in cuda_process(&rm, kid, 0xc1d0_0030, &[0], 3) {
            c.on_event(&e);
        }
        let r = c.handle(Request::GateStart(crate::protocol::GateSpec {
            online: vec![me],
            offline_label: Some("batch".into()),
            ..Default::default()
        }));
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.data["offline_pids"], serde_json::json!([kid]));
        assert_eq!(r.data["offline_channels"], 3);
        assert!(c.handle(Request::OnlineBusy).error.is_none());
        wait_for("busy disables", || rm.disabled().len() == 3);
        assert!(rm.disabled().iter().all(|(cl, _)| cl.0 == 0xc1d0_0030));
        assert!(c.handle(Request::GateStop).error.is_none());
        assert!(rm.disabled().is_empty());
        // A process labelled offline but named online is never frozen.
        let r = c.handle(Request::GateStart(crate::protocol::GateSpec {
            online: vec![kid],
            offline_label: Some("batch".into()),
            ..Default::default()
        }));
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.data["offline_channels"], 0);
        assert!(c.handle(Request::GateStop).error.is_none());
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_dead_gate_thread_leaves_nothing_frozen_and_is_noticed() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let (mut c, edges, me) = gated_core(&rm, dir.path(), true);
        assert!(c.handle(gate_spec(1, me)).error.is_none());
        // An online launch edge: the gate disables, then its launch source fails (panics) when
        // the cooldown check asks it for the latest launch.
        let tx = edges.lock().unwrap().clone().unwrap();
        tx.send(crate::gate::GateInput::Edge(valve_ebpf::LaunchEdge {
            pid: 1,
            graph: false,
            ts_ns: 1,
            idle_ns: 0,
        }))
        .unwrap();
        wait_for("the gate thread dies", || {
            c.gate.as_ref().is_some_and(|g| g.handle_finished())
        });
        c.refresh_gate(Instant::now(), false);
        assert!(c.gate.is_none());
        assert!(rm.disabled().is_empty());
        assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
    }

    #[test]
    fn a_restart_reenables_what_a_killed_daemon_gate_held() {
        let rm = Arc::new(FakeRm::host(1));
        let dir = tempfile::tempdir().unwrap();
        let (mut c, _, me) = gated_core(&rm, dir.path(), false);
        assert!(c.handle(gate_spec(1, me)).error.is_none());
        assert!(c.handle(Request::OnlineBusy).error.is_none());
        wait_for("busy disables", || rm.disabled().len() == 4);
        // SIGKILL: neither the daemon nor the gate thread gets to clean up.
        let g = c.gate.take().unwrap();
        std::mem::forget(g);
        std::mem::forget(c);
        assert_eq!(rm.disabled().len(), 4);
        let second = core(&rm, dir.path(), None);
        assert_eq!(second.recovered, 4);
        assert!(rm.disabled().is_empty());
    }
}
