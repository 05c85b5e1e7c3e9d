//! Online activity detection: uprobes on libcuda's launch entry points (kernel and graph launches,
//! every variant) count each process's GPU work submissions and report idle->busy edges; uprobes
//! and uretprobes on its synchronising entry points tell when a host thread waits for GPU work.
//!
//! Works for calls made through the CUDA runtime too (it calls these exported symbols through
//! pointers from cuGetProcAddress), without touching the application.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, RingBufferBuilder, UprobeMultiOpts, UprobeOpts};

use crate::elf_symbols::function_offsets;
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
/// ...and this one when it was written while offline was held ([`LaunchWatcher::hold_edges`]).
const KIND_QUIET: u32 = 0x200;

/// The daemon's [`LaunchConfig::poll_period`]: watching a process probes it this late at most
/// (its launches before that are not seen), and edges written while offline is held
/// ([`LaunchWatcher::hold_edges`]) reach the sink this late at most.
pub const REQUEST_POLL: Duration = Duration::from_millis(10);

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
    /// How often the poll thread takes up probe requests and drains the edges written while
    /// offline is held ([`REQUEST_POLL`] in the daemon).
    pub poll_period: Duration,
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
    /// Edges written while offline was held ([`LaunchWatcher::hold_edges`]), without waking
    /// the reader.
    pub quiet_edges: u64,
    /// The activity (launch or end of a wait) before the latest edge (0: none, or no edge yet).
    pub edge_prev_ns: u64,
    /// `bpf_ktime_get_ns` of the latest edge (0: none yet). Online was idle from
    /// [`Self::edge_prev_ns`] to it: an arrival in between came to an idle process.
    pub last_edge_ns: u64,
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
    /// Written while offline was held ([`LaunchWatcher::hold_edges`]), without waking the reader
    /// (counted in [`LaunchCounts::quiet_edges`]).
    pub quiet: bool,
}

