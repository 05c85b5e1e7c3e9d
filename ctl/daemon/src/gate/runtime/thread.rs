//! The gate thread ([`spawn`]) and the daemon's handle on it ([`GateHandle`]): inputs in, status
//! and trace out, and a stop that waits for offline to run again but not for the probes.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use valve::controller::Controller;
use valve::driver::RmDriver;
use valve_ebpf::realtime::{self, Scheduling};

use super::input::{GateInput, LaunchSource};
use super::shared::{snapshot, ChannelSet, GateShared};
use super::state::GateRuntime;
use super::status::{GateStatus, ProbeState};
use crate::gate::policy::GateConfig;
use crate::gate::trace::TraceRecord;

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

    /// Where each online process's probes are, as the gate thread last published it (a copy of
    /// that map only: cheap enough to poll).
    pub fn probes(&self) -> std::collections::BTreeMap<u32, ProbeState> {
        let g = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        g.status.online_probes.clone()
    }

    /// Trace records after sequence number `after` (at most `limit`, oldest first).
    pub fn trace(&self, after: u64, limit: usize) -> Vec<TraceRecord> {
        self.shared.trace.since(after, limit)
    }

    /// What the thread shares (its trace stays readable after the gate stops).
    pub fn shared(&self) -> Arc<GateShared> {
        self.shared.clone()
    }

    /// The hold's gaps between requests as the gate left them (empty until it has stopped).
    pub fn hold_history(&self) -> crate::gate::policy::HoldHistory {
        self.shared.hold_history()
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
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;
    use std::time::Instant;

    use super::*;
    use crate::gate::runtime::fixtures::*;
    use valve::fake::FakeRm;

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
