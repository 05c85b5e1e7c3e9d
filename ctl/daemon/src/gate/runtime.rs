//! The gate's runtime: one thread that owns its own RM client, turns launch edges and busy/idle
//! signals into disables and enables of the offline channels, and re-enables them on every exit.
//!
//! The daemon starts it ([`spawn`]), feeds it the offline processes' channels as discovery learns
//! them, and reads its [`GateStatus`]. The thread waits on one channel of [`GateInput`]s, with a
//! timeout that ends exactly when the policy's cooldown would; [`GateRuntime`] is the same logic
//! without the thread, for tests.

use std::collections::BTreeSet;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use valve::controller::{Controller, PreemptMode, PreemptPlan};
use valve::driver::RmDriver;
use valve::state::{reenable, targets_of, DisabledRecord};
pub use valve::stats::monotonic_ns;
use valve::stats::{summarize_us, Summary};
use valve_ebpf::LaunchEdge;

use super::policy::{Action, GateConfig, GatePolicy};

/// What the gate thread is told.
#[derive(Clone, Debug)]
pub enum GateInput {
    /// An online process launched GPU work after an idle gap (from the uprobe watcher).
    Edge(LaunchEdge),
    /// The serving framework: a request is in flight.
    Busy,
    /// The serving framework: no request is in flight.
    Idle,
    /// The offline channels, per process and GPU (replaces the previous set).
    Offline(Vec<DisabledRecord>),
    /// The online processes (replaces the previous set).
    Online(BTreeSet<u32>),
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
    /// CLOCK_MONOTONIC ns of `pid`'s latest launch (0: none yet).
    fn last_launch_ns(&self, pid: u32) -> u64;
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
    /// Online processes watched.
    pub online_pids: Vec<u32>,
    /// Offline processes gated.
    pub offline_pids: Vec<u32>,
    /// Their channels, over all GPUs.
    pub offline_channels: usize,
    /// GPUs they use.
    pub offline_gpus: usize,
    /// The cooldown in force now.
    pub cooldown_us: f64,
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

/// The status and samples the gate thread shares with the daemon.
#[derive(Default)]
pub struct SharedStatus {
    status: GateStatus,
    samples: Samples,
}

/// A snapshot of `shared` with the latency summaries filled in. Only the copy happens under the
/// lock, so a status request never holds up the gate thread for the sorting.
fn snapshot(shared: &Mutex<SharedStatus>) -> GateStatus {
    let (mut s, samples) = {
        let g = shared.lock().unwrap_or_else(PoisonError::into_inner);
        (g.status.clone(), g.samples.clone())
    };
    s.disable_us = summarize_us(&samples.disable);
    s.enable_us = summarize_us(&samples.enable);
    s.reaction_us = summarize_us(&samples.reaction);
    s.edge_to_disable_us = summarize_us(&samples.edge_to_disable);
    s
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
    disabled_since: Option<Instant>,
    online: BTreeSet<u32>,
    shared: Arc<Mutex<SharedStatus>>,
}

impl<D: RmDriver, L: LaunchSource> GateRuntime<D, L> {
    /// A gate with offline running and nothing gated yet.
    pub fn new(
        ctl: Controller<D>,
        launches: L,
        cfg: GateConfig,
        shared: Arc<Mutex<SharedStatus>>,
    ) -> Self {
        let rt = GateRuntime {
            ctl,
            launches,
            policy: GatePolicy::new(cfg),
            records: Vec::new(),
            plan: None,
            disabled: false,
            disabled_since: None,
            online: BTreeSet::new(),
            shared,
        };
        rt.update(|s| s.running = true);
        rt
    }

    fn update(&self, f: impl FnOnce(&mut GateStatus)) {
        let mut g = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut g.status);
        g.status.preempted = self.policy.preempted();
        g.status.pinned = self.policy.pinned();
        g.status.preemptions = self.policy.preemptions();
        g.status.cooldown_us = self.policy.cooldown().as_secs_f64() * 1e6;
    }

