//! A CPU benchmark, not a test: online grows that reclaim 1-16 handles of 64 MiB (up to 1 GiB)
//! while gates start and stop and while other clients flood the control socket; prints p50/p99.
//!
//! Everything runs in this process on the fake RM: the daemon's loop, the pool thread, an online
//! and an offline pool client, a gate cycler and the flooders. A fake `gate start` spends
//! `VALVE_BENCH_GATE_START_MS` (default 250, what it took on the H100) attaching, on the gate
//! thread, as the real one does. Run it with
//! `cargo test -p valve-daemon --release --lib reclaim_queueing_bench -- --ignored --nocapture`;
//! `VALVE_BENCH_GROWS` (default 300) and `VALVE_BENCH_FLOODERS` (default 2) set its size, and
//! `VALVE_BENCH_FREEZER=socket` freezes through the control socket, as the pool did before the
//! fast lane (the comparison).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::json;
use valve::controller::Controller;
use valve::fake::FakeRm;

use super::tests::pool::{call, ids, offline_client, online_client, spawn_pool};
use super::tests::{fake_core, own_group, request, QueuedEvents};
use super::{bind, Lane, Server};
use crate::audit::Audit;
use crate::gate::{GateStarter, LaunchSource};
use crate::memory::reclaim::{DaemonLaneFreezer, DaemonSocketFreezer, FreezeReport, Freezer};

/// The benchmark's size, from the environment.
struct Settings {
    grows: usize,
    gate_start: Duration,
    flooders: usize,
    /// Freeze through the control socket instead of the fast lane.
    by_socket: bool,
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

impl Settings {
    fn from_env() -> Settings {
        Settings {
            grows: env_or("VALVE_BENCH_GROWS", 300) as usize,
            gate_start: Duration::from_millis(env_or("VALVE_BENCH_GATE_START_MS", 250)),
            flooders: env_or("VALVE_BENCH_FLOODERS", 2) as usize,
            by_socket: std::env::var("VALVE_BENCH_FREEZER").as_deref() == Ok("socket"),
        }
    }
}

/// A gate launch source that reports nothing.
struct NoLaunches;

impl LaunchSource for NoLaunches {
    fn watch(&mut self, _pid: u32) -> Result<(), String> {
        Ok(())
    }
    fn unwatch(&mut self, _pid: u32) {}
    fn last_launch_ns(&self, _pid: u32) -> u64 {
        0
    }
}

/// A gate starter that spends `delay` on the gate thread before it is ready, as attaching the
/// BPF programs does.
pub(crate) fn slow_starter(rm: &Arc<FakeRm>, delay: Duration) -> GateStarter {
    let rm = rm.clone();
    Arc::new(move |cfg| {
        let rm = rm.clone();
        crate::gate::runtime::spawn(cfg, move |_tx| {
            std::thread::sleep(delay);
            let ctl = Controller::with_driver(rm).map_err(|e| e.to_string())?;
            Ok((ctl, NoLaunches))
        })
    })
}

/// The daemon's loop on its own thread until `stop`, serving `lane`; this process is a CUDA
/// process with 4 channels in its registry. Returns once the control socket is bound.
fn spawn_daemon(
    dir: &Path,
    s: &Settings,
    stop: &Arc<AtomicBool>,
    lane: Lane,
) -> (JoinHandle<()>, PathBuf) {
    let socket = dir.join("valve.sock");
    let (dir, path, stop, delay) = (
        dir.to_path_buf(),
        socket.clone(),
        stop.clone(),
        s.gate_start,
    );
    let (ready_tx, ready_rx) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rm = Arc::new(FakeRm::host(1));
        let mut core = fake_core(&rm, &dir);
        core.set_gate_starter(slow_starter(&rm, delay));
        let me = std::process::id();
        for e in crate::core::tests::cuda_process(&rm, me, 0xc1d0_0042, &[0], 4) {
            core.on_event(&e);
        }
        let listener = bind(&path, own_group()).unwrap();
        let audit = Audit::log_only();
        let mut server = Server::new(&listener, own_group(), &audit).with_lane(lane);
        let events = QueuedEvents::default();
        ready_tx.send(()).unwrap();
        while !stop.load(Ordering::Relaxed) {
            server
                .step(&mut core, &events, Duration::from_millis(5))
                .unwrap();
        }
        core.shutdown();
    });
    ready_rx.recv().unwrap();
    (thread, socket)
}

/// Starts a gate (online: pid 1, offline: this process), lets it run, stops it, waits; until
/// `stop`. Returns the cycles done.
fn cycle_gates(socket: &Path, stop: &AtomicBool) -> u64 {
    let me = std::process::id();
    let start = format!(
        "{{\"op\":\"gate_start\",\"online\":[1],\"offline\":[{me}],\"realtime_priority\":0}}\n"
    );
    let mut cycles = 0;
    while !stop.load(Ordering::Relaxed) {
        let r = request(socket, &start);
        assert!(r.error.is_none(), "{r:?}");
        std::thread::sleep(Duration::from_millis(200));
        let r = request(socket, "{\"op\":\"gate_stop\"}\n");
        assert!(r.error.is_none(), "{r:?}");
        std::thread::sleep(Duration::from_millis(200));
        cycles += 1;
    }
    cycles
}

