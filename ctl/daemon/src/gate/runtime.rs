//! The gate's runtime: one thread that owns its own RM client, turns arrival and launch edges and
//! busy/idle signals into disables and enables of the offline channels, and re-enables them on
//! every exit. Each decision is recorded in the gate's [`TraceRing`].
//!
//! The daemon starts it ([`spawn`]), feeds it the offline processes' channels as discovery learns
//! them, and reads its [`GateStatus`]. The thread waits on one channel of [`GateInput`]s, with a
//! timeout that ends exactly when the policy's cooldown would; [`GateRuntime`] is the same logic
//! without the thread, for tests.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use valve::controller::{Controller, PreemptMode, PreemptPlan};
use valve::driver::RmDriver;
use valve::state::{reenable, targets_of, DisabledRecord};
pub use valve::stats::monotonic_ns;
use valve::stats::{summarize_us, Summary};
use valve_ebpf::realtime::{self, Scheduling};
use valve_ebpf::{ArrivalCounts, ArrivalEdge, LaunchEdge, WatchedPort};

use super::policy::{Action, GateConfig, GatePolicy};
use super::trace::{TraceKind, TraceRecord, TraceRing, TRACE_CAPACITY};

/// What the gate thread is told.
#[derive(Clone, Debug)]
pub enum GateInput {
    /// An online process launched GPU work after an idle gap (from the uprobe watcher).
    Edge(LaunchEdge),
    /// Request data reached an online port after an idle gap (from the arrival watcher).
    Arrival(ArrivalEdge),
    /// The online ports whose arrivals count (replaces the previous set).
    Ports(BTreeSet<WatchedPort>),
    /// The serving framework: a request is in flight.
    Busy,
    /// The serving framework: no request is in flight.
    Idle,
    /// The offline channels, per process and GPU (replaces the previous set).
    Offline(Vec<DisabledRecord>),
    /// The online processes (replaces the previous set).
    Online(BTreeSet<u32>),
    /// These channels come back from a manual preempt still disabled: in the next offline set
    /// the gate keeps them disabled if it holds offline, else enables them (never an enable
    /// followed at once by a disable). Forgotten at the next [`GateInput::Sync`].
    Adopt(Vec<DisabledRecord>),
    /// Answer on this channel once every earlier input has been applied.
    Sync(mpsc::SyncSender<()>),
    /// Enable everything and end the thread.
    Stop,
}

/// Where the gate learns when online processes last launched GPU work.
pub trait LaunchSource: Send {
    /// Start reporting `pid`'s launches (edges go to the gate's input channel).
    fn watch(&mut self, pid: u32) -> Result<(), String>;
    /// Stop reporting `pid`.
    fn unwatch(&mut self, pid: u32);
    /// CLOCK_MONOTONIC ns of `pid`'s latest launch or end of a wait for its GPU work (0: none).
    fn last_launch_ns(&self, pid: u32) -> u64;
    /// Whether a thread of `pid` is waiting for its GPU work now (inside a synchronising call).
    fn in_sync(&self, _pid: u32) -> bool {
        false
    }
    /// CLOCK_MONOTONIC ns at which a thread of `pid` last returned from waiting for its GPU
    /// work (0: none, or waits are not watched).
    fn last_wait_end_ns(&self, _pid: u32) -> u64 {
        0
    }
    /// How the source's threads are scheduled, by thread name (none: it has no threads).
    fn scheduling(&self) -> Vec<(&'static str, Scheduling)> {
        Vec::new()
    }
    /// Start counting request arrivals on `port` (edges go to the gate's input channel).
    fn watch_port(&mut self, port: WatchedPort) -> Result<(), String> {
        Err(format!(
            "port {}: this gate has no arrival watcher",
            port.port
        ))
    }
    /// Stop counting arrivals on `port`.
    fn unwatch_port(&mut self, _port: u16) {}
    /// The arrival counters of `port`: arrivals, edges and the latest arrival's time (all 0:
    /// none yet). A busy-polling gate spins on them (`--arrival-busy-poll`).
    fn arrival_counts(&self, _port: u16) -> ArrivalCounts {
        ArrivalCounts::default()
    }
    /// The calls of `pid` that hit the launch watcher's probes so far (each costs the calling
    /// thread a trap into the kernel; zeros where the source does not count them).
    fn probe_hits(&self, _pid: u32) -> ProbeHits {
        ProbeHits::default()
    }
    /// Offline is about to resume at `now_ns`: report each online process's next launch as an
    /// edge whatever its idle gap (0: disarm, no resume after all). Errors are the source's to
    /// log; the gate resumes anyway.
    fn arm_resume(&self, _now_ns: u64) {}
}

impl LaunchSource for valve_ebpf::LaunchWatcher {
    fn watch(&mut self, pid: u32) -> Result<(), String> {
        valve_ebpf::LaunchWatcher::watch(self, pid).map_err(|e| e.to_string())
    }
    fn unwatch(&mut self, pid: u32) {
        valve_ebpf::LaunchWatcher::unwatch(self, pid);
    }
    fn last_launch_ns(&self, pid: u32) -> u64 {
        self.counts(pid).last_ns
    }
    fn last_wait_end_ns(&self, pid: u32) -> u64 {
        self.counts(pid).sync_end_ns
    }
    fn probe_hits(&self, pid: u32) -> ProbeHits {
        ProbeHits::from(&self.counts(pid))
    }
    fn arm_resume(&self, now_ns: u64) {
        if let Err(e) = valve_ebpf::LaunchWatcher::arm_resume(self, now_ns) {
            tracing::warn!("gate: {e}");
        }
    }
}

/// Calls of the online processes that hit the launch watcher's probes: what the gate costs
/// their host threads (about 1-2 us per launch; a synchronising call is probed on entry and
/// on return).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProbeHits {
    /// Kernel launches (every variant).
    pub kernel_launches: u64,
    /// Graph launches.
    pub graph_launches: u64,
    /// Synchronising calls.
    pub syncs: u64,
}

impl From<&valve_ebpf::LaunchCounts> for ProbeHits {
    fn from(c: &valve_ebpf::LaunchCounts) -> Self {
        ProbeHits {
            kernel_launches: c.kernel_launches,
            graph_launches: c.graph_launches,
            syncs: c.syncs,
        }
    }
}

impl std::ops::AddAssign for ProbeHits {
    fn add_assign(&mut self, o: ProbeHits) {
        self.kernel_launches += o.kernel_launches;
        self.graph_launches += o.graph_launches;
        self.syncs += o.syncs;
    }
}

/// What the gate has done, as `valvectl gate status` shows it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GateStatus {
    /// The gate thread is running.
    pub running: bool,
    /// Offline is preempted now.
    pub preempted: bool,
    /// Held preempted by an explicit "busy" signal.
    pub pinned: bool,
    /// Preemptions so far (policy decisions, whether or not offline had channels yet).
    pub preemptions: u64,
    /// Resumes so far.
    pub resumes: u64,
    /// Idle->busy launch edges of online processes received.
    pub edges: u64,
    /// Arrival edges (request data on an online port after idling) received.
    pub arrivals: u64,
    /// Online processes watched.
    pub online_pids: Vec<u32>,
    /// Online ports whose request arrivals preempt.
    pub online_ports: Vec<u16>,
    /// Offline processes gated.
    pub offline_pids: Vec<u32>,
    /// Their channels, over all GPUs.
    pub offline_channels: usize,
    /// GPUs they use.
    pub offline_gpus: usize,
    /// The cooldown in force now.
    pub cooldown_us: f64,
    /// How long an arrival holds offline while no launch follows it.
    pub arrival_hold_us: f64,
    /// How the offline GPUs are issued: "serial", "parallel", or "serial (calibrating)".
    pub issue: String,
    /// How the threads an edge crosses are scheduled: the gate thread, then each watcher's poll
    /// thread ("gate SCHED_FIFO 10, launch-watch SCHED_FIFO 10, ...").
    pub scheduling: String,
    /// Every one of those threads preempts a busy CPU when woken (`SCHED_FIFO`, or a short
    /// slice where that was refused); false: an edge can wait for a CPU's slice.
    pub fast_wakeups: bool,
    /// The trace's latest sequence number (`valvectl gate trace --since`).
    pub trace_head: u64,
    /// Total time offline spent preempted by the gate.
    pub preempted_s: f64,
    /// Disable calls (all GPUs at once), wall time.
    pub disable_us: Summary,
    /// Enable calls, wall time.
    pub enable_us: Summary,
    /// From the online launch (uprobe timestamp) to the disable call's start.
    pub reaction_us: Summary,
    /// From the online launch to the disable call's return (the offline GPUs are stopped).
    pub edge_to_disable_us: Summary,
    /// From the request's arrival (BPF timestamp) to the disable call's return.
    pub arrival_to_disable_us: Summary,
    /// The online processes' probed calls so far (of the processes watched now; read at most
    /// every 100 ms).
    pub online_probe_hits: ProbeHits,
    /// Failed disables/enables (each is retried process by process).
    pub errors: u64,
    /// The latest failure.
    pub last_error: Option<String>,
}

#[derive(Clone, Default)]
struct Samples {
    disable: Vec<f64>,
    enable: Vec<f64>,
    reaction: Vec<f64>,
    edge_to_disable: Vec<f64>,
    arrival_to_disable: Vec<f64>,
}

/// Samples kept per series; older ones are dropped (status then covers the latest ones). Small
/// enough that copying them out for a status holds the lock for microseconds.
const MAX_SAMPLES: usize = 10_000;

fn push(v: &mut Vec<f64>, x: f64) {
    if v.len() >= MAX_SAMPLES {
        v.drain(..MAX_SAMPLES / 2);
    }
    v.push(x);
}

/// What the gate thread shares with the daemon: status and samples behind a lock (written after
/// each decision), and the decision trace (lock-free).
pub struct GateShared {
    status: Mutex<SharedStatus>,
    /// Signalled once the runtime has enabled offline on its way out (its `Drop`).
    ended: Condvar,
    /// The runtime was dropped by a panic.
    panicked: AtomicBool,
    trace: TraceRing,
    /// What the gate holds disabled, and the processes the daemon took out of its hands. The
    /// gate thread holds this lock through each disable and enable.
    claims: Mutex<Claims>,
    /// Offline sets sent to the gate thread so far ([`GateInput::Offline`]).
    offline_sent: AtomicU64,
}

/// The hand-over of offline processes from the gate to the daemon (a manual preempt, the memory
/// pool's reclaim), done under one lock instead of a round trip to a thread that may be asleep.
#[derive(Debug, Default)]
struct Claims {
    /// Channels the gate thread holds disabled now.
    held: ChannelSet,
    /// Processes the daemon took over, each with the number of the first offline set sent
    /// after the claim: until the gate applies that set, it neither enables nor disables them.
    taken: BTreeMap<u32, u64>,
}