    fn sample(&self, f: impl FnOnce(&mut Samples)) {
        let mut g = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut g.samples);
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

    /// Handles one input at `now_ns`; returns false on [`GateInput::Stop`].
    pub fn handle(&mut self, input: GateInput, now_ns: u64) -> bool {
        let mut edges = 0;
        match input {
            GateInput::Edge(e) => {
                if !self.online.contains(&e.pid) {
                    return true;
                }
                // Counted after the disable: nothing that can wait on a lock comes before it.
                edges = 1;
                let idle = (e.idle_ns > 0).then_some(e.idle_ns);
                if self.policy.on_edge(e.ts_ns, idle) == Some(Action::Preempt) {
                    self.disable(Some(e.ts_ns));
                }
            }
            GateInput::Busy => {
                if self.policy.on_busy(now_ns) == Some(Action::Preempt) {
                    self.disable(None);
                }
            }
            GateInput::Idle => {
                if self.policy.on_idle() == Some(Action::Resume) {
                    self.enable();
                }
            }
            GateInput::Offline(records) => self.set_offline(records),
            GateInput::Online(pids) => self.set_online(pids),
            GateInput::Sync(ack) => {
                let _ = ack.try_send(());
            }
            GateInput::Stop => return false,
        }
        self.update(|s| s.edges += edges);
        true
    }

    /// Time passes: resumes offline once online has been idle for the cooldown.
    pub fn tick(&mut self, now_ns: u64) {
        // Later launches can only push the due time out, so before it nothing needs reading.
        if self.policy.resume_due_ns().is_none_or(|due| now_ns < due) {
            return;
        }
        // Launches that were not edges (closer together than the edge gap) still count.
        let last = self
            .online
            .iter()
            .map(|&p| self.launches.last_launch_ns(p))
            .max()
            .unwrap_or(0);
        if last > 0 {
            self.policy.saw_launch(last);
        }
        if self.policy.on_tick(now_ns) == Some(Action::Resume) {
            self.enable();
            self.update(|_| {});
        }
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
        let online: Vec<u32> = self.online.iter().copied().collect();
        self.update(|s| s.online_pids = online);
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
        // Offline is preempted now: channels that just appeared must stop too. (Channels that
        // went away belong to exited processes or to a manual `preempt --pid`: left alone.)
        if self.policy.preempted() {
            let old: BTreeSet<(u32, u32, u32)> = channel_set(&self.records);
            let added: Vec<DisabledRecord> = records
                .iter()
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
                .collect();
            if !added.is_empty() {
                self.disable_records(&added);
                self.disabled = true;
                self.disabled_since.get_or_insert_with(Instant::now);
            }
        }
        let mut pids: Vec<u32> = records.iter().map(|r| r.pid).collect();
        pids.sort();
        pids.dedup();
        let (channels, gpus) = plan
            .as_ref()
            .map(|p| (p.channels(), p.gpus()))
            .unwrap_or((0, 0));
        self.records = records;
        self.plan = plan;
        self.update(|s| {
            s.offline_pids = pids;
            s.offline_channels = channels;
            s.offline_gpus = gpus;
        });
    }

