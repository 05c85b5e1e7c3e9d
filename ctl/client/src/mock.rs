//! A mock of the daemon's pool for tests: a listening SOCK_SEQPACKET socket in a temp dir that
//! speaks `docs/memory.md`'s protocol, with memfds named `pool-<id>` standing in for GPU memory.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{json, Value};
use valve_vmm::wire;

/// An anonymous file named `name` (its /proc link reads `/memfd:<name> (deleted)`).
pub(crate) fn memfd(name: &str) -> OwnedFd {
    let c = CString::new(name).unwrap();
    // SAFETY: `c` is a valid NUL-terminated name; memfd_create returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create failed");
    // SAFETY: the descriptor was just created and nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// How the mock behaves.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub handle_bytes: u64,
    pub max_handles: usize,
    /// Send `pool_capacity_handles` in the register reply.
    pub send_capacity: bool,
    /// Refuse every `attach` as a wrong token.
    pub refuse_attach: bool,
    /// Like the daemon (`ctl/daemon/src/memory/server.rs`): a premapped client gets the pool's
    /// handles with the attach reply and new ones with its grow reply (`fds_for`), others get
    /// `{"event": "pool_handles"}`. `false`: the literal reading of docs/memory.md, where every
    /// premapped client gets `{"op": "pool_handles"}` events on the callback connection, after
    /// the attach and grow replies.
    pub fds_in_replies: bool,
    /// Send `pool_handles` events at all (false: a daemon that never delivers).
    pub announce: bool,
    /// Races a single-threaded daemon can produce (once each): reclaim this many handles from
    /// an offline client right after its grow reply, or before processing its shrink.
    pub reclaim_after_grow: usize,
    pub reclaim_before_shrink: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            handle_bytes: 8 << 20,
            max_handles: 8,
            send_capacity: true,
            refuse_attach: false,
            fds_in_replies: true,
            announce: true,
            reclaim_after_grow: 0,
            reclaim_before_shrink: 0,
        }
    }
}

struct MockClient {
    role: String,
    premap: bool,
    control: UnixStream,
    callback: Option<UnixStream>,
}

struct State {
    cfg: Config,
    /// Per handle: its memory and its holder.
    handles: Vec<(OwnedFd, Option<u64>)>,
    clients: BTreeMap<u64, MockClient>,
    next_client: u64,
    next_rid: u64,
    log: Vec<Value>,
}

type Reply = (Value, Vec<u32>);

