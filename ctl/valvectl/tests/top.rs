//! `valvectl top --once` against a daemon on the fake RM: the daemon's core and control socket
//! run in this test (as `valve_daemon`'s own socket tests run them), a live child process
//! stands for an offline job whose channels the registry learned, it is frozen with a preempt
//! over the socket, and the real `valvectl` binary must show it frozen on its GPU.

use std::cell::RefCell;
use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use valve::controller::Controller;
use valve::fake::FakeRm;
use valve::state::StateFile;
use valve_daemon::audit::Audit;
use valve_daemon::metrics::{install_for_gate, Metrics};
use valve_daemon::server::{bind, EventSource, Server};
use valve_daemon::DaemonCore;
use valve_ebpf::{AllocEvent, RmEvent, RmEventKind};
use valve_ioctl_bindings::{self as b, ChannelHandle, ClientHandle, ObjectHandle};

/// RM events handed to the daemon's loop.
struct Queued(RefCell<VecDeque<RmEvent>>);

impl EventSource for Queued {
    fn next_event(&self) -> Option<RmEvent> {
        self.0.borrow_mut().pop_front()
    }
    fn alive(&self) -> bool {
        true
    }
}

fn alloc(
    pid: u32,
    client: u32,
    parent: u32,
    object: u32,
    class: u32,
    extra: Option<u32>,
) -> RmEvent {
    RmEvent {
        ts_ns: 0,
        pid,
        tid: pid,
        kind: RmEventKind::Alloc(AllocEvent {
            client: ClientHandle(client),
            parent: ObjectHandle(parent),
            object: ObjectHandle(object),
            class,
            extra,
            minor: 255,
            nvos64: true,
        }),
    }
}

/// What the watcher reports for a CUDA context on device `instance`: client, device, a TSG of
/// `n` channels (each with its compute object). The channels are registered with the fake RM.
fn cuda_context(rm: &FakeRm, pid: u32, client: u32, instance: u32, n: u32) -> Vec<RmEvent> {
    let (dev, tsg) = (0x5c00_0001, 0x5c00_0002);
    let mut ev = vec![
        alloc(pid, 0, 0, client, b::NV01_ROOT_CLIENT, None),
        alloc(pid, client, client, dev, b::NV01_DEVICE_0, Some(instance)),
        alloc(pid, client, dev, tsg, b::KEPLER_CHANNEL_GROUP_A, None),
    ];
    let chans: Vec<ChannelHandle> = (0..n).map(|i| ChannelHandle(0x5c00_0010 + i)).collect();
    for c in &chans {
        ev.push(alloc(
            pid,
            client,
            tsg,
            c.0,
            b::HOPPER_CHANNEL_GPFIFO_A,
            None,
        ));
        ev.push(alloc(
            pid,
            client,
            c.0,
            c.0 + 0x80,
            b::HOPPER_COMPUTE_A,
            None,
        ));
    }
    rm.add_channels(ClientHandle(client), instance, &chans);
    ev
}

fn request(socket: &Path, line: &str) -> serde_json::Value {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(line.as_bytes()).unwrap();
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply).unwrap();
    serde_json::from_str(&reply).unwrap()
}

