//! The daemon's TOML config file (`valvectl daemon --config FILE`): socket group, hold limit,
//! metrics address, audit log, gate defaults, who may be frozen, pod labels, the harvest
//! profile; validated into [`FileConfig`] with errors that name the file, the key and what is
//! wrong.
//!
//! Command-line flags override the file (`valvectl daemon` merges them). See
//! `deploy/kubernetes/valve.yaml` for a complete example.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::protocol::GateSpec;
use crate::workload::{PodLabels, Workload};

/// A config problem: the file, the key (dotted, or a line number when the file does not
/// parse) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {key}: {problem}", file.display())]
pub struct ConfigError {
    /// The config file.
    pub file: PathBuf,
    /// The key, e.g. `gate.cooldown_floor`.
    pub key: String,
    /// What is wrong, and the fix.
    pub problem: String,
}

/// How the daemon logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (for log collectors).
    Json,
}

/// Who may be frozen (`[offline]`): a process must match one of the listed labels, uids or
/// cgroup prefixes. Empty lists allow every process the operator names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OfflinePolicy {
    /// Workload labels (`VALVE_LABEL` or the pod label).
    pub labels: Vec<String>,
    /// Real uids.
    pub uids: Vec<u32>,
    /// Cgroup path prefixes (whole path components).
    pub cgroups: Vec<String>,
}

/// The validated config file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileConfig {
    /// `group`: who besides root may use the socket.
    pub group: Option<String>,
    /// `max_hold`.
    pub max_hold: Option<Duration>,
    /// `state_dir`.
    pub state_dir: Option<PathBuf>,
    /// `audit_log`: JSON-lines file of audit records.
    pub audit_log: Option<PathBuf>,
    /// `log_format`.
    pub log_format: Option<LogFormat>,
    /// `metrics.address`.
    pub metrics_addr: Option<SocketAddr>,
    /// `[gate]` defaults for `gate start` fields a request leaves out.
    pub gate_defaults: GateSpec,
    /// `gate.autostart`: start a gate with the defaults when the daemon starts.
    pub gate_autostart: bool,
    /// `[offline]`.
    pub offline: OfflinePolicy,
    /// `[kubernetes]`: pod labels as workload labels.
    pub pod_labels: Option<PodLabels>,
    /// `[harvest]`: the node harvest profile.
    pub harvest: HarvestFileConfig,
}

