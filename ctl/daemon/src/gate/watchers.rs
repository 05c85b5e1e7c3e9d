//! The gate's BPF watchers (libcuda uprobes, the arrival program) and the keeper that holds them
//! from one gate to the next, so that `gate stop` + `gate start` does not probe libcuda again.
//!
//! Why keep them: every uprobe registration or removal takes the mmap write lock of every
//! process that maps libcuda, offline jobs included, and a global lock that waits for an RCU grace
//! period. On the H100 beside a busy transformers job that made each `gate start` take 6-12 s and
//! held offline's memory calls (its answer to a reclaim) behind it: grows reclaiming during a gate
//! restart took up to 53 ms. Kept watchers make a restart a few map updates.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use valve::controller::Controller;
use valve::driver::NvDriver;
use valve_ebpf::{ArrivalEdge, ProbeAck, WatchedPort};

use super::policy::GateConfig;
use super::runtime::{self, GateHandle, GateInput, LaunchSource, ProbeHits};
use super::supervisor::{GateStarter, GATE_EDGE_GAP};

/// Where the watchers' edges go: the running gate thread's inputs, or nowhere between gates.
/// Each watcher thread holds a [`RouteReader`]; pointing the route elsewhere sends every reader
/// the new target, so an edge costs a `try_recv` on an empty channel, no lock.
#[derive(Default)]
pub struct Route(Vec<Sender<Option<Sender<GateInput>>>>);

impl Route {
    /// A reader for one watcher thread's sink.
    fn reader(&mut self) -> RouteReader {
        let (tx, rx) = std::sync::mpsc::channel();
        self.0.push(tx);
        RouteReader {
            updates: rx,
            to: None,
        }
    }

    /// Points the edges at `tx` (`None`: drops them).
    pub fn set(&self, tx: Option<Sender<GateInput>>) {
        for r in &self.0 {
            let _ = r.send(tx.clone());
        }
    }
}

/// One watcher thread's end of a [`Route`].
struct RouteReader {
    updates: Receiver<Option<Sender<GateInput>>>,
    to: Option<Sender<GateInput>>,
}

impl RouteReader {
    /// Sends `input` to the gate thread the route points at now, if any.
    fn send(&mut self, input: GateInput) {
        while let Ok(to) = self.updates.try_recv() {
            self.to = to;
        }
        if let Some(tx) = &self.to {
            let _ = tx.send(input);
        }
    }
}

/// One value kept under a key for the next taker with the same key, for at most `keep`.
pub struct Keeper<K, T> {
    slot: Mutex<Option<(K, T, Instant)>>,
    keep: Duration,
}

impl<K: PartialEq, T> Keeper<K, T> {
    /// An empty keeper that keeps a value for at most `keep`.
    pub fn new(keep: Duration) -> Self {
        Keeper {
            slot: Mutex::new(None),
            keep,
        }
    }

    /// The kept value if its key is `key` and it is not older than `keep`; anything else kept is
    /// dropped (a gate with other settings needs other watchers).
    pub fn take(&self, key: &K) -> Option<T> {
        let kept = self.lock().take()?;
        (kept.0 == *key && kept.2.elapsed() <= self.keep).then_some(kept.1)
    }

    /// Keeps `value` (dropping what was kept before).
    pub fn put(&self, key: K, value: T) {
        *self.lock() = Some((key, value, Instant::now()));
    }

