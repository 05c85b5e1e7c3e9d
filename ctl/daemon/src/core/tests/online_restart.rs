//! A server restarted on a watched `--online-port`: the first arrival on the port whose
//! listener is unknown makes the next refresh look the listener up, so the new server is online
//! (and probed) at once instead of at the next scan a second later.

use std::net::TcpListener;

use super::*;
use crate::gate::{GateInput, Rescan};
use crate::protocol::GateSpec;
use valve_ebpf::ArrivalEdge;

fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

#[test]
fn an_arrival_on_a_port_without_a_known_listener_looks_the_listener_up_at_once() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut c = core(&rm, dir.path(), None);
    let (starter, edges) = fake_starter(&rm, false);
    c.set_gate_starter(starter);
    // Offline: pid 1 (alive) with channels; online: whoever listens on the port.
    for e in cuda_process(&rm, 1, 0xc1d0_0010, &[0], 4) {
        c.on_event(&e);
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spec = GateSpec {
        online_ports: vec![port],
        offline: vec![1],
        ..Default::default()
    };
    let r = c.handle(Request::GateStart(Box::new(spec)));
    assert!(r.error.is_none(), "{r:?}");
    let me = std::process::id();
    let online = |c: &DaemonCore<Arc<FakeRm>>| c.gate.as_ref().unwrap().online().clone();
    assert!(online(&c).is_empty(), "nobody listens yet");
    // The server comes (back) on the port: the label cadence alone would not see it yet.
    let _server = TcpListener::bind(("127.0.0.1", port)).unwrap();
    c.refresh_gate(Instant::now(), Rescan::IfDue);
    assert!(
        online(&c).is_empty(),
        "not due: the lookup must come from the arrival"
    );
    let tx = edges.lock().unwrap().clone().expect("gate thread running");
    tx.send(GateInput::Arrival(ArrivalEdge {
        port,
        netns: 0,
        ts_ns: now_ns(),
        idle_ns: 0,
        read_ns: 0,
    }))
    .unwrap();
    let shared = c.gate.as_ref().unwrap().shared();
    wait_for("the gate thread takes the arrival", || {
        shared.arrivals_taken() == 1
    });
    c.refresh_gate(Instant::now(), Rescan::IfDue);
    assert_eq!(
        online(&c),
        BTreeSet::from([me]),
        "the new listener is online at once"
    );
    // Another arrival with the listener known does not make the loop scan /proc again: the
    // set stays as it is even though the listener is gone now.
    drop(_server);
    tx.send(GateInput::Arrival(ArrivalEdge {
        port,
        netns: 0,
        ts_ns: now_ns(),
        idle_ns: 0,
        read_ns: 0,
    }))
    .unwrap();
    wait_for("the second arrival", || shared.arrivals_taken() == 2);
    c.refresh_gate(Instant::now(), Rescan::IfDue);
    assert_eq!(online(&c), BTreeSet::from([me]));
    assert!(c.handle(Request::GateStop).error.is_none());
}
