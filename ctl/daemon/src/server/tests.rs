//! Tests of the control socket against hostile and idle clients, with the fake RM behind it.

use std::cell::RefCell;
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;

use valve::controller::Controller;
use valve::fake::FakeRm;
use valve::state::StateFile;

use super::*;
use crate::protocol::PROTOCOL_VERSION;

/// RM events a test hands to the loop.
#[derive(Default)]
pub(crate) struct QueuedEvents(pub RefCell<VecDeque<RmEvent>>);

impl EventSource for QueuedEvents {
    fn next_event(&self) -> Option<RmEvent> {
        self.0.borrow_mut().pop_front()
    }
    fn alive(&self) -> bool {
        true
    }
}

pub(crate) fn fake_core(rm: &Arc<FakeRm>, dir: &Path) -> DaemonCore<Arc<FakeRm>> {
    let ctl = Controller::with_driver(rm.clone()).unwrap();
    DaemonCore::with_start_time(ctl, StateFile::in_dir(dir), None, BTreeSet::new(), |_| {
        Some(42)
    })
    .unwrap()
}

/// A daemon core over a one-GPU fake RM, its state in a temporary directory, and its control
/// socket bound there for our own group.
pub(crate) fn bound_core() -> (
    Arc<FakeRm>,
    tempfile::TempDir,
    DaemonCore<Arc<FakeRm>>,
    std::path::PathBuf,
    UnixListener,
) {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let core = fake_core(&rm, dir.path());
    let socket = dir.path().join("valve.sock");
    let listener = bind(&socket, own_group()).unwrap();
    (rm, dir, core, socket, listener)
}

/// Our own group may use the socket, so the tests pass as root and as a user.
pub(crate) fn own_group() -> Option<u32> {
    Some(nix::unistd::getegid().as_raw())
}

/// Turns the loop until `client` has finished (at most 60 s); returns its result and the most
/// connections the server held at once.
pub(crate) fn serve_until<D: RmDriver, T>(
    server: &mut Server<'_>,
    core: &mut DaemonCore<D>,
    events: &impl EventSource,
    client: JoinHandle<T>,
) -> (T, usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut most = 0;
    while !client.is_finished() {
        assert!(Instant::now() < deadline, "the client did not finish");
        server.step(core, events, Duration::from_millis(5)).unwrap();
        most = most.max(server.connections());
    }
    (client.join().unwrap(), most)
}

pub(crate) fn request(socket: &Path, req: &str) -> Reply<serde_json::Value> {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

#[test]
fn a_request_over_the_size_limit_is_refused_unread() {
    let (_rm, _dir, mut core, socket, listener) = bound_core();
    let audit = Audit::log_only();
    let refusals = RefCell::new(Vec::new());
    let mut server =
        Server::new(&listener, own_group(), &audit).on_error(|r| refusals.borrow_mut().push(r));
    let events = QueuedEvents::default();
    let path = socket.clone();
    let client = std::thread::spawn(move || {
        let s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut w = s.try_clone().unwrap();
        // 10 MB that starts like a request and never ends its line.
        let writer = std::thread::spawn(move || {
            let mut big = br#"{"op":"status","pad":""#.to_vec();
            big.resize(10 << 20, b'x');
            w.write_all(&big)
        });
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        (line, writer.join().unwrap())
    });
    let ((line, written), _) = serve_until(&mut server, &mut core, &events, client);
    let reply: Reply<serde_json::Value> = serde_json::from_str(&line).unwrap();
    let err = reply.error.expect("refused");
    assert_eq!(err.code, 2);
    assert!(
        err.message
            .contains(&format!("longer than {MAX_REQUEST_BYTES} bytes")),
        "{}",
        err.message
    );
    assert!(
        written.is_err(),
        "the daemon closed the connection instead of reading 10 MB"
    );
    assert_eq!(*refusals.borrow(), vec![ErrorCause::Oversized]);
    // And it still serves.
    let client = std::thread::spawn(move || request(&socket, "{\"op\":\"status\"}\n"));
    let (reply, _) = serve_until(&mut server, &mut core, &events, client);
    assert!(reply.error.is_none(), "{reply:?}");
}

#[test]
fn the_socket_answers_with_a_thousand_idle_connections_open() {
    const IDLE: usize = 1000;
    let limit = raise_fd_limit();
    assert!(
        limit >= 2 * IDLE as u64 + 64,
        "this test needs {} open files (both ends of each connection); the hard limit is {limit}",
        2 * IDLE + 64
    );
    let (_rm, _dir, mut core, socket, listener) = bound_core();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit);
    let events = QueuedEvents::default();
    let path = socket.clone();
    let client = std::thread::spawn(move || {
        // Connected, and never sending a byte.
        let idle: Vec<UnixStream> = (0..IDLE)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        // Half of them start a request and stall mid-line.
        for s in idle.iter().step_by(2) {
            (&*s).write_all(br#"{"op":"pree"#).unwrap();
        }
        let reply = request(&path, "{\"op\":\"status\"}\n");
        let still_open = idle.len();
        drop(idle);
        (reply, still_open)
    });
    let ((reply, still_open), most) = serve_until(&mut server, &mut core, &events, client);
    assert!(reply.error.is_none(), "{reply:?}");
    assert!(reply.data_json()["uptime_s"].is_number(), "{reply:?}");
    assert_eq!(still_open, IDLE);
    // The request was answered while every idle connection was held open, not refused.
    assert!(
        most >= IDLE,
        "the server held at most {most} connections at once, not all {IDLE} idle ones"
    );
}

#[test]
fn a_preempt_over_the_socket_says_how_long_it_queued_and_drained_events() {
    let (rm, _dir, mut core, socket, listener) = bound_core();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit);
    let me = std::process::id();
    // The process's channels are still in the event queue: the request drains them first.
    let events = QueuedEvents(RefCell::new(
        crate::core::tests::cuda_process(&rm, me, 0xc1d0_0001, &[0], 2).into(),
    ));
    let path = socket.clone();
    let req = format!("{{\"op\":\"preempt\",\"pid\":{me},\"max_hold_ms\":2000}}\n");
    let client = std::thread::spawn(move || request(&path, &req));
    let (reply, _) = serve_until(&mut server, &mut core, &events, client);
    assert!(reply.error.is_none(), "{reply:?}");
    let t = &reply.data_json()["timing_us"];
    for k in ["record", "gate", "disable", "drain", "queued"] {
        assert!(t[k].is_u64(), "timing_us.{k} missing: {reply:?}");
    }
    assert_eq!(
        rm.disabled().len(),
        2,
        "drained first, so both channels were known"
    );
    let path = socket.clone();
    let req = format!("{{\"op\":\"resume\",\"pid\":{me}}}\n");
    let client = std::thread::spawn(move || request(&path, &req));
    let (reply, _) = serve_until(&mut server, &mut core, &events, client);
    assert!(reply.error.is_none(), "{reply:?}");
    assert!(rm.disabled().is_empty());
}

