//! The signals that end a hold, a benchmark or the daemon (SIGINT, SIGTERM, SIGHUP), blocked and
//! read from a signalfd so that channels are always resumed before the process exits.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use crate::error::Error;

/// Signals that end a hold or a benchmark, blocked and read from a signalfd so that channels are
/// always resumed before exit.
pub struct Signals {
    fd: SignalFd,
}

impl Signals {
    /// Blocks SIGINT, SIGTERM and SIGHUP for this thread and threads it starts later.
    pub fn install() -> Result<Self, Error> {
        let mut mask = SigSet::empty();
        for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
            mask.add(s);
        }
        let os = |e: nix::Error| Error::Os {
            op: "setting up signal handling".into(),
            source: e.into(),
        };
        mask.thread_block().map_err(os)?;
        let fd = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
            .map_err(os)?;
        Ok(Signals { fd })
    }

    /// Waits until a signal arrives or `timeout` passes (`None`: forever).
    pub fn wait(&self, timeout: Option<Duration>) -> Option<Signal> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Ok(Some(info)) = self.fd.read_signal() {
                return Signal::try_from(info.ssi_signo as i32).ok();
            }
            let left = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    d - now
                }
                None => Duration::from_secs(60),
            };
            let ms = left.as_millis().clamp(1, 60_000) as u16;
            let mut fds = [nix::poll::PollFd::new(
                self.fd.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms));
        }
    }

    /// A signal that is already pending, without waiting.
    pub fn pending(&self) -> Option<Signal> {
        match self.fd.read_signal() {
            Ok(Some(info)) => Signal::try_from(info.ssi_signo as i32).ok(),
            _ => None,
        }
    }
}
