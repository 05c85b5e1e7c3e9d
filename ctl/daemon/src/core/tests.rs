//! Tests of [`DaemonCore`] over the fake RM: preempt and resume by pid, hold limits, restarts
//! (state file and journal), and the gate as the daemon runs it.

use std::sync::Arc;

use super::*;
use crate::gate;
use crate::protocol::EXIT_PROCESS;
use serde_json::json;
use valve::fake::FakeRm;
use valve_ebpf::{AllocEvent, FreeEvent};
use valve_ioctl_bindings::{self as b, ChannelHandle, ClientHandle, ObjectHandle};

pub(crate) fn alloc(
    pid: u32,
    client: u32,
    parent: u32,
    object: u32,
    class: u32,
    extra: Option<u32>,
) -> RmEvent {
    RmEvent {
        ts_ns: 0,
        pid,
        tid: pid,
        kind: RmEventKind::Alloc(AllocEvent {
            client: ClientHandle(client),
            parent: ObjectHandle(parent),
            object: ObjectHandle(object),
            class,
            extra,
            minor: 255,
            nvos64: true,
        }),
    }
}

/// A CUDA-13-like process on the given device instances: client, device per GPU, one TSG
/// of `n` channels per GPU. Returns its events and registers its channels with the fake RM.
pub(crate) fn cuda_process(
    rm: &FakeRm,
    pid: u32,
    client: u32,
    instances: &[u32],
    n: u32,
) -> Vec<RmEvent> {
    let mut ev = vec![alloc(pid, 0, 0, client, b::NV01_ROOT_CLIENT, None)];
    for (k, &inst) in instances.iter().enumerate() {
        let base = 0x5c00_0000 + 0x100 * k as u32;
        let (dev, tsg) = (base + 1, base + 2);
        ev.push(alloc(
            pid,
            client,
            client,
            dev,
            b::NV01_DEVICE_0,
            Some(inst),
        ));
        ev.push(alloc(
            pid,
            client,
            dev,
            tsg,
            b::KEPLER_CHANNEL_GROUP_A,
            None,
        ));
        let chans: Vec<ChannelHandle> = (0..n).map(|i| ChannelHandle(base + 0x10 + i)).collect();
        for c in &chans {
            ev.push(alloc(
                pid,
                client,
                tsg,
                c.0,
                b::HOPPER_CHANNEL_GPFIFO_A,
                None,
            ));
            ev.push(alloc(
                pid,
                client,
                c.0,
                c.0 + 0x80,
                b::HOPPER_COMPUTE_A,
                None,
            ));
        }
        rm.add_channels(ClientHandle(client), inst, &chans);
    }
    ev
}

/// Every test pid "runs" and was started at tick 42.
fn always_running(_: u32) -> Option<u64> {
    Some(42)
}

fn started_later(_: u32) -> Option<u64> {
    Some(43)
}

fn core(rm: &Arc<FakeRm>, dir: &Path, max_hold: Option<Duration>) -> DaemonCore<Arc<FakeRm>> {
    core_with(rm, dir, max_hold, always_running)
}

fn core_with(
    rm: &Arc<FakeRm>,
    dir: &Path,
    max_hold: Option<Duration>,
    start_time: StartTimeFn,
) -> DaemonCore<Arc<FakeRm>> {
    let ctl = Controller::with_driver(rm.clone()).unwrap();
    DaemonCore::with_start_time(
        ctl,
        StateFile::in_dir(dir),
        max_hold,
        BTreeSet::new(),
        start_time,
    )
    .unwrap()
}

