//! A `gate start` under way (its gate thread held in the middle of its start): what the core
//! serves meanwhile, and that nothing is recorded, disabled or left running on any way out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::*;
use crate::protocol::GateSpec;

fn spec(online: u32, offline: u32) -> GateSpec {
    GateSpec {
        online: vec![online],
        offline: vec![offline],
        realtime_priority: Some(0),
        ..Default::default()
    }
}

fn code_of(r: Reply) -> Option<i32> {
    r.error.map(|e| e.code)
}

/// Polls a begun start until it answers (the helper thread has been let go).
fn finished(c: &mut DaemonCore<Arc<FakeRm>>) -> Reply {
    let mut reply = None;
    wait_for("the gate start's reply", || {
        reply = c.poll_gate_start();
        reply.is_some()
    });
    reply.unwrap()
}

#[test]
fn while_the_gate_starts_a_reclaims_freeze_and_thaw_are_served_and_a_stop_is_refused() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    let held = held_starter(&rm);
    c.set_gate_starter(held.starter.clone());
    c.begin_gate_start(spec(1, me), || {}).unwrap();
    held.entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the gate thread reaches its start");
    assert!(c.gate_starting());
    assert!(c.poll_gate_start().is_none(), "held: not finished");
    assert_eq!(c.handle(Request::GateStatus).data_json()["starting"], true);
    let code = |r: Reply| r.error.map(|e| e.code);
    assert_eq!(code(c.handle(Request::GateStop)), Some(1));
    assert_eq!(
        code(c.handle(gate_spec(1, me))),
        Some(1),
        "one start at a time"
    );
    // The memory pool's freeze and thaw, with the gate thread still in its start.
    let r = c.handle(Request::Preempt {
        pid: me,
        gpu: None,
        max_hold_ms: Some(2_000),
        confirm: false,
    });
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(rm.disabled().len(), 4);
    assert!(c.handle(Request::Resume { pid: me }).error.is_none());
    assert!(rm.disabled().is_empty());
    // A busy signal waits for the gate; nothing of the gate is recorded before it runs.
    let r = c.handle(Request::OnlineBusy);
    assert_eq!(r.data_json()["queued"], true, "{r:?}");
    let file = StateFile::in_dir(dir.path());
    assert!(file.load().unwrap().is_empty());
    held.release.send(()).unwrap();
    let r = finished(&mut c);
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(
        (
            r.data_json()["running"].clone(),
            r.data_json()["offline_channels"].clone()
        ),
        (serde_json::json!(true), serde_json::json!(4)),
        "{r:?}"
    );
    assert!(!c.gate_starting());
    assert!(file.load().unwrap().iter().any(|r| r.pid == me));
    wait_for("the kept busy signal disables offline", || {
        rm.disabled().len() == 4
    });
    assert!(c.handle(Request::GateStop).error.is_none());
    assert!(rm.disabled().is_empty());
    assert!(file.load().unwrap().is_empty());
}

#[test]
fn a_gate_that_fails_to_start_leaves_nothing_running_or_recorded() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    c.set_gate_starter(Arc::new(|_| Err("no libcuda".into())));
    c.begin_gate_start(spec(1, me), || {}).unwrap();
    let r = finished(&mut c);
    let e = r.error.expect("the start failed");
    assert_eq!(e.code, crate::protocol::EXIT_BPF);
    assert!(e.message.contains("no libcuda"), "{}", e.message);
    assert_eq!(
        c.handle(Request::GateStatus).data_json(),
        serde_json::json!({"running": false})
    );
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
    // A bad spec is refused on the loop, before any thread starts.
    let r = c.begin_gate_start(spec(1, 1), || {});
    assert_eq!(r.unwrap_err().error.unwrap().code, 2);
    assert!(!c.gate_starting());
    // And a good start afterwards works.
    let (starter, _) = fake_starter(&rm, false);
    c.set_gate_starter(starter);
    assert!(c.handle(gate_spec(1, me)).error.is_none());
    assert!(c.handle(Request::GateStop).error.is_none());
}