/// Bursts of 32 connections that each send a line that is no request and read the refusal;
/// until `stop`. Adds the requests sent to `sent`.
fn flood(socket: &Path, stop: &AtomicBool, sent: &AtomicU64) {
    while !stop.load(Ordering::Relaxed) {
        let conns: Vec<UnixStream> = (0..32)
            .filter_map(|_| UnixStream::connect(socket).ok())
            .collect();
        for c in &conns {
            let _ = (&*c).write_all(b"\x00 this is not a request {{{\n");
        }
        for c in conns {
            let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
            let mut buf = [0u8; 512];
            let _ = (&c).read(&mut buf);
            sent.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A freezer that records each freeze's round trip and how long it waited for the loop.
struct Recording {
    inner: Box<dyn Freezer>,
    freezes: Arc<Mutex<Vec<(Duration, Duration)>>>,
}

impl Freezer for Recording {
    fn freeze(&mut self, pid: u32) -> Result<FreezeReport, String> {
        let t0 = Instant::now();
        let r = self.inner.freeze(pid)?;
        let queued = Duration::from_micros(r.queued_us);
        self.freezes.lock().unwrap().push((t0.elapsed(), queued));
        Ok(r)
    }
    fn thaw(&mut self, pid: u32) -> Result<(), String> {
        self.inner.thaw(pid)
    }
}

/// Online grows of 1-16 handles, each taken back from offline; returns each grow's time.
fn grow_loop(pool: &Path, grows: usize) -> Vec<Duration> {
    let (off, held) = offline_client(pool, 16);
    let on = online_client(pool);
    let mut times = Vec::with_capacity(grows);
    for i in 0..grows {
        let k = 1 + (i * 7) % 16;
        let t0 = Instant::now();
        let grown = call(&on, json!({"op": "grow", "count": k}));
        times.push(t0.elapsed());
        assert_eq!(grown["reclaimed"].as_u64(), Some(k as u64), "{grown}");
        call(&on, json!({"op": "shrink", "handles": grown["handles"]}));
        let back = call(&off, json!({"op": "grow", "count": k}));
        held.lock().unwrap().extend(ids(&back["handles"]));
        std::thread::sleep(Duration::from_millis(10));
    }
    times
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[test]
#[ignore = "a benchmark: run with --release -- --ignored --nocapture"]
fn reclaim_queueing_bench() {
    let s = Settings::from_env();
    let dir = tempfile::tempdir().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (client, lane) = super::lane::lane().unwrap();
    let (daemon, socket) = spawn_daemon(dir.path(), &s, &stop, lane);
    let max_hold = Duration::from_secs(2);
    let freezer: Box<dyn Freezer> = if s.by_socket {
        let socket = socket.clone();
        Box::new(DaemonSocketFreezer { socket, max_hold })
    } else {
        Box::new(DaemonLaneFreezer {
            lane: client,
            max_hold,
        })
    };
    let freezes = Arc::new(Mutex::new(Vec::new()));
    let recording = Recording {
        inner: freezer,
        freezes: freezes.clone(),
    };
    let pool = spawn_pool(dir.path(), 16, &stop, Box::new(recording));
    let (load_stop, flooded) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let gates = {
        let (socket, load_stop) = (socket.clone(), load_stop.clone());
        std::thread::spawn(move || cycle_gates(&socket, &load_stop))
    };
    let flooders: Vec<_> = (0..s.flooders)
        .map(|_| {
            let (socket, load_stop, n) = (socket.clone(), load_stop.clone(), flooded.clone());
            std::thread::spawn(move || flood(&socket, &load_stop, &n))
        })
        .collect();
    let mut times = grow_loop(&dir.path().join("pool.sock"), s.grows);
    load_stop.store(true, Ordering::Relaxed);
    let cycles = gates.join().unwrap();
    for f in flooders {
        f.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    pool.join().unwrap();
    daemon.join().unwrap();
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let freezes = std::mem::take(&mut *freezes.lock().unwrap());
    let (mut trips, mut queued): (Vec<_>, Vec<_>) = freezes.into_iter().unzip();
    trips.sort();
    queued.sort();
    println!(
        "reclaim_queueing_bench (CPU, fake RM, not the hardware target; freezes by {}): {} grows \
         of 1-16 64 MiB handles, each reclaimed from offline: p50 {:.2} ms, p99 {:.2} ms, max \
         {:.2} ms; {cycles} gate start/stop cycles ({} ms starts), {} malformed requests from {} \
         flooders",
        if s.by_socket {
            "the control socket"
        } else {
            "the fast lane"
        },
        times.len(),
        ms(percentile(&times, 0.50)),
        ms(percentile(&times, 0.99)),
        ms(*times.last().unwrap()),
        s.gate_start.as_millis(),
        flooded.load(Ordering::Relaxed),
        s.flooders,
    );
    println!(
        "  their {} freezes: round trip p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms; waiting for \
         the loop (queued) p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        trips.len(),
        ms(percentile(&trips, 0.50)),
        ms(percentile(&trips, 0.99)),
        ms(*trips.last().unwrap()),
        ms(percentile(&queued, 0.50)),
        ms(percentile(&queued, 0.99)),
        ms(*queued.last().unwrap()),
    );
}
