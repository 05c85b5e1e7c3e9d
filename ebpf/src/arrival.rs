//! Request arrival detection: a BPF program on the `sock:sk_data_ready` tracepoint sees request
//! data become readable on the online service's listening port, before the service launches work.
//!
//! It only observes (a tracepoint cannot drop or hold a packet). [`ArrivalWatcher`] loads it,
//! watches ports, and hands out idle->busy [`ArrivalEdge`]s; [`ArrivalWatcher::program_stats`]
//! reads the kernel's run-time statistics of the program (its cost per readable event).

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, Program, RingBufferBuilder};

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
    include!(concat!(env!("OUT_DIR"), "/arrival_watch.skel.rs"));
}
use skel::ArrivalWatchSkelBuilder;

/// Size of `struct arrival_edge` in the BPF program.
const RAW_EDGE_SIZE: usize = 24;
/// Size of `struct port_state` in the BPF program.
const PORT_STATE_SIZE: usize = 32;

/// How to start an [`ArrivalWatcher`].
#[derive(Clone, Debug)]
pub struct ArrivalConfig {
    /// Ports to watch from the start (more with [`ArrivalWatcher::watch_port`]).
    pub ports: Vec<WatchedPort>,
    /// An arrival this long after the port's previous one is an idle->busy edge.
    pub edge_gap: Duration,
    /// Run the poll thread under `SCHED_FIFO` at this priority ([`crate::realtime`]).
    pub realtime: Option<u8>,
}

impl Default for ArrivalConfig {
    fn default() -> Self {
        ArrivalConfig {
            ports: Vec::new(),
            edge_gap: Duration::from_micros(200),
            realtime: None,
        }
    }
}

/// A local TCP port whose inbound data counts as online request arrivals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WatchedPort {
    /// The port (host byte order).
    pub port: u16,
    /// Only sockets in the network namespace with this inode number (`/proc/PID/ns/net`);
    /// 0: the port in every namespace.
    pub netns: u32,
}

/// Arrival counters of one port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArrivalCounts {
    /// Readable-data events on the port's connections.
    pub arrivals: u64,
    /// Idle->busy edges among them.
    pub edges: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of the latest arrival; 0: none.
    pub last_ns: u64,
}

/// The first arrival on a watched port after at least the edge gap without one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArrivalEdge {
    /// The local port.
    pub port: u16,
    /// The network namespace (inode number) of the socket.
    pub netns: u32,
    /// When (CLOCK_MONOTONIC ns).
    pub ts_ns: u64,
    /// Since the port's previous arrival (0 for the first one seen).
    pub idle_ns: u64,
    /// When the watcher's thread read it from the ring buffer (CLOCK_MONOTONIC ns), if the
    /// sink stamps it; 0 otherwise. `read_ns - ts_ns` is the first hop to the gate.
    pub read_ns: u64,
}

/// What the kernel counted for the program while statistics were on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgramStats {
    /// Runs (one per readable event on any socket of the machine).
    pub run_cnt: u64,
    /// Total time inside the program.
    pub run_time_ns: u64,
}

/// Turns on the kernel's BPF run-time statistics while it is alive (`BPF_ENABLE_STATS`), so
/// [`ArrivalWatcher::program_stats`] counts. Costs two clock reads per program run.
pub struct StatsGuard(#[allow(dead_code)] OwnedFd);

/// Enables BPF run-time statistics until the guard is dropped.
pub fn enable_run_time_stats() -> std::io::Result<StatsGuard> {
    // SAFETY: bpf_enable_stats takes an enum by value and returns a new fd or a negative errno;
    // no pointers are passed.
    let fd = unsafe {
        libbpf_rs::libbpf_sys::bpf_enable_stats(libbpf_rs::libbpf_sys::BPF_STATS_RUN_TIME)
    };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: the fd was just returned to us by the kernel and is owned by nobody else.
    Ok(StatsGuard(unsafe {
        <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd)
    }))
}

