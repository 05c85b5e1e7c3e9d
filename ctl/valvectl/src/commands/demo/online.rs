//! The demo's two workloads without a GPU: stand-in processes (real pids the daemon can read in
//! `/proc`) and the online server's launches, reported to the gate as the uprobe watcher would.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::{fork, getpid, ForkResult, Pid};
use valve::stats::monotonic_ns;
use valve_daemon::gate::{GateInput, LaunchSource};
use valve_daemon::GATE_EDGE_GAP;
use valve_ebpf::LaunchEdge;

use crate::error::CliError;

/// A child process named `name` that sleeps until it is killed: the pid a workload has. It is
/// killed when this drops, and by the kernel if the thread that started it ends first.
pub struct StandIn {
    pid: Pid,
}

impl StandIn {
    /// Forks the child.
    pub fn spawn(name: &'static CStr) -> Result<Self, CliError> {
        let parent = getpid();
        // SAFETY: the child only makes system calls that are async-signal-safe (prctl, getppid,
        // pause, _exit) until it is killed: it takes no lock another thread of ours could hold.
        match unsafe { fork() } {
            Ok(ForkResult::Child) => sleep_as(name, parent),
            Ok(ForkResult::Parent { child }) => Ok(StandIn { pid: child }),
            Err(e) => Err(CliError::Io(std::io::Error::other(format!(
                "starting the demo's stand-in process: {e}"
            )))),
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid.as_raw() as u32
    }
}

/// The child's whole life: take the workload's name, die with the parent, sleep.
fn sleep_as(name: &CStr, parent: Pid) -> ! {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and PR_SET_NAME a NUL-terminated string
    // (the kernel reads at most 16 bytes of it); neither touches this process's memory otherwise.
    // getppid, pause and _exit have no preconditions.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::prctl(libc::PR_SET_NAME, name.as_ptr());
        // The parent died before the death signal was set: nobody would kill us.
        if libc::getppid() != parent.as_raw() {
            libc::_exit(0);
        }
        loop {
            libc::pause();
        }
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = kill(self.pid, Signal::SIGKILL);
        let _ = waitpid(self.pid, None);
    }
}

/// The simulated online server's GPU activity, as the launch watcher's counters hold it.
#[derive(Default)]
struct Activity {
    /// CLOCK_MONOTONIC ns of its latest launch (0: none yet).
    last_launch_ns: AtomicU64,
    /// The gate armed the resume edge: the next launch is reported whatever its gap.
    armed: AtomicBool,
    /// The gate thread's input, once the gate has started.
    gate: Mutex<Option<Sender<GateInput>>>,
}

/// The simulated online server: [`OnlineServer::serve`] is one request's kernel launches,
/// reported to the gate as the uprobe watcher reports a real server's.
#[derive(Clone)]
pub struct OnlineServer {
    pid: u32,
    activity: Arc<Activity>,
}

/// How often a request's simulated iterations launch (a decode step's order of magnitude; each
/// gap is longer than the watcher's edge gap, so each iteration is an edge the policy learns).
const ITERATION: Duration = Duration::from_millis(2);

impl OnlineServer {
    /// The server of process `pid`; it launches nothing until asked to serve.
    pub fn new(pid: u32) -> Self {
        OnlineServer {
            pid,
            activity: Arc::default(),
        }
    }

    /// The launch source a gate thread watches it through; `gate` is that thread's input.
    pub fn launch_source(&self, gate: Sender<GateInput>) -> ServerLaunches {
        *self.activity.gate.lock().unwrap() = Some(gate);
        ServerLaunches(self.clone())
    }

