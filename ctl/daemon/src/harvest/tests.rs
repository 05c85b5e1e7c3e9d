//! Tests of the harvest profile: the gate's trace into busy intervals (lost records included),
//! the online processes' GPUs from the daemon's registry, memory from the pool's ledger and
//! from NVML's view, the thread, the socket request, `GET /v1/harvest` and the gauges.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use valve::fake::FakeRm;
use valve_harvest::{NodeHarvest, Recorder};

use super::intervals::{Positions, TraceFolder};
use super::memory::{DeviceMemory, DeviceUsage, MemorySampler};
use super::*;
use crate::audit::Audit;
use crate::core::tests::{alloc, cuda_process, gate_spec, gated_core, wait_for};
use crate::gate::trace::{TraceKind, TraceRing};
use crate::memory::ledger::tests::ledger;
use crate::memory::ledger::Role;
use crate::metrics::tests::parse_exposition;
use crate::metrics::{serve_http, Metrics};
use crate::protocol::Request;
use crate::server::tests::{bound_core, own_group, request, serve_until, QueuedEvents};
use crate::server::Server;

const S: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const MIB: u64 = 1 << 20;

fn infos(n: u32) -> Vec<valve_harvest::GpuInfo> {
    (0..n)
        .map(|i| valve_harvest::GpuInfo {
            index: i,
            name: None,
            memory_total_bytes: 80 << 30,
        })
        .collect()
}

/// A recorder of `n` GPUs measuring from 0 over one 100 s window.
fn recorder(n: u32) -> Recorder {
    Recorder::new("n1", infos(n), &[100], 0)
}

fn positions(of: &[(u32, &[usize])]) -> Positions {
    of.iter().map(|(p, g)| (*p, g.to_vec())).collect()
}

/// `valve::gpu::GpuInfo` of `n` GPUs as the controller lists them.
fn valve_gpus(n: usize) -> Vec<valve::gpu::GpuInfo> {
    (0..n)
        .map(|i| valve::gpu::GpuInfo {
            index: i,
            gpu_id: i as u32,
            device_instance: i as u32,
            minor: i as u32,
            pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + i),
            pci_device_id: 0x2330,
            uuid: String::new(),
            name: "NVIDIA H100 80GB HBM3".into(),
        })
        .collect()
}

#[test]
fn a_successful_disable_and_the_next_enable_of_all_offline_block_every_gpu() {
    let ring = TraceRing::new(64);
    let mut rec = recorder(2);
    let mut f = TraceFolder::default();
    // Disable issued at 10 s, returned 1 ms later; enable of all offline issued at 12 s.
    ring.push(TraceKind::Disable, 10 * S, 0, 10 * S + MS, 0, 0);
    // A failed disable, one process's disable (it joined the set while held) and one process's
    // enable (it left the offline set): the hold goes on.
    ring.push(TraceKind::Disable, 11 * S, 0, 11 * S + MS, 1, 0);
    ring.push(TraceKind::Disable, 11 * S + MS, 78, 11 * S + MS, 0, 0);
    ring.push(
        TraceKind::Enable,
        11 * S + 2 * MS,
        77,
        11 * S + 3 * MS,
        0,
        0,
    );
    ring.push(TraceKind::Enable, 12 * S, 0, 12 * S + MS, 0, 0);
    f.read(&ring, &mut rec, &Positions::new());
    for g in 0..2 {
        let busy = rec.blocked.busy_fraction(g, 100 * S, 100 * S);
        assert!(
            (busy - (2 * S - MS) as f64 / (100 * S) as f64).abs() < 1e-12,
            "{busy}"
        );
        assert_eq!(
            rec.preemptions.sum(g, 100 * S, 100 * S),
            1,
            "the failed disable and one process's disable are no preemptions"
        );
    }
    // A second hold, still going on: it counts up to now.
    ring.push(TraceKind::Disable, 90 * S, 0, 90 * S, 0, 0);
    f.read(&ring, &mut rec, &Positions::new());
    let busy = rec.blocked.busy_fraction(1, 100 * S, 100 * S);
    assert!(
        (busy - (12 * S - MS) as f64 / (100 * S) as f64).abs() < 1e-12,
        "{busy}"
    );
    assert_eq!(f.lost(), 0);
}

