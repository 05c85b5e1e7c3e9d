//! `valvectl doctor`: what this node supports (driver, GSP, BPF, root, device-file exposure) and,
//! with a self-started CUDA test load, whether channel control works and whether the driver
//! serialises it across GPUs (stock: global lock) or not (patched: per-GPU lock), measured with the
//! controller's own issue probe: what serial and parallel issue each cost against one GPU.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use valve::controller::{ChannelTarget, Controller, PreemptMode};
use valve::driver::DriverInfo;
use valve::stats::summarize_us;
use valve::{IssueMode, LockProbe};
use valve_ebpf::{Registry, WatchConfig, Watcher};

/// A check's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but something needs attention.
    Warn,
    /// Valve cannot work here until this is fixed.
    Fail,
    /// Not checked (and why).
    Skip,
}

/// One line of the doctor's report.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// What was checked.
    pub check: &'static str,
    /// The outcome.
    pub status: Status,
    /// What was found, and the fix where there is one.
    pub detail: String,
}

fn finding(check: &'static str, status: Status, detail: impl Into<String>) -> Finding {
    Finding {
        check,
        status,
        detail: detail.into(),
    }
}

/// GSP state from a `/proc/driver/nvidia/gpus/<bus>/information` file: `Some(true)` when its
/// "GPU Firmware" line names a version, `Some(false)` for "N/A", `None` without the line.
pub fn parse_gsp(information: &str) -> Option<bool> {
    let line = information
        .lines()
        .find(|l| l.trim_start().starts_with("GPU Firmware:"))?;
    let value = line.split_once(':')?.1.trim();
    Some(!value.is_empty() && !value.eq_ignore_ascii_case("N/A"))
}

/// The lock the driver takes for FIFO_DISABLE_CHANNELS, judged from one measurement of one GPU
/// against all GPUs issued serially and in parallel (the controller's own probe, the one the gate
/// runs at start): a verdict, and the detail with both ratios against one GPU.
pub fn classify_lock(p: &LockProbe) -> (&'static str, String) {
    let verdict = if p.serialised() {
        "stock: global lock"
    } else if p.parallel_ratio() <= 1.0 + 0.25 * (p.gpus as f64 - 1.0) {
        "patched: per-GPU lock"
    } else {
        "unclear"
    };
    let issue = match p.best_mode() {
        IssueMode::Serial => "serial",
        IssueMode::Parallel => "parallel",
    };
    (verdict, format!("{}; Valve issues {issue}", p.describe()))
}

fn device_files() -> Vec<(String, u32)> {
    let mut v = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/dev") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let is_nv = name == "nvidiactl"
                || (name.starts_with("nvidia")
                    && name[6..].chars().all(|c| c.is_ascii_digit())
                    && name.len() > 6);
            if is_nv {
                if let Ok(m) = e.metadata() {
                    v.push((format!("/dev/{name}"), m.permissions().mode() & 0o777));
                }
            }
        }
    }
    v.sort();
    v
}

/// Runs every check. `test_load` is the command that starts the CUDA test load (normally
/// `valvectl test-load`).
pub fn run(test_load: &std::path::Path) -> Vec<Finding> {
    let mut out = vec![
        driver_check(),
        gsp_check(),
        device_files_check(),
        mps_check(&valve_daemon::mps::MpsScan::all(std::path::Path::new(
            "/proc",
        ))),
    ];
    let root = nix::unistd::geteuid().is_root();
    out.push(finding("root", if root { Status::Ok } else { Status::Warn }, if root { "running as root".to_string() } else { "not root: the daemon and the BPF/test-load checks below need root (sudo valvectl doctor)".to_string() }));
    let ctl = match Controller::open() {
        Ok(c) => {
            out.push(finding(
                "rm client",
                Status::Ok,
                format!("Valve's RM client opened {} GPU(s)", c.gpus().len()),
            ));
            Some(c)
        }
        Err(e) => {
            out.push(finding("rm client", Status::Fail, e.to_string()));
            None
        }
    };
    if !root {
        out.push(finding("bpf", Status::Skip, "needs root"));
        out.push(finding(
            "channel control",
            Status::Skip,
            "needs root (the test load's channels are learned with BPF)",
        ));
        return out;
    }
    let watcher = match Watcher::start(WatchConfig::default()) {
        Ok(w) => {
            out.push(finding("bpf", Status::Ok, "BPF programs loaded on syscalls/sys_enter_ioctl, sys_exit_ioctl and sched_process_exit"));
            w
        }
        Err(e) => {
            out.push(finding("bpf", Status::Fail, e.to_string()));
            return out;
        }
    };
    let Some(ctl) = ctl else { return out };
    match channel_checks(&ctl, &watcher, test_load) {
        Ok(mut f) => out.append(&mut f),
        Err(e) => out.push(finding("channel control", Status::Fail, e)),
    }
    out
}

