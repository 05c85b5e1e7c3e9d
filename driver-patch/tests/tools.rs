//! The library API and the other commands: `check`, `emit-patch`, `entry-flags`, `apt-sources`.

mod common;

use std::fs;
use std::process::Command;

use common::*;
use tempfile::TempDir;
use valve_driver_patch::cli::{exec, DriverCommand, TreeArgs};
use valve_driver_patch::{
    apt_sources, check, emit_patch, entry_flags_in, patch, Flag, PatchError, PatchOptions, Status,
    EXIT_NOT_PATCHED,
};

fn tool_output(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(tool()).args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout),
        text(&out.stderr),
    )
}

#[test]
fn library_outcomes_print_what_the_cli_prints() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("560.35.03", NEW_BITS, 0x108).write(&dir.path().join("t"));
    let outcome = check(&root, Flag::GpuLockDeviceOnly).unwrap();
    assert_eq!(outcome.status, Status::NotPatched);
    assert_eq!(outcome.exit_code(), EXIT_NOT_PATCHED);
    assert_eq!(
        (outcome.report.old.to_u64(), outcome.report.new.to_u64()),
        (Some(0x108), Some(0x118))
    );
    let (code, out, err) = tool_output(&["check", "--src", root.to_str().unwrap()]);
    assert_eq!((code, err.as_str()), (10, ""));
    assert_eq!(out, outcome.to_string());
    assert!(out.starts_with(
        "driver 560.35.03: FIFO_DISABLE_CHANNELS entry (methodId 0x2080110b) at src/nvidia/generated/g_subdevice_nvoc.c:25\n\
         old flags 0x108; RMCTRL_FLAGS_GPU_LOCK_DEVICE_ONLY = 0x10 (from src/nvidia/inc/kernel/rmapi/control.h); new flags 0x118\n\
         not patched: flags 0x108 lack RMCTRL_FLAGS_GPU_LOCK_DEVICE_ONLY; run without --check to set it (0x108 -> 0x118)\n"
    ));

    let diff = emit_patch(&root, Flag::GpuLockDeviceOnly).unwrap();
    let file = dir.path().join("p");
    let opts = PatchOptions {
        emit_patch: Some(file.clone()),
        ..PatchOptions::default()
    };
    let done = patch(&root, &opts).unwrap();
    let Status::Patched { sha256 } = &done.status else {
        panic!("{done:?}")
    };
    assert_eq!(sha256.len(), 64);
    assert_eq!(fs::read(&file).unwrap(), diff);
    assert_eq!(
        emit_patch(&root, Flag::GpuLockDeviceOnly).unwrap(),
        diff,
        "the same after patching"
    );
    assert_eq!(patch(&root, &opts).unwrap().status, Status::AlreadyPatched);
    assert!(done.to_string().ends_with(&format!(
        "patched: src/nvidia/generated/g_subdevice_nvoc.c:25 flags 0x108 -> 0x118 (sha256 of the change: {sha256})\n"
    )));
    let text = String::from_utf8(diff).unwrap();
    assert!(text.starts_with(
        "--- a/src/nvidia/generated/g_subdevice_nvoc.c\n+++ b/src/nvidia/generated/g_subdevice_nvoc.c\n@@ -22,7 +22,7 @@\n"
    ));
}

#[test]
fn emit_patch_command_prints_the_diff_and_changes_nothing() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("580.142", NEW_BITS, 0x10108)
        .amp()
        .write(&dir.path().join("t"));
    let before = gen_text(&root);
    let (code, out, err) = tool_output(&["emit-patch", "--src", root.to_str().unwrap()]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(gen_text(&root), before);
    let file = dir.path().join("p");
    assert_eq!(
        run_src(&root, &["--emit-patch", file.to_str().unwrap()]).0,
        0
    );
    assert_eq!(read(&file), out);
    // Through exec (what valvectl calls), into a buffer.
    let cmd = DriverCommand::EmitPatch {
        tree: TreeArgs {
            src: root.clone(),
            flag: Flag::GpuLockDeviceOnly,
        },
    };
    let mut buf = Vec::new();
    assert_eq!(exec(&cmd, &mut buf), 0);
    assert_eq!(String::from_utf8(buf).unwrap(), out);
    // A refusal: its exit code, nothing on stdout.
    let (code, out, err) = tool_output(&["emit-patch", "--src", dir.path().to_str().unwrap()]);
    assert_eq!((code, out.as_str()), (4, ""));
    assert!(err.starts_with("patch-driver: unsupported: "), "{err}");
}