#[test]
fn launch_edges_give_each_online_process_busy_intervals_on_its_gpus() {
    let ring = TraceRing::new(64);
    let mut rec = recorder(2);
    let mut f = TraceFolder::default();
    // Pid 100 on GPU 0, pid 200 on both GPUs.
    let online = positions(&[(100, &[0]), (200, &[0, 1])]);
    ring.push(TraceKind::Launch, 20 * S, 100, 0, 0, 0);
    ring.push(TraceKind::LaunchAfterResume, 21 * S, 200, 0, 0, 0);
    // 100 idled 2 s before launching again at 25 s: busy 20..23, then from 25.
    ring.push(TraceKind::Launch, 25 * S, 100, 0, 2 * S, 0);
    // The gate resumed offline: the last online activity was at 28 s.
    ring.push(TraceKind::Cooldown, 30 * S, 0, 28 * S, 2 * S, 0);
    f.read(&ring, &mut rec, &online);
    let frac = |rec: &Recorder, g| rec.online.busy_fraction(g, 100 * S, 100 * S);
    assert!((frac(&rec, 0) - 0.08).abs() < 1e-12, "20..28 on GPU 0");
    assert!((frac(&rec, 1) - 0.07).abs() < 1e-12, "21..28 on GPU 1");
    let o = rec.online.overlap(0, 1, 100 * S, 100 * S).unwrap();
    assert!((o.score - 7.0 / 8.0).abs() < 1e-12, "{o:?}");
    assert_eq!(
        rec.blocked.busy_fraction(0, 100 * S, 100 * S),
        0.0,
        "edges alone block nothing"
    );
    // Pid reuse: a new process's first launch (gap 0) while the old one's period is open.
    ring.push(TraceKind::Launch, 40 * S, 100, 0, 0, 0);
    ring.push(TraceKind::Launch, 41 * S, 100, 0, 0, 0);
    ring.push(TraceKind::Cooldown, 43 * S, 0, 42 * S, 0, 0);
    f.read(&ring, &mut rec, &online);
    assert!((frac(&rec, 0) - 0.10).abs() < 1e-12, "40..42 too");
}

#[test]
fn records_lost_to_the_ring_are_counted_and_the_hold_after_them_still_counts() {
    let ring = TraceRing::new(8);
    let mut rec = recorder(2);
    let mut f = TraceFolder::default();
    let online = positions(&[(100, &[1])]);
    ring.push(TraceKind::Launch, S, 100, 0, 0, 0); // seq 1
    ring.push(TraceKind::Disable, S, 0, 2 * S, 0, 0); // seq 2
    f.read(&ring, &mut rec, &online);
    // 20 more launches than the ring holds, then the enable: seqs 3..=23 and 24.
    for k in 0..21u64 {
        ring.push(TraceKind::Launch, (3 + k) * S, 100, 0, 0, 0);
    }
    ring.push(TraceKind::Enable, 50 * S, 0, 50 * S, 0, 0);
    f.read(&ring, &mut rec, &online);
    // The ring kept seqs 17..=24; 3..=16 were lost.
    assert_eq!(f.lost(), 14);
    // The hold ends where the trace went dark (2 s) and counts again from the first record
    // read after the gap (the launch at 17 s, seq 17) to the enable: offline was held.
    let blocked = rec.blocked.busy_fraction(0, 100 * S, 100 * S);
    assert!((blocked - 0.33).abs() < 1e-12, "17..50: {blocked}");
    // Pid 100's launches after the gap (17..23 s, gap 0: one busy period) go on.
    ring.push(TraceKind::Cooldown, 60 * S, 0, 24 * S, 0, 0);
    f.read(&ring, &mut rec, &online);
    let busy = rec.online.busy_fraction(1, 100 * S, 100 * S);
    assert!(
        (busy - 0.08).abs() < 1e-12,
        "1..2 before the gap, 17..24 after: {busy}"
    );
}

