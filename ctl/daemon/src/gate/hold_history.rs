//! What stopped gates' holds learned, by the online service each served, so that a gate started
//! again for that service (also after a daemon restart) starts its hold from it (docs/gate.md).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::policy::{HoldHistory, HOLD_GAPS};

/// The file in the daemon's state directory (a tmpfs by default: a reboot clears it, as it
/// should, since the last activity is on the boot's monotonic clock).
pub const FILE_NAME: &str = "gate-hold-history.json";
/// The file format's version; a file of another version is not read.
const FORMAT_VERSION: u32 = 1;
/// A longer file is not read (16 services of 256 gaps take about 80 KiB).
const MAX_FILE_BYTES: u64 = 1 << 20;
/// The longest service name kept (longer ones are not kept, and refused when read).
const MAX_SERVICE_CHARS: usize = 1000;

/// Stopped gates' hold histories, by service ([`ActiveGate::history_key`](super::supervisor::ActiveGate::history_key)).
#[derive(Debug, Default)]
pub struct HoldHistories {
    kept: BTreeMap<String, Kept>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Kept {
    /// When the gate stopped, in seconds since the Unix epoch.
    saved_unix_s: u64,
    /// The boot it was kept in (`/proc/sys/kernel/random/boot_id`): the last activity is on
    /// that boot's monotonic clock, and means nothing on another.
    boot_id: String,
    history: HoldHistory,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileV1 {
    version: u32,
    services: BTreeMap<String, Kept>,
}

impl HoldHistories {
    /// Histories older than this start no gate.
    pub const MAX_AGE_S: u64 = 24 * 3600;
    /// The most services kept; past it the one kept longest ago goes.
    pub const MAX_SERVICES: usize = 16;

    /// Keeps a stopped gate's history for `service` at `now_unix_s`; whether it did (no gaps
    /// learned, or a service name too long: the earlier history stays).
    pub fn keep(&mut self, service: String, history: HoldHistory, now_unix_s: u64) -> bool {
        if history.gaps.is_empty() || service.chars().count() > MAX_SERVICE_CHARS {
            return false;
        }
        let kept = Kept {
            saved_unix_s: now_unix_s,
            boot_id: boot_id(),
            history,
        };
        self.kept.insert(service, kept);
        while self.kept.len() > Self::MAX_SERVICES {
            let oldest = self
                .kept
                .iter()
                .min_by_key(|(_, k)| k.saved_unix_s)
                .map(|(s, _)| s.clone());
            match oldest {
                Some(s) => self.kept.remove(&s),
                None => break,
            };
        }
        true
    }

    /// The history kept for `service` and its age in seconds, unless older than
    /// [`Self::MAX_AGE_S`]. Kept in another boot, it comes without its last activity.
    pub fn for_service(&self, service: &str, now_unix_s: u64) -> Option<(HoldHistory, u64)> {
        let kept = self.kept.get(service)?;
        let age = now_unix_s.saturating_sub(kept.saved_unix_s);
        if age > Self::MAX_AGE_S {
            return None;
        }
        let mut history = kept.history.clone();
        if kept.boot_id != boot_id() {
            history.last_activity_ns = None;
        }
        Some((history, age))
    }

    /// Reads the file at `path`. A missing file is an empty history; one that cannot be read,
    /// is too large, of another version, or holds values out of range is ignored whole, with
    /// the reason returned for the log (the next save replaces it).
    pub fn load(path: &Path) -> (HoldHistories, Option<String>) {
        match Self::read(path) {
            Ok(h) => (h, None),
            Err(why) => (
                HoldHistories::default(),
                Some(format!(
                    "{}: {why}; every gate's hold starts from nothing (the file is replaced at \
                     the next `gate stop`)",
                    path.display()
                )),
            ),
        }
    }

    fn read(path: &Path) -> Result<HoldHistories, String> {
        let len = match std::fs::metadata(path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(HoldHistories::default())
            }
            Err(e) => return Err(e.to_string()),
        };
        if len > MAX_FILE_BYTES {
            return Err(format!("{len} bytes, more than {MAX_FILE_BYTES}"));
        }
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        let file: FileV1 = serde_json::from_str(&text).map_err(|e| format!("not valid: {e}"))?;
        if file.version != FORMAT_VERSION {
            return Err(format!(
                "version {} (this daemon reads {FORMAT_VERSION})",
                file.version
            ));
        }
        if file.services.len() > Self::MAX_SERVICES {
            return Err(format!(
                "{} services, more than {}",
                file.services.len(),
                Self::MAX_SERVICES
            ));
        }
        for (service, kept) in &file.services {
            if service.chars().count() > MAX_SERVICE_CHARS || kept.history.gaps.len() > HOLD_GAPS {
                return Err("a service name or its gaps are longer than a daemon writes".into());
            }
        }
        Ok(HoldHistories {
            kept: file.services,
        })
    }

    /// Writes the file at `path` (a temporary file beside it, renamed over it: a reader sees the
    /// old one or the new one). No fsync, as for the state file and the registry journal: it is
    /// written on the daemon's loop, and a crash that loses it costs only the hold's history.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let file = FileV1 {
            version: FORMAT_VERSION,
            services: self.kept.clone(),
        };
        let bytes = serde_json::to_vec(&file).map_err(std::io::Error::other)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    }
}

