//! The daemon's logic without sockets or BPF: the registry of every CUDA process's channels,
//! what is preempted (by pid, with hold limits), and the answer to each socket request.
//!
//! Everything it disables is written to the state file *before* the disable, so a restarted
//! daemon re-enables it (a SIGKILLed daemon must not leave a job frozen); the events that built
//! the registry are journaled, so a restart still knows running processes. Tests drive
//! [`DaemonCore`] with the fake RM; [`crate::run()`] adds the socket, BPF and signals.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use valve::controller::{ChannelTarget, Controller, PreemptMode, PreemptPlan};
use valve::driver::RmDriver;
use valve::gpu::{GpuInfo, GpuSelector};
use valve::state::{reenable, DisabledRecord, Salvage, StateFile};
use valve_ebpf::{Registry, RmEvent, RmEventKind};

use crate::config::OfflinePolicy;
use crate::freeze_check::{self, FreezeChecker, FreezeRecorder, Origin};
use crate::gate::hold_history::{self, HoldHistories};
use crate::gate::supervisor::{ActiveGate, GateStarter, Rescan, PROBES_WITHIN};
use crate::harvest::{HarvestShared, ProcessView};
use crate::journal::{process_start_time, Journal, StartTimeFn};
use crate::metrics::Metrics;
use crate::procfs::{alive, comm};
use crate::protocol::{
    batch_timing, gpu_entry, Data, ErrorCode, GateReply, GateSpec, Hello, PreemptReply,
    ProcessEntry, ProcessGpu, PsReply, Reply, Request, ResumeAllReply, ResumeReply, StatusReply,
    TsgEntry, PROTOCOL_VERSION,
};
use crate::workload::Workload;

mod gate_start;
mod mps_guard;
mod recorded;
use gate_start::PendingGate;
use recorded::RecordedState;

struct Preempted {
    records: Vec<DisabledRecord>,
    /// The channels, as disable targets (what the freeze check reads back).
    targets: Arc<[ChannelTarget]>,
    /// Ends the freeze's check off the loop, if one runs (set before any enable, and on drop).
    check: CheckCancel,
    /// The process's workload label as a metric label (set after the disable).
    label: String,
    plan: PreemptPlan,
    since: Instant,
    deadline: Option<Instant>,
}

/// Set when a preemption ends, so that its check never reads channels enabled again.
#[derive(Default)]
struct CheckCancel(Option<Arc<std::sync::atomic::AtomicBool>>);