#[test]
fn processes_that_leave_or_are_never_named_are_forgotten_and_bounded() {
    let ring = TraceRing::new(1 << 14);
    let mut rec = recorder(1);
    let mut f = TraceFolder::default();
    // Not in the view yet: its intervals wait for its GPUs.
    ring.push(TraceKind::Launch, S, 300, 0, 0, 0);
    ring.push(TraceKind::Launch, 4 * S, 300, 0, S, 0);
    f.read(&ring, &mut rec, &Positions::new());
    f.update(&mut rec, &Positions::new(), 5 * S);
    assert_eq!(rec.online.busy_fraction(0, 100 * S, 100 * S), 0.0);
    let online = positions(&[(300, &[0])]);
    f.update(&mut rec, &online, 6 * S);
    assert!(
        (rec.online.busy_fraction(0, 10 * S, 10 * S) - 0.2).abs() < 1e-12,
        "1..3 booked"
    );
    // It leaves the online set (exited): its open period ends at the last time the trace
    // named (4 s), and it is forgotten.
    f.update(&mut rec, &Positions::new(), 7 * S);
    assert_eq!(f.tracked(), 0);
    // A process the view never names is dropped after the grace.
    ring.push(TraceKind::Launch, 8 * S, 301, 0, 0, 0);
    f.read(&ring, &mut rec, &Positions::new());
    f.update(&mut rec, &Positions::new(), 9 * S);
    assert_eq!(f.tracked(), 1);
    f.update(&mut rec, &Positions::new(), 30 * S);
    assert_eq!(f.tracked(), 0);
    // Thousands of pids never grow it past its bound.
    for pid in 0..5000u32 {
        ring.push(
            TraceKind::Launch,
            40 * S + u64::from(pid),
            10_000 + pid,
            0,
            0,
            0,
        );
    }
    f.read(&ring, &mut rec, &Positions::new());
    assert!(f.tracked() <= 4096, "{}", f.tracked());
}

/// Sources of `n` GPUs without pool or NVML.
fn bare_sources(n: usize) -> HarvestSources {
    HarvestSources {
        gpus: valve_gpus(n),
        pool: None,
        devices: None,
        offline_label: None,
    }
}

fn settings(dir: &Path) -> HarvestSettings {
    HarvestSettings {
        node_name: Some("gpu001".into()),
        progress_dir: dir.to_path_buf(),
        windows_s: vec![100],
    }
}

#[test]
fn the_harvester_reads_the_running_gates_trace_and_counts_open_periods_only_in_the_document() {
    let dir = tempfile::tempdir().unwrap();
    let shared = Arc::new(HarvestShared::default());
    shared.set_running(true);
    let mut h = Harvester::new(
        &settings(dir.path()),
        "gpu001",
        bare_sources(2),
        shared.clone(),
        0,
    );
    let gate = Arc::new(GateShared::default());
    shared.set_gate(Some(gate.clone()));
    shared.set_view(ProcessView {
        gate_running: true,
        online_gpus: [(100, vec![1])].into(),
        offline: [200].into(),
    });
    gate.trace()
        .push(TraceKind::Disable, 40 * S, 0, 40 * S, 0, 0);
    gate.trace().push(TraceKind::Launch, 50 * S, 100, 0, 0, 0);
    h.tick(Instant::now(), 60 * S);
    h.rebuild(100 * S, 1_234);
    let p = shared.profile().unwrap();
    let doc = &p.doc;
    doc.validate().unwrap();
    assert_eq!(
        (doc.node.as_str(), doc.generated_unix_ms),
        ("gpu001", 1_234)
    );
    assert_eq!(
        doc.gpu(0).unwrap().windows[0].busy_fraction,
        0.6,
        "held since 40 s"
    );
    // Pid 100 busy from 50 s on GPU 1 (index 1) up to the document's time.
    let pair = doc.pair(0, 1, 100).unwrap();
    assert_eq!((pair.union_fraction, pair.score), (0.5, 0.0));
    assert_eq!(
        h.recorder().online.busy_fraction(1, 100 * S, 100 * S),
        0.0,
        "the open period is the document's only"
    );
    // The gate stops: its final enable is read from its trace, then the thread lets it go.
    gate.trace()
        .push(TraceKind::Enable, 70 * S, 0, 70 * S, 0, 0);
    shared.set_gate(None);
    h.tick(Instant::now(), 80 * S);
    let blocked = h.recorder().blocked.busy_fraction(0, 100 * S, 100 * S);
    assert!((blocked - 0.3).abs() < 1e-12, "40..70: {blocked}");
    assert_eq!(p.value, serde_json::to_value(doc).unwrap());
    assert_eq!(p.json, serde_json::to_string(doc).unwrap());
}