/// The attached program; detaches on drop.
pub struct ArrivalWatcher {
    /// Dropped first: stops the polling thread, which detaches the program.
    thread: PollThread,
    ports: MapHandle,
    program_id: u32,
    edges: Mutex<Option<Receiver<ArrivalEdge>>>,
}

fn parse_edge(data: &[u8]) -> Option<ArrivalEdge> {
    if data.len() < RAW_EDGE_SIZE {
        return None;
    }
    let u64_at = |i: usize| u64::from_ne_bytes(data[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_ne_bytes(data[i..i + 4].try_into().expect("4 bytes"));
    Some(ArrivalEdge {
        ts_ns: u64_at(0),
        idle_ns: u64_at(8),
        port: u32_at(16) as u16,
        netns: u32_at(20),
        read_ns: 0,
    })
}

fn port_value(enabled: bool, netns: u32) -> [u8; PORT_STATE_SIZE] {
    let mut v = [0u8; PORT_STATE_SIZE];
    v[0..4].copy_from_slice(&u32::from(enabled).to_ne_bytes());
    v[4..8].copy_from_slice(&netns.to_ne_bytes());
    v
}

impl ArrivalWatcher {
    /// Loads and attaches the program; edges are read with [`ArrivalWatcher::next_edge`].
    pub fn start(cfg: ArrivalConfig) -> Result<ArrivalWatcher, WatchError> {
        let (tx, rx) = mpsc::channel();
        let mut w = Self::start_with(cfg, move |e| {
            let _ = tx.send(e);
        })?;
        w.edges = Mutex::new(Some(rx));
        Ok(w)
    }

    /// Like [`ArrivalWatcher::start`], but every edge goes to `sink` on the watcher's thread as
    /// soon as the ring buffer delivers it.
    pub fn start_with(
        cfg: ArrivalConfig,
        sink: impl FnMut(ArrivalEdge) + Send + 'static,
    ) -> Result<ArrivalWatcher, WatchError> {
        let (thread, (ports, program_id)) =
            PollThread::spawn("arrival-watch", cfg.realtime, move |ready, stop| {
                run(cfg, ready, sink, stop)
            })?;
        Ok(ArrivalWatcher {
            thread,
            ports,
            program_id,
            edges: Mutex::new(None),
        })
    }

    /// How the poll thread is scheduled.
    pub fn scheduling(&self) -> &crate::Scheduling {
        self.thread.scheduling()
    }

    /// Starts counting arrivals on `p` (its counters start from zero).
    pub fn watch_port(&self, p: WatchedPort) -> Result<(), WatchError> {
        self.ports
            .update(
                &u32::from(p.port).to_ne_bytes(),
                &port_value(true, p.netns),
                MapFlags::ANY,
            )
            .map_err(|e| WatchError::bpf("adding a port to the arrival filter", e))
    }

    /// Stops counting arrivals on `port` (and clears its counters).
    pub fn unwatch_port(&self, port: u16) {
        let _ = self.ports.update(
            &u32::from(port).to_ne_bytes(),
            &port_value(false, 0),
            MapFlags::ANY,
        );
    }

    /// Arrival counters of `port` (zero if it is not watched or saw nothing). One map lookup
    /// (a system call, no wake-up): a thread that spins on it sees an edge within microseconds
    /// of the data becoming readable, without the ring buffer's hop through the poll thread.
    pub fn counts(&self, port: u16) -> ArrivalCounts {
        match self
            .ports
            .lookup(&u32::from(port).to_ne_bytes(), MapFlags::ANY)
        {
            Ok(Some(v)) if v.len() >= PORT_STATE_SIZE => {
                let u = |i: usize| u64::from_ne_bytes(v[i..i + 8].try_into().expect("8 bytes"));
                ArrivalCounts {
                    last_ns: u(8),
                    arrivals: u(16),
                    edges: u(24),
                }
            }
            _ => ArrivalCounts::default(),
        }
    }

    /// The next edge, waiting up to `timeout` (always `None` when edges go to a sink).
    pub fn next_edge(&self, timeout: Duration) -> Option<ArrivalEdge> {
        let rx = self.edges.lock().unwrap_or_else(PoisonError::into_inner);
        rx.as_ref()?.recv_timeout(timeout).ok()
    }

    /// The kernel id of the attached program (`bpftool prog show id N`).
    pub fn program_id(&self) -> u32 {
        self.program_id
    }

    /// The kernel's run count and run time of the program (both zero unless statistics are on:
    /// [`enable_run_time_stats`] or `sysctl kernel.bpf_stats_enabled=1`).
    pub fn program_stats(&self) -> ProgramStats {
        libbpf_rs::query::ProgInfoIter::default()
            .find(|p| p.id == self.program_id)
            .map(|p| ProgramStats {
                run_cnt: p.run_cnt,
                run_time_ns: p.run_time_ns,
            })
            .unwrap_or_default()
    }
}

type Ready = Result<(MapHandle, u32), WatchError>;

fn run(
    cfg: ArrivalConfig,
    ready: SyncSender<Ready>,
    mut sink: impl FnMut(ArrivalEdge) + Send + 'static,
    stop: Arc<AtomicBool>,
) {
    let mut storage = MaybeUninit::uninit();
    let setup = || -> Result<_, WatchError> {
        crate::libbpf_log::route_to_tracing();
        let mut open = ArrivalWatchSkelBuilder::default()
            .open(&mut storage)
            .map_err(|e| WatchError::bpf("opening the arrival-watch BPF object", e))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.edge_gap_ns = cfg.edge_gap.as_nanos() as u64;
        }
        let mut skel = open
            .load()
            .map_err(|e| WatchError::bpf("loading the arrival-watch BPF program", e))?;
        for p in &cfg.ports {
            skel.maps
                .ports
                .update(
                    &u32::from(p.port).to_ne_bytes(),
                    &port_value(true, p.netns),
                    MapFlags::ANY,
                )
                .map_err(|e| WatchError::bpf("filling the port filter", e))?;
        }
        skel.attach()
            .map_err(|e| WatchError::bpf("attaching to tp_btf/sk_data_ready", e))?;
        let program_id = Program::id_from_fd(skel.progs.arrival.as_fd())
            .map_err(|e| WatchError::bpf("querying the program id", e))?;
        let ports = MapHandle::try_from(&skel.maps.ports)
            .map_err(|e| WatchError::bpf("duplicating the port map", e))?;
        let mut rb = RingBufferBuilder::new();
        rb.add(&skel.maps.edges, move |data: &[u8]| {
            if let Some(e) = parse_edge(data) {
                sink(e);
            }
            0
        })
        .map_err(|e| WatchError::bpf("opening the arrival ring buffer", e))?;
        let rb = rb
            .build()
            .map_err(|e| WatchError::bpf("opening the arrival ring buffer", e))?;
        Ok((skel, rb, ports, program_id))
    };
    let (_skel, rb, ports, program_id) = match setup() {
        Ok(x) => x,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok((ports, program_id)));
    while !stop.load(Ordering::Relaxed) {
        let _ = rb.poll(Duration::from_millis(50));
    }
    let _ = rb.consume();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edges_and_port_values_have_the_programs_layout() {
        let mut raw = [0u8; RAW_EDGE_SIZE];
        raw[0..8].copy_from_slice(&5u64.to_ne_bytes());
        raw[8..16].copy_from_slice(&7u64.to_ne_bytes());
        raw[16..20].copy_from_slice(&8000u32.to_ne_bytes());
        raw[20..24].copy_from_slice(&4026531840u32.to_ne_bytes());
        assert_eq!(
            parse_edge(&raw),
            Some(ArrivalEdge {
                port: 8000,
                netns: 4026531840,
                ts_ns: 5,
                idle_ns: 7,
                read_ns: 0,
            })
        );
        assert_eq!(parse_edge(&raw[..20]), None);
        let v = port_value(true, 9);
        assert_eq!((v[0], v[4]), (1, 9));
        assert!(v[8..].iter().all(|&b| b == 0), "counters start at zero");
    }
}