    /// Disables the offline channels (all GPUs at once).
    fn disable(&mut self, edge_ts_ns: Option<u64>) {
        let Some(plan) = &self.plan else {
            // Nothing to stop yet; the policy still counts as preempted, so channels that appear
            // before the resume are disabled on arrival.
            return;
        };
        let issue_ns = monotonic_ns();
        let result = self.ctl.disable(plan).map(|g| g.keep_disabled());
        let done_ns = monotonic_ns();
        self.disabled = true;
        self.disabled_since = Some(Instant::now());
        match result {
            Ok(report) => {
                let wall = report.wall.as_secs_f64() * 1e6;
                self.sample(|s| {
                    push(&mut s.disable, wall);
                    if let Some(ts) = edge_ts_ns {
                        push(&mut s.reaction, issue_ns.saturating_sub(ts) as f64 / 1e3);
                        push(
                            &mut s.edge_to_disable,
                            done_ns.saturating_sub(ts) as f64 / 1e3,
                        );
                    }
                });
                if let Some(m) = crate::metrics::for_gate() {
                    let edge = edge_ts_ns.map(|ts| done_ns.saturating_sub(ts));
                    let edge =
                        edge.map(|ns| (crate::metrics::EdgeKind::Launch, Duration::from_nanos(ns)));
                    m.gate_disabled(&report, edge);
                }
            }
            Err(e) => {
                // The controller rolled back. Most likely an offline process just exited and
                // its handles are gone: go process by process so the others still stop.
                self.error(format!(
                    "disabling offline channels: {e}; retrying per process"
                ));
                let records = self.records.clone();
                self.disable_records(&records);
            }
        }
    }

    /// Disables record by record, skipping the ones that fail.
    fn disable_records(&mut self, records: &[DisabledRecord]) {
        for r in records {
            let (targets, _) = targets_of(&self.ctl, std::slice::from_ref(r));
            let res = self
                .ctl
                .plan(&targets, PreemptMode::Preempt)
                .and_then(|p| self.ctl.disable(&p).map(|g| drop(g.keep_disabled())));
            if let Err(e) = res {
                if alive(r.pid) {
                    self.error(format!("disabling offline pid {}: {e}", r.pid));
                }
            }
        }
    }

    /// Enables the offline channels; on a failure, record by record so one exited process does
    /// not keep the others frozen.
    fn enable(&mut self) {
        if !self.disabled {
            return;
        }
        let t0 = Instant::now();
        let result = match &self.plan {
            Some(plan) => self.ctl.enable(plan).map(Some),
            None => Ok(None),
        };
        if let Err(e) = &result {
            let (_, failures) = reenable(&self.ctl, &self.records);
            if !failures.is_empty() {
                self.error(format!(
                    "enabling offline channels: {e}; per process: {}",
                    failures.join("; ")
                ));
            }
        }
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

    /// The thread body: waits for input or the cooldown's end, until [`GateInput::Stop`] or until
    /// every sender is gone. Offline is enabled before it returns.
    pub fn run(mut self, rx: Receiver<GateInput>) {
        loop {
            let wait = self.wait_for(monotonic_ns());
            match rx.recv_timeout(wait) {
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

impl<D: RmDriver, L: LaunchSource> Drop for GateRuntime<D, L> {
    fn drop(&mut self) {
        if self.disabled {
            self.enable();
        }
        let mut g = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        g.status.running = false;
        g.status.preempted = false;
    }
}

fn channel_set(records: &[DisabledRecord]) -> BTreeSet<(u32, u32, u32)> {
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
    shared: Arc<Mutex<SharedStatus>>,
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
    let shared = Arc::new(Mutex::new(SharedStatus::default()));
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let (tx2, shared2) = (tx.clone(), shared.clone());
    let thread = std::thread::Builder::new()
        .name("valve-gate".into())
        .spawn(move || match make(tx2) {
            Ok((ctl, launches)) => {
                let rt = GateRuntime::new(ctl, launches, cfg, shared2);
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
        let _ = self.tx.send(input);
    }

    /// The gate's status now.
    pub fn status(&self) -> GateStatus {
        snapshot(&self.shared)
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
        let panicked = match self.thread.take() {
            Some(t) => t.join().is_err(),
            None => false,
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

    #[derive(Clone, Default)]
    struct FakeLaunches(Arc<Mutex<BTreeMap<u32, u64>>>);

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
    }

    fn edge(pid: u32, ts_ns: u64, idle_ns: u64) -> GateInput {
        GateInput::Edge(LaunchEdge {
            pid,
            graph: false,
            ts_ns,
            idle_ns,
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
            Arc::new(Mutex::new(SharedStatus::default())),
        );
        (rt, launches)
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
}