#[test]
fn a_gate_that_ends_without_its_enable_in_the_trace_is_held_until_noticed() {
    let dir = tempfile::tempdir().unwrap();
    let shared = Arc::new(HarvestShared::default());
    let mut h = Harvester::new(
        &settings(dir.path()),
        "n",
        bare_sources(1),
        shared.clone(),
        0,
    );
    let gate = Arc::new(GateShared::default());
    shared.set_gate(Some(gate.clone()));
    gate.trace()
        .push(TraceKind::Disable, 10 * S, 0, 10 * S, 0, 0);
    h.tick(Instant::now(), 20 * S);
    shared.set_gate(Some(Arc::new(GateShared::default())));
    h.tick(Instant::now(), 30 * S);
    let blocked = h.recorder().blocked.busy_fraction(0, 100 * S, 100 * S);
    assert!((blocked - 0.2).abs() < 1e-12, "10..30: {blocked}");
}

/// NVML's view of each GPU by PCI address; counts the process lists asked for, and takes
/// `delay` to answer a sample.
#[derive(Default)]
struct FakeDevices {
    gpus: BTreeMap<String, DeviceUsage>,
    lists: Arc<std::sync::atomic::AtomicUsize>,
    delay: Duration,
}

impl FakeDevices {
    fn new(gpus: BTreeMap<String, DeviceUsage>) -> FakeDevices {
        FakeDevices {
            gpus,
            ..FakeDevices::default()
        }
    }
}