#[test]
fn the_metrics_op_is_answered_by_the_loop_and_an_unknown_op_is_named() {
    // No test in this binary installs the process-wide metrics (valvectl's `top` test does, in
    // its own): the op says so, and is not taken for a bad request.
    let (_rm, _dir, mut core, socket, listener) = bound_core();
    let audit = Audit::log_only();
    let causes = RefCell::new(Vec::new());
    let mut server =
        Server::new(&listener, own_group(), &audit).on_error(|c| causes.borrow_mut().push(c));
    let events = QueuedEvents::default();
    let path = socket.clone();
    let client = std::thread::spawn(move || {
        (
            request(&path, "{\"op\":\"metrics\"}\n"),
            request(&path, "{\"op\":\"metricz\"}\n"),
            request(&path, "{\"op\":\"preempt\",\"pid\":\"x\"}\n"),
        )
    });
    let ((metrics, unknown, bad), _) = serve_until(&mut server, &mut core, &events, client);
    let e = metrics.error.expect("no metrics in this daemon");
    assert_eq!((e.code, e.kind), (1, ErrorCode::Failed));
    assert!(e.message.contains("keeps no metrics"), "{}", e.message);
    let e = unknown.error.expect("unknown op");
    assert_eq!((e.code, e.kind), (2, ErrorCode::UnknownOp));
    assert!(e.message.contains("unknown op `metricz`"), "{}", e.message);
    let e = bad.error.expect("bad fields");
    assert_eq!((e.code, e.kind), (2, ErrorCode::BadRequest));
    assert!(e.message.contains("bad request"), "{}", e.message);
    assert!(causes.borrow().contains(&ErrorCause::Malformed));
}

#[test]
fn a_hello_gets_the_daemons_version_or_the_named_mismatch() {
    let (_rm, _dir, mut core, socket, listener) = bound_core();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit);
    let events = QueuedEvents::default();
    let (same, other) = (PROTOCOL_VERSION, PROTOCOL_VERSION + 1);
    let client = std::thread::spawn(move || {
        let hello = |v: u32| format!("{{\"op\":\"hello\",\"protocol_version\":{v}}}\n");
        (
            request(&socket, &hello(same)),
            request(&socket, &hello(other)),
        )
    });
    let ((ok, newer), _) = serve_until(&mut server, &mut core, &events, client);
    let hello: crate::protocol::Hello = serde_json::from_value(ok.data.unwrap()).unwrap();
    assert_eq!(hello.protocol_version, PROTOCOL_VERSION);
    let e = newer.error.expect("mismatch");
    assert_eq!(
        (e.kind, e.code),
        (ErrorCode::VersionMismatch, crate::protocol::EXIT_VERSION)
    );
    assert!(
        e.message.contains("upgrade the older side, the daemon"),
        "{}",
        e.message
    );
}

#[test]
fn without_a_watcher_the_loop_gets_no_events_and_keeps_turning() {
    let (_rm, _dir, mut core, socket, listener) = bound_core();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit);
    let none: Option<QueuedEvents> = None;
    assert!(none.alive() && none.next_event().is_none());
    let client = std::thread::spawn(move || request(&socket, "{\"op\":\"status\"}\n"));
    let (reply, _) = serve_until(&mut server, &mut core, &none, client);
    assert!(reply.error.is_none(), "{reply:?}");
    // A source that is there is read through the Option, and its death still stops the loop.
    let queued = Some(QueuedEvents::default());
    queued.as_ref().unwrap().0.borrow_mut().push_back(RmEvent {
        ts_ns: 0,
        pid: 7,
        tid: 7,
        kind: valve_ebpf::RmEventKind::Exit,
    });
    assert!(queued.next_event().is_some() && queued.next_event().is_none());
    struct Dead;
    impl EventSource for Dead {
        fn next_event(&self) -> Option<RmEvent> {
            None
        }
        fn alive(&self) -> bool {
            false
        }
    }
    assert!(!Some(Dead).alive());
    let err = server
        .step(&mut core, &Some(Dead), Duration::ZERO)
        .unwrap_err();
    assert_eq!(err.code, EXIT_BPF);
}

pub(crate) mod pool;
mod queueing;
