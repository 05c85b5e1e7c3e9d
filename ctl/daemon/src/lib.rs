//! Valve's node daemon (`valvectl daemon`, root, one per node): it watches every CUDA process's
//! RM objects with eBPF, keeps the registry of their channels, and serves pid-based preempt,
//! resume and the gate over a Unix socket.
//!
//! # What is inside
//!
//! - [`run`] starts it: root check, the driver, the eBPF watcher, recovery of what a previous
//!   run left disabled, the socket; then it serves until SIGINT/SIGTERM/SIGHUP and resumes
//!   everything before it returns.
//! - [`DaemonCore`] (`core`) is the logic without sockets or BPF: the registry, what is
//!   preempted, hold limits, the state file. Tests drive it with `valve::fake`.
//! - [`protocol`]: the request and reply types of the socket (one JSON line each way).
//! - [`journal`]: the RM events that built the registry, replayed after a restart.
//! - [`gate`]: `valvectl gate` (the policy, the gate thread and the daemon's side of it).
//!
//! Everything the daemon disables is written to the state file (`valve::state`) *before* the
//! disable, so a restarted daemon re-enables it even after a SIGKILL.
//!
//! # What comes next
//!
//! New roles of the daemon get a module here next to [`gate`], fed by [`DaemonCore`]:
//! - [`memory`]: the GPU memory pool (issue 10), not built yet;
//! - metrics (an exporter of the counters `status` and `gate status` report), not built yet;
//! - the arrival trigger (preempting on an online request's arrival from the network, before
//!   its first kernel launch), not built yet.

pub mod core;
pub mod gate;
pub mod journal;
pub mod memory;
pub mod protocol;

pub use crate::core::{
    nvidia_users, run, DaemonConfig, DaemonCore, DaemonError, EXIT_BPF, EXIT_NO_DAEMON,
    EXIT_PROCESS, EXIT_RM, GATE_EDGE_GAP,
};
