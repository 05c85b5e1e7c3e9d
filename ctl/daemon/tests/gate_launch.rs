//! The gate thread end to end on CPU with the real launch program: uprobes on a fake libcuda
//! built here, this process as online, the in-memory RM as offline. An idle launch must freeze
//! offline; launches while it is held must reach the gate without waking it (quiet) and keep it
//! frozen; once online stops, the cooldown must release offline; and the first launch after that
//! must freeze it again at once, with a woken edge.

use std::sync::Arc;
use std::time::Duration;

use valve::fake::FakeRm;
use valve::Controller;
use valve_daemon::gate::runtime::spawn;
use valve_daemon::gate::{GateConfig, GateInput};
use valve_ebpf::{LaunchConfig, LaunchWatcher, REQUEST_POLL};

mod common;
use common::{offline_process, wait_until};

#[path = "../../../ebpf/tests/common/fake_cuda.rs"]
mod fake_cuda;
use fake_cuda::{call, fake_cuda};

#[test]
fn held_edges_keep_offline_frozen_without_waking_the_gate_and_a_resumed_one_wakes_it() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIP: uprobes need root");
        return;
    }
    let f = fake_cuda();
    let rm = Arc::new(FakeRm::host(1));
    let offline = offline_process(&rm, 4_000_002, 0xc1d0_0020);
    let cfg = GateConfig {
        fixed_cooldown: Some(Duration::from_millis(60)),
        waits: false,
        ..GateConfig::default()
    };
    let (rm2, library) = (rm.clone(), f.path.clone());
    let started = spawn(cfg, move |tx| {
        let w = LaunchWatcher::start_with(
            LaunchConfig {
                library,
                pids: Vec::new(),
                filter: true,
                edge_gap: Duration::from_millis(1),
                track_waits: false,
                realtime: None,
                poll_period: REQUEST_POLL,
            },
            move |e| {
                let _ = tx.send(GateInput::Edge(e));
            },
        )
        .map_err(|e| e.to_string())?;
        Ok((Controller::with_driver(rm2).map_err(|e| e.to_string())?, w))
    });
    let gate = match started {
        Ok(g) => g,
        Err(e) => {
            println!("SKIP: the launch program cannot load here: {e}");
            return;
        }
    };
    gate.send(GateInput::Offline(vec![offline]));
    gate.send(GateInput::Online([std::process::id()].into()));
    let idle_launch = || {
        std::thread::sleep(Duration::from_millis(3));
        call(&f, 1, 0);
    };
    // The probes come in within a poll period: launch until one freezes offline.
    assert!(
        wait_until(|| {
            idle_launch();
            rm.disabled().len() == 20
        }),
        "an idle launch freezes offline"
    );
    let before = gate.status();
    assert_eq!(before.quiet_edges, 0, "that edge woke the gate");
    // Held: each launch after a gap is still an edge, written quietly; offline stays frozen.
    for _ in 0..30 {
        idle_launch();
    }
    assert_eq!(rm.disabled().len(), 20, "held while online launches");
    assert!(
        wait_until(|| gate.status().quiet_edges >= 25),
        "held edges reach the gate: {:?}",
        gate.status()
    );
    // Online stops: released after the cooldown, having waited for nothing still on its way.
    assert!(wait_until(|| rm.disabled().is_empty()), "released");
    assert!(wait_until(|| gate.status().resumes == 1), "resume counted");
    let quiet = gate.status().quiet_edges;
    // The first launch after the resume freezes offline again, and it woke the gate.
    call(&f, 1, 0);
    assert!(
        wait_until(|| rm.disabled().len() == 20),
        "the resume's edge freezes offline"
    );
    assert!(wait_until(|| gate.status().preemptions == 2));
    assert_eq!(gate.status().quiet_edges, quiet, "it was not quiet");
    drop(gate);
    assert!(
        rm.disabled().is_empty(),
        "a stopped gate leaves offline running"
    );
}
