//! Online activity detection: uprobes on libcuda's launch entry points (kernel and graph launches,
//! every variant) count each process's GPU work submissions and report idle->busy edges; uprobes
//! and uretprobes on its synchronising entry points tell when a host thread waits for GPU work.
//!
//! Works for calls made through the CUDA runtime too (it calls these exported symbols through
//! pointers from cuGetProcAddress), without touching the application.

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, RingBufferBuilder, UprobeOpts};

use crate::error::WatchError;
use crate::poll_thread::PollThread;

#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    missing_docs,
    unsafe_op_in_unsafe_fn
)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/launch_watch.skel.rs"));
}
use skel::LaunchWatchSkelBuilder;

/// libcuda entry points that block the calling thread until earlier GPU work is done: while a
/// thread is inside one, the process's GPU is busy although it launches nothing.
pub const SYNC_SYMBOLS: [&str; 12] = [
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuStreamSynchronize_ptsz",
    "cuEventSynchronize",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoH_v2_ptds",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoHAsync_v2_ptsz",
    "cuMemcpy",
    "cuMemcpy_ptds",
    "cuMemcpyAsync",
    "cuMemcpyAsync_ptsz",
];

/// Size of `struct launch_stats` in the BPF program (as the skeleton's generated type has it).
const STATS_SIZE: usize = std::mem::size_of::<skel::types::launch_stats>();

/// An edge's kind: its entry point (1 kernel, 2 graph) in these bits...
const KIND_MASK: u32 = 0xff;
/// ...and this flag when only [`LaunchWatcher::arm_resume`] made it an edge.
const KIND_AFTER_RESUME: u32 = 0x100;

/// libcuda entry points that submit kernels (cookie 1) or graphs (cookie 2).
pub const LAUNCH_SYMBOLS: [(&str, u64); 10] = [
    ("cuLaunchKernel", 1),
    ("cuLaunchKernel_ptsz", 1),
    ("cuLaunchKernelEx", 1),
    ("cuLaunchKernelEx_ptsz", 1),
    ("cuLaunchCooperativeKernel", 1),
    ("cuLaunchCooperativeKernel_ptsz", 1),
    ("cuLaunchCooperativeKernelMultiDevice", 1),
    ("cuLaunchGrid", 1),
    ("cuGraphLaunch", 2),
    ("cuGraphLaunch_ptsz", 2),
];

/// How to start a [`LaunchWatcher`].
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// The libcuda file to probe (resolve `libcuda.so.1` with [`find_libcuda`]).
    pub library: PathBuf,
    /// Count only these processes (more can be added with [`LaunchWatcher::watch`]); empty: all.
    pub pids: Vec<u32>,
    /// When `pids` is empty, still filter (start with nobody watched).
    pub filter: bool,
    /// A launch this long after the process's previous one is an idle->busy edge.
    pub edge_gap: Duration,
    /// Also probe the synchronising entry points ([`SYNC_SYMBOLS`]): a thread waiting for GPU
    /// work keeps its process busy, and the wait's end is activity.
    pub track_waits: bool,
    /// Run the poll thread under `SCHED_FIFO` at this priority ([`crate::realtime`]).
    pub realtime: Option<u8>,
}

/// Launch counters of one process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchCounts {
    /// Kernel launches (all variants).
    pub kernel_launches: u64,
    /// Graph launches.
    pub graph_launches: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of the latest activity: a launch or the end of a
    /// synchronising call.
    pub last_ns: u64,
    /// Idle->busy edges.
    pub edges: u64,
    /// Threads inside a synchronising call now (waiting for the process's GPU work).
    pub in_sync: u64,
    /// Synchronising calls entered.
    pub syncs: u64,
    /// When the latest synchronising call returned (0: none yet).
    pub sync_end_ns: u64,
    /// `bpf_ktime_get_ns` of the latest launch (not the end of a wait; 0: none yet).
    pub last_launch_ns: u64,
}

/// An idle->busy edge: the first launch of `pid` after at least `edge_gap` without one, or its
/// first launch since the last [`LaunchWatcher::arm_resume`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEdge {
    /// The process.
    pub pid: u32,
    /// true for a graph launch.
    pub graph: bool,
    /// When (CLOCK_MONOTONIC ns).
    pub ts_ns: u64,
    /// The idle gap before it (0 for the process's first launch).
    pub idle_ns: u64,
    /// Reported only because it is the process's first launch since
    /// [`LaunchWatcher::arm_resume`]: the idle rule alone (no thread waiting, `edge_gap` without
    /// activity) would not have made it an edge.
    pub after_resume: bool,
}

