use std::sync::Arc;
use std::time::Duration;

use valve::controller::PreemptMode;
use valve::fake::FakeRm;
use valve_ioctl_bindings::ClientHandle;

use super::*;

fn setup(n: u32) -> (Arc<FakeRm>, Controller<Arc<FakeRm>>, Vec<ChannelTarget>) {
    let rm = Arc::new(FakeRm::host(1));
    let targets = rm.process_on_first_gpu(ClientHandle(0xc1d0_0200), 0x5c00_0010, n);
    let ctl = Controller::with_driver(rm.clone()).unwrap();
    (rm, ctl, targets)
}

#[test]
fn a_freeze_rm_reports_complete_is_confirmed() {
    let (_rm, ctl, targets) = setup(3);
    let plan = ctl.plan(&targets, PreemptMode::Preempt).unwrap();
    let _g = ctl.disable(&plan).unwrap().keep_disabled();
    let c = check(&ctl, &targets, Instant::now(), &AtomicBool::new(false));
    assert_eq!(c.outcome, FreezeOutcome::Confirmed, "{c:?}");
    assert_eq!((c.checked, c.channels), (3, 3));
}

#[test]
fn a_channel_left_running_is_named_and_never_called_frozen() {
    let (rm, ctl, targets) = setup(4);
    rm.state
        .lock()
        .unwrap()
        .ignore_disable
        .insert((targets[2].client, targets[2].channel));
    let plan = ctl.plan(&targets, PreemptMode::Preempt).unwrap();
    let _g = ctl.disable(&plan).unwrap().keep_disabled();
    let c = check(&ctl, &targets, Instant::now(), &AtomicBool::new(false));
    assert_eq!(c.outcome, FreezeOutcome::Running);
    assert_eq!(c.running, vec!["c1d00200:5c000012".to_string()]);
    assert_eq!(c.checked, 3, "the check stops at the running channel");
}

#[test]
fn without_channel_state_a_freeze_is_unconfirmed_not_frozen() {
    let (rm, ctl, targets) = setup(2);
    rm.state.lock().unwrap().refuse_diag = true;
    let plan = ctl.plan(&targets, PreemptMode::Preempt).unwrap();
    let _g = ctl.disable(&plan).unwrap().keep_disabled();
    let c = check(&ctl, &targets, Instant::now(), &AtomicBool::new(false));
    assert_eq!(c.outcome, FreezeOutcome::Unconfirmed);
    assert!(c.reason.unwrap().contains("diag"));
}

#[test]
fn a_resume_ends_the_check_without_reading_the_re_enabled_channels() {
    let (rm, ctl, targets) = setup(2);
    let c = check(&ctl, &targets, Instant::now(), &AtomicBool::new(true));
    assert_eq!(c.outcome, FreezeOutcome::ResumedFirst);
    assert_eq!(c.checked, 0);
    assert_eq!(rm.state.lock().unwrap().state_reads, 0);
}

#[test]
fn the_thread_checks_queued_freezes_and_books_every_outcome() {
    let (rm, ctl, targets) = setup(2);
    let other = Controller::with_driver(rm.clone()).unwrap();
    let recorder = FreezeRecorder::new(None);
    let checker = FreezeChecker::start(other, recorder.clone());
    let plan = ctl.plan(&targets, PreemptMode::Preempt).unwrap();
    let guard = ctl.disable(&plan).unwrap();
    checker.submit(Origin::Pool, 42, targets.clone().into(), Instant::now());
    wait_for(|| recorder.counts().confirmed == 1);
    guard.enable().unwrap();
    // Enabled again: a check now would see them running, and says so.
    checker.submit(Origin::Gate, 0, targets.clone().into(), Instant::now());
    wait_for(|| recorder.counts().running == 1);
    let counts = recorder.counts();
    assert_eq!((counts.unconfirmed, counts.resumed_first), (0, 0));
}

#[test]
fn a_freeze_shorter_than_the_wait_is_never_read_back() {
    let (rm, ctl, targets) = setup(2);
    let recorder = FreezeRecorder::new(None);
    let checker = FreezeChecker::start(
        Controller::with_driver(rm.clone()).unwrap(),
        recorder.clone(),
    );
    let plan = ctl.plan(&targets, PreemptMode::Preempt).unwrap();
    let guard = ctl.disable(&plan).unwrap();
    let cancel = checker.submit(Origin::Pool, 7, targets.clone().into(), Instant::now());
    cancel.store(true, Ordering::Release); // the reclaim resumed it at once
    guard.enable().unwrap();
    wait_for(|| recorder.counts().resumed_first == 1);
    assert_eq!(
        rm.state.lock().unwrap().state_reads,
        0,
        "no RM call for a short freeze"
    );
}

fn wait_for(mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(2));
    }
}