/// The config's `[harvest]` table; what it leaves out has a default (`HarvestSettings`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HarvestFileConfig {
    /// `harvest.node_name`.
    pub node_name: Option<String>,
    /// `harvest.progress_dir`.
    pub progress_dir: Option<PathBuf>,
    /// `harvest.windows`, in seconds.
    pub windows_s: Option<Vec<u32>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    group: Option<String>,
    max_hold: Option<String>,
    state_dir: Option<PathBuf>,
    audit_log: Option<PathBuf>,
    log_format: Option<String>,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    gate: RawGate,
    #[serde(default)]
    offline: RawOffline,
    kubernetes: Option<RawKubernetes>,
    #[serde(default)]
    harvest: RawHarvest,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHarvest {
    node_name: Option<String>,
    progress_dir: Option<PathBuf>,
    windows: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    address: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGate {
    #[serde(default)]
    autostart: bool,
    online_label: Option<String>,
    offline_label: Option<String>,
    cooldown_floor: Option<String>,
    cooldown_ceiling: Option<String>,
    gap_factor: Option<f64>,
    gap_memory: Option<String>,
    fixed_cooldown: Option<String>,
    /// Percent of online's idle time a hold for likely arrivals may cost (`--hold-budget`).
    hold_budget: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOffline {
    #[serde(default)]
    labels: Vec<String>,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    cgroups: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKubernetes {
    pod_label: String,
    #[serde(default = "default_kubelet_pods_dir")]
    kubelet_pods_dir: PathBuf,
}

fn default_kubelet_pods_dir() -> PathBuf {
    PathBuf::from("/var/lib/kubelet/pods")
}

/// A duration such as `500ms`, `2s`, `100us`, `1.5m` (ns, us, ms, s, m, h; up to 7 days). The
/// config file wants the unit written out.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    parse_duration_with(s, false)
}

/// [`parse_duration`]; with `bare_is_seconds`, a number without a unit is seconds (the command
/// line's convention). The one duration parser of the daemon and `valvectl`.
pub fn parse_duration_with(s: &str, bare_is_seconds: bool) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (e.g. 500ms, 2s, 100us)"))?;
    let scale = match unit.trim() {
        "" if bare_is_seconds => 1.0,
        "" => return Err(format!("'{s}' has no unit: write e.g. {s}s or {s}ms")),
        "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        u => {
            return Err(format!(
                "unknown unit '{u}' in '{s}': use ns, us, ms, s, m or h"
            ))
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || !(0.0..=7.0 * 86400.0).contains(&secs) {
        return Err(format!("'{s}' is out of range (0 to 7 days)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl FileConfig {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_path_buf(),
            key: "(file)".into(),
            problem: format!("cannot read it: {e}"),
        })?;
        Self::parse(&text, path)
    }

    /// Validates config `text`; `file` names it in errors.
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let err = |key: &str, problem: String| ConfigError {
            file: file.to_path_buf(),
            key: key.to_string(),
            problem,
        };
        let raw: Raw = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            let key = line.map_or("(file)".to_string(), |l| format!("line {l}"));
            err(&key, e.message().to_string())
        })?;
        let duration = |key: &str, v: &Option<String>| {
            v.as_deref()
                .map(parse_duration)
                .transpose()
                .map_err(|p| err(key, p))
        };
        let nonempty = |key: &str, v: &Option<String>| match v.as_deref() {
            Some("") => Err(err(
                key,
                "must not be empty (leave the key out instead)".into(),
            )),
            _ => Ok(v.clone()),
        };
        let log_format = raw
            .log_format
            .as_deref()
            .map(check_log_format)
            .transpose()
            .map_err(|(k, p)| err(k, p))?;
        let metrics_addr = match raw.metrics.address.as_deref() {
            None => None,
            Some(a) => Some(a.parse::<SocketAddr>().map_err(|e| {
                err(
                    "metrics.address",
                    format!("'{a}' is not an address:port ({e}); e.g. \"0.0.0.0:9401\""),
                )
            })?),
        };
        if let Some(p) = raw.audit_log.as_ref().filter(|p| !p.is_absolute()) {
            return Err(err(
                "audit_log",
                format!("'{}' must be an absolute path", p.display()),
            ));
        }
        let g = &raw.gate;
        let gate_defaults = GateSpec {
            online_label: nonempty("gate.online_label", &g.online_label)?,
            offline_label: nonempty("gate.offline_label", &g.offline_label)?,
            cooldown_floor_us: duration("gate.cooldown_floor", &g.cooldown_floor)?
                .map(|d| d.as_micros() as u64),
            cooldown_ceiling_us: duration("gate.cooldown_ceiling", &g.cooldown_ceiling)?
                .map(|d| d.as_micros() as u64),
            gap_factor: g.gap_factor,
            gap_memory_ms: duration("gate.gap_memory", &g.gap_memory)?
                .map(|d| d.as_millis() as u64),
            fixed_cooldown_us: duration("gate.fixed_cooldown", &g.fixed_cooldown)?
                .map(|d| d.as_micros() as u64),
            hold_budget_pct: g.hold_budget,
            ..GateSpec::default()
        };
        check_gate(&gate_defaults, g.autostart).map_err(|(k, p)| err(k, p))?;
        let offline = check_offline(raw.offline).map_err(|(k, p)| err(k, p))?;
        let harvest = check_harvest(raw.harvest).map_err(|(k, p)| err(k, p))?;
        let pod_labels = raw
            .kubernetes
            .map(check_kubernetes)
            .transpose()
            .map_err(|(k, p)| err(k, p))?;
        Ok(FileConfig {
            group: nonempty("group", &raw.group)?,
            max_hold: duration("max_hold", &raw.max_hold)?,
            state_dir: raw.state_dir,
            audit_log: raw.audit_log,
            log_format,
            metrics_addr,
            gate_defaults,
            gate_autostart: g.autostart,
            offline,
            pod_labels,
            harvest,
        })
    }
}

