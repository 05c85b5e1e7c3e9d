//! `deploy/` checked without a cluster: every manifest deserialises into the Kubernetes API
//! types (k8s-openapi) with no field lost on the way (a misspelt or misplaced field is an
//! error), the DaemonSet asks for what docs/kubernetes.md says and nothing more, the ConfigMap's
//! valve.toml is a valid daemon config, and the Grafana dashboard queries metrics the daemon has.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, PodSpec};
use serde_json::Value;
use valve_daemon::config::FileConfig;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The YAML documents of a manifest file, as JSON values.
fn documents(file: &str) -> Vec<Value> {
    let path = deploy_dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            let v: Value = serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
            v
        })
        .collect()
}

/// Where `typed` (the value after a trip through the API type) differs from `raw`.
fn first_difference(path: &str, raw: &Value, typed: &Value) -> Option<String> {
    match (raw, typed) {
        (Value::Object(a), Value::Object(b)) => a.iter().find_map(|(k, v)| {
            let p = format!("{path}.{k}");
            match b.get(k) {
                None => Some(format!(
                    "{p}: not a field of the API type (misspelt or misplaced?)"
                )),
                Some(w) => first_difference(&p, v, w),
            }
        }),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(&format!("{path}[{i}]"), v, w)),
        _ if raw == typed => None,
        _ => Some(format!("{path}: {raw} reads as {typed}")),
    }
}

/// Deserialises `doc` into `T` and checks that nothing was dropped or changed.
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value, what: &str) -> T {
    let t: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{what}: not a valid object of its kind: {e}"));
    let back = serde_json::to_value(&t).unwrap();
    if let Some(d) = first_difference(what, doc, &back) {
        panic!("{d}");
    }
    t
}

/// Every document of a file, checked against the type of its kind.
fn check_file(file: &str) -> Vec<(String, Value)> {
    let docs = documents(file);
    assert!(!docs.is_empty(), "{file} has no documents");
    for doc in &docs {
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        let what = format!("{file}: {kind} {}", doc["metadata"]["name"]);
        match kind.as_str() {
            "Namespace" => drop(typed::<Namespace>(doc, &what)),
            "ConfigMap" => drop(typed::<ConfigMap>(doc, &what)),
            "DaemonSet" => drop(typed::<DaemonSet>(doc, &what)),
            "Deployment" => drop(typed::<Deployment>(doc, &what)),
            "Job" => drop(typed::<Job>(doc, &what)),
            other => panic!("{what}: kind {other:?} is not checked by this test; add it"),
        }
    }
    docs.into_iter()
        .map(|d| (d["kind"].as_str().unwrap().to_string(), d))
        .collect()
}

fn one<T: serde::de::DeserializeOwned + serde::Serialize>(
    docs: &[(String, Value)],
    kind: &str,
) -> T {
    let v: Vec<_> = docs.iter().filter(|(k, _)| k == kind).collect();
    assert_eq!(v.len(), 1, "one {kind} expected");
    typed(&v[0].1, kind)
}

fn daemon_config(docs: &[(String, Value)]) -> FileConfig {
    let cm: ConfigMap = one(docs, "ConfigMap");
    let text = cm.data.unwrap()["valve.toml"].clone();
    FileConfig::parse(&text, Path::new("valve-config/valve.toml"))
        .unwrap_or_else(|e| panic!("the ConfigMap's daemon config: {e}"))
}

#[test]
fn the_install_manifest_is_valid_and_its_config_parses() {
    let docs = check_file("kubernetes/valve.yaml");
    let ns: Namespace = one(&docs, "Namespace");
    let ds: DaemonSet = one(&docs, "DaemonSet");
    let cm: ConfigMap = one(&docs, "ConfigMap");
    let ns_name = ns.metadata.name.unwrap();
    assert_eq!(ds.metadata.namespace.as_deref(), Some(ns_name.as_str()));
    assert_eq!(cm.metadata.namespace.as_deref(), Some(ns_name.as_str()));
    let cfg = daemon_config(&docs);
    let pod = ds.spec.unwrap().template;
    let spec = pod.spec.unwrap();
    // The container runs the daemon on the ConfigMap's file.
    let c = &spec.containers[0];
    let args = c.args.clone().unwrap();
    let config_path = &args[args.iter().position(|a| a == "--config").unwrap() + 1];
    let mounts = c.volume_mounts.clone().unwrap();
    let config_mount = mounts.iter().find(|m| m.name == "config").unwrap();
    assert_eq!(
        Path::new(&config_mount.mount_path).join("valve.toml"),
        Path::new(config_path)
    );
    let config_volume = spec
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "config");
    assert_eq!(
        config_volume
            .and_then(|v| v.config_map.as_ref())
            .map(|c| c.name.clone()),
        cm.metadata.name
    );
    // Metrics: the config's port is the container's and the scrape annotation's.
    let port = cfg.metrics_addr.expect("metrics on").port();
    let ports = c.ports.clone().unwrap();
    assert!(ports.iter().any(|p| p.container_port == i32::from(port)));
    let ann = pod.metadata.unwrap().annotations.unwrap();
    assert_eq!(ann["prometheus.io/port"], port.to_string());
    // The gate's offline label is one the [offline] rules allow.
    let offline = cfg.gate_defaults.offline_label.clone().unwrap();
    assert!(cfg.offline.labels.contains(&offline));
    check_pod_access(&spec);
}

