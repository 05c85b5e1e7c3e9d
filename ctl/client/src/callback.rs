//! The callback connection: bound to the registration with `attach`, then served by the
//! library's own thread, which answers `reclaim` and maps `pool_handles` as they arrive.
//!
//! The reclaim path runs while the daemon holds this process's GPU work frozen, so it does only
//! the selection and the mapping calls under the space's lock, and counts instead of logging.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use valve_protocol::pool::{CallbackReply, PoolErrorCode, PoolRequest};
use valve_vmm::{wire, VmmError};

use crate::space::Space;
use crate::{conn, Error, Result, Role};

/// The longest a reclaim waits for an in-flight `grow` reply to be registered (the daemon's
/// deadline for the whole reclaim is 100 ms by default).
const GROW_WAIT: Duration = Duration::from_millis(20);

/// What the client and its callback thread share.
pub(crate) struct Shared {
    pub space: Mutex<Space>,
    /// Signalled when handles are mapped or the callback connection closes.
    pub changed: Condvar,
    /// The daemon closed the callback connection.
    pub closed: AtomicBool,
    pub role: Role,
    /// Online and mapping the whole pool (pool handle `h` at slot `h`).
    pub premap: bool,
}

impl Shared {
    pub fn new(space: Space, role: Role, premap: bool) -> Shared {
        Shared {
            space: Mutex::new(space),
            changed: Condvar::new(),
            closed: AtomicBool::new(false),
            role,
            premap,
        }
    }

    /// The space (a panic elsewhere does not make it unusable: its state is checked per call).
    pub fn lock(&self) -> MutexGuard<'_, Space> {
        self.space.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The space, for a reclaim of `count`: if it has fewer handles than that while a `grow`
    /// reply is being read, the daemon counted that reply's handles, so wait (at most
    /// [`GROW_WAIT`]) until the control thread has registered them.
    fn lock_for_reclaim(&self, count: usize) -> MutexGuard<'_, Space> {
        let until = Instant::now() + GROW_WAIT;
        let mut sp = self.lock();
        while sp.reclaimable() < count && sp.growing() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            sp = self
                .changed
                .wait_timeout(sp, left)
                .map_or_else(|e| e.into_inner().0, |r| r.0);
        }
        sp
    }
}

/// Opens the callback connection and binds it with `attach`. Events that arrive before the
/// reply (a premapped online client's first `pool_handles`) are handled on the way.
pub(crate) fn attach(path: &Path, client: u64, token: &str, shared: &Shared) -> Result<UnixStream> {
    let sock = conn::connect(path)?;
    let msg = PoolRequest::Attach {
        client,
        token: token.into(),
    };
    wire::send(&sock, &msg.to_json(), &[]).map_err(Error::from_wire)?;
    let mut scratch = Vec::new();
    loop {
        let (msg, fds) = wire::recv(&sock)
            .map_err(Error::from_wire)?
            .ok_or(Error::Closed)?;
        if msg.get("ok").is_none() {
            dispatch(&sock, shared, &msg, fds, &mut scratch);
            continue;
        }
        conn::check_reply("attach", &msg)?;
        // The daemon sends a premapped client the pool's handles with this reply.
        if msg.get("event").and_then(Value::as_str) == Some("pool_handles") {
            pool_handles(shared, &msg, &fds);
        }
        return Ok(sock);
    }
}

/// Starts the thread that serves `sock` until the daemon closes it or the client shuts it down.
pub(crate) fn spawn(sock: UnixStream, shared: Arc<Shared>) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("valve-client-cb".into())
        .spawn(move || serve(sock, shared))
        .map_err(|e| Error::Invalid(format!("starting the callback thread: {e}")))
}

fn serve(sock: UnixStream, shared: Arc<Shared>) {
    let mut scratch = Vec::new();
    loop {
        match wire::recv(&sock) {
            Ok(Some((msg, fds))) => dispatch(&sock, &shared, &msg, fds, &mut scratch),
            // A malformed message: count it and keep serving.
            Err(VmmError::Invalid(_)) => shared.lock().counters.callback_errors += 1,
            Ok(None) | Err(_) => break,
        }
    }
    shared.closed.store(true, Ordering::SeqCst);
    // Take the lock so a waiter between its check and its wait cannot miss the wake-up.
    drop(shared.lock());
    shared.changed.notify_all();
}