/// Whether CUDA MPS runs on this node, and what that means for Valve.
pub fn mps_check(scan: &valve_daemon::mps::MpsScan) -> Finding {
    let daemons = scan.daemons();
    if daemons.is_empty() {
        return finding(
            "cuda mps",
            Status::Ok,
            "no CUDA MPS server or control daemon runs",
        );
    }
    let list: Vec<String> = daemons
        .iter()
        .map(|d| {
            let what = if d.server { "server" } else { "control daemon" };
            format!("{what} pid {} (pipe dir {})", d.pid, d.pipe_dir.display())
        })
        .collect();
    finding(
        "cuda mps",
        Status::Warn,
        format!(
            "CUDA MPS runs: {}. Valve cannot freeze MPS clients (their kernels run in the \
             server's channel group), so preempt and gate start refuse MPS clients and servers \
             (exit code {}) and ps marks them; run offline jobs outside MPS to harvest them \
             (docs/mps.md)",
            list.join(", "),
            valve_daemon::EXIT_MPS
        ),
    )
}

/// The loaded driver: open kernel module or not.
fn driver_check() -> Finding {
    match DriverInfo::read() {
        Ok(d) if d.open_module => finding(
            "driver",
            Status::Ok,
            format!("{} (open kernel module)", d.version),
        ),
        Ok(d) => finding(
            "driver",
            Status::Fail,
            format!(
                "{}: proprietary module; Valve needs the open kernel module of the same version",
                d.version
            ),
        ),
        Err(e) => finding("driver", Status::Fail, e.to_string()),
    }
}

/// GSP firmware, per GPU.
fn gsp_check() -> Finding {
    let mut gsp = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc/driver/nvidia/gpus") {
        for e in dir.flatten() {
            let info = std::fs::read_to_string(e.path().join("information")).unwrap_or_default();
            gsp.push((
                e.file_name().to_string_lossy().to_string(),
                parse_gsp(&info),
            ));
        }
    }
    gsp.sort();
    if gsp.is_empty() {
        return finding("gsp", Status::Skip, "no /proc/driver/nvidia/gpus entries");
    }
    let on = gsp.iter().filter(|g| g.1 == Some(true)).count();
    let status = if on == gsp.len() {
        Status::Ok
    } else {
        Status::Warn
    };
    finding(
        "gsp",
        status,
        format!(
            "GSP firmware on {on} of {} GPU(s){}",
            gsp.len(),
            if on == gsp.len() {
                "; the driver patch's ROUTE_TO_PHYSICAL path applies"
            } else {
                "; without GSP the driver patch does not apply to those GPUs"
            }
        ),
    )
}

/// Who may open the NVIDIA device files (world read-write lets anyone freeze anyone).
fn device_files_check() -> Finding {
    let files = device_files();
    let open: Vec<&(String, u32)> = files.iter().filter(|f| f.1 & 0o006 == 0o006).collect();
    if files.is_empty() {
        finding(
            "device files",
            Status::Fail,
            "no /dev/nvidiactl or /dev/nvidiaN: the driver is not loaded or not visible here",
        )
    } else if !open.is_empty() {
        finding("device files", Status::Warn, format!(
            "{} of {} NVIDIA device files are world read-writable (e.g. {} {:o}): FIFO_DISABLE_CHANNELS is non-privileged and RM handles are predictable, so ANY local user can freeze ANY other user's GPU work. Restrict them (nvidia module options NVreg_DeviceFileUID/GID/Mode) to the users who run GPU jobs",
            open.len(), files.len(), open[0].0, open[0].1))
    } else {
        finding(
            "device files",
            Status::Ok,
            format!("{} files, none world-writable", files.len()),
        )
    }
}