#[test]
fn a_restarted_daemon_still_knows_running_processes_but_not_reused_pids() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut first = core(&rm, dir.path(), None);
    for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 4) {
        first.on_event(&e);
    }
    first.flush_journal().unwrap();
    drop(first);
    // Same pid, same start time: restored, and preempt --pid works on it.
    let mut second = core(&rm, dir.path(), None);
    assert_eq!(second.restored, vec![PID_A]);
    let r = second.handle(Request::Preempt {
        pid: PID_A,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert_eq!(r.data_json()["channels"], 4, "{r:?}");
    assert!(second
        .handle(Request::Resume { pid: PID_A })
        .error
        .is_none());
    second.flush_journal().unwrap();
    drop(second);
    // The pid now belongs to a process started later: nothing is inherited.
    let mut third = core_with(&rm, dir.path(), None, started_later);
    assert!(third.restored.is_empty());
    let r = third.handle(Request::Preempt {
        pid: PID_A,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert_eq!(r.error.unwrap().code, EXIT_PROCESS);
    assert!(rm.disabled().is_empty());
}

#[test]
fn the_journal_forgets_exited_processes() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut first = core(&rm, dir.path(), None);
    for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 2) {
        first.on_event(&e);
    }
    first.on_event(&RmEvent {
        ts_ns: 0,
        pid: PID_A,
        tid: PID_A,
        kind: RmEventKind::Exit,
    });
    first.flush_journal().unwrap();
    drop(first);
    assert!(core(&rm, dir.path(), None).restored.is_empty());
}

const PID_A: u32 = 4_000_001;
const PID_B: u32 = 4_000_002;

#[test]
fn preempt_and_resume_by_pid_on_all_its_gpus() {
    let rm = Arc::new(FakeRm::host(2));
    let dir = tempfile::tempdir().unwrap();
    let mut c = core(&rm, dir.path(), None);
    let insts: Vec<u32> = c
        .controller()
        .gpus()
        .iter()
        .map(|g| g.device_instance)
        .collect();
    for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &insts, 5) {
        c.on_event(&e);
    }
    // Same object handles, other client, first GPU only: must not be touched.
    for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &insts[..1], 5) {
        c.on_event(&e);
    }
    let r = c.handle(Request::Preempt {
        pid: PID_A,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["channels"], 10);
    assert_eq!(r.data_json()["gpus"], 2);
    let disabled = rm.disabled();
    assert_eq!(disabled.len(), 10);
    assert!(disabled.iter().all(|(cl, _)| cl.0 == 0xc1d0_0010));
    let recorded = StateFile::in_dir(dir.path()).load().unwrap();
    assert_eq!(recorded.len(), 2);
    assert!(recorded
        .iter()
        .all(|r| r.pid == PID_A && r.channels.len() == 5));

    let ps = c.handle(Request::Ps).data_json();
    let a = ps["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == PID_A)
        .unwrap();
    assert_eq!(a["preempted"], true);
    assert_eq!(a["gpus"].as_array().unwrap().len(), 2);

    let r = c.handle(Request::Resume { pid: PID_A });
    assert!(r.error.is_none(), "{r:?}");
    assert!(rm.disabled().is_empty());
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
    assert_eq!(
        c.handle(Request::Resume { pid: PID_A }).error.unwrap().code,
        EXIT_PROCESS
    );
}

#[test]
fn gpu_filter_and_process_errors() {
    let rm = Arc::new(FakeRm::host(2));
    let dir = tempfile::tempdir().unwrap();
    let mut c = core(&rm, dir.path(), None);
    let gpus = c.controller().gpus();
    let insts: Vec<u32> = gpus.iter().map(|g| g.device_instance).collect();
    for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &insts[..1], 3) {
        c.on_event(&e);
    }
    let idx_of_second = gpus
        .iter()
        .find(|g| g.device_instance == insts[1])
        .unwrap()
        .index;
    let r = c.handle(Request::Preempt {
        pid: PID_A,
        gpu: Some(idx_of_second.to_string()),
        max_hold_ms: None,
        confirm: false,
    });
    assert_eq!(r.error.unwrap().code, EXIT_PROCESS);
    assert!(rm.disabled().is_empty());
    let r = c.handle(Request::Preempt {
        pid: PID_A,
        gpu: Some("9".into()),
        max_hold_ms: None,
        confirm: false,
    });
    assert_eq!(r.error.unwrap().code, 6);

    let r = c.handle(Request::Preempt {
        pid: 4_100_000,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert!(r.error.unwrap().message.contains("no such process"));
    let me = std::process::id();
    let r = c.handle(Request::Preempt {
        pid: me,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert!(r.error.unwrap().message.contains("has no GPU channels"));
    c.pre_existing.insert(me);
    let r = c.handle(Request::Preempt {
        pid: me,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    let e = r.error.unwrap();
    assert_eq!(e.code, EXIT_PROCESS);
    assert!(
        e.message.contains("started before the daemon"),
        "{}",
        e.message
    );
    let ps = c.handle(Request::Ps).data_json();
    assert!(ps["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == me && p["discoverable"] == false));
}

#[test]
fn a_restarted_daemon_reenables_what_a_dead_one_left_disabled() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut first = core(&rm, dir.path(), None);
    for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 4) {
        first.on_event(&e);
    }
    assert!(first
        .handle(Request::Preempt {
            pid: PID_A,
            gpu: None,
            max_hold_ms: None,
            confirm: false,
        })
        .error
        .is_none());
    assert_eq!(rm.disabled().len(), 4);
    // The daemon dies without resuming (as with SIGKILL): no Drop logic runs for it.
    std::mem::forget(first);
    let second = core(&rm, dir.path(), None);
    assert_eq!(second.recovered, 4);
    assert!(rm.disabled().is_empty());
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
}

#[test]
fn hold_limit_and_process_exit() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut c = core(&rm, dir.path(), Some(Duration::from_secs(3600)));
    for e in cuda_process(&rm, PID_A, 0xc1d0_0010, &[0], 2) {
        c.on_event(&e);
    }
    for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &[0], 2) {
        c.on_event(&e);
    }
    // The request's limit is shorter than the daemon's: it wins.
    let r = c.handle(Request::Preempt {
        pid: PID_A,
        gpu: None,
        max_hold_ms: Some(0),
        confirm: false,
    });
    assert_eq!(r.data_json()["max_hold_ms"], 0);
    assert!(c
        .handle(Request::Preempt {
            pid: PID_B,
            gpu: None,
            max_hold_ms: None,
            confirm: false,
        })
        .error
        .is_none());
    assert_eq!(rm.disabled().len(), 4);
    assert_eq!(
        c.expire(Instant::now() + Duration::from_millis(1)),
        vec![PID_A]
    );
    assert_eq!(rm.disabled().len(), 2);
    // B exits while preempted: its record goes (its channels died with it).
    c.on_event(&RmEvent {
        ts_ns: 0,
        pid: PID_B,
        tid: PID_B,
        kind: RmEventKind::Exit,
    });
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
    assert_eq!(
        c.handle(Request::Resume { pid: PID_B }).error.unwrap().code,
        EXIT_PROCESS
    );
    // A freed client takes its channels out of the registry.
    c.on_event(&RmEvent {
        ts_ns: 0,
        pid: PID_A,
        tid: PID_A,
        kind: RmEventKind::Free(FreeEvent {
            client: ClientHandle(0xc1d0_0010),
            parent: ObjectHandle(0),
            object: ObjectHandle(0xc1d0_0010),
            minor: 255,
        }),
    });
    let r = c.handle(Request::Preempt {
        pid: PID_A,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert_eq!(r.error.unwrap().code, EXIT_PROCESS);
}

#[test]
fn resume_all_resumes_every_pid() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut c = core(&rm, dir.path(), None);
    for (pid, cl) in [(PID_A, 0xc1d0_0010), (PID_B, 0xc1d0_0020)] {
        for e in cuda_process(&rm, pid, cl, &[0], 3) {
            c.on_event(&e);
        }
        assert!(c
            .handle(Request::Preempt {
                pid,
                gpu: None,
                max_hold_ms: None,
                confirm: false,
            })
            .error
            .is_none());
    }
    assert_eq!(rm.disabled().len(), 6);
    let r = c.handle(Request::ResumeAll);
    assert!(r.error.is_none());
    assert!(rm.disabled().is_empty());
}

/// A launch source that reports nothing, or panics when asked (a gate thread that dies).
struct QuietLaunches {
    panic: bool,
}

impl crate::gate::LaunchSource for QuietLaunches {
    fn watch(&mut self, _pid: u32) -> Result<(), String> {
        Ok(())
    }
    fn unwatch(&mut self, _pid: u32) {}
    fn last_launch_ns(&self, _pid: u32) -> u64 {
        assert!(!self.panic, "launch source failed");
        0
    }
}

pub(crate) type EdgeSender =
    Arc<std::sync::Mutex<Option<std::sync::mpsc::Sender<crate::gate::GateInput>>>>;

pub(crate) fn fake_starter(rm: &Arc<FakeRm>, panic: bool) -> (gate::GateStarter, EdgeSender) {
    let rm = rm.clone();
    let edges: EdgeSender = Default::default();
    let edges2 = edges.clone();
    let starter = Arc::new(move |cfg| {
        let (rm, edges) = (rm.clone(), edges2.clone());
        crate::gate::runtime::spawn(cfg, move |tx| {
            *edges.lock().unwrap() = Some(tx);
            let ctl = Controller::with_driver(rm).map_err(|e| e.to_string())?;
            Ok((ctl, QuietLaunches { panic }))
        })
    });
    (starter, edges)
}

/// A gate starter whose gate thread stops in the middle of its start (where the real one
/// attaches its BPF programs) until the test sends on `release`; `entered` says it got there.
pub(crate) struct HeldStarter {
    pub(crate) starter: gate::GateStarter,
    pub(crate) entered: std::sync::mpsc::Receiver<()>,
    pub(crate) release: std::sync::mpsc::Sender<()>,
}

pub(crate) fn held_starter(rm: &Arc<FakeRm>) -> HeldStarter {
    let rm = rm.clone();
    let (entered_tx, entered) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = Arc::new(std::sync::Mutex::new(release_rx));
    let starter = Arc::new(move |cfg| {
        let (rm, entered_tx, release_rx) = (rm.clone(), entered_tx.clone(), release_rx.clone());
        crate::gate::runtime::spawn(cfg, move |_tx| {
            let _ = entered_tx.send(());
            // A dropped `release` lets it go on too, and so does a test that forgot it (or a
            // loop stuck in this start) after a while: a failure, not a hang.
            let _ = release_rx
                .lock()
                .unwrap()
                .recv_timeout(std::time::Duration::from_secs(45));
            let ctl = Controller::with_driver(rm).map_err(|e| e.to_string())?;
            Ok((ctl, QuietLaunches { panic: false }))
        })
    });
    HeldStarter {
        starter,
        entered,
        release,
    }
}

pub(crate) fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "timed out waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A daemon core with a fake gate starter and this test process as a CUDA process with 4
/// channels on GPU 0 (offline candidates must be alive).
pub(crate) fn gated_core(
    rm: &Arc<FakeRm>,
    dir: &Path,
    panic: bool,
) -> (DaemonCore<Arc<FakeRm>>, EdgeSender, u32) {
    let mut c = core(rm, dir, None);
    let (starter, edges) = fake_starter(rm, panic);
    c.set_gate_starter(starter);
    let me = std::process::id();
    for e in cuda_process(rm, me, 0xc1d0_0010, &[0], 4) {
        c.on_event(&e);
    }
    (c, edges, me)
}

pub(crate) fn gate_spec(online: u32, offline: u32) -> Request {
    Request::GateStart(Box::new(crate::protocol::GateSpec {
        online: vec![online],
        offline: vec![offline],
        ..Default::default()
    }))
}

#[test]
fn the_gate_freezes_only_offline_and_records_it_first() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    // Offline: this test process; online: pid 1 (both alive). Another process with the
    // same object handles must never be touched.
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &[0], 4) {
        c.on_event(&e);
    }
    // Bad specs are refused with their exit codes, and nothing starts.
    let code = |r: Reply| r.error.map(|e| e.code);
    let only_online = Request::GateStart(Box::new(crate::protocol::GateSpec {
        online: vec![1],
        ..Default::default()
    }));
    assert_eq!(code(c.handle(only_online)), Some(2));
    assert_eq!(code(c.handle(gate_spec(1, 1))), Some(2));
    assert_eq!(code(c.handle(gate_spec(1, 4_199_999))), Some(EXIT_PROCESS));
    assert_eq!(code(c.handle(Request::GateStop)), Some(1));
    assert_eq!(code(c.handle(Request::OnlineBusy)), Some(1));
    assert_eq!(c.handle(Request::GateStatus).data_json()["running"], false);

    let r = c.handle(gate_spec(1, me));
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["offline_channels"], 4);
    assert_eq!(
        code(c.handle(gate_spec(1, me))),
        Some(1),
        "one gate at a time"
    );
    let recorded = StateFile::in_dir(dir.path()).load().unwrap();
    assert!(recorded
        .iter()
        .any(|r| r.pid == me && r.channels.len() == 4));
    assert!(rm.disabled().is_empty(), "recorded, not yet disabled");

    assert!(c.handle(Request::OnlineBusy).error.is_none());
    wait_for("busy disables", || rm.disabled().len() == 4);
    assert!(rm.disabled().iter().all(|(cl, _)| cl.0 == 0xc1d0_0010));
    assert!(c.handle(Request::OnlineIdle).error.is_none());
    wait_for("idle enables", || rm.disabled().is_empty());

    // A manual preempt of a gated process is the operator's: the gate's resume leaves it.
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    wait_for("busy disables", || rm.disabled().len() == 4);
    let r = c.handle(Request::Preempt {
        pid: me,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert!(r.error.is_none(), "{r:?}");
    assert!(c.handle(Request::OnlineIdle).error.is_none());
    wait_for("the gate resumed", || {
        c.handle(Request::GateStatus).data_json()["resumes"] == 2
    });
    // Read after the resume: by then the gate thread has applied the offline set sent before
    // the idle signal (a status right after the signal could still show the old set).
    let st = c.handle(Request::GateStatus).data_json();
    assert_eq!(st["offline_channels"], 0);
    assert_eq!(rm.disabled().len(), 4, "still held by the manual preempt");
    assert!(c.handle(Request::Resume { pid: me }).error.is_none());
    assert!(rm.disabled().is_empty());
    assert_eq!(
        c.handle(Request::GateStatus).data_json()["offline_channels"],
        4
    );

    // Status shows the gate; stop resumes and clears the records.
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    wait_for("busy disables", || rm.disabled().len() == 4);
    assert_eq!(
        c.handle(Request::Status).data_json()["gate"]["running"],
        true
    );
    let r = c.handle(Request::GateStop);
    assert!(r.error.is_none());
    assert_eq!(r.data_json()["running"], false);
    assert_eq!(r.data_json()["preemptions"], 3);
    assert!(rm.disabled().is_empty());
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
}

#[test]
fn offline_by_label_includes_labelled_processes_only_and_never_online_ones() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    // A labelled CUDA process (a real child, so /proc has its environment) and this
    // unlabelled one, which the registry also lists with channels.
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .env(crate::gate::LABEL_VAR, "batch")
        .spawn()
        .unwrap();
    let kid = child.id();
    for e in cuda_process(&rm, kid, 0xc1d0_0030, &[0], 3) {
        c.on_event(&e);
    }
    let r = c.handle(Request::GateStart(Box::new(crate::protocol::GateSpec {
        online: vec![me],
        offline_label: Some("batch".into()),
        ..Default::default()
    })));
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["offline_pids"], serde_json::json!([kid]));
    assert_eq!(r.data_json()["offline_channels"], 3);
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    wait_for("busy disables", || rm.disabled().len() == 3);
    assert!(rm.disabled().iter().all(|(cl, _)| cl.0 == 0xc1d0_0030));
    assert!(c.handle(Request::GateStop).error.is_none());
    assert!(rm.disabled().is_empty());
    // A process labelled offline but named online is never frozen.
    let r = c.handle(Request::GateStart(Box::new(crate::protocol::GateSpec {
        online: vec![kid],
        offline_label: Some("batch".into()),
        ..Default::default()
    })));
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["offline_channels"], 0);
    assert!(c.handle(Request::GateStop).error.is_none());
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_dead_gate_thread_leaves_nothing_frozen_and_is_noticed() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, edges, me) = gated_core(&rm, dir.path(), true);
    assert!(c.handle(gate_spec(1, me)).error.is_none());
    // An online launch edge: the gate disables, then its launch source fails (panics) when
    // the cooldown check asks it for the latest launch.
    let tx = edges.lock().unwrap().clone().unwrap();
    tx.send(crate::gate::GateInput::Edge(valve_ebpf::LaunchEdge {
        pid: 1,
        graph: false,
        ts_ns: 1,
        idle_ns: 0,
        after_resume: false,
        quiet: false,
    }))
    .unwrap();
    wait_for("the gate thread dies", || {
        c.gate.as_ref().is_some_and(|g| g.handle_finished())
    });
    c.refresh_gate(Instant::now(), crate::gate::Rescan::IfDue);
    assert!(c.gate.is_none());
    assert!(rm.disabled().is_empty());
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
}

