//! The C ABI: a C program compiled with `cc` against `include/valve_client.h` and the cdylib,
//! run against the mock daemon; and the entry points' refusal of NULLs and bad arguments.

use std::ffi::CStr;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::json;

use super::*;
use crate::ffi::*;

/// The cdylib cargo built beside this test binary (target/<profile>/libvalve_client.so).
fn cdylib_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    let found = [deps.parent()?, deps]
        .into_iter()
        .find(|d| d.join("libvalve_client.so").exists())
        .map(Path::to_path_buf);
    found
}

fn compile(out: &Path, lib_dir: &Path) -> Option<()> {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/c/roundtrip.c"))
        .arg("-L")
        .arg(lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lvalve_client", "-o"])
        .arg(out)
        .status();
    match status {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => panic!("running cc: {e}"),
        Ok(s) => {
            assert!(
                s.success(),
                "cc failed to build tests/c/roundtrip.c against the header"
            );
            Some(())
        }
    }
}

#[test]
fn a_c_program_drives_the_library_through_the_header() {
    let Some(lib_dir) = cdylib_dir() else {
        panic!("libvalve_client.so is not beside the test binary: `cargo test -p valve-client` builds it (through the example)");
    };
    let mock = mock();
    let prog = mock.path.with_file_name("roundtrip");
    if compile(&prog, &lib_dir).is_none() {
        eprintln!(
            "skipping the C ABI round trip: no C compiler `cc` on PATH (install gcc or clang)"
        );
        return;
    }
    let mut child = Command::new(&prog)
        .arg(&mock.path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    while lines.last().map(String::as_str) != Some("ready") {
        let mut l = String::new();
        assert!(
            out.read_line(&mut l).unwrap() > 0,
            "the C program stopped early: {lines:?}"
        );
        lines.push(l.trim_end().to_string());
    }
    let id = mock.clients("offline")[0];
    assert_eq!(mock.reclaim(id, 2)["handles"], json!([2, 1]));
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let rest: Vec<String> = out.lines().map(Result::unwrap).collect();
    assert!(
        child.wait().unwrap().success(),
        "C program failed; it printed {lines:?} {rest:?}"
    );
    lines.extend(rest);
    assert_eq!(
        lines,
        [
            "space regions=2 slots=8 blocks_per_slot=4 piece=4194304",
            "grow 3: 0 1 2",
            "ready",
            "invalidated 8 9 10 11 4 5 6 7",
            "stats held=1 quarantined=2 reclaims=1 handles=2",
            "usage 15",
            "done",
        ]
    );
    assert!(eventually(|| mock.clients("offline").is_empty()));
}

fn last_error() -> String {
    // SAFETY: valve_client_last_error returns a NUL-terminated string owned by this thread,
    // valid until this thread's next valve_client_* call; it is copied at once.
    unsafe { CStr::from_ptr(valve_client_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn null_pointers_and_bad_arguments_are_status_codes() {
    // SAFETY: every pointer passed is NULL, a live local, or a client from connect below.
    unsafe {
        let mut c: *mut ValveClient = std::ptr::null_mut();
        assert_eq!(
            valve_client_connect(std::ptr::null(), 0, std::ptr::null(), 0, &mut c),
            100
        );
        assert!(last_error().contains("gpu is NULL"), "{}", last_error());
        assert_eq!(
            valve_client_kv_space(std::ptr::null_mut(), 1, 0, 1, std::ptr::null_mut()),
            100
        );
        assert_eq!(valve_client_region_ptr(std::ptr::null_mut(), 0), 0);
        assert!(last_error().contains("client is NULL"));
        assert_eq!(
            valve_client_take_invalidated(std::ptr::null_mut(), std::ptr::null_mut(), 0),
            -100
        );
        assert_eq!(
            valve_client_shrink(std::ptr::null_mut(), std::ptr::null(), 3),
            100
        );
        valve_client_close(std::ptr::null_mut());

        let mock = mock();
        let path = std::ffi::CString::new(mock.path.to_str().unwrap()).unwrap();
        let gpu = c"0";
        let rc = valve_client_connect(
            path.as_ptr(),
            0,
            gpu.as_ptr(),
            VALVE_CLIENT_FAKE_GPU,
            &mut c,
        );
        assert_eq!(rc, 0, "{}", last_error());
        assert_eq!(last_error(), "");
        assert_eq!(
            valve_client_shrink(c, std::ptr::null(), 2),
            100,
            "NULL with n > 0"
        );
        assert_eq!(
            valve_client_set_block_owner(c, 0, 1, 1),
            107,
            "no KV space yet"
        );
        let mut info = ValveKvSpaceInfo::default();
        assert_eq!(valve_client_kv_space(c, 3, 0, 1 << 20, &mut info), 105);
        assert!(
            last_error().contains("--pool-handle-mib"),
            "{}",
            last_error()
        );
        assert_eq!(valve_client_kv_space(c, 1, 0, 1 << 20, &mut info), 0);
        let mut slots = [0u32; 1];
        let mut n = 0usize;
        assert_eq!(
            valve_client_grow(c, 2, slots.as_mut_ptr(), 1, &mut n),
            100,
            "cap < count"
        );
        assert_eq!(valve_client_grow(c, 1, slots.as_mut_ptr(), 1, &mut n), 0);
        let mut target = 0u64;
        assert_eq!(valve_client_usage(c, 1, &mut target), 0);
        assert_eq!(target, 2);
        valve_client_close(c);
    }
}
