//! What the gate thread is told ([`GateInput`]), and where it learns when online processes
//! launch and when requests arrive ([`LaunchSource`], with the probe hits it counts).

use std::collections::BTreeSet;
use std::sync::mpsc;

use valve::state::DisabledRecord;
use valve_ebpf::realtime::Scheduling;
use valve_ebpf::{ArrivalCounts, ArrivalEdge, LaunchEdge, WatchedPort};

use crate::gate::policy::LaunchesBefore;

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
    /// Gaps between requests an earlier gate on the same online service learned, for the hold
    /// to start from ([`GatePolicy::seed_hold_history`](crate::gate::policy::GatePolicy::seed_hold_history)).
    HoldHistory(crate::gate::policy::HoldHistory),
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
    /// Whether the probes that see a watched `pid`'s launches are in: `Ok(false)` while its
    /// watch is still being applied (its launches are not seen yet), the error if that failed.
    /// Default: in as soon as it is watched.
    fn probes_attached(&mut self, _pid: u32) -> Result<bool, String> {
        Ok(true)
    }
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
    /// Offline is held frozen since `since_ns` (0: no longer): until the next
    /// [`LaunchSource::arm_resume`] after it, edges may reach the gate up to
    /// [`valve_ebpf::REQUEST_POLL`] late, which spares the launching thread the reader's wake-up.
    /// Errors are the source's to log (the edges then wake the gate as before).
    fn hold_edges(&self, _since_ns: u64) {}
    /// Edges of `pid` written while offline was held, so far (0 where the source does not
    /// count them): more than the gate has received means some are still on their way.
    fn quiet_edges(&self, _pid: u32) -> u64 {
        0
    }
    /// What `pid`'s counters say of its activity before an arrival at `ts_ns`. Default, from
    /// [`LaunchSource::last_launch_ns`] alone: that activity if it came before and no thread
    /// waits for GPU work, else busy.
    fn launches_before(&self, pid: u32, ts_ns: u64) -> LaunchesBefore {
        let counts = valve_ebpf::LaunchCounts {
            last_ns: self.last_launch_ns(pid),
            in_sync: u64::from(self.in_sync(pid)),
            ..valve_ebpf::LaunchCounts::default()
        };
        launches_before(&counts, ts_ns)
    }
}

/// What a process's launch counters say of its activity before an arrival at `ts_ns`:
/// - its latest edge came after the arrival and the activity before that edge did not: the
///   process was idle in between, so that activity is the last before the arrival;
/// - no activity since the arrival: the last one, unless a thread has been waiting for GPU work
///   since (busy);
/// - else it was active after the arrival within an edge gap of its previous activity: busy
///   (or it cannot be told, and is never taken for idle time).
pub fn launches_before(c: &valve_ebpf::LaunchCounts, ts_ns: u64) -> LaunchesBefore {
    if c.last_edge_ns > ts_ns && c.edge_prev_ns <= ts_ns {
        LaunchesBefore::Last(c.edge_prev_ns)
    } else if c.last_ns <= ts_ns && c.in_sync == 0 {
        LaunchesBefore::Last(c.last_ns)
    } else {
        LaunchesBefore::Busy
    }
}

/// The bare watcher (the gate uses [`crate::gate::watchers::GateWatchers`], which also tracks
/// when each process's probes are in; this one says "in" at once).
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
        probe_hits(&self.counts(pid))
    }
    fn arm_resume(&self, now_ns: u64) {
        if let Err(e) = valve_ebpf::LaunchWatcher::arm_resume(self, now_ns) {
            tracing::warn!("gate: {e}");
        }
    }
    fn hold_edges(&self, since_ns: u64) {
        if let Err(e) = valve_ebpf::LaunchWatcher::hold_edges(self, since_ns) {
            tracing::warn!("gate: {e}");
        }
    }
    fn quiet_edges(&self, pid: u32) -> u64 {
        self.counts(pid).quiet_edges
    }
    fn launches_before(&self, pid: u32, ts_ns: u64) -> LaunchesBefore {
        self.settled_counts(pid)
            .map_or(LaunchesBefore::Busy, |c| launches_before(&c, ts_ns))
    }
}

pub use valve_protocol::gate::ProbeHits;

/// The launch watcher's counts of a process as the gate's status reports them.
pub fn probe_hits(c: &valve_ebpf::LaunchCounts) -> ProbeHits {
    ProbeHits {
        kernel_launches: c.kernel_launches,
        graph_launches: c.graph_launches,
        syncs: c.syncs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use valve_ebpf::LaunchCounts;

    const MS: u64 = 1_000_000;

    #[test]
    fn the_counters_tell_an_arrival_after_idle_time_from_one_during_a_request() {
        use LaunchesBefore::{Busy, Last};
        // Idle since 100 ms, edge at 900 ms (the arrival's own first launch), busy since.
        let c = LaunchCounts {
            last_ns: 950 * MS,
            edge_prev_ns: 100 * MS,
            last_edge_ns: 900 * MS,
            ..LaunchCounts::default()
        };
        let waiting = LaunchCounts { in_sync: 1, ..c };
        // A process whose first launch came after the arrival: nothing before it.
        let first = LaunchCounts {
            last_ns: 5 * MS,
            last_edge_ns: 5 * MS,
            ..LaunchCounts::default()
        };
        let cases = [
            (&c, 899, Last(100 * MS), "its request's edge"),
            (&c, 920, Busy, "during the request"),
            (&c, 50, Busy, "before the activity that edge followed"),
            (&c, 960, Last(950 * MS), "nothing since"),
            (&waiting, 960, Busy, "a thread still waits"),
            (&waiting, 899, Last(100 * MS), "the wait came after"),
            (&first, 4, Last(0), "first launch after it"),
        ];
        for (counts, at_ms, want, why) in cases {
            assert_eq!(launches_before(counts, at_ms * MS), want, "{why}");
        }
    }
}