/// This boot's id (empty where the kernel does not say).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(gaps: Vec<u64>) -> HoldHistory {
        HoldHistory {
            gaps,
            last_activity_ns: Some(7),
        }
    }

    #[test]
    fn a_history_is_kept_by_service_for_a_day_and_the_most_recent_services_only() {
        let mut h = HoldHistories::default();
        assert!(h.for_service("a", 1000).is_none());
        assert!(h.keep("a".into(), history(vec![5, 6]), 1000));
        assert!(!h.keep("a".into(), history(vec![]), 1001));
        assert_eq!(
            h.for_service("a", 1010),
            Some((history(vec![5, 6]), 10)),
            "a stop with no gaps keeps the earlier ones"
        );
        assert!(h.for_service("b", 1010).is_none());
        assert!(
            h.for_service("a", 1000 + HoldHistories::MAX_AGE_S + 1)
                .is_none(),
            "too old"
        );
        assert!(!h.keep("x".repeat(MAX_SERVICE_CHARS + 1), history(vec![1]), 1000));
        assert!(h
            .for_service(&"x".repeat(MAX_SERVICE_CHARS + 1), 1000)
            .is_none());
        for i in 0..HoldHistories::MAX_SERVICES {
            h.keep(format!("k{i}"), history(vec![1]), 2000 + i as u64);
        }
        assert!(
            h.for_service("a", 2000).is_none(),
            "the one kept longest ago went"
        );
        assert!(h.for_service("k0", 2000).is_some());
    }

    #[test]
    fn a_saved_history_reads_back_and_another_boot_s_comes_without_its_last_activity() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join(FILE_NAME);
        let (h, warn) = HoldHistories::load(&path);
        assert!(
            h.kept.is_empty() && warn.is_none(),
            "no file: empty, no warning"
        );
        let mut h = HoldHistories::default();
        h.keep("ports=8000 label= pids=".into(), history(vec![5, 6]), 1000);
        h.save(&path).unwrap();
        let (back, warn) = HoldHistories::load(&path);
        assert!(warn.is_none(), "{warn:?}");
        assert_eq!(
            back.for_service("ports=8000 label= pids=", 1000),
            Some((history(vec![5, 6]), 0))
        );
        let mut other_boot = back;
        other_boot
            .kept
            .values_mut()
            .for_each(|k| k.boot_id = "another".into());
        let (got, _) = other_boot
            .for_service("ports=8000 label= pids=", 1000)
            .unwrap();
        assert_eq!(got.gaps, vec![5, 6]);
        assert_eq!(got.last_activity_ns, None);
    }

    #[test]
    fn a_corrupt_or_foreign_file_is_ignored_with_a_reason_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let long_gaps = format!(
            r#"{{"version":1,"services":{{"a":{{"saved_unix_s":1,"boot_id":"","history":{{"gaps":[{}],"last_activity_ns":null}}}}}}}}"#,
            vec!["1"; HOLD_GAPS + 1].join(",")
        );
        for (bad, why) in [
            ("{ not json".to_string(), "not valid"),
            (r#"{"version":2,"services":{}}"#.to_string(), "version 2"),
            (
                r#"{"version":1,"services":{},"extra":1}"#.to_string(),
                "not valid",
            ),
            (long_gaps, "longer than a daemon writes"),
            ("x".repeat(MAX_FILE_BYTES as usize + 1), "more than"),
        ] {
            std::fs::write(&path, &bad).unwrap();
            let (h, warn) = HoldHistories::load(&path);
            assert!(h.kept.is_empty());
            let warn = warn.expect("a reason");
            assert!(warn.contains(why), "{warn}");
            assert!(warn.contains("starts from nothing"), "{warn}");
        }
    }
}