impl CheckCancel {
    fn cancel(&self) {
        if let Some(c) = &self.0 {
            c.store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

impl Drop for CheckCancel {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// When each step of a preempt began: where its time goes (the memory pool logs it with each
/// reclaim).
struct PreemptTiming {
    record: Instant,
    gate: Instant,
    disable: Instant,
}

impl PreemptTiming {
    /// Microseconds per step, with the disable's own.
    fn us(&self, disable_us: u64) -> valve_protocol::control::PreemptTiming {
        valve_protocol::control::PreemptTiming {
            record: self.gate.duration_since(self.record).as_micros() as u64,
            gate: self.disable.duration_since(self.gate).as_micros() as u64,
            disable: disable_us,
            drain: None,
            queued: None,
        }
    }
}

/// The daemon's state and request handling, independent of sockets and BPF.
pub struct DaemonCore<D: RmDriver> {
    ctl: Controller<D>,
    registry: Registry,
    preempted: BTreeMap<u32, Preempted>,
    pub(crate) pre_existing: BTreeSet<u32>,
    state: RecordedState,
    journal: Journal,
    max_hold: Option<Duration>,
    started: Instant,
    events: u64,
    /// Whether the eBPF watcher feeds [`Self::on_event`] (off: `valvectl daemon --no-discovery`).
    discovery: bool,
    /// Channels re-enabled from a previous run's state file at start.
    pub recovered: usize,
    /// Records of the previous run that could not be re-enabled.
    pub recovery_failures: Vec<String>,
    /// Processes whose registry entries were restored from the journal at start.
    pub restored: Vec<u32>,
    /// Set when the state file did not parse at start and was moved aside.
    pub state_salvage: Option<Salvage>,
    gate: Option<ActiveGate>,
    /// The hold's gaps left by stopped gates, for the next gate on the same service, and the
    /// file in the state directory that keeps them across daemon restarts.
    hold_histories: HoldHistories,
    hold_histories_path: PathBuf,
    /// A `gate start` whose gate thread is starting off the loop, or not yet synced.
    gate_pending: Option<PendingGate>,
    gate_starter: Option<GateStarter>,
    /// How long a `gate start` waits for its online processes' probes ([`PROBES_WITHIN`]).
    probes_within: Duration,
    metrics: Option<Arc<Metrics>>,
    offline_policy: OfflinePolicy,
    /// Whether a pid may be frozen under `offline_policy`, looked up once per process.
    permit_cache: RefCell<BTreeMap<u32, bool>>,
    gate_defaults: GateSpec,
    /// The harvest thread's side: the gate's trace and the processes view go there, the
    /// profile comes from there.
    harvest: Option<Arc<HarvestShared>>,
    harvest_view_at: Option<Instant>,
    /// Where CUDA MPS is looked for; MPS clients and servers are never frozen.
    mps: crate::mps::MpsLookup,
    /// Whether the gate leaves a pid out as an MPS client or server, looked up once per process.
    mps_cache: RefCell<BTreeMap<u32, bool>>,
    /// RM root clients the watcher has seen opened: a new MPS server opens one before any
    /// client can use it.
    rm_clients_opened: u64,
    /// `rm_clients_opened` when a scan last found no MPS server (see `mps_guard`).
    mps_none_at: std::cell::Cell<Option<u64>>,
    /// Where freeze checks are booked, and the thread that checks the pool's freezes.
    freeze: Arc<FreezeRecorder>,
    freeze_checker: Option<FreezeChecker>,
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
        // A bad state file must not keep the daemon down: what can be read is re-enabled.
        let leftover = state.load_or_salvage()?;
        if let Some(s) = &leftover.salvage {
            tracing::error!(
                "the state file {} did not parse ({}); moved it to {}, re-enabling the {} \
                 record(s) that could be read, {} unreadable; if a job stays frozen, resume it \
                 from the saved file's contents",
                state.path().display(),
                s.reason,
                s.moved_to.display(),
                leftover.records.len(),
                s.dropped
            );
        }
        let (recovered, recovery_failures) = reenable(&ctl, &leftover.records);
        let state = RecordedState::new(state);
        state.write(&[])?;
        let dir = state
            .file()
            .path()
            .parent()
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let hold_histories_path = dir.join(hold_history::FILE_NAME);
        let (hold_histories, warning) = HoldHistories::load(&hold_histories_path);
        if let Some(w) = warning {
            tracing::warn!("{w}");
        }
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
            discovery: true,
            recovered,
            recovery_failures,
            restored,
            state_salvage: leftover.salvage,
            gate: None,
            gate_pending: None,
            hold_histories,
            hold_histories_path,
            gate_starter: None,
            probes_within: PROBES_WITHIN,
            metrics: None,
            offline_policy: OfflinePolicy::default(),
            permit_cache: RefCell::new(BTreeMap::new()),
            gate_defaults: GateSpec::default(),
            harvest: None,
            harvest_view_at: None,
            mps: crate::mps::MpsLookup::default(),
            mps_cache: RefCell::new(BTreeMap::new()),
            rm_clients_opened: 0,
            mps_none_at: std::cell::Cell::new(None),
            freeze: FreezeRecorder::new(None),
            freeze_checker: None,
        })
    }

    /// Records that no eBPF watcher feeds this core (`--no-discovery`): `status` says so, and a
    /// preempt by pid says why it finds no channels.
    pub fn set_discovery_off(&mut self) {
        self.discovery = false;
    }

    /// Writes the journal now (at shutdown).
    pub fn flush_journal(&mut self) -> valve::error::Result<()> {
        self.journal.flush()
    }

    /// Sets who may be frozen (the config's `[offline]`) and the defaults for the `gate start`
    /// fields a request leaves out (its `[gate]`).
    pub fn set_policy(&mut self, offline: OfflinePolicy, gate_defaults: GateSpec) {
        self.offline_policy = offline;
        self.permit_cache.get_mut().clear();
        self.gate_defaults = gate_defaults;
    }

    /// Records preemptions, resumes and the gate's start and stop into `m` from now on.
    pub fn set_metrics(&mut self, m: Arc<Metrics>) {
        self.freeze = FreezeRecorder::new(Some(&m));
        self.metrics = Some(m);
    }

    /// Checks freezes that the request did not wait for (the memory pool's) on `checker`'s
    /// thread (without one, only the freezes a request waits for are checked).
    pub fn set_freeze_checker(&mut self, checker: FreezeChecker) {
        self.freeze_checker = Some(checker);
    }

    /// Where freeze checks are booked (the gate books its own there too).
    pub fn freeze_recorder(&self) -> Arc<FreezeRecorder> {
        self.freeze.clone()
    }

    /// Sets the gauges: processes known, frozen by hand and by the gate.
    pub fn publish_metrics(&self) {
        let Some(m) = &self.metrics else { return };
        let gated = match &self.gate {
            Some(g) if m.gate_frozen() => {
                let pids: BTreeSet<u32> = g.records().iter().map(|r| r.pid).collect();
                pids.len()
            }
            _ => 0,
        };
        m.set_processes(self.registry.processes().len(), self.preempted.len(), gated);
    }

    /// The controller.
    pub fn controller(&self) -> &Controller<D> {
        &self.ctl
    }

    fn save(&self) -> valve::error::Result<()> {
        let all: Vec<DisabledRecord> = self.all_records().cloned().collect();
        self.state.write(&all)
    }

    /// Makes sure the state file lists everything recorded now, writing only if it lacks a
    /// channel (a process moving between the gate and a preempt costs no write, nor a copy of
    /// the records); the exact set is written at the next [`Self::expire`].
    fn record(&self) -> valve::error::Result<()> {
        if self.state.covers(self.all_records()) {
            return Ok(());
        }
        self.save()
    }

    fn all_records(&self) -> impl Iterator<Item = &DisabledRecord> {
        // What the gate may disable counts too: a restart must not leave it frozen.
        self.preempted
            .values()
            .flat_map(|p| p.records.iter())
            .chain(self.gate.iter().flat_map(|g| g.records.iter()))
    }

    /// Folds one watcher event into the registry.
    pub fn on_event(&mut self, ev: &RmEvent) {
        self.events += 1;
        if let RmEventKind::Alloc(a) = &ev.kind {
            if valve_ebpf::registry::is_root_client_class(a.class) {
                self.rm_clients_opened += 1;
            }
        }
        let applied = self.registry.apply(ev);
        self.journal.record(ev, &applied);
        if ev.kind == RmEventKind::Exit {
            self.pre_existing.remove(&ev.pid);
            self.permit_cache.get_mut().remove(&ev.pid);
            self.mps_cache.get_mut().remove(&ev.pid);
            // Its channels are gone with it: nothing left to re-enable.
            if self.preempted.remove(&ev.pid).is_some() {
                if let Err(e) = self.save() {
                    tracing::error!("updating the state file: {e}");
                }
            }
        }
    }

    /// Whether `pid` is preempted by hand now (`preempt --pid`).
    pub fn is_preempted(&self, pid: u32) -> bool {
        self.preempted.contains_key(&pid)
    }

    /// Resumes preemptions whose hold limit has passed; returns their pids.
    pub fn expire(&mut self, now: Instant) -> Vec<u32> {
        if let Err(e) = self.journal.flush_if_due(now, Duration::from_millis(500)) {
            tracing::error!("writing the registry journal: {e}");
        }
        if self.state.is_stale() {
            if let Err(e) = self.save() {
                tracing::error!("updating the state file: {e}");
            }
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
            Request::Hello { protocol_version } => hello(protocol_version),
            Request::Status => Reply::ok(self.status()),
            Request::Preempt {
                pid,
                gpu,
                max_hold_ms,
                confirm,
            } => self.preempt(
                pid,
                gpu.as_deref(),
                max_hold_ms.map(Duration::from_millis),
                confirm,
            ),
            Request::Resume { pid } => self.resume_to_gate(pid),
            Request::ResumeAll => self.resume_all(),
            Request::GateStart(spec) => self.gate_start(*spec),
            Request::GateStop => self.gate_stop(),
            Request::GateStatus => self.gate_status(),
            Request::OnlineBusy => self.gate_signal(true),
            Request::OnlineIdle => self.gate_signal(false),
            Request::Harvest => match &self.harvest {
                Some(h) => match h.profile() {
                    Ok(p) => Reply::ok(Data::Harvest(p.value.clone())),
                    Err(why) => Reply::fail(ErrorCode::Failed, why),
                },
                None => Reply::fail(
                    ErrorCode::Failed,
                    "this daemon does not collect the harvest profile (`valvectl daemon` \
                     starts it)",
                ),
            },
            Request::GateTrace { after, limit } => match &self.gate {
                Some(g) => Reply::ok(g.trace(after, limit.unwrap_or(10_000))),
                None => Reply::fail(
                    ErrorCode::Failed,
                    "no gate is running (start one with `valvectl gate start`)",
                ),
            },
        }
    }

    fn status(&self) -> StatusReply {
        StatusReply {
            uptime_s: self.started.elapsed().as_secs_f64(),
            events: self.events,
            discovery: self.discovery,
            processes: self.registry.processes().len(),
            preempted: self.preempted.keys().copied().collect(),
            max_hold_ms: self.max_hold.map(|d| d.as_millis() as u64),
            state_file: self.state.file().path().to_path_buf(),
            recovered_at_start: self.recovered,
            recovery_failures: self.recovery_failures.clone(),
            restored_from_journal: self.restored.clone(),
            state_file_moved_aside: self.state_salvage.as_ref().map(|s| s.moved_to.clone()),
            gpus: self.ctl.gpus().iter().map(gpu_entry).collect(),
            gate: Some(self.gate_reply()),
            freeze_checks: self.freeze.counts(),
        }
    }

    fn ps(&self) -> Reply {
        let gpus = self.ctl.gpus();
        let listed = self.registry.processes().into_iter();
        let mps = self.mps_roles(listed.chain(self.pre_existing.iter().copied()));
        let mps_of = |pid: u32| mps.get(&pid).map(|r| r.wire());
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
                    ProcessGpu {
                        gpu: index,
                        device_instance: v.device_instance,
                        client: format!("{:#x}", v.client.0),
                        tsgs: v
                            .tsgs
                            .iter()
                            .map(|t| TsgEntry {
                                handle: format!("{:#x}", t.handle.0),
                                channels: t
                                    .channels
                                    .iter()
                                    .map(|c| format!("{:#x}", c.handle.0))
                                    .collect(),
                                compute: t.has_compute(),
                            })
                            .collect(),
                        channels: v.channels().count(),
                    }
                })
                .collect();
            if views.is_empty() {
                continue;
            }
            procs.push(ProcessEntry {
                pid,
                comm: comm(pid),
                discoverable: true,
                preempted: Some(self.preempted.contains_key(&pid)),
                gpus: views,
                note: None,
                mps: mps_of(pid),
            });
        }
        for &pid in &self.pre_existing {
            if alive(pid) {
                procs.push(ProcessEntry {
                    pid,
                    comm: comm(pid),
                    discoverable: false,
                    preempted: None,
                    gpus: Vec::new(),
                    note: Some("not discoverable: started before the daemon".into()),
                    mps: mps_of(pid),
                });
            }
        }
        Reply::ok(PsReply { processes: procs })
    }

    fn no_channels_reason(&self, pid: u32) -> String {
        if !alive(pid) {
            format!("no such process: {pid}")
        } else if !self.discovery {
            format!(
                "process {pid} ({}) has no known GPU channels: this daemon runs with \
                 --no-discovery, so it watches no process's RM calls",
                comm(pid)
            )
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

    fn preempt(
        &mut self,
        pid: u32,
        gpu: Option<&str>,
        hold: Option<Duration>,
        confirm: bool,
    ) -> Reply {
        if self.preempted.contains_key(&pid) {
            return Reply::ok(PreemptReply {
                pid,
                already_preempted: true,
                ..PreemptReply::default()
            });
        }
        // Who it is, read from /proc once, as first asked for: by the config's `[offline]`
        // rules now if it has any, else by the metrics after the disable.
        let who = Workload::of(pid);
        if let Err(why) = self.offline_policy.permits(&who) {
            return Reply::fail(
                ErrorCode::Permission,
                format!("not preempting process {pid}: {why}"),
            );
        }
        if let Some(refused) = self.mps_refusal(pid) {
            return refused;
        }
        let (records, targets, plan) = match self.preempt_plan(pid, gpu) {
            Ok(found) => found,
            Err(reply) => return reply,
        };
        let limit = match (hold, self.max_hold) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let preempted = Preempted {
            records,
            targets: targets.into(),
            check: CheckCancel::default(),
            label: String::new(),
            plan,
            since: Instant::now(),
            deadline: limit.map(|l| Instant::now() + l),
        };
        let (from_gate, timing) = match self.record_preempted(pid, preempted) {
            Ok(taken) => taken,
            Err(reply) => return reply,
        };
        let max_hold_ms = limit.map(|l| l.as_millis() as u64);
        if from_gate {
            let p = self.preempted.get(&pid).expect("inserted");
            return Reply::ok(PreemptReply {
                pid,
                channels: p.plan.channels(),
                gpus: p.plan.gpus(),
                disable: None,
                from_gate: true,
                max_hold_ms,
                timing_us: Some(timing.us(0)),
                ..PreemptReply::default()
            });
        }
        let mut reply = self.disable_preempted(pid, &who, max_hold_ms, timing);
        self.check_freeze(pid, confirm, &mut reply);
        reply
    }

    /// After a preempt's disable returned: with `confirm`, reads its channels back now and puts
    /// the check in the reply; else hands the check to the checker thread (cancelled by the
    /// resume), so that the pool's reclaim does not wait for it.
    fn check_freeze(&mut self, pid: u32, confirm: bool, reply: &mut Reply) {
        let Some(crate::protocol::Data::Preempt(data)) = reply.data.as_mut() else {
            return;
        };
        let Some(p) = self.preempted.get_mut(&pid) else {
            return;
        };
        let done = Instant::now();
        if confirm {
            let never = std::sync::atomic::AtomicBool::new(false);
            let c = freeze_check::check(&self.ctl, &p.targets, done, &never);
            self.freeze.record(Origin::Preempt, pid, &c);
            data.freeze = Some(c);
        } else if let Some(checker) = &self.freeze_checker {
            let cancel = checker.submit(Origin::Pool, pid, Arc::clone(&p.targets), done);
            p.check = CheckCancel(Some(cancel));
        }
    }

    /// What a preempt of `pid` disables (its channels on the GPU `gpu` names, else on every
    /// GPU), as state-file records and a plan; the error is the reply.
    fn preempt_plan(
        &self,
        pid: u32,
        gpu: Option<&str>,
    ) -> Result<(Vec<DisabledRecord>, Vec<ChannelTarget>, PreemptPlan), Reply> {
        let gpus = self.ctl.gpus();
        let want = match gpu.map(|s| s.parse::<GpuSelector>()) {
            None => None,
            Some(Ok(sel)) => match sel.resolve(&gpus) {
                Ok(i) => Some(gpus[i].device_instance),
                Err(e) => return Err(Reply::fail(ErrorCode::NoSuchGpu, e.to_string())),
            },
            Some(Err(e)) => return Err(Reply::fail(ErrorCode::BadRequest, e)),
        };
        let (targets, records) = self.channels_of(pid, want, &gpus);
        if targets.is_empty() {
            let msg = if want.is_some() && !self.registry.gpus(pid).is_empty() {
                format!(
                    "process {pid} has no GPU channels on GPU {}",
                    gpu.unwrap_or("")
                )
            } else {
                self.no_channels_reason(pid)
            };
            return Err(Reply::fail(ErrorCode::Process, msg));
        }
        let plan = self
            .ctl
            .plan(&targets, PreemptMode::Preempt)
            .map_err(|e| Reply::fail(ErrorCode::Rm, e.to_string()))?;
        Ok((records, targets, plan))
    }

    /// The registry's channels of `pid` on the GPU whose RM instance is `want` (every GPU if
    /// `None`), as disable targets and as records per GPU.
    fn channels_of(
        &self,
        pid: u32,
        want: Option<u32>,
        gpus: &[GpuInfo],
    ) -> (Vec<ChannelTarget>, Vec<DisabledRecord>) {
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
        (targets, records)
    }

    /// Records `p` as `pid`'s preemption in the state file, then takes `pid` out of the gate's
    /// hands. Returns whether the gate held all of it disabled (it is taken over as it is: no
    /// second disable), and when each step began.
    fn record_preempted(&mut self, pid: u32, p: Preempted) -> Result<(bool, PreemptTiming), Reply> {
        // Record first: if the daemon dies right after the disable, a restart re-enables.
        self.preempted.insert(pid, p);
        let record = Instant::now();
        if let Err(e) = self.record() {
            self.preempted.remove(&pid);
            return Err(Reply::fail(
                ErrorCode::Failed,
                format!("not preempting: cannot record it ({e})"),
            ));
        }
        let gate = Instant::now();
        // A gated process is the operator's from now on: the gate must not enable it again. The
        // claim waits for no thread (the gate thread's wake-up took 10-15 ms in a few hundred
        // reclaims), and the new offline set reads no /proc: this is the memory pool's path.
        let from_gate = match (&self.gate, self.preempted.get(&pid)) {
            (Some(g), Some(p)) => g.claim(pid, &crate::gate::runtime::channel_set(&p.records)),
            _ => false,
        };
        self.refresh_gate(Instant::now(), Rescan::Never);
        let disable = Instant::now();
        Ok((
            from_gate,
            PreemptTiming {
                record,
                gate,
                disable,
            },
        ))
    }

    /// Disables what [`Self::record_preempted`] recorded for `pid` and answers the preempt; if
    /// the disable fails, the record goes again.
    fn disable_preempted(
        &mut self,
        pid: u32,
        who: &Workload,
        max_hold_ms: Option<u64>,
        timing: PreemptTiming,
    ) -> Reply {
        let outcome = {
            let p = self.preempted.get(&pid).expect("inserted");
            self.ctl
                .disable(&p.plan)
                .map(|g| (g.keep_disabled(), p.plan.channels(), p.plan.gpus()))
                .map_err(|e| e.to_string())
        };
        let disable_us = timing.disable.elapsed().as_micros() as u64;
        if let (Ok((report, ..)), Some(m)) = (&outcome, &self.metrics) {
            // After the disable: the label lookup reads /proc and takes a lock.
            let label = m.workload_label(who.label());
            m.record_preemption(report, &label);
            if let Some(p) = self.preempted.get_mut(&pid) {
                p.label = label;
            }
        }
        match outcome {
            Ok((report, channels, gpus_n)) => Reply::ok(PreemptReply {
                pid,
                channels,
                gpus: gpus_n,
                disable: Some(batch_timing(&report)),
                max_hold_ms,
                from_gate: false,
                timing_us: Some(timing.us(disable_us)),
                ..PreemptReply::default()
            }),
            Err(message) => {
                self.preempted.remove(&pid);
                let _ = self.save();
                Reply::fail(ErrorCode::Rm, message)
            }
        }
    }

    /// `resume --pid`: a process the gate names goes back to the gate still disabled (it keeps
    /// it frozen while it holds offline, else enables it), so its channels never see an enable
    /// followed at once by the gate's disable; any other process is enabled here.
    fn resume_to_gate(&mut self, pid: u32) -> Reply {
        let Some(records) = self.preempted.get(&pid).map(|p| p.records.clone()) else {
            return self.resume(pid);
        };
        let Some(g) = &self.gate else {
            return self.resume(pid);
        };
        g.adopt(records);
        let p = self.preempted.remove(&pid).expect("checked");
        // The gate's new offline set, with this process if the gate names it, is recorded in the
        // state file before the gate thread gets it.
        self.sync_gate(Rescan::Never);
        let taken = self
            .gate
            .as_ref()
            .is_some_and(|g| g.records().iter().any(|r| r.pid == pid));
        if !taken {
            self.preempted.insert(pid, p);
            return self.resume(pid);
        }
        let _ = self.record();
        let held = p.since.elapsed();
        Reply::ok(ResumeReply {
            pid,
            enable: None,
            to_gate: true,
            held_ms: Some(held.as_secs_f64() * 1e3),
            note: None,
        })
    }

    fn resume(&mut self, pid: u32) -> Reply {
        let Some(p) = self.preempted.remove(&pid) else {
            return Reply::fail(
                ErrorCode::Process,
                format!("process {pid} is not preempted by this daemon (see `valvectl status`)"),
            );
        };
        let held = p.since.elapsed();
        p.check.cancel();
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
                if let Some(m) = &self.metrics {
                    m.record_resume(&report, &p.label, held);
                }
                Reply::ok(ResumeReply {
                    pid,
                    enable: Some(batch_timing(&report)),
                    held_ms: Some(held.as_secs_f64() * 1e3),
                    ..ResumeReply::default()
                })
            }
            Err(_) if gone => {
                let _ = self.save();
                Reply::ok(ResumeReply {
                    pid,
                    note: Some("the process's channels are gone (it exited)".into()),
                    ..ResumeReply::default()
                })
            }
            Err(e) => {
                // Keep it recorded so that a retry or a restart re-enables it.
                self.preempted.insert(pid, p);
                Reply::fail(ErrorCode::Rm, e.to_string())
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
            Reply::ok(ResumeAllReply { resumed: pids })
        } else {
            Reply::fail(ErrorCode::Rm, failures.join("; "))
        }
    }

    /// At exit: stops the gate, resumes everything this daemon disabled and writes the journal.
    /// The reply names what could not be resumed.
    pub fn shutdown(&mut self) -> Reply {
        self.finish_gate_start();
        if self.gate.is_some() {
            let _ = self.gate_stop();
        }
        let r = self.resume_all();
        if let Err(e) = self.flush_journal() {
            tracing::error!("writing the registry journal: {e}");
        }
        r
    }
}

