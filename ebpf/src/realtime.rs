//! Real-time scheduling for the threads that carry an online edge to the gate: the watchers'
//! poll threads and the gate thread wake within microseconds instead of waiting out a CPU's slice.
//!
//! Under EEVDF (Linux 6.6+) a woken normal thread does not preempt a busy CPU's current task
//! unless its deadline is earlier, so a wake-up can wait for the rest of a base slice (3.75 ms
//! on 16 CPUs). `SCHED_FIFO` threads preempt normal ones at once. These threads block almost
//! all the time, so a fixed priority costs the machine nothing; the kernel's RT throttling
//! still bounds a runaway one. Where the kernel refuses `SCHED_FIFO` (no `CAP_SYS_NICE`, or an
//! RT cgroup without budget), the thread asks for `SCHED_DEADLINE` (which RT group scheduling
//! does not cover), and where that is refused too, for a short EEVDF slice (Linux 6.12+, no
//! privilege needed): its earlier virtual deadline lets it preempt on wake-up, but not always.

use std::fmt;
use std::io;

/// The `SCHED_FIFO` priority Valve's edge threads use by default: above normal threads, far
/// below the kernel's own RT threads (the IRQ threads run at 50, watchdogs at 99).
pub const DEFAULT_PRIORITY: u8 = 10;

/// The slice asked for when `SCHED_FIFO` is refused: the kernel's shortest (0.1 ms).
pub const SHORT_SLICE_NS: u64 = 100_000;

/// The `SCHED_DEADLINE` reservation asked for when `SCHED_FIFO` is refused: up to
/// `DEADLINE_RUNTIME_NS` of CPU in every `DEADLINE_PERIOD_NS`. The runtime covers the longest
/// burst these threads have (a serial disable of 4 GPUs, about 3.2 ms), and `SCHED_FLAG_RECLAIM`
/// lets a longer one use bandwidth no other deadline task needs rather than be throttled.
pub const DEADLINE_RUNTIME_NS: u64 = 5_000_000;
/// See [`DEADLINE_RUNTIME_NS`]. Admission costs at most half a CPU per thread.
pub const DEADLINE_PERIOD_NS: u64 = 10_000_000;

/// How a thread ended up scheduled, for status output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scheduling {
    /// `SCHED_FIFO` at this priority.
    Fifo(u8),
    /// `SCHED_DEADLINE` with this runtime and period (ns), because `SCHED_FIFO` was refused (why).
    Deadline(u64, u64, String),
    /// The normal policy with a short EEVDF slice (ns), because `SCHED_FIFO` and
    /// `SCHED_DEADLINE` were refused (why).
    ShortSlice(u64, String),
    /// The normal policy, because real-time was turned off.
    Normal,
    /// The normal policy on a thread that spins instead of sleeping while it matters: it is
    /// not woken, so real-time scheduling would only throttle it.
    BusyPoll,
    /// The normal policy, because the kernel refused both (the reasons).
    Refused(String),
}

impl fmt::Display for Scheduling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scheduling::Fifo(p) => write!(f, "SCHED_FIFO {p}"),
            Scheduling::Deadline(runtime, period, why) => write!(
                f,
                "SCHED_DEADLINE {} of {} us (SCHED_FIFO refused: {why})",
                runtime / 1000,
                period / 1000
            ),
            Scheduling::ShortSlice(ns, why) => write!(
                f,
                "normal with a {} us slice (SCHED_FIFO and SCHED_DEADLINE refused: {why})",
                ns / 1000
            ),
            Scheduling::Normal => write!(f, "normal (real-time off)"),
            Scheduling::BusyPoll => write!(f, "normal, busy-polling while offline runs"),
            Scheduling::Refused(why) => write!(f, "normal (real-time refused: {why})"),
        }
    }
}

/// Puts the calling thread under `SCHED_FIFO` at `priority` (`None`: leaves it as it is),
/// else `SCHED_DEADLINE`, else a short slice. A refusal (no `CAP_SYS_NICE`, an RT cgroup without
/// budget, an affinity narrower than the CPUs' root domain) is reported, not an error: the
/// thread still works, only with normal wake-up latency.
pub fn apply_to_current_thread(priority: Option<u8>) -> Scheduling {
    let Some(priority) = priority else {
        return Scheduling::Normal;
    };
    let fifo = match set_fifo(priority) {
        Ok(()) => return Scheduling::Fifo(priority),
        Err(e) => refusal_reason(&e),
    };
    let deadline = match set_deadline(DEADLINE_RUNTIME_NS, DEADLINE_PERIOD_NS) {
        Ok(()) => {
            return Scheduling::Deadline(DEADLINE_RUNTIME_NS, DEADLINE_PERIOD_NS, fifo);
        }
        Err(e) => deadline_refusal_reason(&e),
    };
    let why = format!("{fifo}; SCHED_DEADLINE: {deadline}");
    match set_short_slice(SHORT_SLICE_NS) {
        Ok(()) => Scheduling::ShortSlice(SHORT_SLICE_NS, why),
        Err(e) => Scheduling::Refused(format!("{why}; a short slice: {e}")),
    }
}

/// `struct sched_attr` as of Linux 3.14 (`SCHED_ATTR_SIZE_VER0`, 48 bytes); `sched_runtime`
/// on `SCHED_OTHER` sets the thread's EEVDF slice from Linux 6.12.
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
}