/// Attached uprobes; detaches on drop.
pub struct LaunchWatcher {
    /// Dropped first: stops the polling thread, which detaches the probes.
    thread: PollThread,
    stats: MapHandle,
    watched: MapHandle,
    resumed: MapHandle,
    held: MapHandle,
    /// Edges, unless they go to a sink given to [`LaunchWatcher::start_with`].
    edges: Mutex<Option<Receiver<LaunchEdge>>>,
    attached: Vec<&'static str>,
    multi_links: bool,
    /// To the poll thread: which processes to probe.
    probes: Sender<ProbeRequest>,
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
        quiet_edges: u(8),
        edge_prev_ns: u(9),
        last_edge_ns: u(10),
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
        let (probes, requests) = mpsc::channel();
        let (thread, ([stats, watched, resumed, held], attached, multi_links)) =
            PollThread::spawn("launch-watch", cfg.realtime, move |ready, stop| {
                run(cfg, ready, sink, requests, stop)
            })?;
        Ok(LaunchWatcher {
            thread,
            stats,
            watched,
            resumed,
            held,
            edges: Mutex::new(None),
            attached,
            multi_links,
            probes,
        })
    }

    /// The symbols the probes are attached to (launch entry points, then the waits).
    pub fn attached(&self) -> &[&'static str] {
        &self.attached
    }

    /// Whether each process's probes are one uprobe.multi link per program (Linux 6.6 and later;
    /// removing them waits for 3 grace periods) rather than one link per symbol (34).
    pub fn multi_links(&self) -> bool {
        self.multi_links
    }

    /// How the poll thread is scheduled.
    pub fn scheduling(&self) -> &crate::Scheduling {
        self.thread.scheduling()
    }

    /// Adds a process to the filter and, when filtering, probes it (within the poll period:
    /// this does not wait for the probes, so it never holds up the caller's loop).
    pub fn watch(&self, pid: u32) -> Result<(), WatchError> {
        self.watch_acked(pid).map(drop)
    }

    /// [`LaunchWatcher::watch`], and a receiver that answers once the poll thread has applied
    /// this watch: `Ok` when the process's probes are in (already, for a process probed before
    /// and muted since, without registering anything), the error if attaching failed. Until
    /// then the process's launches are not seen. A disconnected receiver: the thread ended.
    pub fn watch_acked(&self, pid: u32) -> Result<ProbeAck, WatchError> {
        self.watched
            .update(&pid.to_ne_bytes(), &[1u8], MapFlags::ANY)
            .map_err(|e| WatchError::bpf("adding a pid to the filter", e))?;
        let (tx, rx) = mpsc::channel();
        self.probes
            .send(ProbeRequest::Attach(pid, Some(tx)))
            .map_err(|_| WatchError::Thread("the launch-watch thread has ended".into()))?;
        Ok(rx)
    }

    /// Removes a process from the filter (and its counters) but keeps its probes, so that a
    /// later [`LaunchWatcher::watch`] of it is a map update, not another probe registration
    /// (each takes the write lock of every process mapping libcuda: seconds beside busy jobs).
    /// Until then its launches trap into a program that ignores them.
    pub fn mute(&self, pid: u32) {
        let _ = self.watched.delete(&pid.to_ne_bytes());
        let _ = self.stats.delete(&pid.to_ne_bytes());
    }

    /// Removes a process from the filter (and its counters) and its probes.
    pub fn unwatch(&self, pid: u32) {
        let _ = self.watched.delete(&pid.to_ne_bytes());
        let _ = self.stats.delete(&pid.to_ne_bytes());
        let _ = self.probes.send(ProbeRequest::Detach(pid));
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

    /// The gate holds offline frozen since `since_ns` (CLOCK_MONOTONIC; 0: it no longer does).
    /// Until the next [`LaunchWatcher::arm_resume`] after `since_ns`, edges ask nothing of the
    /// reader at once: they are written without waking it (the wake-up is taken inside the
    /// launch call) and reach it within [`LaunchConfig::poll_period`]. Edges after the arm wake
    /// it again, so arm before enabling offline, as [`LaunchWatcher::arm_resume`] says.
    pub fn hold_edges(&self, since_ns: u64) -> Result<(), WatchError> {
        self.held
            .update(&0u32.to_ne_bytes(), &since_ns.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| WatchError::bpf("marking offline held for the edges", e))
    }

    /// [`Self::counts`] read until two readings agree on the latest edge (`None` after three
    /// tries): the program writes an edge's time and the activity before it as two stores,
    /// and a reading between them would pair one edge's time with another's.
    pub fn settled_counts(&self, pid: u32) -> Option<LaunchCounts> {
        let edge = |c: &LaunchCounts| (c.edges, c.edge_prev_ns, c.last_edge_ns);
        let mut last = self.counts(pid);
        for _ in 0..3 {
            let now = self.counts(pid);
            if edge(&now) == edge(&last) {
                return Some(now);
            }
            last = now;
        }
        None
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

type Ready = Result<([MapHandle; 4], Vec<&'static str>, bool), WatchError>;

/// The answer to one [`LaunchWatcher::watch_acked`]: whether the process's probes are in.
pub type ProbeAck = Receiver<Result<(), String>>;

/// Asks the poll thread (which owns the programs) to probe a process (and to say when it has,
/// on the sender) or to stop probing it. Requests are applied in the order sent, so an answer
/// is about the probes in force after every earlier request, a detach of the same pid included.
enum ProbeRequest {
    Attach(u32, Option<Sender<Result<(), String>>>),
    Detach(u32),
}

/// The entry points that resolved in the library at start-up: what each process's probes
/// attach to.
struct Targets {
    library: PathBuf,
    /// Each probed symbol's file offset, read from the library once ([`function_offsets`]).
    offsets: HashMap<&'static str, u64>,
    launches: Vec<(&'static str, u64)>,
    waits: Vec<&'static str>,
    /// One uprobe.multi link per program and process (Linux 6.6 and later) instead of one link
    /// per symbol: removing a process's probes then waits for 3 grace periods, not 34 (about
    /// 110 ms each on Linux 6.18).
    multi: bool,
}

impl Targets {
    /// Attaches every target's program to `pid` (-1: every process mapping the library).
    fn attach(
        &self,
        skel: &skel::LaunchWatchSkel<'_>,
        pid: i32,
    ) -> Result<Vec<libbpf_rs::Link>, libbpf_rs::Error> {
        if self.multi {
            return self.attach_multi(skel, pid, &self.launches, &self.waits);
        }
        let mut links = Vec::new();
        for &(sym, cookie) in &self.launches {
            links.push(self.attach_launch(skel, pid, sym, cookie)?);
        }
        for &sym in &self.waits {
            links.extend(self.attach_wait(skel, pid, sym)?);
        }
        Ok(links)
    }

    /// The launch program on `sym`, with the entry point's kind as its cookie.
    fn attach_launch(
        &self,
        skel: &skel::LaunchWatchSkel<'_>,
        pid: i32,
        sym: &str,
        cookie: u64,
    ) -> Result<libbpf_rs::Link, libbpf_rs::Error> {
        let opts = UprobeOpts {
            cookie,
            ..Default::default()
        };
        let prog = &skel.progs.cuda_launch;
        prog.attach_uprobe_with_opts(pid, &self.library, self.offset(sym), opts)
    }

    /// The wait programs on `sym`: a uprobe at entry and a uretprobe at return.
    fn attach_wait(
        &self,
        skel: &skel::LaunchWatchSkel<'_>,
        pid: i32,
        sym: &str,
    ) -> Result<[libbpf_rs::Link; 2], libbpf_rs::Error> {
        let wait = |retprobe, prog: &libbpf_rs::ProgramMut<'_>| {
            let opts = UprobeOpts {
                retprobe,
                ..Default::default()
            };
            prog.attach_uprobe_with_opts(pid, &self.library, self.offset(sym), opts)
        };
        Ok([
            wait(false, &skel.progs.cuda_sync_enter)?,
            wait(true, &skel.progs.cuda_sync_exit)?,
        ])
    }

    /// `launches` and `waits` of `pid` in at most three uprobe.multi links: the launch program
    /// (each symbol's kind as its cookie), the wait entries and the wait returns.
    fn attach_multi(
        &self,
        skel: &skel::LaunchWatchSkel<'_>,
        pid: i32,
        launches: &[(&'static str, u64)],
        waits: &[&'static str],
    ) -> Result<Vec<libbpf_rs::Link>, libbpf_rs::Error> {
        let multi = |prog: &libbpf_rs::ProgramMut<'_>, syms: Vec<&str>, cookies, retprobe| {
            let opts = UprobeMultiOpts {
                offsets: syms.iter().map(|&s| self.offset(s)).collect(),
                cookies,
                retprobe,
                ..Default::default()
            };
            prog.attach_uprobe_multi_with_opts(pid, &self.library, "", opts)
        };
        let launch_names = launches.iter().map(|&(n, _)| n).collect();
        let cookies = launches.iter().map(|&(_, c)| c).collect();
        let mut links = vec![multi(
            &skel.progs.cuda_launch_multi,
            launch_names,
            cookies,
            false,
        )?];
        if !waits.is_empty() {
            links.push(multi(
                &skel.progs.cuda_sync_enter_multi,
                waits.to_vec(),
                Vec::new(),
                false,
            )?);
            links.push(multi(
                &skel.progs.cuda_sync_exit_multi,
                waits.to_vec(),
                Vec::new(),
                true,
            )?);
        }
        Ok(links)
    }

    /// `sym`'s file offset; every symbol in `launches` and `waits` has one.
    fn offset(&self, sym: &str) -> usize {
        self.offsets.get(sym).map_or(0, |&o| o as usize)
    }

    /// The symbols probed, launches first.
    fn names(&self) -> Vec<&'static str> {
        let launches = self.launches.iter().map(|&(s, _)| s);
        launches.chain(self.waits.iter().copied()).collect()
    }
}

/// Finds which [`LAUNCH_SYMBOLS`] (and, with `waits`, [`SYNC_SYMBOLS`]) `cfg.library` defines
/// (its symbol table, read once) and checks them by attaching to `probe_pid`; returns them with
/// the links made (kept when `probe_pid` is -1, every process). A wait that fails is logged and
/// left out; no launch symbol at all is an error.
fn resolve(
    skel: &skel::LaunchWatchSkel<'_>,
    cfg: &LaunchConfig,
    probe_pid: i32,
    multi: bool,
) -> Result<(Targets, Vec<libbpf_rs::Link>), WatchError> {
    let names: Vec<&'static str> = LAUNCH_SYMBOLS
        .iter()
        .map(|s| s.0)
        .chain(SYNC_SYMBOLS)
        .collect();
    let offsets = function_offsets(&cfg.library, &names)?;
    let mut t = Targets {
        library: cfg.library.clone(),
        offsets,
        launches: Vec::new(),
        waits: Vec::new(),
        multi,
    };
    // Only functions the library defines (a libcuda of another release may lack some).
    let launches: Vec<(&'static str, u64)> = LAUNCH_SYMBOLS
        .into_iter()
        .filter(|s| t.offsets.contains_key(s.0))
        .collect();
    let waits: Vec<&'static str> = SYNC_SYMBOLS
        .into_iter()
        .filter(|s| cfg.track_waits && t.offsets.contains_key(s))
        .collect();
    if multi && !launches.is_empty() {
        match t.attach_multi(skel, probe_pid, &launches, &waits) {
            Ok(links) => {
                (t.launches, t.waits) = (launches, waits);
                return Ok((t, links));
            }
            Err(e) => {
                // A kernel without uprobe.multi links (or one that refuses them): one
                // symbol at a time, and one link per symbol from now on.
                tracing::info!(
                    "launch watch: one link for all symbols failed ({e:#}); one per symbol"
                );
                t.multi = false;
            }
        }
    }
    let (mut links, mut last_err) = (Vec::new(), None);
    for (sym, cookie) in launches {
        match t.attach_launch(skel, probe_pid, sym, cookie) {
            Ok(l) => {
                links.push(l);
                t.launches.push((sym, cookie));
            }
            Err(e) => last_err = Some(e),
        }
    }
    if t.launches.is_empty() {
        return Err(match last_err {
            Some(e) => WatchError::bpf("attaching uprobes to the launch entry points", e),
            None => WatchError::Thread(format!(
                "{} exports none of libcuda's launch entry points: is it libcuda?",
                cfg.library.display()
            )),
        });
    }
    // The waits: optional (a library without them still reports launches).
    for sym in waits {
        match t.attach_wait(skel, probe_pid, sym) {
            Ok(l) => {
                links.extend(l);
                t.waits.push(sym);
            }
            Err(e) => tracing::warn!("launch watch: probing {sym}: {e}"),
        }
    }
    Ok((t, links))
}

/// The probes in force. With a pid filter each watched process has its own, so a process that
/// is not watched runs libcuda without a breakpoint trap per launch (an offline job next to the
/// gate paid about 10% for those); without a filter one set probes every process.
struct Probes {
    targets: Targets,
    everyone: Vec<libbpf_rs::Link>,
    per_pid: HashMap<u32, Vec<libbpf_rs::Link>>,
}

impl Probes {
    fn start(
        skel: &skel::LaunchWatchSkel<'_>,
        cfg: &LaunchConfig,
        multi: bool,
    ) -> Result<Probes, WatchError> {
        let filtered = cfg.filter || !cfg.pids.is_empty();
        // Filtered, the symbols are resolved by probing this process, whose probes go at once.
        let probe_pid = if filtered {
            i32::try_from(std::process::id()).unwrap_or(-1)
        } else {
            -1
        };
        let (targets, links) = resolve(skel, cfg, probe_pid, multi)?;
        let mut probes = Probes {
            targets,
            everyone: if filtered { Vec::new() } else { links },
            per_pid: HashMap::new(),
        };
        for &pid in &cfg.pids {
            probes.attach(skel, pid)?;
        }
        Ok(probes)
    }

    /// Applies one request; an attach's outcome goes to its sender (logged if it failed).
    fn apply(&mut self, skel: &skel::LaunchWatchSkel<'_>, req: ProbeRequest) {
        match req {
            ProbeRequest::Attach(pid, ack) => {
                let done = self.attach(skel, pid);
                if let Err(e) = &done {
                    tracing::warn!("launch watch: {e}");
                }
                if let Some(ack) = ack {
                    // The caller may have stopped asking: nothing to tell then.
                    let _ = ack.send(done.map_err(|e| e.to_string()));
                }
            }
            ProbeRequest::Detach(pid) => {
                self.per_pid.remove(&pid);
            }
        }
    }

    /// Probes `pid`, unless it is probed already (or every process is).
    fn attach(&mut self, skel: &skel::LaunchWatchSkel<'_>, pid: u32) -> Result<(), WatchError> {
        if !self.everyone.is_empty() || self.per_pid.contains_key(&pid) {
            return Ok(());
        }
        let target = i32::try_from(pid)
            .map_err(|_| WatchError::Thread(format!("pid {pid} is out of range for a uprobe")))?;
        let links = self
            .targets
            .attach(skel, target)
            .map_err(|e| WatchError::bpf("attaching uprobes to a watched process", e))?;
        self.per_pid.insert(pid, links);
        Ok(())
    }
}

/// Opens the ring buffer of edges, handing each to `sink`.
fn edge_ring<'a>(
    skel: &'a skel::LaunchWatchSkel<'_>,
    mut sink: impl FnMut(LaunchEdge) + 'a,
) -> Result<libbpf_rs::RingBuffer<'a>, WatchError> {
    let mut rb = RingBufferBuilder::new();
    rb.add(&skel.maps.edges, move |data: &[u8]| {
        if let Some(e) = parse_edge(data) {
            sink(e);
        }
        0
    })
    .map_err(|e| WatchError::bpf("opening the edge ring buffer", e))?;
    rb.build()
        .map_err(|e| WatchError::bpf("opening the edge ring buffer", e))
}

/// An edge record of the ring buffer (`struct launch_edge` of `launch_watch.bpf.c`); `None` if
/// short.
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
        quiet: kind & KIND_QUIET != 0,
    })
}

