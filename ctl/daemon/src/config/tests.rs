//! Tests of the config file: a full example, each validation error by file and key, and the
//! `[offline]` rules.

use super::*;

const FULL: &str = r#"
group = "valve"
max_hold = "60s"
state_dir = "/run/valve"
audit_log = "/var/log/valve/audit.jsonl"
log_format = "json"

[metrics]
address = "0.0.0.0:9401"

[gate]
autostart = true
online_label = "serving"
offline_label = "batch"
cooldown_floor = "1ms"
cooldown_ceiling = "200ms"
gap_factor = 2.5
gap_memory = "30s"
hold_budget = 10

[offline]
labels = ["batch"]
uids = [1000, 1001]
cgroups = ["/kubepods.slice/kubepods-besteffort.slice/"]

[kubernetes]
pod_label = "valve.dev/workload"

[harvest]
node_name = "gpu001"
progress_dir = "/var/run/valve-progress"
windows = ["10m", "30s", "2h"]
"#;

fn parse(text: &str) -> Result<FileConfig, ConfigError> {
    FileConfig::parse(text, Path::new("/etc/valve/valve.toml"))
}

#[test]
fn a_full_config_is_read_into_typed_settings() {
    let c = parse(FULL).unwrap();
    assert_eq!(c.group.as_deref(), Some("valve"));
    assert_eq!(c.max_hold, Some(Duration::from_secs(60)));
    assert_eq!(c.log_format, Some(LogFormat::Json));
    assert_eq!(c.metrics_addr, Some("0.0.0.0:9401".parse().unwrap()));
    assert!(c.gate_autostart);
    assert_eq!(c.gate_defaults.offline_label.as_deref(), Some("batch"));
    assert_eq!(c.gate_defaults.cooldown_floor_us, Some(1_000));
    assert_eq!(c.gate_defaults.cooldown_ceiling_us, Some(200_000));
    assert_eq!(c.gate_defaults.gap_factor, Some(2.5));
    assert_eq!(c.gate_defaults.gap_memory_ms, Some(30_000));
    assert_eq!(c.gate_defaults.hold_budget_pct, Some(10.0));
    assert_eq!(c.offline.uids, vec![1000, 1001]);
    assert_eq!(
        c.offline.cgroups,
        vec!["/kubepods.slice/kubepods-besteffort.slice"]
    );
    let pods = c.pod_labels.unwrap();
    assert_eq!(pods.key, "valve.dev/workload");
    assert_eq!(pods.kubelet_pods_dir, Path::new("/var/lib/kubelet/pods"));
    assert_eq!(
        c.harvest,
        HarvestFileConfig {
            node_name: Some("gpu001".into()),
            progress_dir: Some("/var/run/valve-progress".into()),
            windows_s: Some(vec![30, 600, 7200]),
        },
        "windows shortest first"
    );
    // Nothing is required.
    assert_eq!(parse("").unwrap(), FileConfig::default());
}

/// Each of `cases` (config text, the key its error names, part of the problem) is refused with
/// an error that names the file, the key and the problem.
fn check_errors(cases: &[(&str, &str, &str)]) {
    for (text, key, problem) in cases {
        let e = parse(text).unwrap_err();
        assert_eq!(&e.key, key, "{text}: {e}");
        assert!(e.problem.contains(problem), "{text}: {e}");
        assert!(
            e.to_string()
                .starts_with(&format!("/etc/valve/valve.toml: {key}: ")),
            "{e}"
        );
    }
}