/// The gate (`gate start|stop|status|busy|idle`, and its upkeep in the main loop). The gate
/// itself is [`crate::gate`]; here its offline set is recorded before the gate thread gets it.
impl<D: RmDriver> DaemonCore<D> {
    /// Sets how gate threads are started (without one, `gate start` is refused).
    pub fn set_gate_starter(&mut self, starter: GateStarter) {
        self.gate_starter = Some(starter);
    }

    /// Sets how long a `gate start` waits for its online processes' probes (tests shorten it).
    #[cfg(test)]
    pub(crate) fn set_probes_within(&mut self, within: Duration) {
        self.probes_within = within;
    }

    fn gate_status(&self) -> Reply {
        Reply::ok(self.gate_reply())
    }

    fn gate_reply(&self) -> GateReply {
        match (&self.gate, &self.gate_pending) {
            (Some(g), _) => g.status().into(),
            (None, pending) => GateReply::idle(pending.is_some()),
        }
    }

    /// Stops the gate (its thread enables offline) and drops its records.
    pub fn gate_stop(&mut self) -> Reply {
        if self.gate_pending.is_some() {
            return Reply::fail(
                ErrorCode::Failed,
                "the gate is still starting (attaching its BPF programs); stop it once \
                 `valvectl gate start` has answered",
            );
        }
        let Some(g) = self.gate.take() else {
            return Reply::fail(
                ErrorCode::Failed,
                "no gate is running (start one with `valvectl gate start`)",
            );
        };
        let key = g.history_key();
        let (status, history) = g.stop(&self.ctl);
        self.keep_hold_history(key, history);
        if let Some(m) = &self.metrics {
            m.gate_stopped();
        }
        self.harvest_gate_changed();
        if let Err(e) = self.save() {
            tracing::error!("updating the state file: {e}");
        }
        Reply::ok(status)
    }

