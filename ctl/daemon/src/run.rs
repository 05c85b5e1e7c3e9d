//! Starting and stopping the daemon: root and group checks, the driver, recovery of what a
//! previous run left disabled, the eBPF watcher, the socket; at the end, everything is resumed.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use valve::controller::Controller;
use valve::driver::NvDriver;
use valve::state::StateFile;
use valve::Signals;
use valve_ebpf::{WatchConfig, Watcher};

use crate::audit::{Audit, Caller, Targets};
use crate::config::OfflinePolicy;
use crate::core::DaemonCore;
use crate::error::{derr, DaemonError};
use crate::gate::watchers::real_gate_starter;
use crate::harvest::{HarvestHandle, HarvestSettings, HarvestSources, NvmlMemory};
use crate::metrics::Metrics;
use crate::procfs::nvidia_users;
use crate::protocol::EXIT_BPF;
use crate::protocol::{Data, GateSpec, Reply};
use crate::server;
use crate::workload::PodLabels;

/// How the daemon is started.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// The socket path.
    pub socket: PathBuf,
    /// Where `disabled.json` lives.
    pub state_dir: PathBuf,
    /// A group whose members may use the socket (besides root).
    pub group: Option<String>,
    /// The longest any preemption may last.
    pub max_hold: Option<Duration>,
    /// Where audit records are appended as JSON lines (besides the log).
    pub audit_log: Option<PathBuf>,
    /// Where Prometheus metrics are served (`None`: not at all).
    pub metrics_addr: Option<SocketAddr>,
    /// Who may be frozen (the config's `[offline]`).
    pub offline: OfflinePolicy,
    /// Defaults for the `gate start` fields a request leaves out.
    pub gate_defaults: GateSpec,
    /// Start a gate with `gate_defaults` when the daemon starts.
    pub gate_autostart: bool,
    /// Read Kubernetes pod labels as workload labels.
    pub pod_labels: Option<PodLabels>,
    /// The config file the settings came from (audited at start).
    pub config_file: Option<PathBuf>,
    /// The node harvest profile: node name, progress directory, windows.
    pub harvest: HarvestSettings,
    /// Watch every process's RM calls with eBPF (off only with `--no-discovery`, to measure
    /// what the probes cost a CUDA process: such a daemon knows no process's channels).
    pub discovery: bool,
    /// How long a stopped gate's BPF watchers are kept for the next gate (zero: not kept).
    pub gate_keep_watchers: std::time::Duration,
}

/// Audits the settings the daemon starts with (its config file, with a digest of its text).
fn audit_config(cfg: &DaemonConfig, audit: &Audit) {
    use sha2::Digest;
    let file = cfg.config_file.as_ref().map(|p| {
        let sha256 = std::fs::read(p)
            .map(|b| format!("{:x}", sha2::Sha256::digest(b)))
            .unwrap_or_default();
        ConfigFile { path: p, sha256 }
    });
    let settings = ConfigAudit {
        file,
        group: cfg.group.as_deref(),
        max_hold_ms: cfg.max_hold.map(|d| d.as_millis() as u64),
        metrics_addr: cfg.metrics_addr,
        offline: OfflineAudit {
            labels: &cfg.offline.labels,
            uids: &cfg.offline.uids,
            cgroups: &cfg.offline.cgroups,
        },
        gate_defaults: &cfg.gate_defaults,
        gate_autostart: cfg.gate_autostart,
        harvest: HarvestAudit {
            node_name: cfg.harvest.node_name.as_deref(),
            progress_dir: &cfg.harvest.progress_dir,
            windows_s: &cfg.harvest.windows_s,
        },
    };
    let targets = Targets::Config(serde_json::to_value(settings).unwrap_or_default());
    audit.record("config", Caller::daemon(), targets, &Reply::empty());
}

/// The daemon's settings as its `config` audit record names them.
#[derive(serde::Serialize)]
struct ConfigAudit<'a> {
    file: Option<ConfigFile<'a>>,
    group: Option<&'a str>,
    max_hold_ms: Option<u64>,
    metrics_addr: Option<SocketAddr>,
    offline: OfflineAudit<'a>,
    gate_defaults: &'a GateSpec,
    gate_autostart: bool,
    harvest: HarvestAudit<'a>,
}

/// The config file and the SHA-256 of its text.
#[derive(serde::Serialize)]
struct ConfigFile<'a> {
    path: &'a std::path::Path,
    sha256: String,
}

