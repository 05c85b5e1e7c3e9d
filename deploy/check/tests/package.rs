//! The Debian package's pieces agree with each other and with the image: the packaged config
//! is a valid daemon config, the unit runs the packaged binary on it, the maintainer scripts
//! create the group the config names and start nothing, and the Dockerfile installs the package
//! and runs the binary the DaemonSet and the unit run.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::Value;
use valve_daemon::config::FileConfig;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `[package.metadata.deb]` of a crate's Cargo.toml.
fn deb_metadata(crate_dir: &str) -> toml::Table {
    let manifest: toml::Table = toml::from_str(&read(&format!("{crate_dir}/Cargo.toml"))).unwrap();
    manifest["package"]["metadata"]["deb"]
        .as_table()
        .unwrap_or_else(|| panic!("{crate_dir}: no [package.metadata.deb]"))
        .clone()
}

/// The package's assets as (source relative to the repository, installed path with a leading /).
fn assets(crate_dir: &str) -> Vec<(String, String)> {
    let meta = deb_metadata(crate_dir);
    meta["assets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let a = a.as_array().unwrap();
            let (src, dest) = (a[0].as_str().unwrap(), a[1].as_str().unwrap());
            // cargo-deb: a destination ending in / keeps the source's file name.
            let name = Path::new(src).file_name().unwrap().to_str().unwrap();
            let dest = if dest.ends_with('/') {
                format!("/{dest}{name}")
            } else {
                format!("/{dest}")
            };
            // target/ paths are the build's; the others are relative to the crate.
            let src = if src.starts_with("target/") {
                src.to_string()
            } else {
                let p = repo().join(crate_dir).join(src);
                let p = p.canonicalize().unwrap_or_else(|e| panic!("{src}: {e}"));
                p.strip_prefix(repo().canonicalize().unwrap())
                    .unwrap()
                    .display()
                    .to_string()
            };
            (src, dest)
        })
        .collect()
}

fn installed_from(assets: &[(String, String)], dest: &str) -> String {
    assets
        .iter()
        .find(|(_, d)| d == dest)
        .unwrap_or_else(|| panic!("the package installs no {dest}: {assets:?}"))
        .0
        .clone()
}

#[test]
fn the_packaged_config_and_unit_work_together() {
    let valvectl = assets("ctl/valvectl");
    assert_eq!(
        installed_from(&valvectl, "/usr/bin/valvectl"),
        "target/release/valvectl"
    );
    let config_src = installed_from(&valvectl, "/etc/valve/valve.toml");
    let cfg = FileConfig::load(&repo().join(&config_src))
        .unwrap_or_else(|e| panic!("the packaged config: {e}"));
    // The group the postinst creates, and the hold limit the unit used to pass as a flag.
    assert_eq!(cfg.group.as_deref(), Some("valve"));
    assert_eq!(cfg.max_hold, Some(std::time::Duration::from_secs(60)));
    let conf_files = deb_metadata("ctl/valvectl")["conf-files"].clone();
    assert_eq!(
        conf_files.as_array().unwrap()[0].as_str(),
        Some("/etc/valve/valve.toml"),
        "an upgrade must keep the operator's edits"
    );
    let unit = read(&installed_from(
        &valvectl,
        "/lib/systemd/system/valve.service",
    ));
    let exec = unit
        .lines()
        .find(|l| l.starts_with("ExecStart="))
        .expect("ExecStart");
    assert_eq!(
        exec,
        "ExecStart=/usr/bin/valvectl daemon $VALVE_DAEMON_ARGS"
    );
    assert!(
        unit.contains("Environment=\"VALVE_DAEMON_ARGS=--config /etc/valve/valve.toml\""),
        "{unit}"
    );
    let scheduler = assets("sched/scheduler");
    assert_eq!(
        installed_from(&scheduler, "/usr/bin/valve-scheduler"),
        "target/release/valve-scheduler"
    );
    // `valve-scheduler simulate` runs the valve-sim found next to it.
    assert_eq!(
        installed_from(&scheduler, "/usr/bin/valve-sim"),
        "target/release/valve-sim"
    );
}

#[test]
fn the_maintainer_scripts_create_the_group_and_start_nothing() {
    let dir = deb_metadata("ctl/valvectl")["maintainer-scripts"]
        .as_str()
        .unwrap()
        .to_string();
    let script = |name: &str| read(&format!("ctl/valvectl/{dir}/{name}"));
    let postinst = script("postinst");
    assert!(postinst.contains("groupadd --system valve"), "{postinst}");
    for name in ["postinst", "prerm", "postrm"] {
        let s = script(name);
        assert!(s.starts_with("#!/bin/sh\n"), "{name}: not a sh script");
        // The commands (messages that tell the operator how to start it are fine).
        for line in s
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("systemctl "))
        {
            assert!(
                !(line.starts_with("systemctl enable") || line.starts_with("systemctl start")),
                "{name} enables or starts the daemon: {line}"
            );
            // systemctl only where systemd runs (a container or chroot has none).
            assert!(s.contains("[ -d /run/systemd/system ]"), "{name}: {line}");
        }
    }
    assert!(script("prerm").contains("systemctl stop valve.service"));
}

/// The Dockerfile's instructions, continuation lines joined.
fn dockerfile() -> Vec<String> {
    let text = read("deploy/Dockerfile").replace("\\\n", " ");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

#[test]
fn the_image_installs_the_package_and_runs_what_the_daemonset_runs() {
    let lines = dockerfile();
    let has = |prefix: &str| lines.iter().any(|l| l.starts_with(prefix));
    assert!(has("COPY target/debian/valvectl_*.deb /tmp/"), "{lines:?}");
    assert!(
        lines.iter().any(|l| l.starts_with("RUN")
            && l.contains("apt-get install")
            && l.contains("/tmp/valvectl_*.deb")),
        "{lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("cargo")),
        "the image is built from the package, not a cargo tree: {lines:?}"
    );
    let entry = lines
        .iter()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .expect("ENTRYPOINT");
    let entry: Vec<String> = serde_json::from_str(entry).unwrap();
    assert_eq!(entry, ["/usr/bin/valvectl"]);
    // .dockerignore sends the package to the build.
    let ignore = read(".dockerignore");
    assert!(ignore.lines().any(|l| l == "!target/debian/valvectl_*.deb"));

    let text = read("deploy/kubernetes/valve.yaml");
    let ds: DaemonSet = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .find(|v: &Value| v["kind"] == "DaemonSet")
        .map(|v| serde_json::from_value(v).unwrap())
        .expect("a DaemonSet");
    let c = &ds.spec.unwrap().template.spec.unwrap().containers[0];
    assert_eq!(c.command.as_deref(), Some(&entry[..]));
    let probe = c.liveness_probe.as_ref().unwrap().exec.as_ref().unwrap();
    assert_eq!(probe.command.as_ref().unwrap()[0], entry[0]);
}
