//! The node harvest profile: a thread that turns what the daemon measures into
//! the versioned document a cluster scheduler reads (`valve_harvest::NodeHarvest`).
//!
//! Every 200 ms the thread folds the gate's lock-free trace into busy intervals ([`intervals`]),
//! about once a second it samples the memory left to offline per GPU ([`memory`]), and every 5 s
//! it rebuilds the document with the jobs' progress reports and caches it, with its JSON, in
//! [`HarvestShared`]. The control socket (`harvest`), `GET /v1/harvest` and the `valve_harvest_*`
//! gauges ([`gauges`]) only read that cache. `docs/cluster.md` ("The node harvest profile") says
//! what each figure means and how it is measured.

pub mod gauges;
pub mod intervals;
pub mod memory;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use valve::stats::monotonic_ns;
use valve_harvest::{progress, GpuInfo, NodeHarvest, Recorder, DEFAULT_WINDOWS_S};

use crate::gate::GateShared;
use crate::memory::ledger::UsageSnapshot;
use intervals::{Positions, TraceFolder};
pub use memory::{DeviceMemory, DeviceUsage, MemorySampler, NvmlMemory};

/// How often the gate's trace is read.
pub const TRACE_EVERY: Duration = Duration::from_millis(200);
/// How often the memory left to offline is sampled.
pub const MEMORY_EVERY: Duration = Duration::from_secs(1);
/// How often the document is rebuilt.
pub const DOCUMENT_EVERY: Duration = Duration::from_secs(5);

/// The profile's settings: `--node-name`, `--progress-dir`, `--harvest-windows`, or the config
/// file's `[harvest]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HarvestSettings {
    /// The node's name in the document (`None`: the host name up to its first dot, as Slurm
    /// names nodes).
    pub node_name: Option<String>,
    /// Where offline jobs append their progress reports (created at start, mode 1777).
    pub progress_dir: PathBuf,
    /// The trailing windows reported, in seconds.
    pub windows_s: Vec<u32>,
}

impl Default for HarvestSettings {
    fn default() -> Self {
        HarvestSettings {
            node_name: None,
            progress_dir: PathBuf::from(progress::DEFAULT_DIR),
            windows_s: DEFAULT_WINDOWS_S.to_vec(),
        }
    }
}

/// The document as it is served: the value the control socket replies with and the JSON text
/// `GET /v1/harvest` sends, both made once per rebuild.
#[derive(Debug)]
pub struct Profile {
    /// The document.
    pub doc: NodeHarvest,
    /// Its JSON text.
    pub json: String,
    /// Its JSON value.
    pub value: serde_json::Value,
}

/// The online and offline processes as the daemon's main loop last saw them (about once a
/// second, from the gate and the registry).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessView {
    /// Whether a gate runs.
    pub gate_running: bool,
    /// The gate's online pids, each with the indices of the GPUs it has channels on.
    pub online_gpus: BTreeMap<u32, Vec<u32>>,
    /// The pids the gate freezes.
    pub offline: BTreeSet<u32>,
}