#[test]
fn a_restart_reenables_what_a_killed_daemon_gate_held() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    assert!(c.handle(gate_spec(1, me)).error.is_none());
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    wait_for("busy disables", || rm.disabled().len() == 4);
    // SIGKILL: neither the daemon nor the gate thread gets to clean up.
    let g = c.gate.take().unwrap();
    std::mem::forget(g);
    std::mem::forget(c);
    assert_eq!(rm.disabled().len(), 4);
    let second = core(&rm, dir.path(), None);
    assert_eq!(second.recovered, 4);
    assert!(rm.disabled().is_empty());
}

#[test]
fn a_truncated_state_file_and_journal_do_not_stop_the_daemon() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut first = core(&rm, dir.path(), None);
    for (pid, client) in [(PID_A, 0xc1d0_0010), (PID_A + 1, 0xc1d0_0020)] {
        for e in cuda_process(&rm, pid, client, &[0], 2) {
            first.on_event(&e);
        }
        let r = first.handle(Request::Preempt {
            pid,
            gpu: None,
            max_hold_ms: None,
            confirm: false,
        });
        assert!(r.error.is_none(), "{r:?}");
    }
    first.flush_journal().unwrap();
    std::mem::forget(first); // SIGKILL
    assert_eq!(rm.disabled().len(), 4);
    // The disk filled up mid-write: the second record and the journal's end are cut off.
    let state = dir.path().join("disabled.json");
    let text = std::fs::read_to_string(&state).unwrap();
    let second_record = text.rfind("\"pid\"").unwrap();
    std::fs::write(&state, &text[..second_record + 3]).unwrap();
    let journal = dir.path().join("registry.json");
    let jtext = std::fs::read_to_string(&journal).unwrap();
    std::fs::write(&journal, &jtext[..jtext.len() / 2]).unwrap();

    let mut second = core(&rm, dir.path(), None);
    // The whole record was re-enabled; the cut one could not be read.
    assert_eq!(second.recovered, 2);
    assert_eq!(rm.disabled().len(), 2);
    let salvage = second.state_salvage.clone().expect("the file was bad");
    assert_eq!(salvage.dropped, 1);
    assert!(salvage.moved_to.exists());
    assert!(dir.path().join("registry.json.corrupt").exists());
    assert!(second.restored.is_empty());
    // The daemon runs on a fresh, valid state file.
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
    let status = second.handle(Request::Status);
    assert_eq!(
        status.data_json()["state_file_moved_aside"],
        json!(salvage.moved_to),
        "status tells the operator where the bad file went"
    );
}

