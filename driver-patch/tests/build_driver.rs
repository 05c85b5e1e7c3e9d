//! `scripts/build-driver.sh` on SYNTHETIC trees whose Makefile only records what it was asked to
//! do, with stubs for every tool that could load, unload or install a module (the script must never
//! load or unload one). Ported from the Python fixture tests.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, UNIX_EPOCH};

use common::*;
use tempfile::TempDir;

/// A stand-in for the tree's top-level Makefile: records the goals and arguments, makes the .ko files.
const FAKE_MAKEFILE: &str = "modules:
\techo \"modules $(SYSSRC) $(SYSOUT)\" >> make.log
\ttouch kernel-open/nvidia.ko kernel-open/nvidia-uvm.ko
modules_install:
\techo modules_install >> make.log
\tif [ -n \"$(VALVE_TEST_KO)\" ]; then cp \"$(VALVE_TEST_KO_SRC)\" \"$(VALVE_TEST_KO)\"; fi
";

struct Fixture {
    tmp: TempDir,
    headers: PathBuf,
    bin: PathBuf,
    /// Where the stubs of rmmod, modprobe and insmod record any call.
    calls: PathBuf,
}

fn script(path: &Path, body: &str) {
    write(path, format!("#!/bin/sh\n{body}"));
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

impl Fixture {
    fn new() -> Self {
        let tmp = TempDir::new().unwrap();
        let headers = tmp.path().join("headers");
        write(headers.join("Makefile"), "# fake kernel headers\n");
        let bin = tmp.path().join("bin");
        let calls = tmp.path().join("module-calls");
        for tool in [
            "rmmod",
            "modprobe",
            "insmod",
            "nvidia-smi",
            "dkms",
            "mokutil",
            "depmod",
            "modinfo",
        ] {
            let record = if ["rmmod", "modprobe", "insmod"].contains(&tool) {
                format!("echo {tool} \"$@\" >> {}\n", calls.display())
            } else {
                String::new()
            };
            script(&bin.join(tool), &format!("{record}exit 1\n"));
        }
        Fixture {
            tmp,
            headers,
            bin,
            calls,
        }
    }

    fn dir(&self) -> &Path {
        self.tmp.path()
    }

    fn tree(&self, version: &str, bits: &[(&str, u64)], flags: u64) -> PathBuf {
        let root = Tree::new(version, bits, flags).write(&self.dir().join(version));
        fs::create_dir_all(root.join("kernel-open")).unwrap();
        write(root.join("Makefile"), FAKE_MAKEFILE);
        root
    }

    fn build(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
        let path = format!("{}:/usr/bin:/bin", self.bin.display());
        let mut cmd = Command::new("bash");
        cmd.arg(repo().join("scripts/build-driver.sh"))
            .args(args)
            .env("PATH", path)
            .env("VALVE_DRIVER_PATCH", tool());
        for (k, v) in env {
            cmd.env(k, v);
        }
        output(&mut cmd)
    }

    fn headers(&self) -> &str {
        self.headers.to_str().unwrap()
    }
}

#[test]
fn patches_builds_and_reminds_without_loading() {
    let f = Fixture::new();
    let root = f.tree("580.142", NEW_BITS, 0x10108);
    let src = root.to_str().unwrap();
    let (code, out) = f.build(
        &[
            "--src",
            src,
            "--kernel-headers",
            f.headers(),
            "--kernel-output",
            "/o",
            "--jobs",
            "1",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("0x10108 -> 0x10118"), "{out}");
    assert!(out.contains("REMINDER"), "{out}");
    assert_eq!(
        read(root.join("make.log")),
        format!("modules {} /o\n", f.headers())
    );
    assert!(root.join("kernel-open/nvidia.ko").exists());
    assert!(
        !f.calls.exists(),
        "build-driver.sh ran a module (un)loading command"
    );
}

fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

/// A module image carrying `flags` in a FIFO_DISABLE_CHANNELS entry.
fn module_image(flags: u32) -> Vec<u8> {
    let mut image = vec![0u8; 16];
    image.extend(0u64.to_le_bytes());
    image.extend(flags.to_le_bytes());
    image.extend(0u32.to_le_bytes());
    image.extend(0x2080_110bu32.to_le_bytes());
    image
}

#[test]
fn install_checks_what_modprobe_would_load() {
    if !is_root() {
        eprintln!("skipped: --install needs root");
        return;
    }
    // The fake modules_install copies a module image carrying the given flags where the modinfo stub
    // points; depmod and modinfo are stubs, so nothing on this machine is installed or indexed.
    let f = Fixture::new();
    let root = f.tree("580.142", NEW_BITS, 0x10108);
    let src = root.to_str().unwrap();
    let installed = f.dir().join("lib/modules/kernel/drivers/video/nvidia.ko");
    fs::create_dir_all(installed.parent().unwrap()).unwrap();
    script(
        &f.bin.join("modinfo"),
        &format!("echo {}\n", installed.display()),
    );
    script(
        &f.bin.join("depmod"),
        &format!("echo depmod \"$@\" >> {}/depmod-calls\n", f.dir().display()),
    );
    let expectations = [
        (
            0x10118,
            "which carries the patched flags 0x10118".to_string(),
        ),
        (
            0x10108,
            format!(
                "WARNING: {} carries flags 0x10108, expected 0x10118",
                installed.display()
            ),
        ),
    ];
    for (flags, expect) in expectations {
        let image = f.dir().join("image.ko");
        write(&image, module_image(flags));
        let env = [
            ("VALVE_TEST_KO", installed.to_str().unwrap()),
            ("VALVE_TEST_KO_SRC", image.to_str().unwrap()),
        ];
        let args = [
            "--src",
            src,
            "--kernel-headers",
            f.headers(),
            "--install",
            "--allow-unsigned",
        ];
        let (code, out) = f.build(&args, &env);
        assert_eq!(code, 0, "{flags:#x}: {out}");
        assert!(out.contains(&expect), "{flags:#x}: {out}");
        assert!(out.contains("REMINDER"), "{out}");
    }
    // A module elsewhere (DKMS's updates/) that was not just written shadows the patched one.
    let shadow = f.dir().join("updates-dkms-nvidia.ko");
    write(&shadow, "");
    let file = fs::File::options().write(true).open(&shadow).unwrap();
    file.set_modified(UNIX_EPOCH + Duration::from_secs(1))
        .unwrap();
    script(
        &f.bin.join("modinfo"),
        &format!("echo {}\n", shadow.display()),
    );
    let (code, out) = f.build(
        &[
            "--src",
            src,
            "--kernel-headers",
            f.headers(),
            "--install",
            "--allow-unsigned",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    let warning = format!(
        "WARNING: modprobe would load {}, not the module just installed",
        shadow.display()
    );
    assert!(out.contains(&warning), "{out}");
    assert!(read(root.join("make.log")).contains("modules_install"));
    assert!(read(f.dir().join("depmod-calls")).contains("depmod -a"));
    assert!(
        !f.calls.exists(),
        "build-driver.sh ran a module (un)loading command"
    );
}

#[test]
fn refused_tree_builds_nothing() {
    let f = Fixture::new();
    let root = f.tree("525.147.05", OLD_BITS, 0x10);
    let (code, out) = f.build(
        &[
            "--src",
            root.to_str().unwrap(),
            "--kernel-headers",
            f.headers(),
        ],
        &[],
    );
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("nothing built"), "{out}");
    assert!(!root.join("make.log").exists());
}

#[test]
fn version_mismatch_is_refused_unless_forced() {
    let f = Fixture::new();
    let root = f.tree("580.142", NEW_BITS, 0x10108);
    let src = root.to_str().unwrap();
    script(&f.bin.join("nvidia-smi"), "echo 580.159.04\n");
    let (code, out) = f.build(&["--src", src, "--kernel-headers", f.headers()], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("source version 580.142 != installed driver 580.159.04"),
        "{out}"
    );
    assert!(!root.join("make.log").exists());
    let (code, out) = f.build(
        &["--src", src, "--kernel-headers", f.headers(), "--force"],
        &[],
    );
    assert_eq!(code, 0, "{out}");
}

#[test]
fn missing_headers_and_usage() {
    let f = Fixture::new();
    let root = f.tree("580.142", NEW_BITS, 0x10108);
    let src = root.to_str().unwrap();
    let nope = f.dir().join("nope");
    let (code, out) = f.build(
        &["--src", src, "--kernel-headers", nope.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no kernel headers"), "{out}");
    assert_eq!(f.build(&["--src", src, "--sign-key", "k"], &[]).0, 2);
    assert_eq!(f.build(&[], &[]).0, 2);
    assert!(!root.join("make.log").exists());
}