impl Claims {
    /// Whether the daemon took over any process of `records`.
    fn any_taken(&self, records: &[DisabledRecord]) -> bool {
        records.iter().any(|r| self.taken.contains_key(&r.pid))
    }

    /// `records` without the processes the daemon took over (`None`: none of them is).
    fn untaken(&self, records: &[DisabledRecord]) -> Option<Vec<DisabledRecord>> {
        self.any_taken(records).then(|| {
            records
                .iter()
                .filter(|r| !self.taken.contains_key(&r.pid))
                .cloned()
                .collect()
        })
    }
}

fn lock_claims(shared: &GateShared) -> MutexGuard<'_, Claims> {
    shared.claims.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Channels as (RM device instance, client, channel) triples.
pub type ChannelSet = BTreeSet<(u32, u32, u32)>;

impl Default for GateShared {
    fn default() -> Self {
        GateShared {
            status: Mutex::default(),
            ended: Condvar::new(),
            panicked: AtomicBool::new(false),
            trace: TraceRing::new(TRACE_CAPACITY),
            claims: Mutex::default(),
            offline_sent: AtomicU64::new(0),
        }
    }
}

impl GateShared {
    /// The decision trace.
    pub fn trace(&self) -> &TraceRing {
        &self.trace
    }

    /// See [`GateHandle::claim`].
    fn claim(&self, pid: u32, channels: &ChannelSet) -> bool {
        let mut claims = lock_claims(self);
        let first = self.offline_sent.load(Ordering::SeqCst) + 1;
        claims.taken.insert(pid, first);
        let held = !channels.is_empty() && channels.is_subset(&claims.held);
        claims.held.retain(|c| !channels.contains(c));
        held
    }
}

/// The status and samples the gate thread shares with the daemon.
#[derive(Default)]
struct SharedStatus {
    status: GateStatus,
    samples: Samples,
}

/// A snapshot of `shared` with the latency summaries filled in. Only the copy happens under the
/// lock, so a status request never holds up the gate thread for the sorting.
fn snapshot(shared: &GateShared) -> GateStatus {
    let (mut s, samples) = {
        let g = shared.status.lock().unwrap_or_else(PoisonError::into_inner);
        (g.status.clone(), g.samples.clone())
    };
    s.disable_us = summarize_us(&samples.disable);
    s.enable_us = summarize_us(&samples.enable);
    s.reaction_us = summarize_us(&samples.reaction);
    s.edge_to_disable_us = summarize_us(&samples.edge_to_disable);
    s.arrival_to_disable_us = summarize_us(&samples.arrival_to_disable);
    s.trace_head = shared.trace.head();
    s
}

/// What started a preemption, for its latency samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    /// A launch edge at this CLOCK_MONOTONIC ns.
    Launch(u64),
    /// An arrival edge at this CLOCK_MONOTONIC ns.
    Arrival(u64),
    /// A busy signal, or channels that appeared while preempted.
    Other,
}

/// The gate's state without the thread: feed it inputs and ticks with explicit times.
/// Dropping it enables whatever it has disabled.
pub struct GateRuntime<D: RmDriver, L: LaunchSource> {
    ctl: Controller<D>,
    launches: L,
    policy: GatePolicy,
    records: Vec<DisabledRecord>,
    plan: Option<PreemptPlan>,
    /// Offline channels are disabled by this gate now.
    disabled: bool,
    /// Offline sets applied so far (the claims of [`Claims::taken`] count them).
    offline_applied: u64,
    /// When the status's probe counters were last read (0: read at the next update).
    probe_hits_read_ns: std::cell::Cell<u64>,
    /// Channels handed back disabled ([`GateInput::Adopt`]), until the next sync.
    adopt: BTreeSet<(u32, u32, u32)>,
    disabled_since: Option<Instant>,
    online: BTreeSet<u32>,
    ports: BTreeSet<WatchedPort>,
    /// The issue mode is to be measured once on the first offline plan with 2 or more GPUs.
    probe_pending: bool,
    /// Spin on the input channel and the arrival counters while offline runs
    /// (`--arrival-busy-poll`).
    busy_poll: bool,
    /// Edge counts of the watched ports as last polled (taken afresh whenever polling starts).
    polled_edges: BTreeMap<u16, u64>,
    /// The latest arrival handled per port: an edge at or before it is one already handled
    /// (polled from the counters, then read again from the ring buffer).
    handled_arrival_ns: BTreeMap<u16, u64>,
    shared: Arc<GateShared>,
}

/// A thread waiting for online GPU work holds offline for at most this many cooldown ceilings
/// after the last online launch (a long prefill waits that long at most; a stuck wait is no work).
const SYNC_HOLD_FACTOR: u64 = 5;

/// How often the status's probe counters are read again.
const PROBE_HITS_EVERY_NS: u64 = 100_000_000;

/// Disable/enable rounds of each kind when the gate measures the issue mode.
const PROBE_CYCLES: usize = 5;

impl<D: RmDriver, L: LaunchSource> GateRuntime<D, L> {
    /// A gate with offline running and nothing gated yet.
    pub fn new(ctl: Controller<D>, launches: L, cfg: GateConfig, shared: Arc<GateShared>) -> Self {
        Self::with_scheduling(ctl, launches, cfg, shared, Scheduling::Normal)
    }

    /// As [`GateRuntime::new`], on a thread scheduled as `own` (reported in the status).
    fn with_scheduling(
        ctl: Controller<D>,
        launches: L,
        cfg: GateConfig,
        shared: Arc<GateShared>,
        own: Scheduling,
    ) -> Self {
        if let Some(mode) = cfg.issue {
            ctl.set_issue_mode(mode);
        }
        let rt = GateRuntime {
            ctl,
            launches,
            policy: GatePolicy::new(cfg),
            records: Vec::new(),
            plan: None,
            disabled: false,
            offline_applied: 0,
            probe_hits_read_ns: std::cell::Cell::new(0),
            adopt: BTreeSet::new(),
            disabled_since: None,
            online: BTreeSet::new(),
            ports: BTreeSet::new(),
            probe_pending: cfg.issue.is_none(),
            busy_poll: cfg.arrival_busy_poll,
            polled_edges: BTreeMap::new(),
            handled_arrival_ns: BTreeMap::new(),
            shared,
        };
        let issue = rt.ctl.issue_mode().describe();
        let threads: Vec<_> = std::iter::once(("gate", own))
            .chain(rt.launches.scheduling())
            .collect();
        let scheduling = threads
            .iter()
            .map(|(name, s)| format!("{name} {s}"))
            .collect::<Vec<_>>()
            .join(", ");
        let fast_wakeups = threads.iter().all(|(_, s)| {
            matches!(
                s,
                Scheduling::Fifo(_)
                    | Scheduling::Deadline(..)
                    | Scheduling::ShortSlice(..)
                    | Scheduling::BusyPoll
            )
        });
        if threads
            .iter()
            .any(|(_, s)| matches!(s, Scheduling::Refused(_)))
        {
            tracing::warn!(
                "gate: real-time scheduling refused ({scheduling}); edges may wait for a CPU"
            );
        }
        rt.update(|s| {
            s.running = true;
            s.issue = issue;
            s.scheduling = scheduling;
            s.fast_wakeups = fast_wakeups;
        });
        rt
    }

    fn update(&self, f: impl FnOnce(&mut GateStatus)) {
        let hits = self.probe_hits_due();
        let mut g = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        f(&mut g.status);
        if let Some(hits) = hits {
            g.status.online_probe_hits = hits;
        }
        g.status.preempted = self.policy.preempted();
        g.status.pinned = self.policy.pinned();
        g.status.preemptions = self.policy.preemptions();
        g.status.arrivals = self.policy.arrivals();
        g.status.cooldown_us = self.policy.cooldown().as_secs_f64() * 1e6;
        g.status.arrival_hold_us = self.policy.arrival_hold().as_secs_f64() * 1e6;
    }

    /// The online processes' probe counters, if a read is due: they cost a map lookup per
    /// process, so they are read at most every [`PROBE_HITS_EVERY_NS`], not on every decision
    /// (and at once after the online set changes).
    fn probe_hits_due(&self) -> Option<ProbeHits> {
        let now = monotonic_ns();
        let last = self.probe_hits_read_ns.get();
        if last != 0 && now.saturating_sub(last) < PROBE_HITS_EVERY_NS {
            return None;
        }
        self.probe_hits_read_ns.set(now);
        let mut hits = ProbeHits::default();
        for &p in &self.online {
            hits += self.launches.probe_hits(p);
        }
        Some(hits)
    }

    fn sample(&self, f: impl FnOnce(&mut Samples)) {
        let mut g = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        f(&mut g.samples);
    }

    fn trace(&self, kind: TraceKind, t_ns: u64, id: u32, a: u64, b: u64) {
        self.shared.trace.push(kind, t_ns, id, a, b, 0);
    }

    fn error(&self, what: String) {
        tracing::error!("gate: {what}");
        if let Some(m) = crate::metrics::for_gate() {
            m.record_error(crate::metrics::ErrorCause::Gate);
        }
        self.update(|s| {
            s.errors += 1;
            s.last_error = Some(what);
        });
    }

    /// Whether offline channels are disabled by this gate now.
    pub fn offline_disabled(&self) -> bool {
        self.disabled
    }

    /// The policy (for inspection).
    pub fn policy(&self) -> &GatePolicy {
        &self.policy
    }

    /// The controller (for inspection).
    pub fn controller(&self) -> &Controller<D> {
        &self.ctl
    }

    fn watched_port(&self, e: &ArrivalEdge) -> bool {
        self.ports
            .iter()
            .any(|p| p.port == e.port && (p.netns == 0 || p.netns == e.netns))
    }

