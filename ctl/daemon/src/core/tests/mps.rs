//! CUDA MPS clients and servers are never frozen: `preempt` and `gate start` refuse them with
//! [`EXIT_MPS`], the gate leaves them out of its offline set, and `ps` marks them (fake `/proc`).

use std::os::unix::fs::symlink;

use super::*;
use crate::mps::{MpsLookup, PeerTable};
use crate::protocol::EXIT_MPS;

const SERVER: u32 = 4_000_100;
const SERVER_SOCKET: u64 = 500;
const CLIENT_SOCKET: u64 = 600;

fn fake_process(proc_root: &Path, pid: u32, argv0: &str, sockets: &[u64], root: &Path) {
    let dir = proc_root.join(pid.to_string());
    std::fs::create_dir_all(dir.join("fd")).unwrap();
    let comm: String = Path::new(argv0)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .chars()
        .take(15)
        .collect();
    std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
    std::fs::write(dir.join("cmdline"), format!("{argv0}\0")).unwrap();
    std::fs::write(dir.join("stat"), format!("{pid} ({comm}) S 1 1 1 0")).unwrap();
    std::fs::write(dir.join("environ"), "CUDA_MPS_PIPE_DIRECTORY=/mps\0").unwrap();
    for (i, s) in sockets.iter().enumerate() {
        symlink(
            format!("socket:[{s}]"),
            dir.join("fd").join((i + 3).to_string()),
        )
        .unwrap();
    }
    symlink(root, dir.join("root")).unwrap();
}

/// The kernel's socket table on the fake node: the client's socket is connected to the server's.
fn connected() -> Option<PeerTable> {
    Some(PeerTable::from_pairs([
        (CLIENT_SOCKET, SERVER_SOCKET),
        (SERVER_SOCKET, CLIENT_SOCKET),
    ]))
}

/// A fake `/proc` with an MPS server (pipe dir `/mps` in its mount namespace) and, if
/// `client_connected`, `client` connected to it from another mount namespace; `other` is a
/// plain CUDA process there.
fn mps_node(dir: &Path, client: u32, other: u32, client_connected: bool) -> MpsLookup {
    let (proc_root, server_fs, job_fs) = (dir.join("proc"), dir.join("s"), dir.join("j"));
    std::fs::create_dir_all(server_fs.join("mps")).unwrap();
    std::fs::create_dir_all(&job_fs).unwrap();
    let server_exe = "/usr/bin/nvidia-cuda-mps-server";
    fake_process(&proc_root, SERVER, server_exe, &[SERVER_SOCKET], &server_fs);
    let sockets: &[u64] = if client_connected {
        &[CLIENT_SOCKET]
    } else {
        &[]
    };
    fake_process(&proc_root, client, "python3", sockets, &job_fs);
    fake_process(&proc_root, other, "python3", &[], &job_fs);
    MpsLookup {
        proc_root,
        peers: connected,
    }
}

fn preempt(c: &mut DaemonCore<Arc<FakeRm>>, pid: u32) -> Reply {
    c.handle(Request::Preempt {
        pid,
        gpu: None,
        max_hold_ms: None,
        confirm: false,
    })
}