fn set_short_slice(slice_ns: u64) -> io::Result<()> {
    set_attr(SchedAttr {
        sched_policy: libc::SCHED_OTHER as u32,
        sched_runtime: slice_ns,
        ..SchedAttr::default()
    })
}

fn set_deadline(runtime_ns: u64, period_ns: u64) -> io::Result<()> {
    // Reset-on-fork: a deadline thread could not otherwise start threads (its children start on
    // the normal policy). Reclaim: a burst may use runtime no other deadline task needs.
    set_attr(SchedAttr {
        sched_policy: libc::SCHED_DEADLINE as u32,
        sched_flags: (libc::SCHED_FLAG_RESET_ON_FORK | libc::SCHED_FLAG_RECLAIM) as u64,
        sched_runtime: runtime_ns,
        sched_deadline: period_ns,
        sched_period: period_ns,
        ..SchedAttr::default()
    })
}

/// `sched_setattr(2)` on the calling thread, with `attr.size` filled in.
fn set_attr(mut attr: SchedAttr) -> io::Result<()> {
    attr.size = std::mem::size_of::<SchedAttr>() as u32;
    // SAFETY: sched_setattr(2) reads `size` bytes from a valid, initialised SchedAttr that
    // outlives the call; pid 0 names the calling thread; flags 0. It only changes that thread's
    // scheduling attributes (the kernel checks the privilege each policy needs).
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
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

fn deadline_refusal_reason(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) => "EPERM: it needs CAP_SYS_NICE and a CPU affinity that spans the \
             whole root domain (not so in a cpuset-limited container)"
            .into(),
        Some(libc::EBUSY) => "EBUSY: the CPUs' deadline bandwidth is spent".into(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's scheduling policy and priority, as the kernel reports them.
    fn current_thread_policy() -> io::Result<(i32, i32)> {
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

    /// The calling thread's `sched_attr`, as the kernel reports it.
    fn current_thread_attr() -> SchedAttr {
        let mut got = SchedAttr::default();
        // SAFETY: sched_getattr(2) writes at most `size` (48) bytes into `got`, which is valid
        // for writes for the whole call; pid 0 is the calling thread.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                0,
                &mut got as *mut SchedAttr,
                std::mem::size_of::<SchedAttr>() as u32,
                0,
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        got
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
            Scheduling::Deadline(runtime, period, why) => {
                assert!(!why.is_empty());
                let got = current_thread_attr();
                assert_eq!(got.sched_policy, libc::SCHED_DEADLINE as u32);
                assert_eq!((got.sched_runtime, got.sched_period), (runtime, period));
            }
            Scheduling::ShortSlice(_, why) | Scheduling::Refused(why) => {
                assert!(!why.is_empty());
                assert_eq!(current_thread_policy().unwrap().0, libc::SCHED_OTHER);
                eprintln!("SCHED_FIFO refused here ({why}); the applied case runs as root");
            }
            Scheduling::Normal | Scheduling::BusyPoll => {
                panic!("asked for FIFO, got the normal policy unasked")
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_short_slice_is_set_or_refused_with_a_reason() {
        assert_eq!(std::mem::size_of::<SchedAttr>(), 48, "SCHED_ATTR_SIZE_VER0");
        std::thread::spawn(|| match set_short_slice(SHORT_SLICE_NS) {
            Ok(()) => {
                assert_eq!(current_thread_policy().unwrap().0, libc::SCHED_OTHER);
                // The kernel reports the thread's slice back in sched_runtime.
                assert_eq!(current_thread_attr().sched_runtime, SHORT_SLICE_NS);
            }
            Err(e) => eprintln!("a short slice is refused here ({e}): a kernel before 6.12?"),
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_deadline_thread_reads_back_and_its_children_start_normal() {
        std::thread::spawn(|| {
            match set_deadline(DEADLINE_RUNTIME_NS, DEADLINE_PERIOD_NS) {
                Ok(()) => {
                    let got = current_thread_attr();
                    assert_eq!(got.sched_policy, libc::SCHED_DEADLINE as u32);
                    assert_eq!(got.sched_runtime, DEADLINE_RUNTIME_NS);
                    assert_eq!(got.sched_deadline, DEADLINE_PERIOD_NS);
                    assert_eq!(got.sched_period, DEADLINE_PERIOD_NS);
                    // Without reset-on-fork a deadline thread cannot create one (EAGAIN).
                    let child = std::thread::spawn(|| current_thread_policy().unwrap().0)
                        .join()
                        .unwrap();
                    assert_eq!(child, libc::SCHED_OTHER);
                }
                Err(e) => eprintln!(
                    "SCHED_DEADLINE refused here ({}); the applied case needs CAP_SYS_NICE",
                    deadline_refusal_reason(&e)
                ),
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_status_line_names_the_policy() {
        assert_eq!(Scheduling::Fifo(10).to_string(), "SCHED_FIFO 10");
        assert_eq!(
            Scheduling::ShortSlice(100_000, "EPERM".into()).to_string(),
            "normal with a 100 us slice (SCHED_FIFO and SCHED_DEADLINE refused: EPERM)"
        );
        assert_eq!(
            Scheduling::Deadline(5_000_000, 10_000_000, "EPERM".into()).to_string(),
            "SCHED_DEADLINE 5000 of 10000 us (SCHED_FIFO refused: EPERM)"
        );
        let refused = refusal_reason(&io::Error::from_raw_os_error(libc::EPERM));
        assert!(refused.contains("CAP_SYS_NICE"), "{refused}");
    }
}
