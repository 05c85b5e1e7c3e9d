//! The control socket: binding it with the right owner and mode, checking who connects
//! (SO_PEERCRED: root or the daemon's group), and the main loop that serves requests.
//!
//! One request per connection, answered in order on the daemon's one thread; between requests
//! the loop folds watcher events into the registry, expires hold limits and keeps the gate current.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use valve::driver::RmDriver;
use valve::Signals;
use valve_ebpf::Watcher;

use crate::core::DaemonCore;
use crate::error::{derr, DaemonError};
use crate::protocol::{Reply, Request, EXIT_BPF};

/// Whether a daemon already answers on `socket` (it replies to a status request in time).
pub fn answers(socket: &Path, timeout: Duration) -> bool {
    let Ok(mut stream) = UnixStream::connect(socket) else {
        return false;
    };
    if stream.set_read_timeout(Some(timeout)).is_err() {
        return false;
    }
    let mut line = serde_json::to_string(&Request::Status).expect("requests serialise");
    line.push('\n');
    if stream.write_all(line.as_bytes()).is_err() {
        return false;
    }
    let mut reply = String::new();
    if BufReader::new(stream).read_line(&mut reply).is_err() {
        return false;
    }
    serde_json::from_str::<Reply>(&reply).is_ok()
}

/// Binds the socket (replacing a stale one): mode 0660 with group `gid`, else 0600 (root only).
pub fn bind(socket: &Path, gid: Option<u32>) -> Result<UnixListener, DaemonError> {
    let _ = std::fs::remove_file(socket);
    if let Some(dir) = socket.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let listener = UnixListener::bind(socket)
        .map_err(|e| derr(1, format!("listening on {}: {e}", socket.display())))?;
    let mode = if gid.is_some() { 0o660 } else { 0o600 };
    let _ = std::fs::set_permissions(socket, std::fs::Permissions::from_mode(mode));
    if let Some(g) = gid {
        let _ = nix::unistd::chown(socket, None, Some(nix::unistd::Gid::from_raw(g)));
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| derr(1, format!("socket: {e}")))?;
    Ok(listener)
}

/// Whether the peer on `stream` may use Valve: root, or a member of group `gid` (its primary or
/// a supplementary group).
pub fn peer_allowed(stream: &UnixStream, gid: Option<u32>) -> bool {
    let Ok(cred) = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
    else {
        return false;
    };
    if cred.uid() == 0 {
        return true;
    }
    let Some(gid) = gid else { return false };
    if cred.gid() == gid {
        return true;
    }
    // Supplementary groups of the peer process.
    std::fs::read_to_string(format!("/proc/{}/status", cred.pid()))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Groups:"))
                .map(|l| l.split_whitespace().skip(1).any(|g| g.parse() == Ok(gid)))
        })
        .unwrap_or(false)
}

fn serve_one<D: RmDriver>(core: &mut DaemonCore<D>, stream: UnixStream, gid: Option<u32>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let reply = if !peer_allowed(&stream, gid) {
        Reply::err(
            4,
            "permission denied: only root or the daemon's --group may use Valve",
        )
    } else {
        let mut line = String::new();
        match BufReader::new(stream).read_line(&mut line) {
            Ok(_) => match serde_json::from_str::<Request>(&line) {
                Ok(req) => core.handle(req),
                Err(e) => Reply::err(2, format!("bad request: {e}")),
            },
            Err(e) => Reply::err(1, format!("reading the request: {e}")),
        }
    };
    let mut out = serde_json::to_string(&reply).expect("replies serialise");
    out.push('\n');
    let _ = writer.write_all(out.as_bytes());
}

/// Folds every event the watcher has delivered into the registry.
fn drain<D: RmDriver>(core: &mut DaemonCore<D>, watcher: &Watcher) {
    while let Some(ev) = watcher.poll(Duration::ZERO) {
        core.on_event(&ev);
    }
}

/// Serves the socket until SIGINT/SIGTERM/SIGHUP (`Ok`) or until the eBPF watcher stops.
pub fn serve<D: RmDriver>(
    core: &mut DaemonCore<D>,
    watcher: &Watcher,
    listener: &UnixListener,
    gid: Option<u32>,
    signals: &Signals,
) -> Result<(), DaemonError> {
    loop {
        drain(core, watcher);
        core.expire(Instant::now());
        core.refresh_gate(Instant::now(), false);
        if !watcher.is_alive() {
            return Err(derr(
                EXIT_BPF,
                "the eBPF watcher stopped; exiting so the service restarts",
            ));
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                // Events that arrived before the request must be in the registry.
                drain(core, watcher);
                serve_one(core, stream, gid);
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!("accept: {e}"),
        }
        let mut fds = [nix::poll::PollFd::new(
            listener.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5u8));
        if let Some(sig) = signals.pending() {
            eprintln!("valvectl daemon: {sig}: resuming everything and exiting");
            return Ok(());
        }
    }
}