/// Attached uprobes; detaches on drop.
pub struct LaunchWatcher {
    /// Dropped first: stops the polling thread, which detaches the probes.
    thread: PollThread,
    stats: MapHandle,
    watched: MapHandle,
    resumed: MapHandle,
    /// Edges, unless they go to a sink given to [`LaunchWatcher::start_with`].
    edges: Mutex<Option<Receiver<LaunchEdge>>>,
    attached: Vec<&'static str>,
}

/// `libcuda.so.1` as the dynamic loader would find it, with symlinks resolved (uprobes attach to
/// the real file).
pub fn find_libcuda() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(out) = std::process::Command::new("ldconfig").arg("-p").output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if line.trim_start().starts_with("libcuda.so.1 ") && line.contains("x86-64") {
                if let Some(p) = line.split("=> ").nth(1) {
                    candidates.push(PathBuf::from(p.trim()));
                }
            }
        }
    }
    for dir in [
        "/usr/local/nvidia/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/local/cuda/compat",
    ] {
        candidates.push(Path::new(dir).join("libcuda.so.1"));
    }
    candidates
        .into_iter()
        .find_map(|p| std::fs::canonicalize(p).ok())
}

/// Whether `image` (an ELF file) contains `name` as a whole NUL-terminated string, as its
/// string table would; libbpf then decides whether it is really an exported function.
fn names_symbol(image: &[u8], name: &str) -> bool {
    let mut needle = Vec::with_capacity(name.len() + 2);
    needle.push(0);
    needle.extend_from_slice(name.as_bytes());
    needle.push(0);
    image.windows(needle.len()).any(|w| w == needle.as_slice())
}

