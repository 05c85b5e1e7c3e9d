//! `valvectl gate`: offline GPU work runs only while online work is idle. The policy decides; the
//! runtime runs it inside the daemon, fed by uprobes on libcuda's launch entry points.
//!
//! Online launches reach the runtime as idle->busy edges ([`valve_ebpf::LaunchWatcher`]); on an
//! edge it disables every offline channel on every GPU at once, and it enables them again once
//! online has been idle for the policy's cooldown, or when the serving framework says "idle".

pub mod policy;
pub mod runtime;

pub use policy::{Action, GateConfig, GatePolicy};
pub use runtime::{GateInput, GateRuntime, GateStatus, LaunchSource};
