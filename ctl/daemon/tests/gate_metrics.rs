//! The gate thread's metrics (its own test binary: the gate records into the process-wide
//! metrics that `valve_daemon::metrics::install_for_gate` sets, which no other test may touch).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use valve::controller::Controller;
use valve::fake::FakeRm;
use valve::state::DisabledRecord;
use valve_daemon::gate::runtime::{monotonic_ns, GateShared};
use valve_daemon::gate::{GateConfig, GateInput, GateRuntime, LaunchSource};
use valve_daemon::metrics::{install_for_gate, Metrics};
use valve_ebpf::LaunchEdge;
use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

/// Online launches come only as the edges the test sends.
struct NoLaunches;

impl LaunchSource for NoLaunches {
    fn watch(&mut self, _: u32) -> Result<(), String> {
        Ok(())
    }
    fn unwatch(&mut self, _: u32) {}
    fn last_launch_ns(&self, _: u32) -> u64 {
        0
    }
}

fn exposition(m: &Metrics) -> BTreeMap<String, f64> {
    m.encode()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

fn harvested_s(m: &Metrics) -> f64 {
    exposition(m)
        .get("valve_offline_harvested_seconds_total{label=\"batch\"}")
        .copied()
        .unwrap_or(0.0)
}

#[test]
fn gate_freezes_and_releases_are_counted_timed_and_harvest_is_measured() {
    let rm = FakeRm::host(1);
    let ctl = Controller::with_driver(rm).unwrap();
    let inst = ctl.gpus()[0].device_instance;
    let chans = [ChannelHandle(0x5c00_0010), ChannelHandle(0x5c00_0011)];
    ctl.driver()
        .add_channels(ClientHandle(0xc1d0_0042), inst, &chans);
    let m = Metrics::new(1);
    install_for_gate(m.clone());
    m.gate_started(&m.workload_label(Some("batch")));
    // No offline channels yet: nothing is harvested.
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(harvested_s(&m), 0.0);
    // The daemon tells the metrics once the offline set has channels.
    m.gate_offline_present(true);
    let started = Instant::now();
    let shared = Arc::new(GateShared::default());
    let cfg = GateConfig {
        fixed_cooldown: Some(Duration::ZERO),
        ..GateConfig::default()
    };
    let mut gate = GateRuntime::new(ctl, NoLaunches, cfg, shared);
    gate.handle(
        GateInput::Offline(vec![DisabledRecord {
            pid: 77,
            device_instance: inst,
            client: 0xc1d0_0042,
            channels: chans.iter().map(|c| c.0).collect(),
        }]),
        monotonic_ns(),
    );
    gate.handle(GateInput::Online(BTreeSet::from([1])), monotonic_ns());
    // Offline runs (is harvested) until the edge.
    std::thread::sleep(Duration::from_millis(20));
    // Offline ran at least from `started` to here, at most to after the disable.
    let ran_at_least = started.elapsed().as_secs_f64();
    let edge_ts = monotonic_ns();
    gate.handle(
        GateInput::Edge(LaunchEdge {
            pid: 1,
            graph: false,
            ts_ns: edge_ts,
            idle_ns: 0,
            after_resume: false,
            quiet: false,
        }),
        monotonic_ns(),
    );
    assert!(gate.offline_disabled());
    let edge_to_now = (monotonic_ns() - edge_ts) as f64 / 1e9;
    check_freeze_counted(&m, edge_to_now);
    let v = exposition(&m);
    let harvested = v["valve_offline_harvested_seconds_total{label=\"batch\"}"];
    let ran_at_most = started.elapsed().as_secs_f64();
    assert!(
        (ran_at_least..=ran_at_most).contains(&harvested),
        "{harvested} not within the {ran_at_least}..{ran_at_most} s offline ran"
    );
    // Frozen offline is not harvested: the total stands still while frozen.
    std::thread::sleep(Duration::from_millis(10));
    let still = harvested_s(&m);
    assert_eq!(still, harvested);
    // The cooldown (fixed at zero) has passed: the gate releases.
    gate.tick(monotonic_ns() + 1);
    assert!(!gate.offline_disabled());
    let v = exposition(&m);
    assert_eq!(
        v["valve_resumes_total{gpu=\"0\",label=\"batch\",source=\"gate\"}"],
        1.0
    );
    assert_eq!(
        v["valve_hold_seconds_count{label=\"batch\",source=\"gate\"}"],
        1.0
    );
    let frozen = v["valve_offline_frozen_seconds_total{label=\"batch\",source=\"gate\"}"];
    assert!(frozen >= 0.010, "held at least the 10 ms slept: {frozen}");
    assert_eq!(v["valve_enable_seconds_count{gpu=\"0\"}"], 1.0);
    // Running again: harvested grows.
    std::thread::sleep(Duration::from_millis(5));
    let again = harvested_s(&m);
    assert!(again > harvested, "{again} after {harvested}");
    m.gate_stopped();
    let after_stop = harvested_s(&m);
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(harvested_s(&m), after_stop, "no gate, no harvest");
    drop(gate);
}

/// After the gate's freeze: counted and timed per GPU, label and edge kind, within `edge_to_now`.
fn check_freeze_counted(m: &Metrics, edge_to_now: f64) {
    let v = exposition(m);
    assert_eq!(
        v["valve_processes_frozen{source=\"gate\"}"], 0.0,
        "set by the daemon"
    );
    assert!(m.gate_frozen());
    assert_eq!(
        v["valve_preemptions_total{gpu=\"0\",label=\"batch\",source=\"gate\"}"],
        1.0
    );
    assert_eq!(
        v["valve_edge_to_stopped_seconds_count{edge=\"launch\"}"],
        1.0
    );
    let e2s = v["valve_edge_to_stopped_seconds_sum{edge=\"launch\"}"];
    assert!(e2s > 0.0 && e2s <= edge_to_now, "{e2s} vs {edge_to_now}");
    assert_eq!(v["valve_disable_seconds_count{gpu=\"0\"}"], 1.0);
}