/// The `[offline]` rules, in [`ConfigAudit`].
#[derive(serde::Serialize)]
struct OfflineAudit<'a> {
    labels: &'a [String],
    uids: &'a [u32],
    cgroups: &'a [String],
}

/// The `[harvest]` settings, in [`ConfigAudit`].
#[derive(serde::Serialize)]
struct HarvestAudit<'a> {
    node_name: Option<&'a str>,
    progress_dir: &'a std::path::Path,
    windows_s: &'a [u32],
}

/// Starts the thread that checks the freezes nobody waits for (the pool's, the gate's) on an
/// RM client of its own; without it those freezes go unchecked, and the log says so.
fn start_freeze_checker(core: &mut DaemonCore<NvDriver>) {
    match Controller::<NvDriver>::open() {
        Ok(ctl) => {
            let checker = crate::freeze_check::FreezeChecker::start(ctl, core.freeze_recorder());
            crate::freeze_check::install_for_gate(checker.clone());
            core.set_freeze_checker(checker);
        }
        Err(e) => tracing::warn!(
            "no freeze check thread ({e}): the pool's and the gate's freezes go unchecked; \
             `valvectl preempt` still checks its own"
        ),
    }
}

/// Creates the metrics and has the core and the gate thread record into them, always: the
/// control socket serves them (`valvectl top` reads offline's harvested and frozen time there).
/// With `addr` they are served over HTTP too.
fn start_metrics(
    addr: Option<SocketAddr>,
    core: &mut DaemonCore<NvDriver>,
) -> Result<Arc<Metrics>, DaemonError> {
    let m = Metrics::new(core.controller().gpus().len());
    core.set_metrics(m.clone());
    crate::metrics::install_for_gate(m.clone());
    let Some(addr) = addr else {
        return Ok(m);
    };
    let bound = crate::metrics::serve_http(addr, m.clone()).map_err(|e| {
        derr(
            1,
            format!("serving metrics on {addr}: {e} (is the port in use? choose another --metrics-addr)"),
        )
    })?;
    eprintln!("valvectl daemon: Prometheus metrics on http://{bound}/metrics");
    Ok(m)
}

/// The audit trail the config asks for: its file, else the log only.
fn open_audit(cfg: &DaemonConfig) -> Result<Audit, DaemonError> {
    match &cfg.audit_log {
        Some(path) => Audit::to_file(path).map_err(|e| {
            derr(
                1,
                format!(
                    "opening the audit log {}: {e} (fix the path or its directory's permissions)",
                    path.display()
                ),
            )
        }),
        None => Ok(Audit::log_only()),
    }
}

/// Audits the resume of everything at shutdown, with the pids it resumed.
fn audit_shutdown(audit: &Audit, r: &Reply) {
    let pids = match &r.data {
        Some(Data::ResumeAll(all)) => Some(all.resumed.clone()),
        _ => None,
    };
    audit.record(
        "shutdown_resume",
        Caller::daemon(),
        Targets::Pids { pids },
        r,
    );
}

/// Runs the daemon until SIGINT/SIGTERM/SIGHUP; resumes everything before returning.
pub fn run(cfg: &DaemonConfig, signals: &Signals) -> Result<(), DaemonError> {
    run_with_pool(cfg, None, signals)
}