    /// Handles one input received at `now_ns`; returns false on [`GateInput::Stop`].
    pub fn handle(&mut self, input: GateInput, now_ns: u64) -> bool {
        match input {
            GateInput::Edge(e) => {
                if !self.online.contains(&e.pid) {
                    return true;
                }
                let kind = if e.after_resume {
                    TraceKind::LaunchAfterResume
                } else {
                    TraceKind::Launch
                };
                self.trace(kind, e.ts_ns, e.pid, now_ns, e.idle_ns);
                let idle = (e.idle_ns > 0).then_some(e.idle_ns);
                if self.policy.on_edge(e.ts_ns, idle) == Some(Action::Preempt) {
                    self.disable(Cause::Launch(e.ts_ns));
                }
                // Counted after the disable: nothing that can wait on a lock comes before it.
                self.update(|s| s.edges += 1);
            }
            GateInput::Arrival(e) => {
                if !self.watched_port(&e) || !self.first_sight(&e) {
                    return true;
                }
                self.shared.trace.push(
                    TraceKind::Arrival,
                    e.ts_ns,
                    u32::from(e.port),
                    now_ns,
                    e.idle_ns,
                    e.read_ns,
                );
                if self.policy.on_arrival(e.ts_ns) == Some(Action::Preempt) {
                    self.disable(Cause::Arrival(e.ts_ns));
                }
                self.update(|_| {});
            }
            GateInput::Busy => {
                self.trace(TraceKind::Busy, now_ns, 0, 0, 0);
                if self.policy.on_busy(now_ns) == Some(Action::Preempt) {
                    self.disable(Cause::Other);
                }
                self.update(|_| {});
            }
            GateInput::Idle => {
                self.trace(TraceKind::Idle, now_ns, 0, 0, 0);
                if self.policy.on_idle() == Some(Action::Resume) {
                    self.launches.arm_resume(monotonic_ns());
                    self.enable();
                }
                self.update(|_| {});
            }
            GateInput::Offline(records) => self.set_offline(records),
            GateInput::Online(pids) => self.set_online(pids),
            GateInput::Ports(ports) => self.set_ports(ports),
            GateInput::Adopt(records) => self.adopt = channel_set(&records),
            GateInput::Sync(ack) => {
                self.adopt.clear();
                let _ = ack.try_send(());
            }
            GateInput::Stop => return false,
        }
        true
    }

    /// Time passes: resumes offline once online has been idle for the cooldown (or, after an
    /// arrival that launched nothing, for the arrival hold).
    ///
    /// Before it resumes it arms the launch watcher and reads the counters once more: a launch
    /// after the arm is reported as an edge (which preempts again at once), and one before it is
    /// in this second reading (which pushes the resume out). So no online launch runs beside
    /// resumed offline work without the gate hearing of it, whatever its idle gap.
    pub fn tick(&mut self, now_ns: u64) {
        // Later activity can only push the due time out, so before it nothing needs reading.
        if !self.resume_due(now_ns) {
            return;
        }
        let waiting = self.read_activity(now_ns);
        if !self.resume_due(now_ns) || self.policy.hold_for_first_wait(now_ns) {
            return;
        }
        self.launches.arm_resume(monotonic_ns());
        let waiting = self.read_activity(now_ns) || waiting;
        if !self.resume_due(now_ns) {
            // Online launched in between: no resume, so no launch should be flagged as after one.
            self.launches.arm_resume(0);
            return;
        }
        let activity = self.policy.last_launch_ns().unwrap_or(0);
        let due = self.policy.resume_due_ns().unwrap_or(now_ns);
        if self.policy.on_tick(now_ns) == Some(Action::Resume) {
            // Flag a resume that ignored a wait (the stuck-thread bound ran out): if online was in
            // fact busy, its launches did not reach the probe.
            self.trace(
                TraceKind::Cooldown,
                now_ns,
                u32::from(waiting),
                activity,
                due.saturating_sub(activity),
            );
            self.enable();
            self.update(|_| {});
        }
    }

    /// The latest of `time` over the online processes (0: none).
    fn latest_online(&self, time: impl Fn(&L, u32) -> u64) -> u64 {
        self.online
            .iter()
            .map(|&p| time(&self.launches, p))
            .max()
            .unwrap_or(0)
    }

    fn resume_due(&self, now_ns: u64) -> bool {
        self.policy.resume_due_ns().is_some_and(|due| now_ns >= due)
    }

    /// Feeds the policy the online activity the watchers' counters hold: launches that were not
    /// edges (closer together than the edge gap), threads waiting for online GPU work, and
    /// arrivals that were not edges. Returns whether a thread is waiting now.
    fn read_activity(&mut self, now_ns: u64) -> bool {
        let last = self.latest_online(L::last_launch_ns);
        if last > 0 {
            self.policy.saw_launch(last);
        }
        // A thread waiting for online GPU work: online is busy now although it launches nothing
        // (a launch gap is not GPU idleness). Not for longer than SYNC_HOLD_FACTOR x the ceiling
        // after its last launch, so a thread stuck in a wait cannot hold offline forever.
        let bound = SYNC_HOLD_FACTOR * self.policy.ceiling().as_nanos() as u64;
        let recent = last > 0 && now_ns.saturating_sub(last) < bound;
        let waiting = self.online.iter().any(|&p| self.launches.in_sync(p));
        if recent && waiting {
            self.policy.saw_activity(now_ns);
        }
        self.policy
            .saw_wait_end(self.latest_online(L::last_wait_end_ns));
        let arrived = self
            .ports
            .iter()
            .map(|p| self.launches.arrival_counts(p.port).last_ns)
            .max()
            .unwrap_or(0);
        if arrived > 0 {
            self.policy.saw_activity(arrived);
        }
        waiting
    }

    /// How long the thread may wait for input before it must tick.
    pub fn wait_for(&self, now_ns: u64) -> Duration {
        match self.policy.resume_due_ns() {
            Some(due) => Duration::from_nanos(due.saturating_sub(now_ns)),
            None => Duration::from_millis(100),
        }
    }

    fn set_online(&mut self, pids: BTreeSet<u32>) {
        for &p in pids.difference(&self.online) {
            if let Err(e) = self.launches.watch(p) {
                self.error(format!("watching online pid {p}: {e}"));
            }
        }
        for &p in self.online.difference(&pids) {
            self.launches.unwatch(p);
        }
        self.online = pids;
        self.probe_hits_read_ns.set(0);
        let online: Vec<u32> = self.online.iter().copied().collect();
        self.update(|s| s.online_pids = online);
    }

    fn set_ports(&mut self, ports: BTreeSet<WatchedPort>) {
        // One filter entry per port: every namespace if any entry for it says so.
        let effective = |set: &BTreeSet<WatchedPort>| {
            let mut m: BTreeMap<u16, u32> = BTreeMap::new();
            for p in set {
                m.entry(p.port)
                    .and_modify(|n| {
                        if p.netns == 0 || *n != p.netns {
                            *n = 0;
                        }
                    })
                    .or_insert(p.netns);
            }
            m
        };
        let (old, new) = (effective(&self.ports), effective(&ports));
        for (&port, &netns) in &new {
            if old.get(&port) != Some(&netns) {
                if let Err(e) = self.launches.watch_port(WatchedPort { port, netns }) {
                    self.error(format!("watching online port {port}: {e}"));
                }
            }
        }
        for &port in old.keys().filter(|p| !new.contains_key(p)) {
            self.launches.unwatch_port(port);
        }
        self.ports = ports;
        let list: Vec<u16> = new.keys().copied().collect();
        self.update(|s| s.online_ports = list);
    }

    fn set_offline(&mut self, records: Vec<DisabledRecord>) {
        let (targets, unknown) = targets_of(&self.ctl, &records);
        for r in &unknown {
            self.error(format!(
                "offline pid {}: no GPU with RM instance {} here",
                r.pid, r.device_instance
            ));
        }
        let plan = if targets.is_empty() {
            None
        } else {
            match self.ctl.plan(&targets, PreemptMode::Preempt) {
                Ok(p) => Some(p),
                Err(e) => {
                    self.error(format!("planning the offline channels: {e}"));
                    return;
                }
            }
        };
        let shared = Arc::clone(&self.shared);
        let mut claims = lock_claims(&shared);
        // Claims made before this set was sent are in it: the set itself leaves those out.
        self.offline_applied += 1;
        let applied = self.offline_applied;
        claims.taken.retain(|_, first| *first > applied);
        self.release_gone(&records, &mut claims);
        // Offline is preempted now: channels that just appeared must stop too, unless they come
        // back disabled from a manual preempt. Offline runs: those come back enabled.
        let added = added_channels(&self.records, &records);
        let (adopted, fresh) = split_adopted(&added, &self.adopt);
        if self.policy.preempted() {
            claims.held.extend(channel_set(&adopted));
            if !fresh.is_empty() {
                self.disable_records(&fresh, &mut claims);
            }
            if !added.is_empty() {
                self.disabled = true;
                self.disabled_since.get_or_insert_with(Instant::now);
            }
        } else if !adopted.is_empty() {
            self.enable_records(&adopted, &mut claims);
        }
        drop(claims);
        let mut pids: Vec<u32> = records.iter().map(|r| r.pid).collect();
        pids.sort();
        pids.dedup();
        let (channels, gpus) = plan
            .as_ref()
            .map(|p| (p.channels(), p.gpus()))
            .unwrap_or((0, 0));
        self.records = records;
        self.plan = plan;
        self.probe_issue();
        let issue = self.ctl.issue_mode().describe();
        self.update(|s| {
            s.offline_pids = pids;
            s.offline_channels = channels;
            s.offline_gpus = gpus;
            s.issue = issue;
        });
    }

    /// Once, while offline runs and its plan spans several GPUs: measures serial against
    /// parallel issue on the offline channels and keeps the faster (a few ms of offline pauses;
    /// an online edge that comes meanwhile waits for it, once per gate).
    fn probe_issue(&mut self) {
        if !self.probe_pending || self.policy.preempted() {
            return;
        }
        let Some(plan) = self.plan.as_ref().filter(|p| p.gpus() >= 2) else {
            return;
        };
        // The probe disables and enables the whole plan: not while the daemon owns part of it.
        let claims = lock_claims(&self.shared);
        if claims.any_taken(&self.records) {
            return;
        }
        match self.ctl.probe_issue(plan, PROBE_CYCLES) {
            Ok(p) => {
                self.probe_pending = false;
                tracing::info!("gate: issue mode {}", self.ctl.issue_mode().describe());
                let _ = p;
            }
            Err(e) => self.error(format!(
                "measuring serial against parallel issue: {e}; will try again on the next offline set"
            )),
        }
    }