#[test]
fn errors_carry_exit_codes_and_words() {
    let dir = TempDir::new().unwrap();
    let missing = dir.path().join("missing");
    let e = check(&missing, Flag::GpuLockDeviceOnly).unwrap_err();
    assert!(matches!(e, PatchError::Usage(_)));
    assert_eq!((e.exit_code(), e.word()), (2, "error"));
    assert_eq!(
        e.to_string(),
        format!("{}: no such directory", missing.display())
    );
    let e = check(dir.path(), Flag::GpuLockDeviceOnly).unwrap_err();
    assert_eq!((e.exit_code(), e.word()), (4, "unsupported"));
    write(dir.path().join("p/kernel/nv-kernel.o_binary"), "");
    let e = check(&dir.path().join("p"), Flag::GpuLockDeviceOnly).unwrap_err();
    assert_eq!((e.exit_code(), e.word()), (3, "refused"));
    assert!(e.to_string().contains("(kernel/nv-kernel.o_binary)"), "{e}");
    // Usage errors of the command line exit 2, as argparse's did.
    assert_eq!(run(&[]).0, 2);
    assert_eq!(run(&["--src", "x", "--flag", "other"]).0, 2);
}

#[test]
fn writes_that_fail_exit_1_and_leave_the_tree() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("580.142", NEW_BITS, 0x10108).write(&dir.path().join("t"));
    let before = gen_text(&root);
    // The temporary file cannot be created where a directory of that name is.
    fs::create_dir(root.join(format!("{GEN}.valve-tmp"))).unwrap();
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("patch-driver: error: "), "{out}");
    assert_eq!(gen_text(&root), before);
}

#[test]
fn entry_flags_reads_the_compiled_entry() {
    let dir = TempDir::new().unwrap();
    let entry = |flags: u32, access: u32| -> Vec<u8> {
        [
            &0u64.to_le_bytes()[..],
            &flags.to_le_bytes(),
            &access.to_le_bytes(),
            &0x2080_110bu32.to_le_bytes(),
        ]
        .concat()
    };
    let one = [vec![0x7f, b'E', b'L', b'F'], vec![0; 12], entry(0x850, 0)].concat();
    let file = dir.path().join("g_subdevice_nvoc.o");
    fs::write(&file, &one).unwrap();
    assert_eq!(
        tool_output(&["entry-flags", file.to_str().unwrap()]),
        (0, "0x850\n".into(), String::new())
    );
    assert_eq!(
        run(&["entry-flags", file.to_str().unwrap()]).1,
        "0x850\n",
        "through the wrapper"
    );
    let two = [one.clone(), entry(0x10118, 7), entry(0x850, 0x1000)].concat();
    fs::write(&file, &two).unwrap();
    assert_eq!(entry_flags_in(&two), [0x850, 0x10118]);
    assert_eq!(
        tool_output(&["entry-flags", file.to_str().unwrap()]),
        (1, "0x850 0x10118\n".into(), String::new())
    );
    fs::write(&file, b"no entry here").unwrap();
    assert_eq!(
        tool_output(&["entry-flags", file.to_str().unwrap()]),
        (1, "none\n".into(), String::new())
    );
    let (code, out, err) = tool_output(&["entry-flags", dir.path().join("nope").to_str().unwrap()]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(err.contains("No such file"), "{err}");
}

#[test]
fn apt_sources_from_the_machines_own_lists() {
    let dir = TempDir::new().unwrap();
    let etc = dir.path();
    write(
        etc.join("sources.list"),
        "# the archive\n\
         deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] h://archive.example/debian bookworm main\r\n\
         deb h://security.example/debian-security/ bookworm-security main\n\
         deb [arch=amd64 h://broken.example/debian bookworm main\n\
         deb-src h://archive.example/debian bookworm main\n"
            .replace("h://", "http://"),
    );
    write(
        etc.join("sources.list.d/a.list"),
        "deb h://third.example/repo stable vendor\n".replace("h://", "http://"),
    );
    write(
        etc.join("sources.list.d/.hidden.list"),
        "deb h://hidden.example/d s main\n".replace("h://", "http://"),
    );
    write(
        etc.join("sources.list.d/debian.sources"),
        "Types: deb deb-src\nURIs: h://archive.example/debian\nSuites: bookworm bookworm-updates\n\
         Components: main non-free-firmware\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
         Types: deb\nURIs: h://off.example/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n"
            .replace("h://", "http://"),
    );
    let want = [
        "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://archive.example/debian bookworm main contrib non-free",
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://archive.example/debian bookworm main non-free-firmware contrib non-free",
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://archive.example/debian bookworm-updates main non-free-firmware contrib non-free",
    ];
    assert_eq!(apt_sources(etc).unwrap(), want);
    let (code, out, err) = tool_output(&["apt-sources", "--etc-apt", etc.to_str().unwrap()]);
    assert_eq!((code, out, err), (0, want.join("\n") + "\n", String::new()));
    // Nothing usable: exit 1 and say so.
    let empty = TempDir::new().unwrap();
    write(
        empty.path().join("sources.list"),
        "deb [unterminated http://x/ y main\n",
    );
    assert!(matches!(
        apt_sources(empty.path()),
        Err(PatchError::NoArchive)
    ));
    let (code, out, err) =
        tool_output(&["apt-sources", "--etc-apt", empty.path().to_str().unwrap()]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert_eq!(
        err,
        "apt-sources: no Debian archive with a 'main' component in this machine's apt sources\n"
    );
}