/// [`run`], with the GPU memory pool serving its own socket when `pool` is given.
pub fn run_with_pool(
    cfg: &DaemonConfig,
    pool: Option<&PoolSettings>,
    signals: &Signals,
) -> Result<(), DaemonError> {
    let gid = check_start(cfg)?;
    let node = match &cfg.harvest.node_name {
        Some(n) => n.clone(),
        None => crate::harvest::host_name().map_err(|e| derr(2, e))?,
    };
    crate::harvest::ensure_progress_dir(&cfg.harvest.progress_dir).map_err(|e| derr(1, e))?;
    let audit = open_audit(cfg)?;
    server::raise_fd_limit();
    let (mut core, watcher) = start(cfg)?;
    let listener = server::bind(&cfg.socket, gid)?;
    // The pool's freezes reach the loop by this lane, not by the socket.
    let (lane_client, lane) =
        server::lane::lane().map_err(|e| derr(1, format!("the loop's wake-up pair: {e}")))?;
    let pool = match pool {
        Some(p) => Some(start_pool(p, &core, gid, lane_client)?),
        None => None,
    };
    let harvest = start_harvest(cfg, &node, &core, pool.as_ref())?;
    core.set_harvest(harvest.shared());
    eprintln!(
        "valvectl daemon: {}, {} GPU(s), {} process(es) started before the daemon, socket {}",
        if watcher.is_some() {
            "watching RM ioctls"
        } else {
            "NOT watching RM ioctls (--no-discovery)"
        },
        core.controller().gpus().len(),
        core.pre_existing.len(),
        cfg.socket.display()
    );
    core.set_gate_starter(real_gate_starter(cfg.gate_keep_watchers));
    core.set_policy(cfg.offline.clone(), cfg.gate_defaults.clone());
    if let Some(p) = &cfg.pod_labels {
        crate::workload::use_pod_labels(p.clone());
    }
    audit_config(cfg, &audit);
    // A failure from here on still goes through the shutdown below (socket file, pool).
    let (metrics, started) = match start_metrics(cfg.metrics_addr, &mut core) {
        Err(e) => (None, Err(e)),
        Ok(m) => (Some(m), Ok(())),
    };
    if let Some(m) = &metrics {
        m.serve_profile(harvest.shared());
    }
    start_freeze_checker(&mut core);
    let mut server = server::Server::new(&listener, gid, &audit)
        .with_lane(lane)
        .on_error(|cause| {
            if let Some(m) = &metrics {
                m.record_error(cause);
            }
        });
    let result = started
        .and_then(|()| match cfg.gate_autostart {
            true => server.autostart_gate(&mut core, GateSpec::default()),
            false => Ok(()),
        })
        .and_then(|()| server::serve(&mut core, &watcher, &mut server, signals));
    // The loop's lane goes first, so a reclaim in flight fails at once instead of waiting for
    // a loop that no longer turns; then the pool stops (it can freeze nothing more), and the
    // core's shutdown resumes whatever a reclaim left frozen.
    drop(server);
    drop(pool);
    drop(harvest);
    let r = core.shutdown();
    audit_shutdown(&audit, &r);
    let _ = std::fs::remove_file(&cfg.socket);
    drop(watcher);
    match (result, r.error) {
        (Err(e), _) => Err(e),
        (Ok(()), Some(e)) => Err(derr(e.code, e.message)),
        (Ok(()), None) => Ok(()),
    }
}

/// The memory pool's settings (`valvectl daemon --pool ...`); see `docs/memory.md`.
#[derive(Clone, Debug)]
pub struct PoolSettings {
    /// The pool socket.
    pub socket: PathBuf,
    /// Valve GPU indices to pool (`None`: every GPU).
    pub gpus: Option<Vec<usize>>,
    /// Bytes per handle.
    pub handle_bytes: usize,
    /// The most each GPU's pool may hold.
    pub max_bytes: u64,
    /// Device memory always left to others.
    pub keep_free_bytes: u64,
    /// How long an offline client has to give memory back.
    pub reclaim_deadline: Duration,
    /// The reclamation rate MIAD reservation aims at, per minute and online process.
    pub target_reclaims_per_min: f64,
    /// `SCHED_FIFO` priority of the pool thread (`None`: normal scheduling).
    pub realtime: Option<u8>,
    /// Where online reservations are saved across restarts (`None`: they start cold).
    pub warm: Option<crate::memory::WarmSettings>,
}

fn start_pool(
    p: &PoolSettings,
    core: &DaemonCore<NvDriver>,
    gid: Option<u32>,
    lane: server::LaneClient,
) -> Result<crate::memory::PoolHandle, DaemonError> {
    let all = core.controller().gpus();
    let mut gpus = Vec::new();
    for g in &all {
        if p.gpus.as_ref().is_none_or(|want| want.contains(&g.index)) {
            gpus.push((g.index, g.pci_bus_id.clone()));
        }
    }
    if let Some(missing) = p
        .gpus
        .iter()
        .flatten()
        .find(|i| !all.iter().any(|g| g.index == **i))
    {
        return Err(derr(
            6,
            format!("--pool-gpus: no GPU {missing} (see valvectl gpus)"),
        ));
    }
    let pcfg = crate::memory::PoolConfig {
        socket: p.socket.clone(),
        gpus,
        handle_bytes: p.handle_bytes,
        max_bytes: p.max_bytes,
        keep_free_bytes: p.keep_free_bytes,
        reclaim_deadline: p.reclaim_deadline,
        target_reclaims_per_min: p.target_reclaims_per_min,
        realtime: p.realtime,
        warm: p.warm.clone(),
        gid,
    };
    let allowed = Box::new(move |s: &std::os::unix::net::UnixStream| server::peer_allowed(s, gid));
    // The daemon resumes by itself after max_hold, should the pool thread die mid-reclaim.
    let freezer = Box::new(crate::memory::reclaim::DaemonLaneFreezer {
        lane,
        max_hold: Duration::from_secs(2),
    });
    let handle = crate::memory::start(&pcfg, allowed, freezer)
        .map_err(|e| derr(1, format!("memory pool: {e}")))?;
    eprintln!(
        "valvectl daemon: memory pool on {} GPU(s), {} MiB handles, socket {}",
        pcfg.gpus.len(),
        p.handle_bytes >> 20,
        p.socket.display()
    );
    Ok(handle)
}