    /// Drops the kept value if it has been kept longer than `keep`; whether it did.
    pub fn expire(&self) -> bool {
        let mut slot = self.lock();
        let old = slot.as_ref().is_some_and(|k| k.2.elapsed() > self.keep);
        if old {
            *slot = None;
        }
        old
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(K, T, Instant)>> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What makes watchers fit a gate: the settings they were started with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WatcherKey {
    arrivals: bool,
    waits: bool,
    realtime: Option<u8>,
}

impl WatcherKey {
    fn of(cfg: &GateConfig) -> Self {
        WatcherKey {
            arrivals: cfg.arrivals,
            waits: cfg.waits,
            realtime: cfg.realtime,
        }
    }
}

/// The BPF watchers themselves and where their edges go.
pub struct Watchers {
    launch: valve_ebpf::LaunchWatcher,
    arrival: Option<valve_ebpf::ArrivalWatcher>,
    route: Route,
}

type WatcherKeeper = Keeper<WatcherKey, Watchers>;

/// The real watchers of one gate: uprobes on libcuda for launches, and (unless arrivals are off)
/// the `sk_data_ready` program for request arrivals on the online ports. Dropped with the gate
/// thread, they go back to the keeper with nothing watched.
pub struct GateWatchers {
    inner: Option<Watchers>,
    key: WatcherKey,
    /// Where the watchers go when the gate ends (`None`: not kept, their probes go).
    keeper: Option<Arc<WatcherKeeper>>,
    pids: BTreeSet<u32>,
    ports: BTreeSet<u16>,
    acks: Acks,
}

/// What the launch watcher's poll thread answered about the watched pids' probes.
#[derive(Default)]
struct Acks {
    /// Pids whose probes it has not confirmed yet, and where its answer comes.
    attaching: BTreeMap<u32, ProbeAck>,
    /// Pids whose probes failed to attach, and why.
    failed: BTreeMap<u32, String>,
}

impl Acks {
    /// `pid` is watched anew: its probes are in once `ack` says so.
    fn expect(&mut self, pid: u32, ack: ProbeAck) {
        self.failed.remove(&pid);
        self.attaching.insert(pid, ack);
    }

    fn forget(&mut self, pid: u32) {
        self.attaching.remove(&pid);
        self.failed.remove(&pid);
    }

    /// [`LaunchSource::probes_attached`] for a watched `pid`.
    fn attached(&mut self, pid: u32) -> Result<bool, String> {
        if let Some(e) = self.failed.get(&pid) {
            return Err(e.clone());
        }
        let Some(ack) = self.attaching.get(&pid) else {
            return Ok(true);
        };
        let done = match ack.try_recv() {
            Err(TryRecvError::Empty) => return Ok(false),
            Ok(done) => done,
            Err(TryRecvError::Disconnected) => Err("the launch-watch thread has ended".into()),
        };
        self.attaching.remove(&pid);
        if let Err(e) = &done {
            self.failed.insert(pid, e.clone());
        }
        done.map(|()| true)
    }
}

impl GateWatchers {
    fn w(&self) -> &Watchers {
        self.inner
            .as_ref()
            .expect("watchers are taken only on drop")
    }
}

impl Drop for GateWatchers {
    fn drop(&mut self) {
        let (Some(w), Some(keeper)) = (self.inner.take(), self.keeper.take()) else {
            return;
        };
        w.route.set(None);
        for &pid in &self.pids {
            w.launch.mute(pid);
        }
        if let Some(a) = &w.arrival {
            for &port in &self.ports {
                a.unwatch_port(port);
            }
        }
        let _ = w.launch.arm_resume(0);
        // The next gate to take these watchers starts with offline running.
        let _ = w.launch.hold_edges(0);
        let keep = keeper.keep;
        keeper.put(self.key, w);
        let keeper = Arc::downgrade(&keeper);
        // Probes nobody took go after `keep`; each stop's thread checks for its own watchers.
        let _ = std::thread::Builder::new()
            .name("valve-watch-keep".into())
            .spawn(move || {
                std::thread::sleep(keep + Duration::from_secs(1));
                if let Some(k) = keeper.upgrade() {
                    if k.expire() {
                        tracing::info!("a stopped gate's uprobes are removed (kept {keep:?})");
                    }
                }
            });
    }
}

impl LaunchSource for GateWatchers {
    fn watch(&mut self, pid: u32) -> Result<(), String> {
        self.pids.insert(pid);
        match self.w().launch.watch_acked(pid) {
            Ok(ack) => {
                self.acks.expect(pid, ack);
                Ok(())
            }
            Err(e) => {
                self.acks.failed.insert(pid, e.to_string());
                Err(e.to_string())
            }
        }
    }
    fn unwatch(&mut self, pid: u32) {
        self.pids.remove(&pid);
        self.acks.forget(pid);
        self.w().launch.unwatch(pid);
    }
    fn probes_attached(&mut self, pid: u32) -> Result<bool, String> {
        self.acks.attached(pid)
    }
    fn last_launch_ns(&self, pid: u32) -> u64 {
        self.w().launch.counts(pid).last_ns
    }
    fn in_sync(&self, pid: u32) -> bool {
        self.w().launch.counts(pid).in_sync > 0
    }
    fn last_wait_end_ns(&self, pid: u32) -> u64 {
        self.w().launch.counts(pid).sync_end_ns
    }
    fn probe_hits(&self, pid: u32) -> ProbeHits {
        super::runtime::probe_hits(&self.w().launch.counts(pid))
    }
    fn watch_port(&mut self, port: WatchedPort) -> Result<(), String> {
        self.ports.insert(port.port);
        match &self.w().arrival {
            Some(a) => a.watch_port(port).map_err(|e| e.to_string()),
            None => Err("arrivals are off (--no-arrivals)".into()),
        }
    }
    fn unwatch_port(&mut self, port: u16) {
        self.ports.remove(&port);
        if let Some(a) = &self.w().arrival {
            a.unwatch_port(port);
        }
    }
    fn arrival_counts(&self, port: u16) -> valve_ebpf::ArrivalCounts {
        self.w()
            .arrival
            .as_ref()
            .map_or_else(Default::default, |a| a.counts(port))
    }
    fn arm_resume(&self, now_ns: u64) {
        LaunchSource::arm_resume(&self.w().launch, now_ns);
    }
    fn hold_edges(&self, since_ns: u64) {
        LaunchSource::hold_edges(&self.w().launch, since_ns);
    }
    fn quiet_edges(&self, pid: u32) -> u64 {
        LaunchSource::quiet_edges(&self.w().launch, pid)
    }
    fn launches_before(&self, pid: u32, ts_ns: u64) -> crate::gate::policy::LaunchesBefore {
        LaunchSource::launches_before(&self.w().launch, pid, ts_ns)
    }
    fn scheduling(&self) -> Vec<(&'static str, valve_ebpf::Scheduling)> {
        let w = self.w();
        let mut v = vec![("launch-watch", w.launch.scheduling().clone())];
        if let Some(a) = &w.arrival {
            v.push(("arrival-watch", a.scheduling().clone()));
        }
        v
    }
}

/// Starts new watchers whose edges go to `route`.
fn start_watchers(cfg: &GateConfig, mut route: Route) -> Result<Watchers, String> {
    let arrival = if cfg.arrivals {
        let mut r = route.reader();
        let w = valve_ebpf::ArrivalWatcher::start_with(
            valve_ebpf::ArrivalConfig {
                ports: Vec::new(),
                edge_gap: GATE_EDGE_GAP,
                realtime: cfg.realtime,
            },
            move |e| {
                let read_ns = runtime::monotonic_ns();
                r.send(GateInput::Arrival(ArrivalEdge { read_ns, ..e }));
            },
        )
        .map_err(|e| format!("attaching the arrival program (tp_btf/sk_data_ready): {e}"))?;
        Some(w)
    } else {
        None
    };
    let library = valve_ebpf::find_libcuda().ok_or(
        "libcuda.so.1 not found (ldconfig -p, /usr/local/nvidia/lib64, /usr/lib/x86_64-linux-gnu): \
         the gate watches online launches with uprobes on it",
    )?;
    let mut r = route.reader();
    let launch = valve_ebpf::LaunchWatcher::start_with(
        valve_ebpf::LaunchConfig {
            library,
            pids: Vec::new(),
            filter: true,
            edge_gap: GATE_EDGE_GAP,
            track_waits: cfg.waits,
            realtime: cfg.realtime,
            poll_period: valve_ebpf::REQUEST_POLL,
        },
        move |e| r.send(GateInput::Edge(e)),
    )
    .map_err(|e| format!("attaching uprobes to libcuda: {e}"))?;
    Ok(Watchers {
        launch,
        arrival,
        route,
    })
}

/// The daemon's gate starter: each gate thread gets its own RM client, and the watchers the last
/// gate left within `keep` if they were started with the same settings, else new ones (`keep`
/// zero: always new ones, dropped with their gate).
pub fn real_gate_starter(keep: Duration) -> GateStarter {
    let keeper: Option<Arc<WatcherKeeper>> = (!keep.is_zero()).then(|| Arc::new(Keeper::new(keep)));
    Arc::new(move |cfg: GateConfig| -> Result<GateHandle, String> {
        let keeper = keeper.clone();
        runtime::spawn(cfg, move |tx| {
            // Where the start's time went: a start beside busy jobs took seconds on the H100.
            let t0 = Instant::now();
            let key = WatcherKey::of(&cfg);
            let kept = keeper.as_ref().and_then(|k| k.take(&key));
            let was_kept = kept.is_some();
            let inner = match kept {
                Some(w) => w,
                None => start_watchers(&cfg, Route::default())?,
            };
            inner.route.set(Some(tx));
            let watchers_us = t0.elapsed().as_micros() as u64;
            let multi_links = inner.launch.multi_links();
            let watchers = GateWatchers {
                inner: Some(inner),
                key,
                keeper,
                pids: BTreeSet::new(),
                ports: BTreeSet::new(),
                acks: Acks::default(),
            };
            // On an error here the watchers go back to the keeper with the drop.
            let ctl =
                Controller::<NvDriver>::open().map_err(|e| format!("opening the driver: {e}"))?;
            tracing::info!(
                watchers_kept = was_kept,
                watchers_us,
                uprobe_multi_links = multi_links,
                rm_client_us = t0.elapsed().as_micros() as u64 - watchers_us,
                "gate thread's start"
            );
            Ok((ctl, watchers))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_value_goes_to_the_next_taker_with_the_same_key_only() {
        let k: Keeper<u8, &str> = Keeper::new(Duration::from_secs(60));
        assert_eq!(k.take(&1), None);
        k.put(1, "watchers");
        assert_eq!(k.take(&2), None, "other settings: not these watchers");
        assert_eq!(k.take(&1), None, "a mismatched take drops what was kept");
        k.put(1, "watchers");
        assert_eq!(k.take(&1), Some("watchers"));
        assert_eq!(k.take(&1), None, "taken once");
    }

    #[test]
    fn a_kept_value_expires() {
        let k: Keeper<u8, &str> = Keeper::new(Duration::from_millis(20));
        k.put(1, "watchers");
        assert!(!k.expire(), "young");
        std::thread::sleep(Duration::from_millis(30));
        assert!(k.expire(), "old: dropped");
        assert!(!k.expire(), "nothing left");
        k.put(1, "watchers");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(k.take(&1), None, "too old to take");
    }

    #[test]
    fn a_route_sends_to_the_gate_it_points_at_and_drops_between_gates() {
        let mut route = Route::default();
        let (mut r, mut other) = (route.reader(), route.reader());
        r.send(GateInput::Busy); // nowhere: dropped, no panic
        let (tx, rx) = std::sync::mpsc::channel();
        route.set(Some(tx));
        other.send(GateInput::Busy);
        assert!(matches!(rx.try_recv(), Ok(GateInput::Busy)));
        route.set(None);
        r.send(GateInput::Idle);
        assert!(
            rx.try_recv().is_err(),
            "the old gate gets nothing once its route is cleared"
        );
    }

    #[test]
    fn probes_are_attached_once_the_poll_thread_says_so() {
        let mut acks = Acks::default();
        let (tx, rx) = std::sync::mpsc::channel();
        acks.expect(1, rx);
        assert_eq!(acks.attached(1), Ok(false), "not applied yet");
        tx.send(Ok(())).unwrap();
        assert_eq!(acks.attached(1), Ok(true));
        assert_eq!(acks.attached(1), Ok(true), "and stays so");
        let (tx, rx) = std::sync::mpsc::channel();
        acks.expect(2, rx);
        tx.send(Err("ESRCH".into())).unwrap();
        assert_eq!(acks.attached(2), Err("ESRCH".into()));
        assert_eq!(acks.attached(2), Err("ESRCH".into()), "a failure is kept");
        let (tx, rx) = std::sync::mpsc::channel();
        acks.expect(2, rx);
        assert_eq!(acks.attached(2), Ok(false), "watched again: asked again");
        drop(tx);
        assert!(acks.attached(2).is_err(), "the poll thread ended");
    }

    #[test]
    fn watchers_fit_a_gate_with_the_same_probe_settings_only() {
        let cfg = GateConfig::default();
        let same = GateConfig {
            gap_factor: cfg.gap_factor * 2.0,
            ..cfg
        };
        assert_eq!(
            WatcherKey::of(&cfg),
            WatcherKey::of(&same),
            "tuning is not probing"
        );
        let no_waits = GateConfig {
            waits: !cfg.waits,
            ..cfg
        };
        assert_ne!(WatcherKey::of(&cfg), WatcherKey::of(&no_waits));
        let no_arrivals = GateConfig {
            arrivals: !cfg.arrivals,
            ..cfg
        };
        assert_ne!(WatcherKey::of(&cfg), WatcherKey::of(&no_arrivals));
    }
}
