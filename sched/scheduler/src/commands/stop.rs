//! SIGINT and SIGTERM as a flag that long-running commands check between steps, so that they
//! finish the step, undo what they changed (a pool cap, a child job) and exit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to the flag.
pub fn install_signals() -> anyhow::Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for s in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe, and no
        // other code in this process installs handlers for these signals.
        unsafe { sigaction(s, &action) }?;
    }
    Ok(())
}

/// Whether a stop was asked for.
pub fn stopped() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Sleeps up to `d`, waking early on a stop.
pub fn nap(d: Duration) {
    let end = Instant::now() + d;
    while !stopped() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100).min(end - Instant::now()));
    }
}