fn valvectl(socket: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_valvectl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

/// Kills the stand-in job however the test ends.
struct Job(Child);

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn top_once_shows_a_frozen_offline_process_on_its_gpu() {
    let job = Job(Command::new("sleep").arg("60").spawn().unwrap());
    let pid = job.0.id();
    let rm = Arc::new(FakeRm::host(2));
    let dir = tempfile::tempdir().unwrap();
    let ctl = Controller::with_driver(rm.clone()).unwrap();
    // The job's context is on the second GPU.
    let instance = ctl.gpus()[1].device_instance;
    let mut core = DaemonCore::with_start_time(
        ctl,
        StateFile::in_dir(dir.path()),
        None,
        BTreeSet::new(),
        |_| Some(42),
    )
    .unwrap();
    // The daemon's metrics, as the daemon always sets them up (this test binary is the only
    // one that installs them).
    let metrics = Metrics::new(2);
    install_for_gate(metrics.clone());
    core.set_metrics(metrics);
    let events = Queued(RefCell::new(
        cuda_context(&rm, pid, 0xc1d0_0042, instance, 3).into(),
    ));
    let socket = dir.path().join("valve.sock");
    let listener = bind(&socket, Some(nix::unistd::getegid().as_raw())).unwrap();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, Some(nix::unistd::getegid().as_raw()), &audit);

    let path: PathBuf = socket.clone();
    let pool = dir.path().join("no-pool.sock");
    let client = std::thread::spawn(move || {
        let preempt = request(
            &path,
            &format!("{{\"op\":\"preempt\",\"pid\":{pid},\"max_hold_ms\":60000}}\n"),
        );
        let pool = pool.to_str().unwrap();
        let text = valvectl(
            &path,
            &["top", "--once", "--interval", "200", "--pool-socket", pool],
        );
        let json = valvectl(
            &path,
            &[
                "top",
                "--once",
                "--json",
                "--interval",
                "0",
                "--pool-socket",
                pool,
            ],
        );
        (preempt, text, json)
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !client.is_finished() {
        assert!(Instant::now() < deadline, "valvectl top did not finish");
        server
            .step(&mut core, &events, Duration::from_millis(5))
            .unwrap();
    }
    let (preempt, text, json) = client.join().unwrap();
    assert!(preempt["error"].is_null(), "{preempt}");
    assert_eq!(rm.disabled().len(), 3, "the job's channels are disabled");

    check_text(&text, pid);
    check_json(&json, pid);
    drop(job);
}

/// `top --once` as text: the frozen job's row on GPU 1, no gate, no pool, no escape codes.
fn check_text(text: &std::process::Output, pid: u32) {
    let stdout = String::from_utf8(text.stdout.clone()).unwrap();
    assert!(
        text.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&text.stderr)
    );
    assert!(
        !stdout.contains('\x1b'),
        "escape codes in --once:\n{stdout}"
    );
    let row: Vec<&str> = stdout
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(&pid.to_string()))
        .unwrap_or_else(|| panic!("no row for pid {pid}:\n{stdout}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        row,
        [
            "1",
            &pid.to_string(),
            "sleep",
            "offline",
            "frozen",
            "(preempt)",
            "3",
            "-"
        ],
        "{stdout}"
    );
    assert!(stdout.contains("rates over 0.2 s"), "{stdout}");
    assert!(stdout.contains("gate: not running"), "{stdout}");
    assert!(stdout.contains("pool: not running"), "{stdout}");
    // Nothing harvested without a gate; the hold in progress is booked when it ends.
    assert!(
        stdout.contains("offline time: harvested 0.0 s, frozen 0.0 s"),
        "{stdout}"
    );
}

/// `top --once --json`: the daemon's own counters counted the freeze on GPU 1.
fn check_json(json: &std::process::Output, pid: u32) {
    assert!(
        json.status.success(),
        "{}",
        String::from_utf8_lossy(&json.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["counters"], "metrics");
    let gpu1 = &v["gpus"][1];
    assert_eq!(gpu1["index"], 1);
    assert_eq!(gpu1["frozen"], 1);
    assert_eq!(
        gpu1["preemptions"], 1.0,
        "the daemon's metrics counted the freeze"
    );
    assert!(gpu1["disable_p50_us"].is_number(), "{v}");
    let p = &gpu1["processes"][0];
    assert_eq!(p["pid"], pid);
    assert_eq!(p["state"], "frozen");
    assert_eq!(p["frozen_by"], "preempt");
    assert!(
        v["gpus"][0]["processes"].as_array().unwrap().is_empty(),
        "{v}"
    );
}

#[test]
fn top_without_a_daemon_names_the_socket_and_how_to_start_it() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("valve.sock");
    let out = valvectl(&socket, &["top", "--once"]);
    assert_eq!(out.status.code(), Some(7));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&socket.display().to_string()), "{err}");
    assert!(err.contains("sudo valvectl daemon"), "{err}");
    assert!(out.stdout.is_empty());
}
