//! The memory pool beside the loop, for the queueing tests and the bench: a pool thread over
//! fake memory, and online and offline clients of it.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};
use valve_vmm::wire;

use crate::memory::ledger::tests::ledger;
use crate::memory::reclaim::Freezer;
use crate::memory::server::PoolServer;

/// The pool on its own thread until `stop`: `handles` handles of 64 MiB on GPU 0, at
/// `dir/pool.sock`, freezing with `freezer`, offline's deadline 10 s (no kill on a slow box).
pub(crate) fn spawn_pool(
    dir: &Path,
    handles: u64,
    stop: &Arc<AtomicBool>,
    freezer: Box<dyn Freezer>,
) -> JoinHandle<()> {
    let listener = wire::listen(&dir.join("pool.sock")).unwrap();
    let mut server = PoolServer::new(
        ledger(64 * (handles + 1), 1 << 20),
        listener,
        Box::new(|_: &UnixStream| true),
        freezer,
        Duration::from_secs(10),
    );
    let stop = stop.clone();
    std::thread::spawn(move || server.run(&stop, Duration::from_millis(5)))
}

/// One request on a pool connection, its reply (descriptors closed).
pub(crate) fn call(s: &UnixStream, v: Value) -> Value {
    wire::send(s, &v, &[]).unwrap();
    wire::recv(s).unwrap().unwrap().0
}

/// The handle ids in a reply's list.
pub(crate) fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

/// Registers an offline client (this process) that takes `handles` handles and gives back what
/// each reclaim asks for at once. Returns its control connection (keep it: closing it
/// unregisters) and what it holds.
pub(crate) fn offline_client(pool: &Path, handles: u64) -> (UnixStream, Arc<Mutex<Vec<u64>>>) {
    let off = wire::connect(pool).unwrap();
    let reg = call(&off, json!({"op": "register", "role": "offline", "gpu": 0}));
    let grown = call(&off, json!({"op": "grow", "count": handles}));
    let held = Arc::new(Mutex::new(ids(&grown["handles"])));
    assert_eq!(held.lock().unwrap().len() as u64, handles, "{grown}");
    let cb = wire::connect(pool).unwrap();
    let attach = json!({"op": "attach", "client": reg["client"], "token": reg["token"]});
    assert_eq!(call(&cb, attach)["ok"], true);
    let held2 = held.clone();
    std::thread::spawn(move || {
        while let Ok(Some((req, _))) = wire::recv(&cb) {
            let k = req["count"].as_u64().unwrap() as usize;
            let give: Vec<u64> = held2.lock().unwrap().drain(..k).collect();
            let answer = json!({"rid": req["rid"], "ok": true, "handles": give});
            if wire::send(&cb, &answer, &[]).is_err() {
                return;
            }
        }
    });
    (off, held)
}

/// Registers an online client that maps on demand; its control connection.
pub(crate) fn online_client(pool: &Path) -> UnixStream {
    let on = wire::connect(pool).unwrap();
    let reg = call(
        &on,
        json!({"op": "register", "role": "online", "gpu": 0, "premap": false}),
    );
    assert_eq!(reg["ok"], true, "{reg}");
    on
}