/// The most windows a harvest profile reports (each adds to every GPU's entry and every pair's).
pub const MAX_HARVEST_WINDOWS: usize = 8;

/// Harvest windows as whole seconds, shortest first: 1 to [`MAX_HARVEST_WINDOWS`] different
/// windows of at least 1 s, each a whole number of seconds (`--harvest-windows` and
/// `harvest.windows`).
pub fn harvest_windows(windows: &[Duration]) -> Result<Vec<u32>, String> {
    if windows.is_empty() || windows.len() > MAX_HARVEST_WINDOWS {
        return Err(format!(
            "give 1 to {MAX_HARVEST_WINDOWS} windows, e.g. 60s,10m,1h (got {})",
            windows.len()
        ));
    }
    let mut out = Vec::with_capacity(windows.len());
    for w in windows {
        if w.subsec_nanos() != 0 || w.as_secs() == 0 {
            return Err(format!(
                "{w:?}: a window is a whole number of seconds, at least 1s (e.g. 60s, 10m, 1h)"
            ));
        }
        out.push(u32::try_from(w.as_secs()).map_err(|_| format!("{w:?} is too long"))?);
    }
    out.sort_unstable();
    if let Some(p) = out.windows(2).find(|p| p[0] == p[1]) {
        return Err(format!("the window of {} s is listed twice", p[0]));
    }
    Ok(out)
}

/// Whether `name` can name a node in the harvest document (and in Slurm): 1-64 letters, digits,
/// '.', '_' or '-'.
pub fn check_node_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "'{name}' is not a node name: use 1-64 letters, digits, '.', '_' or '-' (the \
             cluster's name for this node, e.g. Slurm's NodeName gpu001)"
        ))
    }
}

fn check_harvest(raw: RawHarvest) -> Result<HarvestFileConfig, (&'static str, String)> {
    if let Some(n) = &raw.node_name {
        check_node_name(n).map_err(|e| ("harvest.node_name", e))?;
    }
    if let Some(p) = raw.progress_dir.as_ref().filter(|p| !p.is_absolute()) {
        return Err((
            "harvest.progress_dir",
            format!("'{}' must be an absolute path", p.display()),
        ));
    }
    let windows_s = match raw.windows {
        None => None,
        Some(ws) => {
            let parsed = ws
                .iter()
                .map(|w| parse_duration(w))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ("harvest.windows", e))?;
            Some(harvest_windows(&parsed).map_err(|e| ("harvest.windows", e))?)
        }
    };
    Ok(HarvestFileConfig {
        node_name: raw.node_name,
        progress_dir: raw.progress_dir,
        windows_s,
    })
}

/// The gate defaults make sense together; `autostart` needs both sides named.
fn check_gate(spec: &GateSpec, autostart: bool) -> Result<(), (&'static str, String)> {
    if let (Some(f), Some(c)) = (spec.cooldown_floor_us, spec.cooldown_ceiling_us) {
        if f > c {
            return Err((
                "gate.cooldown_floor",
                format!("{f} us is above gate.cooldown_ceiling ({c} us)"),
            ));
        }
    }
    if let Some(f) = spec.gap_factor.filter(|f| !(f.is_finite() && *f >= 1.0)) {
        return Err((
            "gate.gap_factor",
            format!("{f}: must be at least 1 (the cooldown must outlast one gap)"),
        ));
    }
    if spec.gap_memory_ms == Some(0) {
        return Err((
            "gate.gap_memory",
            "0: must be at least 1ms (the cooldown is learned from the gaps it remembers)".into(),
        ));
    }
    if let Some(pct) = spec.hold_budget_pct {
        if !(pct.is_finite() && pct > 0.0 && pct <= 50.0) {
            return Err((
                "gate.hold_budget",
                format!("{pct}: must be a percentage above 0 and at most 50"),
            ));
        }
        if spec.fixed_cooldown_us.is_some() {
            return Err((
                "gate.hold_budget",
                "adds to the learned cooldown, which gate.fixed_cooldown replaces: drop one".into(),
            ));
        }
    }
    if spec.online_label.is_some() && spec.online_label == spec.offline_label {
        return Err((
            "gate.offline_label",
            "is the same as gate.online_label".into(),
        ));
    }
    if autostart && (spec.online_label.is_none() || spec.offline_label.is_none()) {
        return Err((
            "gate.autostart",
            "needs gate.online_label and gate.offline_label (a gate started by the daemon can \
             only name processes by label)"
                .into(),
        ));
    }
    Ok(())
}

