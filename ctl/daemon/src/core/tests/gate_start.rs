//! A `gate start` under way (its gate thread held in the middle of its start): what the core
//! serves meanwhile, and that nothing is recorded, disabled or left running on any way out.

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
    assert_eq!(c.handle(Request::GateStatus).data["starting"], true);
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
    });
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(rm.disabled().len(), 4);
    assert!(c.handle(Request::Resume { pid: me }).error.is_none());
    assert!(rm.disabled().is_empty());
    // A busy signal waits for the gate; nothing of the gate is recorded before it runs.
    let r = c.handle(Request::OnlineBusy);
    assert_eq!(r.data["queued"], true, "{r:?}");
    let file = StateFile::in_dir(dir.path());
    assert!(file.load().unwrap().is_empty());
    held.release.send(()).unwrap();
    let r = finished(&mut c);
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(
        (
            r.data["running"].clone(),
            r.data["offline_channels"].clone()
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
        c.handle(Request::GateStatus).data,
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