impl DeviceMemory for FakeDevices {
    fn total_bytes(&self, pci: &str) -> Option<u64> {
        self.gpus.contains_key(pci).then_some(80 << 30)
    }
    fn usage(&self, pci: &str, processes: bool) -> Option<DeviceUsage> {
        std::thread::sleep(self.delay);
        let mut u = self.gpus.get(pci).cloned()?;
        if processes {
            self.lists
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else {
            u.processes.clear();
        }
        Some(u)
    }
}

#[test]
fn pool_memory_is_free_creatable_and_offline_held_handles_from_the_ledger() {
    // 11 handles of device memory, one kept free: 10 creatable.
    let mut l = ledger(64 * 11, 4096);
    let on = l.register(1, Role::Online, 0, true).unwrap();
    let off = l.register(2, Role::Offline, 0, false).unwrap();
    l.take(on, 4).unwrap();
    l.take(off, 3).unwrap();
    let snapshot = Arc::new(UsageSnapshot::default());
    snapshot.publish(l.usage());
    let u = &snapshot.latest()[0];
    assert_eq!((u.free, u.creatable, u.offline, u.online), (0, 3, 3, 4));
    let mut rec = recorder(1);
    let mut m = MemorySampler::new(&valve_gpus(1), Some(snapshot.clone()), None);
    m.sample(&mut rec, 0, &ProcessView::default());
    // Online grows by 3 (all that could be created): offline keeps only what it holds.
    l.take(on, 3).unwrap();
    snapshot.publish(l.usage());
    m.sample(&mut rec, 50 * S, &ProcessView::default());
    let s = rec.memory.stats(0, 100 * S, 100 * S).unwrap();
    assert_eq!(
        s.mean_bytes,
        (6 + 3) * 64 * MIB / 2,
        "6 handles half the time, 3 the rest"
    );
    assert_eq!(s.quantiles_bytes[1], 3 * 64 * MIB, "p5");
    assert_eq!(s.samples, 2);
    // Online takes 2 of offline's handles: 128 MiB reclaimed, counted at the next sample.
    let taken: Vec<_> = l
        .client(off)
        .unwrap()
        .held
        .iter()
        .take(2)
        .copied()
        .collect();
    l.transfer(off, &taken, on).unwrap();
    l.note_reclaimed(0, 2);
    snapshot.publish(l.usage());
    m.sample(&mut rec, 60 * S, &ProcessView::default());
    assert_eq!(rec.reclaimed.sum(0, 100 * S, 100 * S), 2 * 64 * MIB);
    assert_eq!(
        rec.reclaimed.sum(0, 100 * S, 30 * S),
        0,
        "it happened at 60 s"
    );
    assert_eq!(rec.reclaim_episodes.sum(0, 100 * S, 100 * S), 1);
    // The same burst takes one more handle in the next second: still one episode. After a
    // quiet second, the next reclaim starts a second episode.
    let one = l
        .client(off)
        .unwrap()
        .held
        .iter()
        .take(1)
        .copied()
        .collect::<Vec<_>>();
    l.transfer(off, &one, on).unwrap();
    l.note_reclaimed(0, 1);
    snapshot.publish(l.usage());
    m.sample(&mut rec, 61 * S, &ProcessView::default());
    m.sample(&mut rec, 62 * S, &ProcessView::default());
    assert_eq!(rec.reclaim_episodes.sum(0, 100 * S, 100 * S), 1);
    assert_eq!(rec.reclaimed.sum(0, 100 * S, 100 * S), 3 * 64 * MIB);
    l.note_reclaimed(0, 1);
    snapshot.publish(l.usage());
    m.sample(&mut rec, 63 * S, &ProcessView::default());
    assert_eq!(rec.reclaim_episodes.sum(0, 100 * S, 100 * S), 2);
}

#[test]
fn without_the_pool_memory_is_nvmls_free_plus_what_offline_uses() {
    let gpus = valve_gpus(2);
    let devices = FakeDevices::new(
        [(
            gpus[0].pci_bus_id.clone(),
            DeviceUsage {
                free_bytes: 10 << 30,
                processes: vec![(42, Some(20 << 30)), (43, Some(30 << 30)), (44, None)],
            },
        )]
        .into(),
    );
    let mut m =
        MemorySampler::new(&gpus, None, Some("batch".into())).with_devices(Some(Box::new(devices)));
    let mut rec = recorder(2);
    let gated = ProcessView {
        gate_running: true,
        offline: [42, 44].into(),
        ..ProcessView::default()
    };
    m.sample(&mut rec, 0, &gated);
    assert_eq!(
        rec.memory.stats(0, S, S).unwrap().mean_bytes,
        30 << 30,
        "free + pid 42's"
    );
    assert!(
        rec.memory.stats(1, S, S).is_none(),
        "no NVML for GPU 1: no sample"
    );

    // No gate: offline is who carries the gate's offline label (a real child, so /proc has it).
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .env("VALVE_LABEL", "batch")
        .spawn()
        .unwrap();
    // spawn() returns once exec has begun; /proc shows the new environment a little later.
    wait_for("the child's environment", || {
        crate::gate::process_label(child.id()).is_some()
    });
    let devices = FakeDevices::new(
        [(
            gpus[0].pci_bus_id.clone(),
            DeviceUsage {
                free_bytes: 1 << 30,
                processes: vec![
                    (child.id(), Some(4 << 30)),
                    (std::process::id(), Some(8 << 30)),
                ],
            },
        )]
        .into(),
    );
    let mut m =
        MemorySampler::new(&gpus, None, Some("batch".into())).with_devices(Some(Box::new(devices)));
    let mut rec = recorder(2);
    m.sample(&mut rec, 0, &ProcessView::default());
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(rec.memory.stats(0, S, S).unwrap().mean_bytes, 5 << 30);
}

#[test]
fn the_process_list_is_asked_for_only_when_a_process_may_be_offline() {
    let gpus = valve_gpus(1);
    let usage = DeviceUsage {
        free_bytes: 10 << 30,
        processes: vec![(42, Some(20 << 30))],
    };
    let sampler = |label: Option<&str>| {
        let devices = FakeDevices::new([(gpus[0].pci_bus_id.clone(), usage.clone())].into());
        let lists = devices.lists.clone();
        let m = MemorySampler::new(&gpus, None, label.map(String::from))
            .with_devices(Some(Box::new(devices)));
        (m, lists)
    };
    let lists_after = |label: Option<&str>, view: &ProcessView| {
        let (mut m, lists) = sampler(label);
        m.sample(&mut recorder(1), 0, view);
        lists.load(std::sync::atomic::Ordering::Relaxed)
    };
    let gate = |offline: &[u32]| ProcessView {
        gate_running: true,
        offline: offline.iter().copied().collect(),
        ..ProcessView::default()
    };
    // No gate and no offline label, or a gate that freezes nobody: free memory only.
    assert_eq!(lists_after(None, &ProcessView::default()), 0);
    assert_eq!(lists_after(Some("batch"), &gate(&[])), 0);
    // Someone may be offline: the list is needed to add what offline holds.
    assert_eq!(lists_after(None, &gate(&[42])), 1);
    assert_eq!(lists_after(Some("batch"), &ProcessView::default()), 1);
    let (mut m, _) = sampler(None);
    let mut rec = recorder(1);
    m.sample(&mut rec, 0, &gate(&[42]));
    assert_eq!(rec.memory.stats(0, S, S).unwrap().mean_bytes, 30 << 30);
}

#[test]
fn start_returns_once_the_first_memory_sample_and_document_are_made() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = valve_gpus(1);
    let usage = DeviceUsage {
        free_bytes: 10 << 30,
        processes: Vec::new(),
    };
    // A slow NVML: a first turn left to the thread would still be running below.
    let devices = FakeDevices {
        delay: Duration::from_millis(200),
        ..FakeDevices::new([(gpus[0].pci_bus_id.clone(), usage)].into())
    };
    let sources = HarvestSources {
        devices: Some(Box::new(devices)),
        ..bare_sources(1)
    };
    let h = start(&settings(dir.path()), "gpu001", sources).unwrap();
    let doc = h.shared().profile().expect("built before start returned");
    assert_eq!(doc.doc.gpus.len(), 1);
}

