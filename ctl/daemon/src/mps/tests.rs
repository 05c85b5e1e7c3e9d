//! MPS detection against fake `/proc` trees and the real Unix-socket table.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::symlink;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use super::*;

/// A fake process: its `comm`, `cmdline`, parent, environment, socket fds and root directory.
struct Fake<'a> {
    pid: u32,
    comm: &'a str,
    argv0: &'a str,
    ppid: u32,
    env: &'a [&'a str],
    sockets: &'a [u64],
    root: &'a Path,
}

fn add(proc_root: &Path, p: Fake) {
    let dir = proc_root.join(p.pid.to_string());
    std::fs::create_dir_all(dir.join("fd")).unwrap();
    std::fs::write(dir.join("comm"), format!("{}\n", p.comm)).unwrap();
    std::fs::write(dir.join("cmdline"), format!("{}\0-f\0", p.argv0)).unwrap();
    std::fs::write(
        dir.join("stat"),
        format!("{} ({}) S {} 1 1 0", p.pid, p.comm, p.ppid),
    )
    .unwrap();
    let env: Vec<u8> = p
        .env
        .iter()
        .flat_map(|v| format!("{v}\0").into_bytes())
        .collect();
    std::fs::write(dir.join("environ"), env).unwrap();
    for (i, s) in p.sockets.iter().enumerate() {
        symlink(
            format!("socket:[{s}]"),
            dir.join("fd").join((i + 3).to_string()),
        )
        .unwrap();
    }
    symlink(p.root, dir.join("root")).unwrap();
}

fn plain<'a>(pid: u32, sockets: &'a [u64], env: &'a [&'a str], root: &'a Path) -> Fake<'a> {
    Fake {
        pid,
        comm: "python3",
        argv0: "/usr/bin/python3",
        ppid: 1,
        env,
        sockets,
        root,
    }
}

const SERVER: u32 = 100;
const CONTROL: u32 = 99;

/// A control daemon (99, socket 400) and its server (100, sockets 500, 501), pipe dir `/mps`.
fn mps_node(proc_root: &Path, fs_root: &Path) {
    std::fs::create_dir_all(fs_root.join("mps")).unwrap();
    let env = ["HOME=/root", "CUDA_MPS_PIPE_DIRECTORY=/mps"];
    add(
        proc_root,
        Fake {
            pid: CONTROL,
            comm: "nvidia-cuda-mps",
            argv0: "nvidia-cuda-mps-control",
            ppid: 1,
            env: &env,
            sockets: &[400],
            root: fs_root,
        },
    );
    add(
        proc_root,
        Fake {
            pid: SERVER,
            comm: "nvidia-cuda-mps",
            argv0: "/usr/bin/nvidia-cuda-mps-server",
            ppid: CONTROL,
            env: &env,
            sockets: &[500, 501],
            root: fs_root,
        },
    );
}

fn no_peers() -> Option<PeerTable> {
    None
}

#[test]
fn servers_are_told_apart_by_their_command_line_not_the_cut_comm() {
    let t = tempfile::tempdir().unwrap();
    let (proc_root, fs) = (t.path().join("proc"), t.path().join("fs"));
    mps_node(&proc_root, &fs);
    // Same 15-byte comm, another program: not MPS.
    add(
        &proc_root,
        Fake {
            comm: "nvidia-cuda-mps",
            argv0: "/opt/nvidia-cuda-mps-lookalike",
            ..plain(300, &[], &[], &fs)
        },
    );
    let scan = MpsScan::find(&proc_root, [SERVER, 300]);
    let found: Vec<(u32, bool)> = scan.daemons().iter().map(|d| (d.pid, d.server)).collect();
    assert_eq!(
        found,
        vec![(CONTROL, false), (SERVER, true)],
        "the server's parent joins it"
    );
    assert_eq!(scan.daemons()[1].pipe_dir, Path::new("/mps"));
    assert_eq!(scan.role(SERVER, &mut no_peers), Some(MpsRole::Server));
    assert_eq!(scan.role(CONTROL, &mut no_peers), Some(MpsRole::Server));
    assert_eq!(scan.role(300, &mut no_peers), None);
}

#[test]
fn a_socket_connected_to_the_server_or_its_control_daemon_makes_a_client() {
    let t = tempfile::tempdir().unwrap();
    let (proc_root, fs, other_fs) = (
        t.path().join("proc"),
        t.path().join("fs"),
        t.path().join("c"),
    );
    mps_node(&proc_root, &fs);
    std::fs::create_dir_all(&other_fs).unwrap();
    // Clients in another mount namespace (no /mps there), so only the socket can tell.
    add(&proc_root, plain(200, &[600, 601], &[], &other_fs));
    add(&proc_root, plain(201, &[610], &[], &other_fs));
    add(&proc_root, plain(202, &[620], &[], &other_fs));
    let table = PeerTable::from_pairs([(601, 501), (610, 400), (620, 900)]);
    let scan = MpsScan::find(&proc_root, [200, 201, 202, SERVER]);
    let mut calls = 0;
    let mut peers = || {
        calls += 1;
        Some(table.clone())
    };
    let socket_client = |daemon| {
        Some(MpsRole::Client {
            daemon,
            evidence: Evidence::Socket,
        })
    };
    assert_eq!(scan.role(200, &mut peers), socket_client(SERVER));
    assert_eq!(scan.role(201, &mut peers), socket_client(CONTROL));
    assert_eq!(scan.role(202, &mut peers), None, "connected elsewhere");
    assert_eq!(calls, 3);
}

