//! No freeze waits behind another request: a reclaim's freeze and thaw (the fast lane) while a
//! `gate start` is held in the middle of its start, and while other connections flood the socket.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};

use serde_json::json;

use super::pool::{call, offline_client, online_client, spawn_pool};
use super::*;
use crate::core::tests::{cuda_process, held_starter};
use crate::memory::reclaim::DaemonLaneFreezer;
use crate::server::conn::Conn;
use crate::server::lane::{lane, LaneOp};

/// Turns the loop until `done` (at most 60 s, a guard against a hang, not a latency bound).
fn turn_until<D: RmDriver>(
    server: &mut Server<'_>,
    core: &mut DaemonCore<D>,
    events: &impl EventSource,
    mut done: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "the loop never got there");
        server.step(core, events, Duration::from_millis(5)).unwrap();
    }
}

#[test]
fn a_reclaim_is_answered_while_a_gate_start_is_held_in_its_attach() {
    let (rm, dir, mut core, socket, listener) = bound_core();
    let me = std::process::id();
    for e in cuda_process(&rm, me, 0xc1d0_0051, &[0], 4) {
        core.on_event(&e);
    }
    let held = held_starter(&rm);
    core.set_gate_starter(held.starter.clone());
    let (client, lane) = lane().unwrap();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit).with_lane(lane);
    let events = QueuedEvents::default();
    let stop = Arc::new(AtomicBool::new(false));
    let freezer = DaemonLaneFreezer {
        lane: client,
        max_hold: Duration::from_secs(2),
    };
    let pool_thread = spawn_pool(dir.path(), 10, &stop, Box::new(freezer));
    let path = socket.clone();
    let start = format!(
        "{{\"op\":\"gate_start\",\"online\":[1],\"offline\":[{me}],\"realtime_priority\":0}}\n"
    );
    let starting = std::thread::spawn(move || request(&path, &start));
    turn_until(&mut server, &mut core, &events, || {
        held.entered.try_recv().is_ok()
    });
    // The gate thread is in its start and stays there until released below.
    let path = socket.clone();
    let status = std::thread::spawn(move || request(&path, "{\"op\":\"gate_status\"}\n"));
    let (status, _) = serve_until(&mut server, &mut core, &events, status);
    assert_eq!(status.data_json()["starting"], true, "{status:?}");
    let pool = dir.path().join("pool.sock");
    let grow = std::thread::spawn(move || {
        let (off, _held) = offline_client(&pool, 10);
        let on = online_client(&pool);
        let grown = call(&on, json!({"op": "grow", "count": 3}));
        (grown, off, on)
    });
    let ((grown, _off, _on), _) = serve_until(&mut server, &mut core, &events, grow);
    assert_eq!(grown["reclaimed"], 3, "{grown}");
    // Frozen for the swap and thawed after online's reply, through the loop, all while the
    // gate start is held.
    let toggles = || rm.state.lock().unwrap().disable_calls.len();
    turn_until(&mut server, &mut core, &events, || toggles() >= 2);
    turn_until(&mut server, &mut core, &events, || rm.disabled().is_empty());
    assert!(!starting.is_finished(), "the gate start is still held");
    assert!(core.gate_starting());
    held.release.send(()).unwrap();
    let (started, _) = serve_until(&mut server, &mut core, &events, starting);
    assert!(started.error.is_none(), "{started:?}");
    assert_eq!(started.data_json()["running"], true, "{started:?}");
    stop.store(true, Ordering::Relaxed);
    pool_thread.join().unwrap();
    assert!(core.shutdown().error.is_none());
    assert!(rm.disabled().is_empty());
}

