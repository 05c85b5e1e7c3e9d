//! The pool socket: registers client processes, grows and shrinks their memory, and reclaims
//! from offline for online (freeze, ask, transfer, thaw). One thread, one poll loop.
//!
//! Protocol: the types of `valve_protocol::pool` (`docs/memory.md` explains them). Connections are identified by SO_PEERCRED;
//! a control connection that closes unregisters its process and frees what it held. Online
//! reservations are saved across restarts by [`warm`].

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use valve_protocol::pool::{
    ok_json, AttachReply, CapReply, ClientEntry, GpuRef, GrowReply, PoolErrorCode, PoolFailure,
    PoolHandles, PoolRequest, PoolStatus, RegisterReply, ReservationState, ShrinkReply,
    TakeBackReply, UsageReply,
};
use valve_vmm::wire;

use super::ledger::{ClientId, HandleId, Ledger, PoolError, Role, UsageSnapshot};
use super::reclaim::{FreezeReport, Freezer, Reclaimer, Target};
use super::reservation::{ReservationConfig, ReservationController};

pub mod warm;

use warm::{Start, WarmStore};

/// Most connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 4096;

/// How long the pool waits for the rest of a message whose first part has arrived.
pub const MESSAGE_PARTS_WITHIN: Duration = Duration::from_millis(250);

/// How long the pool waits to hand a reply to a client's socket. A client blocks on its reply,
/// so only one that sends without reading (hundreds of unread replies fill the socket's buffer)
/// ever makes the pool wait; it is closed then, and every online grow waits at most this long
/// behind it.
pub const REPLY_WITHIN: Duration = Duration::from_millis(50);

/// Who may connect: a peer passes if this returns true for its stream.
pub type PeerCheck = Box<dyn Fn(&UnixStream) -> bool + Send>;

enum Kind {
    /// Connected, said nothing yet.
    New,
    /// A registered process's requests.
    Control(ClientId),
    /// The daemon's requests to a process.
    Callback(ClientId),
}

struct Conn {
    stream: UnixStream,
    pid: u32,
    /// The peer's user (root alone may set caps).
    uid: u32,
    kind: Kind,
}

/// The pool server's state.
pub struct PoolServer {
    ledger: Ledger,
    listener: UnixListener,
    conns: BTreeMap<RawFd, Conn>,
    tokens: BTreeMap<ClientId, u64>,
    allowed: PeerCheck,
    reclaimer: Reclaimer,
    reservation: ReservationConfig,
    /// Offline pids a reclaim left frozen until online's reply is out.
    to_thaw: Vec<u32>,
    /// The last reclaim's freeze and answer times (us), for the log line after the thaw.
    reclaim_times: (u64, u64, FreezeReport),
    /// What to log about the reclaim just answered: handles, freeze, answers, total (us).
    reclaim_log: Option<([u64; 4], FreezeReport)>,
    /// MIAD state per online client, fed by its `usage` reports.
    controllers: BTreeMap<ClientId, OnlineReservation>,
    /// The saved reservations that new ones start from, and where live ones are saved.
    warm: WarmStore,
    /// How an online process is named in the saved reservations (`warm::online_name`).
    online_name: fn(u32) -> String,
    started: Instant,
    /// Per-GPU numbers for other threads, and when they were last published.
    usage: Arc<UsageSnapshot>,
    usage_published: Option<Instant>,
}

/// One online client's MIAD reservation, and what it is saved under.
struct OnlineReservation {
    ctl: ReservationController,
    /// The GPU's name in the saved reservations.
    gpu: String,
    /// The online process's name in the saved reservations.
    online: String,
    /// Whether it started warm, and from what.
    start: Start,
}

/// How often the pool publishes its per-GPU numbers for other threads.
const USAGE_EVERY: Duration = Duration::from_secs(1);

/// The peer's pid and uid.
fn peer(stream: &UnixStream) -> Option<(u32, u32)> {
    nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .ok()
        .map(|c| (c.pid() as u32, c.uid()))
}

fn random_token() -> u64 {
    let mut b = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    u64::from_ne_bytes(b) | 1
}

fn err_reply(code: PoolErrorCode, message: impl Into<String>) -> Value {
    PoolFailure::new(code, message).to_json()
}

fn pool_err(e: PoolError) -> Value {
    err_reply(e.code(), e.to_string())
}

impl PoolServer {
    /// A server on `listener` over `ledger`, freezing offline processes with `freezer`.
    pub fn new(
        ledger: Ledger,
        listener: UnixListener,
        allowed: PeerCheck,
        freezer: Box<dyn Freezer>,
        deadline: Duration,
    ) -> PoolServer {
        let mut s = PoolServer {
            ledger,
            listener,
            conns: BTreeMap::new(),
            tokens: BTreeMap::new(),
            allowed,
            reclaimer: Reclaimer::new(freezer, deadline),
            reservation: ReservationConfig::default(),
            controllers: BTreeMap::new(),
            warm: WarmStore::off(),
            online_name: warm::online_name,
            started: Instant::now(),
            usage: Arc::default(),
            usage_published: None,
            to_thaw: Vec::new(),
            reclaim_times: (0, 0, FreezeReport::default()),
            reclaim_log: None,
        };
        // Published at once, so readers started before the pool thread have the numbers.
        s.publish_usage_if_due();
        s
    }

    /// MIAD settings for online clients registered from now on (checked here).
    pub fn set_reservation(&mut self, cfg: ReservationConfig) -> Result<(), String> {
        cfg.validate().map_err(|e| format!("reservation: {e}"))?;
        self.reservation = cfg;
        Ok(())
    }

    /// Where online reservations are saved and start from (off until this is called).
    pub fn set_warm_start(&mut self, store: WarmStore) {
        self.warm = store;
    }

    /// A new online reservation for `pid` on `gpu`: warm from a saved one where one matches
    /// (`docs/memory.md`, "Warm start"), else cold.
    fn new_reservation(&self, pid: u32, gpu: usize) -> OnlineReservation {
        let capacity = self.ledger.max_handles(gpu).unwrap_or(usize::MAX) as u64;
        let mut ctl = ReservationController::new(self.reservation)
            .expect("validated in set_reservation")
            .with_capacity(capacity);
        let gpu_name = warm::gpu_name(self.ledger.pci_bus_id(gpu), gpu);
        let online = (self.online_name)(pid);
        let file = self
            .warm
            .path()
            .map(|p| p.to_path_buf())
            .unwrap_or_default();
        let start = match self.warm.start(&gpu_name, &online, warm::unix_now()) {
            Ok((saved, age_s)) => match ctl.warm_from(saved) {
                Ok(notes) => Start::Warm { file, age_s, notes },
                Err(why) => Start::Cold(why),
            },
            Err(why) => Start::Cold(why),
        };
        match &start {
            Start::Warm { file, age_s, notes } => tracing::info!(
                pid, online, gpu = gpu_name, age_s, adjusted = ?notes,
                "online reservation starts warm from {}", file.display()
            ),
            Start::Cold(why) => {
                tracing::info!(
                    pid,
                    online,
                    gpu = gpu_name,
                    "online reservation starts cold: {why}"
                )
            }
        }
        OnlineReservation {
            ctl,
            gpu: gpu_name,
            online,
            start,
        }
    }