    /// Keeps a stopped gate's hold history, in memory and in the state directory.
    fn keep_hold_history(&mut self, service: String, history: crate::gate::policy::HoldHistory) {
        let now = crate::memory::server::warm::unix_now();
        if !self.hold_histories.keep(service, history, now) {
            return;
        }
        if let Err(e) = self.hold_histories.save(&self.hold_histories_path) {
            tracing::error!(
                "writing {}: {e}; the next gate keeps the hold's history only while this \
                 daemon runs",
                self.hold_histories_path.display()
            );
        }
    }

    fn gate_signal(&mut self, busy: bool) -> Reply {
        if let Some(queued) = self.queue_signal(busy) {
            return queued;
        }
        match &self.gate {
            Some(g) => Reply::ok(g.signal(busy)),
            None => Reply::fail(
                ErrorCode::Failed,
                "no gate is running: start one with `valvectl gate start` before sending \
                 busy/idle signals",
            ),
        }
    }

    /// Brings the gate thread's online and offline sets up to date (labels and ports are looked
    /// up again in /proc as `rescan` says), and notices a gate thread that died.
    pub fn refresh_gate(&mut self, now: Instant, rescan: Rescan) {
        let Some(g) = self.gate.as_mut() else { return };
        if g.handle_finished() {
            let records = std::mem::take(&mut g.records);
            self.gate = None;
            if let Some(m) = &self.metrics {
                m.gate_stopped();
            }
            let (n, failures) = reenable(&self.ctl, &records);
            tracing::error!(
                "the gate thread ended unexpectedly; re-enabled {n} offline channel(s), \
                 failures: {failures:?}"
            );
            self.harvest_gate_changed();
            if let Err(e) = self.save() {
                tracing::error!("updating the state file: {e}");
            }
            return;
        }
        let preempted = &self.preempted;
        let (policy, cache) = (&self.offline_policy, &self.permit_cache);
        // Processes the config does not allow to be frozen are left out of the offline set.
        let denied = |p: u32| {
            policy.restricts()
                && !*cache
                    .borrow_mut()
                    .entry(p)
                    .or_insert_with(|| policy.permits(&Workload::of(p)).is_ok())
        };
        let (mps, mps_cache, registry, pre) = (
            &self.mps,
            &self.mps_cache,
            &self.registry,
            &self.pre_existing,
        );
        let left_alone = |p: u32| {
            preempted.contains_key(&p)
                || denied(p)
                || mps_guard::gate_leaves_out(mps, mps_cache, registry, pre, p)
        };
        let Some(update) = g.refresh(now, rescan, &self.registry, left_alone) else {
            return;
        };
        // Recorded before the gate thread may disable them.
        if let Err(e) = self.record() {
            tracing::error!("recording the gate's offline channels: {e}");
        }
        if let Some(g) = &self.gate {
            g.apply(update);
            if let Some(m) = &self.metrics {
                m.gate_offline_present(!g.records().is_empty());
            }
        }
    }