/// Daemon requests carry `op` (and `rid`); events carry `event` (or `op`: docs/memory.md does
/// not name the key, the daemon uses `event`).
fn dispatch(
    sock: &UnixStream,
    shared: &Shared,
    msg: &Value,
    fds: Vec<OwnedFd>,
    scratch: &mut Vec<u32>,
) {
    let kind = msg.get("op").or_else(|| msg.get("event"));
    match kind.and_then(Value::as_str) {
        Some("reclaim") => reclaim(sock, shared, msg, scratch),
        Some("pool_handles") => pool_handles(shared, msg, &fds),
        _ => {
            shared.lock().counters.callback_errors += 1;
            if let Some(rid) = msg.get("rid").and_then(Value::as_u64) {
                let reply = refused(
                    rid,
                    PoolErrorCode::BadRequest,
                    format!(
                        "unknown callback op in {msg}: this client library answers reclaim \
                         and pool_handles"
                    ),
                );
                reply_or_count(sock, shared, &reply);
            }
        }
    }
}

/// Answers `reclaim {rid, count}`: Algorithm 1 (or FIFO) picks the slots, the quarantine
/// replaces them, and the reply names their pool handles.
fn reclaim(sock: &UnixStream, shared: &Shared, msg: &Value, handles: &mut Vec<u32>) {
    let rid = msg.get("rid").and_then(Value::as_u64).unwrap_or(0);
    let count = msg.get("count").and_then(Value::as_u64);
    let reply = match (shared.role, count) {
        (Role::Online, _) => refused(
            rid,
            PoolErrorCode::WrongRole,
            "reclaim sent to an online client: only offline clients give memory back",
        ),
        (_, None) => refused(
            rid,
            PoolErrorCode::BadRequest,
            "reclaim without an unsigned `count`",
        ),
        (Role::Offline, Some(count)) => {
            handles.clear();
            let done = shared
                .lock_for_reclaim(count as usize)
                .reclaim(count as usize, handles);
            match done {
                Ok(()) => CallbackReply {
                    rid,
                    ok: true,
                    handles: handles.clone(),
                    code: None,
                    error: None,
                },
                Err(e) => {
                    shared.lock().counters.callback_errors += 1;
                    CallbackReply {
                        rid,
                        ok: false,
                        handles: handles.clone(),
                        code: None,
                        error: Some(format!(
                            "the client could not swap every slot to its quarantine: {e}"
                        )),
                    }
                }
            }
        }
    };
    reply_or_count(sock, shared, &reply);
}

/// A premapped online client maps every pool handle the daemon announces.
fn pool_handles(shared: &Shared, msg: &Value, fds: &[OwnedFd]) {
    let mapped = match (shared.premap, conn::handle_ids("pool_handles", msg)) {
        (true, Ok(ids)) => shared.lock().map_announced(&ids, fds),
        (_, Err(e)) => Err(e),
        (false, _) => Err(Error::Protocol(
            "pool_handles sent to a client that does not premap".into(),
        )),
    };
    let mut sp = shared.lock();
    if mapped.is_err() {
        sp.counters.callback_errors += 1;
    }
    drop(sp);
    shared.changed.notify_all();
}

fn reply_or_count(sock: &UnixStream, shared: &Shared, reply: &CallbackReply) {
    let sent = serde_json::to_value(reply).is_ok_and(|v| wire::send(sock, &v, &[]).is_ok());
    if !sent {
        shared.lock().counters.callback_errors += 1;
    }
}

/// A refused callback request `rid`: nothing released, with why.
fn refused(rid: u64, code: PoolErrorCode, error: impl Into<String>) -> CallbackReply {
    CallbackReply {
        rid,
        ok: false,
        handles: Vec::new(),
        code: Some(code),
        error: Some(error.into()),
    }
}