    /// Keeps what `r` has learned in the saved reservations.
    fn remember(warm: &mut WarmStore, r: &OnlineReservation) {
        warm.record(&r.gpu, &r.online, r.ctl.learned(), warm::unix_now());
    }

    /// Saves every live reservation if [`warm::SAVE_EVERY`] has passed (between requests; the
    /// file is written by another thread).
    fn save_reservations_if_due(&mut self, now: Instant) {
        if !self.warm.due(now) {
            return;
        }
        self.save_reservations();
    }

    /// Saves every live reservation now (the writer thread writes the file).
    fn save_reservations(&mut self) {
        for r in self.controllers.values() {
            Self::remember(&mut self.warm, r);
        }
        self.warm.save();
    }

    /// `usage`: an online client's used bytes; the reply says how many handles it should hold.
    fn usage(&mut self, client: ClientId, used: u64) -> Value {
        let Ok(info) = self.ledger.client(client) else {
            return err_reply(PoolErrorCode::NotRegistered, "not registered");
        };
        if info.role != Role::Online {
            return err_reply(
                PoolErrorCode::WrongRole,
                "usage is for online clients: offline gets only free memory",
            );
        }
        let handle = self.ledger.handle_bytes(info.gpu).unwrap_or(1) as u64;
        let mapped = info.held.len() as u64 * handle;
        let (pid, gpu) = (info.pid, info.gpu);
        if !self.controllers.contains_key(&client) {
            let r = self.new_reservation(pid, gpu);
            self.controllers.insert(client, r);
        }
        let c = &mut self
            .controllers
            .get_mut(&client)
            .expect("inserted above")
            .ctl;
        // Growth the pool can serve from spare memory reclaims nothing: not an event of the rate.
        let ledger = &self.ledger;
        let spare = || ledger.spare_handles(gpu).unwrap_or(0) as u64;
        let d = c.observe_with_spare(self.started.elapsed(), used, mapped, spare);
        ok_json(UsageReply {
            target_handles: d.target_mapped_handles,
            pressure: d.pressure,
            headroom_handles: d.headroom_handles,
            interval_ms: d.interval.as_millis() as u64,
            event_rate_per_min: c.event_rate_per_min(),
        })
    }

    /// The per-GPU numbers this server publishes about once a second while it runs.
    pub fn usage_snapshot(&self) -> Arc<UsageSnapshot> {
        self.usage.clone()
    }

    /// Publishes the per-GPU numbers now (after a change readers must see at once).
    fn publish_usage_now(&mut self) {
        self.usage_published = None;
        self.publish_usage_if_due();
    }

    /// Publishes the per-GPU numbers if a second has passed (between requests, never inside
    /// a reclaim: one pass over the handles and one NVML query per GPU).
    fn publish_usage_if_due(&mut self) {
        let now = Instant::now();
        if self
            .usage_published
            .is_none_or(|t| now.duration_since(t) >= USAGE_EVERY)
        {
            self.usage.publish(self.ledger.usage());
            self.usage_published = Some(now);
        }
    }

    /// Serves until `stop` is set (checked every `tick`).
    pub fn run(&mut self, stop: &AtomicBool, tick: Duration) {
        let _ = self.listener.set_nonblocking(true);
        while !stop.load(Ordering::Relaxed) {
            self.publish_usage_if_due();
            self.save_reservations_if_due(Instant::now());
            for fd in self.ready(tick) {
                if fd == self.listener.as_raw_fd() {
                    self.accept();
                } else {
                    self.serve(fd);
                }
            }
        }
        // A clean shutdown: what the reservations learned is kept for the next daemon.
        self.save_reservations();
    }