/// Starts the CUDA test load, checks channel control on it, and stops it again.
fn channel_checks(
    ctl: &Controller,
    watcher: &Watcher,
    test_load: &std::path::Path,
) -> Result<Vec<Finding>, String> {
    let mut child = Command::new(test_load)
        .arg("test-load")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting the CUDA test load: {e}"))?;
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line);
    let result = if line.starts_with("ready") {
        check_test_load(ctl, watcher, child.id())
    } else {
        Err(format!(
            "the CUDA test load did not start (it printed {:?}); is libcuda.so.1 installed?",
            line.trim()
        ))
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(b"\n");
    }
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Channel control on the running test load `pid`: each GPU alone, then all GPUs at once.
fn check_test_load(ctl: &Controller, watcher: &Watcher, pid: u32) -> Result<Vec<Finding>, String> {
    std::thread::sleep(Duration::from_millis(100));
    let mut reg = Registry::new();
    for ev in watcher.drain() {
        reg.apply(&ev);
    }
    let gpus = ctl.gpus();
    let mut per_gpu: Vec<Vec<ChannelTarget>> = Vec::new();
    for g in &gpus {
        let t: Vec<ChannelTarget> = reg
            .channels(pid, g.device_instance)
            .into_iter()
            .map(|(client, channel)| ChannelTarget {
                gpu: g.index,
                client,
                channel,
            })
            .collect();
        per_gpu.push(t);
    }
    let mut out = Vec::new();
    for (i, t) in per_gpu.iter().enumerate() {
        if t.is_empty() {
            out.push(finding(
                "channel control",
                Status::Fail,
                format!("GPU {i}: the test load's channels were not observed"),
            ));
            continue;
        }
        let p50 = disable_p50(ctl, t, &format!("GPU {i}: "))?;
        out.push(finding("channel control", Status::Ok, format!("GPU {i} ({}): disable/enable of {} test-load channel(s) works; disable p50 {:.0} us", gpus[i].name, t.len(), p50)));
    }
    out.push(multi_gpu_check(ctl, &per_gpu)?);
    Ok(out)
}

/// The p50 wall time (us) of disabling `targets` at once, over 20 disable/enable cycles;
/// `context` prefixes a disable or enable error.
fn disable_p50(ctl: &Controller, targets: &[ChannelTarget], context: &str) -> Result<f64, String> {
    let plan = ctl
        .plan(targets, PreemptMode::Preempt)
        .map_err(|e| e.to_string())?;
    let mut walls = Vec::new();
    for _ in 0..20 {
        let t0 = Instant::now();
        let g = ctl.disable(&plan).map_err(|e| format!("{context}{e}"))?;
        walls.push(t0.elapsed().as_secs_f64() * 1e6);
        g.enable().map_err(|e| format!("{context}{e}"))?;
    }
    Ok(summarize_us(&walls).p50_us)
}

/// Whether the driver serialises the disable across GPUs: the controller's probe (one GPU, all
/// serially, all in parallel; interleaved, 20 cycles each) on the test load's channels.
fn multi_gpu_check(ctl: &Controller, per_gpu: &[Vec<ChannelTarget>]) -> Result<Finding, String> {
    let n = per_gpu.iter().filter(|t| !t.is_empty()).count();
    if n < 2 {
        return Ok(finding(
            "multi-GPU lock",
            Status::Skip,
            "needs channels on 2 or more GPUs",
        ));
    }
    let all: Vec<ChannelTarget> = per_gpu.iter().flatten().copied().collect();
    let plan = ctl
        .plan(&all, PreemptMode::Preempt)
        .map_err(|e| e.to_string())?;
    let probe = ctl.probe_issue(&plan, 20).map_err(|e| e.to_string())?;
    let (verdict, detail) = classify_lock(&probe);
    let status = if verdict.starts_with("patched") {
        Status::Ok
    } else {
        Status::Warn
    };
    Ok(finding(
        "multi-GPU lock",
        status,
        format!(
            "{verdict}: {detail}{}",
            if verdict.starts_with("stock") {
                "; apply the driver patch (scripts/patch-driver.sh) so GPUs preempt in parallel"
            } else {
                ""
            }
        ),
    ))
}

