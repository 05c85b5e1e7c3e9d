//! Every freeze checked: `preempt` with `confirm` reads the channels back before it answers,
//! a channel RM still reports enabled is named and never called frozen, and the pool's
//! freezes are checked on the checker thread and cancelled by their resume.

use super::*;
use crate::freeze_check::FreezeChecker;
use crate::protocol::{FreezeOutcome, PreemptReply};

fn preempt(c: &mut DaemonCore<Arc<FakeRm>>, confirm: bool) -> PreemptReply {
    let r = c.handle(Request::Preempt {
        pid: PID_A,
        gpu: None,
        max_hold_ms: None,
        confirm,
    });
    assert!(r.error.is_none(), "{r:?}");
    serde_json::from_value(r.data_json()).unwrap()
}

fn one_process(rm: &Arc<FakeRm>, dir: &Path) -> DaemonCore<Arc<FakeRm>> {
    let mut c = core(rm, dir, None);
    let inst = c.controller().gpus()[0].device_instance;
    for e in cuda_process(rm, PID_A, 0xc1d0_0010, &[inst], 4) {
        c.on_event(&e);
    }
    c
}

#[test]
fn a_confirmed_preempt_says_rm_reports_every_channel_disabled() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut c = one_process(&rm, dir.path());
    let p = preempt(&mut c, true);
    let check = p.freeze.expect("a confirm preempt carries its check");
    assert_eq!(check.outcome, FreezeOutcome::Confirmed, "{check:?}");
    assert_eq!((check.checked, check.channels), (4, 4));
    assert_eq!(c.status().freeze_checks.confirmed, 1);
}

#[test]
fn a_channel_the_disable_did_not_reach_makes_the_preempt_not_frozen() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut c = one_process(&rm, dir.path());
    let victim = *rm
        .state
        .lock()
        .unwrap()
        .channels
        .keys()
        .max()
        .expect("channels registered");
    rm.state.lock().unwrap().ignore_disable.insert(victim);
    let check = preempt(&mut c, true).freeze.unwrap();
    assert_eq!(check.outcome, FreezeOutcome::Running);
    assert_eq!(
        check.running,
        vec![format!("{:x}:{:x}", victim.0 .0, victim.1 .0)]
    );
    let counts = c.status().freeze_checks;
    assert_eq!((counts.confirmed, counts.running), (0, 1));
}

#[test]
fn the_pools_freezes_are_checked_off_the_loop_and_answered_at_once() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let mut c = one_process(&rm, dir.path());
    let checker_ctl = Controller::with_driver(rm.clone()).unwrap();
    c.set_freeze_checker(FreezeChecker::start(checker_ctl, c.freeze_recorder()));
    let p = preempt(&mut c, false);
    assert!(p.freeze.is_none(), "the pool does not wait for the check");
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.status().freeze_checks.confirmed == 0 {
        assert!(
            Instant::now() < deadline,
            "the checker never booked the freeze"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let r = c.handle(Request::Resume { pid: PID_A });
    assert!(r.error.is_none(), "{r:?}");
    let counts = c.status().freeze_checks;
    assert_eq!((counts.running, counts.unconfirmed), (0, 0));
}