    /// The descriptors with something to read (or hung up) within `tick`.
    fn ready(&self, tick: Duration) -> Vec<RawFd> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = vec![PollFd::new(self.listener.as_fd(), PollFlags::POLLIN)];
        let order: Vec<RawFd> = self.conns.keys().copied().collect();
        fds.extend(
            self.conns
                .values()
                .map(|c| PollFd::new(c.stream.as_fd(), PollFlags::POLLIN)),
        );
        let ms = tick.as_millis().min(60_000) as u16;
        if poll(&mut fds, PollTimeout::from(ms)).unwrap_or(0) <= 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (i, p) in fds.iter().enumerate() {
            if p.revents().is_some_and(|r| !r.is_empty()) {
                out.push(if i == 0 {
                    self.listener.as_raw_fd()
                } else {
                    order[i - 1]
                });
            }
        }
        out
    }

    fn accept(&mut self) {
        while let Ok((stream, _)) = self.listener.accept() {
            if self.conns.len() >= MAX_CONNECTIONS || !(self.allowed)(&stream) {
                continue; // dropped: closed
            }
            let Some((pid, uid)) = peer(&stream) else {
                continue;
            };
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(REPLY_WITHIN));
            // A message is read once poll says it started; its later parts must follow at once.
            // Without this, a client that sends part 0 of 2 and stops blocks the pool thread, and
            // with it every online grow.
            let _ = stream.set_read_timeout(Some(MESSAGE_PARTS_WITHIN));
            self.conns.insert(
                stream.as_raw_fd(),
                Conn {
                    stream,
                    pid,
                    uid,
                    kind: Kind::New,
                },
            );
        }
    }

    fn serve(&mut self, fd: RawFd) {
        let Some(conn) = self.conns.get(&fd) else {
            return;
        };
        if matches!(conn.kind, Kind::Callback(_)) {
            // The daemon speaks first on callback connections; anything readable here outside a
            // reclaim is a hang-up or noise.
            let mut probe = [0u8; 1];
            use std::io::Read;
            if matches!((&conn.stream).read(&mut probe), Ok(0) | Err(_)) {
                self.drop_conn(fd);
            }
            return;
        }
        match wire::recv(&conn.stream) {
            Ok(Some((msg, _fds))) => {
                let (reply, attach) = self.handle(fd, &msg);
                if let Some(reply) = reply {
                    self.answer(fd, reply);
                }
                if let Some((client, reply_fds)) = attach {
                    self.send_fds(fd, client, reply_fds);
                }
                // Online has its answer; now offline may run again.
                let pids = std::mem::take(&mut self.to_thaw);
                self.reclaimer.thaw(&pids);
                if let Some(([handles, freeze_us, answer_us, total_us], f)) =
                    self.reclaim_log.take()
                {
                    tracing::info!(
                        handles,
                        freeze_us,
                        answer_us,
                        total_us,
                        from_gate = f.from_gate,
                        record_us = f.record_us,
                        gate_us = f.gate_us,
                        disable_us = f.disable_us,
                        drain_us = f.drain_us,
                        queued_us = f.queued_us,
                        round_trip_us = f.round_trip_us,
                        outside_daemon_us = f.outside_daemon_us(),
                        "reclaimed for online"
                    );
                }
            }
            Ok(None) => self.drop_conn(fd),
            Err(valve_vmm::VmmError::Os { source, .. })
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // Mid-message: the connection cannot be resynchronised. Closed, as if the client
                // had hung up (what it held is freed).
                tracing::warn!(
                    pid = conn.pid,
                    "pool client stopped in the middle of a message for {MESSAGE_PARTS_WITHIN:?}: closing its connection"
                );
                self.drop_conn(fd);
            }
            Err(e) => self.answer(
                fd,
                err_reply(PoolErrorCode::BadRequest, format!("bad request: {e}")),
            ),
        }
    }

    fn answer(&mut self, fd: RawFd, reply: Value) {
        if reply.is_null() {
            return; // answered already, with descriptors
        }
        if let Some(c) = self.conns.get(&fd) {
            if wire::send(&c.stream, &reply, &[]).is_err() {
                self.drop_conn(fd);
            }
        }
    }

    /// Sends a reply that carries descriptors of `handles` (grow).
    fn send_fds(&mut self, fd: RawFd, client: ClientId, (reply, handles): (Value, Vec<HandleId>)) {
        let Ok(gpu) = self.ledger.client(client).map(|c| c.gpu) else {
            return;
        };
        let sent = match (self.ledger.fds(gpu, &handles), self.conns.get(&fd)) {
            (Ok(fds), Some(c)) => wire::send_borrowed(&c.stream, &reply, &fds).is_ok(),
            _ => false,
        };
        if !sent {
            self.drop_conn(fd);
        }
    }

    fn drop_conn(&mut self, fd: RawFd) {
        let Some(conn) = self.conns.remove(&fd) else {
            return;
        };
        if let Kind::Control(client) = conn.kind {
            let freed = self.ledger.unregister(client);
            self.tokens.remove(&client);
            if let Some(r) = self.controllers.remove(&client) {
                Self::remember(&mut self.warm, &r);
            }
            tracing::info!(
                pid = conn.pid,
                client,
                freed = freed.len(),
                "pool client gone; its memory is free again"
            );
            let callbacks: Vec<RawFd> = self
                .conns
                .iter()
                .filter(|(_, c)| matches!(c.kind, Kind::Callback(id) if id == client))
                .map(|(&f, _)| f)
                .collect();
            for f in callbacks {
                self.conns.remove(&f);
            }
        }
    }

    /// One request: a reply, or a reply with descriptors to attach (sent by the caller).
    #[allow(clippy::type_complexity)]
    fn handle(
        &mut self,
        fd: RawFd,
        msg: &Value,
    ) -> (Option<Value>, Option<(ClientId, (Value, Vec<HandleId>))>) {
        let conn = &self.conns[&fd];
        let (pid, uid, kind) = (conn.pid, conn.uid, &conn.kind);
        let req = match serde_json::from_value::<PoolRequest>(msg.clone()) {
            Ok(req) => req,
            Err(e) => return (Some(refusal(kind, msg, &e.to_string())), None),
        };
        match (kind, req) {
            (Kind::New, PoolRequest::Register { role, gpu, premap }) => {
                (Some(self.register(fd, pid, role, &gpu, premap)), None)
            }
            (Kind::New, PoolRequest::Attach { client, token }) => {
                (Some(self.attach(fd, pid, client, &token)), None)
            }
            (Kind::New | Kind::Control(_), PoolRequest::Status) => (Some(self.status()), None),
            (Kind::New, PoolRequest::Cap { gpu, offline_mib }) => {
                (Some(self.cap(uid, gpu, offline_mib)), None)
            }
            (Kind::New, PoolRequest::Reclaim { gpu, mib }) => {
                (Some(self.take_back(uid, gpu, mib)), None)
            }
            (Kind::New, _) => (Some(not_registered()), None),
            (Kind::Control(c), PoolRequest::Grow { count }) => {
                let c = *c;
                match self.grow(c, count) {
                    Ok(with_fds) => (None, Some((c, with_fds))),
                    Err(e) => (Some(e), None),
                }
            }
            (Kind::Control(c), PoolRequest::Shrink { handles }) => {
                (Some(self.shrink(*c, &handles)), None)
            }
            (Kind::Control(c), PoolRequest::Usage { used_bytes }) => {
                (Some(self.usage(*c, used_bytes)), None)
            }
            (Kind::Control(_), other) => (Some(unknown_op(other.op())), None),
            (Kind::Callback(_), _) => (None, None),
        }
    }

    /// `cap`: limit what offline may hold on a GPU (`{"op":"cap","gpu":0,"offline_mib":4096}`;
    /// `null` lifts it). Root only: it changes what every offline job gets.
    fn cap(&mut self, uid: u32, gpu: usize, offline_mib: Option<u64>) -> Value {
        if uid != 0 {
            return err_reply(
                PoolErrorCode::NotPermitted,
                "only root may cap the pool (sudo valvectl pool cap ...)",
            );
        }
        let handle_bytes = match self.ledger.handle_bytes(gpu) {
            Ok(b) => b as u64,
            Err(e) => return pool_err(e),
        };
        let cap = offline_mib.map(|mib| ((mib << 20) / handle_bytes.max(1)) as usize);
        match self.ledger.set_offline_cap(gpu, cap) {
            Ok(()) => {
                self.publish_usage_now();
                ok_json(CapReply {
                    gpu,
                    offline_cap_handles: cap,
                    offline_cap_mib: cap.map(|c| (c as u64 * handle_bytes) >> 20),
                })
            }
            Err(e) => pool_err(e),
        }
    }

    /// `reclaim`: take memory back from offline on a GPU now, as an online burst would, and
    /// leave it free (`{"op":"reclaim","gpu":0,"mib":1024}`). Root only: `valve-scheduler
    /// profile-job` measures what a job loses per GiB reclaimed with it.
    fn take_back(&mut self, uid: u32, gpu: usize, mib: u64) -> Value {
        if uid != 0 {
            return err_reply(
                PoolErrorCode::NotPermitted,
                "only root may reclaim from offline (sudo valvectl pool reclaim ...)",
            );
        }
        let handle_bytes = match self.ledger.handle_bytes(gpu) {
            Ok(b) => b as u64,
            Err(e) => return pool_err(e),
        };
        let count = ((mib << 20).div_ceil(handle_bytes.max(1))) as usize;
        let freed = self.reclaim(gpu, count, None).len();
        self.publish_usage_now();
        ok_json(TakeBackReply {
            gpu,
            reclaimed: freed,
            reclaimed_mib: (freed as u64 * handle_bytes) >> 20,
        })
    }

    fn register(
        &mut self,
        fd: RawFd,
        pid: u32,
        role: Role,
        gpu: &GpuRef,
        premap: Option<bool>,
    ) -> Value {
        let Some(gpu) = gpu.index() else {
            return err_reply(
                PoolErrorCode::BadRequest,
                "register needs \"gpu\": the GPU index (e.g. 0)",
            );
        };
        let client = match self.ledger.register(pid, role, gpu, premap.unwrap_or(true)) {
            Ok(c) => c,
            Err(e) => return pool_err(e),
        };
        let token = random_token();
        self.tokens.insert(client, token);
        if let Some(c) = self.conns.get_mut(&fd) {
            c.kind = Kind::Control(client);
        }
        let info = self.ledger.client(client).expect("just registered");
        ok_json(RegisterReply {
            client,
            token: token.to_string(),
            gpu_index: gpu,
            premapped: info.premapped,
            handle_bytes: self.ledger.handle_bytes(gpu).unwrap_or(0),
            pool_capacity_handles: self.ledger.max_handles(gpu).unwrap_or(0),
            gpu_pci: self.ledger.pci_bus_id(gpu),
        })
    }

    fn attach(&mut self, fd: RawFd, pid: u32, client: ClientId, token: &str) -> Value {
        let token = token.parse::<u64>().ok();
        let owner = self.ledger.client(client).map(|c| c.pid).ok();
        if token.is_none() || self.tokens.get(&client) != token.as_ref() || owner != Some(pid) {
            return err_reply(
                PoolErrorCode::NotRegistered,
                "attach refused: wrong client, token or process",
            );
        }
        if let Some(c) = self.conns.get_mut(&fd) {
            c.kind = Kind::Callback(client);
        }
        if let Some(info) = self.ledger.client(client).ok().filter(|c| c.premapped) {
            let (gpu, all) = (
                info.gpu,
                self.ledger.all_handles(info.gpu).unwrap_or_default(),
            );
            return self.attach_reply_with_pool(fd, client, gpu, all);
        }
        ok_json(AttachReply {})
    }

    /// A premapped online client attaching gets every existing handle with the reply.
    fn attach_reply_with_pool(
        &mut self,
        fd: RawFd,
        client: ClientId,
        gpu: usize,
        all: Vec<HandleId>,
    ) -> Value {
        let handles = self.ledger.mark_sent(client, &all);
        let reply = ok_json(PoolHandles::new(handles.clone()));
        let sent = match (self.ledger.fds(gpu, &handles), self.conns.get(&fd)) {
            (Ok(fds), Some(c)) => wire::send_borrowed(&c.stream, &reply, &fds).is_ok(),
            _ => false,
        };
        if !sent {
            self.drop_conn(fd);
        }
        Value::Null // already answered
    }

    /// Sends newly created handles to every premapped online client on `gpu` (but `except`,
    /// which gets them with its own reply) over its callback connection.
    fn announce(&mut self, gpu: usize, created: &[HandleId], except: Option<ClientId>) {
        if created.is_empty() {
            return;
        }
        for client in self.ledger.premapped_clients(gpu) {
            if Some(client) == except {
                continue;
            }
            let Some(fd) = self.callback_of(client) else {
                continue;
            };
            let handles = self.ledger.mark_sent(client, created);
            let msg =
                serde_json::to_value(PoolHandles::new(handles.clone())).expect("events serialise");
            let sent = match (self.ledger.fds(gpu, &handles), self.conns.get(&fd)) {
                (Ok(fds), Some(c)) => wire::send_borrowed(&c.stream, &msg, &fds).is_ok(),
                _ => false,
            };
            if !sent {
                self.drop_conn(fd);
            }
        }
    }

    fn callback_of(&self, client: ClientId) -> Option<RawFd> {
        self.conns
            .iter()
            .find(|(_, c)| matches!(c.kind, Kind::Callback(id) if id == client))
            .map(|(&fd, _)| fd)
    }

    fn shrink(&mut self, client: ClientId, handles: &[HandleId]) -> Value {
        match self.ledger.release(client, handles) {
            Ok(()) => ok_json(ShrinkReply {
                released: handles.len(),
            }),
            Err(e) => pool_err(e),
        }
    }

    fn status(&self) -> Value {
        let clients = self
            .ledger
            .clients()
            .map(|(id, c)| ClientEntry {
                client: id,
                pid: c.pid,
                role: c.role,
                gpu: c.gpu,
                handles: c.held.len(),
                reservation: self.controllers.get(&id).map(reservation_state),
            })
            .collect();
        ok_json(PoolStatus {
            gpus: self.ledger.usage(),
            clients,
            reclaims: self.reclaimer.stats(),
        })
    }
}

