//! Who a process is, for the gate's labels and the config's `[offline]` rules: its workload
//! label (`VALVE_LABEL`, else a Kubernetes pod label), uid, cgroup and pod UID, from `/proc`.
//!
//! A pod's labels reach the node through a downward-API volume that projects them to a file
//! named `labels`; the daemon finds it from the process's cgroup path (which names the pod UID)
//! under the kubelet's pod directory. No API server access is needed.

use std::cell::OnceCell;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The environment variable that labels a process for `--online-label` / `--offline-label`.
pub const LABEL_VAR: &str = "VALVE_LABEL";

/// Where pod labels come from (the config's `[kubernetes]` table).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodLabels {
    /// The pod label that holds the workload label (e.g. `valve.dev/workload`).
    pub key: String,
    /// The kubelet's pod directory (`/var/lib/kubelet/pods`).
    pub kubelet_pods_dir: PathBuf,
}

static POD_LABELS: OnceLock<PodLabels> = OnceLock::new();

/// Makes [`label_of`] fall back to pod labels (the daemon does this once, at start).
pub fn use_pod_labels(p: PodLabels) {
    let _ = POD_LABELS.set(p);
}

/// A process as the config's `[offline]` rules and the metrics see it: its label, uid and
/// cgroup, each read from `/proc` at most once, when first asked for (a preemption asks for
/// none of them before its disable unless the rules need them).
pub struct Workload {
    pid: u32,
    label: OnceCell<Option<String>>,
    uid: OnceCell<Option<u32>>,
    cgroup: OnceCell<Option<String>>,
}

impl Workload {
    /// Process `pid`; nothing is read yet.
    pub fn of(pid: u32) -> Self {
        Workload {
            pid,
            label: OnceCell::new(),
            uid: OnceCell::new(),
            cgroup: OnceCell::new(),
        }
    }

    /// The process's workload label ([`label_of`]).
    pub fn label(&self) -> Option<&str> {
        self.label.get_or_init(|| label_of(self.pid)).as_deref()
    }

    /// The process's real uid ([`process_uid`]).
    pub fn uid(&self) -> Option<u32> {
        *self.uid.get_or_init(|| process_uid(self.pid))
    }

    /// The process's cgroup path ([`process_cgroup`]).
    pub fn cgroup(&self) -> Option<&str> {
        self.cgroup
            .get_or_init(|| process_cgroup(self.pid))
            .as_deref()
    }
}

/// `VALVE_LABEL` of a process, from its environment at exec (root can read any).
pub fn process_label(pid: u32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{LABEL_VAR}=");
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The workload label of `pid`: `VALVE_LABEL` in its environment, else (if configured) its
/// pod's label. Reads `/proc` and maybe a file: never call it before a disable.
pub fn label_of(pid: u32) -> Option<String> {
    process_label(pid).or_else(|| {
        let cfg = POD_LABELS.get()?;
        let uid = pod_uid(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)?;
        pod_label(&cfg.kubelet_pods_dir, &uid, &cfg.key)
    })
}

/// The pod UID in a `/proc/<pid>/cgroup` text, for the cgroupfs (`.../pod<uid>/<container>`)
/// and systemd (`...-pod<uid_with_underscores>.slice/...`) drivers.
pub fn pod_uid(cgroup: &str) -> Option<String> {
    cgroup
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .flat_map(|path| path.split('/'))
        .find_map(|seg| {
            let seg = seg.strip_suffix(".slice").unwrap_or(seg);
            let uid = seg
                .strip_prefix("pod")
                .or_else(|| seg.rfind("-pod").map(|i| &seg[i + 4..]))?;
            let uid = uid.replace('_', "-");
            let ok = uid.len() == 36
                && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
                && uid.matches('-').count() == 4;
            ok.then_some(uid)
        })
}

/// The unified (v2) cgroup path of a `/proc/<pid>/cgroup` text, else the first one listed.
pub fn cgroup_path(cgroup: &str) -> Option<String> {
    let paths: Vec<(&str, &str)> = cgroup
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let (id, _, path) = (it.next()?, it.next()?, it.next()?);
            Some((id, path))
        })
        .collect();
    paths
        .iter()
        .find(|(id, _)| *id == "0")
        .or(paths.first())
        .map(|(_, p)| p.to_string())
}