    /// Tells the gate thread the current sets and waits until it has applied them (so that a
    /// hand-back to the gate is settled before the reply). `rescan`: whether labels and ports
    /// are looked up in /proc first, which costs milliseconds.
    fn sync_gate(&mut self, rescan: Rescan) {
        self.refresh_gate(Instant::now(), rescan);
        if let Some(g) = &self.gate {
            g.sync();
        }
    }
}

/// The harvest profile's inputs (the gate's trace, the online processes' GPUs); the profile
/// itself is built on the harvest thread ([`crate::harvest`]).
impl<D: RmDriver> DaemonCore<D> {
    /// Feeds `h` from now on: the running gate's trace and, about once a second, the processes
    /// view; `harvest` requests are answered from its cached document.
    pub fn set_harvest(&mut self, h: Arc<HarvestShared>) {
        h.set_gate(self.gate.as_ref().map(ActiveGate::shared));
        self.harvest = Some(h);
        self.harvest_view_at = None;
        self.publish_harvest_view(Instant::now());
    }

    /// Tells the harvest thread which gate runs now (after a start or a stop), and the
    /// processes it gates.
    fn harvest_gate_changed(&mut self) {
        if let Some(h) = &self.harvest {
            h.set_gate(self.gate.as_ref().map(ActiveGate::shared));
            self.harvest_view_at = None;
            self.publish_harvest_view(Instant::now());
        }
    }