#[test]
fn the_views_online_gpus_come_from_the_registry_and_follow_the_gate() {
    let rm = Arc::new(FakeRm::host(2));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    // Online pid 1 (alive) runs work on RM instance 1; like every CUDA process it also opened
    // the other GPU's device, where it has no channels.
    for e in cuda_process(&rm, 1, 0xc1d0_0030, &[1], 2) {
        c.on_event(&e);
    }
    let other_gpu = valve_ioctl_bindings::NV01_DEVICE_0;
    c.on_event(&alloc(
        1,
        0xc1d0_0030,
        0xc1d0_0030,
        0x5c00_9001,
        other_gpu,
        Some(0),
    ));
    let index_of_instance_1 = c
        .controller()
        .gpus()
        .iter()
        .find(|g| g.device_instance == 1)
        .unwrap()
        .index as u32;
    let shared = Arc::new(HarvestShared::default());
    c.set_harvest(shared.clone());
    assert_eq!(
        shared.view(),
        ProcessView::default(),
        "no gate: nothing online"
    );
    assert!(c.handle(gate_spec(1, me)).error.is_none());
    let view = shared.view();
    assert!(view.gate_running);
    assert_eq!(view.online_gpus[&1], vec![index_of_instance_1]);
    assert_eq!(view.offline, [me].into());
    assert!(shared.gate().is_some(), "the gate's trace is handed over");
    assert!(c.handle(Request::GateStop).error.is_none());
    assert!(shared.gate().is_none());
    assert!(!shared.view().gate_running);
}

#[test]
fn the_thread_builds_a_document_with_the_jobs_progress_and_stops_with_its_handle() {
    let dir = tempfile::tempdir().unwrap();
    let unix_ms = super::unix_ms_now();
    valve_harvest::progress::report(dir.path(), "1234", unix_ms - 10_000, 0.0).unwrap();
    valve_harvest::progress::report(dir.path(), "1234", unix_ms - 5_000, 500.0).unwrap();
    let h = start(&settings(dir.path()), "gpu001", bare_sources(2)).unwrap();
    let shared = h.shared();
    wait_for("the first document", || shared.profile().is_ok());
    let doc = shared.profile().unwrap().doc.clone();
    assert_eq!(
        (doc.node.as_str(), doc.source.as_str()),
        ("gpu001", "daemon")
    );
    assert_eq!(doc.gpus.len(), 2);
    assert_eq!(doc.gpus[1].name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(doc.jobs.len(), 1);
    assert_eq!(doc.jobs[0].units_total, 500.0);
    drop(h);
    assert!(!shared.is_running());
    assert!(shared.profile().unwrap_err().contains("not running"));
}

#[test]
fn the_progress_directory_is_made_world_writable_and_sticky() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let progress = dir.path().join("run/progress");
    ensure_progress_dir(&progress).unwrap();
    let mode = std::fs::metadata(&progress).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o1777);
    ensure_progress_dir(&progress).unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let e = ensure_progress_dir(&file).unwrap_err();
    assert!(
        e.contains("not a directory") && e.contains("--progress-dir"),
        "{e}"
    );
    let e = ensure_progress_dir(&file.join("sub")).unwrap_err();
    assert!(e.contains("creating the progress directory"), "{e}");
}

/// A shared state serving `doc`, as a running harvest thread would.
fn serving(doc: &NodeHarvest) -> Arc<HarvestShared> {
    let shared = Arc::new(HarvestShared::default());
    shared.set_running(true);
    shared.publish(doc.clone());
    shared
}