/// hostPID, the documented capabilities and host paths, and nothing more.
fn check_pod_access(spec: &PodSpec) {
    assert_eq!(spec.host_pid, Some(true));
    assert_ne!(spec.host_network, Some(true));
    assert_ne!(spec.host_ipc, Some(true));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let sc = spec.containers[0].security_context.clone().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    let added: BTreeSet<String> = caps.add.unwrap().into_iter().collect();
    let docs = std::fs::read_to_string(deploy_dir().join("../docs/kubernetes.md")).unwrap();
    for cap in &added {
        assert!(
            docs.contains(&format!("`CAP_{cap}`")),
            "docs/kubernetes.md does not say why the pod has CAP_{cap}"
        );
    }
    assert_eq!(
        added,
        [
            "BPF",
            "PERFMON",
            "SYS_PTRACE",
            "SYS_RESOURCE",
            "CHOWN",
            "SYS_NICE"
        ]
        .map(String::from)
        .into(),
        "a capability was added or removed: update docs/kubernetes.md and this list"
    );
    let host_paths: BTreeSet<String> = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| h.path.clone()))
        .collect();
    for p in &host_paths {
        assert!(
            docs.contains(&format!("`{p}`")),
            "docs/kubernetes.md does not explain {p}"
        );
    }
    assert_eq!(
        host_paths,
        ["/run/valve", "/sys/kernel/tracing", "/var/lib/kubelet/pods"]
            .map(String::from)
            .into()
    );
}

#[test]
fn example_workloads_declare_themselves_with_the_gates_labels() {
    let install = check_file("kubernetes/valve.yaml");
    let cfg = daemon_config(&install);
    let online = cfg.gate_defaults.online_label.unwrap();
    let offline = cfg.gate_defaults.offline_label.unwrap();
    let key = cfg.pod_labels.unwrap().key;
    let docs = check_file("kubernetes/example-workloads.yaml");
    let env_label = |spec: &PodSpec| {
        spec.containers[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "VALVE_LABEL")
            .and_then(|e| e.value.clone())
    };
    let serving: Deployment = one(&docs, "Deployment");
    let spec = serving.spec.unwrap().template.spec.unwrap();
    assert_eq!(env_label(&spec), Some(online));
    let job: Job = one(&docs, "Job");
    let template = job.spec.unwrap().template;
    let spec = template.spec.unwrap();
    assert_eq!(env_label(&spec), Some(offline.clone()));
    // The pod-label way: the label, and a downward-API volume with a `labels` file.
    let labels = template.metadata.unwrap().labels.unwrap();
    assert_eq!(labels[&key], offline);
    let projected = spec.volumes.iter().flatten().any(|v| {
        v.downward_api.as_ref().is_some_and(|d| {
            d.items.iter().flatten().any(|i| {
                i.path == "labels"
                    && i.field_ref.as_ref().map(|f| f.field_path.as_str())
                        == Some("metadata.labels")
            })
        })
    });
    assert!(
        projected,
        "the offline Job must project its labels to a `labels` file"
    );
}

/// Metric names (with their sample suffixes) the daemon exposes.
fn daemon_metric_names() -> BTreeSet<String> {
    let m = valve_daemon::metrics::Metrics::new(2);
    // Families with labels appear once they have a series; a gate's start makes them all.
    m.gate_started("batch");
    let _freeze = valve_daemon::freeze_check::FreezeRecorder::new(Some(&m));
    let text = m.encode();
    let mut names = BTreeSet::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
    }
    names
}

#[test]
fn the_grafana_dashboard_queries_metrics_the_daemon_has() {
    let path = deploy_dir().join("grafana/valve-dashboard.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()));
    let have = daemon_metric_names();
    assert!(have.contains("valve_preemptions_total"), "{have:?}");
    let panels = dash["panels"].as_array().unwrap();
    assert!(!panels.is_empty());
    let mut used = BTreeSet::new();
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("valve_") {
                    assert!(
                        have.contains(word),
                        "panel {:?} queries {word}, which the daemon does not expose",
                        p["title"]
                    );
                    used.insert(word.to_string());
                }
            }
        }
    }
    // Every family the issue asks for is on the dashboard.
    for family in [
        "valve_preemptions_total",
        "valve_edge_to_stopped_seconds_bucket",
        "valve_disable_seconds_bucket",
        "valve_offline_harvested_seconds_total",
        "valve_errors_total",
    ] {
        assert!(
            used.contains(family),
            "the dashboard does not show {family}"
        );
    }
}

#[test]
fn a_misspelt_field_is_caught() {
    // The check itself: a field the API type does not have must not pass silently.
    let mut doc = documents("kubernetes/valve.yaml")
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet")
        .unwrap();
    doc["spec"]["template"]["spec"]["hostPid"] = Value::Bool(true);
    let typed: DaemonSet = serde_json::from_value(doc.clone()).unwrap();
    let back = serde_json::to_value(&typed).unwrap();
    let d = first_difference("DaemonSet", &doc, &back).expect("caught");
    assert!(d.contains("spec.template.spec.hostPid"), "{d}");
}