    /// Disables the offline channels (all GPUs in one call; record by record where the daemon
    /// has taken some processes over).
    fn disable(&mut self, cause: Cause) {
        if self.plan.is_none() {
            // Nothing to stop yet; the policy still counts as preempted, so channels that appear
            // before the resume are disabled on arrival.
            return;
        }
        let shared = Arc::clone(&self.shared);
        let mut claims = lock_claims(&shared);
        let issue_ns = monotonic_ns();
        let partial = claims.untaken(&self.records);
        let result = match (&partial, &self.plan) {
            (None, Some(plan)) => Some(self.ctl.disable(plan).map(|g| g.keep_disabled())),
            _ => None,
        };
        let mut done_ns = monotonic_ns();
        self.disabled = true;
        self.disabled_since = Some(Instant::now());
        if let Some(Ok(_)) = &result {
            claims.held.extend(channel_set(&self.records));
        }
        if let Some(r) = &result {
            let failed = u64::from(r.is_err());
            self.trace(TraceKind::Disable, issue_ns, 0, done_ns, failed);
        }
        let wall = match result {
            Some(Ok(report)) => {
                self.count_disable(&report, cause, done_ns);
                Some(report.wall.as_secs_f64() * 1e6)
            }
            Some(Err(e)) => {
                // The controller rolled back. Most likely an offline process just exited and
                // its handles are gone: go process by process so the others still stop.
                self.error(format!(
                    "disabling offline channels: {e}; retrying per process"
                ));
                let records = self.records.clone();
                self.disable_records(&records, &mut claims);
                done_ns = monotonic_ns();
                None
            }
            None => {
                self.disable_records(&partial.unwrap_or_default(), &mut claims);
                done_ns = monotonic_ns();
                None
            }
        };
        drop(claims);
        // The latency samples count the retry too: that is how long online waited.
        let us = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e3;
        self.sample(|s| {
            if let Some(w) = wall {
                push(&mut s.disable, w);
            }
            match cause {
                Cause::Launch(ts) => {
                    push(&mut s.reaction, us(ts, issue_ns));
                    push(&mut s.edge_to_disable, us(ts, done_ns));
                }
                Cause::Arrival(ts) => push(&mut s.arrival_to_disable, us(ts, done_ns)),
                Cause::Other => {}
            }
        });
    }

    /// The disable's metrics, with the edge that caused it.
    fn count_disable(&self, report: &valve::controller::BatchReport, cause: Cause, done_ns: u64) {
        let Some(m) = crate::metrics::for_gate() else {
            return;
        };
        let (kind, ts) = match cause {
            Cause::Launch(ts) => (Some(crate::metrics::EdgeKind::Launch), ts),
            Cause::Arrival(ts) => (Some(crate::metrics::EdgeKind::Arrival), ts),
            Cause::Other => (None, 0),
        };
        let edge = kind.map(|k| (k, Duration::from_nanos(done_ns.saturating_sub(ts))));
        m.gate_disabled(report, edge);
    }

    /// Disables record by record, skipping the ones that fail and the processes the daemon
    /// took over.
    fn disable_records(&mut self, records: &[DisabledRecord], claims: &mut Claims) {
        for r in records
            .iter()
            .filter(|r| !claims.taken.contains_key(&r.pid))
        {
            let (targets, _) = targets_of(&self.ctl, std::slice::from_ref(r));
            let t0 = monotonic_ns();
            let res = self
                .ctl
                .plan(&targets, PreemptMode::Preempt)
                .and_then(|p| self.ctl.disable(&p).map(|g| drop(g.keep_disabled())));
            self.trace(
                TraceKind::Disable,
                t0,
                r.pid,
                monotonic_ns(),
                u64::from(res.is_err()),
            );
            match res {
                Ok(()) => claims.held.extend(channel_set(std::slice::from_ref(r))),
                Err(e) if alive(r.pid) => {
                    self.error(format!("disabling offline pid {}: {e}", r.pid))
                }
                Err(_) => {}
            }
        }
    }

    /// Enables these channels (record by record, skipping the ones that fail and the processes
    /// the daemon took over).
    fn enable_records(&mut self, records: &[DisabledRecord], claims: &mut Claims) {
        for r in records
            .iter()
            .filter(|r| !claims.taken.contains_key(&r.pid))
        {
            let (targets, _) = targets_of(&self.ctl, std::slice::from_ref(r));
            let t0 = monotonic_ns();
            let res = self
                .ctl
                .plan(&targets, PreemptMode::Preempt)
                .and_then(|p| self.ctl.enable(&p));
            for c in channel_set(std::slice::from_ref(r)) {
                claims.held.remove(&c);
            }
            self.trace(
                TraceKind::Enable,
                t0,
                r.pid,
                monotonic_ns(),
                u64::from(res.is_err()),
            );
            if let Err(e) = res {
                if alive(r.pid) {
                    self.error(format!("enabling offline pid {}: {e}", r.pid));
                }
            }
        }
    }

    /// Channels this gate holds disabled whose process left the offline set unclaimed (its
    /// label changed, or it exited) are enabled: nobody else would. A claimed one is the
    /// daemon's, and was taken out of `held` by the claim.
    fn release_gone(&mut self, records: &[DisabledRecord], claims: &mut Claims) {
        let keep = channel_set(records);
        let gone: Vec<DisabledRecord> = self
            .records
            .iter()
            .filter_map(|r| {
                let chans: Vec<u32> = r
                    .channels
                    .iter()
                    .copied()
                    .filter(|&c| {
                        let t = (r.device_instance, r.client, c);
                        claims.held.contains(&t) && !keep.contains(&t)
                    })
                    .collect();
                (!chans.is_empty()).then(|| DisabledRecord {
                    channels: chans,
                    ..r.clone()
                })
            })
            .collect();
        for c in channel_set(&gone) {
            claims.held.remove(&c);
        }
        let live: Vec<DisabledRecord> = gone.into_iter().filter(|r| alive(r.pid)).collect();
        self.enable_records(&live, claims);
    }

    /// Enables the offline channels; on a failure, record by record so one exited process does
    /// not keep the others frozen. Processes the daemon took over stay as they are.
    fn enable(&mut self) {
        if !self.disabled {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let mut claims = lock_claims(&shared);
        let t0 = Instant::now();
        let start_ns = monotonic_ns();
        // Channels of a process the daemon took over stay in `held` until the offline set
        // without it comes: those it did not take (on another GPU) are enabled then.
        let result = if let Some(rest) = claims.untaken(&self.records) {
            self.enable_records(&rest, &mut claims);
            Ok(None)
        } else {
            claims.held.clear();
            match &self.plan {
                Some(plan) => self.ctl.enable(plan).map(Some),
                None => Ok(None),
            }
        };
        let ok = result.is_ok();
        if let Err(e) = &result {
            let (_, failures) = reenable(&self.ctl, &self.records);
            if !failures.is_empty() {
                self.error(format!(
                    "enabling offline channels: {e}; per process: {}",
                    failures.join("; ")
                ));
            }
        }
        drop(claims);
        self.trace(
            TraceKind::Enable,
            start_ns,
            0,
            monotonic_ns(),
            u64::from(!ok),
        );
        let wall = t0.elapsed().as_secs_f64() * 1e6;
        self.disabled = false;
        let held = self
            .disabled_since
            .take()
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        self.sample(|s| push(&mut s.enable, wall));
        if let Some(m) = crate::metrics::for_gate() {
            m.gate_enabled(
                result.as_ref().ok().and_then(Option::as_ref),
                Duration::from_secs_f64(held),
            );
        }
        self.update(|s| {
            s.resumes += 1;
            s.preempted_s += held;
        });
    }

    /// Whether the thread spins now: with `--arrival-busy-poll`, while offline runs (an edge
    /// then has work to preempt). Starting to spin takes the ports' edge counts afresh, so
    /// edges counted while offline was stopped are not taken for new ones.
    fn spins(&mut self) -> bool {
        let offline_runs = !self.disabled && self.plan.is_some();
        let spins = self.busy_poll && offline_runs;
        if spins && self.polled_edges.is_empty() {
            self.polled_edges = self
                .ports
                .iter()
                .map(|p| (p.port, self.launches.arrival_counts(p.port).edges))
                .collect();
        } else if !spins {
            self.polled_edges.clear();
        }
        spins
    }

    /// Whether `e` is news: not at or before an arrival already handled on its port (each
    /// polled edge is also read from the ring buffer later). Records it as handled.
    fn first_sight(&mut self, e: &ArrivalEdge) -> bool {
        let latest = self.handled_arrival_ns.entry(e.port).or_insert(0);
        if e.ts_ns <= *latest {
            return false;
        }
        *latest = e.ts_ns;
        true
    }

    /// An edge the counters of a watched port show since the last poll, read at `now_ns`.
    fn polled_arrival(&mut self, now_ns: u64) -> Option<ArrivalEdge> {
        for p in &self.ports {
            let c = self.launches.arrival_counts(p.port);
            let seen = self.polled_edges.entry(p.port).or_insert(c.edges);
            if c.edges > *seen {
                *seen = c.edges;
                return Some(ArrivalEdge {
                    port: p.port,
                    netns: p.netns,
                    // The latest arrival: within the poll's microseconds of the edge itself.
                    ts_ns: c.last_ns,
                    idle_ns: 0,
                    read_ns: now_ns,
                });
            }
        }
        None
    }

    /// Spins until an input comes, a watched port's counters show an edge, or `wait` ends.
    /// Waking a sleeping thread can take milliseconds where CPUs idle (a VM's halted vCPU);
    /// this sees an arrival within microseconds, with no thread between the program and the
    /// disable, at the cost of one CPU.
    fn spin_for_input(
        &mut self,
        rx: &Receiver<GateInput>,
        wait: Duration,
    ) -> Result<GateInput, RecvTimeoutError> {
        let end = Instant::now() + wait;
        loop {
            match rx.try_recv() {
                Ok(input) => return Ok(input),
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) => {}
            }
            if let Some(e) = self.polled_arrival(monotonic_ns()) {
                return Ok(GateInput::Arrival(e));
            }
            if Instant::now() >= end {
                return Err(RecvTimeoutError::Timeout);
            }
            std::hint::spin_loop();
        }
    }

