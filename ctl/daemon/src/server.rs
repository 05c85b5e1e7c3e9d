//! The control socket: binding it with the right owner and mode, checking who connects
//! (SO_PEERCRED: root or the daemon's group), and the main loop that serves requests.
//!
//! Connections are read without blocking, all of them at once through poll(2), so an idle or
//! slow client holds a slot and never the loop. A request is one line of at most
//! [`MAX_REQUEST_BYTES`], sent within [`REQUEST_TIMEOUT`]; at most [`MAX_CONNECTIONS`] wait at
//! once (the oldest goes for a new one). Requests are answered in order on the daemon's one
//! thread; between them the loop folds watcher events into the registry, expires hold limits
//! and keeps the gate current. The loop answers the read-only [`LoopRequest`]s itself (the
//! metrics text for `valvectl top`); every [`Request`] goes to the daemon's core.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials, UnixCredentials};
use serde_json::json;
use valve::driver::RmDriver;
use valve::Signals;
use valve_ebpf::{RmEvent, Watcher};

use crate::audit::{Audit, Caller};
use crate::core::DaemonCore;
use crate::error::{derr, DaemonError};
use crate::metrics::ErrorCause;
use crate::protocol::{LoopRequest, Reply, Request, EXIT_BPF, MAX_REQUEST_BYTES};

/// Requests that took this long from connection to reply are logged (with where the time went).
const SLOW_REQUEST: Duration = Duration::from_millis(20);
/// How long a connection has to send its request line (and to take its reply).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; for a new one beyond this, the oldest is closed.
pub const MAX_CONNECTIONS: usize = 4096;
/// Refused callers audited per second at most (the rest are only counted), so that a local
/// user cannot fill the disk by connecting in a loop.
const REFUSALS_AUDITED_PER_S: u32 = 10;

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
    getsockopt(stream, PeerCredentials).is_ok_and(|c| allowed(&c, gid))
}

/// Whether a peer with credentials `cred` may use Valve (see [`peer_allowed`]).
fn allowed(cred: &UnixCredentials, gid: Option<u32>) -> bool {
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

/// Raises this process's open-file limit to its hard limit, so that many waiting clients do
/// not run the daemon out of descriptors. Returns the limit now in force.
pub fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                hard
            } else {
                soft
            }
        }
        Ok((soft, _)) => soft,
        Err(_) => 0,
    }
}

/// Where the loop gets RM events from: the eBPF [`Watcher`], or a test's queue.
pub trait EventSource {
    /// The next delivered event, without waiting.
    fn next_event(&self) -> Option<RmEvent>;
    /// Whether events can still come (false: the watcher died).
    fn alive(&self) -> bool;
}

impl EventSource for Watcher {
    fn next_event(&self) -> Option<RmEvent> {
        self.poll(Duration::ZERO)
    }
    fn alive(&self) -> bool {
        self.is_alive()
    }
}

/// Folds every event the source has delivered into the registry.
fn drain<D: RmDriver>(core: &mut DaemonCore<D>, events: &impl EventSource) {
    while let Some(ev) = events.next_event() {
        core.on_event(&ev);
    }
}

/// One client connection: reading its request line, then writing its reply.
struct Conn {
    stream: UnixStream,
    caller: Option<Caller>,
    request: Vec<u8>,
    /// The reply and how much of it is written; set once the request is answered.
    reply: Option<(Vec<u8>, usize)>,
    since: Instant,
    done: bool,
}

/// The control socket's connections and what the loop does with them each turn.
pub struct Server<'a> {
    listener: &'a UnixListener,
    gid: Option<u32>,
    audit: &'a Audit,
    conns: Vec<Conn>,
    on_error: Box<dyn Fn(ErrorCause) + 'a>,
    gauges_published: Option<Instant>,
    refusals_audited: (Instant, u32),
}

impl<'a> Server<'a> {
    /// A server on a bound, non-blocking listener (see [`bind`]).
    pub fn new(listener: &'a UnixListener, gid: Option<u32>, audit: &'a Audit) -> Self {
        Server {
            listener,
            gid,
            audit,
            conns: Vec::new(),
            on_error: Box::new(|_| {}),
            gauges_published: None,
            refusals_audited: (Instant::now(), 0),
        }
    }

