//! What the gate reports: the status `valvectl gate status` prints, and the latency samples
//! behind its summaries, as the gate thread shares them with the daemon.

use std::collections::BTreeMap;

use serde::Serialize;
use valve::stats::Summary;

use super::input::ProbeHits;

/// What the gate has done, as `valvectl gate status` shows it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GateStatus {
    /// The gate thread is running.
    pub running: bool,
    /// Offline is preempted now.
    pub preempted: bool,
    /// Held preempted by an explicit "busy" signal.
    pub pinned: bool,
    /// Preemptions so far (policy decisions, whether or not offline had channels yet).
    pub preemptions: u64,
    /// Resumes so far.
    pub resumes: u64,
    /// Idle->busy launch edges of online processes received.
    pub edges: u64,
    /// Arrival edges (request data on an online port after idling) received.
    pub arrivals: u64,
    /// Of them, arrivals after online had been idle past the learned cooldown that found
    /// offline frozen already: the hold (`--hold-budget`) caught them.
    pub arrivals_held: u64,
    /// Online processes watched.
    pub online_pids: Vec<u32>,
    /// Whether each online process's probes are in: the gate sees its launches only once they
    /// are "attached" (attaching one takes seconds beside busy libcuda users).
    pub online_probes: BTreeMap<u32, ProbeState>,
    /// Every online process's probes are attached.
    pub online_probes_attached: bool,
    /// Online ports whose request arrivals preempt.
    pub online_ports: Vec<u16>,
    /// Offline processes gated.
    pub offline_pids: Vec<u32>,
    /// Their channels, over all GPUs.
    pub offline_channels: usize,
    /// GPUs they use.
    pub offline_gpus: usize,
    /// The cooldown in force now (the hold included).
    pub cooldown_us: f64,
    /// The part of it that holds offline for arrivals likely soon (`--hold-budget`; 0 without).
    pub hold_us: f64,
    /// The share of online's idle time the hold may cost (`--hold-budget`).
    pub hold_budget_pct: Option<f64>,
    /// The gaps between requests the hold was chosen over.
    pub hold_gaps: usize,
    /// How long an arrival holds offline while no launch follows it.
    pub arrival_hold_us: f64,
    /// How the offline GPUs are issued: "serial", "parallel", or "serial (calibrating)".
    pub issue: String,
    /// How the threads an edge crosses are scheduled: the gate thread, then each watcher's poll
    /// thread ("gate SCHED_FIFO 10, launch-watch SCHED_FIFO 10, ...").
    pub scheduling: String,
    /// Every one of those threads preempts a busy CPU when woken (`SCHED_FIFO`, or a short
    /// slice where that was refused); false: an edge can wait for a CPU's slice.
    pub fast_wakeups: bool,
    /// The trace's latest sequence number (`valvectl gate trace --since`).
    pub trace_head: u64,
    /// Total time offline spent preempted by the gate.
    pub preempted_s: f64,
    /// Disable calls (all GPUs at once), wall time.
    pub disable_us: Summary,
    /// Enable calls, wall time.
    pub enable_us: Summary,
    /// From the online launch (uprobe timestamp) to the disable call's start.
    pub reaction_us: Summary,
    /// From the online launch to the disable call's return (the offline GPUs are stopped).
    pub edge_to_disable_us: Summary,
    /// From the request's arrival (BPF timestamp) to the disable call's return.
    pub arrival_to_disable_us: Summary,
    /// The online processes' probed calls so far (of the processes watched now; read at most
    /// every 100 ms).
    pub online_probe_hits: ProbeHits,
    /// Failed disables/enables (each is retried process by process).
    pub errors: u64,
    /// The latest failure.
    pub last_error: Option<String>,
}

/// Where an online process's probes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeState {
    /// Asked for, not applied yet: the process's launches are not seen.
    Attaching,
    /// In: its launches are seen.
    Attached,
    /// Attaching them failed (the gate's `last_error` says why): its launches are not seen.
    Failed,
}

#[derive(Clone, Default)]
pub(super) struct Samples {
    pub(super) disable: Vec<f64>,
    pub(super) enable: Vec<f64>,
    pub(super) reaction: Vec<f64>,
    pub(super) edge_to_disable: Vec<f64>,
    pub(super) arrival_to_disable: Vec<f64>,
}

/// Samples kept per series; older ones are dropped (status then covers the latest ones). Small
/// enough that copying them out for a status holds the lock for microseconds.
const MAX_SAMPLES: usize = 10_000;

pub(super) fn push(v: &mut Vec<f64>, x: f64) {
    if v.len() >= MAX_SAMPLES {
        v.drain(..MAX_SAMPLES / 2);
    }
    v.push(x);
}

/// The status and samples the gate thread shares with the daemon.
#[derive(Default)]
pub(super) struct SharedStatus {
    pub(super) status: GateStatus,
    pub(super) samples: Samples,
}
