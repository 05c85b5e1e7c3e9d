//! The control socket: binding it with the right owner and mode, checking who connects
//! (SO_PEERCRED: root or the daemon's group), and the main loop that serves requests.
//!
//! The loop is one thread. Each turn it folds watcher events into the registry, expires hold
//! limits and keeps the gate current, polls, accepts, and answers requests one at a time in
//! [`DaemonCore`]. Nothing slow runs on it: a `gate start` attaches its BPF programs on a helper
//! thread and is answered when its gate is ready, while the loop goes on. The memory pool's
//! freezes and thaws come by the fast [`lane`], not the socket, and are served between any two
//! pieces of the loop's work (docs/memory.md, "How a reclaim reaches the loop").
//!
//! Connections are read without blocking, all of them at once through poll(2), so an idle or
//! slow client holds a slot and never the loop. A request is one line of at most
//! [`MAX_REQUEST_BYTES`], sent within [`REQUEST_TIMEOUT`]; a line that cannot be JSON is refused
//! unparsed. A turn serves each peer process at most [`REQUESTS_PER_PEER_PER_TURN`] requests
//! and accepts at most [`ACCEPTS_PER_TURN`], so a flood from one client delays another's request
//! by a bounded amount; at most [`MAX_CONNECTIONS`] are open (the flooding peer's oldest goes
//! for a new one). The loop answers the read-only [`LoopRequest`]s itself (the metrics text for
//! `valvectl top`); every [`Request`] goes to the daemon's core.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials, UnixCredentials};
use valve::driver::RmDriver;
use valve::Signals;
use valve_ebpf::{RmEvent, Watcher};

use crate::audit::{Audit, Caller, Targets};
use crate::core::DaemonCore;
use crate::error::{derr, DaemonError};
use crate::metrics::ErrorCause;
use crate::protocol::{
    classify_bad_request, Data, ErrorCode, ErrorReply, GateSpec, LoopRequest, MetricsReply, Reply,
    Request, EXIT_BPF, MAX_REQUEST_BYTES,
};

mod conn;
pub mod lane;

use conn::{may_be_request, Conn, ReadOutcome};
pub use lane::{Lane, LaneClient, LaneOp};

/// Requests that took this long from connection to reply are logged (with where the time went).
const SLOW_REQUEST: Duration = Duration::from_millis(20);
/// How long a connection has to send its request line (and to take its reply).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; for a new one beyond this, the oldest of the peer holding the
/// most is closed.
pub const MAX_CONNECTIONS: usize = 4096;
/// Requests served per peer process in one turn; the rest of its ready connections wait for the
/// next turn (they stay readable), so one client's flood delays another's request by at most
/// this many per flooding process.
pub const REQUESTS_PER_PEER_PER_TURN: usize = 16;
/// Connections accepted per turn; more wait in the listen queue for the next turn.
pub const ACCEPTS_PER_TURN: usize = 256;
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
    serde_json::from_str::<Reply<serde_json::Value>>(&reply).is_ok()
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

/// No source at all (`valvectl daemon --no-discovery`): nothing is delivered and it never dies.
impl<E: EventSource> EventSource for Option<E> {
    fn next_event(&self) -> Option<RmEvent> {
        self.as_ref().and_then(EventSource::next_event)
    }
    fn alive(&self) -> bool {
        self.as_ref().is_none_or(EventSource::alive)
    }
}

/// Folds every event the source has delivered into the registry.
fn drain<D: RmDriver>(core: &mut DaemonCore<D>, events: &impl EventSource) {
    while let Some(ev) = events.next_event() {
        core.on_event(&ev);
    }
}

/// Who waits for the `gate start` under way.
enum GateWaiter {
    /// A connection, by id, with what its reply is audited as.
    Conn {
        id: u64,
        caller: Option<Caller>,
        event: AuditEvent,
        started: Instant,
    },
    /// The daemon's own start (`gate.autostart`): a failure stops the daemon.
    Autostart { event: AuditEvent },
}

