//! The gate thread's loop ([`GateRuntime::run`]): each input and each tick, decided by the
//! policy and carried out on the offline channels.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use valve::driver::RmDriver;
use valve::stats::monotonic_ns;
use valve_ebpf::{ArrivalEdge, LaunchEdge};

use super::channels::Cause;
use super::input::{GateInput, LaunchSource};
use super::shared::channel_set;
use super::state::GateRuntime;
use crate::gate::policy::{Action, LaunchesBefore};
use crate::gate::trace::TraceKind;

/// A thread waiting for online GPU work holds offline for at most this many cooldown ceilings
/// after the last online launch (a long prefill waits that long at most; a stuck wait is no work).
const SYNC_HOLD_FACTOR: u64 = 5;

/// How long a due resume waits for edges written while offline was held (they reach the gate
/// within the watcher's poll period); past it they are taken as lost.
const QUIET_EDGE_WAIT_NS: u64 = 2 * valve_ebpf::REQUEST_POLL.as_nanos() as u64;

impl<D: RmDriver, L: LaunchSource> GateRuntime<D, L> {
    /// Whether `e` came to a watched port: in the port's network namespace, or in any where
    /// the port was named without one.
    pub(super) fn watched_port(&self, e: &ArrivalEdge) -> bool {
        self.ports
            .iter()
            .any(|p| p.port == e.port && (p.netns == 0 || p.netns == e.netns))
    }

    /// Handles one input received at `now_ns`; returns false on [`GateInput::Stop`].
    pub fn handle(&mut self, input: GateInput, now_ns: u64) -> bool {
        match input {
            GateInput::Edge(e) => self.edge(e, now_ns),
            GateInput::Arrival(e) => self.arrival(e, now_ns),
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
            GateInput::HoldHistory(gaps) => {
                self.policy.seed_hold_history(&gaps);
                // Chosen now, not at the next tick: the status shows the hold it starts with.
                self.policy.refresh_hold();
                self.update(|_| {});
            }
            GateInput::Sync(ack) => {
                self.adopt.clear();
                self.refresh_probes();
                let _ = ack.try_send(());
            }
            GateInput::Stop => return false,
        }
        true
    }