/// `valvectl test-load`: creates a CUDA context on every GPU through libcuda (loaded at run time),
/// runs a memset on each so its channels exist, prints `ready N` and waits for stdin to close.
pub fn test_load() -> i32 {
    type Fn1 = unsafe extern "C" fn(u32) -> i32;
    type FnCount = unsafe extern "C" fn(*mut i32) -> i32;
    type FnGet = unsafe extern "C" fn(*mut i32, i32) -> i32;
    type FnRetain = unsafe extern "C" fn(*mut *mut libc::c_void, i32) -> i32;
    type FnSetCurrent = unsafe extern "C" fn(*mut libc::c_void) -> i32;
    type FnAlloc = unsafe extern "C" fn(*mut u64, usize) -> i32;
    type FnMemset = unsafe extern "C" fn(u64, u8, usize) -> i32;
    type FnSync = unsafe extern "C" fn() -> i32;
    // SAFETY: dlopen with a constant NUL-terminated name; a null result is handled.
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if lib.is_null() {
        eprintln!("test-load: libcuda.so.1 not found: install the NVIDIA user-space driver");
        return 1;
    }
    let sym = |name: &std::ffi::CStr| {
        // SAFETY: `lib` is a live handle from dlopen; `name` is NUL-terminated.
        let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
        if p.is_null() {
            eprintln!("test-load: libcuda lacks {name:?}");
            std::process::exit(1);
        }
        p
    };
    // SAFETY: each symbol is transmuted to the C signature the CUDA driver API documents for it
    // (cuInit, cuDeviceGetCount, cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent,
    // cuMemAlloc_v2, cuMemsetD8_v2, cuCtxSynchronize); all pointers passed are to live locals.
    unsafe {
        let init: Fn1 = std::mem::transmute(sym(c"cuInit"));
        let count: FnCount = std::mem::transmute(sym(c"cuDeviceGetCount"));
        let get: FnGet = std::mem::transmute(sym(c"cuDeviceGet"));
        let retain: FnRetain = std::mem::transmute(sym(c"cuDevicePrimaryCtxRetain"));
        let set_current: FnSetCurrent = std::mem::transmute(sym(c"cuCtxSetCurrent"));
        let alloc: FnAlloc = std::mem::transmute(sym(c"cuMemAlloc_v2"));
        let memset: FnMemset = std::mem::transmute(sym(c"cuMemsetD8_v2"));
        let sync: FnSync = std::mem::transmute(sym(c"cuCtxSynchronize"));
        let check = |what: &str, r: i32| {
            if r != 0 {
                eprintln!("test-load: {what} failed with CUDA error {r}");
                std::process::exit(1);
            }
        };
        check("cuInit", init(0));
        let mut n = 0;
        check("cuDeviceGetCount", count(&mut n));
        for i in 0..n {
            let mut dev = 0;
            check("cuDeviceGet", get(&mut dev, i));
            let mut ctx = std::ptr::null_mut();
            check("cuDevicePrimaryCtxRetain", retain(&mut ctx, dev));
            check("cuCtxSetCurrent", set_current(ctx));
            let mut ptr = 0u64;
            check("cuMemAlloc", alloc(&mut ptr, 1 << 20));
            check("cuMemsetD8", memset(ptr, 0, 1 << 20));
            check("cuCtxSynchronize", sync());
        }
        println!("ready {n}");
    }
    let _ = std::io::stdout().flush();
    let mut buf = String::new();
    let _ = std::io::stdin().read_line(&mut buf);
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_mps_server_is_reported_with_what_it_means() {
        let t = tempfile::tempdir().unwrap();
        let none = mps_check(&valve_daemon::mps::MpsScan::all(t.path()));
        assert_eq!(none.status, Status::Ok, "{}", none.detail);
        let dir = t.path().join("77");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("comm"), "nvidia-cuda-mps\n").unwrap();
        std::fs::write(dir.join("cmdline"), "nvidia-cuda-mps-server\0").unwrap();
        std::fs::write(dir.join("environ"), "CUDA_MPS_PIPE_DIRECTORY=/run/mps\0").unwrap();
        let f = mps_check(&valve_daemon::mps::MpsScan::all(t.path()));
        assert_eq!(f.status, Status::Warn);
        for part in [
            "server pid 77 (pipe dir /run/mps)",
            "refuse",
            "exit code 10",
        ] {
            assert!(f.detail.contains(part), "{part:?} missing: {}", f.detail);
        }
    }

    #[test]
    fn gsp_line_parsing() {
        let on =
            "Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t GPU-1\nGPU Firmware: \t 580.159.04\n";
        assert_eq!(parse_gsp(on), Some(true));
        assert_eq!(parse_gsp("Model: x\nGPU Firmware: \t N/A\n"), Some(false));
        assert_eq!(parse_gsp("Model: x\n"), None);
    }

    fn probe(gpus: usize, single: f64, serial: f64, parallel: f64) -> LockProbe {
        LockProbe {
            gpus,
            single_us: single,
            serial_us: serial,
            parallel_us: parallel,
        }
    }

    #[test]
    fn lock_classification() {
        // The hardware notes' 4x H200 on the stock driver: parallel is no faster than serial,
        // and serial costs 3.9x one GPU (what the doctor must report, not parallel's ratio).
        let (v, d) = classify_lock(&probe(4, 814.0, 3190.0, 3479.0));
        assert_eq!(v, "stock: global lock");
        assert!(d.contains("serial 3190 us (3.92x one GPU)"), "{d}");
        assert!(d.ends_with("Valve issues serial"), "{d}");
        // A per-GPU lock: parallel close to one GPU.
        let (v, d) = classify_lock(&probe(2, 825.0, 1650.0, 900.0));
        assert_eq!(v, "patched: per-GPU lock");
        assert!(d.ends_with("Valve issues parallel"), "{d}");
        // Parallel clearly faster than serial but far from one GPU: unclear.
        assert_eq!(classify_lock(&probe(4, 800.0, 3200.0, 1900.0)).0, "unclear");
    }
}