    /// Publishes the gate's online processes with their GPUs, and its offline pids, to the
    /// harvest thread; at most once a second (the main loop calls it every turn).
    pub fn publish_harvest_view(&mut self, now: Instant) {
        let Some(h) = &self.harvest else { return };
        if self
            .harvest_view_at
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return;
        }
        self.harvest_view_at = Some(now);
        let mut view = ProcessView::default();
        if let Some(g) = &self.gate {
            let gpus = self.ctl.gpus();
            view.gate_running = true;
            view.offline = g.records().iter().map(|r| r.pid).collect();
            for &pid in g.online() {
                // A CUDA process opens a device on every GPU it can see; it runs work only
                // where it has channels.
                let mut on: Vec<u32> = self
                    .registry
                    .gpus(pid)
                    .iter()
                    .filter(|v| v.channels().next().is_some())
                    .filter_map(|v| v.device_instance)
                    .filter_map(|i| gpus.iter().find(|g| g.device_instance == i))
                    .map(|g| g.index as u32)
                    .collect();
                on.sort_unstable();
                on.dedup();
                view.online_gpus.insert(pid, on);
            }
        }
        h.set_view(view);
    }
}

/// Answers a client's hello: the daemon's version, or the named error when the client speaks
/// another protocol version.
fn hello(client: u32) -> Reply {
    if client != PROTOCOL_VERSION {
        return Reply::fail(
            ErrorCode::VersionMismatch,
            valve_protocol::version_mismatch_message(PROTOCOL_VERSION, client),
        );
    }
    Reply::ok(Hello {
        protocol_version: PROTOCOL_VERSION,
        daemon_version: env!("CARGO_PKG_VERSION").into(),
    })
}

#[cfg(test)]
pub(crate) mod tests;