/// Duplicates the maps the watcher reads from other threads: stats, the pid filter, resume,
/// held.
fn map_handles(skel: &skel::LaunchWatchSkel<'_>) -> Result<[MapHandle; 4], WatchError> {
    let dup = |m, what| MapHandle::try_from(m).map_err(|e| WatchError::bpf(what, e));
    Ok([
        dup(&skel.maps.stats, "duplicating the stats map")?,
        dup(&skel.maps.watched, "duplicating the pid filter map")?,
        dup(&skel.maps.resumed, "duplicating the resume map")?,
        dup(&skel.maps.held, "duplicating the held map")?,
    ])
}

/// Loads the program with `cfg`'s filter and edge gap, and probes what `cfg` asks for: with
/// uprobe.multi links where the kernel has them, else (or where loading them fails, into
/// `fallback`) with one link per symbol.
fn load<'a>(
    storage: &'a mut MaybeUninit<libbpf_rs::OpenObject>,
    fallback: &'a mut MaybeUninit<libbpf_rs::OpenObject>,
    cfg: &LaunchConfig,
) -> Result<(skel::LaunchWatchSkel<'a>, Probes), WatchError> {
    let multi = uprobe_multi_supported();
    let skel = match load_object(storage, cfg, multi) {
        Err(e) if multi => {
            tracing::info!(
                "launch watch: loading the uprobe.multi programs failed ({e:#}); one link per symbol"
            );
            return finish(load_object(fallback, cfg, false)?, cfg, false);
        }
        other => other?,
    };
    finish(skel, cfg, multi)
}