/// Starts the harvest thread on the node's GPUs, reading memory from the pool where it runs and
/// from NVML elsewhere.
fn start_harvest(
    cfg: &DaemonConfig,
    node: &str,
    core: &DaemonCore<NvDriver>,
    pool: Option<&crate::memory::PoolHandle>,
) -> Result<HarvestHandle, DaemonError> {
    let devices = match NvmlMemory::open() {
        Ok(n) => Some(Box::new(n) as Box<dyn crate::harvest::DeviceMemory>),
        Err(e) => {
            tracing::warn!(
                "harvest: NVML is unavailable ({e}); GPUs outside the memory pool get no memory \
                 samples and their total memory reads 0"
            );
            None
        }
    };
    let sources = HarvestSources {
        gpus: core.controller().gpus(),
        pool: pool.map(|p| p.usage()),
        devices,
        offline_label: cfg.gate_defaults.offline_label.clone(),
    };
    let h = crate::harvest::start(&cfg.harvest, node, sources).map_err(|e| derr(1, e))?;
    eprintln!(
        "valvectl daemon: harvest profile of node {node} (windows {:?} s), progress reports in {}",
        cfg.harvest.windows_s,
        cfg.harvest.progress_dir.display()
    );
    Ok(h)
}

/// Root, the group's id (if one is given), and no other daemon on the socket.
fn check_start(cfg: &DaemonConfig) -> Result<Option<u32>, DaemonError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(derr(
            4,
            "the daemon must run as root (it loads BPF programs and owns /run/valve): sudo valvectl daemon",
        ));
    }
    let gid = match &cfg.group {
        None => None,
        Some(name) => match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => Some(g.gid.as_raw()),
            _ => return Err(derr(2, format!("no such group: {name}"))),
        },
    };
    if server::answers(&cfg.socket, Duration::from_secs(1)) {
        return Err(derr(
            1,
            format!("another daemon already serves {}", cfg.socket.display()),
        ));
    }
    Ok(gid)
}

/// Opens the driver, starts the eBPF watcher (unless `--no-discovery`) and sets up the core,
/// which re-enables what a previous run left disabled and restores the registry from the journal.
fn start(cfg: &DaemonConfig) -> Result<(DaemonCore<NvDriver>, Option<Watcher>), DaemonError> {
    let ctl = Controller::<NvDriver>::open().map_err(|e| {
        let message = format!("opening the driver: {e}");
        derr(e.exit_code(), message)
    })?;
    std::fs::create_dir_all(&cfg.state_dir)
        .map_err(|e| derr(1, format!("creating {}: {e}", cfg.state_dir.display())))?;
    let pre_existing = nvidia_users();
    let watcher = match cfg.discovery {
        true => Some(start_watcher()?),
        false => None,
    };
    let mut core = DaemonCore::new(
        ctl,
        StateFile::in_dir(&cfg.state_dir),
        cfg.max_hold,
        pre_existing,
    )
    .map_err(|e| derr(1, format!("recovering state: {e}")))?;
    if watcher.is_none() {
        core.set_discovery_off();
    }
    if !core.restored.is_empty() {
        tracing::warn!(
            "restored {} running process(es) from the registry journal",
            core.restored.len()
        );
    }
    if core.recovered > 0 || !core.recovery_failures.is_empty() {
        tracing::warn!(
            "re-enabled {} channel(s) a previous daemon had disabled; failures: {:?}",
            core.recovered,
            core.recovery_failures
        );
    }
    Ok((core, watcher))
}

/// The eBPF watcher of every process's RM objects. Batched delivery keeps the consumer wake-up
/// (~2 us) off every RM call of every CUDA process; the registry then lags the ioctls by at most
/// 2 ms.
fn start_watcher() -> Result<Watcher, DaemonError> {
    Watcher::start(WatchConfig {
        batched_delivery: true,
        poll_interval: Duration::from_millis(2),
        ..WatchConfig::default()
    })
    .map_err(|e| derr(EXIT_BPF, format!("starting the eBPF watcher: {e}")))
}
