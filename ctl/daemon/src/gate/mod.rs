//! `valvectl gate`: offline GPU work runs only while online work is idle. The policy decides; the
//! runtime runs it inside the daemon, fed by uprobes on libcuda's launch entry points.
//!
//! Online requests reach the runtime as arrival edges ([`valve_ebpf::ArrivalWatcher`]: request
//! data on the service's port) and launches as idle->busy edges ([`valve_ebpf::LaunchWatcher`]);
//! on an edge it disables every offline channel on every GPU at once, and it enables them again
//! once online has been idle for the policy's cooldown, or when the serving framework says "idle".
//!
//! [`policy`] decides (no I/O), [`runtime`] is the gate thread with its own RM client,
//! [`trace`] its lock-free decision trace, [`ports`] finds a service's listening ports and the
//! processes behind a port, and [`supervisor`] is the daemon's side: which processes are online
//! and offline, their channels from the registry, recorded in the state file before the gate
//! thread may disable them.

pub mod hold_history;
pub mod policy;
pub mod ports;
pub mod runtime;
pub mod supervisor;
pub mod trace;
pub mod watchers;

pub use policy::{Action, GateConfig, GatePolicy};
pub use runtime::{GateInput, GateRuntime, GateShared, GateStatus, LaunchSource, ProbeState};
pub use supervisor::{ActiveGate, GateStarter, Rescan, GATE_EDGE_GAP, PROBES_WITHIN};
pub use trace::{TraceKind, TraceRecord, TraceRing};
// A process's label, by which `--online-label` and `--offline-label` name it.
pub use crate::workload::{process_label, LABEL_VAR};