    /// Calls `f` for every refused or dropped connection and every failed request (the
    /// metrics count them).
    pub fn on_error(mut self, f: impl Fn(ErrorCause) + 'a) -> Self {
        self.on_error = Box::new(f);
        self
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// One turn of the loop: registry, hold limits and gate upkeep, then waits up to `wait`
    /// for the sockets and serves what they have. Errors only when the event source died.
    pub fn step<D: RmDriver>(
        &mut self,
        core: &mut DaemonCore<D>,
        events: &impl EventSource,
        wait: Duration,
    ) -> Result<(), DaemonError> {
        drain(core, events);
        for pid in core.expire(Instant::now()) {
            let reply = if core.is_preempted(pid) {
                (self.on_error)(ErrorCause::Rm);
                Reply::err(1, "resume at the hold limit failed; see the daemon's log")
            } else {
                Reply::ok(serde_json::Value::Null)
            };
            let targets = json!({"pid": pid});
            self.audit
                .record("hold_limit_resume", Caller::daemon(), targets, &reply);
        }
        core.refresh_gate(Instant::now(), crate::gate::Rescan::IfDue);
        core.publish_harvest_view(Instant::now());
        if !events.alive() {
            return Err(derr(
                EXIT_BPF,
                "the eBPF watcher stopped; exiting so the service restarts",
            ));
        }
        let ready = self.poll(wait);
        let fresh = self.accept();
        for i in ready.into_iter().chain(fresh) {
            self.service(i, core, events);
        }
        self.close_stale(Instant::now());
        // Gauges: after every request, else once a second.
        let now = Instant::now();
        if self
            .gauges_published
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            core.publish_metrics();
            self.gauges_published = Some(now);
        }
        Ok(())
    }

    /// Waits for the listener or any connection; returns the connections that are ready.
    fn poll(&self, wait: Duration) -> Vec<usize> {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let mut fds = Vec::with_capacity(self.conns.len() + 1);
        fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
        for c in &self.conns {
            let want = if c.reply.is_some() {
                PollFlags::POLLOUT
            } else {
                PollFlags::POLLIN
            };
            fds.push(PollFd::new(c.stream.as_fd(), want));
        }
        let ms = wait.as_millis().min(u16::MAX as u128) as u16;
        if nix::poll::poll(&mut fds, PollTimeout::from(ms)).unwrap_or(0) <= 0 {
            return Vec::new();
        }
        fds[1..]
            .iter()
            .enumerate()
            .filter(|(_, f)| f.revents().is_some_and(|r| !r.is_empty()))
            .map(|(i, _)| i)
            .collect()
    }

    /// Accepts every waiting connection; returns their indices. Callers that may not use Valve
    /// get their refusal queued at once and are never read.
    fn accept(&mut self) -> Vec<usize> {
        let mut fresh = Vec::new();
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    break;
                }
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            if self.conns.len() >= MAX_CONNECTIONS {
                self.evict_oldest();
            }
            let cred = getsockopt(&stream, PeerCredentials).ok();
            let mut conn = Conn {
                stream,
                caller: cred.map(|c| Caller {
                    uid: c.uid(),
                    gid: c.gid(),
                    pid: c.pid(),
                }),
                request: Vec::new(),
                reply: None,
                since: Instant::now(),
                done: false,
            };
            if !cred.is_some_and(|c| allowed(&c, self.gid)) {
                let reply = Reply::err(
                    4,
                    "permission denied: only root or the daemon's --group may use Valve",
                );
                (self.on_error)(ErrorCause::Permission);
                self.audit_refusal(conn.caller, &reply);
                conn.answer(&reply);
            }
            self.conns.push(conn);
            fresh.push(self.conns.len() - 1);
        }
        fresh
    }

    fn audit_refusal(&mut self, caller: Option<Caller>, reply: &Reply) {
        let now = Instant::now();
        if now.duration_since(self.refusals_audited.0) >= Duration::from_secs(1) {
            self.refusals_audited = (now, 0);
        }
        if self.refusals_audited.1 < REFUSALS_AUDITED_PER_S {
            self.refusals_audited.1 += 1;
            let caller = caller.unwrap_or(Caller {
                uid: u32::MAX,
                gid: u32::MAX,
                pid: 0,
            });
            self.audit.record("refused", caller, json!({}), reply);
        }
    }

    fn evict_oldest(&mut self) {
        if let Some(c) = self
            .conns
            .iter_mut()
            .filter(|c| !c.done)
            .min_by_key(|c| c.since)
        {
            // Closed by the retain at the end of the turn (indices stay valid until then).
            c.done = true;
            (self.on_error)(ErrorCause::Evicted);
        }
    }

    /// Reads what connection `i` sent and answers a complete request, or writes its reply.
    fn service<D: RmDriver>(
        &mut self,
        i: usize,
        core: &mut DaemonCore<D>,
        events: &impl EventSource,
    ) {
        let Some(conn) = self.conns.get_mut(i) else {
            return;
        };
        if conn.done {
            return;
        }
        if conn.reply.is_some() {
            conn.write_reply();
            return;
        }
        match conn.read_request() {
            ReadOutcome::Pending => {}
            ReadOutcome::Closed => conn.done = true,
            ReadOutcome::TooLong => {
                (self.on_error)(ErrorCause::Oversized);
                conn.answer(&Reply::err(
                    2,
                    format!(
                        "request refused: longer than {MAX_REQUEST_BYTES} bytes; a request is \
                         one JSON line (see valve_daemon::protocol::Request)"
                    ),
                ));
            }
            ReadOutcome::Line(line) => {
                let (caller, waited) = (conn.caller, conn.since.elapsed());
                let started = Instant::now();
                let (reply, event) = match serde_json::from_slice::<Request>(&line) {
                    Ok(req) => {
                        // Events that arrived before the request must be in the registry.
                        drain(core, events);
                        let drained = started.elapsed();
                        let event = Audit::event_of(&req);
                        let mut reply = core.handle(req);
                        // A preempt says where its time went (the memory pool logs it per reclaim).
                        if let Some(t) = reply.data.get_mut("timing_us") {
                            t["drain"] = json!(drained.as_micros() as u64);
                            t["queued"] = json!(waited.as_micros() as u64);
                        }
                        (reply, Some(event))
                    }
                    Err(e) => match serde_json::from_slice::<LoopRequest>(&line) {
                        // Read-only: nothing to audit.
                        Ok(req) => (answer_loop(req), None),
                        Err(_) => {
                            (self.on_error)(ErrorCause::Malformed);
                            (Reply::err(2, format!("bad request: {e}")), None)
                        }
                    },
                };
                let handled = started.elapsed();
                if let Some(conn) = self.conns.get_mut(i) {
                    conn.answer(&reply);
                }
                // Bookkeeping once the reply is on its way: a preempt (the memory pool's reclaim)
                // waits for it.
                if let Some(e) = &reply.error {
                    (self.on_error)(ErrorCause::of_exit_code(e.code));
                }
                if let (Some(c), Some(event)) = (caller, event) {
                    self.audit.served(c, event, &reply);
                }
                self.gauges_published = None;
                if handled + waited >= SLOW_REQUEST {
                    tracing::warn!(
                        handled_us = handled.as_micros() as u64,
                        waited_us = waited.as_micros() as u64,
                        "slow request"
                    );
                }
            }
        }
    }

    /// Closes finished connections and those past [`REQUEST_TIMEOUT`].
    fn close_stale(&mut self, now: Instant) {
        for c in &mut self.conns {
            if !c.done && now.duration_since(c.since) >= REQUEST_TIMEOUT {
                c.done = true;
                if c.reply.is_none() {
                    (self.on_error)(ErrorCause::Timeout);
                }
            }
        }
        self.conns.retain(|c| !c.done);
    }
}