fn finish<'a>(
    skel: skel::LaunchWatchSkel<'a>,
    cfg: &LaunchConfig,
    multi: bool,
) -> Result<(skel::LaunchWatchSkel<'a>, Probes), WatchError> {
    for pid in &cfg.pids {
        skel.maps
            .watched
            .update(&pid.to_ne_bytes(), &[1u8], MapFlags::ANY)
            .map_err(|e| WatchError::bpf("filling the pid filter", e))?;
    }
    let probes = Probes::start(&skel, cfg, multi)?;
    Ok((skel, probes))
}

/// Opens and loads the object; the uprobe.multi programs only with `multi`.
fn load_object<'a>(
    storage: &'a mut MaybeUninit<libbpf_rs::OpenObject>,
    cfg: &LaunchConfig,
    multi: bool,
) -> Result<skel::LaunchWatchSkel<'a>, WatchError> {
    crate::libbpf_log::route_to_tracing();
    let mut open = LaunchWatchSkelBuilder::default()
        .open(storage)
        .map_err(|e| WatchError::bpf("opening the launch-watch BPF object", e))?;
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.filter_pids = u8::from(cfg.filter || !cfg.pids.is_empty());
        ro.edge_gap_ns = cfg.edge_gap.as_nanos() as u64;
    }
    open.progs.cuda_launch_multi.set_autoload(multi);
    open.progs.cuda_sync_enter_multi.set_autoload(multi);
    open.progs.cuda_sync_exit_multi.set_autoload(multi);
    open.load()
        .map_err(|e| WatchError::bpf("loading the launch-watch BPF program", e))
}

