//! Real-time scheduling for the threads that carry an online edge to the gate: the watchers'
//! poll threads and the gate thread wake within microseconds instead of waiting out a CPU's slice.
//!
//! Under EEVDF (Linux 6.6+) a woken normal thread does not preempt a busy CPU's current task
//! unless its deadline is earlier, so a wake-up can wait for the rest of a base slice (3.75 ms
//! on 16 CPUs). `SCHED_FIFO` threads preempt normal ones at once. These threads block almost
//! all the time, so a fixed priority costs the machine nothing; the kernel's RT throttling
//! still bounds a runaway one.

use std::fmt;
use std::io;

/// The `SCHED_FIFO` priority Valve's edge threads use by default: above normal threads, far
/// below the kernel's own RT threads (the IRQ threads run at 50, watchdogs at 99).
pub const DEFAULT_PRIORITY: u8 = 10;

/// How a thread ended up scheduled, for status output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scheduling {
    /// `SCHED_FIFO` at this priority.
    Fifo(u8),
    /// The normal policy, because real-time was turned off.
    Normal,
    /// The normal policy, because the kernel refused real-time (the reason).
    Refused(String),
}

impl fmt::Display for Scheduling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scheduling::Fifo(p) => write!(f, "SCHED_FIFO {p}"),
            Scheduling::Normal => write!(f, "normal (real-time off)"),
            Scheduling::Refused(why) => write!(f, "normal (SCHED_FIFO refused: {why})"),
        }
    }
}

/// Puts the calling thread under `SCHED_FIFO` at `priority` (`None`: leaves it as it is).
/// A refusal (no `CAP_SYS_NICE`, an RT cgroup without budget) is reported, not an error: the
/// thread still works, only with normal wake-up latency.
pub fn apply_to_current_thread(priority: Option<u8>) -> Scheduling {
    let Some(priority) = priority else {
        return Scheduling::Normal;
    };
    match set_fifo(priority) {
        Ok(()) => Scheduling::Fifo(priority),
        Err(e) => Scheduling::Refused(refusal_reason(&e)),
    }
}

fn set_fifo(priority: u8) -> io::Result<()> {
    let param = libc::sched_param {
        sched_priority: i32::from(priority.clamp(1, 99)),
    };
    // SAFETY: `param` is a valid, initialised sched_param that outlives the call; pid 0 names
    // the calling thread, and the call only changes that thread's scheduling attributes.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn refusal_reason(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) => "EPERM: the daemon needs CAP_SYS_NICE (in its unit or pod), and on \
             kernels with RT group scheduling a real-time budget in its cgroup"
            .into(),
        _ => e.to_string(),
    }
}

/// The calling thread's scheduling policy and priority, as the kernel reports them.
pub fn current_thread_policy() -> io::Result<(i32, i32)> {
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 names the calling thread; `param` is valid for writes for the whole call.
    let policy = unsafe { libc::sched_getscheduler(0) };
    if policy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::sched_getparam(0, &mut param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((policy, param.sched_priority))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_leaves_the_thread_alone() {
        std::thread::spawn(|| {
            let before = current_thread_policy().unwrap();
            assert_eq!(apply_to_current_thread(None), Scheduling::Normal);
            assert_eq!(current_thread_policy().unwrap(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn fifo_is_applied_or_the_refusal_is_named() {
        // Runs on a thread of its own: the policy must not leak into the test harness.
        std::thread::spawn(|| match apply_to_current_thread(Some(DEFAULT_PRIORITY)) {
            Scheduling::Fifo(p) => {
                assert_eq!(
                    current_thread_policy().unwrap(),
                    (libc::SCHED_FIFO, i32::from(p))
                );
            }
            Scheduling::Refused(why) => {
                assert!(!why.is_empty());
                assert_eq!(current_thread_policy().unwrap().0, libc::SCHED_OTHER);
                eprintln!("SCHED_FIFO refused here ({why}); the applied case runs as root");
            }
            Scheduling::Normal => panic!("asked for FIFO, got the normal policy unasked"),
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_status_line_names_the_policy() {
        assert_eq!(Scheduling::Fifo(10).to_string(), "SCHED_FIFO 10");
        let refused = refusal_reason(&io::Error::from_raw_os_error(libc::EPERM));
        assert!(refused.contains("CAP_SYS_NICE"), "{refused}");
    }
}