#[test]
fn the_same_pipe_directory_makes_a_client_and_another_mount_namespace_does_not() {
    let t = tempfile::tempdir().unwrap();
    let (proc_root, fs, other_fs) = (
        t.path().join("proc"),
        t.path().join("fs"),
        t.path().join("c"),
    );
    mps_node(&proc_root, &fs);
    std::fs::create_dir_all(other_fs.join("mps")).unwrap();
    std::fs::create_dir_all(fs.join("tmp/nvidia-mps")).unwrap();
    let env = ["CUDA_MPS_PIPE_DIRECTORY=/mps"];
    add(&proc_root, plain(200, &[], &env, &fs));
    add(&proc_root, plain(201, &[], &env, &other_fs));
    add(&proc_root, plain(202, &[], &[], &fs)); // the default /tmp/nvidia-mps: not the server's
    let scan = MpsScan::find(&proc_root, [SERVER]);
    assert_eq!(
        scan.role(200, &mut no_peers),
        Some(MpsRole::Client {
            daemon: CONTROL,
            evidence: Evidence::PipeDir("/mps".into())
        })
    );
    assert_eq!(
        scan.role(201, &mut no_peers),
        None,
        "its /mps is another directory"
    );
    assert_eq!(scan.role(202, &mut no_peers), None);
}

#[test]
fn without_an_mps_daemon_nothing_is_read() {
    let t = tempfile::tempdir().unwrap();
    let (proc_root, fs) = (t.path().join("proc"), t.path().join("fs"));
    std::fs::create_dir_all(fs.join("tmp/nvidia-mps")).unwrap();
    add(&proc_root, plain(200, &[600], &[], &fs));
    let scan = MpsScan::all(&proc_root);
    assert!(scan.daemons().is_empty());
    let mut peers = || -> Option<PeerTable> { panic!("no MPS daemon: no socket table needed") };
    assert_eq!(scan.role(200, &mut peers), None);
}

#[test]
fn refusal_names_the_process_the_reason_and_the_fix() {
    let role = MpsRole::Client {
        daemon: 7,
        evidence: Evidence::Socket,
    };
    let msg = refusal(42, "train", &role);
    for part in [
        "process 42 (train)",
        "MPS client",
        "MPS process 7",
        "echo quit",
        "docs/mps.md",
    ] {
        assert!(msg.contains(part), "{part:?} missing from {msg}");
    }
}

/// A netlink message: header, then `body`.
fn nl(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&(16 + body.len() as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&[0; 10]);
    m.extend_from_slice(body);
    while m.len() % 4 != 0 {
        m.push(0);
    }
    m
}

/// A `unix_diag_msg` for `inode`, with a peer attribute if `peer` is set and a name attribute.
fn diag_msg(inode: u32, peer: Option<u32>) -> Vec<u8> {
    let mut b = vec![1, 1, 1, 0];
    b.extend_from_slice(&inode.to_ne_bytes());
    b.extend_from_slice(&[0; 8]);
    b.extend_from_slice(&7u16.to_ne_bytes()); // a 3-byte name attribute, padded
    b.extend_from_slice(&0u16.to_ne_bytes());
    b.extend_from_slice(&[b'/', b'x', 0, 0]);
    if let Some(p) = peer {
        b.extend_from_slice(&8u16.to_ne_bytes());
        b.extend_from_slice(&UNIX_DIAG_PEER.to_ne_bytes());
        b.extend_from_slice(&p.to_ne_bytes());
    }
    b
}

#[test]
fn diag_replies_are_folded_into_peers() {
    let mut buf = nl(SOCK_DIAG_BY_FAMILY, &diag_msg(10, Some(11)));
    buf.extend(nl(SOCK_DIAG_BY_FAMILY, &diag_msg(12, None)));
    let mut table = BTreeMap::new();
    assert_eq!(parse_diag(&buf, &mut table), Ok(false), "no end yet");
    assert_eq!(table, BTreeMap::from([(10, 11)]));
    buf = nl(NLMSG_DONE, &[0; 4]);
    assert_eq!(parse_diag(&buf, &mut table), Ok(true));
    let err = parse_diag(&nl(NLMSG_ERROR, &(-2i32).to_ne_bytes()), &mut table).unwrap_err();
    assert!(err.contains("CONFIG_UNIX_DIAG"), "{err}");
    assert!(parse_diag(&buf[..8], &mut table) == Ok(false));
    let mut short = nl(SOCK_DIAG_BY_FAMILY, &diag_msg(10, Some(11)));
    short[0] = 200;
    assert!(
        parse_diag(&short, &mut table).is_err(),
        "a length past the buffer"
    );
}

fn inode_of(fd: &impl AsRawFd) -> u64 {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    let s = link.to_str().unwrap();
    s["socket:[".len()..s.len() - 1].parse().unwrap()
}

#[test]
fn the_kernel_table_pairs_a_connected_socket_with_the_accepted_one() {
    let t = tempfile::tempdir().unwrap();
    let listener = UnixListener::bind(t.path().join("control")).unwrap();
    let client = UnixStream::connect(t.path().join("control")).unwrap();
    let (accepted, _) = listener.accept().unwrap();
    let table = PeerTable::read().expect("sock_diag dump");
    assert_eq!(table.peer(inode_of(&client)), Some(inode_of(&accepted)));
    assert_eq!(table.peer(inode_of(&accepted)), Some(inode_of(&client)));
    assert_eq!(
        table.peer(inode_of(&listener)),
        None,
        "a listener has no peer"
    );
}
