//! The gate's state without the thread ([`GateRuntime`]): what it holds, how it is built, and
//! how it reports (status, latency samples, trace, errors) after each decision.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use valve::controller::{Controller, PreemptPlan};
use valve::driver::RmDriver;
use valve::state::DisabledRecord;
use valve::stats::monotonic_ns;
use valve_ebpf::realtime::Scheduling;
use valve_ebpf::WatchedPort;

use super::input::{LaunchSource, ProbeHits};
use super::shared::GateShared;
use super::status::{GateStatus, ProbeState, Samples};
use crate::gate::policy::{GateConfig, GatePolicy};
use crate::gate::trace::TraceKind;

/// The gate's state without the thread: feed it inputs and ticks with explicit times.
/// Dropping it enables whatever it has disabled.
pub struct GateRuntime<D: RmDriver, L: LaunchSource> {
    pub(super) ctl: Controller<D>,
    pub(super) launches: L,
    pub(super) policy: GatePolicy,
    pub(super) records: Vec<DisabledRecord>,
    pub(super) plan: Option<PreemptPlan>,
    /// Offline channels are disabled by this gate now.
    pub(super) disabled: bool,
    /// Times `disabled` became true: the status's preemptions (resumes are its way back).
    pub(super) preemptions: u64,
    /// Offline sets applied so far (the claims of
    /// [`Claims::taken`](super::shared::Claims::taken) count them).
    pub(super) offline_applied: u64,
    /// When the status's probe counters were last read (0: read at the next update).
    pub(super) probe_hits_read_ns: std::cell::Cell<u64>,
    /// Channels handed back disabled ([`GateInput::Adopt`](super::GateInput::Adopt)), until
    /// the next sync.
    pub(super) adopt: BTreeSet<(u32, u32, u32)>,
    pub(super) disabled_since: Option<Instant>,
    pub(super) online: BTreeSet<u32>,
    /// Where each online process's probes are (published in the status).
    pub(super) probes: BTreeMap<u32, ProbeState>,
    pub(super) ports: BTreeSet<WatchedPort>,
    /// The issue mode is to be measured once on the first offline plan with 2 or more GPUs.
    pub(super) probe_pending: bool,
    /// Spin on the input channel and the arrival counters while offline runs
    /// (`--arrival-busy-poll`).
    pub(super) busy_poll: bool,
    /// Edge counts of the watched ports as last polled (taken afresh whenever polling starts).
    pub(super) polled_edges: BTreeMap<u16, u64>,
    /// The latest arrival handled per port: an edge at or before it is one already handled
    /// (polled from the counters, then read again from the ring buffer).
    pub(super) handled_arrival_ns: BTreeMap<u16, u64>,
    /// Quiet edges received per online pid (written while offline was held; see
    /// [`LaunchSource::quiet_edges`]).
    pub(super) quiet_received: BTreeMap<u32, u64>,
    /// A due resume waits until then for quiet edges still on their way.
    pub(super) quiet_awaited_until: Option<u64>,
    pub(super) shared: Arc<GateShared>,
    /// The running check of the current freeze (set at the enable, which it must not outrun).
    pub(super) freeze_check: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The offline set's channels as the freeze check reads them (made with the set).
    pub(super) check_targets: Arc<[valve::controller::ChannelTarget]>,
}

/// How often the status's probe counters are read again.
const PROBE_HITS_EVERY_NS: u64 = 100_000_000;

impl<D: RmDriver, L: LaunchSource> GateRuntime<D, L> {
    /// A gate with offline running and nothing gated yet.
    pub fn new(ctl: Controller<D>, launches: L, cfg: GateConfig, shared: Arc<GateShared>) -> Self {
        Self::with_scheduling(ctl, launches, cfg, shared, Scheduling::Normal)
    }

    /// As [`GateRuntime::new`], on a thread scheduled as `own` (reported in the status).
    pub(super) fn with_scheduling(
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
            preemptions: 0,
            offline_applied: 0,
            probe_hits_read_ns: std::cell::Cell::new(0),
            adopt: BTreeSet::new(),
            disabled_since: None,
            online: BTreeSet::new(),
            probes: BTreeMap::new(),
            ports: BTreeSet::new(),
            probe_pending: cfg.issue.is_none(),
            busy_poll: cfg.arrival_busy_poll,
            polled_edges: BTreeMap::new(),
            handled_arrival_ns: BTreeMap::new(),
            quiet_received: BTreeMap::new(),
            quiet_awaited_until: None,
            shared,
            freeze_check: None,
            check_targets: Arc::from([]),
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
            s.online_probes_attached = true;
            s.hold_budget_pct = cfg.hold_budget.map(|b| b * 100.0);
        });
        rt
    }

    pub(super) fn update(&self, f: impl FnOnce(&mut GateStatus)) {
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
        g.status.preemptions = self.preemptions;
        g.status.arrivals = self.policy.arrivals();
        g.status.cooldown_us = self.policy.cooldown().as_secs_f64() * 1e6;
        g.status.hold_us = self.policy.hold().as_secs_f64() * 1e6;
        g.status.hold_gaps = self.policy.idle_gaps();
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

    pub(super) fn sample(&self, f: impl FnOnce(&mut Samples)) {
        let mut g = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        f(&mut g.samples);
    }

    pub(super) fn trace(&self, kind: TraceKind, t_ns: u64, id: u32, a: u64, b: u64) {
        self.shared.trace.push(kind, t_ns, id, a, b, 0);
    }

    pub(super) fn error(&self, what: String) {
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
        // Before `ended`: the daemon reads the gaps once the gate has stopped.
        *self
            .shared
            .hold_history
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = self.policy.hold_history();
        drop(g);
        self.shared.ended.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gate::runtime::fixtures::*;
    use crate::gate::runtime::shared::snapshot;
    use crate::gate::runtime::GateInput;
    use valve::fake::FakeRm;

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
    fn a_hold_history_handed_in_is_in_the_status_and_goes_back_out_when_the_gate_ends() {
        struct Quiet;
        impl LaunchSource for Quiet {
            fn watch(&mut self, _: u32) -> Result<(), String> {
                Ok(())
            }
            fn unwatch(&mut self, _: u32) {}
            fn last_launch_ns(&self, _: u32) -> u64 {
                0
            }
        }
        let rm = Arc::new(FakeRm::host(1));
        let shared = Arc::new(GateShared::default());
        let cfg = GateConfig {
            hold_budget: Some(0.08),
            ..GateConfig::default()
        };
        let mut rt = GateRuntime::new(
            Controller::with_driver(rm).unwrap(),
            Quiet,
            cfg,
            shared.clone(),
        );
        let history = crate::gate::policy::HoldHistory {
            gaps: (1..=20).map(|i| i * 1_000_000).collect(),
            last_activity_ns: None,
        };
        assert!(rt.handle(GateInput::HoldHistory(history.clone()), 0));
        assert_eq!(snapshot(&shared).hold_gaps, 20);
        assert!(
            snapshot(&shared).hold_us > 0.0,
            "chosen at once, not at the next tick"
        );
        assert!(
            shared.hold_history().gaps.is_empty(),
            "not before the gate ends"
        );
        drop(rt);
        assert_eq!(shared.hold_history(), history);
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
}
