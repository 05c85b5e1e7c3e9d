//! Without an NVIDIA driver, `valve-hwtest --only-ctx` must say why it skips and exit 0, without
//! touching its --bins or --out directories.

use std::process::Command;

#[test]
fn only_ctx_skips_cleanly_without_the_driver() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        eprintln!("a driver is present: this test covers hosts without one");
        return;
    }
    let out_dir = std::env::temp_dir().join(format!("valve-hwtest-skip-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_valve-hwtest"))
        .args(["--bins", "/nonexistent/bins", "--only-ctx", "--out"])
        .arg(&out_dir)
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{:?}: {stdout}", out.status);
    assert!(
        stdout.starts_with("SKIP: no NVIDIA driver on this machine (/dev/nvidiactl missing)")
            && stdout.contains("--only-ctx"),
        "{stdout}"
    );
    assert!(!out_dir.exists(), "nothing is written when skipping");
}
