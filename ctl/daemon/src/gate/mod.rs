//! `valvectl gate`: offline GPU work runs only while online work is idle. The policy decides; the
//! runtime runs it inside the daemon, fed by uprobes on libcuda's launch entry points.
//!
//! Online launches reach the runtime as idle->busy edges ([`valve_ebpf::LaunchWatcher`]); on an
//! edge it disables every offline channel on every GPU at once, and it enables them again once
//! online has been idle for the policy's cooldown, or when the serving framework says "idle".
//!
//! [`policy`] decides (no I/O), [`runtime`] is the gate thread with its own RM client, and
//! [`supervisor`] is the daemon's side: which processes are online and offline, their channels
//! from the registry, recorded in the state file before the gate thread may disable them.

pub mod policy;
pub mod runtime;
pub mod supervisor;

pub use policy::{Action, GateConfig, GatePolicy};
pub use runtime::{GateInput, GateRuntime, GateStatus, LaunchSource};
pub use supervisor::{process_label, ActiveGate, GateStarter, GATE_EDGE_GAP, LABEL_VAR};