/// What the daemon's main loop, the metrics server and the harvest thread share. Every lock is
/// held for a swap or a copy, never across work.
#[derive(Default)]
pub struct HarvestShared {
    gate: Mutex<Option<Arc<GateShared>>>,
    view: Mutex<ProcessView>,
    profile: Mutex<Option<Arc<Profile>>>,
    running: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HarvestShared {
    /// The running gate's shared state (`None`: no gate runs). Its trace stays readable after
    /// the gate stops, so the thread reads it to the end.
    pub fn set_gate(&self, gate: Option<Arc<GateShared>>) {
        *lock(&self.gate) = gate;
    }

    /// The running gate's shared state, if a gate runs.
    pub fn gate(&self) -> Option<Arc<GateShared>> {
        lock(&self.gate).clone()
    }

    /// Replaces the processes view.
    pub fn set_view(&self, view: ProcessView) {
        *lock(&self.view) = view;
    }

    /// The processes view.
    pub fn view(&self) -> ProcessView {
        lock(&self.view).clone()
    }

    /// Makes `doc` the one served (its JSON is made here, on the harvest thread).
    pub fn publish(&self, doc: NodeHarvest) {
        let json = serde_json::to_string(&doc).expect("the document serialises");
        let value = serde_json::to_value(&doc).expect("the document serialises");
        *lock(&self.profile) = Some(Arc::new(Profile { doc, json, value }));
    }

    /// The latest document; the error says why there is none.
    pub fn profile(&self) -> Result<Arc<Profile>, String> {
        if !self.is_running() {
            return Err(
                "the harvest thread is not running (the daemon starts it; its log says \
                        why it stopped)"
                    .into(),
            );
        }
        lock(&self.profile)
            .clone()
            .ok_or_else(|| "the harvest profile is not built yet: ask again in a second".into())
    }

    /// Whether the harvest thread runs.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    /// Marks the harvest thread as running (tests serve a document without one).
    pub fn set_running(&self, running: bool) {
        self.running.store(running, Ordering::Release);
    }
}

/// Where the harvest thread reads the node from.
pub struct HarvestSources {
    /// The node's GPUs, in Valve's enumeration (index, name, PCI address).
    pub gpus: Vec<valve::gpu::GpuInfo>,
    /// The memory pool's per-GPU numbers, when the daemon runs the pool.
    pub pool: Option<Arc<UsageSnapshot>>,
    /// NVML (the GPUs' total memory; memory left to offline where no pool runs), if available.
    pub devices: Option<Box<dyn DeviceMemory>>,
    /// The label of offline processes while no gate runs (the config's `gate.offline_label`).
    pub offline_label: Option<String>,
}

/// The running harvest thread; dropping it stops the thread.
pub struct HarvestHandle {
    shared: Arc<HarvestShared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HarvestHandle {
    /// What the thread shares with the daemon.
    pub fn shared(&self) -> Arc<HarvestShared> {
        self.shared.clone()
    }
}

impl Drop for HarvestHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Starts the harvest thread for node `node`. Its first turn (NVML's first memory sample of
/// every GPU, the first document) runs here, on the caller's thread: the daemon calls this
/// before it serves its socket, so a CUDA process started once the socket answers never meets
/// that start-up work on RM's locks, and a profile is served from the first request on.
pub fn start(
    settings: &HarvestSettings,
    node: &str,
    sources: HarvestSources,
) -> Result<HarvestHandle, String> {
    let shared = Arc::new(HarvestShared::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut harvester = Harvester::new(settings, node, sources, shared.clone(), monotonic_ns());
    harvester.tick(Instant::now(), monotonic_ns());
    let stop2 = stop.clone();
    shared.set_running(true);
    let thread = std::thread::Builder::new()
        .name("valve-harvest".into())
        .spawn(move || {
            loop {
                std::thread::park_timeout(TRACE_EVERY);
                if stop2.load(Ordering::Acquire) {
                    break;
                }
                harvester.tick(Instant::now(), monotonic_ns());
            }
            harvester.shared.set_running(false);
        })
        .map_err(|e| {
            shared.set_running(false);
            format!("starting the harvest thread: {e}")
        })?;
    Ok(HarvestHandle {
        shared,
        stop,
        thread: Some(thread),
    })
}

/// The harvest thread's state: the trackers, where it is in the gate's trace, and when it last
/// sampled memory and rebuilt the document.
pub struct Harvester {
    shared: Arc<HarvestShared>,
    recorder: Recorder,
    /// GPU index -> the recorder's position of that GPU.
    positions: BTreeMap<u32, usize>,
    folder: TraceFolder,
    /// The gate whose trace is being read.
    gate: Option<Arc<GateShared>>,
    memory: MemorySampler,
    progress_dir: PathBuf,
    next_memory: Option<Instant>,
    next_document: Option<Instant>,
}

impl Harvester {
    /// A harvester measuring from `now_ns` (CLOCK_MONOTONIC, the trace's clock).
    pub fn new(
        settings: &HarvestSettings,
        node: &str,
        sources: HarvestSources,
        shared: Arc<HarvestShared>,
        now_ns: u64,
    ) -> Harvester {
        let infos: Vec<GpuInfo> = sources
            .gpus
            .iter()
            .map(|g| GpuInfo {
                index: g.index as u32,
                name: Some(g.name.clone()).filter(|n| !n.is_empty()),
                memory_total_bytes: sources
                    .devices
                    .as_ref()
                    .and_then(|d| d.total_bytes(&g.pci_bus_id))
                    .unwrap_or(0),
            })
            .collect();
        let positions = infos
            .iter()
            .enumerate()
            .map(|(pos, g)| (g.index, pos))
            .collect();
        let memory = MemorySampler::new(&sources.gpus, sources.pool, sources.offline_label)
            .with_devices(sources.devices);
        Harvester {
            shared,
            recorder: Recorder::new(node, infos, &settings.windows_s, now_ns),
            positions,
            folder: TraceFolder::default(),
            gate: None,
            memory,
            progress_dir: settings.progress_dir.clone(),
            next_memory: None,
            next_document: None,
        }
    }

    /// One turn: the trace, then memory and the document when they are due.
    pub fn tick(&mut self, now: Instant, now_ns: u64) {
        let view = self.shared.view();
        let online = self.positions_of(&view);
        self.read_trace(now_ns, &online);
        if self.next_memory.is_none_or(|t| now >= t) {
            self.memory.sample(&mut self.recorder, now_ns, &view);
            self.next_memory = Some(now + MEMORY_EVERY);
        }
        if self.next_document.is_none_or(|t| now >= t) {
            self.rebuild(now_ns, unix_ms_now());
            self.next_document = Some(now + DOCUMENT_EVERY);
        }
    }

    /// The online pids' GPUs as the recorder's positions.
    fn positions_of(&self, view: &ProcessView) -> Positions {
        view.online_gpus
            .iter()
            .map(|(&pid, gpus)| {
                let pos = gpus
                    .iter()
                    .filter_map(|i| self.positions.get(i).copied())
                    .collect();
                (pid, pos)
            })
            .collect()
    }

    /// Folds what the gate's trace has since the last turn. A gate that stopped (or was
    /// replaced) is read to its end first, and what it left open is closed.
    fn read_trace(&mut self, now_ns: u64, online: &Positions) {
        let current = self.shared.gate();
        let same = match (&self.gate, &current) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            if let Some(old) = self.gate.take() {
                self.folder.read(old.trace(), &mut self.recorder, online);
                self.folder.gate_ended(&mut self.recorder, now_ns);
            }
            self.gate = current;
        }
        if let Some(g) = &self.gate {
            self.folder.read(g.trace(), &mut self.recorder, online);
        }
        self.folder.update(&mut self.recorder, online, now_ns);
    }

    /// Rebuilds the document at `now_ns` = `unix_ms` and publishes it.
    pub fn rebuild(&mut self, now_ns: u64, unix_ms: u64) {
        let windows = self.recorder.windows_s().to_vec();
        // A job still shows (its rates falling) for the longest window after its last report.
        let stale_ms = u64::from(windows.last().copied().unwrap_or(3600)) * 1000;
        let jobs = progress::read_all(&self.progress_dir, unix_ms, &windows, stale_ms);
        let gpus = self.recorder.gpus().len();
        // Busy periods still going on count up to now, for this document only.
        let open = self.folder.open_starts(gpus);
        for (pos, start) in open.iter().enumerate() {
            self.recorder.online.set_open(pos, *start);
        }
        let doc = self.recorder.document(now_ns, unix_ms, jobs);
        for pos in 0..gpus {
            self.recorder.online.set_open(pos, None);
        }
        self.shared.publish(doc);
    }

    /// The trackers (for tests and inspection).
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// Trace records lost to overwriting so far.
    pub fn lost_records(&self) -> u64 {
        self.folder.lost()
    }
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The host name up to its first dot (Slurm's default NodeName), from the kernel.
pub fn host_name() -> Result<String, String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_err(|e| format!("reading the host name from /proc/sys/kernel/hostname: {e}"))?;
    let short = name
        .trim()
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string();
    crate::config::check_node_name(&short).map_err(|e| {
        format!("the host name {short:?} cannot name this node ({e}); give --node-name")
    })?;
    Ok(short)
}

/// Creates the progress directory (mode 1777, like /tmp, so any job can report) unless it
/// exists; an existing one keeps its mode.
pub fn ensure_progress_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let fix = "choose another with --progress-dir or harvest.progress_dir";
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => {
            return Err(format!(
                "the progress directory {} exists and is not a directory: {fix}",
                dir.display()
            ))
        }
        Err(_) => {}
    }
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777)))
        .map_err(|e| {
            format!(
                "creating the progress directory {}: {e} ({fix})",
                dir.display()
            )
        })
}

#[cfg(test)]
mod tests;