/// The real uid of a process.
pub fn process_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The cgroup path of a process (see [`cgroup_path`]).
pub fn process_cgroup(pid: u32) -> Option<String> {
    cgroup_path(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

/// The value of label `key` of pod `uid`, from a downward-API or projected volume of that pod
/// that has a `labels` file.
pub fn pod_label(kubelet_pods_dir: &Path, uid: &str, key: &str) -> Option<String> {
    let volumes = kubelet_pods_dir.join(uid).join("volumes");
    ["kubernetes.io~downward-api", "kubernetes.io~projected"]
        .iter()
        .filter_map(|kind| std::fs::read_dir(volumes.join(kind)).ok())
        .flat_map(|dir| dir.flatten())
        .filter_map(|vol| std::fs::read_to_string(vol.path().join("labels")).ok())
        .find_map(|text| downward_label(&text, key))
}

/// The value of `key` in a downward-API labels file (`key="value"` lines, Go-quoted).
pub fn downward_label(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        if k != key {
            return None;
        }
        let v = v.strip_prefix('"')?.strip_suffix('"')?;
        Some(v.replace("\\\"", "\"").replace("\\\\", "\\"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f3c9f6e-2b1a-4c55-9d2e-6a7b8c9d0e1f";

    #[test]
    fn the_pod_uid_comes_from_either_cgroup_driver() {
        let systemd = "0::/kubepods.slice/kubepods-besteffort.slice/\
                       kubepods-besteffort-pod0f3c9f6e_2b1a_4c55_9d2e_6a7b8c9d0e1f.slice/\
                       cri-containerd-4f1e.scope\n";
        assert_eq!(pod_uid(systemd).as_deref(), Some(UID));
        let cgroupfs = format!(
            "12:memory:/kubepods/burstable/pod{UID}/4f1e\n0::/kubepods/burstable/pod{UID}/4f1e\n"
        );
        assert_eq!(pod_uid(&cgroupfs).as_deref(), Some(UID));
        assert_eq!(
            cgroup_path(&cgroupfs).as_deref(),
            Some(format!("/kubepods/burstable/pod{UID}/4f1e").as_str())
        );
        assert_eq!(
            pod_uid("0::/user.slice/user-1000.slice/session-2.scope\n"),
            None
        );
        assert_eq!(pod_uid("0::/kubepods/podnot-a-uid/x\n"), None);
    }

    #[test]
    fn pod_labels_are_read_from_the_pods_downward_api_volume() {
        let dir = tempfile::tempdir().unwrap();
        let vol = dir
            .path()
            .join(UID)
            .join("volumes/kubernetes.io~downward-api/podinfo");
        std::fs::create_dir_all(&vol).unwrap();
        std::fs::write(
            vol.join("labels"),
            "app=\"trainer\"\nvalve.dev/workload=\"batch\"\nquoted=\"a\\\"b\"\n",
        )
        .unwrap();
        assert_eq!(
            pod_label(dir.path(), UID, "valve.dev/workload").as_deref(),
            Some("batch")
        );
        assert_eq!(
            pod_label(dir.path(), UID, "quoted").as_deref(),
            Some("a\"b")
        );
        assert_eq!(pod_label(dir.path(), UID, "missing"), None);
        assert_eq!(pod_label(dir.path(), "other-uid", "app"), None);
    }

    #[test]
    fn this_process_has_a_uid_and_a_cgroup() {
        let me = std::process::id();
        assert_eq!(process_uid(me), Some(nix::unistd::getuid().as_raw()));
        assert!(process_cgroup(me).is_some_and(|p| p.starts_with('/')));
        let who = Workload::of(me);
        assert_eq!(who.uid(), process_uid(me));
        assert_eq!(who.cgroup(), process_cgroup(me).as_deref());
        assert_eq!(who.label(), label_of(me).as_deref());
    }

    #[test]
    fn labels_come_from_the_environment() {
        // This test process has no label unless the environment gives it one.
        let me = std::process::id();
        assert_eq!(
            process_label(me),
            std::env::var(LABEL_VAR).ok(),
            "reads /proc/self/environ"
        );
        assert_eq!(process_label(u32::MAX), None);
    }
}