/// The refusal of a message that is no valid [`PoolRequest`]: a known op with bad fields is a
/// bad request; an unknown one is refused as unregistered on a new connection (whose first
/// message must be `register` or `attach`), else named.
fn refusal(kind: &Kind, msg: &Value, why: &str) -> Value {
    let op = msg.get("op").and_then(Value::as_str).unwrap_or("");
    if PoolRequest::OPS.contains(&op) {
        return err_reply(
            PoolErrorCode::BadRequest,
            format!("bad `{op}` request: {why}"),
        );
    }
    match kind {
        Kind::New => not_registered(),
        _ => unknown_op(op),
    }
}

fn not_registered() -> Value {
    err_reply(
        PoolErrorCode::NotRegistered,
        "not registered: the first message on a pool connection is `register` (or `attach`)",
    )
}

fn unknown_op(op: &str) -> Value {
    err_reply(
        PoolErrorCode::BadRequest,
        format!("unknown op `{op}`: register, grow, shrink, usage, status"),
    )
}

/// An online client's MIAD state for `status`: what it is asked to hold, its headroom and interval T,
/// how its pressure events compare with the target (the balance is positive when over it), the
/// name it is saved under and whether it started warm.
fn reservation_state(r: &OnlineReservation) -> ReservationState {
    let ctl = &r.ctl;
    ReservationState {
        target_handles: ctl.target_handles(),
        headroom_handles: ctl.headroom_handles(),
        interval_ms: ctl.interval().as_millis() as u64,
        event_rate_per_min: ctl.event_rate_per_min(),
        balance_events: ctl.balance_events(),
        events: ctl.total_events(),
        target_rate_per_min: ctl.config().target_rate_per_min,
        online: r.online.clone(),
        gpu_name: r.gpu.clone(),
        start: r.start.wire(),
    }
}

