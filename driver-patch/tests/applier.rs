//! The applier on SYNTHETIC trees, through `scripts/patch-driver.sh` (the interface the docs, CI and
//! build-driver.sh use). Each test is one of the Python applier's fixture tests, ported.

mod common;

use std::fs;
use std::path::Path;

use common::*;
use tempfile::TempDir;

fn assert_one_line_changed(before: &str, after: &str, old: u64, new: u64) {
    let (b, a): (Vec<&str>, Vec<&str>) = (before.lines().collect(), after.lines().collect());
    assert_eq!(b.len(), a.len());
    let diff: Vec<(&str, &str)> = b
        .iter()
        .zip(&a)
        .filter(|(x, y)| x != y)
        .map(|(x, y)| (*x, *y))
        .collect();
    assert_eq!(diff.len(), 1, "{diff:?}");
    assert!(
        diff[0].0.contains(&format!("/*flags=*/      {old:#x}u,")),
        "{diff:?}"
    );
    assert!(
        diff[0].1.contains(&format!("/*flags=*/      {new:#x}u,")),
        "{diff:?}"
    );
}

#[test]
fn each_branch_shape_gets_its_own_bit() {
    let dir = TempDir::new().unwrap();
    let cases = [
        ("535.261.03", OLD_BITS, 0x810, 0x850, false),
        ("550.163.01", OLD_BITS, 0x810, 0x850, false),
        ("560.35.03", NEW_BITS, 0x108, 0x118, false),
        ("580.142", NEW_BITS, 0x10108, 0x10118, true),
        ("595.45.04", NEW_BITS, 0x10108, 0x10118, true),
    ];
    for (version, bits, old, new, amp) in cases {
        let mut tree = Tree::new(version, bits, old);
        if amp {
            tree = tree.amp();
        }
        let root = tree.write(&dir.path().join(version));
        let before = gen_text(&root);
        let (code, out) = run_src(&root, &[]);
        assert_eq!(code, 0, "{version}: {out}");
        assert!(out.contains(version), "{out}");
        assert_one_line_changed(&before, &gen_text(&root), old, new);
    }
}

#[test]
fn route_to_physical_option() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("580.142", NEW_BITS, 0x10108)
        .amp()
        .write(&dir.path().join("t"));
    let before = gen_text(&root);
    let (code, out) = run_src(&root, &["--flag", "route-to-physical"]);
    assert_eq!(code, 0, "{out}");
    assert_one_line_changed(&before, &gen_text(&root), 0x10108, 0x10148);
}

#[test]
fn idempotent_and_check_codes() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("535.261.03", OLD_BITS, 0x810).write(&dir.path().join("t"));
    let (code, out) = run_src(&root, &["--check"]);
    assert_eq!(code, 10, "{out}");
    assert!(out.contains("not patched"), "{out}");
    assert_eq!(run_src(&root, &[]).0, 0);
    let once = gen_text(&root);
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 0);
    assert!(out.contains("already patched"), "{out}");
    assert_eq!(gen_text(&root), once);
    assert_eq!(run_src(&root, &["--check"]).0, 0);
}

#[test]
fn check_changes_nothing() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("570.211.01", NEW_BITS, 0x108).write(&dir.path().join("t"));
    let before = gen_text(&root);
    run_src(&root, &["--check"]);
    assert_eq!(gen_text(&root), before);
}

#[test]
fn emitted_patch_is_one_line_and_stable() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("580.142", NEW_BITS, 0x10108)
        .amp()
        .write(&dir.path().join("t"));
    let (p1, p2) = (dir.path().join("1.patch"), dir.path().join("2.patch"));
    assert_eq!(run_src(&root, &["--emit-patch", p1.to_str().unwrap()]).0, 0);
    assert_eq!(run_src(&root, &["--emit-patch", p2.to_str().unwrap()]).0, 0); // already patched
    let text = read(&p1);
    assert_eq!(text, read(&p2));
    let changed: Vec<&str> = text
        .lines()
        .filter(|l| {
            (l.starts_with('+') || l.starts_with('-'))
                && !l.starts_with("+++")
                && !l.starts_with("---")
        })
        .collect();
    assert_eq!(
        changed,
        [
            "-        /*flags=*/      0x10108u,",
            "+        /*flags=*/      0x10118u,"
        ]
    );
}

/// Replaces the entry's `/*flags=*/` line (the last one before the method id) with `bad`.
fn replace_entry_flags_line(root: &Path, bad: &str) {
    let text = gen_text(root);
    let id = text.find("0x2080110bu").unwrap();
    let j = text[..id].rfind("/*flags=*/").unwrap();
    let end = j + text[j..].find('\n').unwrap();
    write(
        root.join(GEN),
        format!("{}{bad}{}", &text[..j], &text[end..]),
    );
}