/// Whether this kernel has uprobe.multi links (Linux 6.6), unless VALVE_UPROBE_MULTI=0 says
/// not to use them.
fn uprobe_multi_supported() -> bool {
    if std::env::var("VALVE_UPROBE_MULTI").is_ok_and(|v| v == "0") {
        return false;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    kernel_at_least(release.trim(), (6, 6))
}

/// Whether a kernel release string ("6.18.44-fc-v669") is at least `want` (major, minor).
fn kernel_at_least(release: &str, want: (u32, u32)) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|x| x.parse().ok());
    let minor = parts.next().and_then(|x| x.parse().ok());
    matches!((major, minor), (Some(a), Some(b)) if (a, b) >= want)
}

fn run(
    cfg: LaunchConfig,
    ready: SyncSender<Ready>,
    sink: impl FnMut(LaunchEdge) + Send + 'static,
    requests: Receiver<ProbeRequest>,
    stop: Arc<AtomicBool>,
) {
    let (mut storage, mut fallback) = (MaybeUninit::uninit(), MaybeUninit::uninit());
    let (skel, mut probes) = match load(&mut storage, &mut fallback, &cfg) {
        Ok(x) => x,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let started = map_handles(&skel).and_then(|maps| Ok((maps, edge_ring(&skel, sink)?)));
    let (maps, rb) = match started {
        Ok(x) => x,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let names = probes.targets.names();
    let _ = ready.send(Ok((maps, names, probes.targets.multi)));
    while !stop.load(Ordering::Relaxed) {
        let _ = rb.poll(cfg.poll_period);
        // Edges written while offline was held woke nobody: the poll times out over them.
        let _ = rb.consume();
        for req in requests.try_iter() {
            probes.apply(&skel, req);
        }
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
            offset_of!(S, quiet_edges),
            offset_of!(S, edge_prev_ns),
            offset_of!(S, last_edge_ns),
        ];
        // parse_counts reads field i at byte 8 * i.
        assert_eq!(offsets, [0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80]);
        assert_eq!(STATS_SIZE, 88);
        let bytes: Vec<u8> = (1..=11u64).flat_map(u64::to_ne_bytes).collect();
        let c = parse_counts(&bytes);
        assert_eq!(
            (c.kernel_launches, c.last_launch_ns, c.quiet_edges),
            (1, 8, 9)
        );
        assert_eq!((c.edge_prev_ns, c.last_edge_ns), (10, 11));
    }

    #[test]
    fn edges_are_read_where_the_program_writes_them() {
        // struct launch_edge: pid, kind (graph = 2, flags 0x100 after a resume, 0x200 quiet),
        // ts_ns, idle_ns.
        let mut raw = Vec::new();
        raw.extend(42u32.to_ne_bytes());
        raw.extend((2 | KIND_AFTER_RESUME | KIND_QUIET).to_ne_bytes());
        raw.extend(5u64.to_ne_bytes());
        raw.extend(7u64.to_ne_bytes());
        let e = parse_edge(&raw).expect("a whole record");
        assert_eq!(
            (e.pid, e.graph, e.ts_ns, e.idle_ns, e.after_resume, e.quiet),
            (42, true, 5, 7, true, true)
        );
        assert_eq!(parse_edge(&raw[..20]), None);
    }

    #[test]
    fn uprobe_multi_links_need_linux_6_6() {
        assert!(kernel_at_least("6.18.44-fc-v669", (6, 6)));
        assert!(kernel_at_least("6.6.0", (6, 6)));
        assert!(kernel_at_least("7.0-rc1", (6, 6)));
        assert!(!kernel_at_least("6.1.0-28-amd64", (6, 6)), "Debian 12");
        assert!(!kernel_at_least("5.15.0-generic", (6, 6)));
        assert!(!kernel_at_least("", (6, 6)), "unreadable: not assumed");
    }
}
