//! A CPU benchmark, not a test: online grows that reclaim 1-16 handles of 64 MiB (up to 1 GiB)
//! while gates start and stop and while other clients flood the control socket; prints p50/p99.
//!
//! Everything runs in this process on the fake RM: the daemon's loop, the pool thread, an online
//! and an offline pool client, a gate cycler and the flooders. A fake `gate start` spends
//! `VALVE_BENCH_GATE_START_MS` (default 250, what it took on the H100) attaching, on the gate
//! thread, as the real one does. Run it with
//! `cargo test -p valve-daemon --release --lib reclaim_queueing_bench -- --ignored --nocapture`;
//! `VALVE_BENCH_GROWS` (default 300) and `VALVE_BENCH_FLOODERS` (default 2) set its size.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valve::controller::Controller;
use valve::fake::FakeRm;
use valve_vmm::wire;

use super::tests::{fake_core, own_group, request, QueuedEvents};
use super::{bind, Server};
use crate::audit::Audit;
use crate::gate::{GateStarter, LaunchSource};
use crate::memory::ledger::tests::ledger;
use crate::memory::reclaim::{DaemonSocketFreezer, Freezer};
use crate::memory::server::PoolServer;

/// The benchmark's size, from the environment.
struct Settings {
    grows: usize,
    gate_start: Duration,
    flooders: usize,
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

/// The daemon's loop on its own thread until `stop`; this process is a CUDA process with 4
/// channels in its registry. Returns once the control socket is bound.
fn spawn_daemon(dir: &Path, s: &Settings, stop: &Arc<AtomicBool>) -> (JoinHandle<()>, PathBuf) {
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
        let mut server = Server::new(&listener, own_group(), &audit);
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

/// The pool on its own thread until `stop`: 16 handles of 64 MiB, freezing with `freezer`.
fn spawn_pool(dir: &Path, stop: &Arc<AtomicBool>, freezer: Box<dyn Freezer>) -> JoinHandle<()> {
    let listener = wire::listen(&dir.join("pool.sock")).unwrap();
    let mut server = PoolServer::new(
        ledger(64 * 17, 1 << 20),
        listener,
        Box::new(|_: &UnixStream| true),
        freezer,
        Duration::from_secs(1),
    );
    let stop = stop.clone();
    std::thread::spawn(move || server.run(&stop, Duration::from_millis(5)))
}

fn call(s: &UnixStream, v: Value) -> Value {
    wire::send(s, &v, &[]).unwrap();
    wire::recv(s).unwrap().unwrap().0
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

/// Registers an offline client that takes the whole pool and gives back the handles each
/// reclaim asks for at once. Returns its control connection and what it holds.
fn offline_client(pool: &Path) -> (UnixStream, Arc<Mutex<Vec<u64>>>) {
    let off = wire::connect(pool).unwrap();
    let reg = call(&off, json!({"op": "register", "role": "offline", "gpu": 0}));
    let grown = call(&off, json!({"op": "grow", "count": 16}));
    let held = Arc::new(Mutex::new(ids(&grown["handles"])));
    assert_eq!(held.lock().unwrap().len(), 16, "{grown}");
    let cb = wire::connect(pool).unwrap();
    let attach = json!({"op": "attach", "client": reg["client"], "token": reg["token"]});
    assert_eq!(call(&cb, attach)["ok"], true);
    let held2 = held.clone();
    std::thread::spawn(move || {
        while let Ok(Some((req, _))) = wire::recv(&cb) {
            let k = req["count"].as_u64().unwrap() as usize;
            let give: Vec<u64> = held2.lock().unwrap().drain(..k).collect();
            let answer = json!({"rid": req["rid"], "ok": true, "handles": give});
            if wire::send(&cb, &answer, &[]).is_err() {
                return;
            }
        }
    });
    (off, held)
}

/// Online grows of 1-16 handles, each taken back from offline; returns each grow's time.
fn grow_loop(pool: &Path, grows: usize) -> Vec<Duration> {
    let (off, held) = offline_client(pool);
    let on = wire::connect(pool).unwrap();
    let reg = call(
        &on,
        json!({"op": "register", "role": "online", "gpu": 0, "premap": false}),
    );
    assert_eq!(reg["ok"], true, "{reg}");
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
    let (daemon, socket) = spawn_daemon(dir.path(), &s, &stop);
    let freezer = Box::new(DaemonSocketFreezer {
        socket: socket.clone(),
        max_hold: Duration::from_secs(2),
    });
    let pool = spawn_pool(dir.path(), &stop, freezer);
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
    println!(
        "reclaim_queueing_bench (CPU, fake RM, not the hardware target): {} grows of 1-16 \
         64 MiB handles, each reclaimed from offline: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; \
         {cycles} gate start/stop cycles ({} ms starts), {} malformed requests from {} flooders",
        times.len(),
        ms(percentile(&times, 0.50)),
        ms(percentile(&times, 0.99)),
        ms(*times.last().unwrap()),
        s.gate_start.as_millis(),
        flooded.load(Ordering::Relaxed),
        s.flooders,
    );
}