/// A two-GPU document with `jobs` reporting jobs.
fn sample_doc(jobs: usize) -> NodeHarvest {
    let mut r = Recorder::new("gpu001", infos(2), &[60, 3600], 0);
    r.blocked.add(0, 0, 15 * S);
    r.blocked.add(1, 0, 30 * S);
    r.online.add(0, 0, 10 * S);
    r.online.add(1, 5 * S, 10 * S);
    r.memory.sample(0, 0, 40 << 30);
    let jobs = (0..jobs)
        .map(|k| {
            let points = [(0, 0.0), (60_000, 60.0 * (k + 1) as f64)];
            valve_harvest::progress::progress(&format!("job{k:03}"), &points, 60_000, &[60])
        })
        .collect();
    r.document(60 * S, 99, jobs)
}

#[test]
fn the_socket_request_answers_with_the_cached_document() {
    let (_rm, _dir, mut core, socket, listener) = bound_core();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit);
    let events = QueuedEvents::default();
    let path = socket.clone();
    let client = std::thread::spawn(move || request(&path, "{\"op\":\"harvest\"}\n"));
    let (reply, _) = serve_until(&mut server, &mut core, &events, client);
    assert!(reply.error.unwrap().message.contains("does not collect"));

    let doc = sample_doc(1);
    core.set_harvest(serving(&doc));
    let path = socket.clone();
    let client = std::thread::spawn(move || request(&path, "{\"op\":\"harvest\"}\n"));
    let (reply, _) = serve_until(&mut server, &mut core, &events, client);
    assert!(reply.error.is_none(), "{reply:?}");
    let back: NodeHarvest = serde_json::from_value(reply.data_json()).unwrap();
    assert_eq!(back, doc);
}

fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: valve\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

#[test]
fn get_v1_harvest_serves_the_cached_document_or_a_404_with_a_hint() {
    let m = Metrics::new(2);
    let addr = serve_http("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
    let (head, body) = http_get(addr, "/v1/harvest");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    assert!(body.contains("harvest thread is not running"), "{body}");
    assert_eq!(body.lines().count(), 1);

    let doc = sample_doc(1);
    let shared = serving(&doc);
    m.serve_profile(shared.clone());
    let (head, body) = http_get(addr, "/v1/harvest");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("Content-Type: application/json"), "{head}");
    assert_eq!(body, serde_json::to_string(&doc).unwrap());
    assert_eq!(NodeHarvest::from_json(&body).unwrap(), doc);
    let (head, _) = http_get(addr, "/v1/harvest?pretty=1");
    assert!(
        head.starts_with("HTTP/1.1 200 OK"),
        "a query changes nothing"
    );

    shared.set_running(false);
    let (head, body) = http_get(addr, "/v1/harvest");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    assert!(body.contains("not running"), "{body}");
}

#[test]
fn the_gauges_show_the_cached_document_with_job_labels_capped() {
    let m = Metrics::new(2);
    let doc = sample_doc(gauges::MAX_JOB_LABELS + 3);
    m.serve_profile(serving(&doc));
    let text = m.encode();
    let v = parse_exposition(&text);
    let get = |k: &str| *v.get(k).unwrap_or_else(|| panic!("{k} missing:\n{text}"));
    assert_eq!(
        get("valve_harvest_busy_fraction{gpu=\"0\",window=\"60s\"}"),
        0.25
    );
    assert_eq!(
        get("valve_harvest_busy_fraction{gpu=\"1\",window=\"60s\"}"),
        0.5
    );
    let mem = |stat: &str| {
        get(&format!(
            "valve_harvest_offline_memory_bytes{{gpu=\"0\",window=\"3600s\",stat=\"{stat}\"}}"
        ))
    };
    assert_eq!(
        (mem("mean"), mem("p5"), mem("p50")),
        (42949672960.0, 42949672960.0, 42949672960.0)
    );
    assert_eq!(
        get("valve_harvest_alignment_score{gpu_a=\"0\",gpu_b=\"1\",window=\"60s\"}"),
        0.5
    );
    assert_eq!(
        get("valve_harvest_job_rate{job=\"job000\",window=\"60s\"}"),
        1.0
    );
    // Jobs 32, 33 and 34 (rates 33, 34 and 35 a second) add up under `other`.
    assert_eq!(
        get("valve_harvest_job_rate{job=\"other\",window=\"60s\"}"),
        102.0
    );
    let jobs = v
        .keys()
        .filter(|k| k.starts_with("valve_harvest_job_rate{"))
        .count();
    assert_eq!(jobs, gauges::MAX_JOB_LABELS + 1);
}