#[test]
fn a_freeze_sent_mid_flood_is_answered_before_the_next_malformed_request() {
    let (rm, _dir, mut core, socket, listener) = bound_core();
    let me = std::process::id();
    for e in cuda_process(&rm, me, 0xc1d0_0052, &[0], 4) {
        core.on_event(&e);
    }
    let (client, lane) = lane().unwrap();
    let audit = Audit::log_only();
    // At the first malformed request the loop handles, the pool sends a freeze; at each later
    // one, note whether the freeze was answered already.
    let malformed = Cell::new(0usize);
    let pending: RefCell<Option<Receiver<Reply>>> = RefCell::new(None);
    let answered_at = Cell::new(None);
    let mut server = Server::new(&listener, own_group(), &audit)
        .with_lane(lane)
        .on_error(|cause| {
            if cause != ErrorCause::Malformed {
                return;
            }
            malformed.set(malformed.get() + 1);
            let mut p = pending.borrow_mut();
            match p.as_ref() {
                None => {
                    let op = LaneOp::Freeze {
                        pid: me,
                        max_hold_ms: 2_000,
                    };
                    *p = Some(client.send(op).unwrap());
                }
                Some(rx) if answered_at.get().is_none() => {
                    if !matches!(rx.try_recv(), Err(TryRecvError::Empty)) {
                        answered_at.set(Some(malformed.get()));
                    }
                }
                Some(_) => {}
            }
        });
    let events = QueuedEvents::default();
    // 64 connections, each with a line that is no request, all waiting before the loop turns.
    let flood: Vec<UnixStream> = (0..64)
        .map(|_| {
            let s = UnixStream::connect(&socket).unwrap();
            (&s).write_all(b"not json at all\n").unwrap();
            s
        })
        .collect();
    turn_until(&mut server, &mut core, &events, || malformed.get() >= 64);
    assert_eq!(
        answered_at.get(),
        Some(2),
        "the freeze was answered before the second malformed request"
    );
    assert_eq!(rm.disabled().len(), 4, "frozen");
    for s in flood {
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        assert!(line.contains("bad request"), "{line}");
    }
    let thaw = client.send(LaneOp::Thaw { pid: me }).unwrap();
    let thawed: RefCell<Option<Reply>> = RefCell::new(None);
    turn_until(&mut server, &mut core, &events, || {
        *thawed.borrow_mut() = thaw.try_recv().ok();
        thawed.borrow().is_some()
    });
    let r = thawed.take().unwrap();
    assert!(r.error.is_none(), "{r:?}");
    assert!(rm.disabled().is_empty());
}

/// A connection from `pid` (a crafted peer) that has sent `line`; the client's end.
fn crafted(server: &mut Server<'_>, pid: i32, line: &[u8]) -> UnixStream {
    let (ours, theirs) = UnixStream::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    (&theirs).write_all(line).unwrap();
    let caller = Caller {
        uid: 0,
        gid: 0,
        pid,
    };
    server.next_id += 1;
    server
        .conns
        .push(Conn::new(server.next_id, ours, Some(caller)));
    theirs
}

/// Whether a reply is waiting on `s` (never blocks).
fn answered(s: &UnixStream) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
    matches!(recv(s.as_raw_fd(), &mut b, flags), Ok(1))
}

#[test]
fn one_peers_flood_waits_its_turn_behind_another_peers_request() {
    let (_rm, _dir, mut core, _socket, listener) = bound_core();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit);
    let events = QueuedEvents::default();
    let flood: Vec<UnixStream> = (0..100)
        .map(|_| crafted(&mut server, 4_000_001, b"{\"op\":\"nope\"}\n"))
        .collect();
    let other = crafted(&mut server, 4_000_002, b"{\"op\":\"status\"}\n");
    server
        .step(&mut core, &events, Duration::from_millis(5))
        .unwrap();
    assert!(
        answered(&other),
        "the other peer was served in the first turn"
    );
    let served = flood.iter().filter(|s| answered(s)).count();
    assert_eq!(
        served, REQUESTS_PER_PEER_PER_TURN,
        "the flooding peer got its share of the turn, no more"
    );
    turn_until(&mut server, &mut core, &events, || {
        flood.iter().all(answered)
    });
}

#[test]
fn a_full_server_closes_the_oldest_connection_of_the_peer_holding_the_most() {
    let (_rm, _dir, _core, _socket, listener) = bound_core();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit);
    let _quiet = crafted(&mut server, 4_000_002, b"");
    let _flood: Vec<UnixStream> = (0..3)
        .map(|_| crafted(&mut server, 4_000_001, b""))
        .collect();
    server.evict(&mut None);
    let closed: Vec<i32> = server
        .conns
        .iter()
        .filter(|c| c.done)
        .map(|c| c.peer())
        .collect();
    assert_eq!(
        closed,
        vec![4_000_001],
        "the quiet peer keeps its connection"
    );
    assert!(server.conns[1].done, "the flooding peer's oldest went");
}
