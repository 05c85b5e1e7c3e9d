//! Why a BPF watcher could not start ([`WatchError`]): shared by every watcher and the thread
//! they poll on, each message naming the fix.

use std::path::PathBuf;

use libbpf_rs::ErrorKind;

/// Why the BPF program could not be started. Each message names the fix.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// No kernel BTF: CO-RE cannot relocate the kernel struct fields the program reads.
    #[error("kernel BTF not found at {0}: the kernel needs CONFIG_DEBUG_INFO_BTF=y")]
    NoBtf(PathBuf),
    /// tracefs is not mounted (or not readable) and could not be mounted.
    #[error("tracefs is not mounted and mounting it failed ({0}): run `mount -t tracefs nodev /sys/kernel/tracing` as root, or run the watcher as root")]
    Tracefs(std::io::Error),
    /// A tracepoint the program needs does not exist in this kernel.
    #[error("tracepoint {0} not found under {1}: the kernel needs CONFIG_FTRACE_SYSCALLS=y (syscall tracepoints) and CONFIG_TRACEPOINTS")]
    MissingTracepoint(&'static str, PathBuf),
    /// The kernel refused to load or attach: not root, or BPF is restricted.
    #[error("the kernel refused the BPF program ({what}: {source}): run as root (or with CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN); check kernel.unprivileged_bpf_disabled and lockdown")]
    PermissionDenied {
        /// The step that failed.
        what: &'static str,
        /// The underlying error (libbpf's, or the OS error of mounting tracefs).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Loading or attaching failed for another reason (verifier, missing BPF syscall, ...).
    #[error("{what} failed: {source}: the kernel needs CONFIG_BPF_SYSCALL, CONFIG_BPF_EVENTS and BTF; run with RUST_LOG/LIBBPF debug output for the verifier log")]
    Bpf {
        /// The step that failed.
        what: &'static str,
        /// libbpf's error.
        source: libbpf_rs::Error,
    },
    /// The polling thread could not be started or died during start-up.
    #[error("the watcher thread failed to start: {0}")]
    Thread(String),
}

impl WatchError {
    pub(crate) fn bpf(what: &'static str, source: libbpf_rs::Error) -> WatchError {
        match source.kind() {
            ErrorKind::PermissionDenied => WatchError::PermissionDenied {
                what,
                source: Box::new(source),
            },
            _ => WatchError::Bpf { what, source },
        }
    }
}
