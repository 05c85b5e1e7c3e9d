//! Valve's node daemon (`valvectl daemon`, root, one per node): it watches every CUDA process's
//! RM objects with eBPF, keeps the registry of their channels, and serves pid-based preempt,
//! resume and the gate over a Unix socket.
//!
//! # What is inside
//!
//! - [`run()`] (`run.rs`) starts it: root and group checks, the driver, recovery of what a
//!   previous run left disabled, the eBPF watcher, the socket; it serves until SIGINT, SIGTERM or
//!   SIGHUP and resumes everything before it returns. `valvectl daemon` calls it.
//! - [`server`]: the control socket (who may connect) and the main loop.
//! - [`DaemonCore`] (`core.rs`): the logic without sockets or BPF: the registry, what is
//!   preempted, hold limits, the state file, the answer to each request. Tests drive it with the
//!   fake RM (`valve::fake`).
//! - [`protocol`]: the request and reply types of the socket (one JSON line each way) and the
//!   exit codes replies carry.
//! - [`journal`]: the RM events that built the registry, replayed after a restart.
//! - [`gate`]: `valvectl gate` (the policy, the gate thread and the daemon's side of it).
//! - [`procfs`]: what `/proc` says about other processes. [`error`]: why the daemon stopped.
//! - [`memory`]: the GPU memory pool: ledger, reclaim and the pool socket, started
//!   beside the control socket by [`run_with_pool`].
//! - [`config`]: the TOML config file and the `[offline]` rules; [`workload`]: a process's
//!   workload label (`VALVE_LABEL` or its Kubernetes pod's label), uid and cgroup.
//! - [`metrics`]: Prometheus metrics and their HTTP endpoint; [`audit`]: the audit trail.
//! - [`harvest`]: the node harvest profile: a thread that folds the gate's trace, the
//!   memory left to offline and the jobs' progress into the document a cluster scheduler reads.
//!
//! Everything the daemon disables is written to the state file (`valve::state`) *before* the
//! disable, so a restarted daemon re-enables it even after a SIGKILL.
//!
//! # What comes next
//!
//! New roles of the daemon get a module here beside [`gate`] and [`memory`], fed by
//! [`DaemonCore`], with their requests in [`protocol`] (the `valve-protocol` crate):
//! - the memory pool's metrics, registered through [`metrics::Metrics::with_registry`].
//!
//! The arrival trigger is part of [`gate`]: BPF sees an online request's data arrive
//! and the gate preempts before the request's first kernel launch; the gate records edge ->
//! offline stopped into [`metrics::Metrics::record_edge_to_stopped`] by edge kind.

pub mod audit;
pub mod config;
pub mod core;
pub mod error;
pub mod freeze_check;
pub mod gate;
pub mod harvest;
pub mod journal;
pub mod memory;
pub mod metrics;
pub mod mps;
pub mod procfs;
pub mod protocol;
pub mod run;
pub mod server;
pub mod workload;

pub use crate::core::DaemonCore;
pub use error::DaemonError;
pub use gate::GATE_EDGE_GAP;
pub use protocol::{EXIT_BPF, EXIT_MPS, EXIT_NO_DAEMON, EXIT_PROCESS, EXIT_RM};
pub use run::{run, run_with_pool, DaemonConfig, PoolSettings};