#[test]
fn the_configs_offline_rules_decide_who_may_be_frozen_by_hand_and_by_the_gate() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    // This test process is the CUDA process (alive, so /proc can be read).
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    let preempt = Request::Preempt {
        pid: me,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    };
    let only_batch = crate::config::OfflinePolicy {
        labels: vec!["batch-label-this-test-does-not-have".into()],
        ..Default::default()
    };
    c.set_policy(only_batch.clone(), GateSpec::default());
    let e = c.handle(preempt.clone()).error.expect("refused");
    assert_eq!(e.code, 4);
    assert!(
        e.message.contains("[offline] allows labels"),
        "{}",
        e.message
    );
    assert!(rm.disabled().is_empty());
    // The gate leaves it out of its offline set: busy freezes nothing.
    assert!(c.handle(gate_spec(1, me)).error.is_none());
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    c.refresh_gate(Instant::now(), crate::gate::Rescan::Now);
    assert!(c.gate.as_ref().unwrap().records().is_empty());
    assert!(rm.disabled().is_empty());
    assert!(c.handle(Request::GateStop).error.is_none());
    // Allowed by uid: frozen.
    let my_uid = crate::config::OfflinePolicy {
        uids: vec![nix::unistd::getuid().as_raw()],
        ..only_batch
    };
    c.set_policy(my_uid, GateSpec::default());
    assert!(c.handle(preempt).error.is_none());
    assert_eq!(rm.disabled().len(), 4);
    assert!(c.handle(Request::Resume { pid: me }).error.is_none());
}