/// The running mock.
pub(crate) struct Mock {
    pub path: PathBuf,
    dir: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

static DIRS: AtomicUsize = AtomicUsize::new(0);

impl Mock {
    pub fn start(cfg: Config) -> Mock {
        let n = DIRS.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("valve-client-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool.sock");
        let listener = wire::listen(&path).unwrap();
        let state = Arc::new(Mutex::new(State {
            cfg,
            handles: Vec::new(),
            clients: BTreeMap::new(),
            next_client: 0,
            next_rid: 0,
            log: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, stp) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                if stp.load(Ordering::SeqCst) {
                    break;
                }
                let st = st.clone();
                std::thread::spawn(move || serve(conn, st));
            }
        });
        Mock {
            path,
            dir,
            state,
            stop,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ids of registered clients with `role`.
    pub fn clients(&self, role: &str) -> Vec<u64> {
        let st = self.lock();
        st.clients
            .iter()
            .filter(|(_, c)| c.role == role)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Handles `client` holds.
    pub fn held(&self, client: u64) -> Vec<u32> {
        held(&self.lock(), client)
    }

    /// Every request the mock received, in order.
    pub fn log(&self) -> Vec<Value> {
        self.lock().log.clone()
    }

    /// Asks `client` for `count` handles over its callback connection, as the daemon's reclaim
    /// does, and frees the handles it names. Returns its reply.
    pub fn reclaim(&self, client: u64, count: usize) -> Value {
        reclaim(&self.state, client, count)
    }

    /// Sends a raw message on `client`'s callback connection and returns the reply, if any.
    pub fn callback_call(&self, client: u64, msg: &Value, want_reply: bool) -> Option<Value> {
        let cb = self.lock().clients[&client]
            .callback
            .as_ref()
            .unwrap()
            .try_clone()
            .unwrap();
        wire::send(&cb, msg, &[]).unwrap();
        want_reply.then(|| wire::recv(&cb).unwrap().unwrap().0)
    }

    /// The daemon drops `client`: both connections are shut down, its handles freed.
    pub fn kick(&self, client: u64) {
        let mut st = self.lock();
        if let Some(c) = st.clients.remove(&client) {
            let _ = c.control.shutdown(std::net::Shutdown::Both);
            if let Some(cb) = c.callback {
                let _ = cb.shutdown(std::net::Shutdown::Both);
            }
        }
        free_all(&mut st, client);
    }

    /// The daemon forgets `client` (as after a restart) but keeps its connections open.
    pub fn forget(&self, client: u64) {
        let mut st = self.lock();
        st.clients.remove(&client);
        free_all(&mut st, client);
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = crate::conn::connect(&self.path);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn held(st: &State, client: u64) -> Vec<u32> {
    (0..st.handles.len() as u32)
        .filter(|&h| st.handles[h as usize].1 == Some(client))
        .collect()
}

fn free_all(st: &mut State, client: u64) {
    for h in st.handles.iter_mut().filter(|h| h.1 == Some(client)) {
        h.1 = None;
    }
}

fn refuse(code: i32, error: &str) -> Reply {
    (
        json!({"ok": false, "code": code, "error": error}),
        Vec::new(),
    )
}

fn send(sock: &UnixStream, st: &State, reply: &Value, fd_ids: &[u32]) {
    let fds: Vec<BorrowedFd> = fd_ids
        .iter()
        .map(|&h| st.handles[h as usize].0.as_fd())
        .collect();
    let _ = wire::send_borrowed(sock, reply, &fds);
}

/// One connection: `register` makes it a control connection, `attach` a callback one.
fn serve(sock: UnixStream, state: Arc<Mutex<State>>) {
    let mut me: Option<u64> = None;
    while let Ok(Some((msg, _fds))) = wire::recv(&sock) {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        st.log.push(msg.clone());
        let op = msg["op"].as_str().unwrap_or("").to_string();
        if op == "attach" && me.is_none() {
            attach(&mut st, &sock, &msg);
            return;
        }
        let (reply, fd_ids) = match (op.as_str(), me) {
            ("register", None) => register(&mut st, &sock, &msg, &mut me),
            (_, None) => refuse(13, "not registered: send `register` first"),
            (_, Some(id)) if !st.clients.contains_key(&id) => {
                refuse(13, "client unknown (the daemon restarted?): register again")
            }
            ("grow", Some(id)) => {
                let after = std::mem::take(&mut st.cfg.reclaim_after_grow);
                drop(st);
                let count = msg["count"].as_u64().unwrap_or(0) as usize;
                grow(&state, &sock, id, count);
                if after > 0 {
                    reclaim(&state, id, after);
                }
                continue;
            }
            ("shrink", Some(id)) if st.cfg.reclaim_before_shrink > 0 => {
                let before = std::mem::take(&mut st.cfg.reclaim_before_shrink);
                drop(st);
                reclaim(&state, id, before);
                st = state.lock().unwrap_or_else(|e| e.into_inner());
                shrink(&mut st, id, &msg)
            }
            ("shrink", Some(id)) => shrink(&mut st, id, &msg),
            ("usage", Some(id)) => usage(&st, id, &msg),
            ("status", Some(_)) => (json!({"ok": true, "handles": st.handles.len()}), vec![]),
            (op, Some(_)) => refuse(2, &format!("unknown op {op:?}")),
        };
        send(&sock, &st, &reply, &fd_ids);
    }
    if let Some(id) = me {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        st.clients.remove(&id);
        free_all(&mut st, id);
    }
}

fn register(st: &mut State, sock: &UnixStream, msg: &Value, me: &mut Option<u64>) -> Reply {
    let role = msg["role"].as_str().unwrap_or("").to_string();
    if role != "online" && role != "offline" {
        return refuse(2, "role must be online or offline");
    }
    st.next_client += 1;
    let id = st.next_client;
    let premap = role == "online" && msg["premap"] != false;
    let control = sock.try_clone().unwrap();
    st.clients.insert(
        id,
        MockClient {
            role,
            premap,
            control,
            callback: None,
        },
    );
    *me = Some(id);
    let mut reply = json!({"ok": true, "client": id, "token": format!("tok-{id}"),
        "handle_bytes": st.cfg.handle_bytes, "gpu_index": 0});
    if st.cfg.send_capacity {
        reply["pool_capacity_handles"] = st.cfg.max_handles.into();
    }
    (reply, vec![])
}

fn attach(st: &mut State, sock: &UnixStream, msg: &Value) {
    let id = msg["client"].as_u64().unwrap_or(0);
    let good = msg["token"] == format!("tok-{id}")
        && !st.cfg.refuse_attach
        && st.clients.contains_key(&id);
    if !good {
        let r = json!({"ok": false, "code": 13, "error": "wrong token for this client"});
        send(sock, st, &r, &[]);
        return;
    }
    let client = st.clients.get_mut(&id).unwrap();
    client.callback = Some(sock.try_clone().unwrap());
    let all: Vec<u32> = (0..st.handles.len() as u32).collect();
    match (st.clients[&id].premap, st.cfg.fds_in_replies) {
        (true, true) => {
            let r = json!({"ok": true, "event": "pool_handles", "handles": all});
            send(sock, st, &r, &all);
        }
        (true, false) => {
            send(sock, st, &json!({"ok": true}), &[]);
            send(
                sock,
                st,
                &json!({"op": "pool_handles", "handles": all}),
                &all,
            );
        }
        (false, _) => send(sock, st, &json!({"ok": true}), &[]),
    }
}
fn grow(state: &Arc<Mutex<State>>, sock: &UnixStream, id: u64, count: usize) {
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    let online = st.clients[&id].role == "online";
    if count + held(&st, id).len() > st.cfg.max_handles {
        let r = refuse(
            11,
            &format!(
                "{count} handles is more than GPU 0 holds ({} handles)",
                st.cfg.max_handles
            ),
        );
        return send(sock, &st, &r.0, &[]);
    }
    let free = st.handles.iter().filter(|h| h.1.is_none()).count();
    let room = free + st.cfg.max_handles - st.handles.len();
    if room < count && !online {
        let r = refuse(
            12,
            &format!("the pool on GPU 0 has {room} free handle(s), {count} asked"),
        );
        return send(sock, &st, &r.0, &[]);
    }
    let mut reclaimed = 0;
    if room < count {
        let victims: Vec<u64> = st
            .clients
            .iter()
            .filter(|(_, c)| c.role == "offline")
            .map(|(&v, _)| v)
            .collect();
        drop(st);
        let mut short = count - room;
        for v in victims {
            let got = reclaim(state, v, short)["handles"]
                .as_array()
                .map_or(0, Vec::len);
            short = short.saturating_sub(got);
            reclaimed += got;
        }
        st = state.lock().unwrap_or_else(|e| e.into_inner());
    }
    let mut ids: Vec<u32> = (0..st.handles.len() as u32)
        .filter(|&h| st.handles[h as usize].1.is_none())
        .take(count)
        .collect();
    let mut created = Vec::new();
    while ids.len() < count && st.handles.len() < st.cfg.max_handles {
        let h = st.handles.len() as u32;
        st.handles.push((memfd(&format!("pool-{h}")), None));
        ids.push(h);
        created.push(h);
    }
    for &h in &ids {
        st.handles[h as usize].1 = Some(id);
    }
    reply_and_announce(&st, sock, id, &ids, &created, reclaimed);
}

/// The grow reply, and `pool_handles` for the premapped clients that do not get them with it.
fn reply_and_announce(
    st: &State,
    sock: &UnixStream,
    id: u64,
    ids: &[u32],
    created: &[u32],
    reclaimed: usize,
) {
    let premap = st.clients[&id].premap;
    let inline = st.cfg.fds_in_replies;
    // What the growing client's reply carries descriptors for.
    let fds_for = match (premap, inline) {
        (false, _) => ids.to_vec(),
        (true, true) => created.to_vec(),
        (true, false) => Vec::new(),
    };
    let mut reply = json!({"ok": true, "handles": ids, "reclaimed": reclaimed});
    if inline || !premap {
        reply["fds_for"] = json!(fds_for);
    }
    send(sock, st, &reply, &fds_for);
    let key = if inline { "event" } else { "op" };
    for (&c, client) in st.clients.iter().filter(|(_, c)| c.premap) {
        let skip = created.is_empty() || (inline && c == id) || !st.cfg.announce;
        if let (Some(cb), false) = (&client.callback, skip) {
            let event = json!({key: "pool_handles", "handles": created});
            send(cb, st, &event, created);
        }
    }
}

fn shrink(st: &mut State, id: u64, msg: &Value) -> Reply {
    let ids: Vec<u32> = msg["handles"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|h| h.as_u64())
        .map(|h| h as u32)
        .collect();
    if let Some(h) = ids
        .iter()
        .find(|&&h| st.handles.get(h as usize).is_none_or(|e| e.1 != Some(id)))
    {
        return refuse(14, &format!("handle {h} is not held by this client"));
    }
    for &h in &ids {
        st.handles[h as usize].1 = None;
    }
    (json!({"ok": true, "released": ids.len()}), vec![])
}

fn usage(st: &State, id: u64, msg: &Value) -> Reply {
    if st.clients[&id].role != "online" {
        return refuse(15, "usage is for online clients");
    }
    let used = msg["used_bytes"].as_u64().unwrap_or(0);
    (
        json!({"ok": true, "target_handles": used.div_ceil(st.cfg.handle_bytes) + 1}),
        vec![],
    )
}

fn reclaim(state: &Arc<Mutex<State>>, client: u64, count: usize) -> Value {
    let (cb, rid) = {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        st.next_rid += 1;
        let cb = st.clients[&client]
            .callback
            .as_ref()
            .expect("attached")
            .try_clone()
            .unwrap();
        (cb, st.next_rid)
    };
    wire::send(
        &cb,
        &json!({"op": "reclaim", "rid": rid, "count": count}),
        &[],
    )
    .unwrap();
    let reply = wire::recv(&cb).unwrap().expect("the client answers").0;
    assert_eq!(reply["rid"], rid);
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    for h in reply["handles"].as_array().into_iter().flatten() {
        let h = h.as_u64().unwrap() as usize;
        assert_eq!(
            st.handles[h].1,
            Some(client),
            "the client gave back a handle it did not hold"
        );
        st.handles[h].1 = None;
    }
    reply
}