    /// The thread body: waits for input or the cooldown's end, until [`GateInput::Stop`] or until
    /// every sender is gone. Offline is enabled before it returns.
    pub fn run(mut self, rx: Receiver<GateInput>) {
        loop {
            let wait = self.wait_for(monotonic_ns());
            let input = if self.spins() {
                self.spin_for_input(&rx, wait)
            } else {
                rx.recv_timeout(wait)
            };
            match input {
                Ok(input) => {
                    if !self.handle(input, monotonic_ns()) {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.tick(monotonic_ns());
        }
        // Drop enables.
    }
}

/// The channels of `new` that `old` does not have, per record.
/// Splits `added` into the channels handed back disabled (in `adopt`) and the others.
fn split_adopted(
    added: &[DisabledRecord],
    adopt: &BTreeSet<(u32, u32, u32)>,
) -> (Vec<DisabledRecord>, Vec<DisabledRecord>) {
    let pick = |want: bool| -> Vec<DisabledRecord> {
        added
            .iter()
            .filter_map(|r| {
                let chans: Vec<u32> = r
                    .channels
                    .iter()
                    .copied()
                    .filter(|&c| adopt.contains(&(r.device_instance, r.client, c)) == want)
                    .collect();
                (!chans.is_empty()).then(|| DisabledRecord {
                    channels: chans,
                    ..r.clone()
                })
            })
            .collect()
    };
    (pick(true), pick(false))
}

fn added_channels(old: &[DisabledRecord], new: &[DisabledRecord]) -> Vec<DisabledRecord> {
    let old = channel_set(old);
    new.iter()
        .filter_map(|r| {
            let chans: Vec<u32> = r
                .channels
                .iter()
                .copied()
                .filter(|&c| !old.contains(&(r.device_instance, r.client, c)))
                .collect();
            (!chans.is_empty()).then(|| DisabledRecord {
                channels: chans,
                ..r.clone()
            })
        })
        .collect()
}

impl<D: RmDriver, L: LaunchSource> Drop for GateRuntime<D, L> {
    fn drop(&mut self) {
        if self.disabled {
            self.enable();
        }
        let mut g = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        g.status.running = false;
        g.status.preempted = false;
        self.shared
            .panicked
            .store(std::thread::panicking(), Ordering::SeqCst);
        drop(g);
        self.shared.ended.notify_all();
    }
}

/// The (device instance, client, channel) triples of `records`.
pub(crate) fn channel_set(records: &[DisabledRecord]) -> ChannelSet {
    records
        .iter()
        .flat_map(|r| {
            r.channels
                .iter()
                .map(move |&c| (r.device_instance, r.client, c))
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// A running gate thread.
pub struct GateHandle {
    tx: Sender<GateInput>,
    shared: Arc<GateShared>,
    thread: Option<JoinHandle<()>>,
}

/// What the gate thread needs, built on the thread itself: its own controller, and a launch
/// source that sends edges to the given sender.
pub type GateParts<D, L> = (Controller<D>, L);

/// Starts the gate thread. `make` runs on it and builds the controller and the launch source;
/// its error is returned here.
pub fn spawn<D, L, F>(cfg: GateConfig, make: F) -> Result<GateHandle, String>
where
    D: RmDriver,
    L: LaunchSource + 'static,
    F: FnOnce(Sender<GateInput>) -> Result<GateParts<D, L>, String> + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(GateShared::default());
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let (tx2, shared2) = (tx.clone(), shared.clone());
    let thread = std::thread::Builder::new()
        .name("valve-gate".into())
        .spawn(move || match make(tx2) {
            Ok((ctl, launches)) => {
                // A spinning thread needs no fast wake-up, and a real-time one would be
                // throttled mid-spin (SCHED_FIFO's bandwidth limit, SCHED_DEADLINE's budget).
                let own = if cfg.arrival_busy_poll {
                    Scheduling::BusyPoll
                } else {
                    realtime::apply_to_current_thread(cfg.realtime)
                };
                let rt = GateRuntime::with_scheduling(ctl, launches, cfg, shared2, own);
                let _ = ready_tx.send(Ok(()));
                rt.run(rx);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .map_err(|e| format!("starting the gate thread: {e}"))?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(GateHandle {
            tx,
            shared,
            thread: Some(thread),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err("the gate thread died while starting".into())
        }
    }
}

impl GateHandle {
    /// Sends an input to the gate thread (ignored if it has ended).
    pub fn send(&self, input: GateInput) {
        if matches!(input, GateInput::Offline(_)) {
            self.shared.offline_sent.fetch_add(1, Ordering::SeqCst);
        }
        let _ = self.tx.send(input);
    }

    /// Takes `pid` out of the gate's hands at once (a manual preempt): from now on the gate
    /// neither enables nor disables its channels, until an offline set sent after this call
    /// says otherwise. Returns whether the gate held all of `channels` disabled; they are the
    /// caller's now, as they are. If the gate thread is inside a disable or enable, this waits
    /// for that one call, never for the thread to wake.
    pub fn claim(&self, pid: u32, channels: &ChannelSet) -> bool {
        self.shared.claim(pid, channels)
    }

    /// The gate's status now.
    pub fn status(&self) -> GateStatus {
        snapshot(&self.shared)
    }

    /// Trace records after sequence number `after` (at most `limit`, oldest first).
    pub fn trace(&self, after: u64, limit: usize) -> Vec<TraceRecord> {
        self.shared.trace.since(after, limit)
    }

    /// What the thread shares (its trace stays readable after the gate stops).
    pub fn shared(&self) -> Arc<GateShared> {
        self.shared.clone()
    }

    /// Whether the thread has ended (it should only after [`Self::stop`]).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops the thread (it enables offline first) and returns the final status. Returns an
    /// error text if the thread had panicked.
    pub fn stop(mut self) -> (GateStatus, Option<String>) {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> (GateStatus, Option<String>) {
        let _ = self.tx.send(GateInput::Stop);
        let Some(thread) = self.thread.take() else {
            return (self.status(), None);
        };
        // Wait until the runtime has enabled offline and marked itself stopped (its Drop), not
        // for the thread's end: detaching the uprobes after that takes about 0.1 s per probe
        // (over 4 s on libcuda's), and would hold the daemon's control loop that long.
        let mut g = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while g.status.running && !thread.is_finished() {
            g = self
                .shared
                .ended
                .wait_timeout(g, Duration::from_millis(50))
                .map_or_else(|e| e.into_inner().0, |r| r.0);
        }
        drop(g);
        let panicked = if thread.is_finished() {
            thread.join().is_err()
        } else {
            // The probes go on detaching on the gate thread; nothing waits for it.
            drop(thread);
            self.shared.panicked.load(Ordering::SeqCst)
        };
        (
            self.status(),
            panicked.then(|| "the gate thread had panicked".to_string()),
        )
    }
}

impl Drop for GateHandle {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.stop_inner();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use valve::fake::FakeRm;
    use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;
    const ONLINE: u32 = 7_000_001;

    /// Last launch per pid, last arrival per port, pids waiting for their GPU work, the times
    /// the gate armed the resume edge, a launch (pid, time) that happens as it arms, and the
    /// end of the last wait for GPU work per pid.
    #[derive(Clone, Default)]
    #[allow(clippy::type_complexity)]
    struct FakeLaunches(
        Arc<Mutex<BTreeMap<u32, u64>>>,
        Arc<Mutex<BTreeMap<u16, ArrivalCounts>>>,
        Arc<Mutex<BTreeSet<u32>>>,
        Arc<Mutex<Vec<u64>>>,
        Arc<Mutex<Option<(u32, u64)>>>,
        Arc<Mutex<BTreeMap<u32, u64>>>,
    );

    impl LaunchSource for FakeLaunches {
        fn watch(&mut self, pid: u32) -> Result<(), String> {
            self.0.lock().unwrap().entry(pid).or_insert(0);
            Ok(())
        }
        fn unwatch(&mut self, pid: u32) {
            self.0.lock().unwrap().remove(&pid);
        }
        fn last_launch_ns(&self, pid: u32) -> u64 {
            self.0.lock().unwrap().get(&pid).copied().unwrap_or(0)
        }
        fn watch_port(&mut self, port: WatchedPort) -> Result<(), String> {
            self.1.lock().unwrap().entry(port.port).or_default();
            Ok(())
        }
        fn unwatch_port(&mut self, port: u16) {
            self.1.lock().unwrap().remove(&port);
        }
        fn arrival_counts(&self, port: u16) -> ArrivalCounts {
            self.1
                .lock()
                .unwrap()
                .get(&port)
                .copied()
                .unwrap_or_default()
        }
        fn in_sync(&self, pid: u32) -> bool {
            self.2.lock().unwrap().contains(&pid)
        }
        fn last_wait_end_ns(&self, pid: u32) -> u64 {
            self.5.lock().unwrap().get(&pid).copied().unwrap_or(0)
        }
        fn arm_resume(&self, now_ns: u64) {
            self.3.lock().unwrap().push(now_ns);
            if let Some((pid, t)) = self.4.lock().unwrap().take() {
                self.0.lock().unwrap().insert(pid, t);
            }
        }
    }

    /// One offline process (20 channels on one GPU) and the online pid, cooldown ceiling 50 ms.
    fn one_offline_one_online() -> (
        Arc<FakeRm>,
        GateRuntime<Arc<FakeRm>, FakeLaunches>,
        FakeLaunches,
    ) {
        let rm = Arc::new(FakeRm::host(1));
        let cfg = GateConfig {
            cooldown_ceiling: Duration::from_millis(50),
            ..GateConfig::default()
        };
        let (mut rt, launches) = runtime(&rm, cfg);
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        (rm, rt, launches)
    }

    #[test]
    fn no_online_launch_runs_beside_resumed_offline_unreported() {
        let (rm, mut rt, launches) = one_offline_one_online();
        rt.handle(edge(ONLINE, 10 * MS, 0), 10 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 10 * MS);
        // The cooldown runs out at 60 ms, but online launches after the gate's first reading of
        // the counters, as it arms: its second reading sees the launch, and offline stays stopped.
        *launches.4.lock().unwrap() = Some((ONLINE, 61 * MS));
        rt.tick(61 * MS);
        assert_eq!(
            rm.disabled().len(),
            20,
            "a launch in the window holds offline"
        );
        let arms = launches.3.lock().unwrap().clone();
        assert!(
            arms.len() == 2 && arms[0] > 0 && arms[1] == 0,
            "armed before reading again, disarmed when the resume was called off: {arms:?}"
        );
        // Nothing more: it resumes, armed (the watcher then reports online's next launch).
        rt.tick(112 * MS);
        assert!(rm.disabled().is_empty());
        let arms = launches.3.lock().unwrap().clone();
        assert!(arms.len() == 3 && arms[2] > 0, "{arms:?}");
        // That launch, 50 us after a wait's end (no idle edge), comes flagged: preempt at once.
        rt.handle(
            GateInput::Edge(LaunchEdge {
                pid: ONLINE,
                graph: true,
                ts_ns: 113 * MS,
                idle_ns: 50 * US,
                after_resume: true,
            }),
            113 * MS,
        );
        assert_eq!(rm.disabled().len(), 20, "the armed edge preempts");
        let trace = rt.shared.trace.since(0, 1000);
        let flagged = trace
            .iter()
            .find(|r| r.kind == TraceKind::LaunchAfterResume)
            .expect("the trace marks it");
        assert_eq!(flagged.to_json()["after_resume"], true);
        // A resume on an explicit idle signal arms too.
        rt.handle(GateInput::Busy, 120 * MS);
        rt.handle(GateInput::Idle, 130 * MS);
        assert!(rm.disabled().is_empty());
        assert_eq!(launches.3.lock().unwrap().len(), 4);
    }

    #[test]
    fn no_resume_while_online_waits_for_its_gpu_work() {
        let (rm, mut rt, launches) = one_offline_one_online();
        // A prefill: launches at 10 ms, then the host waits for the GPU.
        rt.handle(edge(ONLINE, 10 * MS, 0), 10 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 11 * MS);
        launches.2.lock().unwrap().insert(ONLINE);
        // The cooldown (the 50 ms ceiling) runs out while it waits: held.
        rt.tick(61 * MS);
        assert_eq!(rm.disabled().len(), 20, "held while online waits");
        rt.tick(200 * MS);
        assert_eq!(rm.disabled().len(), 20, "a long wait");
        // Still waiting long after its last launch (a stuck thread): released after 5 ceilings.
        rt.tick(262 * MS);
        assert!(
            rm.disabled().is_empty(),
            "a wait cannot hold offline forever"
        );
        let cooldown = rt.shared.trace.since(0, 1000);
        let cooldown = cooldown
            .iter()
            .rfind(|r| r.kind == TraceKind::Cooldown)
            .unwrap();
        assert_eq!(
            cooldown.to_json()["waits_ignored"],
            true,
            "the trace says the resume ignored a wait"
        );
        // Next request; its wait ends at 430 ms (the GPU work is done): the cooldown (now the
        // 1 ms floor: nothing learned) runs from the wait's end, not from the launch.
        rt.handle(edge(ONLINE, 400 * MS, 0), 400 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 401 * MS);
        rt.tick(420 * MS);
        assert_eq!(rm.disabled().len(), 20, "still waiting");
        launches.2.lock().unwrap().clear();
        launches.0.lock().unwrap().insert(ONLINE, 430 * MS);
        rt.tick(430 * MS + 500 * US);
        assert_eq!(rm.disabled().len(), 20);
        rt.tick(432 * MS);
        assert!(rm.disabled().is_empty());
    }

    fn arrival(port: u16, ts_ns: u64) -> GateInput {
        GateInput::Arrival(ArrivalEdge {
            port,
            netns: 1,
            ts_ns,
            idle_ns: 0,
            read_ns: 0,
        })
    }

    const PORT: u16 = 8000;

    #[test]
    fn an_arrival_stops_offline_before_the_first_launch_and_the_trace_tells_it() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, launches) = runtime(&rm, GateConfig::default());
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        rt.handle(
            GateInput::Ports(
                [WatchedPort {
                    port: PORT,
                    netns: 0,
                }]
                .into(),
            ),
            0,
        );
        assert!(launches.1.lock().unwrap().contains_key(&PORT));
        // Another port's data is not the service's.
        rt.handle(arrival(9000, MS), MS);
        assert!(rm.disabled().is_empty());
        rt.handle(arrival(PORT, 10 * MS), 10 * MS + 50 * US);
        assert_eq!(rm.disabled().len(), 20, "frozen at the arrival");
        // The first kernel 3 ms later finds offline stopped: no second preemption.
        rt.handle(edge(ONLINE, 13 * MS, 0), 13 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 20 * MS);
        assert_eq!(rt.policy().preemptions(), 1);
        // Not learned yet: the cooldown is the ceiling after the last launch.
        rt.tick(210 * MS);
        assert_eq!(rm.disabled().len(), 20);
        rt.tick(221 * MS);
        assert!(rm.disabled().is_empty());
        let st = snapshot(&rt.shared);
        assert_eq!((st.arrivals, st.edges, st.preemptions), (1, 1, 1));
        assert_eq!(st.arrival_to_disable_us.n, 1);
        assert_eq!(st.online_ports, vec![PORT]);
        let kinds: Vec<TraceKind> = rt
            .shared
            .trace
            .since(0, 100)
            .iter()
            .map(|r| r.kind)
            .collect();
        assert_eq!(
            kinds,
            vec![
                TraceKind::Arrival,
                TraceKind::Disable,
                TraceKind::Launch,
                TraceKind::Cooldown,
                TraceKind::Enable
            ]
        );
        let t = rt.shared.trace.since(0, 100);
        assert_eq!(
            (t[0].t_ns, t[0].id, t[0].a),
            (10 * MS, u32::from(PORT), 10 * MS + 50 * US)
        );
        assert!(
            t[1].t_ns <= t[1].a && t[1].b == 0,
            "disable start <= end, ok"
        );
        assert_eq!(
            (t[3].a, t[3].b),
            (20 * MS, 200 * MS),
            "last activity, cooldown"
        );
        assert_eq!(st.trace_head, 5);
    }

    #[test]
    fn a_port_named_twice_is_watched_once_and_unwatched_when_gone() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, launches) = runtime(&rm, GateConfig::default());
        let p = |netns| WatchedPort { port: PORT, netns };
        rt.handle(GateInput::Ports([p(5)].into()), 0);
        rt.handle(GateInput::Ports([p(0), p(5)].into()), 0);
        assert_eq!(snapshot(&rt.shared).online_ports, vec![PORT]);
        // Either namespace's data counts while both are named.
        let mut e = ArrivalEdge {
            port: PORT,
            netns: 9,
            ts_ns: MS,
            idle_ns: 0,
            read_ns: 0,
        };
        assert!(rt.watched_port(&e));
        rt.handle(GateInput::Ports([p(5)].into()), 0);
        assert!(!rt.watched_port(&e), "only namespace 5 now");
        e.netns = 5;
        assert!(rt.watched_port(&e));
        rt.handle(GateInput::Ports(BTreeSet::new()), 0);
        assert!(launches.1.lock().unwrap().is_empty(), "unwatched");
        assert!(snapshot(&rt.shared).online_ports.is_empty());
    }

    fn counted(edges: u64, last_ns: u64) -> ArrivalCounts {
        ArrivalCounts {
            arrivals: edges,
            edges,
            last_ns,
        }
    }

    fn arrival_records(rt: &GateRuntime<Arc<FakeRm>, FakeLaunches>) -> Vec<(u64, u64)> {
        rt.shared
            .trace
            .since(0, 100)
            .iter()
            .filter(|r| r.kind == TraceKind::Arrival)
            .map(|r| (r.t_ns, r.a))
            .collect()
    }

    #[test]
    fn a_busy_polling_gate_takes_arrivals_from_the_counters_once_each() {
        let rm = Arc::new(FakeRm::host(1));
        let cfg = GateConfig {
            arrival_busy_poll: true,
            ..GateConfig::default()
        };
        let (mut rt, launches) = runtime(&rm, cfg);
        let port = WatchedPort {
            port: PORT,
            netns: 0,
        };
        rt.handle(GateInput::Ports([port].into()), 0);
        assert!(!rt.spins(), "no offline work to preempt");
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        launches.1.lock().unwrap().insert(PORT, counted(4, 5 * MS));
        assert!(rt.spins(), "offline runs");
        assert_eq!(
            rt.polled_arrival(6 * MS),
            None,
            "edges before polling are old"
        );
        // The program counts an edge: the next poll hands it over, with no watcher thread.
        launches.1.lock().unwrap().insert(PORT, counted(5, 10 * MS));
        let e = rt
            .polled_arrival(10 * MS + 5 * US)
            .expect("the counted edge");
        assert_eq!(
            (e.port, e.ts_ns, e.read_ns),
            (PORT, 10 * MS, 10 * MS + 5 * US)
        );
        assert_eq!(rt.polled_arrival(10 * MS + 6 * US), None, "taken once");
        rt.handle(GateInput::Arrival(e), 10 * MS + 6 * US);
        assert_eq!(rm.disabled().len(), 20, "frozen at the polled arrival");
        // The ring buffer delivers the same edge later: already handled.
        rt.handle(arrival(PORT, 10 * MS), 12 * MS);
        assert_eq!(arrival_records(&rt), vec![(10 * MS, 10 * MS + 6 * US)]);
        assert_eq!(rt.policy().arrivals(), 1);
        assert!(!rt.spins(), "offline is stopped: nothing to preempt");
        // An edge counted while offline is stopped is not news once polling starts again.
        launches.1.lock().unwrap().insert(PORT, counted(6, 20 * MS));
        rt.tick(20 * MS + 300 * MS);
        assert!(rm.disabled().is_empty(), "resumed after the hold");
        assert!(rt.spins(), "offline runs again");
        assert_eq!(rt.polled_arrival(321 * MS), None);
        launches
            .1
            .lock()
            .unwrap()
            .insert(PORT, counted(7, 400 * MS));
        assert_eq!(rt.polled_arrival(400 * MS).map(|e| e.ts_ns), Some(400 * MS));
        rt.handle(GateInput::Ports(BTreeSet::new()), 0);
        assert!(rt.spins(), "launch edges still have offline to preempt");
        assert_eq!(
            rt.polled_arrival(401 * MS),
            None,
            "no port: nothing to poll"
        );
    }

    #[test]
    fn without_busy_polling_the_gate_never_spins() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, _launches) = runtime(&rm, GateConfig::default());
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        assert!(!rt.spins());
    }

    #[test]
    fn a_busy_polling_gate_thread_preempts_on_a_counted_arrival_alone() {
        let rm = Arc::new(FakeRm::host(1));
        let launches = FakeLaunches::default();
        let (rm2, launches2) = (rm.clone(), launches.clone());
        let cfg = GateConfig {
            arrival_busy_poll: true,
            ..GateConfig::default()
        };
        let h = spawn(cfg, move |_tx| {
            Ok((
                Controller::with_driver(rm2).map_err(|e| e.to_string())?,
                launches2,
            ))
        })
        .unwrap();
        assert!(h
            .status()
            .scheduling
            .starts_with("gate normal, busy-polling"));
        h.send(GateInput::Ports(
            [WatchedPort {
                port: PORT,
                netns: 0,
            }]
            .into(),
        ));
        h.send(GateInput::Offline(offline(&rm)[..1].to_vec()));
        let (ack, synced) = mpsc::sync_channel(1);
        h.send(GateInput::Sync(ack));
        synced.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(rm.disabled().is_empty());
        // Only the counters change: no input is sent to the thread.
        launches
            .1
            .lock()
            .unwrap()
            .insert(PORT, counted(1, monotonic_ns()));
        let t0 = Instant::now();
        while rm.disabled().len() != 20 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(rm.disabled().len(), 20, "the spinning gate saw the arrival");
        assert_eq!(h.status().arrivals, 1);
        drop(h);
        assert!(rm.disabled().is_empty());
    }

    #[test]
    fn a_request_keeps_offline_stopped_until_its_host_has_waited_for_the_gpu() {
        let rm = Arc::new(FakeRm::host(1));
        let cfg = GateConfig {
            fixed_cooldown: Some(Duration::from_millis(1)),
            ..GateConfig::default()
        };
        let (mut rt, launches) = runtime(&rm, cfg);
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        let port = WatchedPort {
            port: PORT,
            netns: 0,
        };
        rt.handle(GateInput::Ports([port].into()), 0);
        rt.handle(arrival(PORT, 10 * MS), 10 * MS);
        rt.handle(edge(ONLINE, 13 * MS, 0), 13 * MS);
        launches
            .0
            .lock()
            .unwrap()
            .insert(ONLINE, 13 * MS + 300 * US);
        // The host is quiet for 7 ms, far past the 1 ms cooldown, but has not waited yet.
        rt.tick(20 * MS);
        assert_eq!(rm.disabled().len(), 20, "the prefill may still be queued");
        // The first token's copy returns at 20.5 ms: the cooldown runs from there.
        launches
            .5
            .lock()
            .unwrap()
            .insert(ONLINE, 20 * MS + 500 * US);
        launches
            .0
            .lock()
            .unwrap()
            .insert(ONLINE, 20 * MS + 500 * US);
        rt.tick(21 * MS);
        assert_eq!(rm.disabled().len(), 20);
        rt.tick(21 * MS + 600 * US);
        assert!(
            rm.disabled().is_empty(),
            "resumed a cooldown after the wait"
        );
    }

    #[test]
    fn an_arrival_that_launches_nothing_releases_offline_after_the_hold() {
        let rm = Arc::new(FakeRm::host(1));
        let cfg = GateConfig {
            cooldown_ceiling: Duration::from_millis(50),
            ..GateConfig::default()
        };
        let (mut rt, launches) = runtime(&rm, cfg);
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        rt.handle(
            GateInput::Ports(
                [WatchedPort {
                    port: PORT,
                    netns: 0,
                }]
                .into(),
            ),
            0,
        );
        rt.handle(arrival(PORT, 10 * MS), 10 * MS);
        assert_eq!(rm.disabled().len(), 20);
        // A later arrival (not an edge) read from the counters extends the hold.
        launches.1.lock().unwrap().insert(
            PORT,
            ArrivalCounts {
                arrivals: 1,
                edges: 1,
                last_ns: 30 * MS,
            },
        );
        rt.tick(60 * MS);
        assert_eq!(rm.disabled().len(), 20);
        assert_eq!(rt.wait_for(60 * MS), Duration::from_millis(20));
        rt.tick(80 * MS);
        assert!(rm.disabled().is_empty());
    }

    #[test]
    fn the_issue_mode_is_measured_once_on_a_multi_gpu_offline_set() {
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        rt.handle(GateInput::Offline(offline(&rm)), 0);
        let s = rt.controller().issue_mode();
        assert!(s.probe.is_some() && !s.forced, "{s:?}");
        assert!(rm.disabled().is_empty(), "the probe left nothing disabled");
        let calls = rm.state.lock().unwrap().disable_calls.len();
        rt.handle(GateInput::Offline(offline(&rm)[..2].to_vec()), 0);
        rt.handle(GateInput::Offline(offline(&rm)), 0);
        assert_eq!(
            rm.state.lock().unwrap().disable_calls.len(),
            calls,
            "only once"
        );
        assert!(snapshot(&rt.shared).issue.contains("measured"));
        // Forced: never measured.
        let rm2 = Arc::new(FakeRm::host(2));
        let forced = GateConfig {
            issue: Some(valve::IssueMode::Parallel),
            ..GateConfig::default()
        };
        let (mut rt2, _) = runtime(&rm2, forced);
        rt2.handle(GateInput::Offline(offline(&rm2)), 0);
        assert!(rm2.state.lock().unwrap().disable_calls.is_empty());
        assert_eq!(snapshot(&rt2.shared).issue, "parallel (forced)");
    }

    fn edge(pid: u32, ts_ns: u64, idle_ns: u64) -> GateInput {
        GateInput::Edge(LaunchEdge {
            pid,
            graph: false,
            ts_ns,
            idle_ns,
            after_resume: false,
        })
    }

    /// Two offline processes, one on both GPUs; returns their records.
    fn offline(rm: &FakeRm) -> Vec<DisabledRecord> {
        let mut recs = Vec::new();
        for (pid, client, insts) in [
            (8_000_001, 0xc1d0_0010, &[0u32, 1][..]),
            (8_000_002, 0xc1d0_0020, &[0][..]),
        ] {
            for &inst in insts {
                let chans: Vec<u32> = (0..20).map(|i| 0x5c00_0000 + 0x100 * inst + i).collect();
                rm.add_channels(
                    ClientHandle(client),
                    inst,
                    &chans.iter().map(|&c| ChannelHandle(c)).collect::<Vec<_>>(),
                );
                recs.push(DisabledRecord {
                    pid,
                    device_instance: inst,
                    client,
                    channels: chans,
                });
            }
        }
        recs
    }

    fn runtime(
        rm: &Arc<FakeRm>,
        cfg: GateConfig,
    ) -> (GateRuntime<Arc<FakeRm>, FakeLaunches>, FakeLaunches) {
        let launches = FakeLaunches::default();
        let rt = GateRuntime::new(
            Controller::with_driver(rm.clone()).unwrap(),
            launches.clone(),
            cfg,
            Arc::new(GateShared::default()),
        );
        (rt, launches)
    }

    /// Sends an offline set as the daemon does: counted as sent, then applied.
    fn send_offline(rt: &mut GateRuntime<Arc<FakeRm>, FakeLaunches>, recs: &[DisabledRecord]) {
        rt.shared.offline_sent.fetch_add(1, Ordering::SeqCst);
        rt.handle(GateInput::Offline(recs.to_vec()), 0);
    }

    /// `offline()` with its second process (on GPU 0 only) made this test process, so that it
    /// counts as alive.
    fn offline_with_a_live_process(rm: &FakeRm) -> (Vec<DisabledRecord>, u32) {
        let me = std::process::id();
        let mut recs = offline(rm);
        recs[2].pid = me;
        (recs, me)
    }

    #[test]
    fn a_claim_takes_a_held_process_over_with_no_thread_and_the_gate_leaves_it_frozen() {
        // A manual preempt (the memory pool's reclaim) takes an offline process out of the
        // gate's hands under the claims lock: there is no gate thread here to answer. The gate
        // must then leave it as it is: frozen through its resumes and preempts, even after the
        // offline set without it has come.
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let (recs, me) = offline_with_a_live_process(&rm);
        send_offline(&mut rt, &recs);
        rt.handle(GateInput::Busy, MS);
        assert_eq!(rm.disabled().len(), 60);
        // A set sent before the claim, still naming the process, is applied after it.
        rt.shared.offline_sent.fetch_add(1, Ordering::SeqCst);
        assert!(rt.shared.claim(me, &channel_set(&recs[2..])), "held");
        rt.handle(GateInput::Offline(recs.clone()), 0);
        rt.handle(GateInput::Idle, 2 * MS);
        assert_eq!(rm.disabled().len(), 20, "the claimed process stays frozen");
        let calls = rm.state.lock().unwrap().disable_calls.len();
        rt.handle(GateInput::Busy, 3 * MS);
        let new_calls = rm.state.lock().unwrap().disable_calls[calls..].to_vec();
        assert_eq!(
            new_calls.iter().map(|c| c.2).sum::<usize>(),
            40,
            "the preempt disables the other process only: {new_calls:?}"
        );
        send_offline(&mut rt, &recs[..2]);
        rt.handle(GateInput::Idle, 4 * MS);
        assert_eq!(rm.disabled().len(), 20, "still the daemon's to enable");
        drop(rt);
        assert_eq!(
            rm.disabled().len(),
            20,
            "the gate's exit enables only its own"
        );
    }

    #[test]
    fn a_process_claimed_while_offline_runs_is_never_disabled_by_the_gate() {
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let (recs, me) = offline_with_a_live_process(&rm);
        send_offline(&mut rt, &recs);
        assert!(
            !rt.shared.claim(me, &channel_set(&recs[2..])),
            "running: the daemon disables it"
        );
        rt.handle(GateInput::Busy, MS);
        assert_eq!(
            rm.disabled().len(),
            40,
            "the gate stops the other process only"
        );
        rt.handle(GateInput::Idle, 2 * MS);
        assert!(rm.disabled().is_empty());
    }

    #[test]
    fn held_channels_whose_process_leaves_unclaimed_are_enabled() {
        // A process that leaves the offline set while the gate holds it (a relabel) is nobody
        // else's: it must not stay frozen. Likewise the channels a claim did not take (a
        // preempt of one GPU only) once the set without the process comes.
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let (mut recs, me) = offline_with_a_live_process(&rm);
        send_offline(&mut rt, &recs);
        rt.handle(GateInput::Busy, MS);
        send_offline(&mut rt, &recs[..2]);
        assert_eq!(rm.disabled().len(), 40, "the process that left runs again");
        rt.handle(GateInput::Idle, 2 * MS);
        assert!(rm.disabled().is_empty());
        // The first process, on two GPUs, is preempted on GPU 0 only.
        recs[0].pid = me;
        recs[1].pid = me;
        send_offline(&mut rt, &recs[..2]);
        rt.handle(GateInput::Busy, 3 * MS);
        assert_eq!(rm.disabled().len(), 40);
        assert!(rt.shared.claim(me, &channel_set(&recs[..1])));
        rt.handle(GateInput::Idle, 4 * MS);
        assert_eq!(
            rm.disabled().len(),
            40,
            "claimed: the gate enables none of it yet"
        );
        send_offline(&mut rt, &[]);
        assert_eq!(
            rm.disabled().len(),
            20,
            "GPU 1's channels, not taken, run again"
        );
    }

    #[test]
    fn the_status_names_how_each_thread_is_scheduled() {
        struct Watchers;
        impl LaunchSource for Watchers {
            fn watch(&mut self, _: u32) -> Result<(), String> {
                Ok(())
            }
            fn unwatch(&mut self, _: u32) {}
            fn last_launch_ns(&self, _: u32) -> u64 {
                0
            }
            fn scheduling(&self) -> Vec<(&'static str, Scheduling)> {
                vec![("launch-watch", Scheduling::Refused("EPERM".into()))]
            }
        }
        let rm = Arc::new(FakeRm::host(1));
        let shared = Arc::new(GateShared::default());
        let _rt = GateRuntime::with_scheduling(
            Controller::with_driver(rm).unwrap(),
            Watchers,
            GateConfig::default(),
            shared.clone(),
            Scheduling::Fifo(10),
        );
        assert_eq!(
            snapshot(&shared).scheduling,
            "gate SCHED_FIFO 10, launch-watch normal (real-time refused: EPERM)"
        );
        assert!(
            !snapshot(&shared).fast_wakeups,
            "the watcher waits for a CPU"
        );
    }

    #[test]
    fn the_status_sums_the_probe_hits_of_the_online_processes_only() {
        struct Hits;
        impl LaunchSource for Hits {
            fn watch(&mut self, _: u32) -> Result<(), String> {
                Ok(())
            }
            fn unwatch(&mut self, _: u32) {}
            fn last_launch_ns(&self, _: u32) -> u64 {
                0
            }
            fn probe_hits(&self, pid: u32) -> ProbeHits {
                let n = u64::from(pid);
                ProbeHits {
                    kernel_launches: 100 * n,
                    graph_launches: 10 * n,
                    syncs: n,
                }
            }
        }
        let rm = Arc::new(FakeRm::host(1));
        let shared = Arc::new(GateShared::default());
        let mut rt = GateRuntime::new(
            Controller::with_driver(rm).unwrap(),
            Hits,
            GateConfig::default(),
            shared.clone(),
        );
        rt.handle(GateInput::Online([1, 2].into()), 0);
        let want = ProbeHits {
            kernel_launches: 300,
            graph_launches: 30,
            syncs: 3,
        };
        assert_eq!(snapshot(&shared).online_probe_hits, want);
        rt.handle(GateInput::Online([2].into()), 0);
        assert_eq!(snapshot(&shared).online_probe_hits.kernel_launches, 200);
    }

    #[test]
    fn the_probe_counters_are_not_read_on_every_decision() {
        // Each read is a map lookup per online process: the gate's decisions must not pay it.
        struct Counted(Arc<std::sync::atomic::AtomicUsize>);
        impl LaunchSource for Counted {
            fn watch(&mut self, _: u32) -> Result<(), String> {
                Ok(())
            }
            fn unwatch(&mut self, _: u32) {}
            fn last_launch_ns(&self, _: u32) -> u64 {
                0
            }
            fn probe_hits(&self, _: u32) -> ProbeHits {
                self.0.fetch_add(1, Ordering::SeqCst);
                ProbeHits::default()
            }
        }
        let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let rm = Arc::new(FakeRm::host(1));
        let mut rt = GateRuntime::new(
            Controller::with_driver(rm.clone()).unwrap(),
            Counted(reads.clone()),
            GateConfig::default(),
            Arc::new(GateShared::default()),
        );
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        let after_online = reads.load(Ordering::SeqCst);
        assert!(after_online >= 1, "a new online set is counted at once");
        for i in 0..50 {
            rt.handle(GateInput::Busy, 2 * i * MS);
            rt.handle(GateInput::Idle, (2 * i + 1) * MS);
        }
        let during = reads.load(Ordering::SeqCst) - after_online;
        assert!(
            during <= 2,
            "100 decisions read the counters {during} times"
        );
    }

    #[test]
    fn an_online_edge_freezes_every_offline_channel_and_the_cooldown_releases_them() {
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, launches) = runtime(&rm, GateConfig::default());
        rt.handle(GateInput::Offline(offline(&rm)), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        assert!(rm.disabled().is_empty());
        // Another process's launches are not online work.
        rt.handle(edge(4242, MS, 0), MS);
        assert!(rm.disabled().is_empty());
        rt.handle(edge(ONLINE, 10 * MS, 0), 10 * MS);
        assert_eq!(rm.disabled().len(), 60, "both processes, both GPUs");
        // Not learned yet: the cooldown is the ceiling (200 ms), and later launches extend it.
        launches.0.lock().unwrap().insert(ONLINE, 15 * MS);
        rt.tick(150 * MS);
        assert_eq!(rm.disabled().len(), 60);
        // The counters are read once the edge's cooldown is over: the 15 ms launch extends it.
        assert_eq!(rt.wait_for(150 * MS), Duration::from_millis(60));
        rt.tick(210 * MS);
        assert_eq!(rm.disabled().len(), 60);
        assert_eq!(rt.wait_for(210 * MS), Duration::from_millis(5));
        rt.tick(215 * MS);
        assert!(rm.disabled().is_empty());
        assert!(!rt.offline_disabled());
        let st = snapshot(&rt.shared);
        assert_eq!((st.preemptions, st.resumes, st.edges), (1, 1, 1));
        assert_eq!(st.offline_channels, 60);
        assert_eq!(st.offline_gpus, 2);
        assert_eq!(st.disable_us.n, 1);
        assert_eq!(st.edge_to_disable_us.n, 1);
    }

    #[test]
    fn one_preemption_per_request_once_gaps_are_learned() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, launches) = runtime(&rm, GateConfig::default());
        let recs: Vec<_> = offline(&rm)
            .into_iter()
            .filter(|r| r.device_instance == 0)
            .collect();
        rt.handle(GateInput::Offline(recs), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        let mut t = 0;
        let mut first = true;
        for _request in 0..5 {
            t += 300 * MS;
            let before = rt.policy().preemptions();
            // Prefill then 20 decode iterations 2 ms apart; each iteration is an edge.
            let mut idle = if first { 0 } else { 300 * MS };
            for _ in 0..21 {
                rt.handle(edge(ONLINE, t, idle), t);
                launches.0.lock().unwrap().insert(ONLINE, t + 50 * US);
                assert!(rt.offline_disabled(), "frozen inside the request");
                rt.tick(t + MS);
                assert!(rt.offline_disabled(), "no resume between iterations");
                t += 2 * MS;
                idle = 2 * MS - 50 * US;
            }
            assert_eq!(rt.policy().preemptions(), before + 1);
            // Idle after the request: resumed once the cooldown (ceiling until learned) passed.
            rt.tick(t + 250 * MS);
            assert!(!rt.offline_disabled());
            assert!(rm.disabled().is_empty());
            first = false;
        }
        assert_eq!(rt.policy().preemptions(), 5);
        assert!(rt.policy().cooldown() < Duration::from_millis(5));
    }

    #[test]
    fn offline_channels_that_appear_while_preempted_are_frozen_at_once() {
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let recs = offline(&rm);
        rt.handle(GateInput::Offline(recs[..1].to_vec()), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        rt.handle(edge(ONLINE, MS, 0), MS);
        assert_eq!(rm.disabled().len(), 20);
        rt.handle(GateInput::Offline(recs.clone()), 2 * MS);
        assert_eq!(rm.disabled().len(), 60);
        drop(rt);
        assert!(rm.disabled().is_empty(), "drop enables everything");
    }

    #[test]
    fn busy_and_idle_signals_override_the_launch_clock() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
        rt.handle(GateInput::Busy, MS);
        assert_eq!(rm.disabled().len(), 20);
        rt.tick(10_000 * MS);
        assert_eq!(rm.disabled().len(), 20, "pinned by busy");
        rt.handle(GateInput::Idle, 10_001 * MS);
        assert!(rm.disabled().is_empty());
    }

    #[test]
    fn an_exited_offline_process_does_not_keep_the_others_running() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let mut recs: Vec<_> = offline(&rm)
            .into_iter()
            .filter(|r| r.device_instance == 0)
            .collect();
        // A third process whose client RM does not know (it exited): its channels fail.
        recs.insert(
            0,
            DisabledRecord {
                pid: 4_199_999,
                device_instance: 0,
                client: 0xc1d0_0099,
                channels: vec![0x5c00_0001],
            },
        );
        rt.handle(GateInput::Offline(recs), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        rt.handle(edge(ONLINE, MS, 0), MS);
        assert_eq!(rm.disabled().len(), 40, "the live processes are frozen");
        rt.handle(GateInput::Idle, 2 * MS);
        assert!(rm.disabled().is_empty());
        let st = snapshot(&rt.shared);
        assert!(st.errors >= 1 && st.last_error.is_some());
    }

    #[test]
    fn the_thread_resumes_offline_when_stopped_or_dropped() {
        let rm = Arc::new(FakeRm::host(1));
        let recs = offline(&rm)[..1].to_vec();
        for stop_explicitly in [true, false] {
            let rm2 = rm.clone();
            let h = spawn(GateConfig::default(), move |_tx| {
                Ok((
                    Controller::with_driver(rm2).map_err(|e| e.to_string())?,
                    FakeLaunches::default(),
                ))
            })
            .unwrap();
            h.send(GateInput::Offline(recs.clone()));
            h.send(GateInput::Busy);
            let t0 = Instant::now();
            while rm.disabled().len() != 20 && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(rm.disabled().len(), 20);
            assert!(h.status().preempted && h.status().running);
            if stop_explicitly {
                let (st, err) = h.stop();
                assert!(err.is_none());
                assert!(!st.running && !st.preempted);
                assert_eq!(st.resumes, 1);
            } else {
                drop(h);
            }
            assert!(rm.disabled().is_empty());
        }
        let err = spawn::<Arc<FakeRm>, FakeLaunches, _>(GateConfig::default(), |_| {
            Err("no libcuda".into())
        })
        .err();
        assert_eq!(err.as_deref(), Some("no libcuda"));
    }

    /// A launch source whose drop (detaching uprobes) waits until the test releases it.
    struct SlowToDetach {
        release: Mutex<mpsc::Receiver<()>>,
        detached: Arc<AtomicBool>,
    }

    impl LaunchSource for SlowToDetach {
        fn watch(&mut self, _pid: u32) -> Result<(), String> {
            Ok(())
        }
        fn unwatch(&mut self, _pid: u32) {}
        fn last_launch_ns(&self, _pid: u32) -> u64 {
            0
        }
    }

    impl Drop for SlowToDetach {
        fn drop(&mut self) {
            let rx = self.release.lock().unwrap();
            let _ = rx.recv_timeout(Duration::from_secs(10));
            self.detached.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn stop_returns_once_offline_runs_without_waiting_for_the_probes_to_detach() {
        let rm = Arc::new(FakeRm::host(1));
        let recs = offline(&rm)[..1].to_vec();
        let (release_tx, release_rx) = mpsc::channel();
        let detached = Arc::new(AtomicBool::new(false));
        let (rm2, detached2) = (rm.clone(), detached.clone());
        let h = spawn(GateConfig::default(), move |_tx| {
            Ok((
                Controller::with_driver(rm2).map_err(|e| e.to_string())?,
                SlowToDetach {
                    release: Mutex::new(release_rx),
                    detached: detached2,
                },
            ))
        })
        .unwrap();
        h.send(GateInput::Offline(recs));
        h.send(GateInput::Busy);
        let t0 = Instant::now();
        while rm.disabled().len() != 20 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (st, err) = h.stop();
        // Offline runs and the status is final, while the probes are still detaching.
        assert!(rm.disabled().is_empty() && !st.running && err.is_none());
        assert!(
            !detached.load(Ordering::SeqCst),
            "stop waited for the detach"
        );
        release_tx.send(()).unwrap();
        let t0 = Instant::now();
        while !detached.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(detached.load(Ordering::SeqCst), "the detach still happens");
    }
}