impl PoolServer {
    /// `grow`: take free memory, reclaim the rest from offline for online, and say which
    /// descriptors travel with the reply (every handle for a client that maps on demand; only
    /// handles it has not been sent yet for a premapped one).
    fn grow(&mut self, client: ClientId, count: usize) -> Result<(Value, Vec<HandleId>), Value> {
        let started = Instant::now();
        let taken = self.ledger.take(client, count).map_err(pool_err)?;
        let mut handles = taken.handles.clone();
        let mut reclaimed = Vec::new();
        if taken.short > 0 {
            let gpu = self.ledger.client(client).map_err(pool_err)?.gpu;
            reclaimed = self.reclaim(gpu, taken.short, Some(client));
            handles.extend(&reclaimed);
        }
        let gpu = self.ledger.client(client).map_err(pool_err)?.gpu;
        self.announce(gpu, &taken.created, Some(client));
        // A client maps each handle once: premapped online clients were sent most of the pool
        // already; offline clients map on demand and are sent every handle again after a shrink.
        let premapped = self.ledger.client(client).map_err(pool_err)?.premapped;
        let with_fds = if premapped {
            self.ledger.mark_sent(client, &handles)
        } else {
            handles.clone()
        };
        let elapsed_us = started.elapsed().as_micros() as u64;
        let reply = ok_json(GrowReply {
            short: count - handles.len(),
            handles,
            fds_for: with_fds.clone(),
            reclaimed: reclaimed.len(),
            elapsed_us,
        });
        if !reclaimed.is_empty() {
            let (freeze_us, answer_us, slowest) = self.reclaim_times;
            self.reclaim_log = Some((
                [reclaimed.len() as u64, freeze_us, answer_us, elapsed_us],
                slowest,
            ));
        }
        Ok((reply, with_fds))
    }

    /// Frees `short` handles on `gpu` from offline processes and gives them to `to` (`None`:
    /// leaves them free). Returns the handles freed.
    fn reclaim(&mut self, gpu: usize, short: usize, to: Option<ClientId>) -> Vec<HandleId> {
        let targets: Vec<Target> = self
            .ledger
            .reclaim_plan(gpu, short)
            .into_iter()
            .map(|(client, count)| Target {
                client,
                pid: self.ledger.client(client).map(|c| c.pid).unwrap_or(0),
                count,
                callback: self
                    .conns
                    .values()
                    .find(|c| matches!(c.kind, Kind::Callback(id) if id == client))
                    .and_then(|c| c.stream.try_clone().ok()),
            })
            .collect();
        let ledger = &self.ledger;
        let outcome = self.reclaimer.run(targets, |client, handles| {
            ledger
                .client(client)
                .is_ok_and(|c| handles.iter().all(|h| c.held.contains(h)))
        });
        self.to_thaw.extend(&outcome.frozen);
        self.reclaim_times = (outcome.freeze_us, outcome.answer_us, outcome.slowest_freeze);
        let mut got = Vec::new();
        for (client, handles) in outcome.returned {
            let moved = match to {
                Some(to) => self.ledger.transfer(client, &handles, to),
                None => self.ledger.release(client, &handles),
            };
            if moved.is_ok() {
                got.extend(handles);
            }
        }
        let mut from_offline = got.len();
        for client in outcome.killed {
            // Its process is dead or dying with its channels still disabled, so its mappings can
            // no longer be used: its handles are free to hand over.
            let freed = self.ledger.unregister(client);
            from_offline += freed.len();
            if to.is_none() {
                got.extend(freed);
            }
            self.tokens.remove(&client);
        }
        self.ledger.note_reclaimed(gpu, from_offline);
        let still = short.saturating_sub(got.len());
        match to {
            Some(to) if still > 0 => {
                if let Ok(t) = self.ledger.take(to, still) {
                    got.extend(t.handles);
                }
            }
            _ => {}
        }
        got
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ledger::tests::ledger;
    use serde_json::json;
    use std::sync::{Arc, Mutex};

    /// Records the freezer's calls; a freeze takes `.1` (a busy daemon).
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<String>>>, Duration);

    impl Log {
        /// The calls so far, once `n` have happened (the thaw follows online's reply, so it
        /// can land just after the reply is read).
        fn take(&self, n: usize) -> Vec<String> {
            let deadline = Instant::now() + Duration::from_secs(2);
            while self.0.lock().unwrap().len() < n && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            std::mem::take(&mut self.0.lock().unwrap())
        }
    }

    impl Freezer for Log {
        fn freeze(&mut self, pid: u32) -> Result<FreezeReport, String> {
            std::thread::sleep(self.1);
            self.0.lock().unwrap().push(format!("freeze {pid}"));
            Ok(FreezeReport::default())
        }
        fn thaw(&mut self, pid: u32) -> Result<(), String> {
            self.0.lock().unwrap().push(format!("thaw {pid}"));
            Ok(())
        }
        fn kill(&mut self, pid: u32) {
            self.0.lock().unwrap().push(format!("kill {pid}"));
        }
    }

    struct Running {
        dir: PathBuf,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
        log: Log,
    }

    impl Drop for Running {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    use std::path::PathBuf;

    /// A pool server over a GPU with `device_mib` of memory, on a socket in a temp dir.
    fn start(device_mib: u64) -> Running {
        start_with(device_mib, Duration::ZERO)
    }

    /// [`start`], with every freeze taking `freeze_delay`.
    fn start_with(device_mib: u64, freeze_delay: Duration) -> Running {
        start_saving(device_mib, freeze_delay, None)
    }