fn parse_counts(v: &[u8]) -> LaunchCounts {
    let u = |i: usize| u64::from_ne_bytes(v[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    LaunchCounts {
        kernel_launches: u(0),
        graph_launches: u(1),
        last_ns: u(2),
        edges: u(3),
        in_sync: (u(4) as i64).max(0) as u64,
        syncs: u(5),
        sync_end_ns: u(6),
        last_launch_ns: u(7),
    }
}

impl LaunchWatcher {
    /// Loads the program and attaches it to every launch symbol `cfg.library` exports; edges are
    /// read with [`LaunchWatcher::next_edge`].
    pub fn start(cfg: LaunchConfig) -> Result<LaunchWatcher, WatchError> {
        let (tx, rx) = mpsc::channel();
        let mut w = Self::start_with(cfg, move |e| {
            let _ = tx.send(e);
        })?;
        w.edges = Mutex::new(Some(rx));
        Ok(w)
    }

    /// Like [`LaunchWatcher::start`], but every edge is handed to `sink` on the watcher's thread
    /// as soon as the ring buffer delivers it (for a consumer that waits on a channel of its own).
    pub fn start_with(
        cfg: LaunchConfig,
        sink: impl FnMut(LaunchEdge) + Send + 'static,
    ) -> Result<LaunchWatcher, WatchError> {
        let (thread, (stats, watched, resumed, attached)) =
            PollThread::spawn("launch-watch", cfg.realtime, move |ready, stop| {
                run(cfg, ready, sink, stop)
            })?;
        Ok(LaunchWatcher {
            thread,
            stats,
            watched,
            resumed,
            edges: Mutex::new(None),
            attached,
        })
    }

    /// The symbols the probes are attached to (launch entry points, then the waits).
    pub fn attached(&self) -> &[&'static str] {
        &self.attached
    }

    /// How the poll thread is scheduled.
    pub fn scheduling(&self) -> &crate::Scheduling {
        self.thread.scheduling()
    }

    /// Adds a process to the filter.
    pub fn watch(&self, pid: u32) -> Result<(), WatchError> {
        self.watched
            .update(&pid.to_ne_bytes(), &[1u8], MapFlags::ANY)
            .map_err(|e| WatchError::bpf("adding a pid to the filter", e))
    }

    /// Removes a process from the filter (and its counters).
    pub fn unwatch(&self, pid: u32) {
        let _ = self.watched.delete(&pid.to_ne_bytes());
        let _ = self.stats.delete(&pid.to_ne_bytes());
    }

    /// Offline is about to resume at `now_ns` (CLOCK_MONOTONIC): every watched process's first
    /// launch after it is an edge, whatever the idle rule says. Call it before re-reading the
    /// counters one last time and then enabling offline: a launch the re-read misses is then
    /// reported. 0 disarms (the resume was called off).
    pub fn arm_resume(&self, now_ns: u64) -> Result<(), WatchError> {
        self.resumed
            .update(&0u32.to_ne_bytes(), &now_ns.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| WatchError::bpf("arming the resume edge", e))
    }

    /// Launch counters of `pid` (zero if it launched nothing).
    pub fn counts(&self, pid: u32) -> LaunchCounts {
        match self.stats.lookup(&pid.to_ne_bytes(), MapFlags::ANY) {
            Ok(Some(v)) if v.len() >= STATS_SIZE => parse_counts(&v),
            _ => LaunchCounts::default(),
        }
    }

    /// The next idle->busy edge, waiting up to `timeout` (always `None` when the edges go to
    /// the sink of [`LaunchWatcher::start_with`]).
    pub fn next_edge(&self, timeout: Duration) -> Option<LaunchEdge> {
        let rx = self.edges.lock().unwrap_or_else(PoisonError::into_inner);
        rx.as_ref()?.recv_timeout(timeout).ok()
    }
}

type Ready = Result<(MapHandle, MapHandle, MapHandle, Vec<&'static str>), WatchError>;

/// Attaches the launch program to every [`LAUNCH_SYMBOLS`] entry `image` names, each with its
/// cookie; returns the last failure (what to report if none attached).
fn attach_launches(
    skel: &skel::LaunchWatchSkel<'_>,
    library: &Path,
    image: &[u8],
    links: &mut Vec<libbpf_rs::Link>,
    attached: &mut Vec<&'static str>,
) -> Option<libbpf_rs::Error> {
    let mut last_err = None;
    for (sym, cookie) in LAUNCH_SYMBOLS {
        // Skip names the library does not carry at all (libbpf would warn for each).
        if !names_symbol(image, sym) {
            continue;
        }
        let opts = UprobeOpts {
            cookie,
            func_name: Some(sym.to_string()),
            ..Default::default()
        };
        match skel
            .progs
            .cuda_launch
            .attach_uprobe_with_opts(-1, library, 0, opts)
        {
            Ok(link) => {
                links.push(link);
                attached.push(sym);
            }
            Err(e) => last_err = Some(e),
        }
    }
    last_err
}

/// An edge record of the ring buffer (`struct launch_edge` of `launch_watch.bpf.c`); `None` if short.
fn parse_edge(data: &[u8]) -> Option<LaunchEdge> {
    if data.len() < 24 {
        return None;
    }
    let u32_at = |i: usize| u32::from_ne_bytes(data[i..i + 4].try_into().expect("4"));
    let u64_at = |i: usize| u64::from_ne_bytes(data[i..i + 8].try_into().expect("8"));
    let kind = u32_at(4);
    Some(LaunchEdge {
        pid: u32_at(0),
        graph: kind & KIND_MASK == 2,
        ts_ns: u64_at(8),
        idle_ns: u64_at(16),
        after_resume: kind & KIND_AFTER_RESUME != 0,
    })
}

/// Attaches the wait programs (uprobe at entry, uretprobe at return) to every [`SYNC_SYMBOLS`]
/// entry `image` names; a symbol that fails is logged and left out.
fn attach_waits(
    skel: &skel::LaunchWatchSkel<'_>,
    library: &Path,
    image: &[u8],
    links: &mut Vec<libbpf_rs::Link>,
    attached: &mut Vec<&'static str>,
) {
    for sym in SYNC_SYMBOLS {
        if !names_symbol(image, sym) {
            continue;
        }
        for (retprobe, prog) in [
            (false, &skel.progs.cuda_sync_enter),
            (true, &skel.progs.cuda_sync_exit),
        ] {
            let opts = UprobeOpts {
                retprobe,
                func_name: Some(sym.to_string()),
                ..Default::default()
            };
            match prog.attach_uprobe_with_opts(-1, library, 0, opts) {
                Ok(link) => links.push(link),
                Err(e) => tracing::warn!("launch watch: probing {sym}: {e}"),
            }
        }
        attached.push(sym);
    }
}

fn run(
    cfg: LaunchConfig,
    ready: SyncSender<Ready>,
    mut sink: impl FnMut(LaunchEdge) + Send + 'static,
    stop: Arc<AtomicBool>,
) {
    let mut storage = MaybeUninit::uninit();
    let setup = || -> Result<_, WatchError> {
        let mut open = LaunchWatchSkelBuilder::default()
            .open(&mut storage)
            .map_err(|e| WatchError::bpf("opening the launch-watch BPF object", e))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.filter_pids = u8::from(cfg.filter || !cfg.pids.is_empty());
            ro.edge_gap_ns = cfg.edge_gap.as_nanos() as u64;
        }
        let skel = open
            .load()
            .map_err(|e| WatchError::bpf("loading the launch-watch BPF program", e))?;
        for pid in &cfg.pids {
            skel.maps
                .watched
                .update(&pid.to_ne_bytes(), &[1u8], MapFlags::ANY)
                .map_err(|e| WatchError::bpf("filling the pid filter", e))?;
        }
        let image = std::fs::read(&cfg.library)
            .map_err(|e| WatchError::Thread(format!("reading {}: {e}", cfg.library.display())))?;
        let mut links = Vec::new();
        let mut attached = Vec::new();
        let mut sync_attached = Vec::new();
        let last_err = attach_launches(&skel, &cfg.library, &image, &mut links, &mut attached);
        // The waits: optional (a library without them still reports launches).
        if cfg.track_waits {
            attach_waits(&skel, &cfg.library, &image, &mut links, &mut sync_attached);
        }
        if attached.is_empty() {
            return Err(match last_err {
                Some(e) => WatchError::bpf("attaching uprobes to the launch entry points", e),
                None => WatchError::Thread(format!(
                    "{} exports none of libcuda's launch entry points: is it libcuda?",
                    cfg.library.display()
                )),
            });
        }
        attached.extend(sync_attached);
        let stats = MapHandle::try_from(&skel.maps.stats)
            .map_err(|e| WatchError::bpf("duplicating the stats map", e))?;
        let watched = MapHandle::try_from(&skel.maps.watched)
            .map_err(|e| WatchError::bpf("duplicating the pid filter map", e))?;
        let resumed = MapHandle::try_from(&skel.maps.resumed)
            .map_err(|e| WatchError::bpf("duplicating the resume map", e))?;
        let mut rb = RingBufferBuilder::new();
        rb.add(&skel.maps.edges, move |data: &[u8]| {
            if let Some(e) = parse_edge(data) {
                sink(e);
            }
            0
        })
        .map_err(|e| WatchError::bpf("opening the edge ring buffer", e))?;
        let rb = rb
            .build()
            .map_err(|e| WatchError::bpf("opening the edge ring buffer", e))?;
        Ok((skel, links, rb, stats, watched, resumed, attached))
    };
    let (_skel, _links, rb, stats, watched, resumed, attached) = match setup() {
        Ok(x) => x,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok((stats, watched, resumed, attached)));
    while !stop.load(Ordering::Relaxed) {
        let _ = rb.poll(Duration::from_millis(50));
    }
    let _ = rb.consume();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_read_where_the_program_writes_them() {
        use skel::types::launch_stats as S;
        use std::mem::offset_of;
        let offsets = [
            offset_of!(S, kernel_launches),
            offset_of!(S, graph_launches),
            offset_of!(S, last_ns),
            offset_of!(S, edges),
            offset_of!(S, in_sync),
            offset_of!(S, syncs),
            offset_of!(S, sync_end_ns),
            offset_of!(S, last_launch_ns),
        ];
        // parse_counts reads field i at byte 8 * i.
        assert_eq!(offsets, [0, 8, 16, 24, 32, 40, 48, 56]);
        assert_eq!(STATS_SIZE, 64);
        let bytes: Vec<u8> = (1..=8u64).flat_map(u64::to_ne_bytes).collect();
        let c = parse_counts(&bytes);
        assert_eq!((c.kernel_launches, c.last_launch_ns), (1, 8));
    }

    #[test]
    fn edges_are_read_where_the_program_writes_them() {
        // struct launch_edge: pid, kind (graph = 2, flag 0x100 after a resume), ts_ns, idle_ns.
        let mut raw = Vec::new();
        raw.extend(42u32.to_ne_bytes());
        raw.extend((2 | KIND_AFTER_RESUME).to_ne_bytes());
        raw.extend(5u64.to_ne_bytes());
        raw.extend(7u64.to_ne_bytes());
        let e = parse_edge(&raw).expect("a whole record");
        assert_eq!(
            (e.pid, e.graph, e.ts_ns, e.idle_ns, e.after_resume),
            (42, true, 5, 7, true)
        );
        assert_eq!(parse_edge(&raw[..20]), None);
    }

    #[test]
    fn symbol_names_match_whole_strings_only() {
        let image = b"\x7fELF\0cuLaunchKernel_ptsz\0cuGraphLaunch\0";
        assert!(names_symbol(image, "cuLaunchKernel_ptsz"));
        assert!(names_symbol(image, "cuGraphLaunch"));
        assert!(!names_symbol(image, "cuLaunchKernel"));
        assert!(!names_symbol(image, "cuGraphLaunch_ptsz"));
    }
}
