//! What `/proc` says about other processes: whether a pid runs, its name, every pid, and which
//! processes hold NVIDIA device files open (those the daemon cannot have watched).

use std::collections::BTreeSet;
use std::path::Path;

/// The process's command name (`/proc/<pid>/comm`), empty if it is gone.
pub fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Whether `pid` exists.
pub fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Every pid in `/proc`.
pub fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// Processes that have an NVIDIA device file open now (other than this one): at daemon start,
/// these are the ones whose RM objects the watcher never saw.
pub fn nvidia_users() -> BTreeSet<u32> {
    let me = std::process::id();
    let mut out = BTreeSet::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
            continue;
        };
        if fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .map(|t| t.to_string_lossy().starts_with("/dev/nvidia"))
                .unwrap_or(false)
        }) {
            out.insert(pid);
        }
    }
    out
}
