//! `valvectl demo` as a new user runs it: the real binary, within its time limit, shows the
//! offline job frozen by the gate and then released, exits 0 and leaves no process or file.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The most the demo may take (it says it ends well within a minute).
const LIMIT: Duration = Duration::from_secs(60);

/// Runs `valvectl demo ARGS` with its temporary files under `tmp`; kills it past [`LIMIT`].
fn demo(tmp: &Path, args: &[&str]) -> (Output, Duration) {
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_valvectl"))
        .arg("demo")
        .args(args)
        .env("TMPDIR", tmp)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("valvectl demo ran past {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (child.wait_with_output().unwrap(), t0.elapsed())
}

/// The process of `role` in a frame (the demo has one GPU).
fn process<'a>(frame: &'a Value, role: &str) -> &'a Value {
    frame["top"]["gpus"][0]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["role"] == role)
        .unwrap_or_else(|| panic!("no {role} process in {frame}"))
}

#[test]
fn the_json_frames_show_offline_frozen_then_released_and_nothing_is_left() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, took) = demo(tmp.path(), &["--json", "--requests", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    assert!(took < LIMIT);
    let frames: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Start, then a freeze and a release per request, in that order.
    let frozen: Vec<bool> = frames
        .iter()
        .map(|f| f["top"]["gate"]["offline_frozen"].as_bool().unwrap())
        .collect();
    assert_eq!(frozen, [false, true, false, true, false], "{frames:?}");
    for f in &frames {
        let offline = process(f, "offline");
        let state = offline["state"].as_str().unwrap();
        assert_eq!(
            process(f, "online")["state"],
            "running",
            "online is never frozen"
        );
        let is_frozen = f["top"]["gate"]["offline_frozen"] == true;
        // What the daemon showed agrees with the fake driver's disabled channels.
        let disabled = f["driver_disabled_channels"].as_u64().unwrap();
        if is_frozen {
            assert_eq!(state, "frozen", "{f}");
            assert_eq!(offline["frozen_by"], "gate", "{f}");
            assert_eq!(disabled, 4, "the offline job's 4 channels: {f}");
        } else {
            assert_eq!(state, "running", "{f}");
            assert_eq!(disabled, 0, "{f}");
        }
    }
    // At least one freeze per request (a host stall longer than the cooldown inside a request
    // costs another, as it would on a GPU), and every freeze released.
    let last = frames.last().unwrap();
    let freezes = last["top"]["gate"]["preemptions"].as_u64().unwrap();
    assert!(freezes >= 2, "{last}");
    assert_eq!(last["top"]["gate"]["resumes"], freezes, "{last}");
    // The stand-in processes and the temporary directory are gone.
    for role in ["online", "offline"] {
        let pid = process(last, role)["pid"].as_u64().unwrap();
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "pid {pid} left"
        );
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
}

/// The numbers in the closing line: "froze the offline job N time(s) and released it M time(s)".
fn counts(text: &str) -> (u64, u64) {
    let line = text
        .lines()
        .find(|l| l.starts_with("demo: done."))
        .unwrap_or_else(|| panic!("no closing line:\n{text}"));
    let n: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(n.len(), 2, "{line}");
    (n[0], n[1])
}

#[test]
fn the_text_frames_are_tops_and_end_with_what_happened() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, _) = demo(tmp.path(), &["--requests", "1", "--busy", "300"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains('\x1b'), "escape codes:\n{text}");
    // Three frames (start, frozen, released), each with the offline job's row as top prints it.
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.split_whitespace().nth(2) == Some("offline-job"))
        .collect();
    assert_eq!(rows.len(), 3, "{text}");
    assert!(
        !rows[0].contains("frozen") && rows[0].contains("running"),
        "{text}"
    );
    assert!(rows[1].contains("frozen (gate)"), "{text}");
    assert!(
        !rows[2].contains("frozen") && rows[2].contains("running"),
        "{text}"
    );
    assert!(
        text.contains("(the fake driver has 4 of 6 channels disabled)"),
        "{text}"
    );
    let (froze, released) = counts(&text);
    assert!(froze >= 1 && released == froze, "{text}");
    assert!(std::fs::read_dir(tmp.path()).unwrap().next().is_none());
}

#[test]
fn bad_arguments_are_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, _) = demo(tmp.path(), &["--requests", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--requests"));
}