#[test]
fn refusals_change_nothing() {
    let dir = TempDir::new().unwrap();
    let tree = |name: &str, t: Tree| t.write(&dir.path().join(name));
    // Two entries with the method id.
    let mut t = Tree::new("580.142", NEW_BITS, 0x10108);
    t.extra = vec![entry(300, 0x2080110B, 0x8, "dup", "")];
    let root = tree("dup", t);
    let before = gen_text(&root);
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("2 entries"), "{out}");
    assert_eq!(gen_text(&root), before);
    // No such entry.
    let root = tree("none", Tree::new("580.142", NEW_BITS, 0x10108));
    write(
        root.join(GEN),
        gen_text(&root).replace("0x2080110bu", "0x2080110cu"),
    );
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("no exported-method entry"), "{out}");
    // Entry without a flags line.
    let root = tree("noflags", Tree::new("580.142", NEW_BITS, 0x10108));
    let text = gen_text(&root);
    let j = text[..text.find("0x2080110bu").unwrap()]
        .rfind("/*flags=*/")
        .unwrap();
    write(
        root.join(GEN),
        format!("{}/*flagz=*/{}", &text[..j], &text[j + 10..]),
    );
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("0 /*flags=*/ lines"), "{out}");
    // Flags not a hex literal, and an entry with two flags lines: not parseable, refused.
    for (name, bad, count) in [
        (
            "symbolic",
            "/*flags=*/      (RMCTRL_FLAGS_NON_PRIVILEGED | 0x100u),",
            0,
        ),
        (
            "twice",
            "/*flags=*/      0x10108u,\n        /*flags=*/      0x10108u,",
            2,
        ),
    ] {
        let root = tree(name, Tree::new("580.142", NEW_BITS, 0x10108));
        replace_entry_flags_line(&root, bad);
        let before = gen_text(&root);
        let (code, out) = run_src(&root, &[]);
        assert_eq!(code, 4, "{name}: {out}");
        assert!(
            out.contains(&format!("has {count} /*flags=*/ lines")),
            "{name}: {out}"
        );
        assert_eq!(gen_text(&root), before);
    }
    // control.h without the flag.
    let root = tree(
        "noctl",
        Tree::new("580.142", &[("NON_PRIVILEGED", 8)], 0x10108),
    );
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 4, "{out}");
    assert!(
        out.contains("does not define RMCTRL_FLAGS_GPU_LOCK_DEVICE_ONLY"),
        "{out}"
    );
    // control.h missing.
    let mut t = Tree::new("580.142", NEW_BITS, 0x10108);
    t.control = false;
    let root = tree("nocontrol", t);
    assert_eq!(run_src(&root, &[]).0, 4);
}

#[test]
fn the_525_shape_is_refused_for_the_default_flag() {
    // 525: the entry lacks API_LOCK_READONLY, so the API lock still serialises every GPU.
    let dir = TempDir::new().unwrap();
    let root = Tree::new("525.147.05", OLD_BITS, 0x10).write(&dir.path().join("t"));
    let before = gen_text(&root);
    for extra in [&[][..], &["--check"]] {
        let (code, out) = run_src(&root, extra);
        assert_eq!(code, 4, "{out}");
        assert!(out.contains("unsupported"), "{out}");
        assert!(out.contains("RMCTRL_FLAGS_API_LOCK_READONLY"), "{out}");
    }
    assert_eq!(gen_text(&root), before);
    // The experimental flag is still possible there (its own bit, read from control.h), with a warning.
    let (code, out) = run_src(&root, &["--flag", "route-to-physical"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("warning"), "{out}");
    assert_one_line_changed(&before, &gen_text(&root), 0x10, 0x210);
}

#[test]
fn refuses_when_the_disable_macro_reads_the_flags() {
    let dir = TempDir::new().unwrap();
    let mut t = Tree::new("580.142", NEW_BITS, 0x10108).amp();
    t.macro_line = "#define NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(x)      ((x) & 0x10)\n";
    let root = t.write(&dir.path().join("t"));
    let before = gen_text(&root);
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 4, "{out}");
    assert!(
        out.contains("NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG"),
        "{out}"
    );
    assert_eq!(gen_text(&root), before);
}

#[test]
fn version_from_nvver_h_and_help() {
    let dir = TempDir::new().unwrap();
    let root = Tree::new("580.142", NEW_BITS, 0x10108)
        .amp()
        .write(&dir.path().join("t"));
    fs::remove_file(root.join("version.mk")).unwrap();
    write(
        root.join("src/common/inc/nvVer.h"),
        "#define NV_VERSION_STRING \"580.999\"\n",
    );
    let (code, out) = run_src(&root, &["--check"]);
    assert_eq!(code, 10, "{out}");
    assert!(out.contains("driver 580.999"), "{out}");
    assert!(out.contains("old flags 0x10108"), "{out}");
    let (code, out) = run(&["--help"]);
    assert_eq!(code, 0);
    for c in [" 0 ", "10 ", " 2 ", " 3 ", " 4 "] {
        assert!(out.contains(c), "{c:?} in {out}");
    }
}

#[test]
fn refuses_packaged_and_proprietary_trees() {
    let dir = TempDir::new().unwrap();
    let root = dir.path().join("NVIDIA-Linux-x86_64-580.142");
    write(root.join("kernel/nvidia/nv-kernel.o_binary"), b"\x7fELF");
    let (code, out) = run_src(&root, &[]);
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("prebuilt resource manager"), "{out}");
    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let (code, out) = run_src(&empty, &[]);
    assert_eq!(code, 4);
    assert!(out.contains("not an open-gpu-kernel-modules tree"), "{out}");
    assert_eq!(run_src(&dir.path().join("missing"), &[]).0, 2);
}
