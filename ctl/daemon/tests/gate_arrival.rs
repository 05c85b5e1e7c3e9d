//! The gate thread end to end on CPU: the real arrival program on loopback drives a gate whose
//! controller is the in-memory RM. Data sent to the online port must freeze the offline channels
//! before any launch; data to another port must not; the trace must show the arrival, then the
//! disable, then after the cooldown the enable.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use valve::fake::FakeRm;
use valve::Controller;
use valve_daemon::gate::runtime::spawn;
use valve_daemon::gate::{GateConfig, GateInput, LaunchSource, TraceKind};
use valve_ebpf::{ArrivalConfig, ArrivalCounts, ArrivalWatcher, WatchedPort};

mod common;
use common::{offline_process, wait_until};

/// Arrivals from the real program; no launches (there is no libcuda here).
struct ArrivalsOnly(ArrivalWatcher);

impl LaunchSource for ArrivalsOnly {
    fn watch(&mut self, _pid: u32) -> Result<(), String> {
        Ok(())
    }
    fn unwatch(&mut self, _pid: u32) {}
    fn last_launch_ns(&self, _pid: u32) -> u64 {
        0
    }
    fn watch_port(&mut self, port: WatchedPort) -> Result<(), String> {
        self.0.watch_port(port).map_err(|e| e.to_string())
    }
    fn unwatch_port(&mut self, port: u16) {
        self.0.unwatch_port(port);
    }
    fn arrival_counts(&self, port: u16) -> ArrivalCounts {
        self.0.counts(port)
    }
}

#[test]
fn request_data_on_the_online_port_freezes_offline_and_the_cooldown_releases_it() {
    freeze_on_arrival_and_release(false);
}

/// `--arrival-busy-poll`: the watcher's ring buffer edges are thrown away here, so only the
/// gate thread's polling of the program's counters can see the request.
#[test]
fn a_busy_polling_gate_sees_the_request_in_the_programs_counters() {
    freeze_on_arrival_and_release(true);
}

fn freeze_on_arrival_and_release(busy_poll: bool) {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIP: BPF needs root");
        return;
    }
    let rm = Arc::new(FakeRm::host(1));
    let offline = offline_process(&rm, 4_000_001, 0xc1d0_0010);
    let online = TcpListener::bind("127.0.0.1:0").unwrap();
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = online.local_addr().unwrap().port();
    let cfg = GateConfig {
        cooldown_ceiling: Duration::from_millis(100),
        arrival_busy_poll: busy_poll,
        ..GateConfig::default()
    };
    let rm2 = rm.clone();
    let started = spawn(cfg, move |tx| {
        let w = ArrivalWatcher::start_with(ArrivalConfig::default(), move |e| {
            if !busy_poll {
                let _ = tx.send(GateInput::Arrival(e));
            }
        })
        .map_err(|e| e.to_string())?;
        Ok((
            Controller::with_driver(rm2).map_err(|e| e.to_string())?,
            ArrivalsOnly(w),
        ))
    });
    let gate = match started {
        Ok(g) => g,
        Err(e) => {
            println!("SKIP: the arrival program cannot load here: {e}");
            return;
        }
    };
    gate.send(GateInput::Offline(vec![offline]));
    gate.send(GateInput::Ports([WatchedPort { port, netns: 0 }].into()));
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    gate.send(GateInput::Sync(tx));
    rx.recv_timeout(Duration::from_secs(2)).unwrap();

    // Data to another port: nothing.
    let mut c = TcpStream::connect(other.local_addr().unwrap()).unwrap();
    let (mut s, _) = other.accept().unwrap();
    c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut buf = [0u8; 64];
    let _ = s.read(&mut buf).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(rm.disabled().is_empty());

    // A request to the online port: offline frozen, with no launch at all.
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (mut s, _) = online.accept().unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\n\r\n{}")
        .unwrap();
    assert!(
        wait_until(|| rm.disabled().len() == 20),
        "frozen on arrival"
    );
    let _ = s.read(&mut buf).unwrap();
    // No launch follows: released once the arrival hold (the 100 ms ceiling) has passed.
    assert!(wait_until(|| rm.disabled().is_empty()), "released");
    // The resume is counted just after the enable returns: wait for it rather than race it.
    assert!(wait_until(|| gate.status().resumes == 1), "resume counted");
    let st = gate.status();
    assert_eq!((st.arrivals, st.preemptions, st.resumes), (1, 1, 1));
    // Counted for the daemon, which looks an unknown listener up on it.
    assert_eq!(gate.shared().arrivals_taken(), 1);
    assert_eq!(st.arrival_to_disable_us.n, 1);
    let kinds: Vec<TraceKind> = gate.trace(0, 100).iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        vec![
            TraceKind::Arrival,
            TraceKind::Disable,
            TraceKind::Cooldown,
            TraceKind::Enable
        ]
    );
    let t = gate.trace(0, 100);
    assert_eq!(t[0].id, u32::from(port));
    assert!(t[0].t_ns <= t[1].t_ns && t[1].t_ns <= t[1].a, "{t:?}");
    assert!(
        t[3].t_ns - t[0].t_ns >= 100_000_000,
        "held for the hold: {t:?}"
    );
    let (st, err) = gate.stop();
    assert!(err.is_none() && !st.running);
}