#[test]
fn preempt_refuses_mps_clients_and_servers_and_ps_marks_them() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    for e in cuda_process(&rm, SERVER, 0xc1d0_0030, &[0], 4) {
        c.on_event(&e);
    }
    for e in cuda_process(&rm, PID_B, 0xc1d0_0020, &[0], 4) {
        c.on_event(&e);
    }
    c.set_mps_lookup(mps_node(dir.path(), me, PID_B, true));
    for pid in [me, SERVER] {
        let e = preempt(&mut c, pid).error.expect("refused");
        assert_eq!(e.code, EXIT_MPS, "{}", e.message);
        assert_eq!(e.kind, crate::protocol::ErrorCode::MpsProcess);
        assert!(e.message.contains("cannot be frozen"), "{}", e.message);
    }
    assert!(
        rm.disabled().is_empty(),
        "nothing disabled for an MPS process"
    );
    assert!(!c.is_preempted(me) && !c.is_preempted(SERVER));
    let ps = c.handle(Request::Ps).data_json();
    let mps_of = |pid: u32| {
        ps["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .map(|p| p["mps"].clone())
    };
    assert_eq!(mps_of(me), Some(json!("client")));
    assert_eq!(mps_of(SERVER), Some(json!("server")));
    assert_eq!(mps_of(PID_B), Some(json!(null)));
    // A process outside MPS is preempted as before.
    assert!(preempt(&mut c, PID_B).error.is_none());
    assert_eq!(rm.disabled().len(), 4);
}

#[test]
fn gate_start_refuses_an_mps_offline_process_and_the_gate_leaves_one_out() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    for e in cuda_process(&rm, SERVER, 0xc1d0_0030, &[0], 4) {
        c.on_event(&e);
    }
    let e = {
        c.set_mps_lookup(mps_node(&dir.path().join("a"), me, PID_B, true));
        c.handle(gate_spec(1, me)).error.expect("refused")
    };
    assert_eq!(e.code, EXIT_MPS, "{}", e.message);
    assert_eq!(c.handle(Request::GateStatus).data_json()["running"], false);
    // Not an MPS client when the gate starts (not connected, another pipe directory); it
    // becomes one: the gate's next refresh drops it, and a busy online freezes nothing.
    c.set_mps_lookup(mps_node(&dir.path().join("b"), me, PID_B, false));
    let r = c.handle(gate_spec(1, me));
    assert!(r.error.is_none(), "{r:?}");
    assert_eq!(r.data_json()["offline_channels"], 4);
    c.set_mps_lookup(mps_node(&dir.path().join("c"), me, PID_B, true));
    c.refresh_gate(Instant::now(), crate::gate::Rescan::Now);
    assert!(c.gate.as_ref().unwrap().records().is_empty());
    assert!(c.handle(Request::OnlineBusy).error.is_none());
    c.sync_gate(crate::gate::Rescan::Now);
    assert!(
        rm.disabled().is_empty(),
        "an MPS client is never frozen by the gate"
    );
    assert!(c.handle(Request::GateStop).error.is_none());
}

#[test]
fn a_server_that_starts_after_a_scan_is_found_once_its_rm_objects_arrive() {
    let rm = Arc::new(FakeRm::host(1));
    let dir = tempfile::tempdir().unwrap();
    let (mut c, _, me) = gated_core(&rm, dir.path(), false);
    c.set_mps_lookup(mps_node(dir.path(), me, PID_B, true));
    // The server's process exists in /proc but the daemon has not seen its RM objects yet: it
    // is no candidate, nothing is refused, and that answer is kept until an RM client opens.
    assert!(preempt(&mut c, me).error.is_none());
    assert!(c.handle(Request::Resume { pid: me }).error.is_none());
    let mut server = cuda_process(&rm, SERVER, 0xc1d0_0030, &[0], 4).into_iter();
    let root_client = server.next().unwrap();
    // Objects under clients the daemon knows (memory, channels) open no MPS server: no new
    // scan. (The server is made a candidate by hand here, so a scan would find it.)
    c.pre_existing.insert(SERVER);
    c.on_event(&super::alloc(
        me,
        0xc1d0_0010,
        0xc1d0_0010,
        0x5c00_0f00,
        0x3e,
        None,
    ));
    assert!(preempt(&mut c, me).error.is_none());
    assert!(c.handle(Request::Resume { pid: me }).error.is_none());
    c.on_event(&root_client);
    for e in server {
        c.on_event(&e);
    }
    let e = preempt(&mut c, me)
        .error
        .expect("refused once the server is known");
    assert_eq!(e.code, EXIT_MPS, "{}", e.message);
}