/// Answers a [`LoopRequest`] from what the daemon shares process-wide (its metrics).
fn answer_loop(req: LoopRequest) -> Reply {
    match req {
        LoopRequest::Metrics => match crate::metrics::for_gate() {
            Some(m) => Reply::ok(json!({"text": m.encode()})),
            None => Reply::err(
                1,
                "this daemon keeps no metrics: start it with `--metrics-addr ADDR` (or \
                 `address` under `[metrics]` in its config file)",
            ),
        },
    }
}

enum ReadOutcome {
    /// No complete line yet.
    Pending,
    /// The line (without its newline; or everything, if the peer closed without one).
    Line(Vec<u8>),
    /// Over [`MAX_REQUEST_BYTES`] without a newline.
    TooLong,
    /// The peer closed without sending anything.
    Closed,
}

impl Conn {
    /// Reads what is there without blocking, never past [`MAX_REQUEST_BYTES`] + 1 bytes.
    fn read_request(&mut self) -> ReadOutcome {
        let mut chunk = [0u8; 4096];
        loop {
            let room = (MAX_REQUEST_BYTES + 1 - self.request.len()).min(chunk.len());
            if room == 0 {
                return ReadOutcome::TooLong;
            }
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) if self.request.is_empty() => return ReadOutcome::Closed,
                Ok(0) => return ReadOutcome::Line(std::mem::take(&mut self.request)),
                Ok(n) => {
                    let seen = self.request.len();
                    self.request.extend_from_slice(&chunk[..n]);
                    if let Some(p) = self.request[seen..].iter().position(|&b| b == b'\n') {
                        self.request.truncate(seen + p);
                        return ReadOutcome::Line(std::mem::take(&mut self.request));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return ReadOutcome::Pending
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return ReadOutcome::Closed,
            }
        }
    }

    /// Queues `reply` and writes as much of it as the socket takes now.
    fn answer(&mut self, reply: &Reply) {
        let mut out = serde_json::to_vec(reply).expect("replies serialise");
        out.push(b'\n');
        self.reply = Some((out, 0));
        self.since = Instant::now();
        self.write_reply();
    }

    fn write_reply(&mut self) {
        let Some((out, written)) = &mut self.reply else {
            return;
        };
        while *written < out.len() {
            match self.stream.write(&out[*written..]) {
                Ok(n) => *written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.done = true;
    }
}

/// Serves the socket until SIGINT/SIGTERM/SIGHUP (`Ok`) or until the eBPF watcher stops.
pub fn serve<D: RmDriver>(
    core: &mut DaemonCore<D>,
    events: &impl EventSource,
    server: &mut Server<'_>,
    signals: &Signals,
) -> Result<(), DaemonError> {
    loop {
        server.step(core, events, Duration::from_millis(5))?;
        if let Some(sig) = signals.pending() {
            eprintln!("valvectl daemon: {sig}: resuming everything and exiting");
            return Ok(());
        }
    }
}

#[cfg(test)]
mod bench;
#[cfg(test)]
pub(crate) mod tests;