    /// [`start_with`], saving online reservations in `warm` (where every online process is
    /// `label:test-online`).
    fn start_saving(
        device_mib: u64,
        freeze_delay: Duration,
        warm: Option<warm::WarmSettings>,
    ) -> Running {
        let dir = std::env::temp_dir().join(format!(
            "valve-pool-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let listener = wire::listen(&dir.join("pool.sock")).unwrap();
        let log = Log(Arc::default(), freeze_delay);
        let mut server = PoolServer::new(
            ledger(device_mib, 1 << 20),
            listener,
            Box::new(|_: &UnixStream| true),
            Box::new(log.clone()),
            Duration::from_millis(200),
        );
        if let Some(w) = warm {
            server.set_warm_start(WarmStore::open(w, warm::unix_now()).0);
            server.online_name = |_| "label:test-online".into();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::spawn(move || server.run(&s2, Duration::from_millis(5)));
        Running {
            dir,
            stop,
            thread: Some(thread),
            log,
        }
    }

    fn connect(r: &Running) -> UnixStream {
        wire::connect(&r.dir.join("pool.sock")).unwrap()
    }

    fn call(s: &UnixStream, v: Value) -> (Value, usize) {
        wire::send(s, &v, &[]).unwrap();
        let (reply, fds) = wire::recv(s).unwrap().unwrap();
        (reply, fds.len())
    }

    fn register(r: &Running, role: &str) -> (UnixStream, u64, String) {
        let s = connect(r);
        let (reply, _) = call(&s, json!({"op": "register", "role": role, "gpu": 0}));
        assert_eq!(reply["ok"], true, "{reply}");
        let token = reply["token"].as_str().unwrap().to_string();
        (s, reply["client"].as_u64().unwrap(), token)
    }

    #[test]
    fn root_caps_offline_and_others_may_not() {
        let r = start(64 * 11);
        let admin = connect(&r);
        let (reply, _) = call(&admin, json!({"op": "cap", "gpu": 0, "offline_mib": 128}));
        assert_eq!(
            (reply["ok"].clone(), reply["offline_cap_handles"].clone()),
            (json!(true), json!(2)),
            "{reply}"
        );
        let (off, _, _) = register(&r, "offline");
        assert_eq!(call(&off, json!({"op": "grow", "count": 3})).0["code"], 12);
        assert_eq!(call(&off, json!({"op": "grow", "count": 2})).0["ok"], true);
        let (st, _) = call(&connect(&r), json!({"op": "status"}));
        assert_eq!(st["gpus"][0]["offline_cap"], 2);
        let (reply, _) = call(
            &connect(&r),
            json!({"op": "cap", "gpu": 0, "offline_mib": null}),
        );
        assert_eq!(reply["offline_cap_handles"], Value::Null);
        assert_eq!(
            call(
                &connect(&r),
                json!({"op": "cap", "gpu": 9, "offline_mib": 1})
            )
            .0["code"],
            6
        );
        assert_eq!(
            call(&connect(&r), json!({"op": "cap", "offline_mib": 1})).0["code"],
            2
        );
        assert_eq!(
            call(&off, json!({"op": "cap", "gpu": 0})).0["code"],
            2,
            "not on a client's connection"
        );
    }

    #[test]
    fn only_root_may_cap_or_reclaim() {
        let sock = std::env::temp_dir().join(format!("valve-cap-{}.sock", std::process::id()));
        let mut server = PoolServer::new(
            ledger(64 * 11, 1 << 20),
            wire::listen(
                &std::env::temp_dir().join(format!("valve-cap-{}.sock", std::process::id())),
            )
            .unwrap(),
            Box::new(|_: &UnixStream| true),
            Box::new(Log::default()),
            Duration::from_millis(200),
        );
        let reply = server.cap(1000, 0, Some(64));
        assert!(
            reply["error"].as_str().unwrap().contains("only root"),
            "{reply}"
        );
        assert_eq!(server.ledger.usage()[0].offline_cap, None);
        let reply = server.take_back(1000, 0, 64);
        assert!(
            reply["error"].as_str().unwrap().contains("only root"),
            "{reply}"
        );
        let _ = std::fs::remove_file(sock);
    }

    #[test]
    fn register_grow_shrink_and_status() {
        let r = start(64 * 11);
        let (off, _, _) = register(&r, "offline");
        let (reply, fds) = call(&off, json!({"op": "grow", "count": 4}));
        assert_eq!(
            (reply["handles"].as_array().unwrap().len(), fds),
            (4, 4),
            "{reply}"
        );
        let (reply, _) = call(&off, json!({"op": "shrink", "handles": [0, 1]}));
        assert_eq!(reply["released"], 2);
        let (reply, _) = call(&off, json!({"op": "shrink", "handles": [0]}));
        assert_eq!(reply["code"], 14, "{reply}");
        let (st, _) = call(&off, json!({"op": "status"}));
        assert_eq!(st["gpus"][0]["offline"], 2, "{st}");
        assert_eq!(st["gpus"][0]["free"], 2);
    }

    #[test]
    fn bad_requests_get_named_errors_and_change_nothing() {
        let r = start(1024);
        let s = connect(&r);
        assert_eq!(call(&s, json!({"op": "grow", "count": 1})).0["code"], 13);
        assert_eq!(
            call(&s, json!({"op": "status"})).0["ok"],
            true,
            "status needs no registration"
        );
        assert_eq!(
            call(&s, json!({"op": "register", "role": "boss", "gpu": 0})).0["code"],
            2
        );
        assert_eq!(
            call(&s, json!({"op": "register", "role": "online", "gpu": 7})).0["code"],
            6
        );
        valve_vmm::fdpass::send(&s, b"{not json", &[]).unwrap();
        let (reply, _) = wire::recv(&s).unwrap().unwrap();
        assert_eq!(reply["code"], 2, "{reply}");
        let (reply, _) = call(&s, json!({"op": "register", "role": "online", "gpu": 0}));
        assert_eq!(
            reply["ok"], true,
            "the connection survives bad input: {reply}"
        );
        assert_eq!(
            call(&s, json!({"op": "grow", "count": 1_000_000})).0["code"],
            11
        );
        assert_eq!(call(&s, json!({"op": "launch"})).0["code"], 2);
        let other = connect(&r);
        let bad = json!({"op": "attach", "client": reply["client"], "token": "12345"});
        assert_eq!(call(&other, bad).0["code"], 13, "a wrong token is refused");
    }

    /// A new client whose `status` is answered within `bound`, whatever another client does.
    fn served_within(r: &Running, bound: Duration) -> UnixStream {
        let other = connect(r);
        other
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let t0 = Instant::now();
        assert_eq!(call(&other, json!({"op": "status"})).0["ok"], true);
        assert!(
            t0.elapsed() < bound,
            "another client waited {:?} behind the misbehaving one",
            t0.elapsed()
        );
        other
    }

    #[test]
    fn a_client_that_stops_mid_message_is_closed_and_blocks_no_one() {
        let r = start(1024);
        let (stalled, _, _) = register(&r, "online");
        // Part 0 of 2, then nothing: the pool must not wait for part 1.
        valve_vmm::fdpass::send(&stalled, br#"{"op":"status","part":0,"parts":2}"#, &[]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let other = served_within(&r, MESSAGE_PARTS_WITHIN * 4);
        stalled
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert!(
            matches!(wire::recv(&stalled), Ok(None)),
            "the stalled connection is closed"
        );
        // Closed as a hang-up: its registration is gone.
        let (status, _) = call(&other, json!({"op": "status"}));
        assert!(status["clients"].as_array().unwrap().is_empty(), "{status}");
    }

    #[test]
    fn a_client_that_never_reads_its_replies_is_closed_and_blocks_no_one() {
        let r = start(1024);
        let (flood, _, _) = register(&r, "online");
        let sender = flood.try_clone().unwrap();
        // Requests without reading a reply: the replies fill the socket, and the pool's write
        // blocks until it gives up on the client.
        let spam = std::thread::spawn(move || {
            for _ in 0..200_000 {
                if wire::send(&sender, &json!({"op": "status"}), &[]).is_err() {
                    return true; // closed by the pool
                }
            }
            false
        });
        std::thread::sleep(Duration::from_millis(300));
        let other = served_within(&r, REPLY_WITHIN * 4);
        assert!(spam.join().unwrap(), "the flooding connection is closed");
        let (status, _) = call(&other, json!({"op": "status"}));
        assert!(status["clients"].as_array().unwrap().is_empty(), "{status}");
    }

    #[test]
    fn a_closed_connection_frees_what_the_process_held() {
        let r = start(64 * 11);
        let (off, _, _) = register(&r, "offline");
        assert_eq!(call(&off, json!({"op": "grow", "count": 10})).1, 10);
        drop(off);
        let (on, _, _) = register(&r, "online");
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let (st, _) = call(&on, json!({"op": "status"}));
            if st["gpus"][0]["free"] == 10 {
                break;
            }
            assert!(Instant::now() < deadline, "memory never came back: {st}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// An offline client's callback side: answers each reclaim with the first handles it holds,
    /// or (if `silent`) never answers.
    /// An offline client that takes all 10 handles and answers reclaims at once; keep the
    /// returned connection open (closing it unregisters the client).
    fn offline_holding_all(r: &Running) -> UnixStream {
        let (off, off_id, token) = register(r, "offline");
        let (reply, _) = call(&off, json!({"op": "grow", "count": 10}));
        let held: Vec<u64> = reply["handles"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        offline_callback(r, off_id, &token, held, false);
        off
    }

    fn offline_callback(r: &Running, client: u64, token: &str, held: Vec<u64>, silent: bool) {
        let cb = connect(r);
        let (reply, _) = call(
            &cb,
            json!({"op": "attach", "client": client, "token": token}),
        );
        assert_eq!(reply["ok"], true, "{reply}");
        std::thread::spawn(move || {
            while let Ok(Some((req, _))) = wire::recv(&cb) {
                if silent {
                    continue;
                }
                let k = req["count"].as_u64().unwrap() as usize;
                let give: Vec<u64> = held[..k].to_vec();
                let answer = json!({"rid": req["rid"], "ok": true, "handles": give});
                wire::send(&cb, &answer, &[]).unwrap();
            }
        });
    }

    #[test]
    fn root_takes_memory_back_from_offline_and_leaves_it_free() {
        let r = start(64 * 11); // 10 handles
        let _off = offline_holding_all(&r);
        let (reply, _) = call(&connect(&r), json!({"op": "reclaim", "gpu": 0, "mib": 100}));
        assert_eq!(
            (reply["reclaimed"].as_u64(), reply["reclaimed_mib"].as_u64()),
            (Some(2), Some(128)),
            "100 MiB is two 64 MiB handles: {reply}"
        );
        let me = std::process::id();
        assert_eq!(
            r.log.take(2),
            vec![format!("freeze {me}"), format!("thaw {me}")]
        );
        let (st, _) = call(&connect(&r), json!({"op": "status"}));
        let g = &st["gpus"][0];
        assert_eq!(
            (g["offline"].as_u64(), g["free"].as_u64()),
            (Some(8), Some(2)),
            "{st}"
        );
        assert_eq!(g["reclaimed_total"], 2, "the harvest profile reads this");
        let bad = call(&connect(&r), json!({"op": "reclaim", "gpu": 0})).0;
        assert_eq!(bad["code"], 2, "{bad}");
        let none = call(&connect(&r), json!({"op": "reclaim", "gpu": 7, "mib": 1})).0;
        assert_eq!(none["code"], 6, "{none}");
    }

    #[test]
    fn online_grows_into_offline_memory_with_offline_frozen_around_the_swap() {
        let r = start(64 * 11); // 10 handles
        let off = offline_holding_all(&r);
        let (on, on_id, on_token) = register(&r, "online");
        let on_cb = connect(&r);
        let (attached, fds) = call(
            &on_cb,
            json!({"op": "attach", "client": on_id, "token": on_token}),
        );
        assert_eq!(
            (attached["event"].as_str(), fds),
            (Some("pool_handles"), 10),
            "premapped online maps the whole pool: {attached}"
        );
        let (reply, fds) = call(&on, json!({"op": "grow", "count": 3}));
        assert_eq!(reply["handles"], json!([0, 1, 2]), "{reply}");
        assert_eq!(
            (reply["reclaimed"].as_u64(), fds),
            (Some(3), 0),
            "it has every descriptor already"
        );
        let me = std::process::id();
        assert_eq!(
            r.log.take(2),
            vec![format!("freeze {me}"), format!("thaw {me}")]
        );
        let (st, _) = call(&on, json!({"op": "status"}));
        assert_eq!(
            (
                st["gpus"][0]["online"].as_u64(),
                st["gpus"][0]["offline"].as_u64(),
                st["gpus"][0]["reclaimed_total"].as_u64()
            ),
            (Some(3), Some(7), Some(3)),
            "{st}"
        );
        assert_eq!(
            call(&off, json!({"op": "shrink", "handles": [0]})).0["code"],
            14,
            "offline no longer holds it"
        );
    }

    #[test]
    fn new_handles_are_announced_to_premapped_online_clients() {
        let r = start(64 * 11);
        let (on, on_id, token) = register(&r, "online");
        let cb = connect(&r);
        let (attached, fds) = call(
            &cb,
            json!({"op": "attach", "client": on_id, "token": token}),
        );
        assert_eq!((attached["handles"].clone(), fds), (json!([]), 0));
        let (off, _, _) = register(&r, "offline");
        assert_eq!(call(&off, json!({"op": "grow", "count": 4})).1, 4);
        let (event, fds) = wire::recv(&cb).unwrap().unwrap();
        assert_eq!(
            (event["handles"].clone(), fds.len()),
            (json!([0, 1, 2, 3]), 4),
            "{event}"
        );
        let (reply, fds) = call(&on, json!({"op": "grow", "count": 2}));
        assert_eq!(
            (reply["handles"].clone(), fds),
            (json!([4, 5]), 2),
            "created for online: sent with the reply"
        );
    }

    #[test]
    fn usage_feeds_online_reservation_and_is_refused_for_offline() {
        let r = start(4096);
        let (on, _, _) = register(&r, "online");
        call(&on, json!({"op": "grow", "count": 2}));
        // 120 of 128 MiB used: over 90% of what is mapped, so a pressure event.
        let (reply, _) = call(&on, json!({"op": "usage", "used_bytes": 120u64 << 20}));
        assert_eq!(reply["pressure"], true, "{reply}");
        assert!(
            reply["target_handles"].as_u64().unwrap() > 2,
            "headroom above use: {reply}"
        );
        let status = call(&on, json!({"op": "status"})).0;
        let miad = &status["clients"][0]["reservation"];
        assert_eq!(
            miad["events"], 0,
            "the pool has spare memory for the growth: no reclamation, no event: {status}"
        );
        assert_eq!(miad["target_handles"], reply["target_handles"], "{status}");
        assert!(miad["interval_ms"].as_u64().unwrap() > 0, "{status}");
        let (off, _, _) = register(&r, "offline");
        assert_eq!(
            call(&off, json!({"op": "usage", "used_bytes": 1})).0["code"],
            15
        );
        let status = call(&on, json!({"op": "status"})).0;
        assert!(
            status["clients"][1].get("reservation").is_none(),
            "offline has no reservation: {status}"
        );
        assert_eq!(call(&on, json!({"op": "usage"})).0["code"], 2);
    }

    #[test]
    fn a_pressure_event_counts_toward_the_rate_only_when_its_growth_must_reclaim() {
        let r = start(64 * 11);
        let (on, _, _) = register(&r, "online");
        call(&on, json!({"op": "grow", "count": 1}));
        let (off, _, _) = register(&r, "offline");
        let (reply, _) = call(&off, json!({"op": "grow", "count": 9}));
        assert_eq!(
            reply["handles"].as_array().map(Vec::len),
            Some(9),
            "{reply}"
        );
        // Online uses its whole handle; the pool has nothing spare: the growth must reclaim.
        let (reply, _) = call(&on, json!({"op": "usage", "used_bytes": 64u64 << 20}));
        assert_eq!(reply["pressure"], true, "{reply}");
        let status = call(&on, json!({"op": "status"})).0;
        assert_eq!(status["clients"][0]["reservation"]["events"], 1, "{status}");
    }

    #[test]
    fn an_offline_process_that_does_not_answer_is_killed_and_its_memory_goes_to_online() {
        let r = start(64 * 11);
        let (off, off_id, token) = register(&r, "offline");
        call(&off, json!({"op": "grow", "count": 10}));
        offline_callback(&r, off_id, &token, Vec::new(), true);
        let (on, _, _) = register(&r, "online");
        let t = Instant::now();
        let (reply, _) = call(&on, json!({"op": "grow", "count": 2}));
        // The deadline is 200 ms; poll's millisecond rounding may end it a fraction early.
        assert!(
            t.elapsed() >= Duration::from_millis(190),
            "returned before the deadline: {:?}",
            t.elapsed()
        );
        assert_eq!(reply["handles"].as_array().unwrap().len(), 2, "{reply}");
        let me = std::process::id();
        assert_eq!(
            r.log.take(3),
            vec![
                format!("freeze {me}"),
                format!("kill {me}"),
                format!("thaw {me}")
            ]
        );
        let (st, _) = call(&on, json!({"op": "status"}));
        assert_eq!(st["reclaims"]["killed"], 1);
        let kill = &st["reclaims"]["last_kill"];
        assert_eq!(
            (kill["pid"].as_u64(), &kill["answered"]),
            (Some(me as u64), &json!(false)),
            "{st}"
        );
        let threads = kill["threads"].as_str().unwrap_or("");
        assert!(
            threads.starts_with(&format!("{me} ")),
            "the killed process's own threads, main first: {threads}"
        );
        assert_eq!(
            st["gpus"][0]["offline"], 0,
            "the killed process holds nothing: {st}"
        );
    }

    #[test]
    fn a_slow_freeze_does_not_count_against_offline_s_deadline() {
        // The daemon takes 300 ms to freeze (busy), longer than the 200 ms deadline; offline then
        // answers at once and must not be killed for the daemon's delay.
        let r = start_with(64 * 11, Duration::from_millis(300));
        let _off = offline_holding_all(&r);
        let (on, _, _) = register(&r, "online");
        let (reply, _) = call(&on, json!({"op": "grow", "count": 2}));
        assert_eq!(reply["reclaimed"], 2, "{reply}");
        let me = std::process::id();
        assert_eq!(
            r.log.take(2),
            vec![format!("freeze {me}"), format!("thaw {me}")]
        );
        let (st, _) = call(&on, json!({"op": "status"}));
        assert_eq!(st["reclaims"]["killed"], 0, "{st}");
    }

    /// One life of a pool that saves reservations in `warm`: online registers, holds 2 handles
    /// and reports 120 MiB used. Returns the usage reply and the status; the pool then stops.
    fn one_pool_life(warm: &warm::WarmSettings) -> (Value, Value) {
        let r = start_saving(64 * 11, Duration::ZERO, Some(warm.clone()));
        let (on, _, _) = register(&r, "online");
        call(&on, json!({"op": "grow", "count": 2}));
        let (reply, _) = call(&on, json!({"op": "usage", "used_bytes": 120u64 << 20}));
        let (status, _) = call(&on, json!({"op": "status"}));
        drop(r); // a clean shutdown: the reservation is saved
        (reply, status["clients"][0]["reservation"].clone())
    }

    #[test]
    fn an_online_reservation_starts_warm_from_what_the_last_pool_saved() {
        let dir = tempfile::tempdir().unwrap();
        let warm = warm::WarmSettings {
            path: dir.path().join("reservations.json"),
            max_age: warm::DEFAULT_MAX_AGE,
        };
        let (first, miad) = one_pool_life(&warm);
        assert_eq!(first["pressure"], true, "{first}");
        let start = &miad["start"];
        assert_eq!(start["warm"], false, "{miad}");
        let why = start["why"].as_str().unwrap();
        assert!(
            why.starts_with("nothing saved for label:test-online on GPU index 0"),
            "{why}"
        );
        assert_eq!(miad["online"], "label:test-online");
        // The next daemon: the same online process starts where the last one stood.
        let (again, miad) = one_pool_life(&warm);
        assert_eq!(miad["start"]["warm"], true, "{miad}");
        assert_eq!(miad["start"]["from"], warm.path.display().to_string());
        assert_eq!(miad["start"]["adjusted"], json!([]));
        assert_eq!(
            (again["target_handles"].clone(), again["pressure"].clone()),
            (first["target_handles"].clone(), json!(false)),
            "asks at once for what it had learned, without a new pressure event: {again}"
        );
        assert_eq!(again["headroom_handles"], first["headroom_handles"]);
        // A corrupted file: a warning, and a cold start.
        std::fs::write(&warm.path, "{\"version\": 1, \"reserv").unwrap();
        let (_, miad) = one_pool_life(&warm);
        assert_eq!(miad["start"]["warm"], false, "{miad}");
        let aside = dir.path().join("reservations.json.bad");
        assert!(aside.exists(), "the bad file is kept for inspection");
    }
}