#[test]
fn a_gate_started_again_for_the_same_service_starts_its_hold_from_the_last_one_s_gaps() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    let spec = |hold: Option<f64>| GateSpec {
        online: vec![1],
        offline: vec![me],
        hold_budget_pct: hold,
        ..GateSpec::default()
    };
    let key = ActiveGate::history_key_of(&spec(None));
    let history = crate::gate::policy::HoldHistory {
        gaps: (1..=20).map(|i| i * 1_000_000).collect(),
        last_activity_ns: None,
    };
    let now = crate::memory::server::warm::unix_now;
    // Kept an hour ago (within the 24 h they are good for).
    c.hold_histories
        .keep(key.clone(), history.clone(), now() - 3600);
    let gaps_now = |c: &mut DaemonCore<Arc<FakeRm>>| {
        c.handle(Request::GateStatus).data_json()["hold_gaps"].clone()
    };
    let file = dir.path().join(crate::gate::hold_history::FILE_NAME);

    // Without a hold the gaps are not handed over, and stay as they were.
    let r = c.handle(Request::GateStart(Box::new(spec(None))));
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(gaps_now(&mut c), 0);
    assert!(c.handle(Request::GateStop).error.is_none());
    assert_eq!(
        c.hold_histories.for_service(&key, now()).unwrap().0,
        history
    );
    assert!(!file.exists(), "a gate that learned nothing writes nothing");

    // With one, the new gate starts from them, and hands them back when it stops.
    let r = c.handle(Request::GateStart(Box::new(spec(Some(8.0)))));
    assert!(r.error.is_none(), "{r:?}");
    wait_for("the gaps handed over", || gaps_now(&mut c) == 20);
    assert!(c.handle(Request::GateStop).error.is_none());
    let (kept, age_s) = c.hold_histories.for_service(&key, now()).unwrap();
    assert_eq!(kept.gaps, history.gaps);
    assert!(age_s < 60, "kept again by the stop: {age_s} s");

    // A daemon started again on the same state directory has them.
    drop(c);
    let (mut c, _, _) = gated_core(&rm, dir.path(), false);
    let r = c.handle(Request::GateStart(Box::new(spec(Some(8.0)))));
    assert!(r.error.is_none(), "{r:?}");
    wait_for("the gaps handed over after a restart", || {
        gaps_now(&mut c) == 20
    });
    assert!(c.handle(Request::GateStop).error.is_none());
}

