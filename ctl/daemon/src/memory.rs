//! The daemon's GPU memory pool: shareable physical memory in fixed-size handles,
//! lent to registered online and offline processes, and taken back from offline for online.
//!
//! - [`ledger`]: who holds which handle; the rules for lending and taking back (pure).
//! - [`backing`]: real memory (CUDA VMM handles created without a CUDA context; NVML).
//! - [`reservation`]: MIAD headroom for each online process, so reclaims stay near the
//!   operator's target rate (paper section 5).
//! - [`reclaim`]: freeze offline, ask its client library for k handles, kill it past the
//!   deadline, thaw.
//! - [`server`]: the pool socket (`docs/memory.md`, "The pool protocol").
//! - [`threads`]: what an offline process's threads are doing, logged before a kill.
//!
//! Why it is built this way, and the measurements behind the choices: `docs/memory.md`.

pub mod backing;
pub mod ledger;
pub mod reclaim;
pub mod reservation;
pub mod server;
pub mod threads;

pub use server::warm::WarmSettings;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The pool's settings (`valvectl daemon --pool ...`).
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// The pool socket.
    pub socket: PathBuf,
    /// GPUs to pool, as (Valve's GPU index, PCI address).
    pub gpus: Vec<(usize, String)>,
    /// Bytes per handle (default 64 MiB: docs/memory.md says why).
    pub handle_bytes: usize,
    /// The most each GPU's pool may hold.
    pub max_bytes: u64,
    /// Device memory the pool always leaves to others (contexts, non-pool allocations).
    pub keep_free_bytes: u64,
    /// How long an offline client has to give memory back before it is killed.
    pub reclaim_deadline: Duration,
    /// The reclamation rate MIAD reservation steers each online process to, per minute.
    pub target_reclaims_per_min: f64,
    /// The pool thread runs under `SCHED_FIFO` at this priority (`None`: normal scheduling).
    pub realtime: Option<u8>,
    /// Where online reservations are saved and start warm from (`None`: always cold).
    pub warm: Option<WarmSettings>,
    /// Group allowed on the socket besides root.
    pub gid: Option<u32>,
}

/// The running pool; dropping it stops the server and releases the daemon's handles (clients
/// keep what they mapped until they unmap or exit).
pub struct PoolHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    socket: PathBuf,
    usage: Arc<ledger::UsageSnapshot>,
}

impl PoolHandle {
    /// The pool's per-GPU numbers, published by its thread about once a second.
    pub fn usage(&self) -> Arc<ledger::UsageSnapshot> {
        self.usage.clone()
    }
}

impl Drop for PoolHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Opens every GPU's backing, binds the socket and starts the server thread, which freezes
/// offline through `freezer` (the daemon's: [`reclaim::DaemonLaneFreezer`]).
pub fn start(
    cfg: &PoolConfig,
    allowed: server::PeerCheck,
    freezer: Box<dyn reclaim::Freezer>,
) -> Result<PoolHandle, String> {
    let mut ledger = ledger::Ledger::default();
    for (index, pci) in &cfg.gpus {
        let b = backing::CudaBacking::open(pci, cfg.handle_bytes)
            .map_err(|e| format!("pool on GPU {index} ({pci}): {e}"))?;
        ledger.add_gpu(*index, Box::new(b), cfg.max_bytes, cfg.keep_free_bytes);
    }
    if let Some(dir) = cfg.socket.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&cfg.socket);
    let listener = valve_vmm::wire::listen(&cfg.socket).map_err(|e| e.to_string())?;
    let mode = if cfg.gid.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(&cfg.socket, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("setting the mode of {}: {e}", cfg.socket.display()))?;
    if let Some(gid) = cfg.gid {
        nix::unistd::chown(&cfg.socket, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|e| format!("giving {} to group {gid}: {e}", cfg.socket.display()))?;
    }
    let mut srv = server::PoolServer::new(ledger, listener, allowed, freezer, cfg.reclaim_deadline);
    srv.set_reservation(reservation::ReservationConfig {
        target_rate_per_min: cfg.target_reclaims_per_min,
        ..reservation::ReservationConfig::for_handle_bytes(cfg.handle_bytes as u64)
    })?;
    if let Some(w) = &cfg.warm {
        let (store, _warned) = server::warm::WarmStore::open(w.clone(), server::warm::unix_now());
        srv.set_warm_start(store);
    }
    let usage = srv.usage_snapshot();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let realtime = cfg.realtime;
    let thread = std::thread::Builder::new()
        .name("valve-pool".into())
        .spawn(move || {
            match valve_ebpf::realtime::apply_to_current_thread(realtime) {
                valve_ebpf::Scheduling::Refused(why) => {
                    tracing::warn!("pool thread stays on the normal scheduler: {why}")
                }
                s => tracing::info!("pool thread: {s}"),
            }
            srv.run(&s2, Duration::from_millis(50))
        })
        .map_err(|e| format!("starting the pool thread: {e}"))?;
    Ok(PoolHandle {
        stop,
        thread: Some(thread),
        socket: cfg.socket.clone(),
        usage,
    })
}