#[test]
fn errors_name_the_file_the_key_and_the_problem() {
    check_errors(&[
        ("max_hold = \"60\"", "max_hold", "has no unit"),
        ("max_hold = \"1 fortnight\"", "max_hold", "unknown unit"),
        (
            "log_format = \"xml\"",
            "log_format",
            "use \"text\" or \"json\"",
        ),
        ("audit_log = \"audit.jsonl\"", "audit_log", "absolute path"),
        ("group = \"\"", "group", "must not be empty"),
        (
            "[metrics]\naddress = \"9401\"",
            "metrics.address",
            "not an address:port",
        ),
        (
            "[gate]\ncooldown_floor = \"5ms\"\ncooldown_ceiling = \"1ms\"",
            "gate.cooldown_floor",
            "above gate.cooldown_ceiling",
        ),
        ("[gate]\ngap_factor = 0.5", "gate.gap_factor", "at least 1"),
        ("[gate]\nhold_budget = 75", "gate.hold_budget", "at most 50"),
        (
            "[gate]\nhold_budget = 5\nfixed_cooldown = \"10ms\"",
            "gate.hold_budget",
            "drop one",
        ),
        (
            "[gate]\ngap_memory = \"0s\"",
            "gate.gap_memory",
            "at least 1ms",
        ),
        (
            "[gate]\nautostart = true\noffline_label = \"b\"",
            "gate.autostart",
            "needs gate.online_label",
        ),
        (
            "[gate]\nonline_label = \"a\"\noffline_label = \"a\"",
            "gate.offline_label",
            "same as",
        ),
    ]);
    let e = FileConfig::load(Path::new("/nonexistent/valve.toml")).unwrap_err();
    assert!(e.to_string().contains("cannot read it"), "{e}");
}

#[test]
fn errors_in_the_offline_kubernetes_and_harvest_tables_are_named_too() {
    check_errors(&[
        (
            "[offline]\ncgroups = [\"kubepods\"]",
            "offline.cgroups",
            "from the root",
        ),
        ("[offline]\nuids = [-1]", "line 2", "invalid value"),
        (
            "[kubernetes]\npod_label = \"a=b\"",
            "kubernetes.pod_label",
            "not a label key",
        ),
        ("\n\nmaxhold = \"1s\"", "line 3", "unknown field `maxhold`"),
        (
            "[gate]\nauto_start = true",
            "line 2",
            "unknown field `auto_start`",
        ),
        ("group = valve", "line 1", ""),
        (
            "[harvest]\nnode_name = \"gpu 001\"",
            "harvest.node_name",
            "not a node name",
        ),
        (
            "[harvest]\nprogress_dir = \"progress\"",
            "harvest.progress_dir",
            "absolute path",
        ),
        ("[harvest]\nwindows = []", "harvest.windows", "give 1 to 8"),
        (
            "[harvest]\nwindows = [\"1.5s\"]",
            "harvest.windows",
            "whole number of seconds",
        ),
        (
            "[harvest]\nwindows = [\"60s\", \"1m\"]",
            "harvest.windows",
            "listed twice",
        ),
        (
            "[harvest]\nwindows = [\"60\"]",
            "harvest.windows",
            "has no unit",
        ),
        (
            "[harvest]\nwindow = [\"60s\"]",
            "line 2",
            "unknown field `window`",
        ),
    ]);
}

#[test]
fn offline_rules_allow_by_label_uid_or_cgroup_prefix() {
    let p = parse(FULL).unwrap().offline;
    assert!(p
        .check(Some("batch"), Some(0), Some("/system.slice"))
        .is_ok());
    assert!(p.check(None, Some(1001), None).is_ok());
    let pod = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podx.slice/c.scope";
    assert!(p.check(None, Some(0), Some(pod)).is_ok());
    // A prefix of a component is not a match.
    let e = p
        .check(
            Some("serving"),
            Some(0),
            Some("/kubepods.slice/kubepods-besteffort.slice-other"),
        )
        .unwrap_err();
    assert!(
        e.contains("does not allow freezing it (label serving, uid 0"),
        "{e}"
    );
    // No rules: anything the operator names.
    assert!(OfflinePolicy::default().check(None, None, None).is_ok());
    // This test process is neither labelled batch, nor uid 1000/1001 in a pod (usually);
    // its own uid is allowed by a rule naming it.
    let me = OfflinePolicy {
        uids: vec![nix::unistd::getuid().as_raw()],
        ..OfflinePolicy::default()
    };
    assert!(me.permits(&Workload::of(std::process::id())).is_ok());
}