#[test]
fn a_shutdown_while_the_gate_starts_waits_for_it_then_stops_it() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    let held = held_starter(&rm);
    c.set_gate_starter(held.starter.clone());
    c.begin_gate_start(spec(1, me), || {}).unwrap();
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    held.entered.recv_timeout(Duration::from_secs(10)).unwrap();
    held.release.send(()).unwrap();
    let r = c.shutdown();
    assert!(r.error.is_none(), "{r:?}");
    assert!(!c.gate_starting() && c.gate.is_none());
    assert!(rm.disabled().is_empty(), "offline runs");
    assert!(StateFile::in_dir(dir.path()).load().unwrap().is_empty());
}

/// A launch source whose probes attach only once the test sets the flag.
struct HeldProbes(Arc<AtomicBool>);

impl crate::gate::LaunchSource for HeldProbes {
    fn watch(&mut self, _pid: u32) -> Result<(), String> {
        Ok(())
    }
    fn unwatch(&mut self, _pid: u32) {}
    fn last_launch_ns(&self, _pid: u32) -> u64 {
        0
    }
    fn probes_attached(&mut self, _pid: u32) -> Result<bool, String> {
        Ok(self.0.load(Ordering::SeqCst))
    }
}

/// A gate starter whose online processes' probes attach when the returned flag is set.
fn held_probes_starter(rm: &Arc<FakeRm>) -> (crate::gate::GateStarter, Arc<AtomicBool>) {
    let (rm, attached) = (rm.clone(), Arc::new(AtomicBool::new(false)));
    let flag = attached.clone();
    let starter = Arc::new(move |cfg| {
        let (rm, flag) = (rm.clone(), flag.clone());
        crate::gate::runtime::spawn(cfg, move |_tx| {
            let ctl = Controller::with_driver(rm).map_err(|e| e.to_string())?;
            Ok((ctl, HeldProbes(flag)))
        })
    });
    (starter, attached)
}

/// Polls a begun start for `d`, as the loop would; asserts it does not answer meanwhile.
fn unanswered_for(c: &mut DaemonCore<Arc<FakeRm>>, d: Duration) {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < d {
        assert!(c.poll_gate_start().is_none(), "answered before the probes");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_gate_start_answers_only_once_its_online_probes_are_attached() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    let (starter, attached) = held_probes_starter(&rm);
    c.set_gate_starter(starter);
    c.begin_gate_start(spec(1, me), || {}).unwrap();
    unanswered_for(&mut c, Duration::from_millis(300));
    assert!(c.gate_starting());
    // The loop goes on serving: the installed gate's status says what it waits for.
    let st = c.handle(Request::GateStatus).data_json();
    assert_eq!(st["online_probes"]["1"], "attaching", "{st}");
    assert_eq!(st["online_probes_attached"], false);
    assert_eq!(
        code_of(c.handle(Request::GateStop)),
        Some(1),
        "still starting"
    );
    attached.store(true, Ordering::SeqCst);
    let r = finished(&mut c);
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["online_probes"]["1"], "attached", "{r:?}");
    assert_eq!(r.data_json()["online_probes_attached"], true);
    assert!(r.data_json().get("note").is_none(), "{r:?}");
    assert!(c.handle(Request::GateStop).error.is_none());
}

#[test]
fn a_gate_start_whose_probes_do_not_attach_in_time_answers_with_a_note() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    let (starter, _attached) = held_probes_starter(&rm);
    c.set_gate_starter(starter);
    c.set_probes_within(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    c.begin_gate_start(spec(1, me), || {}).unwrap();
    let r = finished(&mut c);
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "waited the bound"
    );
    assert!(r.error.is_none(), "the start still succeeds: {r:?}");
    let data = r.data_json();
    let note = data["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("online pid(s) [1] are not attached yet"),
        "{note}"
    );
    assert_eq!(r.data_json()["running"], true);
    assert_eq!(r.data_json()["online_probes_attached"], false);
    // The one-call start (tests) waits the same way.
    assert!(c.handle(Request::GateStop).error.is_none());
    let r = c.handle(gate_spec(1, me));
    assert!(r.data_json()["note"]
        .as_str()
        .unwrap_or_default()
        .contains("[1]"));
    assert!(c.handle(Request::GateStop).error.is_none());
}
