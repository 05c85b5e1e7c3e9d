//! What the runtime's tests share: a fake launch source, offline processes on the fake RM, and
//! the inputs the watchers would send.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use valve::controller::Controller;
use valve::fake::FakeRm;
use valve::state::DisabledRecord;
use valve_ebpf::{ArrivalCounts, ArrivalEdge, LaunchEdge, WatchedPort};
use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

use super::{GateInput, GateRuntime, GateShared, LaunchSource};
use crate::gate::GateConfig;

pub(super) const MS: u64 = 1_000_000;
pub(super) const US: u64 = 1_000;
pub(super) const ONLINE: u32 = 7_000_001;
pub(super) const PORT: u16 = 8000;

/// Last launch per pid, last arrival per port, pids waiting for their GPU work, the times
/// the gate armed the resume edge, a launch (pid, time) that happens as it arms, the
/// end of the last wait for GPU work per pid, the times it marked offline held, and the quiet
/// edges written per pid.
#[derive(Clone, Default)]
#[allow(clippy::type_complexity)]
pub(super) struct FakeLaunches(
    pub(super) Arc<Mutex<BTreeMap<u32, u64>>>,
    pub(super) Arc<Mutex<BTreeMap<u16, ArrivalCounts>>>,
    pub(super) Arc<Mutex<BTreeSet<u32>>>,
    pub(super) Arc<Mutex<Vec<u64>>>,
    pub(super) Arc<Mutex<Option<(u32, u64)>>>,
    pub(super) Arc<Mutex<BTreeMap<u32, u64>>>,
    pub(super) Arc<Mutex<Vec<u64>>>,
    pub(super) Arc<Mutex<BTreeMap<u32, u64>>>,
);

impl LaunchSource for FakeLaunches {
    fn watch(&mut self, pid: u32) -> Result<(), String> {
        self.0.lock().unwrap().entry(pid).or_insert(0);
        Ok(())
    }
    fn unwatch(&mut self, pid: u32) {
        self.0.lock().unwrap().remove(&pid);
    }
    fn last_launch_ns(&self, pid: u32) -> u64 {
        self.0.lock().unwrap().get(&pid).copied().unwrap_or(0)
    }
    fn watch_port(&mut self, port: WatchedPort) -> Result<(), String> {
        self.1.lock().unwrap().entry(port.port).or_default();
        Ok(())
    }
    fn unwatch_port(&mut self, port: u16) {
        self.1.lock().unwrap().remove(&port);
    }
    fn arrival_counts(&self, port: u16) -> ArrivalCounts {
        self.1
            .lock()
            .unwrap()
            .get(&port)
            .copied()
            .unwrap_or_default()
    }
    fn in_sync(&self, pid: u32) -> bool {
        self.2.lock().unwrap().contains(&pid)
    }
    fn last_wait_end_ns(&self, pid: u32) -> u64 {
        self.5.lock().unwrap().get(&pid).copied().unwrap_or(0)
    }
    fn arm_resume(&self, now_ns: u64) {
        self.3.lock().unwrap().push(now_ns);
        if let Some((pid, t)) = self.4.lock().unwrap().take() {
            self.0.lock().unwrap().insert(pid, t);
        }
    }
    fn hold_edges(&self, since_ns: u64) {
        self.6.lock().unwrap().push(since_ns);
    }
    fn quiet_edges(&self, pid: u32) -> u64 {
        self.7.lock().unwrap().get(&pid).copied().unwrap_or(0)
    }
}

/// One offline process (20 channels on one GPU) and the online pid, cooldown ceiling 50 ms.
pub(super) fn one_offline_one_online() -> (
    Arc<FakeRm>,
    GateRuntime<Arc<FakeRm>, FakeLaunches>,
    FakeLaunches,
) {
    let rm = Arc::new(FakeRm::host(1));
    let cfg = GateConfig {
        cooldown_ceiling: Duration::from_millis(50),
        ..GateConfig::default()
    };
    let (mut rt, launches) = runtime(&rm, cfg);
    rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
    rt.handle(GateInput::Online([ONLINE].into()), 0);
    (rm, rt, launches)
}