fn check_log_format(name: &str) -> Result<LogFormat, (&'static str, String)> {
    match name {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        o => Err(("log_format", format!("'{o}': use \"text\" or \"json\""))),
    }
}

fn check_kubernetes(raw: RawKubernetes) -> Result<PodLabels, (&'static str, String)> {
    if raw.pod_label.is_empty() || raw.pod_label.contains(['=', '"', '\n']) {
        return Err((
            "kubernetes.pod_label",
            format!(
                "'{}' is not a label key (e.g. valve.dev/workload)",
                raw.pod_label
            ),
        ));
    }
    Ok(PodLabels {
        key: raw.pod_label,
        kubelet_pods_dir: raw.kubelet_pods_dir,
    })
}

fn check_offline(raw: RawOffline) -> Result<OfflinePolicy, (&'static str, String)> {
    if raw.labels.iter().any(String::is_empty) {
        return Err(("offline.labels", "an empty label matches nothing".into()));
    }
    if let Some(c) = raw.cgroups.iter().find(|c| !c.starts_with('/')) {
        return Err((
            "offline.cgroups",
            format!("'{c}' must be a cgroup path from the root, e.g. /kubepods.slice/kubepods-besteffort.slice"),
        ));
    }
    Ok(OfflinePolicy {
        labels: raw.labels,
        uids: raw.uids,
        cgroups: raw
            .cgroups
            .into_iter()
            .map(|c| c.trim_end_matches('/').to_string())
            .collect(),
    })
}

impl OfflinePolicy {
    /// Whether any rule is set (no rules: every process may be frozen).
    pub fn restricts(&self) -> bool {
        !(self.labels.is_empty() && self.uids.is_empty() && self.cgroups.is_empty())
    }

    /// Whether a process with this label, uid and cgroup path may be frozen; the error says
    /// why not.
    pub fn check(
        &self,
        label: Option<&str>,
        uid: Option<u32>,
        cgroup: Option<&str>,
    ) -> Result<(), String> {
        if !self.restricts() {
            return Ok(());
        }
        let by_label = label.is_some_and(|l| self.labels.iter().any(|a| a == l));
        let by_uid = uid.is_some_and(|u| self.uids.contains(&u));
        let by_cgroup = cgroup.is_some_and(|c| {
            self.cgroups.iter().any(|p| {
                c.strip_prefix(p.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('/') || p.is_empty())
            })
        });
        if by_label || by_uid || by_cgroup {
            return Ok(());
        }
        Err(format!(
            "the daemon's config does not allow freezing it (label {}, uid {}, cgroup {}); \
             [offline] allows labels {:?}, uids {:?}, cgroups {:?}",
            label.unwrap_or("none"),
            uid.map_or("unknown".into(), |u| u.to_string()),
            cgroup.unwrap_or("unknown"),
            self.labels,
            self.uids,
            self.cgroups
        ))
    }

    /// [`OfflinePolicy::check`] for a running process (reads `/proc`, only if a rule is set).
    pub fn permits(&self, who: &Workload) -> Result<(), String> {
        if !self.restricts() {
            return Ok(());
        }
        self.check(who.label(), who.uid(), who.cgroup())
    }
}

#[cfg(test)]
mod tests;
