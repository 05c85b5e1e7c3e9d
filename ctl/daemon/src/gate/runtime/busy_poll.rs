//! Busy polling (`--arrival-busy-poll`): while offline runs, the gate thread spins on its input
//! channel and on the arrival counters instead of sleeping, and takes each arrival once.

use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use valve::driver::RmDriver;
use valve::stats::monotonic_ns;
use valve_ebpf::ArrivalEdge;

use super::input::{GateInput, LaunchSource};
use super::state::GateRuntime;

impl<D: RmDriver, L: LaunchSource> GateRuntime<D, L> {
    /// Whether the thread spins now: with `--arrival-busy-poll`, while offline runs (an edge
    /// then has work to preempt). Starting to spin takes the ports' edge counts afresh, so
    /// edges counted while offline was stopped are not taken for new ones.
    pub(super) fn spins(&mut self) -> bool {
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
    pub(super) fn first_sight(&mut self, e: &ArrivalEdge) -> bool {
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
    pub(super) fn spin_for_input(
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
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::gate::runtime::fixtures::*;
    use crate::gate::runtime::spawn;
    use crate::gate::trace::TraceKind;
    use crate::gate::GateConfig;
    use valve::controller::Controller;
    use valve::fake::FakeRm;
    use valve_ebpf::{ArrivalCounts, WatchedPort};

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
}