/// `cfg`'s gate with one offline process (20 channels on one GPU), the online pid and its port.
pub(super) fn gate_with_port(
    cfg: GateConfig,
) -> (
    Arc<FakeRm>,
    GateRuntime<Arc<FakeRm>, FakeLaunches>,
    FakeLaunches,
) {
    let rm = Arc::new(FakeRm::host(1));
    let (mut rt, launches) = runtime(&rm, cfg);
    rt.handle(GateInput::Offline(offline(&rm)[..1].to_vec()), 0);
    rt.handle(GateInput::Online([ONLINE].into()), 0);
    let port = WatchedPort {
        port: PORT,
        netns: 0,
    };
    rt.handle(GateInput::Ports([port].into()), 0);
    (rm, rt, launches)
}

pub(super) fn arrival(port: u16, ts_ns: u64) -> GateInput {
    GateInput::Arrival(ArrivalEdge {
        port,
        netns: 1,
        ts_ns,
        idle_ns: 0,
        read_ns: 0,
    })
}

pub(super) fn edge(pid: u32, ts_ns: u64, idle_ns: u64) -> GateInput {
    launch_edge(pid, ts_ns, idle_ns, false)
}

/// An edge written while offline was held: it woke nobody, and the watcher counted it.
pub(super) fn quiet_edge(pid: u32, ts_ns: u64, idle_ns: u64) -> GateInput {
    launch_edge(pid, ts_ns, idle_ns, true)
}

fn launch_edge(pid: u32, ts_ns: u64, idle_ns: u64, quiet: bool) -> GateInput {
    GateInput::Edge(LaunchEdge {
        pid,
        graph: false,
        ts_ns,
        idle_ns,
        after_resume: false,
        quiet,
    })
}

/// Two offline processes, one on both GPUs; returns their records.
pub(super) fn offline(rm: &FakeRm) -> Vec<DisabledRecord> {
    let mut recs = Vec::new();
    for (pid, client, insts) in [
        (8_000_001, 0xc1d0_0010, &[0u32, 1][..]),
        (8_000_002, 0xc1d0_0020, &[0][..]),
    ] {
        for &inst in insts {
            let chans: Vec<u32> = (0..20).map(|i| 0x5c00_0000 + 0x100 * inst + i).collect();
            rm.add_channels(
                ClientHandle(client),
                inst,
                &chans.iter().map(|&c| ChannelHandle(c)).collect::<Vec<_>>(),
            );
            recs.push(DisabledRecord {
                pid,
                device_instance: inst,
                client,
                channels: chans,
            });
        }
    }
    recs
}

pub(super) fn runtime(
    rm: &Arc<FakeRm>,
    cfg: GateConfig,
) -> (GateRuntime<Arc<FakeRm>, FakeLaunches>, FakeLaunches) {
    let launches = FakeLaunches::default();
    let rt = GateRuntime::new(
        Controller::with_driver(rm.clone()).unwrap(),
        launches.clone(),
        cfg,
        Arc::new(GateShared::default()),
    );
    (rt, launches)
}

/// Sends an offline set as the daemon does: counted as sent, then applied.
pub(super) fn send_offline(
    rt: &mut GateRuntime<Arc<FakeRm>, FakeLaunches>,
    recs: &[DisabledRecord],
) {
    rt.shared.offline_sent.fetch_add(1, Ordering::SeqCst);
    rt.handle(GateInput::Offline(recs.to_vec()), 0);
}

/// `offline()` with its second process (on GPU 0 only) made this test process, so that it
/// counts as alive.
pub(super) fn offline_with_a_live_process(rm: &FakeRm) -> (Vec<DisabledRecord>, u32) {
    let me = std::process::id();
    let mut recs = offline(rm);
    recs[2].pid = me;
    (recs, me)
}