/// A request's audit event ([`Audit::event_of`]).
type AuditEvent = Option<(&'static str, Targets)>;

/// The control socket's connections, the fast lane, and what the loop does with them each turn.
pub struct Server<'a> {
    listener: &'a UnixListener,
    gid: Option<u32>,
    audit: &'a Audit,
    conns: Vec<Conn>,
    next_id: u64,
    /// The fast lane, once given ([`Self::with_lane`]).
    lane: Option<Lane>,
    gate_waiter: Option<GateWaiter>,
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
            next_id: 0,
            lane: None,
            gate_waiter: None,
            on_error: Box::new(|_| {}),
            gauges_published: None,
            refusals_audited: (Instant::now(), 0),
        }
    }

    /// Serves `lane` (see [`lane::lane`]) before anything else, and wakes on it.
    pub fn with_lane(mut self, lane: Lane) -> Self {
        self.lane = Some(lane);
        self
    }

    /// What wakes the loop when a `gate start` has finished on its helper thread (without a
    /// lane, the poll's timeout does).
    fn waker(&self) -> impl FnOnce() + Send + 'static {
        let waker = self.lane.as_ref().map(Lane::waker);
        move || {
            if let Some(w) = waker {
                w.wake();
            }
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

    /// Starts the configured gate (`gate.autostart`) without holding the loop: it finishes in
    /// a later [`Self::step`], which fails if the start does, since the operator asked for a gate.
    pub fn autostart_gate<D: RmDriver>(
        &mut self,
        core: &mut DaemonCore<D>,
        spec: GateSpec,
    ) -> Result<(), DaemonError> {
        let event = Audit::event_of(&Request::GateStart(Box::new(spec.clone())));
        match core.begin_gate_start(spec, self.waker()) {
            Ok(()) => {
                self.gate_waiter = Some(GateWaiter::Autostart { event });
                Ok(())
            }
            Err(reply) => autostarted(self.audit, event, &reply),
        }
    }

    /// One turn of the loop: registry, hold limits and gate upkeep, then waits up to `wait`
    /// for the sockets and serves what they have, each peer at most
    /// [`REQUESTS_PER_PEER_PER_TURN`] requests; the fast lane between any two of these. Errors
    /// when the event source died or the configured gate failed to start.
    pub fn step<D: RmDriver>(
        &mut self,
        core: &mut DaemonCore<D>,
        events: &impl EventSource,
        wait: Duration,
    ) -> Result<(), DaemonError> {
        self.serve_lane(core, events);
        drain(core, events);
        self.expire(core);
        self.serve_lane(core, events);
        core.refresh_gate(Instant::now(), crate::gate::Rescan::IfDue);
        core.publish_harvest_view(Instant::now());
        if !events.alive() {
            return Err(derr(
                EXIT_BPF,
                "the eBPF watcher stopped; exiting so the service restarts",
            ));
        }
        self.finish_gate_start(core)?;
        let ready = self.poll(wait);
        self.serve_lane(core, events);
        self.finish_gate_start(core)?;
        let fresh = self.accept();
        self.serve_lane(core, events);
        let mut served = HashMap::new();
        for i in ready.into_iter().chain(fresh) {
            if self.fair_share_used(i, &mut served) {
                continue; // still readable: served next turn
            }
            self.service(i, core, events);
            self.serve_lane(core, events);
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

    /// Resumes the preemptions past their hold limit, and audits it.
    fn expire<D: RmDriver>(&mut self, core: &mut DaemonCore<D>) {
        for pid in core.expire(Instant::now()) {
            let reply = if core.is_preempted(pid) {
                (self.on_error)(ErrorCause::Rm);
                Reply::fail(
                    ErrorCode::Failed,
                    "resume at the hold limit failed; see the daemon's log",
                )
            } else {
                Reply::empty()
            };
            let targets = Targets::Pid { pid };
            self.audit
                .record("hold_limit_resume", Caller::daemon(), targets, &reply);
        }
    }

    /// Serves every call waiting on the fast lane (the pool's freezes and thaws), as the socket
    /// would serve the same preempt or resume, with the daemon as the audited caller.
    fn serve_lane<D: RmDriver>(&mut self, core: &mut DaemonCore<D>, events: &impl EventSource) {
        while let Some(call) = self.lane.as_ref().and_then(Lane::next) {
            let queued = call.sent.elapsed();
            let started = Instant::now();
            // Events that arrived before the call must be in the registry.
            drain(core, events);
            let drained = started.elapsed();
            let req = call.op.request();
            let event = Audit::event_of(&req);
            let mut reply = core.handle(req);
            stamp(&mut reply, drained, queued);
            let _ = call.reply.send(reply.clone());
            let caller = Some(Caller::daemon());
            self.bookkeep(caller, event, &reply, Some((started.elapsed(), queued)));
        }
    }

    /// Answers the `gate start` under way once it has finished.
    fn finish_gate_start<D: RmDriver>(
        &mut self,
        core: &mut DaemonCore<D>,
    ) -> Result<(), DaemonError> {
        let Some(reply) = core.poll_gate_start() else {
            return Ok(());
        };
        match self.gate_waiter.take() {
            Some(GateWaiter::Conn {
                id,
                caller,
                event,
                started,
            }) => {
                if let Some(c) = self.conns.iter_mut().find(|c| c.id == id) {
                    c.answer(&reply);
                }
                tracing::info!(
                    took_us = started.elapsed().as_micros() as u64,
                    "gate start answered (the loop served other requests meanwhile)"
                );
                self.bookkeep(caller, event, &reply, None);
                Ok(())
            }
            Some(GateWaiter::Autostart { event }) => autostarted(self.audit, event, &reply),
            None => Ok(()),
        }
    }

    /// Whether connection `i`'s peer has had its requests for this turn (counting this one).
    fn fair_share_used(&self, i: usize, served: &mut HashMap<i32, usize>) -> bool {
        let Some(c) = self.conns.get(i) else {
            return false;
        };
        if c.done || c.reply.is_some() {
            return false; // closing or writing a reply: no request to serve
        }
        let n = served.entry(c.peer()).or_insert(0);
        *n += 1;
        *n > REQUESTS_PER_PEER_PER_TURN
    }

    /// After a reply is on its way: error metrics, the audit record, fresh gauges, and a log
    /// line if it was slow (`timing`: handled, waited; `None`: not a loop-held request).
    fn bookkeep(
        &mut self,
        caller: Option<Caller>,
        event: AuditEvent,
        reply: &Reply,
        timing: Option<(Duration, Duration)>,
    ) {
        if let Some(e) = &reply.error {
            (self.on_error)(ErrorCause::of_exit_code(e.code));
        }
        if let (Some(c), Some(event)) = (caller, event) {
            self.audit.served(c, Some(event), reply);
        }
        self.gauges_published = None;
        if let Some((handled, waited)) = timing.filter(|(h, w)| *h + *w >= SLOW_REQUEST) {
            tracing::warn!(
                handled_us = handled.as_micros() as u64,
                waited_us = waited.as_micros() as u64,
                "slow request"
            );
        }
    }

    /// Waits for the listener, the lane or any connection; returns the connections that are
    /// ready. Connections waiting for a gate's start are not read.
    fn poll(&self, wait: Duration) -> Vec<usize> {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let mut fds = Vec::with_capacity(self.conns.len() + 2);
        fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
        if let Some(lane) = &self.lane {
            fds.push(PollFd::new(lane.fd(), PollFlags::POLLIN));
        }
        let first = fds.len();
        let mut polled = Vec::with_capacity(self.conns.len());
        for (i, c) in self.conns.iter().enumerate() {
            if c.waiting || c.done {
                continue;
            }
            let want = if c.reply.is_some() {
                PollFlags::POLLOUT
            } else {
                PollFlags::POLLIN
            };
            fds.push(PollFd::new(c.stream.as_fd(), want));
            polled.push(i);
        }
        let ms = wait.as_millis().min(u16::MAX as u128) as u16;
        if nix::poll::poll(&mut fds, PollTimeout::from(ms)).unwrap_or(0) <= 0 {
            return Vec::new();
        }
        if let Some(lane) = &self.lane {
            if fds[1].revents().is_some_and(|r| !r.is_empty()) {
                lane.clear_wake();
            }
        }
        fds[first..]
            .iter()
            .zip(polled)
            .filter(|(f, _)| f.revents().is_some_and(|r| !r.is_empty()))
            .map(|(_, i)| i)
            .collect()
    }

    /// Accepts up to [`ACCEPTS_PER_TURN`] waiting connections; returns their indices. Callers
    /// that may not use Valve get their refusal queued at once and are never read.
    fn accept(&mut self) -> Vec<usize> {
        let mut fresh = Vec::new();
        let mut heaviest = None;
        while fresh.len() < ACCEPTS_PER_TURN {
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
                self.evict(&mut heaviest);
            }
            let cred = getsockopt(&stream, PeerCredentials).ok();
            let caller = cred.map(|c| Caller {
                uid: c.uid(),
                gid: c.gid(),
                pid: c.pid(),
            });
            self.next_id += 1;
            let mut conn = Conn::new(self.next_id, stream, caller);
            if !cred.is_some_and(|c| allowed(&c, self.gid)) {
                let reply = Reply::fail(
                    ErrorCode::Permission,
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
            self.audit
                .record("refused", caller, Targets::Nothing {}, reply);
        }
    }

    /// Makes room for a new connection: closes the oldest open one of the peer that holds the
    /// most (`heaviest`, worked out once per accept batch), so that one client's flood costs
    /// other clients none of their connections.
    fn evict(&mut self, heaviest: &mut Option<i32>) {
        let open = |c: &&mut Conn| !c.done && !c.waiting;
        for _ in 0..2 {
            let peer = *heaviest.get_or_insert_with(|| {
                let mut held: HashMap<i32, usize> = HashMap::new();
                for c in self.conns.iter().filter(|c| !c.done && !c.waiting) {
                    *held.entry(c.peer()).or_insert(0) += 1;
                }
                held.into_iter()
                    .max_by_key(|&(_, n)| n)
                    .map_or(-1, |(p, _)| p)
            });
            let oldest = self
                .conns
                .iter_mut()
                .filter(open)
                .filter(|c| c.peer() == peer)
                .min_by_key(|c| c.since);
            if let Some(c) = oldest {
                // Closed by the retain at the end of the turn (indices stay valid until then).
                c.done = true;
                (self.on_error)(ErrorCause::Evicted);
                return;
            }
            *heaviest = None; // that peer has none left: count again
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
        if conn.done || conn.waiting {
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
                conn.answer(&Reply::fail(
                    ErrorCode::BadRequest,
                    format!(
                        "request refused: longer than {MAX_REQUEST_BYTES} bytes; a request is \
                         one JSON line (see valve_daemon::protocol::Request)"
                    ),
                ));
            }
            ReadOutcome::Line(line) => self.answer_line(i, &line, core, events),
        }
    }

    /// Answers connection `i`'s request line; a `gate start` is begun and answered once its gate
    /// has started (see [`Self::finish_gate_start`]).
    fn answer_line<D: RmDriver>(
        &mut self,
        i: usize,
        line: &[u8],
        core: &mut DaemonCore<D>,
        events: &impl EventSource,
    ) {
        let (id, caller, waited) = {
            let c = &self.conns[i];
            (c.id, c.caller, c.since.elapsed())
        };
        let started = Instant::now();
        let parsed = match parse(line) {
            Ok(req) => req,
            Err(Ok(req)) => {
                // A read-only request the loop answers itself: nothing to audit.
                self.conns[i].answer(&answer_loop(req));
                return;
            }
            Err(Err(why)) => {
                // Refused cheaply: counted, neither audited nor logged.
                (self.on_error)(ErrorCause::Malformed);
                self.conns[i].answer(&Reply {
                    data: None,
                    error: Some(why),
                });
                return;
            }
        };
        let event = Audit::event_of(&parsed);
        let reply = match parsed {
            Request::GateStart(spec) => match core.begin_gate_start(*spec, self.waker()) {
                Ok(()) => {
                    self.conns[i].waiting = true;
                    self.gate_waiter = Some(GateWaiter::Conn {
                        id,
                        caller,
                        event,
                        started,
                    });
                    return;
                }
                Err(reply) => reply,
            },
            req => {
                // Events that arrived before the request must be in the registry.
                drain(core, events);
                let drained = started.elapsed();
                let mut reply = core.handle(req);
                stamp(&mut reply, drained, waited);
                reply
            }
        };
        self.conns[i].answer(&reply);
        // Bookkeeping once the reply is on its way: a preempt may be waited for.
        self.bookkeep(caller, event, &reply, Some((started.elapsed(), waited)));
    }

    /// Closes finished connections and those past [`REQUEST_TIMEOUT`] (not those waiting for a
    /// gate's start, which always ends).
    fn close_stale(&mut self, now: Instant) {
        for c in &mut self.conns {
            if !c.done && !c.waiting && now.duration_since(c.since) >= REQUEST_TIMEOUT {
                c.done = true;
                if c.reply.is_none() {
                    (self.on_error)(ErrorCause::Timeout);
                }
            }
        }
        self.conns.retain(|c| !c.done);
    }
}

/// A request line as a [`Request`], else as a [`LoopRequest`], else the error to answer (an
/// unknown op and a malformed request have their own). A line that cannot be a JSON object is
/// refused without parsing.
fn parse(line: &[u8]) -> Result<Request, Result<LoopRequest, ErrorReply>> {
    if !may_be_request(line) {
        return Err(Err(ErrorReply::new(
            ErrorCode::BadRequest,
            "bad request: a request is one JSON object per line",
        )));
    }
    serde_json::from_slice::<Request>(line).map_err(|e| {
        serde_json::from_slice::<LoopRequest>(line)
            .map_err(|_| classify_bad_request(line, &e.to_string()))
    })
}

/// A preempt's reply says where its time went: `drain` and `queued` join the core's timings.
fn stamp(reply: &mut Reply, drained: Duration, queued: Duration) {
    if let Some(Data::Preempt(p)) = &mut reply.data {
        if let Some(t) = &mut p.timing_us {
            t.drain = Some(drained.as_micros() as u64);
            t.queued = Some(queued.as_micros() as u64);
        }
    }
}

/// Audits the configured gate's start; its failure stops the daemon.
fn autostarted(audit: &Audit, event: AuditEvent, reply: &Reply) -> Result<(), DaemonError> {
    audit.served(Caller::daemon(), event, reply);
    match &reply.error {
        None => {
            eprintln!("valvectl daemon: gate started from the config (gate.autostart)");
            Ok(())
        }
        Some(e) => Err(derr(
            e.code,
            format!("gate.autostart: starting the gate failed: {}", e.message),
        )),
    }
}

/// Answers a [`LoopRequest`] from what the daemon shares process-wide (its metrics).
fn answer_loop(req: LoopRequest) -> Reply {
    match req {
        LoopRequest::Metrics => match crate::metrics::for_gate() {
            Some(m) => Reply::ok(MetricsReply { text: m.encode() }),
            None => Reply::fail(ErrorCode::Failed, "this daemon keeps no metrics"),
        },
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