#[test]
fn gate_defaults_fill_what_a_gate_start_leaves_out() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    let defaults = GateSpec {
        offline_label: Some("batch".into()),
        gap_factor: Some(0.5),
        ..GateSpec::default()
    };
    c.set_policy(Default::default(), defaults);
    // The default's bad gap factor is applied (and refused) when the request has none...
    let e = c.handle(gate_spec(1, me)).error.expect("refused");
    assert!(e.message.contains("at least 1"), "{}", e.message);
    // ...and a request's own value wins.
    let own = Request::GateStart(Box::new(GateSpec {
        online: vec![1],
        gap_factor: Some(2.0),
        ..GateSpec::default()
    }));
    let r = c.handle(own);
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["offline_label"], "batch", "{r:?}");
    assert!(c.handle(Request::GateStop).error.is_none());
    // The same for the gap memory (0 is refused).
    c.set_policy(
        Default::default(),
        GateSpec {
            gap_memory_ms: Some(0),
            ..GateSpec::default()
        },
    );
    let e = c.handle(gate_spec(1, me)).error.expect("refused");
    assert!(e.message.contains("--gap-memory"), "{}", e.message);
}

#[test]
fn a_manual_preempt_and_resume_while_the_gate_holds_offline_touch_no_channel() {
    // The memory pool freezes an offline process by pid for a reclaim, usually while the gate
    // already holds it frozen (online is busy). Taking it over and handing it back must not
    // disable it twice or enable it only for the gate to disable it again.
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    assert!(c.handle(gate_spec(1, me)).error.is_none());
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    wait_for("busy disables", || rm.disabled().len() == 4);
    let calls = |rm: &FakeRm| rm.state.lock().unwrap().disable_calls.clone();
    let before = calls(&rm);
    let r = c.handle(Request::Preempt {
        pid: me,
        gpu: None,
        max_hold_ms: Some(2000),
        confirm: false,
    });
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["from_gate"], true, "{r:?}");
    assert_eq!(r.data_json()["timing_us"]["disable"], 0, "{r:?}");
    assert!(r.data_json()["timing_us"]["gate"].is_u64(), "{r:?}");
    assert_eq!(calls(&rm), before, "taken over as it was: no ioctl");
    assert_eq!(rm.disabled().len(), 4);
    let r = c.handle(Request::Resume { pid: me });
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["to_gate"], true, "{r:?}");
    assert_eq!(
        calls(&rm),
        before,
        "handed back frozen: no enable, no disable"
    );
    assert_eq!(rm.disabled().len(), 4);
    assert_eq!(
        c.handle(Request::GateStatus).data_json()["offline_channels"],
        4
    );
    // The gate owns it again: its resume enables it, its next preempt disables it.
    assert!(c.handle(Request::OnlineIdle).error.is_none());
    wait_for("idle enables", || rm.disabled().is_empty());
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    wait_for("busy disables", || rm.disabled().len() == 4);
    // Preempted by hand while offline runs: the daemon disables it itself, and hands it back
    // disabled; the gate, not holding offline, enables it.
    assert!(c.handle(Request::OnlineIdle).error.is_none());
    wait_for("idle enables", || rm.disabled().is_empty());
    let r = c.handle(Request::Preempt {
        pid: me,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert_eq!(r.data_json()["from_gate"], false, "{r:?}");
    assert!(r.data_json()["timing_us"]["record"].is_u64(), "{r:?}");
    assert_eq!(rm.disabled().len(), 4);
    assert!(c.handle(Request::Resume { pid: me }).error.is_none());
    assert!(rm.disabled().is_empty());
    assert!(c.handle(Request::GateStop).error.is_none());
    assert!(rm.disabled().is_empty());
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
}

#[test]
fn a_reclaim_preempt_of_a_gated_process_writes_no_state_file_and_the_next_turn_tidies_it() {
    // The state file already lists what the gate may disable, so the memory pool's preempt of
    // a gated process costs no write on its reclaim path; a write follows at the loop's turn.
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    assert!(c.handle(gate_spec(1, me)).error.is_none());
    let file = StateFile::in_dir(dir.path());
    assert_eq!(
        file.load().unwrap().len(),
        1,
        "the gate's offline set is recorded"
    );
    let writes = c.state.writes();
    for busy in [true, false] {
        let edge = if busy {
            Request::OnlineBusy
        } else {
            Request::OnlineIdle
        };
        assert!(c.handle(edge).error.is_none());
        let want = if busy { 4 } else { 0 };
        wait_for("the gate's edge", || rm.disabled().len() == want);
        let r = c.handle(Request::Preempt {
            pid: me,
            gpu: None,
            max_hold_ms: None,
            confirm: false,
        });
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.data_json()["from_gate"], busy, "{r:?}");
        assert_eq!(c.state.writes(), writes, "no write while preempting");
        assert_eq!(file.load().unwrap().len(), 1, "still listed: {r:?}");
        assert!(c.handle(Request::Resume { pid: me }).error.is_none());
        assert_eq!(c.state.writes(), writes, "no write handing it back");
    }
    // A process the gate does not name is new to the file: written before the disable.
    for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &[0], 2) {
        c.on_event(&e);
    }
    let r = c.handle(Request::Preempt {
        pid: PID_B,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(c.state.writes(), writes + 1);
    assert!(file.load().unwrap().iter().any(|r| r.pid == PID_B));
    assert!(c.handle(Request::Resume { pid: PID_B }).error.is_none());
    // The resume wrote the exact set: the gate's process only.
    assert!(!c.state.is_stale());
    assert!(c.handle(Request::GateStop).error.is_none());
    c.expire(Instant::now());
    assert!(file.load().unwrap().is_empty());
}

#[test]
fn without_discovery_status_says_so_and_a_preempt_by_pid_names_the_switch() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut c = core(&rm, dir.path(), None);
    assert_eq!(c.handle(Request::Status).data_json()["discovery"], true);
    c.set_discovery_off();
    assert_eq!(c.handle(Request::Status).data_json()["discovery"], false);
    let r = c.handle(Request::Preempt {
        pid: std::process::id(),
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    });
    let e = r.error.unwrap();
    assert_eq!(e.code, EXIT_PROCESS);
    assert!(e.message.contains("--no-discovery"), "{}", e.message);
    assert!(rm.disabled().is_empty());
}

mod freeze;
mod gate_start;
mod mps;
mod online_restart;
