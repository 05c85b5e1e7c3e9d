//! valve-ebpf: watches NVIDIA RM object creation (clients, devices, TSGs, channels) with BPF
//! on syscall tracepoints, and keeps a registry of which process owns which objects on which GPU.
//!
//! [`Watcher`] loads `src/bpf/rm_watch.bpf.c` and yields [`RmEvent`]s; [`Registry`] folds
//! them into per-process object trees and answers "which (client, channel) pairs does process
//! P have on GPU G". [`LaunchWatcher`] (uprobes on libcuda) and [`ArrivalWatcher`] (request data
//! on a port) tell the gate when online work starts.

pub mod arrival;
mod elf_symbols;
mod error;
pub mod event;
pub mod launch;
mod libbpf_log;
mod poll_thread;
pub mod realtime;
pub mod registry;
mod skel;
pub mod watcher;

pub use arrival::{
    enable_run_time_stats, ArrivalConfig, ArrivalCounts, ArrivalEdge, ArrivalWatcher, ProgramStats,
    StatsGuard, WatchedPort,
};
pub use error::WatchError;
pub use event::{AllocEvent, DecodeError, FreeEvent, RmEvent, RmEventKind};
pub use launch::{
    find_libcuda, LaunchConfig, LaunchCounts, LaunchEdge, LaunchWatcher, ProbeAck, REQUEST_POLL,
};
pub use realtime::Scheduling;
pub use registry::Registry;
pub use watcher::{WatchConfig, WatchStats, Watcher, NVIDIA_MAJOR};
