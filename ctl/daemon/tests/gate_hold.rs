//! The gate's hold end to end on CPU with both real programs: uprobes on a fake libcuda built
//! here (this process is online), the arrival program on loopback, the in-memory RM as offline.
//! A request queued behind one that is running while offline is frozen must not count as an
//! idle arrival (the gate hears no edge during a request; the launch counters say it was busy);
//! one after idle time within the hold must count as idle and caught.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use valve::fake::FakeRm;
use valve::Controller;
use valve_daemon::gate::policy::{HoldHistory, LaunchesBefore};
use valve_daemon::gate::runtime::spawn;
use valve_daemon::gate::{GateConfig, GateInput, LaunchSource};
use valve_ebpf::{
    ArrivalConfig, ArrivalCounts, ArrivalWatcher, LaunchConfig, LaunchWatcher, WatchedPort,
    REQUEST_POLL,
};

mod common;
use common::{offline_process, wait_until};

#[path = "../../../ebpf/tests/common/fake_cuda.rs"]
mod fake_cuda;
use fake_cuda::{call, fake_cuda};

/// Launches from the launch program, arrivals from the arrival program.
struct Both {
    launch: LaunchWatcher,
    arrival: ArrivalWatcher,
}

impl LaunchSource for Both {
    fn watch(&mut self, pid: u32) -> Result<(), String> {
        LaunchSource::watch(&mut self.launch, pid)
    }
    fn unwatch(&mut self, pid: u32) {
        LaunchSource::unwatch(&mut self.launch, pid);
    }
    fn last_launch_ns(&self, pid: u32) -> u64 {
        LaunchSource::last_launch_ns(&self.launch, pid)
    }
    fn arm_resume(&self, now_ns: u64) {
        LaunchSource::arm_resume(&self.launch, now_ns);
    }
    fn hold_edges(&self, since_ns: u64) {
        LaunchSource::hold_edges(&self.launch, since_ns);
    }
    fn quiet_edges(&self, pid: u32) -> u64 {
        LaunchSource::quiet_edges(&self.launch, pid)
    }
    fn launches_before(&self, pid: u32, ts_ns: u64) -> LaunchesBefore {
        LaunchSource::launches_before(&self.launch, pid, ts_ns)
    }
    fn watch_port(&mut self, port: WatchedPort) -> Result<(), String> {
        self.arrival.watch_port(port).map_err(|e| e.to_string())
    }
    fn unwatch_port(&mut self, port: u16) {
        self.arrival.unwatch_port(port);
    }
    fn arrival_counts(&self, port: u16) -> ArrivalCounts {
        self.arrival.counts(port)
    }
}

/// Request data on `port`, read by the server side.
fn request(online: &TcpListener, port: u16) {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (mut s, _) = online.accept().unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\n\r\n{}")
        .unwrap();
    let _ = s.read(&mut [0u8; 64]).unwrap();
}

#[test]
fn a_request_queued_behind_a_running_one_is_no_idle_arrival_and_one_after_idle_time_is_caught() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIP: uprobes and the arrival program need root");
        return;
    }
    let f = fake_cuda();
    let rm = Arc::new(FakeRm::host(1));
    let offline = offline_process(&rm, 4_000_003, 0xc1d0_0030);
    let online = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = online.local_addr().unwrap().port();
    let cfg = GateConfig {
        cooldown_ceiling: Duration::from_millis(50),
        hold_budget: Some(0.1),
        waits: false,
        ..GateConfig::default()
    };
    let (rm2, library) = (rm.clone(), f.path.clone());
    let started = spawn(cfg, move |tx| {
        let edges = tx.clone();
        let launch = LaunchWatcher::start_with(
            LaunchConfig {
                library,
                pids: Vec::new(),
                filter: true,
                edge_gap: Duration::from_millis(5),
                track_waits: false,
                realtime: None,
                poll_period: REQUEST_POLL,
            },
            move |e| {
                let _ = edges.send(GateInput::Edge(e));
            },
        )
        .map_err(|e| e.to_string())?;
        let arrival = ArrivalWatcher::start_with(ArrivalConfig::default(), move |e| {
            let _ = tx.send(GateInput::Arrival(e));
        })
        .map_err(|e| e.to_string())?;
        Ok((
            Controller::with_driver(rm2).map_err(|e| e.to_string())?,
            Both { launch, arrival },
        ))
    });
    let gate = match started {
        Ok(g) => g,
        Err(e) => {
            println!("SKIP: the programs cannot load here: {e}");
            return;
        }
    };
    gate.send(GateInput::Offline(vec![offline]));
    gate.send(GateInput::Online([std::process::id()].into()));
    gate.send(GateInput::Ports([WatchedPort { port, netns: 0 }].into()));
    // A history whose hold is about 2 s (36 gaps of 0.5 s, 4 of 60 s, 10% of their sum).
    let gaps = (0..40)
        .map(|i| if i % 10 == 9 { 60_000 } else { 500 } * 1_000_000)
        .collect();
    gate.send(GateInput::HoldHistory(HoldHistory {
        gaps,
        last_activity_ns: None,
    }));
    assert!(
        wait_until(|| gate.status().hold_us > 1e6),
        "the seeded hold is chosen"
    );
    // The probes come in within a poll period: launch until an idle launch freezes offline.
    assert!(
        wait_until(|| {
            std::thread::sleep(Duration::from_millis(10));
            call(&f, 1, 0);
            rm.disabled().len() == 20
        }),
        "an idle launch freezes offline"
    );
    // A request running for about 150 ms (a launch each millisecond: no edge), a second one
    // arriving 100 ms into it: queued, not idle.
    for i in 0..150 {
        if i == 100 {
            request(&online, port);
        }
        call(&f, 1, 0);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(wait_until(|| gate.status().arrivals == 1), "arrival seen");
    let st = gate.status();
    assert_eq!(
        (st.arrivals_idle, st.arrivals_held),
        (0, 0),
        "queued behind a running request"
    );
    // 150 ms after the request's last launch: past the 50-ms cooldown, within the hold.
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(rm.disabled().len(), 20, "the hold keeps offline frozen");
    request(&online, port);
    assert!(wait_until(|| gate.status().arrivals == 2), "arrival seen");
    let st = gate.status();
    assert_eq!((st.arrivals_idle, st.arrivals_held), (1, 1), "caught");
    let (st, err) = gate.stop();
    assert!(err.is_none() && !st.running);
    assert!(rm.disabled().is_empty(), "offline resumed at the stop");
}