    /// One request: launches every [`ITERATION`] for `busy`. As the uprobe watcher does, it
    /// reports each launch after [`GATE_EDGE_GAP`] of silence as an edge with its gap, and the
    /// first launch after the gate armed its resume whatever the gap.
    pub fn serve(&self, busy: Duration) {
        let start = Instant::now();
        loop {
            let now = monotonic_ns();
            let last = self.activity.last_launch_ns.swap(now, Ordering::SeqCst);
            let armed = self.activity.armed.swap(false, Ordering::SeqCst);
            let idle_ns = if last == 0 { 0 } else { now - last };
            let silent = last == 0 || idle_ns >= GATE_EDGE_GAP.as_nanos() as u64;
            if silent || armed {
                self.edge(now, idle_ns, armed && !silent);
            }
            if start.elapsed() >= busy {
                return;
            }
            std::thread::sleep(ITERATION);
        }
    }

    fn edge(&self, ts_ns: u64, idle_ns: u64, after_resume: bool) {
        if let Some(tx) = self.activity.gate.lock().unwrap().as_ref() {
            let _ = tx.send(GateInput::Edge(LaunchEdge {
                pid: self.pid,
                graph: false,
                ts_ns,
                idle_ns,
                after_resume,
                quiet: false,
            }));
        }
    }
}

/// [`OnlineServer`] as the gate thread's [`LaunchSource`].
pub struct ServerLaunches(OnlineServer);

impl LaunchSource for ServerLaunches {
    fn watch(&mut self, _pid: u32) -> Result<(), String> {
        Ok(())
    }
    fn unwatch(&mut self, _pid: u32) {}
    fn last_launch_ns(&self, pid: u32) -> u64 {
        if pid == self.0.pid {
            self.0.activity.last_launch_ns.load(Ordering::SeqCst)
        } else {
            0
        }
    }
    fn arm_resume(&self, now_ns: u64) {
        self.0.activity.armed.store(now_ns != 0, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stand_in_has_its_name_and_is_gone_once_dropped() {
        let s = StandIn::spawn(c"demo-test").unwrap();
        let comm = format!("/proc/{}/comm", s.pid());
        let t0 = Instant::now();
        // The child names itself after the fork.
        while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "demo-test" {
            assert!(t0.elapsed() < Duration::from_secs(5), "never named");
            std::thread::sleep(Duration::from_millis(5));
        }
        let pid = s.pid();
        drop(s);
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    }

    fn edges(rx: &std::sync::mpsc::Receiver<GateInput>) -> Vec<LaunchEdge> {
        rx.try_iter()
            .map(|i| match i {
                GateInput::Edge(e) => e,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn each_iteration_after_the_edge_gap_is_an_edge_with_its_gap() {
        let server = OnlineServer::new(42);
        let (tx, rx) = std::sync::mpsc::channel();
        let launches = server.launch_source(tx);
        assert_eq!(launches.last_launch_ns(42), 0);
        server.serve(Duration::from_millis(20));
        let first = edges(&rx);
        assert!(first.len() >= 2, "{first:?}");
        assert_eq!(
            (first[0].pid, first[0].idle_ns),
            (42, 0),
            "the first launch"
        );
        for e in &first[1..] {
            assert!(e.idle_ns >= ITERATION.as_nanos() as u64, "{e:?}");
            assert!(!e.after_resume);
        }
        assert_eq!(launches.last_launch_ns(42), first.last().unwrap().ts_ns);
    }

    #[test]
    fn a_launch_after_an_armed_resume_is_an_edge_whatever_its_gap() {
        let server = OnlineServer::new(42);
        let (tx, rx) = std::sync::mpsc::channel();
        let launches = server.launch_source(tx);
        // Launched just now: the next launch's gap is below the edge gap.
        server
            .activity
            .last_launch_ns
            .store(monotonic_ns(), Ordering::SeqCst);
        launches.arm_resume(monotonic_ns());
        server.serve(Duration::ZERO);
        let e = edges(&rx);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].after_resume && e[0].idle_ns < GATE_EDGE_GAP.as_nanos() as u64);
        // Disarmed (0): no edge without the gap.
        launches.arm_resume(0);
        server.serve(Duration::ZERO);
        assert!(edges(&rx).is_empty());
    }
}