    /// An online launch after an idle gap (or the first since a resume).
    fn edge(&mut self, e: LaunchEdge, now_ns: u64) {
        if !self.online.contains(&e.pid) {
            return;
        }
        if e.quiet {
            *self.quiet_received.entry(e.pid).or_default() += 1;
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
        self.update(|s| {
            s.edges += 1;
            s.quiet_edges += u64::from(e.quiet);
        });
    }

    /// Request data on a watched port after an idle gap.
    fn arrival(&mut self, e: ArrivalEdge, now_ns: u64) {
        if !self.watched_port(&e) || !self.first_sight(&e) {
            return;
        }
        self.shared.trace.push(
            TraceKind::Arrival,
            e.ts_ns,
            u32::from(e.port),
            now_ns,
            e.idle_ns,
            e.read_ns,
        );
        // While offline is frozen only edges reach the gate, not the launches of a
        // request in flight: the counters say what online did before the arrival (no
        // disable waits on them, offline is off already).
        let before = if self.policy.preempted() {
            self.launches_before(e.ts_ns)
        } else {
            LaunchesBefore::Heard
        };
        let idle = self.policy.idle_at(e.ts_ns, before);
        let held = self.policy.held_at(e.ts_ns, before);
        if self.policy.on_arrival_after(e.ts_ns, before) == Some(Action::Preempt) {
            self.disable(Cause::Arrival(e.ts_ns));
        }
        self.update(|s| {
            s.arrivals_idle += u64::from(idle);
            s.arrivals_held += u64::from(held);
        });
        if idle || held {
            if let Some(m) = crate::metrics::for_gate() {
                m.gate_arrival(idle, held);
            }
        }
        // After the disable: the daemon's owner lookup is not on the online path.
        self.shared
            .arrivals_taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Time passes: resumes offline once online has been idle for the cooldown (or, after an
    /// arrival that launched nothing, for the arrival hold).
    ///
    /// Before it resumes it arms the launch watcher and reads the counters once more: a launch
    /// after the arm is reported as an edge (which preempts again at once), and one before it is
    /// in this second reading (which pushes the resume out). So no online launch runs beside
    /// resumed offline work without the gate hearing of it, whatever its idle gap.
    pub fn tick(&mut self, now_ns: u64) {
        // The hold (--hold-budget) first, so that every due time below is the same one.
        self.policy.refresh_hold();
        // Later activity can only push the due time out, so before it nothing needs reading.
        if !self.resume_due(now_ns) {
            self.quiet_awaited_until = None;
            return;
        }
        if self.awaiting_quiet_edges(now_ns) {
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

    /// Whether edges written while offline was held are still on their way at `now_ns` (the
    /// policy learns gaps and arrival delays from them, so a resume decided without them could
    /// come too early), for at most [`QUIET_EDGE_WAIT_NS`] from the first time asked; those that
    /// have not come by then are taken as lost.
    fn awaiting_quiet_edges(&mut self, now_ns: u64) -> bool {
        let behind = |rt: &Self, p: u32| {
            rt.launches.quiet_edges(p) > rt.quiet_received.get(&p).copied().unwrap_or(0)
        };
        if !self.online.iter().any(|&p| behind(self, p)) {
            self.quiet_awaited_until = None;
            return false;
        }
        let until = *self
            .quiet_awaited_until
            .get_or_insert(now_ns.saturating_add(QUIET_EDGE_WAIT_NS));
        if now_ns < until {
            return true;
        }
        for &p in &self.online {
            self.quiet_received.insert(p, self.launches.quiet_edges(p));
        }
        self.quiet_awaited_until = None;
        false
    }

    /// The latest of `time` over the online processes (0: none).
    fn latest_online(&self, time: impl Fn(&L, u32) -> u64) -> u64 {
        self.online
            .iter()
            .map(|&p| time(&self.launches, p))
            .max()
            .unwrap_or(0)
    }

    /// Online's activity before an arrival at `ts_ns`, from every online process's counters:
    /// busy if one was, else the latest of their last activities.
    fn launches_before(&self, ts_ns: u64) -> LaunchesBefore {
        let mut last = 0;
        for &p in &self.online {
            match self.launches.launches_before(p, ts_ns) {
                LaunchesBefore::Last(t) => last = last.max(t),
                other => return other,
            }
        }
        LaunchesBefore::Last(last)
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
        if let Some(until) = self.quiet_awaited_until.filter(|&u| u > now_ns) {
            return Duration::from_nanos(until - now_ns);
        }
        match self.policy.resume_due_ns() {
            Some(due) => Duration::from_nanos(due.saturating_sub(now_ns)),
            None => Duration::from_millis(100),
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
            // After every input or wake-up: the status says soon when probes are in.
            self.refresh_probes();
        }
        // Drop enables.
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::gate::runtime::fixtures::*;
    use crate::gate::runtime::shared::snapshot;
    use crate::gate::GateConfig;
    use valve::fake::FakeRm;
    use valve_ebpf::{ArrivalCounts, LaunchEdge, WatchedPort};

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
                quiet: false,
            }),
            113 * MS,
        );
        assert_eq!(rm.disabled().len(), 20, "the armed edge preempts");
        let trace = rt.shared.trace.since(0, 1000);
        let flagged = trace
            .iter()
            .find(|r| r.kind == TraceKind::LaunchAfterResume)
            .expect("the trace marks it");
        assert_eq!(
            serde_json::to_value(flagged.entry()).unwrap()["after_resume"],
            true
        );
        // A resume on an explicit idle signal arms too.
        rt.handle(GateInput::Busy, 120 * MS);
        rt.handle(GateInput::Idle, 130 * MS);
        assert!(rm.disabled().is_empty());
        assert_eq!(launches.3.lock().unwrap().len(), 4);
    }

    #[test]
    fn edges_are_quiet_only_from_a_preemption_to_the_resume() {
        let (rm, mut rt, launches) = one_offline_one_online();
        let held = |l: &FakeLaunches| *l.6.lock().unwrap().last().expect("a mark");
        rt.handle(edge(ONLINE, 10 * MS, 0), 10 * MS);
        assert_eq!(rm.disabled().len(), 20);
        assert!(held(&launches) > 0, "held from the disable");
        // A resume called off (online launched as the gate armed): disarmed, so quiet again.
        launches.0.lock().unwrap().insert(ONLINE, 10 * MS);
        *launches.4.lock().unwrap() = Some((ONLINE, 61 * MS));
        rt.tick(61 * MS);
        assert!(held(&launches) > 0 && launches.3.lock().unwrap().last() == Some(&0));
        rt.tick(112 * MS);
        assert!(rm.disabled().is_empty());
        assert_eq!(held(&launches), 0, "no longer held once offline runs");
        // The serving framework's busy and idle signals mark it too, and so does the stop.
        rt.handle(GateInput::Busy, 120 * MS);
        assert!(held(&launches) > 0);
        rt.handle(GateInput::Idle, 130 * MS);
        assert_eq!(held(&launches), 0);
        rt.handle(GateInput::Busy, 140 * MS);
        drop(rt);
        assert!(rm.disabled().is_empty());
        assert_eq!(held(&launches), 0, "a stopped gate leaves nothing held");
    }

    #[test]
    fn a_due_resume_waits_for_the_edges_still_on_their_way() {
        let (rm, mut rt, launches) = one_offline_one_online();
        rt.handle(edge(ONLINE, 10 * MS, 0), 10 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 10 * MS);
        // Held, online launched after a gap: the watcher wrote that edge quietly, and at the
        // due time (10 ms + the 50 ms ceiling) it has not reached the gate yet.
        launches.7.lock().unwrap().insert(ONLINE, 1);
        rt.tick(61 * MS);
        assert_eq!(rm.disabled().len(), 20, "the resume waits for it");
        assert_eq!(rt.wait_for(61 * MS), Duration::from_millis(20));
        // It comes (a launch at 12 ms): the resume is decided with it, at 12 + 50 ms.
        rt.handle(quiet_edge(ONLINE, 12 * MS, 2 * MS), 61 * MS + 500 * US);
        let status = snapshot(&rt.shared);
        assert_eq!((status.edges, status.quiet_edges), (2, 1));
        rt.tick(61 * MS + 600 * US);
        assert_eq!(rm.disabled().len(), 20);
        rt.tick(62 * MS);
        assert!(rm.disabled().is_empty(), "nothing on its way: resumed");
        // One lost for good: the resume waits for it 20 ms at most, and not again.
        rt.handle(edge(ONLINE, 100 * MS, 38 * MS), 100 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 100 * MS);
        launches.7.lock().unwrap().insert(ONLINE, 2);
        rt.tick(150 * MS);
        rt.tick(169 * MS);
        assert_eq!(rm.disabled().len(), 20);
        rt.tick(170 * MS);
        assert!(rm.disabled().is_empty(), "resumed once the wait ran out");
        rt.handle(edge(ONLINE, 200 * MS, 30 * MS), 200 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 200 * MS);
        rt.tick(250 * MS);
        assert!(
            rm.disabled().is_empty(),
            "the lost edge is not waited for twice"
        );
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
            serde_json::to_value(cooldown.entry()).unwrap()["waits_ignored"],
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
    fn a_request_keeps_offline_stopped_until_its_host_has_waited_for_the_gpu() {
        let (rm, mut rt, launches) = gate_with_port(GateConfig {
            fixed_cooldown: Some(Duration::from_millis(1)),
            ..GateConfig::default()
        });
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

    /// A gate with a hold (10% of a seeded history: 36 gaps of 30 ms, 4 of 5 s), offline,
    /// online and its port; cooldown ceiling 50 ms.
    fn holding_gate() -> (
        Arc<FakeRm>,
        GateRuntime<Arc<FakeRm>, FakeLaunches>,
        FakeLaunches,
    ) {
        let (rm, mut rt, launches) = gate_with_port(GateConfig {
            cooldown_ceiling: Duration::from_millis(50),
            hold_budget: Some(0.1),
            ..GateConfig::default()
        });
        let gaps = (0..40)
            .map(|i| if i % 10 == 9 { 5_000 * MS } else { 30 * MS })
            .collect();
        let history = crate::gate::policy::HoldHistory {
            gaps,
            last_activity_ns: None,
        };
        rt.handle(GateInput::HoldHistory(history), 0);
        rt.tick(MS);
        assert!(rt.policy().hold() > Duration::from_millis(100));
        (rm, rt, launches)
    }

    #[test]
    fn an_arrival_while_a_request_runs_unheard_is_not_idle_nor_caught_nor_a_gap() {
        let (rm, mut rt, launches) = holding_gate();
        // A first request, served and ended: the gate resumes once its cooldown and hold pass.
        rt.handle(arrival(PORT, 10 * MS), 10 * MS);
        rt.handle(edge(ONLINE, 10 * MS + 200 * US, 0), 11 * MS);
        launches.0.lock().unwrap().insert(ONLINE, 20 * MS);
        let mut now = 20 * MS;
        while !rm.disabled().is_empty() {
            now += MS;
            rt.tick(now);
            assert!(now < 2_000 * MS, "never resumed");
        }
        // The next request after 1 s of idle time: it preempts, is idle, is not caught.
        rt.handle(arrival(PORT, 1_000 * MS), 1_000 * MS);
        rt.handle(edge(ONLINE, 1_000 * MS + 200 * US, 980 * MS), 1_001 * MS);
        assert_eq!(rm.disabled().len(), 20);
        let st = snapshot(&rt.shared);
        assert_eq!((st.arrivals_idle, st.arrivals_held), (1, 0));
        let gaps = st.hold_gaps;
        // It launches for 300 ms with no gap long enough for an edge: the gate hears nothing,
        // the counters see it. A request queued behind it 200 ms in is no idle arrival.
        launches.0.lock().unwrap().insert(ONLINE, 1_200 * MS);
        rt.handle(arrival(PORT, 1_200 * MS + 500 * US), 1_201 * MS);
        let st = snapshot(&rt.shared);
        assert_eq!((st.arrivals, st.arrivals_idle, st.arrivals_held), (3, 1, 0));
        assert_eq!(st.hold_gaps, gaps, "no gap noted");
        // A thread waiting for its GPU work since before the arrival: busy as well.
        launches.2.lock().unwrap().insert(ONLINE);
        rt.handle(arrival(PORT, 1_250 * MS), 1_250 * MS);
        launches.2.lock().unwrap().clear();
        // The request ends at 1.3 s; 100 ms later, within the hold, the next one is caught.
        launches.0.lock().unwrap().insert(ONLINE, 1_300 * MS);
        assert_eq!(rm.disabled().len(), 20, "still held");
        rt.handle(arrival(PORT, 1_400 * MS), 1_400 * MS);
        let st = snapshot(&rt.shared);
        assert_eq!((st.arrivals, st.arrivals_idle, st.arrivals_held), (5, 2, 1));
        assert_eq!(st.hold_gaps, gaps + 1, "its gap is noted");
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
    fn a_preemption_counts_only_when_offline_channels_stop() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, _launches) = runtime(&rm, GateConfig::default());
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        // No offline channels yet: the policy preempts, nothing is disabled, none is counted.
        rt.handle(edge(ONLINE, MS, 0), MS);
        assert_eq!(rt.policy().preemptions(), 1);
        assert!(rm.disabled().is_empty());
        rt.tick(300 * MS);
        rt.handle(edge(ONLINE, 400 * MS, 0), 400 * MS);
        assert_eq!(rt.policy().preemptions(), 2);
        let st = snapshot(&rt.shared);
        assert_eq!((st.preemptions, st.resumes), (0, 0));
        // Channels that appear while the policy is preempted stop on arrival: that one counts.
        rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 401 * MS);
        assert_eq!(rm.disabled().len(), 20);
        rt.tick(700 * MS);
        assert!(rm.disabled().is_empty());
        let st = snapshot(&rt.shared);
        assert_eq!((st.preemptions, st.resumes), (1, 1));
        // And the next edge's disable is the second.
        rt.handle(edge(ONLINE, 800 * MS, 0), 800 * MS);
        assert_eq!(rm.disabled().len(), 20);
        assert_eq!(snapshot(&rt.shared).preemptions, 2);
    }
}
